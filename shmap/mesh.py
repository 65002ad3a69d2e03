"""Device meshes and PartitionSpecs: names and shapes only, no tensors.

A mesh arranges devices in an n-d array with named axes; a `PartitionSpec`
says, per leading tensor dimension, which mesh axes split it.  Everything here
is pure metadata so that every other layer (types, collectives, backends) can
depend on it without pulling in execution.
"""
from __future__ import annotations

import itertools
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

    __slots__ = ("_entries", "_dims", "_axes", "_axis_set", "_trimmed", "_hash", "_exact", "unreduced")

    def __init__(self, *entries, unreduced=frozenset()):
        norm = []
        for e in entries:
            if isinstance(e, list):
                e = tuple(e)
            if isinstance(e, tuple) and len(e) == 1:
                e = e[0]
            if isinstance(e, tuple) and len(e) == 0:
                e = None
            if not (e is None or isinstance(e, str) or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))):
                raise TypeError(
                    f"P: entry {len(norm)} is {type(e).__name__} {e!r}; an entry is None, a mesh axis name, or a "
                    "tuple of names (a dimension split over several axes, major to minor). Fix: e.g. P('i') or "
                    "P(('i', 'j'))" + (" (a tuple: a set has no order)." if isinstance(e, (set, frozenset)) else ".")
                )
            norm.append(e)
        self._entries = tuple(norm)
        # Derived once: specs are immutable and consulted on every call.
        self._dims = tuple(
            () if e is None else (e if isinstance(e, tuple) else (e,)) for e in self._entries
        )
        self._axes = tuple(a for d in self._dims for a in d)
        self._axis_set = frozenset(self._axes)
        trimmed = list(self._entries)
        while trimmed and trimmed[-1] is None:
            trimmed.pop()
        if not (isinstance(unreduced, str) or (isinstance(unreduced, (set, frozenset, tuple, list))
                                                and all(isinstance(a, str) for a in unreduced))):
            raise TypeError(f"P: unreduced must be an axis name or a set of names, got {unreduced!r}. "
                            "Fix: e.g. P('i', unreduced={'j'}), or leave it out.")
        #: mesh axes along which the value is a pending sum (JAX's `unreduced`)
        self.unreduced = frozenset({unreduced} if isinstance(unreduced, str) else unreduced)
        self._trimmed = tuple(trimmed)  # equality ignores trailing Nones
        self._hash = hash((self._trimmed, self.unreduced))
        self._exact = hash((self._entries, self.unreduced))  # (trailing Nones count: shard_map._check_spec)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)

    def __getitem__(self, i):
        return self._entries[i]

    def __eq__(self, other):
        if other is self:
            return True
        if not isinstance(other, PartitionSpec):
            return NotImplemented
        return self._trimmed == other._trimmed and self.unreduced == other.unreduced

    def __hash__(self):
        return self._hash

    def __repr__(self):
        parts = [repr(e) for e in self._entries]
        if self.unreduced:
            parts.append("unreduced={" + ", ".join(repr(a) for a in sorted(self.unreduced)) + "}")
        return "P(" + ", ".join(parts) + ")"

    def dim_axes(self, d: int) -> tuple[AxisName, ...]:
        """The mesh axes splitting tensor dimension `d` (empty if none)."""
        return self._dims[d] if d < len(self._dims) else ()

    def axes(self) -> tuple[AxisName, ...]:
        """Every mesh axis the spec mentions, in order of appearance."""
        return self._axes

    def axis_set(self) -> frozenset:
        """`axes()` as a frozenset (the boundary's type checks compare it with value types)."""
        return self._axis_set


P = PartitionSpec


class Mesh:
    """Devices in an n-d array with named axes.

    `devices` is an integer array (torch tensor) of device ids (ranks); the
    mesh shape is its shape.  `device` is the torch device the simulated mesh
    computes on (None: wherever the inputs already are).
    """

    def __init__(self, devices, axis_names: Sequence[AxisName], *, device=None, device_mesh=None):
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
        #: the `torch.distributed.device_mesh.DeviceMesh` of a distributed mesh
        #: (one process per device); None for a simulated mesh.
        self.device_mesh = device_mesh

    @property
    def is_distributed(self) -> bool:
        """True when each device is a process of an initialised torch.distributed world."""
        return self.device_mesh is not None

    @property
    def devices_flat(self) -> list[int]:
        return self.devices.flatten().tolist()

    def __repr__(self):
        inner = ", ".join(f"{n}={s}" for n, s in self.shape.items())
        dev = f", device={self.device}" if self.device is not None else ""
        if self.device_mesh is not None:
            dev += f", distributed over {self.size} ranks"
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
            and self.device_mesh is other.device_mesh
        )

    def __hash__(self):
        return hash((self.axis_names, self.axis_sizes))


def make_mesh(shape: Iterable[int], names: Iterable[AxisName], *, device=None, distributed=None) -> Mesh:
    """Build a mesh of `prod(shape)` devices with the given axis names.

    Without an initialised `torch.distributed` process group this is a
    simulated mesh: every device lives in this process, on `device` (CPU by
    default, or e.g. `'cuda'`).  When `torch.distributed` is initialised (e.g.
    under `torchrun`) the mesh is laid over the world's processes, one device
    each, rank `r` at row-major position `r` (a `DeviceMesh` underneath), and
    `prod(shape)` must equal the world size.  `distributed=False` forces a
    simulated mesh even then (handy to compare both in one program);
    `distributed=True` insists on the world.  Axis sizes must be positive ints
    (2.5, '4' or True raise rather than being rounded or parsed) and names
    distinct non-empty strings.
    """
    shape = _mesh_shape(shape)
    names = _mesh_names(names, len(shape))
    device = _mesh_device(device)
    if len(shape) != len(names):
        raise ValueError(
            f"make_mesh: shape {shape} has {len(shape)} axes but names {names} has {len(names)}; "
            "give one name per mesh axis, e.g. make_mesh((4, 2), ('i', 'j'))."
        )
    n = math.prod(shape)
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"make_mesh: distributed must be True, False or None (decide from the world), got "
                        f"{distributed!r}.")
    if distributed is None:
        distributed = _real_world()
    if distributed:
        return _world_mesh(shape, names, device)
    if n > MAX_SIMULATED:
        raise ValueError(
            f"make_mesh: shape {shape} is a mesh of {n} devices; a simulated mesh holds at most {MAX_SIMULATED} "
            "(each device is a row of every varying value in this process). Fix: a smaller shape."
        )
    return Mesh(torch.arange(n).reshape(shape), names, device=device)


#: the most devices a simulated mesh may have (its device-id table alone would not fit in memory long before
#: 10**12, and every varying value holds a block per device)
MAX_SIMULATED = 1 << 20


def _mesh_device(device):
    """`device` as a torch.device (None stays None), checked here: a bad string raised torch's parser error,
    naming neither make_mesh nor the argument, and an absent accelerator failed at the first shard_map."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"make_mesh: device={device!r} is not a torch device{f' ({reason})' if len(reason) <= 80 else ''}. "
            "Fix: e.g. device='cpu', 'cuda' or 'cuda:1', or leave it out (the CPU)."
        ) from None
    backend = getattr(torch, dev.type, None) if dev.type not in ("cpu", "meta") else None
    available = getattr(backend, "is_available", None)
    if callable(available) and not available():
        raise ValueError(
            f"make_mesh: device={device!r}, but torch reports no {dev.type} device on this machine "
            f"(torch.{dev.type}.is_available() is False). Fix: device='cpu' (or leave it out), or run where a "
            f"{dev.type} device is present."
        )
    count = getattr(backend, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        raise ValueError(
            f"make_mesh: device={device!r}, but this machine has {count()} {dev.type} device(s), numbered from 0. "
            f"Fix: an index below {count()}."
        )
    return dev


def _mesh_shape(shape) -> tuple:
    """`shape` as a tuple of positive Python ints; anything else (2.5, '4', True) is refused, not rounded."""
    import operator

    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(
            f"make_mesh: shape must be a sequence of axis sizes, got {type(shape).__name__} {shape!r}. "
            f"Fix: e.g. make_mesh(({shape!r},), ('i',)) for one axis." if isinstance(shape, int) else
            f"make_mesh: shape must be a sequence of axis sizes, got {type(shape).__name__} {shape!r}. "
            "Fix: e.g. make_mesh((4, 2), ('i', 'j'))."
        )
    shape = tuple(shape)
    sizes = []
    for k, s in enumerate(shape):
        try:
            if isinstance(s, bool):
                raise TypeError
            size = operator.index(s)  # ints and integer scalars (numpy, 0-d integer tensors); not 2.5, not '4'
        except TypeError:
            raise TypeError(
                f"make_mesh: axis {k} of shape {shape} has size {s!r} ({type(s).__name__}); every axis size must "
                f"be a positive int. Fix: give whole numbers, e.g. make_mesh((4, 2), ('i', 'j'))"
                + (f" (int({s!r}) if you meant that)." if isinstance(s, (float, str)) else ".")
            ) from None
        if size < 1:
            raise ValueError(
                f"make_mesh: axis {k} of shape {shape} has size {size}; every axis size must be >= 1 "
                "(a positive int). Fix: give each axis at least one device."
            )
        sizes.append(size)
    return tuple(sizes)


def _mesh_names(names, n) -> tuple:
    """`names` as a tuple of distinct, non-empty strings."""
    if isinstance(names, str):
        raise TypeError(
            f"make_mesh: names must be a sequence of axis names, got the string {names!r} (which would be read "
            f"as {len(names)} one-letter names). Fix: make_mesh(shape, ({names!r},))"
            + (f" or make_mesh(shape, {tuple(names)!r})." if n == len(names) and n > 1 else ".")
        )
    if not hasattr(names, "__iter__"):
        raise TypeError(
            f"make_mesh: names must be a sequence of axis names (strings), got {type(names).__name__} {names!r}. "
            "Fix: e.g. make_mesh((4, 2), ('i', 'j'))."
        )
    names = tuple(names)
    for k, a in enumerate(names):
        if not isinstance(a, str) or not a:
            raise TypeError(
                f"make_mesh: axis name {k} of {names} is {a!r} ({type(a).__name__}); axis names must be non-empty "
                "strings. Fix: e.g. make_mesh((4, 2), ('i', 'j'))."
            )
    seen = set()
    for a in names:
        if a in seen:
            raise ValueError(
                f"make_mesh: axis name {a!r} appears twice in {names}; each mesh axis needs its own name "
                "(collectives and specs refer to axes by name). Fix: rename one, e.g. "
                f"{tuple(a + str(k) if x == a else x for k, x in enumerate(names))}."
            )
        seen.add(a)
    return names


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _real_world() -> bool:
    """An initialised world of real processes (not the single-process "fake" backend that
    LocalTensor and DTensor tests use, which has no peers to talk to)."""
    import torch.distributed as dist

    return _dist_initialized() and str(dist.get_backend()).lower() != "fake"


def _agree_on_mesh(shape, names, device_type):
    """Every rank must build the same distributed meshes, in the same order, under the same guard
    settings: each posts its mesh (and the settings that shape the wire) to the store and compares them
    with the others' before any process group is made.  Ranks that differ waited in DeviceMesh's group
    creation until the store's timeout (30 min under torchrun) with a raw DistStoreError, or, with
    different settings, aborted in gloo; now every rank raises naming each rank's mesh."""
    from datetime import timedelta

    import torch.distributed as dist

    from .backends.config import _OPTIONS

    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a world without a default store: nothing to compare through
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    n = next(_MESH_COUNT)
    settings = {k: _OPTIONS[k] for k in ("check_collectives", "transport", "bucket_bytes", "first_bucket_bytes")}
    mine = f"mesh {tuple(shape)} {tuple(names)} on {device_type}; settings {settings}"
    keys = [f"shmap/make_mesh/{n}/{r}" for r in range(world)]
    store.set(keys[rank], mine)
    timeout = _OPTIONS["timeout"] or 300.0
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - DistStoreError: some rank never got here
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"make_mesh: rank(s) {missing} did not build distributed mesh #{n + 1} of this program within "
            f"{timeout:g} s (this rank: {mine}). Every rank must build the same meshes in the same order "
            "(a rank that returned early, or builds its meshes in another order, leaves the others here). "
            "Fix: make every rank run the same make_mesh calls."
        ) from None
    theirs = [v.decode() for v in store.multi_get(keys)]
    if len(set(theirs)) > 1:
        groups = {}
        for r, v in enumerate(theirs):
            groups.setdefault(v, []).append(r)
        listed = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}"
                           for v, rs in groups.items())
        raise ValueError(
            f"make_mesh: the ranks build different distributed meshes (#{n + 1} of this program): {listed}. "
            "Every rank must build the same meshes in the same order, under the same configure_distributed "
            "settings (they shape what goes on the wire). Fix: make the ranks agree."
        )


_MESH_COUNT = itertools.count()  #: this process's distributed meshes, in order


#: (shape, names, device type) -> (world group, Mesh): a DeviceMesh creates
#: process groups (a collective over the world), so each mesh is built once per world.
_WORLD_MESHES: dict = {}


def _world_mesh(shape, names, device) -> Mesh:
    """The mesh over the initialised torch.distributed world (one device per rank)."""
    import torch.distributed as dist

    if not _dist_initialized():
        raise RuntimeError(
            "make_mesh(distributed=True): torch.distributed is not initialised. Fix: launch with "
            "`torchrun --nproc-per-node N prog.py` and call "
            "`torch.distributed.init_process_group()` first (see docs/distributed.md)."
        )
    world = dist.get_world_size()
    n = math.prod(shape)
    if n != world:
        raise ValueError(
            f"make_mesh: a distributed mesh needs one device per process, but shape {shape} has "
            f"{n} devices and the torch.distributed world has {world} processes. Fix: use a shape whose "
            f"product is {world} (e.g. make_mesh(({world},), ({names[0]!r},))), launch with "
            f"`torchrun --nproc-per-node {n}`, or pass distributed=False for a simulated mesh."
        )
    backend = str(dist.get_backend()).lower()
    if device is None:
        if "nccl" in backend and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    key = (shape, names, device.type)
    world_pg, got = _WORLD_MESHES.get(key, (None, None))
    if got is None or world_pg is not dist.group.WORLD:  # first use, or a new world since
        from torch.distributed.device_mesh import init_device_mesh
        from torch.utils._python_dispatch import _disable_current_modes

        # Real process groups and tensors, also when the first call is traced by torch.compile (a pmap
        # smaller than the world builds its mesh there): every rank traces the same program, in step.
        with _disable_current_modes():
            _agree_on_mesh(shape, names, device.type)
            dm = init_device_mesh(device.type, shape, mesh_dim_names=names)
            got = Mesh(torch.arange(n).reshape(shape), names, device=device, device_mesh=dm)
            _WORLD_MESHES[key] = (dist.group.WORLD, got)
            from .backends import for_mesh

            for_mesh(got)  # its guard and process groups, now, while every rank is in step (docs/distributed.md)
    return got
