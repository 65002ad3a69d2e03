"""Hand-written programs from the seeds, differentially tested against JAX.

Every example of seed 000 (the shard_map design doc: matmuls, f1..f5, the
closure/tile examples) and seed 004 (efficient transposes: Examples 1-5 and
the data-parallel loss) is written *once*, against a small namespace of ops
(:class:`JaxOps` / :class:`ShmapOps`), and run through ``jax.shard_map`` and
``shmap.shard_map``.  For each case we check, via differential.assert_matches_jax,
outputs, first and second order gradients and the collectives of the backward
pass; then we also assert

* the output the seed document states (e.g. ``matmul_basic(a, b) == a @ b``,
  ``f3(x).shape == (12, 6)``), computed here with numpy from the doc's words;
* the absolute backward communication the seeds derive (e.g. Example 1's
  transpose performs no collective; Example 5's is exactly one psum_scatter;
  the DP loss needs exactly one psum per replicated parameter).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as JP

import shmap
from differential import assert_close, assert_matches_jax, tensors
from jax_helpers import count_collectives, jax_mesh


# ----------------------------------------------------------------------------
# One spelling per backend, so each program is written exactly once.
# ----------------------------------------------------------------------------
class JaxOps:
    psum, pmean = staticmethod(jax.lax.psum), staticmethod(jax.lax.pmean)
    all_gather, psum_scatter = staticmethod(jax.lax.all_gather), staticmethod(jax.lax.psum_scatter)
    sin, tanh = staticmethod(jnp.sin), staticmethod(jnp.tanh)

    @staticmethod
    def all_gather_invariant(x, axis_name, **kw):
        return jax.lax.all_gather(x, axis_name, to="invarying", **kw)

    @staticmethod
    def sum(x, axis=None):
        return jnp.sum(x, axis=axis)

    @staticmethod
    def mean(x):
        return jnp.mean(x)


class ShmapOps:
    psum, pmean = staticmethod(shmap.psum), staticmethod(shmap.pmean)
    all_gather, psum_scatter = staticmethod(shmap.all_gather), staticmethod(shmap.psum_scatter)
    all_gather_invariant = staticmethod(shmap.all_gather_invariant)
    sin, tanh = staticmethod(torch.sin), staticmethod(torch.tanh)

    @staticmethod
    def sum(x, axis=None):
        return x.sum() if axis is None else x.sum(axis)

    @staticmethod
    def mean(x):
        return x.mean()


@dataclass
class Case:
    """A shard_map program: ``body(ops)`` returns the per-device function."""
    name: str
    mesh: tuple  # (shape, names)
    body: Callable
    in_specs: tuple  # of jax PartitionSpecs (converted for shmap)
    out_specs: object  # a PartitionSpec or a tuple of them
    shapes: list  # global input shapes
    backward: dict  # the backward collectives the seed derives
    expected: Callable | None = None  # numpy: inputs -> output the seed states
    make_inputs: Callable | None = None  # default: standard normal of `shapes`
    second_order: bool = True
    notes: str = field(default="", repr=False)


def to_shmap_spec(spec):
    if isinstance(spec, JP):
        return shmap.P(*spec)
    return tuple(to_shmap_spec(s) for s in spec)


def build(case: Case):
    shape, names = case.mesh
    f_jax = jax.shard_map(case.body(JaxOps), mesh=jax_mesh(shape, names),
                          in_specs=case.in_specs, out_specs=case.out_specs, check_vma=True)
    f_shmap = shmap.shard_map(case.body(ShmapOps), mesh=shmap.make_mesh(shape, names),
                              in_specs=to_shmap_spec(case.in_specs),
                              out_specs=to_shmap_spec(case.out_specs), check_vma=True)
    return f_jax, f_shmap


def g(o, x):
    """A nonlinear local function (so second-order gradients are not trivial)."""
    return o.sin(x) * x


IJ, I8, BATCH = ((4, 2), ("i", "j")), ((8,), ("i",)), ((8,), ("batch",))
arange = lambda *shape: np.arange(float(np.prod(shape))).reshape(shape)  # noqa: E731


def block_sum(x, axis, n):
    """Sum of the n equal blocks of x along axis (what a psum over n devices sees)."""
    return sum(np.split(x, n, axis=axis))


def dp_loss(o):
    """Seed 004's data-parallel loss: replicated params, batch-sharded data."""
    def loss(w, b, inputs, targets):
        predictions = o.tanh(inputs @ w + b)
        local_loss = o.mean(o.sum((predictions - targets) ** 2, -1))
        return o.pmean(local_loss, "batch")
    return loss


CASES = [
    # -- seed 000 -------------------------------------------------------------
    Case("matmul_basic", IJ, lambda o: lambda a, b: o.psum(a @ b, "j"),
         (JP("i", "j"), JP("j", None)), JP("i", None), [(8, 16), (16, 32)],
         backward={"psum": 1},  # b is invariant along i: its pvary transposes to psum('i')
         expected=lambda a, b: a @ b, make_inputs=lambda: [arange(8, 16), arange(16, 32)]),
    Case("matmul_basic_random", IJ, lambda o: lambda a, b: o.psum(a @ b, "j"),
         (JP("i", "j"), JP("j", None)), JP("i", None), [(8, 16), (16, 32)],
         backward={"psum": 1}, expected=lambda a, b: a @ b),
    Case("matmul_reduce_scatter", IJ,
         lambda o: lambda a, b: o.psum_scatter(a @ b, "j", scatter_dimension=1, tiled=True),
         (JP("i", "j"), JP("j", None)), JP("i", "j"), [(8, 16), (16, 32)],
         backward={"all_gather": 1, "psum": 1}, expected=lambda a, b: a @ b),
    # f1: the unmentioned input axis j is a tile; naming j in out_specs tiles the
    # output, so the backward must sum the cotangent's j-blocks: one psum.
    Case("f1", IJ, lambda o: lambda x: x, (JP("i", None),), JP("i", "j"), [(12, 12)],
         backward={"psum": 1}, expected=lambda x: np.tile(x, (1, 2)),
         make_inputs=lambda: [arange(12, 12)]),
    Case("f2", IJ, lambda o: lambda x: x, (JP("i", "j"),), JP("i", "j"), [(12, 24)],
         backward={}, expected=lambda x: x,
         make_inputs=lambda: [np.tile(arange(12, 12), (1, 2))]),  # f1(x) == f2(tile(x))
    Case("f3", IJ, lambda o: lambda x: o.psum(x, "j"), (JP("i", "j"),), JP("i", None),
         [(12, 12)], backward={}, expected=lambda x: block_sum(x, 1, 2)),  # (12, 6)
    Case("f4", IJ, lambda o: lambda x: o.psum(x, "i"), (JP("i", "j"),), JP(None, "j"),
         [(12, 12)], backward={}, expected=lambda x: block_sum(x, 0, 4)),  # (3, 12)
    Case("f5", IJ, lambda o: lambda x: o.psum(x, ("i", "j")), (JP("i", "j"),), JP(None, None),
         [(12, 12)], backward={},
         expected=lambda x: block_sum(block_sum(x, 0, 4), 1, 2)),  # (3, 6)
    # -- seed 004 -------------------------------------------------------------
    Case("ex1_psum_to_unmapped", I8, lambda o: lambda x: o.psum(o.sum(g(o, x)), "i"),
         (JP("i"),), JP(), [(24, 4)],
         backward={},  # psum transposes to pvary: no communication
         expected=lambda x: np.sum(np.sin(x) * x)),
    Case("ex2_psum_times_mapped", I8, lambda o: lambda x, y: o.psum(g(o, x), "i") * y,
         (JP("i"), JP("i")), JP("i"), [(24, 4), (24, 4)],
         backward={"psum": 1},  # the auto-pvary of psum(g(x)) transposes to psum
         expected=lambda x, y: np.tile(block_sum(np.sin(x) * x, 0, 8), (8, 1)) * y),
    Case("ex3_cursed_identity", I8, lambda o: lambda x: x, (JP(),), JP(), [(8, 3)],
         backward={}, expected=lambda x: x),
    Case("ex4_all_gather_invariant_to_unmapped", I8,
         lambda o: lambda x: o.all_gather_invariant(x, "i", tiled=True), (JP("i"),), JP(),
         [(8,)], backward={},  # transposes to slicing the own block
         expected=lambda x: x),
    Case("ex5_all_gather_times_mapped", I8,
         lambda o: lambda x, y: o.all_gather(x, "i", tiled=True) * y,
         (JP("i"), JP("i")), JP("i"), [(8,), (64,)],
         backward={"psum_scatter": 1}, expected=lambda x, y: np.tile(x, 8) * y),
    Case("dp_loss", BATCH, dp_loss, (JP(), JP(), JP("batch"), JP("batch")), JP(),
         [(4, 3), (3,), (16, 4), (16, 3)],
         backward={"psum": 2},  # exactly one psum per replicated parameter (w, b)
         expected=lambda w, b, inputs, t: np.mean(np.sum((np.tanh(inputs @ w + b) - t) ** 2, -1))),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_seed_example_matches_jax(case):
    f_jax, f_shmap = build(case)
    rng = np.random.default_rng(0)
    args = case.make_inputs() if case.make_inputs else [rng.standard_normal(s) for s in case.shapes]
    if case.expected is not None:  # what the seed document says the program computes
        assert_close(f_shmap(*tensors(args)), case.expected(*args), f"{case.name} vs the seed")
    backward = assert_matches_jax(f_jax, f_shmap, args, second_order=case.second_order,
                                  context=case.name)
    assert backward == Counter(case.backward), f"{case.name}: jax backward {dict(backward)}"


# -- closures: the seed's tile examples -----------------------------------------
@pytest.mark.parametrize("spec,reps,backward", [
    (JP("i", "j"), (4, 2), {"psum": 1}),
    (JP("i", None), (4, 1), {"psum": 1}),
    (JP(None, None), (1, 1), {}),
])
def test_closure_output_is_a_tile(spec, reps, backward):
    """``shard_map(lambda: x, in_specs=(), out_specs=spec)()`` == ``tile(x, reps)``;
    a closed-over array is an invariant input, and its gradient sums the tiles."""
    x = np.array([[3.0]]) + np.random.default_rng(1).standard_normal((1, 1))
    m_jax, m_shmap = jax_mesh(*IJ), shmap.make_mesh(*IJ)

    def f_jax(x):
        return jax.shard_map(lambda: x, mesh=m_jax, in_specs=(), out_specs=spec)()

    def f_shmap(x):
        return shmap.shard_map(lambda: x, mesh=m_shmap, in_specs=(),
                               out_specs=to_shmap_spec(spec))()

    assert_close(f_shmap(*tensors([x])), np.tile(x, reps), f"closure {spec} vs the seed")
    got = assert_matches_jax(f_jax, f_shmap, [x], context=f"closure out_specs={spec}")
    assert got == Counter(backward)



@pytest.mark.parametrize("name", ["psum", "all_gather", "axis_index", "ppermute", "tile"])
def test_a_closure_without_checks_is_an_unmapped_argument(name):
    """check_vma=False: JAX passes a closed-over array in as an argument, so its cotangent is psum'd (the
    defensive transpose).  A closure that met a collective or the output before any varying value was an
    invariant plain tensor: on processes each rank kept its own share of the gradient (4x too small),
    and comm_log missed the psum on both meshes."""
    w = np.array([0.1, 0.2, 0.3])
    bodies = {  # (ops namespace, w) -> output; out_spec
        "psum": (lambda o, w: o.psum(o.sin(w), "i"), JP()),
        "all_gather": (lambda o, w: o.all_gather(o.sin(w), "i", tiled=True), JP()),
        "axis_index": (lambda o, w: o.sin(w) * o.axis_index("i"), JP("i")),
        "ppermute": (lambda o, w: o.ppermute(o.sin(w), "i", [(0, 1), (1, 2), (2, 3)]), JP("i")),
        "tile": (lambda o, w: o.sin(w), JP("i")),
    }
    body, spec = bodies[name]
    m_jax, m_shmap = jax_mesh((4,), ("i",)), shmap.make_mesh((4,), ("i",))

    def f_jax(w):
        return jax.shard_map(lambda: body(_JAX_CLOSURE_OPS, w), mesh=m_jax, in_specs=(), out_specs=spec,
                             check_vma=False)()

    def f_shmap(w):
        return shmap.shard_map(lambda: body(_SHMAP_CLOSURE_OPS, w), mesh=m_shmap, in_specs=(),
                               out_specs=to_shmap_spec(spec), check_vma=False)()

    got = assert_matches_jax(f_jax, f_shmap, [w], context=f"check_vma=False closure, {name}")
    assert got["psum"] >= 1  # (the closure's)


class _JAX_CLOSURE_OPS:
    sin, psum, all_gather = staticmethod(jnp.sin), staticmethod(jax.lax.psum), staticmethod(jax.lax.all_gather)
    axis_index, ppermute = staticmethod(jax.lax.axis_index), staticmethod(jax.lax.ppermute)


class _SHMAP_CLOSURE_OPS:
    sin, psum, all_gather = staticmethod(torch.sin), staticmethod(shmap.psum), staticmethod(shmap.all_gather)
    axis_index, ppermute = staticmethod(shmap.axis_index), staticmethod(shmap.ppermute)

# -- seed 004 Example 3: transposing the cursed identity again and again -----------
def jax_transpose(f, example):
    t = jax.linear_transpose(f, example)
    return lambda c: t(c)[0]


def torch_transpose(f, example):
    """The transpose of a linear torch function, by (double) backward."""
    def ft(c):
        x = torch.zeros_like(example, requires_grad=True)
        (ct,) = torch.autograd.grad(f(x), x, c, create_graph=True)
        return ct
    return ft


@pytest.mark.parametrize("times", [1, 2, 3])
def test_cursed_identity_transposes_stay_identity_without_communication(times):
    """t(shard_map(x -> x, P(), P())) must stay the identity, with no psum, no
    matter how often it is transposed (JAX without vma typing grows a psum and
    a division by 8 per transpose)."""
    x = np.random.default_rng(2).standard_normal((8, 3))
    f_jax = jax.shard_map(lambda v: v, mesh=jax_mesh(*I8), in_specs=JP(), out_specs=JP())
    f_shmap = shmap.shard_map(lambda v: v, mesh=shmap.make_mesh(*I8), in_specs=shmap.P(),
                              out_specs=shmap.P())
    (xt,) = tensors([x])
    for _ in range(times):
        f_jax, f_shmap = jax_transpose(f_jax, x), torch_transpose(f_shmap, xt)
    assert count_collectives(jax.make_jaxpr(f_jax)(x)) == Counter()
    np.testing.assert_allclose(np.asarray(f_jax(x)), x, rtol=0, atol=0)

    with shmap.comm_log() as log:
        y = f_shmap(xt.clone().requires_grad_(True))
    assert log.count() == 0, f"{times}x transposed identity communicated: {log}"
    assert_close(y, x, f"identity transposed {times}x")


# -- seed 004: all_gather (varying result) cannot be an unmapped output ----------
@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather_to_unmapped_output_is_a_type_error(tiled):
    """With check_vma, all_gather's result varies along i (it has a pvary
    fused in), so out_specs=P() must be rejected, as JAX rejects it; the fix
    is all_gather_invariant (Example 4) or out_specs=P('i')."""
    x = np.arange(8.0)
    with pytest.raises(ValueError):
        jax.shard_map(lambda v: jax.lax.all_gather(v, "i", tiled=tiled), mesh=jax_mesh(*I8),
                      in_specs=JP("i"), out_specs=JP())(x)
    f = shmap.shard_map(lambda v: shmap.all_gather(v, "i", tiled=tiled),
                        mesh=shmap.make_mesh(*I8), in_specs=shmap.P("i"), out_specs=shmap.P())
    with pytest.raises(shmap.VmaError, match="'i'"):
        f(torch.tensor(x))
