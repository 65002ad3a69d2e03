"""The distributed mesh's collectives as autograd Functions: each backward is its transpose collective.

Each records the same `comm.CommEvent` the simulated backend records, so
`comm_log` reads the same on both meshes.  Each forward runs the collective
as a named op (`library.py`: `torch.ops.shmap.psum`, ...).

torch.func: the Functions are in `setup_context` form with a `vmap` and a
`jvp` staticmethod, as `torch.func` requires, so `grad`, `vjp`, `jacrev`,
`jacfwd`, `hessian` and `vmap` transform a body on the distributed mesh as
on the simulated one.  A `vmap` rule moves the batch dim to the front,
shifts the collective's axis arguments past it and calls the same Function
once on the whole batch (one collective, not one per example).  A `jvp` rule
runs the same collective on the tangent, unreported (as on the simulated
mesh, where the tangent moves inside the same op).

comm_log under vmap: the simulated mesh reports a batched collective once,
with the shape of one example (the batch hides inside the body value).  So
every Function takes `log`: True reports the operand's shape, False nothing,
and a tuple is the per-example shape the vmap rule passes with a batched
operand.  Its backward reports its transpose with the cotangent's
per-example shape in the same way; nested vmaps pass the tuple on.

An ordinary backward pass (grad mode off, plain tensors) keeps its fast
path: the transposes of pvary and all_gather are deferred and bucketed
(`deferred.py`); so is one that AOT autograd traces (torch.compile).  Under
`torch.func` or `create_graph` the transpose is the Function, which a
further derivative or vmap transforms again.
"""
from __future__ import annotations

import torch

from .. import comm
from ..errors import TransformError
from ..recording import event
from . import deferred, library
from . import traced
from .traced import tracing
from .transports import _all_reduce, _own_block

_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_dead = torch._functorch.utils.unwrap_dead_wrappers


def _grad(t) -> bool:
    """Whether a collective on `t` must run as its Function: autograd records it, or a torch.func
    transform sees `t` (a vmap batch needs the Function's vmap rule; the raw transport has none)."""
    return (torch.is_grad_enabled() and t.requires_grad) or _wrapped(t)


def _transposing(ct) -> bool:
    """Whether a backward must call its transpose as a Function rather than the deferred reduction:
    a graph is built (create_graph, torch.func.grad) or `ct` is a torch.func value (batched)."""
    return torch.is_grad_enabled() or _wrapped(ct)


# --------------------------------------------------------------------------
# comm_log
# --------------------------------------------------------------------------
def _record(kind, axes, shape, dtype):
    """Report a collective to every active `comm_log` (nothing to build when none is active)."""
    if tracing():  # torch.compile: the op shmap.coll_record, run by the graph on every call (traced.py)
        return traced.record(kind, axes, shape, dtype)
    if comm._LOGS:
        comm.record(event(kind, axes, shape, dtype))


def _report(kind, g, x, log):
    """Report collective `kind` on `x` as `log` says: True its shape, False not, a tuple that shape.
    (Every collective's Function reports before it communicates: where a batch it cannot carry is refused.)"""
    if _legacy_batched(x):
        raise _legacy_batch_error(kind)
    if log is not False:
        _record(kind, g.axes, x.shape if log is True else log, x.dtype)


_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def _legacy_batch_error(kind) -> TransformError:
    return TransformError(
        f"{kind} on the distributed mesh under `torch.autograd.grad(..., is_grads_batched=True)` (which "
        "`torch.autograd.functional.jacobian` / `hessian` use with vectorize=True): torch's legacy batching "
        "has no rule for a collective, so the batch of cotangents cannot travel. Fix: `torch.func.vmap` over "
        "`torch.func.vjp`, or `torch.func.jacrev` / `hessian`, which work on both meshes; or vectorize=False "
        "(a loop over the cotangents)."
    )


def _tail(log, t, k):
    """`log` for a tensor `t` whose first `k` dims are vmap batch dims: its per-example shape."""
    return log if isinstance(log, bool) else tuple(t.shape[k:])


def _example(x, bdim, log):
    """The `log` a vmap rule passes on with its batch: the per-example shape (or False)."""
    if log is True:
        return tuple(x.shape[:bdim] + x.shape[bdim + 1:])
    return log  # False, or already per-example (an inner vmap level's)


# --------------------------------------------------------------------------
# vmap rules
# --------------------------------------------------------------------------
def _front(x, bdim):
    """`x` with its batch dim first (the axis arguments shift by one past it)."""
    return x if bdim == 0 else x.movedim(bdim, 0)


def _elementwise(cls, in_dims, x, g, *rest):
    """The vmap rule of an elementwise collective (psum, pmax, ppermute, pvary): the batch dim stays."""
    bdim = in_dims[0]
    if bdim is None:
        return cls.apply(x, g, *rest), None
    return cls.apply(x, g, *rest[:-1], _example(x, bdim, rest[-1])), bdim


def _shifted(cls, in_dims, x, g, axes, rest, log):
    """The vmap rule of a collective with axis arguments: batch dim first, axes + 1, one collective."""
    bdim = in_dims[0]
    if bdim is None:
        return cls.apply(x, g, *axes, *rest, log), None
    return cls.apply(_front(x, bdim), g, *(a + 1 for a in axes), *rest, _example(x, bdim, log)), 0


# --------------------------------------------------------------------------
# The Functions' common form
# --------------------------------------------------------------------------
class _Function(torch.autograd.Function):
    """An autograd Function in `setup_context` form whose eager `apply` costs what the classic form's does.

    torch's `Function.apply` binds a `setup_context` Function's default
    arguments with `inspect.signature` on every call (about 20-50 us here, a
    tenth of a small collective).  Outside torch.func transforms this `apply`
    goes straight to autograd's C++ `apply`, as torch's does after binding, so
    `setup_context` sees the arguments as passed (trailing defaults may be
    absent: read them with `_arg`).  Under a transform it is torch's `apply`
    (defaults bound, then the transform's rule).
    """

    @classmethod
    def apply(cls, *args):
        if _functorch_active():
            return _TORCH_APPLY(cls, *args)
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead(args))


_TORCH_APPLY = torch.autograd.Function.__dict__["apply"].__func__


def _arg(args, i, default=True):
    """Argument `i` of a Function's call (its default when the caller left it out)."""
    return args[i] if len(args) > i else default


def _keep_args(ctx, inputs, output):
    """setup_context of most Functions: keep the non-tensor arguments (as passed) for the backward pass."""
    ctx.args = inputs[1:]


def _keep_shifted(ctx, inputs, output, nargs):
    """setup_context of a collective with axis arguments: also how many leading dims are vmap batch dims."""
    ctx.args = inputs[1:]
    log = _arg(inputs, nargs + 1)
    ctx.log = log
    ctx.k = 0 if isinstance(log, bool) else inputs[0].dim() - len(log)


# --------------------------------------------------------------------------
# Autograd: each collective's backward is its transpose collective
# --------------------------------------------------------------------------
class Psum(_Function):
    """psum (V -> I); transpose: pvary (no communication)."""

    @staticmethod
    def forward(x, g, log=True):
        _report("psum", g, x, log)
        out = deferred.forward_psum(x, g)  # launched, read at first use (see there), where plainly safe
        return library.psum(x, g) if out is None else out

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, ct):
        return Pvary.apply(ct, ctx.args[0], _arg(ctx.args, 1)), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return Psum.apply(t, ctx.args[0], False)

    @staticmethod
    def vmap(info, in_dims, x, g, log=True):
        return _elementwise(Psum, in_dims, x, g, log)


class Pvary(_Function):
    """pvary and the automatic lift (I -> V, identity); transpose: psum.  `log` is the transpose's."""

    @staticmethod
    def forward(x, g, log=True):
        return x.view_as(x)

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, ct):
        g, log = ctx.args[0], _arg(ctx.args, 1)
        if _transposing(ct):  # a graph for higher derivatives, or torch.func: the Function, which transposes again
            return Psum.apply(ct, g, log), None, None
        _report("psum", g, ct, log)
        return deferred.psum(ct, g), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return Pvary.apply(t, ctx.args[0], False)

    @staticmethod
    def vmap(info, in_dims, x, g, log=True):
        return _elementwise(Pvary, in_dims, x, g, log)


class PsumUnchecked(_Function):
    """psum with check_vma=False: every value counts as varying; transpose: psum.

    `log=False`: the same sum inside another collective's backward (pmax's),
    which the simulated mesh performs inside one batched op and does not log.
    """

    @staticmethod
    def forward(x, g, log=True):
        _report("psum", g, x, log)
        return library.psum(x, g)

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, ct):
        return PsumUnchecked.apply(ct, ctx.args[0], _arg(ctx.args, 1)), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return PsumUnchecked.apply(t, ctx.args[0], False)

    @staticmethod
    def vmap(info, in_dims, x, g, log=True):
        return _elementwise(PsumUnchecked, in_dims, x, g, log)


def _count(mask, g):
    """How many devices of `g` hold the extremum (no gradient, not reported)."""
    if _wrapped(mask):  # a torch.func batch: the Function's vmap rule, one collective
        return PsumUnchecked.apply(mask, g, False)
    return _all_reduce(mask, g, "psum")


class Pextremum(_Function):
    """pmax / pmin; subgradient: the devices holding the extremum, ties split evenly.

    Counting the ties (and, with check_vma=False, summing the cotangent first)
    communicates a little in the backward pass; like the simulated mesh, which
    does this inside one batched op, it is not reported to `comm_log`.
    """

    @staticmethod
    def forward(x, g, kind, unchecked, log=True):
        _report(kind, g, x, log)
        return library.psum(x, g, kind)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, ctx.unchecked = inputs[1], inputs[3]
        ctx.save_for_backward(inputs[0], output)
        if _functorch_active():  # forward-mode AD (torch.func.jvp, jacfwd) reads them too
            ctx.save_for_forward(inputs[0], output)

    @staticmethod
    def backward(ctx, ct):
        x, out = ctx.saved_tensors
        g = ctx.g
        if ctx.unchecked:
            ct = PsumUnchecked.apply(ct, g, False)
        elif torch.is_grad_enabled():
            # A graph for higher derivatives: the invariant cotangent times the varying mask is an implicit
            # pvary, whose transpose (a psum, reported as the simulated mesh's transposed pmax is) the second
            # derivative needs (without it, every device's term through the cotangent was lost, silently).
            ct = Pvary.apply(ct, g)
        mask = (x == out).to(ct.dtype)
        return ct * mask / _count(mask, g), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        x, out = ctx.saved_tensors
        mask = (x == out).to(t.dtype)
        return PsumUnchecked.apply(t * mask, ctx.g, False) / _count(mask, ctx.g)

    @staticmethod
    def vmap(info, in_dims, x, g, kind, unchecked, log=True):
        return _elementwise(Pextremum, in_dims, x, g, kind, unchecked, log)


class AllGather(_Function):
    """all_gather (V -> V); transpose: psum_scatter."""

    @staticmethod
    def forward(x, g, axis, tiled, log=True):
        _report("all_gather", g, x, log)
        return library.all_gather(x, g, axis, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keep_shifted(ctx, inputs, output, 3)

    @staticmethod
    def backward(ctx, ct):
        g, dim, tiled = ctx.args[:3]
        log = _tail(ctx.log, ct, ctx.k)
        if _transposing(ct):
            return PsumScatter.apply(ct, g, dim, tiled, log), None, None, None, None
        _report("psum_scatter", g, ct, log)
        return deferred.psum_scatter(ct, g, dim, tiled), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return AllGather.apply(t, *ctx.args[:3], False)

    @staticmethod
    def vmap(info, in_dims, x, g, axis, tiled, log=True):
        return _shifted(AllGather, in_dims, x, g, (axis,), (tiled,), log)


class PsumScatter(_Function):
    """psum_scatter (V -> V); transpose: all_gather."""

    @staticmethod
    def forward(x, g, dim, tiled, log=True):
        _report("psum_scatter", g, x, log)
        return library.psum_scatter(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keep_shifted(ctx, inputs, output, 3)

    @staticmethod
    def backward(ctx, ct):
        g, dim, tiled = ctx.args[:3]
        return AllGather.apply(ct, g, dim, tiled, _tail(ctx.log, ct, ctx.k)), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return PsumScatter.apply(t, *ctx.args[:3], False)

    @staticmethod
    def vmap(info, in_dims, x, g, dim, tiled, log=True):
        return _shifted(PsumScatter, in_dims, x, g, (dim,), (tiled,), log)


class AllGatherInvariant(_Function):
    """all_gather_invariant (V -> I); transpose: the own-block slice."""

    @staticmethod
    def forward(x, g, axis, tiled, log=True):
        _report("all_gather_invariant", g, x, log)
        return library.all_gather(x, g, axis, tiled, "all_gather_invariant")

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keep_shifted(ctx, inputs, output, 3)

    @staticmethod
    def backward(ctx, ct):
        g, axis, tiled = ctx.args[:3]
        return OwnBlock.apply(ct, g, axis, tiled, _tail(ctx.log, ct, ctx.k)), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return AllGatherInvariant.apply(t, *ctx.args[:3], False)

    @staticmethod
    def vmap(info, in_dims, x, g, axis, tiled, log=True):
        return _shifted(AllGatherInvariant, in_dims, x, g, (axis,), (tiled,), log)


class OwnBlock(_Function):
    """The own-block slice (I -> V, no communication); transpose: all_gather_invariant.

    Its `log` (True, False or the per-example shape of its operand) is for the transpose.
    """

    @staticmethod
    def forward(x, g, axis, tiled, log=True):
        return _own_block(x, g, axis, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keep_shifted(ctx, inputs, output, 3)

    @staticmethod
    def backward(ctx, ct):
        g, axis, tiled = ctx.args[:3]
        return AllGatherInvariant.apply(ct, g, axis, tiled, _tail(ctx.log, ct, ctx.k)), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return OwnBlock.apply(t, *ctx.args[:3], False)

    @staticmethod
    def vmap(info, in_dims, x, g, axis, tiled, log=True):
        return _shifted(OwnBlock, in_dims, x, g, (axis,), (tiled,), log)


class Ppermute(_Function):
    """ppermute (V -> V); transpose: ppermute with the inverse permutation."""

    @staticmethod
    def forward(x, g, perm, log=True):
        _report("ppermute", g, x, log)
        return library.ppermute(x, g, perm)

    setup_context = staticmethod(_keep_args)

    @staticmethod
    def backward(ctx, ct):
        g, perm = ctx.args[:2]
        inverse = tuple((d, s) for s, d in perm)
        return Ppermute.apply(ct, g, inverse, _arg(ctx.args, 2)), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return Ppermute.apply(t, *ctx.args[:2], False)

    @staticmethod
    def vmap(info, in_dims, x, g, perm, log=True):
        return _elementwise(Ppermute, in_dims, x, g, perm, log)


class AllToAll(_Function):
    """all_to_all (V -> V); transpose: all_to_all with split and concat swapped."""

    @staticmethod
    def forward(x, g, split_axis, concat_axis, tiled, log=True):
        _report("all_to_all", g, x, log)
        return library.all_to_all(x, g, split_axis, concat_axis, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keep_shifted(ctx, inputs, output, 4)

    @staticmethod
    def backward(ctx, ct):
        g, s, c, tiled = ctx.args[:4]
        return AllToAll.apply(ct, g, c, s, tiled, _tail(ctx.log, ct, ctx.k)), None, None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return AllToAll.apply(t, *ctx.args[:4], False)

    @staticmethod
    def vmap(info, in_dims, x, g, split_axis, concat_axis, tiled, log=True):
        return _shifted(AllToAll, in_dims, x, g, (split_axis, concat_axis), (tiled,), log)
