"""Device meshes and PartitionSpecs: names and shapes only, no tensors.

A mesh arranges devices in an n-d array with named axes; a `PartitionSpec`
says, per leading tensor dimension, which mesh axes split it.  Everything here
is pure metadata so that every other layer (types, collectives, backends) can
depend on it without pulling in execution.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

AxisName = str


class PartitionSpec:
    """`P(*entries)`: one entry per leading tensor dimension.

    An entry is `None` (not split), an axis name, or a tuple of axis names (the
    dimension is split major-to-minor over several mesh axes).  Missing trailing
    entries mean `None`; `P()` is fully replicated.  Unlike JAX's, this is not a
    tuple subclass, so a spec can never be confused with a tuple of specs in a
    pytree of `in_specs`.
    """

    __slots__ = ("_entries",)

    def __init__(self, *entries):
        norm = []
        for e in entries:
            if isinstance(e, list):
                e = tuple(e)
            if isinstance(e, tuple) and len(e) == 1:
                e = e[0]
            if isinstance(e, tuple) and len(e) == 0:
                e = None
            norm.append(e)
        self._entries = tuple(norm)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)

    def __getitem__(self, i):
        return self._entries[i]

    def __eq__(self, other):
        if not isinstance(other, PartitionSpec):
            return NotImplemented
        a, b = list(self._entries), list(other._entries)
        while a and a[-1] is None:
            a.pop()
        while b and b[-1] is None:
            b.pop()
        return a == b

    def __hash__(self):
        a = list(self._entries)
        while a and a[-1] is None:
            a.pop()
        return hash(tuple(a))

    def __repr__(self):
        return "P(" + ", ".join(repr(e) for e in self._entries) + ")"

    def dim_axes(self, d: int) -> tuple[AxisName, ...]:
        """The mesh axes splitting tensor dimension `d` (empty if none)."""
        if d >= len(self._entries) or self._entries[d] is None:
            return ()
        e = self._entries[d]
        return e if isinstance(e, tuple) else (e,)

    def axes(self) -> tuple[AxisName, ...]:
        """Every mesh axis the spec mentions, in order of appearance."""
        out = []
        for d in range(len(self._entries)):
            out.extend(self.dim_axes(d))
        return tuple(out)


P = PartitionSpec


class Mesh:
    """Devices in an n-d array with named axes.

    `devices` is an integer array (torch tensor) of device ids (ranks); the
    mesh shape is its shape.  `device` is the torch device the simulated mesh
    computes on (None: wherever the inputs already are).
    """

    def __init__(self, devices, axis_names: Sequence[AxisName], *, device=None):
        devices = torch.as_tensor(devices, dtype=torch.long)
        axis_names = tuple(axis_names)
        if devices.dim() != len(axis_names):
            raise ValueError(
                f"Mesh: devices has {devices.dim()} dimensions {tuple(devices.shape)} but "
                f"{len(axis_names)} axis names {axis_names} were given; give one name per dimension."
            )
        for n in axis_names:
            if not isinstance(n, str):
                raise TypeError(f"Mesh: axis names must be strings, got {n!r} ({type(n).__name__}).")
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"Mesh: axis names must be distinct, got {axis_names}.")
        self.devices = devices
        self.axis_names = axis_names
        self.axis_sizes = tuple(int(s) for s in devices.shape)
        self.shape = dict(zip(axis_names, self.axis_sizes))
        self.size = math.prod(self.axis_sizes)
        self.device = torch.device(device) if device is not None else None

    @property
    def devices_flat(self) -> list[int]:
        return self.devices.flatten().tolist()

    def __repr__(self):
        inner = ", ".join(f"{n}={s}" for n, s in self.shape.items())
        dev = f", device={self.device}" if self.device is not None else ""
        return f"Mesh({inner}{dev})"

    def describe(self) -> str:
        """Short form used in error messages: `(i=4, j=2)`."""
        return "(" + ", ".join(f"{n}={s}" for n, s in self.shape.items()) + ")"

    def __eq__(self, other):
        return (
            isinstance(other, Mesh)
            and self.axis_names == other.axis_names
            and torch.equal(self.devices, other.devices)
            and self.device == other.device
        )

    def __hash__(self):
        return hash((self.axis_names, self.axis_sizes))


def make_mesh(shape: Iterable[int], names: Iterable[AxisName], *, device=None) -> Mesh:
    """Build a mesh of `prod(shape)` devices with the given axis names.

    Without an initialised `torch.distributed` process group this is a
    simulated mesh: every device lives in this process, on `device` (CPU by
    default, or e.g. `'cuda'`).
    """
    shape = tuple(int(s) for s in shape)
    names = tuple(names)
    if len(shape) != len(names):
        raise ValueError(
            f"make_mesh: shape {shape} has {len(shape)} axes but names {names} has {len(names)}; "
            "give one name per mesh axis, e.g. make_mesh((4, 2), ('i', 'j'))."
        )
    if any(s < 1 for s in shape):
        raise ValueError(f"make_mesh: every axis size must be >= 1, got shape {shape}.")
    n = math.prod(shape)
    return Mesh(torch.arange(n).reshape(shape), names, device=device)
