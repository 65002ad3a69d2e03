"""The distributed mesh's boundary: a rank's block of a global value and back, as autograd Functions.

`TakeBlock` / `AssembleBlocks` (a plain tensor every rank holds <-> this
rank's block), `Arrive` (where deferred gradient reductions are read),
`PendingTerm` (a pending sum's term), `ScaleGrad` (the check_vma=False
transpose of an unmapped output), and the DTensor layout check.
"""
from __future__ import annotations

import torch

from ..errors import SpecError, TransformError
from ..mesh import PartitionSpec
from .deferred import arrived
from .functions import _Function, _keep_args, _legacy_batch_error, _legacy_batched
from .transports import _gather_rows


def _take_block(x, starts):
    for d, (start, size) in starts.items():
        x = x.narrow(d, start, size)
    return x


# The boundary's Functions are in `setup_context` form with `vmap` and `jvp` rules
# (`functions._Function`), as torch.func requires: a nested shard_map inside a transformed function
# cuts and assembles blocks with them, and so does a top-level shard_map under a transform from
# outside (`Distributed.split`, `check_not_dtensor`).  A vmap rule puts the batch dim first and, where the Function
# cuts or assembles blocks, describes the batch by a spec with a leading unsplit dim.
def _batch_first(x, bdim):
    return x if bdim == 0 else x.movedim(bdim, 0)


def _batched_spec(spec):
    """`spec` for a value with a batch dim in front (not split)."""
    return PartitionSpec(None, *spec, unreduced=spec.unreduced)


class Arrive(_Function):
    """Identity at a body's input whose backward waits for the input's deferred gradient reductions.

    Created when the body starts, so autograd runs it after every node of the
    body: the reductions launched on the way (`deferred`) overlap the rest of
    the backward pass, and what leaves the body is an ordinary tensor.  (No vmap or jvp rule: under
    a torch.func transform from outside `Distributed.split` leaves it out.)
    """

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, ct):
        return arrived(ct)


def _transformed() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, vmap, ...) is active around this call."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _unwrapped(x):
    """`x` without its torch.func wrappers (the tensor the transforms were applied to)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x) or torch._C._functorch.is_batchedtensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def check_not_dtensor(x, spec):
    """Under a torch.func transform from outside, `Distributed.split` takes plain tensors only.

    Its blocks are cut by the boundary's own Functions, which carry vmap and
    jvp rules, and `assemble` returns plain global tensors, which functorch can
    carry; a DTensor it cannot (DTensor's autograd Functions have no functorch
    rules).  So `torch.func.grad(f)` of a shard_mapped `f` gives on every rank
    what the simulated mesh gives.
    """
    from .. import dtensor as dt

    if dt.is_dtensor(_unwrapped(x)):
        raise TransformError(
            f"shard_map: a DTensor argument (in_spec {spec}) under a torch.func transform from outside: "
            "torch.func cannot carry a DTensor (its autograd Functions have no functorch rules). "
            "Fix: pass the global value as a plain tensor (`x.full_tensor()`, outside the transform), "
            "or apply the transform inside the body."
        )


class ScaleGrad(_Function):
    """Identity whose cotangent is scaled (the unmapped-output transpose of check_vma=False)."""

    @staticmethod
    def forward(x, scale):
        return x.view_as(x)

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, ct):
        return ct * ctx.args[0], None

    @staticmethod
    def vmap(info, in_dims, x, scale):
        return ScaleGrad.apply(x, scale), in_dims[0]

    @staticmethod
    def jvp(ctx, t, _):
        return ScaleGrad.apply(t, *ctx.args)


class PendingTerm(_Function):
    """A global value -> this rank's term of a pending sum of it (itself on the first rank, else zeros).

    Transpose: the cotangent as it is.  A pending sum's cotangent is the same
    on every device of its axes, so every rank already holds the cotangent of
    the first rank's term, the global value's whole gradient.
    """

    @staticmethod
    def forward(x, first):
        return x.view_as(x) if first else torch.zeros_like(x)

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, ct):
        return PendingTermT.apply(ct, ctx.args[0]), None

    @staticmethod
    def vmap(info, in_dims, x, first):
        return PendingTerm.apply(x, first), in_dims[0]

    @staticmethod
    def jvp(ctx, t, _):
        return PendingTerm.apply(t, *ctx.args)


class PendingTermT(_Function):
    """The transpose of `PendingTerm` (identity); its own transpose is `PendingTerm` again."""

    @staticmethod
    def forward(ct, first):
        return ct.view_as(ct)

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, g):
        return PendingTerm.apply(g, ctx.args[0]), None

    @staticmethod
    def vmap(info, in_dims, ct, first):
        return PendingTermT.apply(ct, first), in_dims[0]

    @staticmethod
    def jvp(ctx, t, _):
        return PendingTermT.apply(t, *ctx.args)


class TakeBlock(_Function):
    """This rank's block of a global value every rank holds.

    Its transpose assembles every rank's block cotangent (an all_gather over
    the split axes), so the global value's gradient is whole on every rank,
    as on the simulated mesh.  This boundary traffic is not a collective of
    the program and is not reported to `comm_log`.
    """

    @staticmethod
    def forward(x, backend, spec, body):
        return _take_block(x, backend._block_starts(spec, x.shape))

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, ct):
        return AssembleBlocks.apply(ct, *ctx.args), None, None, None

    @staticmethod
    def vmap(info, in_dims, x, backend, spec, body):
        if in_dims[0] is None:
            return TakeBlock.apply(x, backend, spec, body), None
        return TakeBlock.apply(_batch_first(x, in_dims[0]), backend, _batched_spec(spec), body), 0

    @staticmethod
    def jvp(ctx, t, *_):
        return TakeBlock.apply(t, *ctx.args)


class AssembleBlocks(_Function):
    """Every rank's block -> the global value on every rank; transpose: `TakeBlock`."""

    @staticmethod
    def forward(block, backend, spec, body):
        return _assemble_blocks(block, backend, spec, body)

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, ct):
        return TakeBlock.apply(ct, *ctx.args), None, None, None

    @staticmethod
    def vmap(info, in_dims, block, backend, spec, body):
        """One gather for the whole batch (the batch is one more unsplit dim of the block)."""
        if in_dims[0] is None:
            return AssembleBlocks.apply(block, backend, spec, body), None
        return AssembleBlocks.apply(_batch_first(block, in_dims[0]), backend, _batched_spec(spec), body), 0

    @staticmethod
    def jvp(ctx, t, *_):
        return AssembleBlocks.apply(t, *ctx.args)


def _assemble_blocks(block, backend, spec, body):
    """Every rank's block of a global value (same spec) -> the global value, on every rank."""
    from .simulated import SIMULATED

    if _legacy_batched(block):  # (the backward of a sharded plain argument under is_grads_batched=True)
        raise _legacy_batch_error("the gradient of a sharded plain argument (an all_gather of every rank's block)")
    axes = body.order(spec.axes())
    g = backend.group(axes)
    rows = _gather_rows(block, g, "assemble (boundary)")  # [n, *block], mesh order
    lead = [body.sizes[a] for a in axes]
    return SIMULATED.assemble(rows.reshape(*lead, *block.shape), axes, spec, body, tuple(block.shape))


def check_dtensor_layout(x, mesh, spec, expected):
    """Raise if DTensor `x` is not laid out as `spec` on `mesh` (placements `expected`)."""
    dm = mesh.device_mesh
    if x.device_mesh != dm:
        # (DeviceMesh's repr shows neither the rank order nor always the names: say what differs)
        theirs, ours = x.device_mesh, dm
        raise SpecError(
            f"shard_map: a DTensor argument lives on another DeviceMesh than mesh {mesh.describe()}'s: ranks "
            f"{theirs.mesh.tolist()} with dims {theirs.mesh_dim_names}, where the mesh has ranks "
            f"{ours.mesh.tolist()} with dims {ours.mesh_dim_names}. A DTensor is used in place only on the "
            f"shard_map's mesh. Fix: move it there first, `x = shmap.device_put(x, mesh, {spec})`."
        )
    if tuple(x.placements) != tuple(expected):
        raise SpecError(
            f"shard_map: a DTensor argument is laid out as {tuple(x.placements)} on {x.device_mesh}, but its "
            f"in_spec {spec} on mesh {mesh.describe()} needs {tuple(expected)}. A DTensor is used in place only "
            "when its layout matches. Fix: reshard it explicitly first, "
            f"`x = shmap.device_put(x, mesh, {spec})`, or change the in_spec to match."
        )


def check_local_shape(x, mesh, spec):
    """Raise if DTensor `x`'s local tensor is not its global shape cut by `spec` (a DTensor built with
    `from_local` from blocks of other shapes: its ranks would run the body on blocks of different shapes,
    and the outputs' global shapes would differ by rank)."""
    from ..dtensor import block_shape

    want = block_shape(x.shape, mesh, spec)
    local = x._local_tensor
    if tuple(local.shape) != tuple(want):
        raise SpecError(
            f"shard_map: a DTensor argument of global shape {tuple(x.shape)} laid out as {spec} holds a local "
            f"tensor of shape {tuple(local.shape)} on rank {mesh.device_mesh.get_rank()}, but that layout's "
            f"blocks are {tuple(want)} (the global shape divided by the mesh axes each dimension is split "
            "over). Fix: build it with blocks of that shape (DTensor.from_local(..., shape=...) takes the "
            "blocks as they are), or pass the global tensor and let shard_map cut it."
        )
