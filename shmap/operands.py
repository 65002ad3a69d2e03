"""The collectives' shared plumbing: the axis argument, the operand's body and type, the
implicit `pvary`, the result's type, and the shape and permutation checks (`collectives.py`)."""
from __future__ import annotations

import functools
import math
import numbers
import operator

import optree
import torch

from . import context, cow, nesting
from .errors import CollectiveArgumentError, CollectiveShapeError, VmaError, as_tensor_arg, fmt_axes, fmt_vma
from .tensor import ShTensor, lift


def _axes(api: str, axis_name) -> tuple:
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, (tuple, list)) and axis_name and all(isinstance(a, str) for a in axis_name):
        if len(set(axis_name)) != len(axis_name):
            raise CollectiveArgumentError(
                f"{api}: axis_name {tuple(axis_name)} repeats an axis. Fix: name each mesh axis once."
            )
        return tuple(axis_name)
    x = "" if api in ("axis_index", "axis_size") else "x, "  # (they take no operand)
    none = " (JAX's pmax and pmin refuse no axes too; psum and the others are then the identity)" \
        if no_axes(axis_name) else ""
    raise TypeError(
        f"{api}: axis_name must be a mesh axis name (str) or a non-empty tuple of names, "
        f"got {axis_name!r}{none}. Fix: e.g. {api}({x}'i') or {api}({x}('i', 'j'))."
    )


def plain_value(t: torch.Tensor, body) -> ShTensor:
    """A plain tensor (closed over, made in the body, or from a number) met by a collective or returned:
    an invariant value.  With check_vma=False, an unmapped argument: JAX passes a closed-over array into
    the shard_map as an argument, so it varies on every axis and its cotangent is psum'd (the defensive
    transpose); without that, each process kept its own share of the closure's gradient."""
    if body.check_vma or body.parent is not None:
        return ShTensor(t, (), frozenset(), body)
    phys, paxes, v = body.backend.input_value(t, (), body)
    return ShTensor(phys, paxes, v, body)


_REDUCING = frozenset({"psum", "pmean", "pcast"})


def no_axes(axis_name) -> bool:
    """Whether `axis_name` names no axes (an empty tuple or list)."""
    return type(axis_name) in (tuple, list) and not axis_name


def entry(*, identity_without_axes: bool):
    """A collective `collective(x, axis_name, ...)` as JAX's take their operand: `x` may be a pytree (a list,
    tuple, dict or namedtuple of tensors), the collective applied to each leaf with the same arguments and
    the tree rebuilt around the results (one collective per leaf: `comm_log` reports each); and, with
    `identity_without_axes`, over no axes (`psum(x, ())`: code that reduces over a computed tuple of axes
    may find it empty) each leaf is itself, as a collective over no devices moves nothing.  (JAX's pmax
    and pmin refuse no axes: so do shmap's.)"""
    def wrap(collective):
        def call(x, axis_name, *args, **kwargs):
            identity = identity_without_axes and no_axes(axis_name)
            if type(x) is ShTensor or isinstance(x, (torch.Tensor, numbers.Number)):
                return x if identity else collective(x, axis_name, *args, **kwargs)
            leaves, tree = optree.tree_flatten(x)
            if optree.treespec_is_leaf(tree):
                return x if identity else collective(x, axis_name, *args, **kwargs)
            return optree.tree_unflatten(tree, [leaf if identity else collective(leaf, axis_name, *args, **kwargs)
                                                for leaf in leaves])

        functools.update_wrapper(call, collective)
        return call
    return wrap


def _operand(api: str, x, axes):
    """(body, ShTensor) for `x`; plain tensors and scalars are invariant values."""
    body = context.body_for_axes(api, axes, hint=x._body if isinstance(x, ShTensor) else None)
    if isinstance(x, ShTensor):
        if x._body is not body:
            if not nesting.encloses(x._body, body):
                raise VmaError(
                    f"{api}: the operand belongs to a different shard_map body than the one binding "
                    f"{fmt_axes(axes)}. Fix: pass the value into the inner shard_map as an argument."
                )
            x = ShTensor(x._phys, x._paxes, x._vma, body, x._unreduced)  # an enclosing body's value
        if x._unreduced and api not in _REDUCING:
            raise VmaError(
                f"{api}: the operand is unreduced along {fmt_vma(x._unreduced, body.axes)} (a pending sum). "
                f"Fix: reduce it first with shmap.psum(x, {fmt_axes(body.order(x._unreduced))})."
            )
        return body, x
    if not isinstance(x, torch.Tensor):
        x = as_tensor_arg(api, "the operand", x)
    return body, plain_value(x, body)


def _countable(x: ShTensor, api="psum", axes=()) -> ShTensor:
    """A sum's operand: booleans become int32 counts, as in JAX's psum (every other dtype is
    summed in its own dtype, integers wrapping, on both meshes)."""
    if x._phys.dtype == torch.bool:  # (the block's dtype: x.dtype would go through __torch_function__)
        return x.to(torch.int32)
    _check_reducible(api, axes, x)
    return x


#: dtypes torch can move but not reduce (no sum or max kernel on the CPU, and gloo does not carry them)
_UNREDUCIBLE = frozenset(t for t in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex32"))
    if t is not None)


def _check_reducible(api, axes, x: ShTensor):
    """The same clear error on both meshes (torch's differ: a missing CPU kernel, gloo's scalar type)."""
    dt = x._phys.dtype
    if dt in _UNREDUCIBLE:
        name = str(dt).replace("torch.", "")
        wide = "complex64" if dt.is_complex else "bfloat16"
        raise CollectiveArgumentError(
            f"{api} over {fmt_axes(axes)}: the operand is {name}, which torch can move but not reduce (no "
            f"{'sum' if api.startswith('psum') else 'max/min'} kernel for it). Fix: reduce a wider copy and cast "
            f"back, e.g. shmap.{api}(x.to(torch.{wide}), {fmt_axes(axes)}).to(x.dtype)."
        )


def _size(body, axes) -> int:
    return math.prod(body.sizes[a] for a in axes)


def _varying(x: ShTensor, axes, body):
    """Physical tensor of x typed as varying along `axes` too (JAX's implicit pvary)."""
    if not body.check_vma:
        return x._phys
    return lift(x, x._vma | frozenset(axes), body)


def _out(phys, paxes, vma_, body, *, pvary=False, src=None):
    """Wrap a backend result with the type the collective's rule gives it; it may share memory (its
    input's, or a recording view) until first written in place (`cow.py`; a pvary's always does), and
    its operand `src` may not be written meanwhile without the result keeping its values (`cow.lend`)."""
    if not body.check_vma:
        vma_ = frozenset(body.axes)
    out = cow.mark_shared(ShTensor(phys, paxes, frozenset(vma_), body), pvary)
    if src is not None:
        cow.lend(out, src)
    return out


def _dim(api, what, d, rank, allow_end=False):
    if isinstance(d, bool) or not hasattr(d, "__index__"):
        raise TypeError(f"{api}: {what} must be an int, got {d!r}. Fix: e.g. {what}=0.")
    d = d.__index__()  # (integer scalars: numpy, 0-d integer tensors)
    hi = rank + 1 if allow_end else rank
    if not -hi <= d < hi:
        raise CollectiveShapeError(
            f"{api}: {what}={d} is out of range for a per-device block of rank {rank}. "
            f"Fix: use a dimension in [{-hi}, {hi})."
        )
    return d % hi if hi else 0


def _flag(api, what, v) -> bool:
    """A boolean argument: a truthy string ('no') is not taken for True."""
    if not isinstance(v, bool):
        raise TypeError(f"{api}: {what} must be True or False, got {v!r}.")
    return v


def _check_split(api, axes, body, x, d, n, tiled, what):
    """Dimension `d` is cut into `n` chunks (tiled) or is the `n` chunks (untiled)."""
    if tiled and x.shape[d] % n:
        raise _shape_error(api, axes, body, x, f"tiled=True needs {what} divisible by {n}",
                           f"pad dimension {d} to a multiple of {n}")
    if not tiled and x.shape[d] != n:
        raise _shape_error(api, axes, body, x, f"tiled=False needs {what} to equal {n}",
                           f"use tiled=True, or reshape so dimension {d} has size {n}")


def _shape_error(api, axes, body, x, rule, fix):
    sizes = ", ".join(f"{a}={body.sizes[a]}" for a in axes)
    return CollectiveShapeError(
        f"{api} over {fmt_axes(axes)} (axis size {_size(body, axes)}: {sizes}; mesh {body.describe()}): "
        f"{rule}, but the per-device block has shape {tuple(x.shape)}. Fix: {fix}"
    )


def _check_perm(api, perm, n, axes, body):
    try:
        pairs = [(operator.index(s), operator.index(d)) for s, d in perm]
    except (TypeError, ValueError):
        raise CollectiveArgumentError(
            f"{api}: perm must be a sequence of (source, destination) integer pairs, got {perm!r}. "
            "Fix: e.g. perm=[(i, (i + 1) % n) for i in range(n)]."
        ) from None
    for s, d in pairs:
        if not (0 <= s < n and 0 <= d < n):
            raise CollectiveArgumentError(
                f"{api}: pair ({s}, {d}) is out of range for axis {fmt_axes(axes)} of size {n} "
                f"(mesh {body.describe()}). Fix: device indices must lie in [0, {n})."
            )
    for which, idx in (("source", 0), ("destination", 1)):
        seen = {}
        for p in pairs:
            if p[idx] in seen:
                raise CollectiveArgumentError(
                    f"{api}: {which} {p[idx]} appears twice in perm ({seen[p[idx]]} and {p}); each device may "
                    f"send at most once and receive at most once. Fix: make perm a partial permutation."
                )
            seen[p[idx]] = p
    return pairs
