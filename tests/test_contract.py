"""shmap.contract: the direct einsum whose backward reads a broadcast cotangent in place.

Its forward is torch.einsum's and its backward runs the GEMMs of autograd's derivative of
torch.einsum, so values and gradients equal autograd's bit for bit; a cotangent broadcast along
device dims (the transpose of a psum) is read in place instead of copied.
"""
import pytest
import torch

import shmap
from shmap import P

_PAIRS = [
    ("FTamk", "FTkn", "FTamn", {"F": 2, "T": 4, "a": 3, "m": 5, "k": 6, "n": 7}),   # row-parallel
    ("FTamk", "FTkn", "FTamn", {"F": 2, "T": 4, "a": 2, "m": 16, "k": 16, "n": 32}),  # aligned: in place
    ("Famk", "FTkn", "FTamn", {"F": 2, "T": 4, "a": 3, "m": 5, "k": 6, "n": 7}),    # column-parallel
    ("FTbhsk", "FThkd", "FTbsd", {"F": 2, "T": 2, "b": 3, "h": 1, "s": 4, "k": 5, "d": 6}),  # size-1 h
    ("Fbsd", "FTtdhk", "FTtbhsk", {"F": 2, "T": 2, "t": 3, "b": 2, "s": 4, "d": 5, "h": 2, "k": 3}),
    ("Tnk", "Tmk", "Tmn", {"T": 3, "n": 4, "m": 5, "k": 6}),                         # bmm swaps operands
    ("ab", "b", "a", {"a": 4, "b": 5}),                                              # no batch letter
]


def _operands(sa, sb, size, dtype, broadcast_b):
    a = torch.randn([size[c] for c in sa][::-1], dtype=dtype).permute(*reversed(range(len(sa))))  # strided
    shape_b = [size[c] for c in sb]
    if broadcast_b and sb[0] == "F" and "F" in sa:  # an all-gathered weight: stride 0 along F
        b = torch.randn([1] + shape_b[1:], dtype=dtype).expand(shape_b)
    else:
        b = torch.randn(shape_b, dtype=dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("pair", _PAIRS, ids=["row", "row-aligned", "column", "size-1", "qkv", "swapped", "no-batch"])
@pytest.mark.parametrize("broadcast", [False, True])
def test_contract_backward_is_autograds_to_the_bit(pair, dtype, broadcast):
    sa, sb, so, size = pair
    torch.manual_seed(0)
    a, b = _operands(sa, sb, size, dtype, broadcast)
    g = torch.randn([size[c] for c in so], dtype=dtype)
    if broadcast and "T" in so:  # the cotangent of a psum over T: one copy, expanded along T
        g = g.select(so.index("T"), 0).unsqueeze(so.index("T")).expand(g.shape)
    ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = torch.einsum(f"{sa},{sb}->{so}", ref_a, ref_b)
    got_a, got_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    got = shmap.contract.Contract.apply(sa, sb, so, got_a, got_b)
    assert torch.equal(got, ref) and got.is_contiguous()
    for x, y in zip(torch.autograd.grad(got, (got_a, got_b), g), torch.autograd.grad(ref, (ref_a, ref_b), g)):
        assert x.shape == y.shape and torch.equal(x, y)


def test_contract_second_order_and_forward_mode():
    sa, sb, so, size = _PAIRS[0]
    torch.manual_seed(1)
    a, b = _operands(sa, sb, size, torch.float64, True)
    a, b = a.requires_grad_(), b.clone().requires_grad_()
    eq = f"{sa},{sb}->{so}"
    results = []
    for fn in (lambda x, y: shmap.contract.Contract.apply(sa, sb, so, x, y), lambda x, y: torch.einsum(eq, x, y)):
        ga, = torch.autograd.grad(fn(a, b).square().sum(), (a,), create_graph=True)
        hb, = torch.autograd.grad(ga.sin().sum(), (b,))
        results.append((ga.detach(), hb))
    for x, y in zip(*results):
        torch.testing.assert_close(x, y)
    import torch.autograd.forward_ad as fwad
    ta, tb = torch.randn_like(a), torch.randn_like(b)
    with fwad.dual_level():
        out = shmap.contract.Contract.apply(sa, sb, so, fwad.make_dual(a.detach(), ta), fwad.make_dual(b.detach(), tb))
        tangent = fwad.unpack_dual(out).tangent
    torch.testing.assert_close(tangent, torch.einsum(eq, ta, b) + torch.einsum(eq, a, tb))


def test_row_parallel_projection_gradients_unchanged_and_its_cotangent_not_copied(monkeypatch):
    """The recipe's row-parallel projection: x @ (w all-gathered over F), then psum over T. The psum's
    transpose is a stride-0 expand along T; the direct einsum's backward reads it in place (no tensor
    of its size is made) and gives the gradients of the plain autograd path to the bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            self.numels += [o.numel() for o in (out if isinstance(out, (tuple, list)) else [out])
                            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in seen]
            return out

    mesh = shmap.make_mesh((2, 4), ("F", "T"))
    torch.manual_seed(2)
    x = torch.randn(2 * 4, 16, 4 * 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4 * 8, 16, dtype=torch.float64, requires_grad=True)
    body = lambda a, b: shmap.psum(a @ shmap.all_gather(b, "F", axis=1, tiled=True), "T")  # noqa: E731
    f = shmap.shard_map(body, mesh=mesh, in_specs=(P("F", None, "T"), P("T", "F")), out_specs=P("F"))
    cotangent_numel = 2 * 4 * 4 * 16 * 16  # [F, T, rows, seq, out] if the expand were copied

    def grads():
        out = f(x, w)
        mode = Sizes()
        mode.numels = []
        with mode:
            got = torch.autograd.grad(out.sin().sum(), (x, w))
        return (out, *got), cotangent_numel in mode.numels

    got, copied = grads()
    assert not copied
    monkeypatch.setattr(shmap.contract, "applies", lambda *a: False)
    expect, copied_before = grads()
    assert copied_before
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[0], x @ w)


def test_batched_cotangents_and_second_order_through_a_row_parallel_projection():
    """autograd.grad(is_grads_batched=True) hands the backward batched cotangents (no storage to
    read in place) and create_graph differentiates the backward itself: both as plain torch."""
    mesh = shmap.make_mesh((2, 2), ("F", "T"))
    torch.manual_seed(4)
    x = torch.randn(4, 8, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    body = lambda a, b: shmap.psum(a @ shmap.all_gather(b, "F", axis=1, tiled=True), "T")  # noqa: E731
    f = shmap.shard_map(body, mesh=mesh, in_specs=(P("F", None, "T"), P("T", "F")), out_specs=P("F"))
    out = f(x, w)
    gs = torch.randn(3, *out.shape, dtype=torch.float64)
    bx, bw = torch.autograd.grad(out, (x, w), gs, is_grads_batched=True, retain_graph=True)
    each = [torch.autograd.grad(out, (x, w), g, retain_graph=True) for g in gs]
    torch.testing.assert_close(bx, torch.stack([e[0] for e in each]))
    torch.testing.assert_close(bw, torch.stack([e[1] for e in each]))
    gx, = torch.autograd.grad(f(x, w).square().sum(), (x,), create_graph=True)
    hw, = torch.autograd.grad(gx.sum(), (w,))
    rx, rw = x.detach().requires_grad_(), w.detach().requires_grad_()
    gr, = torch.autograd.grad((rx @ rw).square().sum(), (rx,), create_graph=True)
    torch.testing.assert_close(hw, torch.autograd.grad(gr.sum(), (rw,))[0])
