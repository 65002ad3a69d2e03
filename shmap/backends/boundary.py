"""The distributed mesh's boundary: a rank's block of a global value and back, as autograd Functions.

`TakeBlock` / `AssembleBlocks` (a plain tensor every rank holds <-> this
rank's block), `Arrive` (where deferred gradient reductions are read),
`PendingTerm` (a pending sum's term), `ScaleGrad` (the check_vma=False
transpose of an unmapped output), and the DTensor layout check.
"""
from __future__ import annotations

import torch

from ..errors import SpecError
from ..tensor import mesh_order
from .deferred import arrived
from .transports import _gather_rows


def _take_block(x, starts):
    for d, (start, size) in starts.items():
        x = x.narrow(d, start, size)
    return x


class Arrive(torch.autograd.Function):
    """Identity at a body's input whose backward waits for the input's deferred gradient reductions.

    Created when the body starts, so autograd runs it after every node of the
    body: the reductions launched on the way (`deferred`) overlap the rest of
    the backward pass, and what leaves the body is an ordinary tensor.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, ct):
        return arrived(ct)


class ScaleGrad(torch.autograd.Function):
    """Identity whose cotangent is scaled (the unmapped-output transpose of check_vma=False)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, ct):
        return ct * ctx.scale, None


class PendingTerm(torch.autograd.Function):
    """A global value -> this rank's term of a pending sum of it (itself on the first rank, else zeros).

    Transpose: the cotangent as it is.  A pending sum's cotangent is the same
    on every device of its axes, so every rank already holds the cotangent of
    the first rank's term, the global value's whole gradient.
    """

    @staticmethod
    def forward(ctx, x, first):
        ctx.first = first
        return x.view_as(x) if first else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, ct):
        return PendingTermT.apply(ct, ctx.first), None


class PendingTermT(torch.autograd.Function):
    """The transpose of `PendingTerm` (identity); its own transpose is `PendingTerm` again."""

    @staticmethod
    def forward(ctx, ct, first):
        ctx.first = first
        return ct.view_as(ct)

    @staticmethod
    def backward(ctx, g):
        return PendingTerm.apply(g, ctx.first), None


class TakeBlock(torch.autograd.Function):
    """This rank's block of a global value every rank holds.

    Its transpose assembles every rank's block cotangent (an all_gather over
    the split axes), so the global value's gradient is whole on every rank,
    as on the simulated mesh.  This boundary traffic is not a collective of
    the program and is not reported to `comm_log`.
    """

    @staticmethod
    def forward(ctx, x, backend, spec, body):
        ctx.args = (backend, spec, body, tuple(x.shape))
        return _take_block(x, backend._block_starts(spec, x.shape))

    @staticmethod
    def backward(ctx, ct):
        backend, spec, body, shape = ctx.args
        return AssembleBlocks.apply(ct, backend, spec, body), None, None, None


class AssembleBlocks(torch.autograd.Function):
    """Every rank's block -> the global value on every rank; transpose: `TakeBlock`."""

    @staticmethod
    def forward(ctx, block, backend, spec, body):
        ctx.args = (backend, spec, body)
        return _assemble_blocks(block, backend, spec, body)

    @staticmethod
    def backward(ctx, ct):
        return TakeBlock.apply(ct, *ctx.args), None, None, None


def _assemble_blocks(block, backend, spec, body):
    """Every rank's block of a global value (same spec) -> the global value, on every rank."""
    from .simulated import SIMULATED

    axes = mesh_order(spec.axes(), body)
    g = backend.group(axes)
    rows = _gather_rows(block, g, "assemble (boundary)")  # [n, *block], mesh order
    lead = [body.sizes[a] for a in axes]
    return SIMULATED.assemble(rows.reshape(*lead, *block.shape), axes, spec, body, tuple(block.shape))


def check_dtensor_layout(x, mesh, spec, expected):
    """Raise if DTensor `x` is not laid out as `spec` on `mesh` (placements `expected`)."""
    if x.device_mesh != mesh.device_mesh or tuple(x.placements) != tuple(expected):
        raise SpecError(
            f"shard_map: a DTensor argument is laid out as {tuple(x.placements)} on {x.device_mesh}, but its "
            f"in_spec {spec} on mesh {mesh.describe()} needs {tuple(expected)}. A DTensor is used in place only "
            "when its layout matches. Fix: reshard it explicitly first, "
            f"`x = shmap.device_put(x, mesh, {spec})`, or change the in_spec to match."
        )
