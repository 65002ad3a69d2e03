"""Refs: named views of a device's buffers and semaphores.

A kernel never holds tensors directly; it holds *refs*.  A ref names a buffer
(by a key that is the same on every device, so a ref on device 0 also names
"the same buffer" on device 3, which is what a remote copy's destination
means) plus a rectangular view of it, built with `.at[...]`.  Reading
`ref[...]` or writing `ref[...] = value` goes through the runtime that runs
the kernel, so the interpreter can record every access (for race detection)
and the shared-memory runtime can map the key to a segment of shared memory.

A view is stored per *base* dimension: an `int` (the dimension was indexed
away) or a `range` (the dimension survives).  This keeps views composable
(`range` supports slicing) and lets the race detector reason about boxes in
base coordinates without touching tensor data.
"""
from __future__ import annotations

import enum
import operator
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import KernelUsageError

# ---------------------------------------------------------------------------
# The runtime context of the device whose kernel code is running right now.

_local = threading.local()


def current_context():
    """The device context of the running kernel, or a clear error outside one."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise KernelUsageError(
            "kernel API used outside a kernel: refs, copies and semaphores only work "
            "inside a kernel run by shmap.kernels.interpret(...) or run_shm(...)")
    return ctx


def set_context(ctx) -> None:
    _local.ctx = ctx


# ---------------------------------------------------------------------------
# Specs of buffers and semaphores (what `out_shapes` / `scratch` list).


@dataclass(frozen=True)
class Buffer:
    """Shape and dtype of an output or scratch buffer (Pallas' ShapeDtypeStruct / VMEM).

    `local=True` puts the buffer in the device's private memory (like VMEM):
    only the device itself writes it -- it can be the source of a remote copy
    but never the destination.  The shared-memory runtime then keeps it out of
    shared memory (and can hand it back, or write it into a caller's tensor,
    without a copy).
    """

    shape: tuple
    dtype: torch.dtype | None = None  # None: torch's default dtype when the spec is made
    local: bool = False

    def __init__(self, shape, dtype: torch.dtype | None = None, local: bool = False):
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise KernelUsageError(f"Buffer: shape {shape} has a negative size. Fix: sizes >= 0.")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise KernelUsageError(f"Buffer: dtype must be a torch.dtype, got {dtype!r}. Fix: e.g. torch.float32.")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", torch.get_default_dtype() if dtype is None else dtype)
        object.__setattr__(self, "local", bool(local))

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def as_buffer(spec: Any, what: str) -> Buffer:
    if isinstance(spec, Buffer):
        return spec
    if isinstance(spec, torch.Tensor):
        return Buffer(spec.shape, spec.dtype)
    raise KernelUsageError(
        f"{what}: expected kernels.Buffer(shape, dtype) or a tensor to take shape and dtype "
        f"from, got {type(spec).__name__}: {spec!r}")


class SemaphoreKind(enum.Enum):
    DMA = "DMA"          # counts bytes delivered by copies; waited through a copy descriptor
    REGULAR = "REGULAR"  # counts semaphore_signal increments; semaphore_wait
    BARRIER = "BARRIER"  # like REGULAR, but one per kernel, shared by every device


@dataclass(frozen=True)
class SemaphoreSpec:
    """A semaphore (or an array of them, `SemaphoreType.DMA((n,))`) to allocate."""

    kind: SemaphoreKind
    shape: tuple = ()

    def __call__(self, shape) -> "SemaphoreSpec":
        if isinstance(shape, int):
            shape = (shape,)
        return SemaphoreSpec(self.kind, tuple(int(s) for s in shape))

    @property
    def count(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class SemaphoreType:
    """`SemaphoreType.DMA`, `SemaphoreType.REGULAR`; call with a shape for an array."""

    DMA = SemaphoreSpec(SemaphoreKind.DMA)
    REGULAR = SemaphoreSpec(SemaphoreKind.REGULAR)
    BARRIER = SemaphoreSpec(SemaphoreKind.BARRIER)


# ---------------------------------------------------------------------------
# Indexing.


@dataclass(frozen=True)
class ds:
    """`ds(start, size)`: the slice start:start+size, bounds-checked (Pallas' pl.ds)."""

    start: int
    size: int


def _index_items(idx) -> tuple:
    return idx if isinstance(idx, tuple) else (idx,)


def _apply_index(view: tuple, shape_of_base: tuple, idx, what: str) -> tuple:
    """Compose `idx` (basic indexing only) onto a view; returns the new view."""
    free = [i for i, e in enumerate(view) if isinstance(e, range)]
    items = list(_index_items(idx))
    n_ellipsis = sum(1 for it in items if it is Ellipsis)
    if n_ellipsis > 1:
        raise KernelUsageError(f"{what}: at most one `...` in an index, got {idx!r}")
    n_real = len(items) - n_ellipsis
    if n_real > len(free):
        raise KernelUsageError(
            f"{what}: too many indices ({n_real}) for a ref with {len(free)} dimension(s)")
    if n_ellipsis:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(free) - n_real)
    new = list(view)
    for dim, item in zip(free, items):
        r = view[dim]
        if isinstance(item, ds):
            start, size = operator.index(item.start), operator.index(item.size)
            if size < 0 or start < 0 or start + size > len(r):
                raise KernelUsageError(
                    f"{what}: ds({start}, {size}) is out of bounds for a dimension of size {len(r)}")
            new[dim] = r[start:start + size]
        elif isinstance(item, slice):
            if item.step is not None and operator.index(item.step) <= 0:
                raise KernelUsageError(f"{what}: slice steps must be positive, got {item!r}")
            for end in (item.start, item.stop):  # (Python clamps; a ref, as ds(), does not: a copy of the
                if end is not None and not -len(r) <= operator.index(end) <= len(r):  # wrong size otherwise)
                    raise KernelUsageError(
                        f"{what}: slice {item.start}:{item.stop} is out of bounds for a dimension of size "
                        f"{len(r)}. Fix: bounds within 0..{len(r)} (or ds(start, size)).")
            new[dim] = r[item]
        elif item is None:
            raise KernelUsageError(f"{what}: `None` (new axis) is not supported in a ref index")
        else:
            try:
                i = operator.index(item)
            except TypeError:
                raise KernelUsageError(
                    f"{what}: only ints, slices, ds(start, size) and `...` can index a ref "
                    f"(no advanced indexing), got {type(item).__name__}") from None
            if not -len(r) <= i < len(r):
                raise KernelUsageError(
                    f"{what}: index {i} is out of bounds for a dimension of size {len(r)}")
            new[dim] = r[i]
    return tuple(new)


def _view_shape(view: tuple) -> tuple:
    return tuple(len(e) for e in view if isinstance(e, range))


def _torch_index(view: tuple) -> tuple:
    return tuple(e if isinstance(e, int) else slice(e.start, e.stop, e.step) for e in view)


def format_box(box: Sequence[range]) -> str:
    """`[1, 0:8, 0:128]`: a box in base coordinates, as one would index the buffer."""
    parts = []
    for r in box:
        if len(r) == 1:
            parts.append(str(r.start))
        elif r.step == 1:
            parts.append(f"{r.start}:{r.stop}")
        else:
            parts.append(f"{r.start}:{r.stop}:{r.step}")
    return "[" + ", ".join(parts) + "]"


class _At:
    __slots__ = ("_ref",)

    def __init__(self, ref):
        self._ref = ref

    def __getitem__(self, idx):
        return self._ref._sub(idx)


# ---------------------------------------------------------------------------
# Buffer refs.


@dataclass(frozen=True, eq=False)
class BufferInfo:
    """A buffer as every device knows it: key (same on all devices), name for messages."""

    key: Any
    name: str
    shape: tuple
    dtype: torch.dtype
    role: str  # "input", "output", "scratch" or "scoped"
    local: bool = False  # private to the device: never a remote copy's destination

    @property
    def readonly(self) -> bool:
        return self.role == "input"


class Ref:
    """A view of one of the current device's buffers.

    `ref[idx]` reads (returns a new tensor, a value: later writes to the buffer
    do not change it), `ref[idx] = v` writes, `ref.at[idx]` is a sub-ref for
    copies.  Indices: ints, slices, `ds(start, size)`, `...`.
    """

    __slots__ = ("info", "view")

    def __init__(self, info: BufferInfo, view: tuple | None = None):
        self.info = info
        self.view = view if view is not None else tuple(range(s) for s in info.shape)

    # -- structure
    @property
    def at(self) -> _At:
        return _At(self)

    def _sub(self, idx) -> "Ref":
        return Ref(self.info, _apply_index(self.view, self.info.shape, idx, f"{self.name}.at[...]"))

    @property
    def shape(self) -> tuple:
        return _view_shape(self.view)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.info.dtype

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def name(self) -> str:
        return self.info.name

    def box(self) -> tuple:
        """The accessed elements as one range per base dimension."""
        return tuple(range(e, e + 1) if isinstance(e, int) else e for e in self.view)

    def torch_index(self) -> tuple:
        return _torch_index(self.view)

    def describe(self) -> str:
        return f"'{self.name}'{format_box(self.box())}"

    # -- data
    def __getitem__(self, idx):
        return current_context().read(self._sub(idx))

    def __setitem__(self, idx, value):
        current_context().write(self._sub(idx), value)

    def __repr__(self) -> str:
        return f"Ref({self.describe()}, shape={self.shape}, dtype={self.dtype})"


# ---------------------------------------------------------------------------
# Semaphore refs.


@dataclass(frozen=True, eq=False)
class SemaphoreInfo:
    key: Any
    name: str
    kind: SemaphoreKind
    shape: tuple


class SemaphoreRef:
    """A semaphore, or an array of them (index with `.at[i]` to get one)."""

    __slots__ = ("info", "view")

    def __init__(self, info: SemaphoreInfo, view: tuple | None = None):
        self.info = info
        self.view = view if view is not None else tuple(range(s) for s in info.shape)

    @property
    def at(self) -> _At:
        return _At(self)

    def _sub(self, idx) -> "SemaphoreRef":
        return SemaphoreRef(self.info, _apply_index(self.view, self.info.shape, idx,
                                                    f"{self.info.name}.at[...]"))

    @property
    def kind(self) -> SemaphoreKind:
        return self.info.kind

    @property
    def shape(self) -> tuple:
        return _view_shape(self.view)

    def element(self, what: str) -> tuple:
        """(key, flat index) of the single semaphore this ref names."""
        if self.shape != ():
            what = what() if callable(what) else what
            raise KernelUsageError(
                f"{what}: '{self.info.name}' is an array of semaphores with shape {self.shape}; "
                f"pick one with {self.info.name}.at[i]")
        flat = 0
        for e, s in zip(self.view, self.info.shape):
            flat = flat * s + e
        return (self.info.key, flat)

    def describe(self) -> str:
        if not self.info.shape:
            return f"'{self.info.name}'"
        return f"'{self.info.name}{format_box(tuple(range(e, e + 1) if isinstance(e, int) else e for e in self.view))}'"

    def __repr__(self) -> str:
        return f"SemaphoreRef({self.describe()}, {self.kind.value})"


def element_name(info: SemaphoreInfo, flat: int) -> str:
    """Name of one semaphore of an array, for messages: `recv_sems[2]`."""
    if not info.shape:
        return info.name
    idx = []
    for s in reversed(info.shape):
        idx.append(flat % s)
        flat //= s
    return f"{info.name}[{', '.join(str(i) for i in reversed(idx))}]"


def flatten_specs(specs) -> tuple[list, bool]:
    """A single spec or a sequence of them -> (list, was_single)."""
    if isinstance(specs, (Buffer, torch.Tensor, SemaphoreSpec)):
        return [specs], True
    return list(specs), False
