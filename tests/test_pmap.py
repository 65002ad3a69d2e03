"""shmap.pmap against jax.pmap, and nested pmap (seed 003).

Single-level programs are written once against an ops namespace and run
through `jax.pmap` and `shmap.pmap`: outputs and first- and second-order
gradients must equal jax.pmap's.  The backward collectives are compared with
JAX's *typed* equivalent, `jax.shard_map(check_vma=True)` over a one-axis mesh
with untiled specs: jax.pmap itself runs its shard_map with check_vma=False
and so transposes defensively (a psum's cotangent is psum'd again), which is
exactly the communication shmap's pmap avoids.

Nested pmap has no working JAX oracle (JAX 0.10.2 raises "The context mesh ...
should match the mesh passed to shard_map"); it is checked against the seed's
worked numbers, against one 2-D shard_map running the same collectives (on
generated cases), and against nested `jax.vmap` with axis names, which is the
semantics nested pmap had in JAX.
"""
from __future__ import annotations

import random
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as JP

import shmap
from differential import assert_close, assert_matches_jax, jax_gradients, shmap_gradients, tensors
from jax_helpers import jax_mesh
from shmap import P


# ----------------------------------------------------------------------------
# One spelling per backend
# ----------------------------------------------------------------------------
class J:
    psum, pmean, pmax = staticmethod(jax.lax.psum), staticmethod(jax.lax.pmean), staticmethod(jax.lax.pmax)
    all_gather, ppermute = staticmethod(jax.lax.all_gather), staticmethod(jax.lax.ppermute)
    psum_scatter, axis_index = staticmethod(jax.lax.psum_scatter), staticmethod(jax.lax.axis_index)
    sin, tanh, exp = staticmethod(jnp.sin), staticmethod(jnp.tanh), staticmethod(jnp.exp)

    @staticmethod
    def sum(x, axis=None):
        return jnp.sum(x, axis=axis)


class S:
    psum, pmean, pmax = staticmethod(shmap.psum), staticmethod(shmap.pmean), staticmethod(shmap.pmax)
    all_gather, ppermute = staticmethod(shmap.all_gather), staticmethod(shmap.ppermute)
    psum_scatter, axis_index = staticmethod(shmap.psum_scatter), staticmethod(shmap.axis_index)
    sin, tanh, exp = staticmethod(torch.sin), staticmethod(torch.tanh), staticmethod(torch.exp)

    @staticmethod
    def sum(x, axis=None):
        return x.sum() if axis is None else x.sum(axis)


def jax_typed_pmap(f, name, n, in_axes, out_axes, shapes):
    """jax.pmap's program as a typed jax.shard_map (check_vma=True), for backward collective counts."""
    mesh = jax_mesh((n,), (name,))
    ranks = [len(s) for s in shapes]
    in_ax = [None if a is None else a % r for a, r in zip(in_axes, ranks)]

    def body(*xs):
        xs = [x if a is None else jnp.squeeze(x, a) for x, a in zip(xs, in_ax)]
        out = f(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        res = tuple(o if a is None else jnp.expand_dims(o, a % (o.ndim + 1))
                    for o, a in zip(outs, out_axes))
        return res if isinstance(out, tuple) else res[0]

    def spec(a, rank):
        return JP() if a is None else JP(*([None] * (a % rank)), name)

    in_specs = tuple(spec(a, r) for a, r in zip(in_ax, ranks))
    probe = jax.eval_shape(jax.vmap(f, in_axes=tuple(in_ax), axis_name=name),
                           *[jax.ShapeDtypeStruct(s, jnp.float64) for s in shapes])
    outs = probe if isinstance(probe, tuple) else (probe,)  # each with the mapped dim in front
    out_specs = tuple(spec(a, o.ndim) for o, a in zip(outs, out_axes))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs if isinstance(probe, tuple) else out_specs[0], check_vma=True)


# ----------------------------------------------------------------------------
# Single-level programs: (name, body(ops), in_axes, out_axes, global shapes)
# ----------------------------------------------------------------------------
def _dp_loss(o):
    def f(x, w, t):
        return o.pmean(o.sum((o.tanh(x @ w) - t) ** 2), "i")
    return f


def _psum_mul(o):
    return lambda x, w: o.psum(x * w, "i")


def _gather_ring(o):
    def f(x):
        n = 4
        y = o.ppermute(o.sin(x), "i", [(k, (k + 1) % n) for k in range(n)])
        return o.all_gather(y * x, "i") + 1.0
    return f


def _index_scale(o):
    return lambda x: x * (o.axis_index("i") + 1.0) + o.psum(x * x, "i")


def _two_outputs(o):
    def f(x, w):
        y = o.exp(x) * w
        return o.psum(y, "i"), y
    return f


def _scatter(o):
    return lambda x: o.psum_scatter(x * x, "i", scatter_dimension=0, tiled=True)


CASES = [
    ("dp_loss", _dp_loss, (0, None, 0), (None,), [(4, 3, 5), (5, 2), (4, 3, 2)]),
    ("psum_mul", _psum_mul, (0, None), (0,), [(4, 3), (3,)]),
    ("psum_mul_out1", _psum_mul, (1, None), (1,), [(3, 4), (3,)]),
    ("gather_ring", _gather_ring, (0,), (0,), [(4, 2)]),
    # jax.pmap 0.10.2 mishandles negative axes (in_axes=-1 splits the wrong dimension, out_axes=-1
    # returns shape (16, 2, 1) for (2, 4)); this case is checked against the typed program only.
    ("gather_ring_neg", _gather_ring, (-1,), (-1,), [(2, 4)]),
    ("index_scale", _index_scale, (0,), (2,), [(4, 2, 3)]),
    ("two_outputs", _two_outputs, (0, 0), (None, 1), [(4, 3), (4, 3)]),
    ("scatter", _scatter, (0,), (0,), [(4, 8)]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pmap_matches_jax_pmap(case):
    name, body, in_axes, out_axes, shapes = case
    rng = np.random.default_rng(len(name))
    args = [rng.standard_normal(s) for s in shapes]
    n = next(s[a] for s, a in zip(shapes, in_axes) if a is not None)
    oa = out_axes if len(out_axes) > 1 else out_axes[0]
    f_jax = jax.pmap(body(J), axis_name="i", in_axes=in_axes, out_axes=oa)
    f_sh = shmap.pmap(body(S), axis_name="i", in_axes=in_axes, out_axes=oa)
    # Outputs, gradients (1st and 2nd order) and backward collectives against JAX's typed program ...
    typed = jax_typed_pmap(body(J), "i", n, in_axes, out_axes, shapes)
    assert_matches_jax(typed, f_sh, args, context=name)
    # ... and outputs and gradients against jax.pmap itself.
    if any(a is not None and a < 0 for a in in_axes + out_axes):
        return
    want = jax.jit(f_jax)(*args)
    got = f_sh(*tensors(args))
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert_close(g, w, f"{name}: output vs jax.pmap")
    outs = want if isinstance(want, tuple) else (want,)
    cots = [np.random.default_rng(1).standard_normal(np.shape(w)) for w in outs]
    jg1, jg2 = jax_gradients(f_jax, args, cots, True)
    sg1, sg2, _ = shmap_gradients(f_sh, args, cots, True)
    for k, (a, b) in enumerate(zip(sg1, jg1)):
        assert_close(a, b, f"{name}: d/d input {k} vs jax.pmap")
    for k, (a, b) in enumerate(zip(sg2, jg2)):
        assert_close(a, b, f"{name}: 2nd order d/d input {k} vs jax.pmap")


def test_typed_backward_is_cheaper_than_jax_pmap():
    """jax.pmap's defensive transpose psums the cotangent of a psum; the typed one does not."""
    from jax_helpers import backward_collectives

    x, w = np.ones((4, 3)), np.ones(3)
    f_jax = jax.pmap(_psum_mul(J), axis_name="i", in_axes=(0, None), out_axes=None)
    assert backward_collectives(f_jax, (x, w), np.ones(3)) == Counter(psum=2)
    f_sh = shmap.pmap(_psum_mul(S), axis_name="i", in_axes=(0, None), out_axes=None)
    xs = tensors([x, w], requires_grad=True)
    y = f_sh(*xs)
    with shmap.comm_log() as log:
        y.sum().backward()
    assert log.summary() == {"psum": 1}  # only w's gradient is summed


def test_pytree_in_axes_kwargs_and_static_args():
    x, y, z = np.arange(12.).reshape(4, 3), np.arange(6.).reshape(3, 2), np.arange(8.).reshape(4, 2)

    def body(o):
        def f(d, scale, *, k):
            return {"a": o.psum(d["x"] @ d["y"], "i") * scale, "b": d["x"] + k.sum()}
        return f

    f_jax = jax.pmap(body(J), axis_name="i", in_axes=({"x": 0, "y": None}, None),
                     out_axes={"a": None, "b": 1}, static_broadcasted_argnums=(1,))
    f_sh = shmap.pmap(body(S), axis_name="i", in_axes=({"x": 0, "y": None}, None),
                      out_axes={"a": None, "b": 1}, static_broadcasted_argnums=(1,))
    want = f_jax({"x": x, "y": y}, 2.0, k=z)
    xt, yt, zt = tensors([x, y, z])
    got = f_sh({"x": xt, "y": yt}, 2.0, k=zt)
    assert set(got) == {"a", "b"}
    assert_close(got["a"], want["a"], "a")
    assert_close(got["b"], want["b"], "b")
    # The static argument reaches the body as the Python value itself.
    seen = []
    shmap.pmap(lambda v, s: seen.append(s) or v, "i", static_broadcasted_argnums=1)(xt, ("tag", 3))
    assert seen == [("tag", 3)]


def test_pmap_under_torch_compile_is_one_graph():
    """A pmap call is one node of Dynamo's graph, as a shard_mapped call is (compile.py): fullgraph=True
    with dicts in and out, a keyword argument, a static argument and a nested pmap; values,
    gradients and comm_log equal eager's."""
    import torch._dynamo.testing

    def body(d, scale, *, k):
        inner = shmap.pmap(lambda r: shmap.psum(r, "j") * scale, "j")(d["x"])  # nested over dim 1
        return {"a": shmap.pmean(inner.sum(-1), "i"), "b": d["x"] * k}

    f = shmap.pmap(body, "i", in_axes=({"x": 0}, None), out_axes={"a": None, "b": 0},
                   static_broadcasted_argnums=(1,))
    x, k = torch.randn(4, 2, 3, dtype=torch.float64), torch.randn(4, 1, 1, dtype=torch.float64)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    cf = torch.compile(f, fullgraph=True, backend=counter)

    def run(fn):
        xx = x.clone().requires_grad_()
        with shmap.comm_log() as log:
            out = fn({"x": xx}, 2.0, k=k)
            (gx,) = torch.autograd.grad(out["a"].sum() + (out["b"] ** 2).sum(), xx)
        return out, gx, log.events

    want, got = run(f), run(cf)
    assert type(got[0]) is dict and list(got[0]) == ["a", "b"]
    for a, b in zip([got[0]["a"], got[0]["b"], got[1]], [want[0]["a"], want[0]["b"], want[1]]):
        torch.testing.assert_close(a, b)
    assert got[2] == want[2]
    assert counter.frame_count == 1


def test_decorator_forms_and_anonymous_axis():
    @shmap.pmap
    def double(x):
        return 2 * x

    @shmap.pmap(axis_name="i")
    def total(x):
        return shmap.psum(x, "i")

    x = torch.arange(6.).reshape(3, 2)
    assert torch.equal(double(x), 2 * x)
    assert torch.equal(total(x), x.sum(0).expand(3, 2))
    # axis_size maps nothing: every device gets the broadcast value.
    got = shmap.pmap(lambda v: v + shmap.axis_index("i"), "i", in_axes=None, axis_size=3)(torch.zeros(2))
    assert torch.equal(got, torch.arange(3.)[:, None].expand(3, 2))


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------
def test_error_mapped_sizes_differ():
    f = shmap.pmap(lambda a, b: a + b, "i")
    with pytest.raises(ValueError, match=r"(?s)different sizes.*args\[0\]: axis 0 has size 4.*args\[1\]: axis 0 has size 3"):
        f(torch.ones(4, 2), torch.ones(3, 2))
    with pytest.raises(ValueError, match="axis_size=5"):
        shmap.pmap(lambda a: a, "i", axis_size=5)(torch.ones(4))


def test_error_out_axes_none_on_varying_output():
    f = shmap.pmap(lambda a: a * 2, "i", out_axes=None)
    with pytest.raises(shmap.VmaError, match=r"out_axes=None.*varies along the mapped axis .i.*shmap.psum\(y, .i.\).*out_axes=0"):
        f(torch.ones(4))


def test_error_rank_static_and_no_mapped_axis():
    with pytest.raises(ValueError, match=r"args\[0\] is mapped along axis 2, but it has rank 2"):
        shmap.pmap(lambda a: a, "i", in_axes=2)(torch.ones(4, 2))
    with pytest.raises(ValueError, match="not hashable"):
        shmap.pmap(lambda a, s: a, "i", static_broadcasted_argnums=1)(torch.ones(4), [1])
    with pytest.raises(ValueError, match="axis_size=N"):
        shmap.pmap(lambda a: a, "i", in_axes=None)(torch.ones(4))
    with pytest.raises(ValueError, match="in_axes is a tuple of 1 entries but the call passes 2"):
        shmap.pmap(lambda a, b: a, "i", in_axes=(0,))(torch.ones(4), torch.ones(4))
    # True is not an axis (it mapped axis 1, silently); JAX refuses it too.
    with pytest.raises(TypeError, match=r"in_axes must be an int, None, or a tuple .* got bool True"):
        shmap.pmap(lambda a: a, "i", in_axes=True)(torch.ones(4, 2))
    with pytest.raises(TypeError, match=r"in_axes entries must be ints or None, got True for args\[0\]"):
        shmap.pmap(lambda a: a, "i", in_axes=(True,))(torch.ones(4, 2))


def test_error_bad_out_axes_outputs_devices_and_empty_axis():
    """Each crashed in pmap or torch (a str compared with an int, unsqueeze of a float dim, a size-0 mesh)."""
    x = torch.ones(4, 3)
    for out_axes, leaf in [("0", 0), (1.0, 0), ((0, "x"), 1)]:
        with pytest.raises(TypeError, match=rf"out_axes entries must be ints or None, got .* for output leaf {leaf}"):
            shmap.pmap(lambda a: (a, a), "i", out_axes=out_axes)(x)
    with pytest.raises(TypeError, match=r"output leaf 0 is a str; pmap outputs are tensors or numbers"):
        shmap.pmap(lambda a: "s", "i")(x)
    with pytest.raises(TypeError, match=r"devices must be a sequence of 4 devices"):
        shmap.pmap(lambda a: a, "i", devices=3)(x)
    with pytest.raises(ValueError, match=r"args\[0\] is mapped along axis 0, which has size 0"):
        shmap.pmap(lambda a: a, "i")(torch.zeros(0, 2))
    import numpy as np

    with pytest.raises(ValueError, match=r"is a ndarray, not a torch.Tensor \(convert it: torch.as_tensor"):
        shmap.pmap(lambda a: a, "i")(np.ones((4, 2)))


def test_error_inner_axis_shadows_outer():
    inner = shmap.pmap(lambda a: shmap.psum(a, "i"), "i")
    outer = shmap.pmap(lambda a: inner(a), "i")
    with pytest.raises(shmap.SpecError, match=r"axis_name 'i' is already bound.*Fix: rename"):
        outer(torch.ones(2, 2))


def test_error_in_place_update_of_an_argument_names_pmap():
    with pytest.raises(shmap.InPlaceInputError, match=r"argument 0 .* of pmap\(<lambda>\)"):
        shmap.pmap(lambda a: a.add_(1), "p")(torch.ones(2, 3))


def test_error_shard_map_in_a_pmap_body():
    """A shard_map cannot nest in a pmap (pmap's mesh is its own): passing or closing over a pmap body's
    value names that and the fix, not "use the same mesh", which the user cannot do."""
    mesh = shmap.make_mesh((2,), ("j",))

    def passes(a):
        return shmap.shard_map(lambda t: shmap.psum(t, "j"), mesh=mesh, in_specs=P("j"), out_specs=P())(a)

    def closes(a):
        return shmap.shard_map(lambda t: shmap.psum(t + a.sum(), "j"), mesh=mesh, in_specs=P("j"),
                               out_specs=P())(torch.ones(4))

    fix = r"a shard_map cannot nest in a pmap.*Fix: nest a pmap.*axis_names="
    with pytest.raises(shmap.SpecError, match=r"in_specs\[0\]: got a value of a running pmap body: " + fix):
        shmap.pmap(passes, "p")(torch.randn(4, 6))
    with pytest.raises(shmap.VmaError, match=r"a shard_map body uses a value of a running pmap body: " + fix):
        shmap.pmap(closes, "p")(torch.randn(4, 6))


# ----------------------------------------------------------------------------
# Nested pmap: seed 003
# ----------------------------------------------------------------------------
@shmap.pmap(axis_name="model")
def inner_op(x_model_shard, params_model_shard):
    return shmap.psum(x_model_shard * params_model_shard, axis_name="model") * 2


@shmap.pmap(axis_name="data")
def outer_op(x_data_shard, params_data_shard):
    result = inner_op(x_data_shard, params_data_shard)
    return shmap.psum(result, axis_name="data")


def test_seed003_large_example():
    data = torch.arange(16.).reshape(2, 2, 2, 2)
    params = torch.ones(16).reshape(2, 2, 2, 2) * 0.5
    out = outer_op(data, params)
    assert out.shape == (2, 2, 2, 2)
    # inner psum over 'model' within each data instance, then psum over 'data', on every device.
    inner = 2 * (data * params).sum(1)                       # [data, f1, f2]
    want = inner.sum(0).expand(2, 2, 2, 2)
    assert torch.equal(out, want)
    assert torch.equal(out[0, 0], torch.tensor([[24., 28.], [32., 36.]]))


def test_seed003_small_example():
    """The seed's device-by-device walk-through: devices 0,1 hold 1.0 and devices 2,3 hold 5.0 after the
    inner pmap (the 'model' psum stays within one data instance); the seed's total over all four devices
    of the outer pmap is 12.0, on every device."""
    data = torch.arange(4.).reshape(2, 2)
    params = torch.ones(4).reshape(2, 2) * 0.5

    per_device = shmap.pmap(lambda x, p: inner_op(x, p), "data")(data, params)
    assert torch.equal(per_device, torch.tensor([[1., 1.], [5., 5.]]))

    # The seed's "psum over all devices of the outer call": both axes, from inside the inner call.
    @shmap.pmap(axis_name="model")
    def inner_all(x, p):
        r = shmap.psum(x * p, "model") * 2
        return shmap.psum(r, ("data", "model"))

    out = shmap.pmap(lambda x, p: inner_all(x, p), "data")(data, params)
    assert torch.equal(out, torch.full((2, 2), 12.0))
    # The seed's program as written: psum over 'data' is elementwise over the model entries (as one 2-D
    # shard_map, and as nested pmap was in JAX): 1 + 5 on every device.
    assert torch.equal(outer_op(data, params), torch.full((2, 2), 6.0))


def test_seed003_collectives_are_scoped():
    data = torch.arange(4.).reshape(2, 2)
    with shmap.comm_log() as log:
        outer_op(data, torch.ones(2, 2))
    assert [(e.kind, e.axes) for e in log.events] == [("psum", ("model",)), ("psum", ("data",))]


def _as_2d_shard_map(x, p):
    """The seed's nested program as one shard_map over the 2x2 mesh (untiled specs).  The inner pmap
    returns a value invariant along 'model' into a mapped output, which (as in JAX) is a `pvary`: its
    transpose is a psum over 'model' in the backward pass, so the flat program has it too."""
    mesh = shmap.make_mesh((2, 2), ("data", "model"))

    def body(x, p):
        r = shmap.pvary(shmap.psum(x[0, 0] * p[0, 0], "model") * 2, "model")
        return shmap.psum(r, "data")[None, None]

    return shmap.shard_map(body, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model"))(x, p)


def test_seed003_gradients_equal_2d_shard_map():
    data = torch.randn(2, 2, 3, dtype=torch.float64)
    params = torch.randn(2, 2, 3, dtype=torch.float64)
    cot = torch.randn(2, 2, 3, dtype=torch.float64)
    grads, logs = [], []
    for f in (outer_op, _as_2d_shard_map):
        x, p = data.clone().requires_grad_(), params.clone().requires_grad_()
        with shmap.comm_log() as fwd:
            y = f(x, p)
        with shmap.comm_log() as bwd:
            g = torch.autograd.grad((y * cot).sum(), (x, p), create_graph=True)
        g2 = torch.autograd.grad(sum((a ** 2).sum() for a in g), (x, p))
        grads.append((y, g, g2))
        logs.append((fwd.summary(), bwd.summary()))
    (y1, g1, h1), (y2, g2, h2) = grads
    torch.testing.assert_close(y1, y2)
    for a, b in zip(g1 + h1, g2 + h2):
        torch.testing.assert_close(a, b)
    assert logs[0] == logs[1]


# ----------------------------------------------------------------------------
# Nested pmap == one shard_map over the product mesh, on generated cases
# ----------------------------------------------------------------------------
_INNER_OPS = ["sin", "mul_w", "psum_b", "psum_a", "psum_ab", "pmean_a", "gather_b", "perm_a", "index_b"]
# Only 'a' is bound in the outer body.  No `mul_w` there: an outer-body op mixing the stacked inner
# results with a value invariant along 'b' sums its gradient over the stacked dimension locally,
# where the flat program needs a psum over 'b' (nested pmap then communicates less, not the same).
_OUTER_OPS = ["sin", "psum_a", "pmean_a", "perm_a", "index_a"]


def _run_steps(steps, x, w):
    for s in steps:
        if s == "sin":
            x = torch.sin(x)
        elif s == "mul_w":
            x = x * w
        elif s in ("psum_a", "psum_b"):
            x = shmap.psum(x, s[-1])
        elif s == "psum_ab":
            x = shmap.psum(x, ("a", "b"))
        elif s == "pmean_a":
            x = shmap.pmean(x, "a")
        elif s == "gather_b":
            x = shmap.all_gather(x, "b", tiled=True)[: x.shape[0]]
        elif s == "perm_a":
            n = shmap.axis_size("a")
            x = shmap.ppermute(x, "a", [(k, (k + 1) % n) for k in range(n)])
        elif s in ("index_a", "index_b"):
            x = x + shmap.axis_index(s[-1])
    return x


@pytest.mark.parametrize("seed", range(40))
def test_nested_pmap_equals_2d_shard_map(seed):
    """Random bodies: `pre` inside the inner pmap (both axes bound), `post` in the outer body after it
    returns (on the stacked inner results); the flat program runs both per device, with the inner
    call's boundary (a `pvary` over 'b' of an output invariant along it) in between."""
    rng = random.Random(seed)
    na, nb, f = rng.choice([1, 2, 3]), rng.choice([1, 2, 4]), rng.choice([1, 2])
    pre = [rng.choice(_INNER_OPS) for _ in range(rng.randint(1, 4))]
    post = [rng.choice(_OUTER_OPS) for _ in range(rng.randint(0, 3))]
    x = torch.randn(na, nb, f, dtype=torch.float64)
    w = torch.randn(f, dtype=torch.float64)

    def nested(x, w):
        def outer(xa):
            return _run_steps(post, shmap.pmap(lambda xb: _run_steps(pre, xb, w), "b")(xa), w)
        return shmap.pmap(outer, "a")(x)

    def flat(x, w):
        mesh = shmap.make_mesh((na, nb), ("a", "b"))
        def body(xb, w):
            return _run_steps(post, shmap.pvary(_run_steps(pre, xb[0, 0], w), "b"), w)[None, None]

        return shmap.shard_map(body,
                               mesh=mesh, in_specs=(P("a", "b"), P()), out_specs=P("a", "b"))(x, w)

    results = []
    for fn in (nested, flat):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        with shmap.comm_log() as fwd:
            y = fn(xx, ww)
        cot = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        with shmap.comm_log() as bwd:
            g = torch.autograd.grad((y * cot).sum(), (xx, ww), allow_unused=True)
        results.append((y, g, fwd.summary(), bwd.summary()))
    a, b = results
    torch.testing.assert_close(a[0], b[0])
    for ga, gb in zip(a[1], b[1]):
        if ga is None or gb is None:
            assert (ga is None or not ga.any()) and (gb is None or not gb.any())
        else:
            torch.testing.assert_close(ga, gb)
    assert a[2:] == b[2:], (pre, post, a[2:], b[2:])


def test_nested_pmap_matches_nested_vmap():
    """JAX's nested-pmap semantics, as nested vmap with axis names (JAX's own nested pmap is broken)."""
    def body(o, p):
        def inner(x, w):
            return o.psum(o.sin(x) * w, "model") + o.pmean(x, "data")

        def outer(x, w):
            return p(inner, "model")(x, w) * 2

        return p(outer, "data")

    def jvmap(f, name):
        return jax.vmap(f, axis_name=name, in_axes=(0, None))

    def spmap(f, name):
        return shmap.pmap(f, name, in_axes=(0, None))

    rng = np.random.default_rng(3)
    args = [rng.standard_normal((3, 2, 4)), rng.standard_normal(4)]
    f_jax, f_sh = body(J, jvmap), body(S, spmap)
    assert_close(f_sh(*tensors(args)), jax.jit(f_jax)(*args), "nested pmap vs nested vmap")
    cots = [rng.standard_normal((3, 2, 4))]
    jg1, jg2 = jax_gradients(f_jax, args, cots, True)
    sg1, sg2, _ = shmap_gradients(f_sh, args, cots, True)
    for a, b in zip(sg1 + sg2, list(jg1) + list(jg2)):
        assert_close(a, b, "gradients vs nested vmap")


def test_devices_argument_and_pmap_inside_shard_map():
    x = torch.arange(6.).reshape(3, 2)
    assert torch.equal(shmap.pmap(lambda v: v + 1, "i", devices="cpu")(x), x + 1)
    assert torch.equal(shmap.pmap(lambda v: v + 1, "i", devices=[0, 1, 2])(x), x + 1)
    with pytest.raises(ValueError, match="devices lists 2 devices but the mapped axis has size 3"):
        shmap.pmap(lambda v: v, "i", devices=[0, 1])(x)
    # A pmap inside a shard_map body extends its mesh by one axis, scoped to the call.
    mesh = shmap.make_mesh((2,), ("i",))

    def body(blk):                                      # blk: [1, 3, 2] on each of 2 devices
        y = shmap.pmap(lambda r: shmap.psum(r, ("i", "j")), "j")(blk[0])
        return y[None]

    got = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.ones(2, 3, 2))
    assert torch.equal(got, torch.full((2, 3, 2), 6.0))


def test_compiled_pmap_follows_a_python_value_its_body_reads():
    """The body's closed-over number was frozen at the first trace (compile.python_state)."""
    scale = 2.0
    f = torch.compile(shmap.pmap(lambda v: v * scale, "i"), backend="aot_eager")
    x = torch.ones(4, 2)
    assert torch.equal(f(x), x * 2)
    scale = 3.0
    assert torch.equal(f(x), x * 3)


def test_prefix_and_unbound_axis_messages_name_structures_and_pmap_not_the_data():
    """A mismatched in_axes / out_axes names the structures (it printed every device's values); an axis a
    nested pmap does not bind is named in pmap's terms, the anonymous outer axis not by its internal name."""
    x = torch.randn(4, 3)
    with pytest.raises(ValueError) as e:
        shmap.pmap(lambda a: (a, a), "i", out_axes=(0,))(x)
    msg = str(e.value)
    assert "got (0,), but the function returned (*, *): tuple arity mismatch; expected: 1, got: 2. Fix:" in msg
    assert "device (i=0)" not in msg
    with pytest.raises(ValueError, match=r"got \[0, 0, 0\], but the argument is \[\*, \*\]: list arity mismatch"):
        shmap.pmap(lambda a: a[0], "i", in_axes=([0, 0, 0],))([x, torch.randn(4)])
    with pytest.raises(shmap.UnboundAxisError) as e:
        shmap.pmap(lambda a: shmap.pmap(lambda p: shmap.psum(p, "i"), "j")(a))(torch.randn(2, 2))
    msg = str(e.value)
    assert "the enclosing pmap binds ('j',) (and an anonymous pmap axis: give that pmap axis_name=" in msg
    assert "_pmap" not in msg and "shard_map" not in msg
