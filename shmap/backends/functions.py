"""The distributed mesh's collectives as autograd Functions: each backward is its transpose collective.

Each records the same `comm.CommEvent` the simulated backend records, so
`comm_log` reads the same on both meshes.
"""
from __future__ import annotations

import torch

from .. import comm
from ..tensor import event
from . import deferred
from . import traced
from .traced import tracing
from .transports import _all_gather, _all_reduce, _all_to_all, _own_block, _ppermute, _psum_scatter


def _grad(t) -> bool:
    return torch.is_grad_enabled() and t.requires_grad


# --------------------------------------------------------------------------
# Autograd: each collective's backward is its transpose collective
# --------------------------------------------------------------------------
def _record(kind, axes, shape, dtype):
    """Report a collective to every active `comm_log` (nothing to build when none is active)."""
    if tracing():  # torch.compile: the op shmap.coll_record, run by the graph on every call (traced.py)
        return traced.record(kind, axes, shape, dtype)
    if comm._LOGS:
        comm.record(event(kind, axes, shape, dtype))


class Psum(torch.autograd.Function):
    """psum (V -> I); transpose: pvary (no communication)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        _record("psum", g.axes, x.shape, x.dtype)
        return _all_reduce(x, g, "psum")

    @staticmethod
    def backward(ctx, ct):
        return Pvary.apply(ct, ctx.g), None


class Pvary(torch.autograd.Function):
    """pvary and the automatic lift (I -> V, identity); transpose: psum."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, ct):
        if torch.is_grad_enabled():  # a graph for higher derivatives: the Function, which transposes again
            return Psum.apply(ct, ctx.g), None
        _record("psum", ctx.g.axes, ct.shape, ct.dtype)
        return deferred.psum(ct, ctx.g), None


class PsumUnchecked(torch.autograd.Function):
    """psum with check_vma=False: every value counts as varying; transpose: psum.

    `log=False`: the same sum inside another collective's backward (pmax's),
    which the simulated mesh performs inside one batched op and does not log.
    """

    @staticmethod
    def forward(ctx, x, g, log=True):
        ctx.g, ctx.log = g, log
        if log:
            _record("psum", g.axes, x.shape, x.dtype)
        return _all_reduce(x, g, "psum")

    @staticmethod
    def backward(ctx, ct):
        return PsumUnchecked.apply(ct, ctx.g, ctx.log), None, None


class Pextremum(torch.autograd.Function):
    """pmax / pmin; subgradient: the devices holding the extremum, ties split evenly.

    Counting the ties (and, with check_vma=False, summing the cotangent first)
    communicates a little in the backward pass; like the simulated mesh, which
    does this inside one batched op, it is not reported to `comm_log`.
    """

    @staticmethod
    def forward(ctx, x, g, kind, unchecked):
        ctx.g, ctx.unchecked = g, unchecked
        _record(kind, g.axes, x.shape, x.dtype)
        out = _all_reduce(x, g, kind)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, ct):
        x, out = ctx.saved_tensors
        g = ctx.g
        if ctx.unchecked:
            ct = PsumUnchecked.apply(ct, g, False)
        mask = (x == out).to(ct.dtype)
        count = _all_reduce(mask, g, "psum")
        return ct * mask / count, None, None, None


class AllGather(torch.autograd.Function):
    """all_gather (V -> V); transpose: psum_scatter."""

    @staticmethod
    def forward(ctx, x, g, axis, tiled):
        ctx.args = (g, axis, tiled)
        _record("all_gather", g.axes, x.shape, x.dtype)
        return _all_gather(x, g, axis, tiled)

    @staticmethod
    def backward(ctx, ct):
        if torch.is_grad_enabled():
            return PsumScatter.apply(ct, *ctx.args), None, None, None
        g, dim, tiled = ctx.args
        _record("psum_scatter", g.axes, ct.shape, ct.dtype)
        return deferred.psum_scatter(ct, g, dim, tiled), None, None, None


class PsumScatter(torch.autograd.Function):
    """psum_scatter (V -> V); transpose: all_gather."""

    @staticmethod
    def forward(ctx, x, g, dim, tiled):
        ctx.args = (g, dim, tiled)
        _record("psum_scatter", g.axes, x.shape, x.dtype)
        return _psum_scatter(x, g, dim, tiled)

    @staticmethod
    def backward(ctx, ct):
        return AllGather.apply(ct, *ctx.args), None, None, None


class AllGatherInvariant(torch.autograd.Function):
    """all_gather_invariant (V -> I); transpose: the own-block slice."""

    @staticmethod
    def forward(ctx, x, g, axis, tiled):
        ctx.args = (g, axis, tiled)
        _record("all_gather_invariant", g.axes, x.shape, x.dtype)
        return _all_gather(x, g, axis, tiled, "all_gather_invariant")

    @staticmethod
    def backward(ctx, ct):
        return OwnBlock.apply(ct, *ctx.args), None, None, None


class OwnBlock(torch.autograd.Function):
    """The own-block slice (I -> V, no communication); transpose: all_gather_invariant."""

    @staticmethod
    def forward(ctx, x, g, axis, tiled):
        ctx.args = (g, axis, tiled)
        return _own_block(x, g, axis, tiled)

    @staticmethod
    def backward(ctx, ct):
        return AllGatherInvariant.apply(ct, *ctx.args), None, None, None


class Ppermute(torch.autograd.Function):
    """ppermute (V -> V); transpose: ppermute with the inverse permutation."""

    @staticmethod
    def forward(ctx, x, g, perm):
        ctx.g, ctx.perm = g, perm
        _record("ppermute", g.axes, x.shape, x.dtype)
        return _ppermute(x, g, perm)

    @staticmethod
    def backward(ctx, ct):
        return Ppermute.apply(ct, ctx.g, tuple((d, s) for s, d in ctx.perm)), None, None


class AllToAll(torch.autograd.Function):
    """all_to_all (V -> V); transpose: all_to_all with split and concat swapped."""

    @staticmethod
    def forward(ctx, x, g, split_axis, concat_axis, tiled):
        ctx.args = (g, split_axis, concat_axis, tiled)
        _record("all_to_all", g.axes, x.shape, x.dtype)
        return _all_to_all(x, g, split_axis, concat_axis, tiled)

    @staticmethod
    def backward(ctx, ct):
        g, s, c, tiled = ctx.args
        return AllToAll.apply(ct, g, c, s, tiled), None, None, None, None
