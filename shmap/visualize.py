"""`visualize_sharding`: a text picture of which device holds which block of a global value."""
from __future__ import annotations

import itertools
import math

import torch

from .dtensor import is_dtensor, spec_from_placements
from .mesh import Mesh, PartitionSpec


def visualize_sharding(x, mesh: Mesh | None = None, spec: PartitionSpec | None = None) -> str:
    """A text picture of which device holds which block of a global value.

    `x` is a tensor, a DTensor (mesh and spec default to its own) or a shape.
    Works for simulated and distributed meshes alike (devices are ranks on a
    distributed mesh).  Returns the picture; `print` it.
    """
    if is_dtensor(x):
        if mesh is None:
            dm = x.device_mesh
            mesh = Mesh(dm.mesh, dm.mesh_dim_names or tuple(f"dim{k}" for k in range(dm.ndim)), device_mesh=dm)
        if spec is None:
            spec = spec_from_placements(mesh, tuple(x.placements), x.dim())
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"visualize_sharding: mesh must be a shmap.Mesh, got {type(mesh).__name__}.")
    if mesh is None or spec is None:
        raise TypeError(
            "visualize_sharding: give the mesh and the spec, e.g. visualize_sharding(x, mesh, P('i')) "
            "(they default to a DTensor's own)."
        )
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else _shape_arg(x)
    from .shard_map import _check_spec

    _check_spec(spec, "spec", shape, mesh, mesh.axis_names, "visualize_sharding", what="the value")
    blocks: dict = {}
    for coords in itertools.product(*(range(s) for s in mesh.axis_sizes)):
        c = dict(zip(mesh.axis_names, coords))
        box = []
        for d, size in enumerate(shape):
            axes = spec.dim_axes(d)
            n = math.prod(mesh.shape[a] for a in axes)
            idx = 0
            for a in axes:
                idx = idx * mesh.shape[a] + c[a]
            b = size // n
            box.append((idx * b, idx * b + b))
        blocks.setdefault(tuple(box), []).append(int(mesh.devices[coords]))
    who = "rank" if mesh.is_distributed else "device"
    head = f"global shape {shape} as {spec} on mesh {mesh.describe()}" + (
        " (one process per device)" if mesh.is_distributed else " (simulated)"
    )
    if spec.unreduced:
        head += (f"\na pending sum over {', '.join(repr(a) for a in mesh.axis_names if a in spec.unreduced)}: "
                 f"each {who} listed holds one term of its block")
    legend = f"{who} = ({', '.join(mesh.axis_names)}): " + ", ".join(
        f"{int(mesh.devices[c])} = {c}" for c in itertools.product(*(range(s) for s in mesh.axis_sizes))
    )
    if len(shape) == 0:
        return "\n".join([head, f"scalar, held whole by every {who}: " + _devs(next(iter(blocks.values()))),
                          legend])
    if len(shape) > 2:
        lines = [head]
        for box, devs in sorted(blocks.items()):
            lines.append(f"  [{', '.join(f'{a}:{b}' for a, b in box)}] on {who} {_devs(devs)}")
        return "\n".join(lines + [legend])
    return "\n".join([head, _grid(shape, blocks), legend])


def _shape_arg(x) -> tuple:
    """`visualize_sharding`'s `x` given as a shape: a sequence of non-negative ints, or a clear error."""
    ok = isinstance(x, (tuple, list, torch.Size)) and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in x)
    if not ok:
        raise TypeError(
            f"visualize_sharding: x must be a tensor, a DTensor or a shape (a tuple of non-negative ints); got "
            f"{type(x).__name__} {x!r}. Fix: pass the tensor itself, or its shape, e.g. (8, 4).")
    return tuple(x)


def _devs(devs) -> str:
    return ", ".join(str(d) for d in sorted(devs))


def _grid(shape, blocks) -> str:
    """A box picture: rows are ranges of dimension 0 (if 2-D), columns of the last dimension."""
    two = len(shape) == 2
    rows = sorted({b[0] for b in blocks}) if two else [None]
    cols = sorted({b[-1] for b in blocks})
    cell = {}
    for box, devs in blocks.items():
        cell[(box[0] if two else None, box[-1])] = _devs(devs)
    width = max(len(v) for v in cell.values()) + 2
    col_labels = [f"{a}:{b}" for a, b in cols]
    width = max(width, max(len(c) for c in col_labels) + 2)
    row_labels = [f"{r[0]}:{r[1]}" if r else "" for r in rows]
    lw = max(len(r) for r in row_labels)
    pad = " " * (lw + 1)
    lines = [pad + " " + "".join(c.center(width + 1) for c in col_labels)]
    lines.append(pad + "┌" + "┬".join("─" * width for _ in cols) + "┐")
    for k, (r, label) in enumerate(zip(rows, row_labels)):
        lines.append(label.rjust(lw) + " │" + "│".join(cell[(r, c)].center(width) for c in cols) + "│")
        if k < len(rows) - 1:
            lines.append(pad + "├" + "┼".join("─" * width for _ in cols) + "┤")
    lines.append(pad + "└" + "┴".join("─" * width for _ in cols) + "┘")
    return "\n".join(lines)
