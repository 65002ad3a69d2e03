"""The simulated mesh's fallback for an op vmap cannot batch: run it once per device.

`batching.run_batched` runs an op once over every device with functorch's
vmap.  Some ops have no batching rule (RNNs), some decompositions do in-place
arithmetic vmap refuses (`cross_entropy` with class weights and label
smoothing), and an op whose output shape depends on values (boolean-mask
indexing, `unique`) cannot be batched at all.  On a process each device runs
the op on its own block; here it runs device by device in the same way and the
results are stacked: slower, never different.  An error the op raises on one
device is that device's error, with its per-device shapes, as a process would
report it.  Results of different shapes on different devices would be a value
with no single per-device shape: refused, naming the op.
"""
from __future__ import annotations

import itertools

import optree
import torch

from .errors import VmaError, op_name, shared_write

#: what vmap says when it cannot batch an op (an in-place op retried only then: it failed before writing)
_VMAP_REFUSALS = ("vmap", "Batching rule", "batched", "Batched", "batching")


def retry(func, leaves, treedef, batched, out_paxes, body, run, unflatten, error: Exception):
    """`func` once per device of `out_paxes` on each device's block of `leaves` (`batched`: (leaf index,
    its device axes)); the results stacked with leading device dims in mesh order.  `error` is vmap's
    (None: not tried, under autocast, whose casts vmap would drop)."""
    from .tensor import _is_inplace  # (tensor imports batching, which imports this module)

    inplace = _is_inplace(func)
    if inplace and error is not None and not any(m in str(error) for m in _VMAP_REFUSALS):
        raise error
    sizes = [body.sizes[a] for a in out_paxes]
    outs, devices = [], list(itertools.product(*(range(n) for n in sizes)))
    done = {k for k, _ in batched}
    # Tensors that are the same on every device (closed over, invariant): an op that writes one from varying
    # data (BatchNorm's running statistics) would have each device write it in turn.  (Not every such write
    # bumps the version counter: the values are compared, after the first device.)
    shared = [(t, t.detach().clone()) for k, t in enumerate(leaves) if k not in done and isinstance(t, torch.Tensor)]
    for idx in devices:
        coord = dict(zip(out_paxes, idx))
        per = list(leaves)
        for k, paxes in batched:
            per[k] = leaves[k][tuple(coord[a] for a in paxes)]  # (a view: an in-place op writes the block)
        args, kwargs = unflatten(treedef, per)
        try:
            outs.append(run(func, args, kwargs))
            if idx == devices[0]:
                _check_shared(func, shared, body)
        except VmaError:
            raise
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"(shmap: raised by {op_name(func)} on device {_where(out_paxes, idx)} of mesh "
                           f"{body.describe()}, run device by device: "
                           + (f"vmap cannot batch it, {_first_line(error)})" if error is not None
                              else "under autocast)"))
            raise
    if inplace:
        return None  # (`_dispatch` returns the target itself)
    return _stack(func, outs, devices, sizes, out_paxes, body)


def _stack(func, outs, devices, sizes, out_paxes, body):
    flat = [optree.tree_flatten(o, none_is_leaf=True) for o in outs]
    treedef = flat[0][1]
    stacked = []
    for j, first in enumerate(flat[0][0]):
        column = [f[0][j] for f in flat]
        if not isinstance(first, torch.Tensor):
            if any(c != first for c in column):
                raise VmaError(f"{op_name(func)}: returns {first!r} on device {_where(out_paxes, devices[0])} but "
                               f"other values on other devices (mesh {body.describe()}); a body value is one per "
                               "device. Fix: compute it from tensors, or reduce it first.")
            stacked.append(first)
            continue
        shapes = {tuple(c.shape) for c in column}
        if len(shapes) > 1:
            raise shapes_differ(func, [tuple(c.shape) for c in column], [_where(out_paxes, d) for d in devices], body)
        stacked.append(torch.stack(column).reshape(*sizes, *first.shape))
    return optree.tree_unflatten(treedef, stacked)


def shapes_differ(func, shapes, devices, body) -> VmaError:
    """The error for a result whose shape differs by device: `shapes[k]` on device `devices[k]` (described,
    e.g. "(i=0)"), each shape named once, by its first device.  Raised alike on both meshes: here after
    the per-device runs, on processes after comparing the shapes (`value_shaped`)."""
    where: dict = {}
    for s, d in zip(shapes, devices):
        where.setdefault(s, d)
    listed = "; ".join(f"device {w}: {s}" for s, w in where.items())
    return VmaError(
        f"{op_name(func)}: its result has a different shape on different devices ({listed}; mesh "
        f"{body.describe()}): its shape depends on each device's values (unique, nonzero, a boolean "
        "mask), and a shard_map value has one per-device shape. Fix: keep shapes fixed, e.g. "
        "torch.where(mask, x, 0) instead of x[mask], or pad to a common size."
    )


#: torch functions whose result's shape depends on the operand's values (always, or `value_shaped` says when)
_VALUE_SHAPED = frozenset((
    torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.masked_select,
    torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
    torch.Tensor.unique_consecutive, torch.bincount, torch.Tensor.bincount, torch.repeat_interleave,
    torch.Tensor.repeat_interleave, torch.Tensor.__getitem__, torch.where))


def value_shaped(func, leaves) -> bool:
    """Whether `func` on `leaves` (its flattened arguments) makes a result whose shape depends on the
    values: on processes each device runs it alone, so its result's shape is compared across the devices
    (`Distributed.run_op`), as the per-device runs here compare them.  Indexing only with a boolean (or
    uint8) mask, `torch.where` only in its one-argument form, `repeat_interleave` only with a tensor of
    repeats."""
    try:
        if func not in _VALUE_SHAPED:
            return False
    except TypeError:  # an unhashable callable
        return False
    if func is torch.Tensor.__getitem__:
        return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in leaves[1:])
    if func is torch.where:
        return len(leaves) == 1
    if func is torch.repeat_interleave or func is torch.Tensor.repeat_interleave:
        return len(leaves) == 1 or any(isinstance(t, torch.Tensor) for t in leaves[1:])
    return True


def _check_shared(func, shared, body):
    """Refuse (and undo) a write to a tensor every device shares, from the first device's values."""
    changed = [(t, b) for t, b in shared if not _same(t.detach(), b)]
    if not changed:
        return
    with torch.no_grad():
        for t, before in changed:
            t.copy_(before)  # (as they were: the call fails)
    raise shared_write(op_name(func), changed[0][0].shape, body.describe())


def _same(a, b) -> bool:
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


def _where(out_paxes, idx) -> str:
    return "(" + ", ".join(f"{a}={i}" for a, i in zip(out_paxes, idx)) + ")"


def _first_line(e) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else type(e).__name__
