"""Unreduced values: pending sums, and which ordinary ops keep them pending.

A value unreduced along axes U holds, on each device, one term of a sum over
the devices of U; its logical value is that sum.  Delaying the sum lets a
program fuse reductions (psum of a sum instead of a sum of psums) and hand a
`Partial` result across the shard_map boundary.  Only ops that are linear in
the pending value commute with the sum, so only those may touch it:

- structure and reductions of one pending value (views, indexing, sum, mean,
  negation, dtype casts ...);
- sums and differences of values pending along the same axes;
- products with values that are the same on every device of U (invariant
  along U), with the pending value in a linear slot (e.g. the numerator).

Anything else raises, naming the op and the fix (`psum` first).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .errors import VmaError, fmt_vma, op_name

_T = torch.Tensor


#: where an op named in the tables below may live
_OWNERS = (torch, torch.Tensor, F, torch.linalg)


def _ops(*groups) -> frozenset:
    """The torch callables named in `groups`, as `__torch_function__` receives them: functions,
    Tensor methods, and the getters of Tensor properties (`x.T`).  Keyed by the callables, not
    their names, so an unrelated function that happens to share a name is not taken for one."""
    out = set()
    for g in groups:
        for n in g.split():
            for owner in _OWNERS:
                obj = inspect.getattr_static(owner, n, None) if owner is torch.Tensor else getattr(owner, n, None)
                if obj is None:
                    continue
                out.add(obj.__get__ if hasattr(obj, "__get__") and not callable(obj) else obj)
    return frozenset(out)


#: linear in their single tensor argument (other arguments are not tensors)
UNARY = _ops(
    "view view_as reshape reshape_as transpose permute t flatten unflatten squeeze unsqueeze expand expand_as",
    "__getitem__ narrow select split chunk unbind movedim moveaxis swapaxes flip roll repeat tile diagonal",
    "tril triu sum mean neg __neg__ negative clone contiguous to float double half bfloat16 type cumsum",
    "T mT H real detach __pos__ positive",
)
#: sums of values pending along the same axes
ADDITIVE = _ops("add sub subtract __add__ __sub__ __radd__ __rsub__ __iadd__ __isub__ add_ sub_ cat concat stack")
#: bilinear: exactly one pending operand, the others invariant along its axes
PRODUCT = _ops(
    "mul multiply __mul__ __rmul__ __imul__ mul_ matmul __matmul__ __rmatmul__ mm bmm einsum linear",
    "div divide true_divide __truediv__ __itruediv__ div_ tensordot inner outer dot vdot",
)
#: for these, only the first tensor argument may be the pending one
NUMERATOR_ONLY = _ops("div divide true_divide __truediv__ __itruediv__ div_")
#: sums: adding a Python number (other than 0) to a pending value would add it once per device
_SUMS = _ops("add sub subtract __add__ __sub__ __radd__ __rsub__ __iadd__ __isub__ add_ sub_")


def check(func, operands, body, has_number=False, args=(), kwargs=None) -> frozenset:
    """The unreduced axes of `func(*operands)`, or a VmaError if the op is not linear in them.

    `operands` are the tensor arguments in order (body values and plain tensors);
    `has_number` says whether a Python number is among the other arguments; `args` and
    `kwargs` are the call's own (a number before the pending divisor, a cast's dtype).
    """
    pending = [getattr(o, "_unreduced", frozenset()) for o in operands]
    axes = frozenset().union(*pending)
    if not axes:
        return axes
    name = op_name(func)
    order = body.axes
    if any(p and p != axes for p in pending):
        raise VmaError(
            f"{name}: operands are unreduced along different axes ({', '.join(fmt_vma(p, order) for p in pending if p)}); "
            "their pending sums cannot be combined. Fix: psum each over its axes first."
        )
    n_pending = sum(1 for p in pending if p)
    if func in _CASTS:
        _check_cast(name, operands[0], args, kwargs or {}, axes, order)
    if func in UNARY and n_pending == 1 and not any(
        getattr(o, "_vma", frozenset()) & axes for o, p in zip(operands, pending) if not p
    ):
        return axes  # e.g. indexing by an index tensor that is the same on every device of the axes
    if func in ADDITIVE and all(pending) and not (has_number and func in _SUMS):
        return axes
    if func in PRODUCT and n_pending == 1:
        k = next(i for i, p in enumerate(pending) if p)
        others = [o for i, o in enumerate(operands) if i != k]
        varying_others = [o for o in others if getattr(o, "_vma", frozenset()) & axes]
        if func in NUMERATOR_ONLY and (k != 0 or (args and not isinstance(args[0], torch.Tensor))):
            # (`torch.div(2.0, u)`: the number is the numerator, the pending value the divisor)
            raise VmaError(
                f"{name}: dividing by a value unreduced along {fmt_vma(axes, order)} is not linear in the "
                "pending sum. Fix: psum the divisor first."
            )
        if func is F.linear and len(operands) > 2:
            raise VmaError(
                f"linear with a bias on a value unreduced along {fmt_vma(axes, order)} would add the bias once per "
                "device. Fix: use bias=None and add the bias after psum."
            )
        if not varying_others:
            return axes
        raise VmaError(
            f"{name}: multiplying a value unreduced along {fmt_vma(axes, order)} by a value that varies along "
            f"{fmt_vma(varying_others[0]._vma & axes, order)} is not linear in the pending sum. "
            "Fix: psum the unreduced value first."
        )
    raise VmaError(
        f"{name}: got a value unreduced along {fmt_vma(axes, order)} (a pending sum over those devices); "
        f"{name} does not commute with that sum"
        + (" (adding a value that is not pending would add it once per device)" if func in ADDITIVE else "")
        + f". Fix: reduce it first, e.g. `shmap.psum(x, {_lit(axes, order)})`."
    )


#: dtype casts in UNARY whose target is an argument (`to`, `type`)
_CASTS = _ops("to type")


def _check_cast(name, x, args, kwargs, axes, order):
    """A cast of a pending sum commutes with the sum only into a floating or complex dtype (up to rounding):
    to bool each term becomes 0 or 1, to an integer each float term is truncated."""
    target = kwargs.get("dtype")
    for a in args[1:]:
        if target is None and isinstance(a, torch.dtype):
            target = a
        elif target is None and isinstance(a, torch.Tensor):  # `to(other)`
            target = a.dtype
    src = getattr(x, "dtype", None)
    if target is None or target.is_floating_point or target.is_complex:
        return
    if target is torch.bool or (src is not None and (src.is_floating_point or src.is_complex)):
        raise VmaError(
            f"{name}: casting a value unreduced along {fmt_vma(axes, order)} (a pending sum) to "
            f"{str(target).replace('torch.', '')} does not commute with the sum (each term would be "
            f"{'made 0 or 1' if target is torch.bool else 'truncated'}). Fix: reduce it first, e.g. "
            f"`shmap.psum(x, {_lit(axes, order)})`, then cast."
        )


def _lit(axes, order):
    axes = [a for a in order if a in axes]
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
