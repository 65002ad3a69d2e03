"""Collectives keep JAX's dtype semantics on the simulated mesh, for every dtype.

Integer sums keep their dtype and wrap (as JAX and torch.distributed do), a
boolean psum counts in int32 (JAX's `psum` converts booleans to int32 first),
pmax/pmin of booleans are any/all, and complex numbers have no order.  JAX is
the oracle wherever it supports the dtype; tests/distributed/test_dist_dtypes.py
checks that the distributed mesh gives exactly these results too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as JP

import shmap
from shmap import P
from jax_helpers import jax_mesh

DTYPES = [torch.int8, torch.int32, torch.int64, torch.bool, torch.bfloat16, torch.float16, torch.complex64]
N = 4
PERM = [(0, 1), (1, 2), (2, 3)]  # device 0 receives nothing: zeros (False for booleans)


def sample(dtype, shape, seed=0):
    """Values whose sums wrap in int8 and are exact in 16-bit floats (so every mesh must agree bitwise)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    v = torch.randint(-100, 100, shape, generator=g)
    if dtype.is_complex:
        return torch.complex(v.float(), torch.randint(-100, 100, shape, generator=g).float()).to(dtype)
    if dtype.is_floating_point:
        return (v % 64 - 32).to(dtype)
    return v.to(dtype)


def to_jax(t):
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy(), dtype=jnp.bfloat16)
    return jnp.asarray(t.numpy())


def from_jax(a):
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(a.copy())


# name -> (shmap body, jax body, out_spec entries); input: global (8, 4) split P('i'), blocks (2, 4)
def _ops():
    lax = jax.lax
    return {
        "psum": (lambda x: shmap.psum(x, "i"), lambda x: lax.psum(x, "i"), ()),
        "pmean": (lambda x: shmap.pmean(x, "i"), lambda x: lax.pmean(x, "i"), ()),
        "pmax": (lambda x: shmap.pmax(x, "i"), lambda x: lax.pmax(x, "i"), ()),
        "pmin": (lambda x: shmap.pmin(x, "i"), lambda x: lax.pmin(x, "i"), ()),
        "psum_scatter": (lambda x: shmap.psum_scatter(x, "i", scatter_dimension=1, tiled=True),
                         lambda x: lax.psum_scatter(x, "i", scatter_dimension=1, tiled=True), (None, "i")),
        "all_gather": (lambda x: shmap.all_gather(x, "i", tiled=True),
                       lambda x: lax.all_gather(x, "i", tiled=True), ("i",)),
        "all_gather_invariant": (lambda x: shmap.all_gather_invariant(x, "i"),
                                 lambda x: lax.all_gather(x, "i", to="invarying"), ()),
        "ppermute": (lambda x: shmap.ppermute(x, "i", PERM), lambda x: lax.ppermute(x, "i", PERM), ("i",)),
        "pshuffle": (lambda x: shmap.pshuffle(x, "i", [3, 0, 1, 2]),
                     lambda x: lax.ppermute(x, "i", [(s, d) for d, s in enumerate([3, 0, 1, 2])]), ("i",)),
        "all_to_all": (lambda x: shmap.all_to_all(x, "i", 1, 0, tiled=True),
                       lambda x: lax.all_to_all(x, "i", 1, 0, tiled=True), ("i",)),
    }


OPS = _ops()


def jax_supports(name, dtype):
    if dtype == torch.bool and name == "psum_scatter":
        return False  # JAX: "add does not accept dtype bool"; shmap counts, as its psum
    if dtype.is_complex and name in ("pmax", "pmin"):
        return False  # no order; both raise (test_complex_pmax_pmin_raise)
    return True


def run_shmap(names, x, mesh=None):
    mesh = mesh or shmap.make_mesh((N,), ("i",))
    body = lambda x: tuple(OPS[n][0](x) for n in names)  # noqa: E731
    outs = tuple(P(*OPS[n][2]) for n in names)
    return shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=outs)(x)


def run_jax(names, x):
    body = lambda x: tuple(OPS[n][1](x) for n in names)  # noqa: E731
    outs = tuple(JP(*OPS[n][2]) for n in names)
    res = jax.shard_map(body, mesh=jax_mesh((N,), ("i",)), in_specs=JP("i"), out_specs=outs)(to_jax(x))
    return tuple(from_jax(r) for r in res)


def expected_dtype(name, dtype):
    """JAX's result dtype, except pmean of integers: torch's default float (JAX's under x64 is float64
    for int64; without x64 it is float32 for every integer type, as here)."""
    if dtype == torch.bool and name in ("psum", "psum_scatter"):
        return torch.int32
    if name == "pmean" and not (dtype.is_floating_point or dtype.is_complex):
        return torch.get_default_dtype()
    return dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_collective_matches_jax(dtype):
    x = sample(dtype, (8, 4))
    names = [n for n in OPS if jax_supports(n, dtype)]
    got = run_shmap(names, x)
    want = run_jax(names, x)
    for name, g, w in zip(names, got, want):
        assert g.dtype == expected_dtype(name, dtype), (name, g.dtype)
        if name == "pmean":
            w = w.to(g.dtype)
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name} {dtype}:\n{g}\nJAX:\n{w}"


def test_int8_psum_keeps_its_dtype_and_wraps():
    x = torch.full((4, 2), 50, dtype=torch.int8)
    mesh = shmap.make_mesh((N,), ("i",))
    out = shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x)
    assert out.dtype == torch.int8 and out.tolist() == [[-56, -56]]  # 200 - 256
    # an invariant operand is pvary'd first: 4 * x, wrapping too (JAX: [-112, 4])
    inv = shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=mesh, in_specs=P(), out_specs=P())(
        torch.tensor([100, 1], dtype=torch.int8))
    assert inv.dtype == torch.int8 and inv.tolist() == [-112, 4]
    # psum_scatter and an unreduced output's sum wrap the same way
    f = shmap.shard_map(lambda x: (shmap.psum_scatter(x, "i", scatter_dimension=1, tiled=True),
                                   shmap.pcast(x, "i", to="unreduced")),
                        mesh=mesh, in_specs=P("i"), out_specs=(P(None, "i"), P(unreduced={"i"})))
    rs, pending = f(torch.full((4, 4), 50, dtype=torch.int8))
    assert rs.dtype == torch.int8 and rs.tolist() == [[-56] * 4]
    assert pending.dtype == torch.int8 and pending.tolist() == [[-56] * 4]


def test_bool_psum_counts_in_int32_as_jax():
    """JAX 0.10: lax.psum converts booleans to int32 and sums (x64 or not): [4, 2], int32."""
    x = torch.tensor([True, True, True, True, True, False, True, False])
    mesh = shmap.make_mesh((N,), ("i",))
    f = shmap.shard_map(lambda x: (shmap.psum(x, "i"), shmap.pmean(x, "i"),
                                   shmap.psum_scatter(torch.cat([x, x]), "i", tiled=True)),
                        mesh=mesh, in_specs=P("i"), out_specs=(P(), P(), P("i")))
    total, mean, scattered = f(x)
    assert total.dtype == torch.int32 and total.tolist() == [4, 2]
    assert mean.dtype == torch.get_default_dtype() and mean.tolist() == [1.0, 0.5]  # JAX: float32
    assert scattered.dtype == torch.int32 and scattered.tolist() == [4, 2, 4, 2]
    assert run_jax(["psum"], x)[0].tolist() == [4, 2] and run_jax(["psum"], x)[0].dtype == torch.int32


def test_bool_pmax_pmin_are_any_and_all():
    x = torch.tensor([True, False, False, False, True, False, True, False])  # blocks [T,F] [F,F] [T,F] [T,F]
    hi, lo = run_shmap(["pmax", "pmin"], x.reshape(8, 1).expand(8, 4).contiguous())
    assert hi.dtype == lo.dtype == torch.bool
    assert hi[:, 0].tolist() == [True, False] and lo[:, 0].tolist() == [False, False]


@pytest.mark.parametrize("kind", ["pmax", "pmin"])
def test_complex_pmax_pmin_raise(kind):
    with pytest.raises(shmap.CollectiveArgumentError, match=rf"{kind} over 'i'.*complex64.*no order.*Fix:.*abs"):
        run_shmap([kind], sample(torch.complex64, (8, 4)))


@pytest.mark.parametrize("kind, dtype", [  # (complex pmax/pmin: no order at all, test_complex_pmax_pmin_raise)
    (k, d) for k in ("psum", "pmean", "pmax", "pmin", "psum_scatter")
    for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32) if not (d.is_complex and k in ("pmax", "pmin"))
], ids=str)
def test_dtypes_torch_cannot_reduce_raise_clearly(kind, dtype):
    """torch's own errors differed between the meshes ("sum_cpu" not implemented; gloo's invalid scalar type).
    Moving such a value (all_gather) still works."""
    x = torch.zeros(8, 4).to(dtype)
    api = "psum" if kind == "pmean" else kind
    with pytest.raises(shmap.CollectiveArgumentError, match=rf"{api} over 'i': the operand is .* which torch can "
                                                            rf"move but not reduce .* Fix: .*\.to\(x\.dtype\)"):
        run_shmap([kind], x)
    out = shmap.shard_map(lambda v: shmap.all_gather_invariant(v, "i", tiled=True), mesh=shmap.make_mesh((N,), ("i",)),
                          in_specs=P("i"), out_specs=P())(x)
    assert out.dtype == dtype and out.shape == (8, 4)


def test_non_tensor_operands_and_axis_names_are_clear_errors():
    """Operands torch cannot convert named neither the collective nor the argument; axis_size's fix
    showed an operand it does not take."""
    mesh = shmap.make_mesh((N,), ("i",))
    for bad in ("abc", object()):
        with pytest.raises(TypeError, match=r"psum: the operand must be a tensor or a number, got"):
            shmap.shard_map(lambda v: shmap.psum(bad, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(torch.ones(8))
    for bad in (None, "abc", [[1, 2], [3]]):
        with pytest.raises(TypeError, match=r"device_put: x must be a tensor or a number"):
            shmap.device_put(bad, mesh, P())
    # (as JAX's, psum takes a pytree: None is an empty one, and a nested list of numbers one of numbers)
    seen = {}

    def body(v):
        seen["none"], seen["nested"] = shmap.psum(None, "i"), shmap.psum([[1, 2], [3]], "i")
        return v

    shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.ones(8))
    assert seen["none"] is None
    assert [[int(t) for t in row] for row in seen["nested"]] == [[N, 2 * N], [3 * N]]
    with pytest.raises(TypeError, match=r"Fix: e\.g\. axis_size\('i'\)"):
        shmap.shard_map(lambda v: v * shmap.axis_size(0), mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.ones(8))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.bfloat16], ids=str)
def test_tuple_axes_and_untiled_collectives(dtype):
    """A (j, i) tuple on a 2x2 mesh: the same dtype rules when the devices are linearised."""
    x = sample(dtype, (8, 4), seed=3)
    mesh = shmap.make_mesh((2, 2), ("i", "j"))

    def body(x):
        return (shmap.psum(x, ("j", "i")), shmap.all_gather(x, ("j", "i")),
                shmap.all_to_all(x, ("j", "i"), 1, 0, tiled=True))

    s, g, a = shmap.shard_map(body, mesh=mesh, in_specs=P(("i", "j")), out_specs=(P(), P(("i", "j")), P(("j", "i"))))(x)
    blocks = x.reshape(4, 2, 4)
    if dtype == torch.bool:
        want = blocks.to(torch.int32).sum(0, dtype=torch.int32)
    elif dtype.is_floating_point:
        want = blocks.float().sum(0).to(dtype)
    else:
        want = blocks.sum(0, dtype=dtype)
    assert s.dtype == want.dtype and torch.equal(s, want)
    assert g.dtype == dtype and torch.equal(g.reshape(4, 4, 2, 4)[0], blocks[[0, 2, 1, 3]])
    assert a.dtype == dtype


def test_collective_flags_and_dims_take_bools_and_integer_scalars():
    """tiled='no' tiled; a numpy integer axis was refused (make_mesh takes them); pshuffle(perm=None) raised
    "'NoneType' object is not iterable"."""
    import numpy as np

    mesh = shmap.make_mesh((N,), ("i",))

    def run(body, out=P()):
        return shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=out)(torch.arange(8.0).reshape(8, 1))

    for bad in ("no", None, 1):
        with pytest.raises(TypeError, match=r"all_gather_invariant: tiled must be True or False"):
            run(lambda v: shmap.all_gather_invariant(v, "i", tiled=bad))
        with pytest.raises(TypeError, match=r"psum_scatter: tiled must be True or False"):
            run(lambda v: shmap.psum_scatter(v, "i", tiled=bad), P("i"))
    got = run(lambda v: shmap.all_gather_invariant(v, "i", axis=np.int64(1), tiled=True))
    assert torch.equal(got, run(lambda v: shmap.all_gather_invariant(v, "i", axis=1, tiled=True)))
    assert got.tolist() == [[0.0, 2.0, 4.0, 6.0], [1.0, 3.0, 5.0, 7.0]]
    with pytest.raises(TypeError, match=r"all_gather_invariant: axis must be an int, got True"):
        run(lambda v: shmap.all_gather_invariant(v, "i", axis=True))
    with pytest.raises(shmap.CollectiveArgumentError, match=r"pshuffle: perm must be a permutation of range\(4\)"):
        run(lambda v: shmap.pshuffle(v, "i", None), P("i"))
