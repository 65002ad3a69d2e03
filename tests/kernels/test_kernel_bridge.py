"""Library kernels called from shard_map bodies equal shmap's own collectives.

On a (2, 4) mesh the kernels run over 'i' once per 'j' group, exactly like the
collective they replace; with a transpose they work under autograd too.
"""
import pytest
import torch

import shmap
from shmap import P
from shmap.kernels import bridge, library

MESH = shmap.make_mesh((2, 4), ("j", "i"))
N = 4


@pytest.fixture(autouse=True)
def float64_default():
    """Float64 for exact comparisons, restored afterwards (other kernel tests use float32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def both(kernel_body, ref_body, in_spec, out_spec, *args):
    k = shmap.shard_map(kernel_body, mesh=MESH, in_specs=in_spec, out_specs=out_spec)(*args)
    r = shmap.shard_map(ref_body, mesh=MESH, in_specs=in_spec, out_specs=out_spec)(*args)
    torch.testing.assert_close(k, r)
    return k


def test_all_reduce_kernel_replaces_psum_with_gradients():
    x = torch.randn(2 * N * 3, 5, requires_grad=True)
    spec = P(("j", "i"))
    out = both(lambda v: bridge.call(library.all_reduce, v, axis_name="i", out="invariant",
                                     transpose=bridge.IDENTITY),
               lambda v: shmap.psum(v, "i"), spec, P("j"), x)
    ct = torch.randn_like(out)
    k = shmap.shard_map(lambda v: bridge.call(library.all_reduce, v, axis_name="i", out="invariant",
                                              transpose=bridge.IDENTITY), mesh=MESH, in_specs=spec, out_specs=P("j"))
    r = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=MESH, in_specs=spec, out_specs=P("j"))
    torch.testing.assert_close(torch.autograd.grad(k(x), x, ct)[0], torch.autograd.grad(r(x), x, ct)[0])


def test_all_gather_kernel_with_reduce_scatter_transpose():
    x = torch.randn(2 * N * 2, 3, requires_grad=True)
    spec = P(("j", "i"))
    k = shmap.shard_map(lambda v: bridge.call(library.all_gather, v, axis_name="i",
                                              transpose=library.reduce_scatter), mesh=MESH, in_specs=spec,
                        out_specs=spec)
    r = shmap.shard_map(lambda v: shmap.all_gather(v, "i"), mesh=MESH, in_specs=spec, out_specs=spec)
    torch.testing.assert_close(k(x), r(x))
    ct = torch.randn_like(r(x))
    torch.testing.assert_close(torch.autograd.grad(k(x), x, ct)[0], torch.autograd.grad(r(x), x, ct)[0])


def test_permute_reduce_scatter_all_to_all_and_matmul_kernels():
    x = torch.randn(2 * N, 3)
    spec = P(("j", "i"))
    shift = [(d, (d + 1) % N) for d in range(N)]
    both(lambda v: bridge.call(library.right_permute, v, axis_name="i"),
         lambda v: shmap.ppermute(v, "i", shift), spec, spec, x)
    y = torch.randn(2 * N * N, 2, 3)  # per device [n, 2, 3]: contribution to each device's block
    both(lambda v: bridge.call(library.reduce_scatter, v, axis_name="i"),
         lambda v: shmap.psum_scatter(v, "i", scatter_dimension=0), P(("j", "i")), P(("j", "i")), y)
    both(lambda v: bridge.call(library.all_to_all, v, axis_name="i"),
         lambda v: shmap.all_to_all(v, "i", 0, 0), P(("j", "i")), P(("j", "i")), y)
    a, w = torch.randn(2 * N * 2, 3), torch.randn(3, 2 * N * 5)
    both(lambda u, v: bridge.call(library.allgather_matmul, u, v, axis_name="i"),
         lambda u, v: shmap.all_gather(u, "i", tiled=True) @ v, (P(("j", "i")), P(None, ("j", "i"))),
         P(("j", "i")), a, w)


def test_invariant_result_is_verified():
    x = torch.randn(N * 2, 3)

    def broken_all_reduce(xs):
        return [t * (i + 1) for i, t in enumerate(library.all_reduce(xs))]

    with pytest.raises(shmap.VmaError, match="device 1 of axis 'i' disagrees"):
        shmap.shard_map(lambda v: bridge.call(broken_all_reduce, v, axis_name="i", out="invariant"),
                        mesh=shmap.make_mesh((N,), ("i",)), in_specs=P("i"), out_specs=P())(x)


def test_missing_transpose_under_autograd_is_a_clear_error():
    x = torch.randn(N * 2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="no transpose"):
        shmap.shard_map(lambda v: bridge.call(library.all_gather, v, axis_name="i"),
                        mesh=shmap.make_mesh((N,), ("i",)), in_specs=P("i"), out_specs=P("i"))(x)


def test_kernel_calls_are_recorded():
    x = torch.randn(N * 2, 3)
    with shmap.comm_log() as log:
        shmap.shard_map(lambda v: bridge.call(library.all_reduce, v, axis_name="i", out="invariant"),
                        mesh=shmap.make_mesh((N,), ("i",)), in_specs=P("i"), out_specs=P())(x)
    assert log.summary() == {"kernel": 1}


def test_an_invariant_result_holding_nan_is_not_a_disagreement():
    """`out='invariant'` checks the devices agree; NaN equals NaN there (psum gives NaN too)."""
    x = torch.ones(2 * N * 3, 5)
    x[0, 0] = float("nan")
    out = shmap.shard_map(lambda v: bridge.call(library.all_reduce, v, axis_name="i", out="invariant"), mesh=MESH,
                          in_specs=P(("j", "i")), out_specs=P("j"))(x)
    want = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=MESH, in_specs=P(("j", "i")), out_specs=P("j"))(x)
    torch.testing.assert_close(out, want, equal_nan=True)


def test_jit_of_a_kernel_call_names_the_kernel_not_control_flow():
    """shmap.jit traces on fake tensors, where the interpreter cannot run: it blamed value-dependent control flow."""
    f = shmap.shard_map(lambda v: bridge.call(library.all_reduce, v, axis_name="i", out="invariant"), mesh=MESH,
                        in_specs=P(("j", "i")), out_specs=P("j"))
    x = torch.randn(2 * N * 3, 5)
    with pytest.raises(NotImplementedError, match=r"kernels.call\(all_reduce\): a kernel runs in the verifying "
                                                  r"interpreter .* shmap.jit"):
        shmap.jit(f)(x)
    torch.testing.assert_close(f(x), shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=MESH, in_specs=P(("j", "i")),
                                                     out_specs=P("j"))(x))


def test_a_bfloat16_ring_all_reduce_is_invariant_within_its_rounding():
    """A ring all-reduce adds the blocks in another order on each device; in bfloat16 its devices differed by 2
    ulps and the fixed float32 tolerance called that a disagreement.  16-bit floats get n ulps; a real
    disagreement (a kernel that leaves a device's block) is still caught."""
    mesh = shmap.make_mesh((8,), ("i",))
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    outs = library.all_reduce(list(x.chunk(8)))
    assert not all(torch.equal(outs[0], o) for o in outs)  # (the premise: the devices do differ)
    got = shmap.shard_map(lambda v: bridge.call(library.all_reduce, v, axis_name="i", out="invariant"), mesh=mesh,
                          in_specs=P("i"), out_specs=P())(x)
    torch.testing.assert_close(got.float(), x.float().reshape(8, 2, 4).sum(0), atol=0.1, rtol=0.02)
    with pytest.raises(shmap.VmaError, match="disagrees with device 0"):
        shmap.shard_map(lambda v: bridge.call(lambda xs: [t * (i + 1) for i, t in enumerate(xs)], v,
                                              axis_name="i", out="invariant"), mesh=mesh, in_specs=P("i"),
                        out_specs=P())(x)
