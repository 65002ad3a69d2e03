"""Helpers both runtimes share: argument checks, kernel names, poisoning, comparisons."""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from .errors import KernelUsageError
from .refs import Ref


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with a value that makes reads of never-written memory visible."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(False)
    return t.fill_(torch.iinfo(t.dtype).min)


def fit_value(value, dst: torch.Tensor, ref: Ref) -> torch.Tensor:
    """`value` as a tensor that can be copied into `dst` (same shape, or broadcastable)."""
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=dst.dtype)
    if value.shape != dst.shape and (
            value.dim() > dst.dim() or any(v not in (1, d) for v, d in
                                           zip(reversed(value.shape), reversed(dst.shape)))):
        raise KernelUsageError(
            f"write to {ref.describe()}: value of shape {tuple(value.shape)} does not fit "
            f"a ref of shape {tuple(dst.shape)}")
    return value


@functools.lru_cache(maxsize=512)
def kernel_param_names(kernel: Callable, count: int) -> list[str] | None:
    """Names of the kernel's first `count` positional parameters, for messages."""
    try:
        params = list(inspect.signature(kernel).parameters.values())
    except (TypeError, ValueError):
        return None
    names = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            names += [f"{p.name}[{i}]" for i in range(count - len(names))]
    return names[:count] if len(names) >= count else None


@functools.lru_cache(maxsize=512)
def check_kernel_arity(kernel, n_in, n_out, n_scratch) -> None:
    total = n_in + n_out + n_scratch
    try:
        sig = inspect.signature(kernel)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*range(total))
    except TypeError:
        raise KernelUsageError(
            f"kernel {getattr(kernel, '__name__', kernel)!r} is called with {total} refs "
            f"({n_in} inputs, {n_out} outputs, {n_scratch} scratch), in that order, "
            f"but its signature is {sig}") from None


def normalize_inputs(inputs) -> list[list[torch.Tensor]]:
    if isinstance(inputs, torch.Tensor) or not len(inputs):
        raise KernelUsageError(
            "inputs_per_device must be a non-empty list with one entry per device, each a list "
            "of tensors, e.g. [[x0], [x1]] for two devices and one input")
    per_dev = [[t] if isinstance(t, torch.Tensor) else list(t) for t in inputs]
    first = per_dev[0]
    for d, ts in enumerate(per_dev):
        if len(ts) != len(first):
            raise KernelUsageError(
                f"inputs_per_device: device 0 has {len(first)} inputs, device {d} has {len(ts)}")
        for i, (a, b) in enumerate(zip(first, ts)):
            if not isinstance(b, torch.Tensor):
                raise KernelUsageError(f"inputs_per_device[{d}][{i}] is not a tensor")
            if a.shape != b.shape or a.dtype != b.dtype:
                raise KernelUsageError(
                    f"inputs_per_device[{d}][{i}] is {tuple(b.shape)} {b.dtype} but device 0's is "
                    f"{tuple(a.shape)} {a.dtype}; every device's block must have the same shape")
    return per_dev


def same_outputs(a: list, b: list) -> bool:
    """Bitwise equality (NaN equal to NaN) of nested lists of tensors."""
    return all(torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)
               if x.dtype.is_floating_point or x.dtype.is_complex else torch.equal(x, y)
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))


