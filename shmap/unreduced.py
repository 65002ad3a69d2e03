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

import torch
import torch.nn.functional as F

from .errors import VmaError, fmt_vma

_T = torch.Tensor


def _names(*objs):
    out = set()
    for o in objs:
        for n in o.split():
            out.add(n)
    return frozenset(out)


#: linear in their single tensor argument (other arguments are not tensors)
UNARY = _names(
    "view view_as reshape reshape_as transpose permute t flatten unflatten squeeze unsqueeze expand expand_as",
    "__getitem__ narrow select split chunk unbind movedim moveaxis swapaxes flip roll repeat tile diagonal",
    "tril triu sum mean neg __neg__ negative clone contiguous to float double half bfloat16 type cumsum",
    "T mT H real detach __pos__ positive",
)
#: sums of values pending along the same axes
ADDITIVE = _names("add sub subtract __add__ __sub__ __radd__ __rsub__ __iadd__ __isub__ add_ sub_ cat concat stack")
#: bilinear: exactly one pending operand, the others invariant along its axes
PRODUCT = _names(
    "mul multiply __mul__ __rmul__ __imul__ mul_ matmul __matmul__ __rmatmul__ mm bmm einsum linear",
    "div divide true_divide __truediv__ __itruediv__ div_ tensordot inner outer dot vdot",
)
#: for these, only the first tensor argument may be the pending one
NUMERATOR_ONLY = _names("div divide true_divide __truediv__ __itruediv__ div_")


def _fname(func):
    return getattr(func, "__name__", None) or repr(func)


_SUMS = _names("add sub subtract __add__ __sub__ __radd__ __rsub__ __iadd__ __isub__ add_ sub_")


def check(func, operands, body, has_number=False) -> frozenset:
    """The unreduced axes of `func(*operands)`, or a VmaError if the op is not linear in them.

    `operands` are the tensor arguments in order (body values and plain tensors);
    `has_number` says whether a Python number is among the other arguments.
    """
    pending = [getattr(o, "_unreduced", frozenset()) for o in operands]
    axes = frozenset().union(*pending)
    if not axes:
        return axes
    name = _fname(func)
    if func is F.linear:
        name = "linear"
    order = body.axes
    if any(p and p != axes for p in pending):
        raise VmaError(
            f"{name}: operands are unreduced along different axes ({', '.join(fmt_vma(p, order) for p in pending if p)}); "
            "their pending sums cannot be combined. Fix: psum each over its axes first."
        )
    n_pending = sum(1 for p in pending if p)
    if name in UNARY and n_pending == 1 and not any(
        getattr(o, "_vma", frozenset()) & axes for o, p in zip(operands, pending) if not p
    ):
        return axes  # e.g. indexing by an index tensor that is the same on every device of the axes
    if name in ADDITIVE and all(pending) and not (has_number and name in _SUMS):
        return axes
    if name in PRODUCT and n_pending == 1:
        k = next(i for i, p in enumerate(pending) if p)
        others = [o for i, o in enumerate(operands) if i != k]
        varying_others = [o for o in others if getattr(o, "_vma", frozenset()) & axes]
        if name in NUMERATOR_ONLY and k != 0:
            raise VmaError(
                f"{name}: dividing by a value unreduced along {fmt_vma(axes, order)} is not linear in the "
                "pending sum. Fix: psum the divisor first."
            )
        if name == "linear" and len(operands) > 2:
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
        + (" (adding a value that is not pending would add it once per device)" if name in ADDITIVE else "")
        + f". Fix: reduce it first, e.g. `shmap.psum(x, {_lit(axes, order)})`."
    )


def _lit(axes, order):
    axes = [a for a in order if a in axes]
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
