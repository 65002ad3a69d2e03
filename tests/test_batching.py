"""Decompositions used when an op without a functorch batching rule runs over devices."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import shmap
from shmap import P

MESH = shmap.make_mesh((4,), ("i",))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn", ["cross_entropy", "nll_loss"])
def test_losses_match_torch_without_the_slow_fallback(fn, reduction):
    x = torch.randn(8, 5, requires_grad=True)
    t = torch.randint(0, 5, (8,))
    t[3] = -100  # ignored
    if fn == "nll_loss":
        inp_fn = lambda v: F.log_softmax(v, -1)  # noqa: E731
    else:
        inp_fn = lambda v: v  # noqa: E731
    loss = getattr(F, fn)

    def body(v, tt):
        return loss(inp_fn(v), tt, reduction=reduction)

    out_spec = P("i") if reduction == "none" else P()
    wrap = (lambda y: y) if reduction == "none" else (lambda y: shmap.psum(y, "i"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # functorch's fallback warns; the decomposition must not
        out = shmap.shard_map(lambda v, tt: wrap(body(v, tt)), mesh=MESH, in_specs=(P("i"), P("i")),
                              out_specs=out_spec)(x, t)
    blocks = [loss(inp_fn(a), b, reduction=reduction) for a, b in zip(x.chunk(4), t.chunk(4))]
    expect = torch.cat(blocks) if reduction == "none" else sum(blocks)
    torch.testing.assert_close(out, expect)
    (g,) = torch.autograd.grad(out.sum(), x)
    (ge,) = torch.autograd.grad(expect.sum(), x)
    torch.testing.assert_close(g, ge)
