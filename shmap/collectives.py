"""Collectives inside shard_map bodies: their types, checks and transposes.

Each collective is a section headed by its device-variance signature.  "V{A}"
means varying along the named axes A, "I{A}" invariant along them.  Each is
also one `Collective` record in `COLLECTIVES`: its signature, its type rule (a
pure function of the operand's vma and per-device shape, callable without
running anything: `COLLECTIVES['psum'].rule(vma, shape, axes, n)`), the
collective its transpose performs, and whether it communicates.  `TRANSPOSES`
and `comm.COMMUNICATING` are derived from it.  The user function normalises
the axis argument, checks shapes, lifts an invariant operand with `pvary`
where the collective needs a varying one (as JAX does), calls the backend's
physical implementation (which records the collective and, under autograd,
its transpose), and types the result by the rule.  The plumbing those steps
share (the axis argument, the operand's body, the implicit `pvary`, the
result's type, shape and permutation checks) is in `operands.py`.

`tests/test_collectives.py` checks every collective has a rule, a backend
implementation and a transpose, that each rule predicts the type and shape
every backend produces, and each transpose pair numerically
(<f(x), y> == <x, f^T(y)>).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import comm, context, cow
from .errors import CollectiveArgumentError, UnboundAxisError, VmaError, fmt_axes, fmt_vma
from .operands import (
    _axes,
    _check_perm,
    _check_split,
    _check_reducible,
    _countable,
    _dim,
    _flag,
    _operand,
    _out,
    _shape_error,
    _size,
    _varying,
    entry,
    no_axes,
    plain_value,
)
from .tensor import ShTensor, logical_shape, unreduced_axes, vma  # noqa: F401  (unreduced_axes, vma: re-exported)


@dataclass(frozen=True)
class Collective:
    """One collective: signature, type rule, transpose, and whether it moves data between devices."""

    name: str
    signature: str  # e.g. "V{A} -> I{A}"
    rule: Callable  # (vma, shape, axes, n, **params) -> (vma, shape) of the result, n = devices along axes
    transpose: str | None  # the collective its transpose performs (None: no communication)
    logged: bool  # comm_log reports events of this kind (pmean and pshuffle report their psum / ppermute)


#: name -> its `Collective`, in the order of the sections below
COLLECTIVES: dict = {}


def _collective(name, signature, transpose, logged=True):
    """Register the decorated type rule as collective `name`'s."""
    def register(rule):
        COLLECTIVES[name] = Collective(name, signature, rule, transpose, logged)
        if logged:
            comm.register_communicating(name)
        return rule
    return register


# --------------------------------------------------------------------------
# psum: V{A} -> I{A}                        transpose: pvary (no communication)
# --------------------------------------------------------------------------
@_collective("psum", "V{A} -> I{A}", "pvary")
def _reduced(vma, shape, axes, n):
    return frozenset(vma) - frozenset(axes), tuple(shape)


@entry(identity_without_axes=True)
def psum(x, axis_name):
    """Sum over the devices of `axis_name`; the result is invariant along it.

    An operand that is invariant along the axis is first `pvary`'d, so the
    result is N * x, as in JAX.  Integers keep their dtype and wrap on
    overflow; booleans are counted (an int32 result, as JAX's psum).
    """
    if type(x) is ShTensor and type(axis_name) is str:  # the backend's short way, where it has one
        out = x._body.backend.quick_psum(x, axis_name)
        if out is not None:
            return out
    axes = _axes("psum", axis_name)
    body, x = _operand("psum", x, axes)
    x = _countable(x, "psum", axes)
    phys = _varying(x, axes, body)
    out, paxes = body.backend.psum(phys, x._paxes, axes, body, logical_shape(x), not body.check_vma)
    res = _out(out, paxes, _reduced(x._vma, (), axes, 0)[0], body, src=x)
    if x._unreduced:  # psum over an unreduced axis is that pending sum's reduction
        res._unreduced = x._unreduced - set(axes)
    return res


# pmean: V{A} -> I{A}                        transpose: pvary, scaled
_collective("pmean", "V{A} -> I{A}", "pvary", logged=False)(_reduced)


@entry(identity_without_axes=False)
def pmean(x, axis_name):
    """Mean over the devices of `axis_name` (a psum, then a division)."""
    if no_axes(axis_name):  # (no axes: x / 1, as JAX's)
        return x / 1
    axes = _axes("pmean", axis_name)
    body = context.body_for_axes("pmean", axes, hint=x._body if isinstance(x, ShTensor) else None)
    return psum(x, axes) / _size(body, axes)


# --------------------------------------------------------------------------
# pmax / pmin: V{A} -> I{A}                 transpose: none (not linear)
# --------------------------------------------------------------------------
_collective("pmax", "V{A} -> I{A}", None)(_reduced)
_collective("pmin", "V{A} -> I{A}", None)(_reduced)


def _pextremum(kind, x, axis_name):
    axes = _axes(kind, axis_name)
    body, x = _operand(kind, x, axes)
    if x.dtype.is_complex:
        raise CollectiveArgumentError(
            f"{kind} over {fmt_axes(axes)}: the operand is {str(x.dtype).replace('torch.', '')}, and complex "
            "numbers have no order (JAX's pmax/pmin refuse them too). "
            f"Fix: take the {'maximum' if kind == 'pmax' else 'minimum'} of a real quantity, e.g. "
            f"shmap.{kind}(x.abs(), {fmt_axes(axes)}) or shmap.{kind}(x.real, {fmt_axes(axes)})."
        )
    _check_reducible(kind, axes, x)
    phys = _varying(x, axes, body)
    out, paxes = body.backend.pextremum(kind, phys, x._paxes, axes, body, x.shape, not body.check_vma)
    return _out(out, paxes, _reduced(x._vma, (), axes, 0)[0], body, src=x)


@entry(identity_without_axes=False)
def pmax(x, axis_name):
    """Maximum over the devices of `axis_name`.

    Differentiable (JAX's is not): the gradient goes to the devices holding
    the maximum, split evenly among ties (torch.amax's rule).
    """
    return _pextremum("pmax", x, axis_name)


@entry(identity_without_axes=False)
def pmin(x, axis_name):
    """Minimum over the devices of `axis_name` (gradient as for `pmax`)."""
    return _pextremum("pmin", x, axis_name)


# --------------------------------------------------------------------------
# pvary: I{A} -> V{A}                       transpose: psum
# --------------------------------------------------------------------------
@_collective("pvary", "I{A} -> V{A}", "psum", logged=False)
def _varies(vma, shape, axes, n):
    return frozenset(vma) | frozenset(axes), tuple(shape)


@entry(identity_without_axes=True)
def pvary(x, axis_name):
    """Mark `x` as varying along `axis_name` (no communication: a stride-0 view).

    Its transpose is the `psum` that gives a replicated parameter its
    gradient.  Usually inserted for you; call it to be explicit.  Axes `x`
    already varies along are left as they are.
    """
    axes = _axes("pvary", axis_name)
    body, x = _operand("pvary", x, axes)
    if not body.check_vma:
        return x
    added = tuple(a for a in axes if a not in x._vma)
    if not added:
        return x
    out, paxes = body.backend.pvary(x._phys, x._paxes, body.order(added), body, x.shape)
    return _out(out, paxes, _varies(x._vma, (), axes, 0)[0], body, pvary=True, src=x)


# --------------------------------------------------------------------------
# pcast: V{A} -> U{A} (to='unreduced'), I{A} -> V{A} (to='varying')
#                                           transpose: no communication
# --------------------------------------------------------------------------
@_collective("pcast", "V{A} -> U{A}", None, logged=False)
def _pending(vma, shape, axes, n):
    return frozenset(vma) - frozenset(axes), tuple(shape)  # A leaves the vma: a pending sum along A (U{A})


@entry(identity_without_axes=True)
def pcast(x, axis_name, *, to):
    """Change how a value relates to the devices of `axis_name` without communicating.

    - `to='varying'`: `pvary`.
    - `to='unreduced'`: declare a varying value a *pending sum*: its logical
      value is the sum of the per-device values.  Only ops linear in it are
      allowed afterwards; `psum` performs the sum, and `out_specs`
      `P(..., unreduced={...})` returns it pending (a `Partial` DTensor on the
      distributed mesh).  This fuses reductions: psum a sum, not sum psums.
    """
    if to == "varying":
        return pvary(x, axis_name)
    if to != "unreduced":
        raise CollectiveArgumentError(
            f"pcast: to must be 'varying' or 'unreduced', got {to!r}. Fix: e.g. pcast(x, 'i', to='unreduced')."
        )
    axes = _axes("pcast", axis_name)
    body, x = _operand("pcast", x, axes)
    if not body.check_vma:
        raise VmaError("pcast(to='unreduced') needs typed values. Fix: use shard_map(..., check_vma=True).")
    missing = [a for a in axes if a not in x._vma or a in x._unreduced]
    if missing:
        why = "already unreduced" if missing[0] in x._unreduced else "invariant"
        raise VmaError(
            f"pcast(to='unreduced'): the value is {why} along {missing[0]!r} (mesh {body.describe()}); "
            "an unreduced value's logical value is the sum of its per-device values, so only a varying value "
            f"can become one (an invariant x would mean {body.sizes[missing[0]]}*x). "
            "Fix: pcast a varying value, or shmap.pvary it first if the multiple is intended."
        )
    return cow.lend(cow.mark_shared(ShTensor(x._phys, x._paxes, x._vma, body, x._unreduced | frozenset(axes)),
                                    True), x)


# --------------------------------------------------------------------------
# all_gather: V{A} -> V{A}                  transpose: psum_scatter
# all_gather_invariant: V{A} -> I{A}        transpose: own-block slice
# --------------------------------------------------------------------------
def _gathered(shape, n, axis, tiled):
    shape = list(shape)
    if tiled:
        shape[axis] *= n
    else:
        shape.insert(axis, n)
    return tuple(shape)


@_collective("all_gather", "V{A} -> V{A}", "psum_scatter")
def _gather_rule(vma, shape, axes, n, *, axis=0, tiled=False):
    return frozenset(vma) | frozenset(axes), _gathered(shape, n, axis, tiled)


@_collective("all_gather_invariant", "V{A} -> I{A}", None)
def _gather_invariant_rule(vma, shape, axes, n, *, axis=0, tiled=False):
    return frozenset(vma) - frozenset(axes), _gathered(shape, n, axis, tiled)


def _all_gather(api, x, axis_name, axis, tiled, invariant):
    if type(x) is ShTensor and type(axis_name) is str:  # the backend's short way, where it has one
        out = x._body.backend.quick_all_gather(x, axis_name, axis, tiled, invariant)
        if out is not None:
            return out
    axes = _axes(api, axis_name)
    body, x = _operand(api, x, axes)
    rank = x.dim()
    if _flag(api, "tiled", tiled):
        if rank == 0:
            raise _shape_error(api, axes, body, x, "tiled=True concatenates along an existing dimension",
                               "use tiled=False for scalars, or give the value a dimension")
        axis = _dim(api, "axis", axis, rank)
    else:
        axis = _dim(api, "axis", axis, rank, allow_end=True)
    phys = _varying(x, axes, body)
    out, paxes = body.backend.all_gather(
        phys, x._paxes, axes, body, x.shape, axis, tiled, invariant, not body.check_vma
    )
    return _out(out, paxes, (_reduced if invariant else _varies)(x._vma, (), axes, 0)[0], body, src=x)


@entry(identity_without_axes=True)
def all_gather(x, axis_name, *, axis=0, tiled=False):
    """Every device gets every device's block, stacked (or concatenated if `tiled`) at `axis`.

    The result is typed varying (a `pvary` is fused in) so that its transpose
    is one `psum_scatter`; use `all_gather_invariant` for an invariant result.
    """
    return _all_gather("all_gather", x, axis_name, axis, tiled, False)


@entry(identity_without_axes=True)
def all_gather_invariant(x, axis_name, *, axis=0, tiled=False):
    """As `all_gather`, typed invariant; its transpose is a slice of the own block (no communication)."""
    return _all_gather("all_gather_invariant", x, axis_name, axis, tiled, True)


# --------------------------------------------------------------------------
# psum_scatter: V{A} -> V{A}                transpose: all_gather
# --------------------------------------------------------------------------
@_collective("psum_scatter", "V{A} -> V{A}", "all_gather")
def _scatter_rule(vma, shape, axes, n, *, scatter_dimension=0, tiled=False):
    shape = list(shape)
    if tiled:
        shape[scatter_dimension] //= n
    else:
        del shape[scatter_dimension]
    return frozenset(vma) | frozenset(axes), tuple(shape)


@entry(identity_without_axes=True)
def psum_scatter(x, axis_name, *, scatter_dimension=0, tiled=False):
    """Sum over the devices of `axis_name`, each keeping its own slice of `scatter_dimension`.

    `tiled=True`: the dimension (a multiple of the axis size n) is cut into n
    blocks and device k keeps the sum of block k (the dimension shrinks n-fold);
    `tiled=False`, as JAX: the dimension must equal n, and device k keeps the
    sum of index k, the dimension removed.  Dtypes as `psum`: booleans are
    counted in int32 (JAX's psum_scatter refuses booleans).
    """
    api = "psum_scatter"
    axes = _axes(api, axis_name)
    body, x = _operand(api, x, axes)
    n = _size(body, axes)
    if x.dim() == 0:
        raise _shape_error(api, axes, body, x, "the operand needs a dimension to scatter",
                           "psum_scatter a value with at least one dimension")
    d = _dim(api, "scatter_dimension", scatter_dimension, x.dim())
    _check_split(api, axes, body, x, d, n, _flag(api, "tiled", tiled), f"dimension {d}")
    x = _countable(x, api, axes)
    phys = _varying(x, axes, body)
    out, paxes = body.backend.psum_scatter(phys, x._paxes, axes, body, x.shape, d, tiled)
    return _out(out, paxes, _varies(x._vma, (), axes, 0)[0], body, src=x)


# --------------------------------------------------------------------------
# ppermute: V{A} -> V{A}                    transpose: ppermute(inverse perm)
# --------------------------------------------------------------------------
_collective("ppermute", "V{A} -> V{A}", "ppermute")(_varies)
_collective("pshuffle", "V{A} -> V{A}", "pshuffle", logged=False)(_varies)


@entry(identity_without_axes=True)
def ppermute(x, axis_name, perm):
    """Send each device's block along `(src, dst)` pairs; devices with no source get zeros."""
    api = "ppermute"
    axes = _axes(api, axis_name)
    body, x = _operand(api, x, axes)
    n = _size(body, axes)
    pairs = _check_perm(api, perm, n, axes, body)
    phys = _varying(x, axes, body)
    out, paxes = body.backend.ppermute(phys, x._paxes, axes, body, x.shape, pairs)
    return _out(out, paxes, _varies(x._vma, (), axes, 0)[0], body, src=x)


# --------------------------------------------------------------------------
# pshuffle: V{A} -> V{A}                    transpose: pshuffle(inverse perm); a ppermute
# --------------------------------------------------------------------------
@entry(identity_without_axes=True)
def pshuffle(x, axis_name, perm):
    """Device i receives the block of device `perm[i]`; `perm` must be a permutation."""
    api = "pshuffle"
    axes = _axes(api, axis_name)
    body = context.body_for_axes(api, axes)
    n = _size(body, axes)
    try:
        perm = list(perm)
    except TypeError:
        perm = None
    if perm is None or not all(type(p) is int for p in perm) or sorted(perm) != list(range(n)):
        raise CollectiveArgumentError(
            f"pshuffle: perm must be a permutation of range({n}) for axis {fmt_axes(axes)} of size {n}, "
            f"got {perm}. Fix: list each device index exactly once."
        )
    return ppermute(x, axes, [(s, d) for d, s in enumerate(perm)])


# --------------------------------------------------------------------------
# all_to_all: V{A} -> V{A}                  transpose: all_to_all(concat_axis, split_axis)
# --------------------------------------------------------------------------
@_collective("all_to_all", "V{A} -> V{A}", "all_to_all")
def _all_to_all_rule(vma, shape, axes, n, *, split_axis=0, concat_axis=0, tiled=False):
    shape = list(shape)
    if tiled:
        shape[split_axis] //= n
        shape[concat_axis] *= n
    else:  # the split dimension (of size n) moves to concat_axis
        del shape[split_axis]
        shape.insert(concat_axis, n)
    return frozenset(vma) | frozenset(axes), tuple(shape)


@entry(identity_without_axes=True)
def all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=False):
    """Device d sends chunk j of `split_axis` to device j; chunks are concatenated at `concat_axis`.

    Untiled: `split_axis` must equal the axis size and is removed; a new
    dimension of that size appears at `concat_axis`.  Tiled: `split_axis`
    shrinks and `concat_axis` grows by the axis size.
    """
    api = "all_to_all"
    axes = _axes(api, axis_name)
    body, x = _operand(api, x, axes)
    n = _size(body, axes)
    rank = x.dim()
    if rank == 0:
        raise _shape_error(api, axes, body, x, "the operand needs a dimension to split",
                           "all_to_all a value with at least one dimension")
    sa = _dim(api, "split_axis", split_axis, rank)
    ca = _dim(api, "concat_axis", concat_axis, rank)
    _check_split(api, axes, body, x, sa, n, _flag(api, "tiled", tiled), f"split_axis {sa}")
    phys = _varying(x, axes, body)
    out, paxes = body.backend.all_to_all(phys, x._paxes, axes, body, x.shape, sa, ca, tiled)
    return _out(out, paxes, _varies(x._vma, (), axes, 0)[0], body, src=x)


# --------------------------------------------------------------------------
# axis_index: -> V{A} (int64 scalar)        axis_size: -> Python int
# --------------------------------------------------------------------------
@_collective("axis_index", "-> V{A}", None, logged=False)
def _index_rule(vma, shape, axes, n):
    return frozenset(axes), ()


def axis_index(axis_name):
    """This device's index along `axis_name` (a tuple is linearised major-to-minor; no axes: 0, as JAX's)."""
    if no_axes(axis_name):
        body = context.current()
        if body is None:
            raise UnboundAxisError("axis_index(()): no shard_map or pmap body is running (collectives only work "
                                   "inside one). Fix: call it inside a body.")
        return plain_value(torch.zeros((), dtype=torch.int64, device=body.mesh.device), body)
    axes = _axes("axis_index", axis_name)
    body = context.body_for_axes("axis_index", axes)
    device = body.mesh.device or torch.get_default_device()
    phys, paxes = body.backend.axis_index(axes, body, device, not body.check_vma)
    return _out(phys, paxes, _index_rule((), (), axes, 0)[0], body)


def axis_size(axis_name) -> int:
    """Number of devices along `axis_name` (product for a tuple; no axes: 1, as JAX's)."""
    if no_axes(axis_name):
        return 1
    axes = _axes("axis_size", axis_name)
    body = context.body_for_axes("axis_size", axes)
    return _size(body, axes)


def describe_vma(x) -> str:
    body = x._body if isinstance(x, ShTensor) else context.current()
    order = body.axes if body is not None else None
    return fmt_vma(vma(x), order)


#: collective -> the collective its transpose performs (None: no communication); from `COLLECTIVES`
TRANSPOSES = {name: c.transpose for name, c in COLLECTIVES.items()}
