"""`torch._foreach_*` on body values: one call over many tensors, typed index by index.

An optimizer step runs the same few elementwise ops on every parameter;
`torch.optim` (and the training recipe's Adam) batch them with
`torch._foreach_*` so that one call covers every tensor.  In a body each op
on a body value pays for typing (`ShTensor.__torch_function__`), so a step
over many small tensors is dominated by it: here one foreach call is typed
once per list position with plain set comparisons, and runs once on the
physical tensors.

The fast path takes the common case of an elementwise op (any op on the
distributed mesh, where a value is its block): at every position the body values
(a parameter, its gradient, its moments) are of one body, one type (vma), one
layout, and nothing else is a tensor but a 0-d invariant factor outside
autograd (a clipping scale).  The same rule as the elementwise fast
path in tensor.py: nothing to lift, so the physical op is the op.  An
in-place foreach (`_foreach_add_`, as torch.optim writes its updates) takes
it too, after each target passes the per-tensor in-place checks (not an
argument of the body, its own storage); since every operand at a position
has the target's type, the type rule holds as it is.  Any other call (mixed
types at a position, a closed-over tensor) runs as its per-tensor op at each
position, through ordinary dispatch: slower, never different.  functorch has
no batching rule for foreach ops, so on the simulated mesh this is also what
makes them work at all.
"""
from __future__ import annotations

import torch

from . import batching, cow
from .errors import VmaError
from .tensor import _NUMBER, _SPECIAL, ShTensor, _check_inplace


def _positions(args, kwargs):
    """The number of list positions (the length of the first list argument)."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            return len(a)
    return 0


def _typed_positions(args, kwargs, n):
    """[(paxes, vma, body, physical rank)] per position when the fast path applies, else None."""
    types = [None] * n
    scalar = None
    for a in list(args) + list(kwargs.values()):
        if not isinstance(a, (list, tuple, torch.Tensor)):  # a number, None, a dtype
            continue
        if type(a) is ShTensor and scalar is None and _plain_scalar(a):
            scalar = a
            continue
        if not isinstance(a, (list, tuple)) or len(a) != n:
            return None
        for i, x in enumerate(a):
            if isinstance(x, _NUMBER):
                continue
            if type(x) is not ShTensor or x._unreduced or not x._body.active:
                return None
            t = types[i]
            if t is None:
                types[i] = (x._paxes, x._vma, x._body, x._phys.dim())
            elif t[2] is not x._body or t[1] != x._vma or t[0] != x._paxes or t[3] != x._phys.dim():
                return None
    if any(t is None for t in types) or (scalar is not None and any(t[2] is not scalar._body for t in types)):
        return None
    return types


def _plain_scalar(x) -> bool:
    """A 0-d invariant body value no gradient flows to (a clipping factor): it multiplies a value
    of any type as it is, since lifting it (pvary) would only matter to its own gradient."""
    return (x.dim() == 0 and not x._vma and x._body.active
            and not (torch.is_grad_enabled() and x._phys.requires_grad))


def _phys(a):
    if isinstance(a, (list, tuple)):
        return [x._phys if type(x) is ShTensor else x for x in a]
    return a._phys if type(a) is ShTensor else a


def _per_tensor_op(name):
    """The op a foreach op applies at each position, e.g. `_foreach_lerp` -> `torch.lerp`."""
    base = name[len("_foreach_"):]
    if base.endswith("_"):
        op = getattr(torch.Tensor, base, None)
    elif base == "norm":
        return lambda t, ord=2, dtype=None: torch.linalg.vector_norm(t, ord, dtype=dtype)
    elif base == "max":
        return torch.amax
    else:
        op = getattr(torch, base, None)
    if op is None:
        raise VmaError(
            f"torch.{name} on body values: shmap knows no per-tensor op for it. Fix: call the per-tensor "
            f"op in a loop over the list."
        )
    return op


#: foreach ops whose scalar is positional, where the per-tensor op's `value` is keyword-only
_VALUE_KEYWORD = frozenset({"_foreach_addcmul", "_foreach_addcdiv"})


def _at(a, i, n):
    return a[i] if isinstance(a, (list, tuple)) and len(a) == n else a


def _direct(name, types) -> bool:
    """Whether the foreach op runs on the physical tensors as they are: an elementwise op, or any op
    where a physical tensor is the block itself (no device dims: a reduction stays within it)."""
    return name[len("_foreach_"):].rstrip("_") in batching.POINTWISE or not types[0][2].backend.device_dims


def _foreach(func, args, kwargs):
    n = _positions(args, kwargs)
    name = func.__name__
    types = _typed_positions(args, kwargs, n)
    if types and _direct(name, types):
        if not name.endswith("_"):
            out = func(*[_phys(a) for a in args], **{k: _phys(v) for k, v in kwargs.items()})
            return [ShTensor(o, t[0], t[1], t[2]) for o, t in zip(out, types)]
        if all(type(x) is ShTensor for x in args[0]):  # in place: each target checked as its per-tensor op's
            for x in args[0]:
                _check_inplace(func, x, x._vma, x._body)  # (every operand at its position has x's type)
                cow.before_write(func, x)
            func(*[_phys(a) for a in args], **{k: _phys(v) for k, v in kwargs.items()})
            for x in args[0]:
                x._lifts = None
                if x._source is not None:  # (`[p.data for p in ...]`: see tensor._dispatch)
                    x._source._lifts = None
            return None
    op = _per_tensor_op(name)
    if name.rstrip("_") in _VALUE_KEYWORD and len(args) > 3:
        # The foreach op takes its scalar(s) positionally (torch.optim's Adam does); the per-tensor op's
        # `value` is keyword-only.  A tensor of scalars gives one per position.
        value = args[3]
        if isinstance(value, torch.Tensor) and type(value) is not ShTensor:
            value = value.tolist()
        args, kwargs = args[:3], {**kwargs, "value": value}
    outs = [op(*[_at(a, i, n) for a in args], **{k: _at(v, i, n) for k, v in kwargs.items()}) for i in range(n)]
    return None if name.endswith("_") else outs


for _name in dir(torch):
    if _name.startswith("_foreach_"):
        _SPECIAL[getattr(torch, _name)] = _foreach
