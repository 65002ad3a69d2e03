"""The kernel API: what a kernel body calls.

A kernel is an ordinary Python function over refs.  It runs once per grid
point on every device of an axis; buffers and semaphores persist across grid
points (like Pallas TPU kernels whose operands live in HBM), so a grid is a
loop whose iterations each device runs at its own pace.  Communication follows
TPU's remote-DMA model: a device can only *read* its own memory, and *pushes*
data into a peer's buffer with an asynchronous copy; semaphores say when a
copy has left (send) or arrived (receive), and REGULAR semaphores carry
handshakes ("your slot is free").

Every function here forwards to the device context of the runtime running the
kernel (`interpret` or the shared-memory runtime), so the same kernel source
runs unchanged under both.  A runtime implements `DeviceContext`.

Beyond Pallas: `borrow(ref)` gives a zero-copy view for heavy local compute
(reads through `ref[...]` are copies, which Python cannot keep in registers).
"""
from __future__ import annotations

import operator
from typing import Callable

from .errors import KernelUsageError
from .refs import (
    Buffer,
    Ref,
    SemaphoreKind,
    SemaphoreRef,
    SemaphoreSpec,
    as_buffer,
    current_context,
)


class DeviceContext:
    """What a runtime provides to the kernel API, for one device.

    Methods are called from inside the kernel's API call, so a runtime that
    needs the user's source line (for records or errors) gets it with
    `errors.capture_site()` when it needs it.  `wait` must block until the
    local semaphore is >= value and then subtract value; its `what` is a
    zero-argument callable that describes the wait (for messages only).
    """

    device: int
    num_devices: int
    grid: tuple
    grid_index: tuple

    def read(self, ref: Ref):  # pragma: no cover - interface
        raise NotImplementedError

    def write(self, ref: Ref, value) -> None:  # pragma: no cover
        raise NotImplementedError

    def start_copy(self, copy: "AsyncCopy") -> None:  # pragma: no cover
        raise NotImplementedError

    def wait(self, sem: SemaphoreRef, value: int, what) -> None:  # pragma: no cover
        raise NotImplementedError

    def signal(self, sem: SemaphoreRef, inc: int, device: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def read_semaphore(self, sem: SemaphoreRef) -> int:  # pragma: no cover
        raise NotImplementedError

    def borrow(self, ref: Ref, write: bool):  # pragma: no cover
        """Start a borrow: return a live view of ref's elements."""
        raise NotImplementedError

    def end_borrow(self, ref: Ref, write: bool, view, token) -> None:  # pragma: no cover
        raise NotImplementedError

    def barrier_semaphore(self) -> SemaphoreRef:  # pragma: no cover
        raise NotImplementedError

    def alloc_scoped(self, specs: list, names: list) -> list:  # pragma: no cover
        raise NotImplementedError

    def free_scoped(self, refs: list, check: bool) -> None:  # pragma: no cover
        raise NotImplementedError


# ---------------------------------------------------------------------------
# Position.


def device_id() -> int:
    """This device's position along the kernel's axis (0 .. num_devices()-1)."""
    return current_context().device


def num_devices() -> int:
    """Number of devices running the kernel."""
    return current_context().num_devices


def program_id(axis: int) -> int:
    """Index of the current grid iteration along `axis`."""
    ctx = current_context()
    _check_axis(ctx, axis, "program_id")
    return ctx.grid_index[axis]


def num_programs(axis: int) -> int:
    """Size of the grid along `axis`."""
    ctx = current_context()
    _check_axis(ctx, axis, "num_programs")
    return ctx.grid[axis]


def _check_axis(ctx, axis, what):
    if not 0 <= axis < len(ctx.grid):
        raise KernelUsageError(
            f"{what}({axis}): the kernel's grid is {ctx.grid!r} "
            f"({len(ctx.grid)} axes); pass grid=(...) to the runner")


def _device_arg(device, what: str) -> int:
    ctx = current_context()
    if isinstance(device, (tuple, list)):
        if len(device) != 1:
            raise KernelUsageError(
                f"{what}: device_id={device!r}; kernels run along one axis, pass an int "
                "(or a 1-tuple)")
        device = device[0]
    try:
        d = operator.index(device)
    except TypeError:
        raise KernelUsageError(f"{what}: device_id must be an int, got {device!r}") from None
    if not 0 <= d < ctx.num_devices:
        raise KernelUsageError(
            f"{what}: device_id={d} is out of range for {ctx.num_devices} devices "
            f"(use (device_id() + 1) % num_devices() for a ring neighbour)")
    return d


# ---------------------------------------------------------------------------
# Copies.


def _check_sem(sem, kinds, what, arg):
    if not isinstance(sem, SemaphoreRef):
        raise KernelUsageError(f"{what}: {arg} must be a semaphore ref, got {type(sem).__name__}")
    if sem.kind not in kinds:
        want = " or ".join(k.value for k in kinds)
        raise KernelUsageError(
            f"{what}: {arg}={sem.describe()} is a {sem.kind.value} semaphore; it must be {want}"
            + (" (allocate it as SemaphoreType.DMA)" if SemaphoreKind.DMA in kinds else
               " (DMA semaphores are waited through a copy descriptor: .wait_send()/.wait_recv())"))
    sem.element(what)


def _check_pair(src, dst, what, remote=False):
    for arg, r in (("src", src), ("dst", dst)):
        if not isinstance(r, Ref):
            raise KernelUsageError(f"{what}: {arg} must be a ref, got {type(r).__name__}")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise KernelUsageError(
            f"{what}: src {src.describe()} is {tuple(src.shape)} {src.dtype} but dst "
            f"{dst.describe()} is {tuple(dst.shape)} {dst.dtype}; they must match")
    if dst.info.readonly:
        raise KernelUsageError(
            f"{what}: dst {dst.describe()} is a kernel input, and inputs are read-only; "
            "copy into an output or scratch buffer")
    if remote and dst.info.local:
        raise KernelUsageError(
            f"{what}: dst {dst.describe()} is a local buffer (Buffer(..., local=True)), which "
            "only its own device writes; copy into a shared output or scratch buffer instead")


class AsyncCopy:
    """Base of copy descriptors.  `target` is the destination device."""

    src: Ref
    dst: Ref
    target: int

    def start(self) -> None:
        """Begin the copy.  Returns at once; the data moves asynchronously."""
        current_context().start_copy(self)


class RemoteCopy(AsyncCopy):
    """Push `src` (local) into `dst` on device `target`.

    The sender waits with `wait_send()` (src may be reused), the receiver with
    `wait_recv()` (dst holds the data).  Both sides build the same descriptor;
    a device that only receives never calls `start()`.
    """

    def __init__(self, src, dst, send_sem, recv_sem, target):
        self.src, self.dst = src, dst
        self.send_sem, self.recv_sem = send_sem, recv_sem
        self.target = target

    def wait_send(self) -> None:
        """Block until the whole of src has been read (then src may be overwritten)."""
        current_context().wait(self.send_sem, self.src.nbytes, self._what_send)

    def wait_recv(self) -> None:
        """Block until dst.nbytes have arrived in dst on this device."""
        current_context().wait(self.recv_sem, self.dst.nbytes, self._what_recv)

    def wait(self) -> None:
        """wait_send() then wait_recv(): for SPMD kernels where every device sends and receives."""
        ctx = current_context()
        ctx.wait(self.send_sem, self.src.nbytes, self._what_send)
        ctx.wait(self.recv_sem, self.dst.nbytes, self._what_recv)

    # Descriptions for messages, built only when a message is (lazily: this is a hot path).
    def _what_send(self) -> str:
        return f"wait_send of a copy from {self.src.describe()}"

    def _what_recv(self) -> str:
        return f"wait_recv into {self.dst.describe()}"

    def __repr__(self) -> str:
        return (f"remote_copy({self.src.describe()} -> device {self.target} "
                f"{self.dst.describe()})")


class LocalCopy(AsyncCopy):
    """Asynchronous copy between two buffers of this device."""

    def __init__(self, src, dst, sem, target):
        self.src, self.dst, self.sem, self.target = src, dst, sem, target

    def wait(self) -> None:
        """Block until the copy has finished."""
        current_context().wait(self.sem, self.dst.nbytes, self._what)

    def _what(self) -> str:
        return f"wait of a local copy into {self.dst.describe()}"

    def __repr__(self) -> str:
        return f"local_copy({self.src.describe()} -> {self.dst.describe()})"


def remote_copy(src: Ref, dst: Ref, send_sem: SemaphoreRef, recv_sem: SemaphoreRef,
                device_id) -> RemoteCopy:
    """Descriptor of an asynchronous copy of local `src` into `dst` on `device_id`.

    `send_sem` (this device) and `recv_sem` (the destination device's copy of
    the same semaphore) are DMA semaphores; they count bytes.
    """
    what = "remote_copy"
    _check_pair(src, dst, what, remote=True)
    _check_sem(send_sem, (SemaphoreKind.DMA,), what, "send_sem")
    _check_sem(recv_sem, (SemaphoreKind.DMA,), what, "recv_sem")
    return RemoteCopy(src, dst, send_sem, recv_sem, _device_arg(device_id, what))


def local_copy(src: Ref, dst: Ref, sem: SemaphoreRef) -> LocalCopy:
    """Descriptor of an asynchronous copy between two local buffers; `sem` is a DMA semaphore."""
    what = "local_copy"
    _check_pair(src, dst, what)
    _check_sem(sem, (SemaphoreKind.DMA,), what, "sem")
    return LocalCopy(src, dst, sem, current_context().device)


# ---------------------------------------------------------------------------
# Semaphores.

_SIGNALLABLE = (SemaphoreKind.REGULAR, SemaphoreKind.BARRIER)


def semaphore_signal(sem: SemaphoreRef, inc: int = 1, device_id=None) -> None:
    """Add `inc` to `sem` on `device_id` (default: this device)."""
    what = "semaphore_signal"
    _check_sem(sem, _SIGNALLABLE, what, "sem")
    inc = operator.index(inc)
    if inc < 0:
        raise KernelUsageError(f"{what}: inc must be >= 0, got {inc}")
    ctx = current_context()
    target = ctx.device if device_id is None else _device_arg(device_id, what)
    ctx.signal(sem, inc, target)


def semaphore_wait(sem: SemaphoreRef, value: int = 1) -> None:
    """Block until the local `sem` is >= value, then subtract value."""
    what = "semaphore_wait"
    _check_sem(sem, _SIGNALLABLE, what, "sem")
    value = operator.index(value)
    if value < 0:
        raise KernelUsageError(f"{what}: value must be >= 0, got {value}")
    current_context().wait(sem, value, lambda: f"semaphore_wait({sem.describe()}, {value})")


def semaphore_read(sem: SemaphoreRef) -> int:
    """Current value of the local `sem` (a snapshot; it does not synchronise)."""
    if not isinstance(sem, SemaphoreRef):
        raise KernelUsageError(f"semaphore_read: expected a semaphore ref, got {type(sem).__name__}")
    sem.element("semaphore_read")
    return current_context().read_semaphore(sem)


def get_barrier_semaphore() -> SemaphoreRef:
    """The kernel's BARRIER semaphore: one per device, signalled by peers to rendezvous."""
    return current_context().barrier_semaphore()


# ---------------------------------------------------------------------------
# Zero-copy access (beyond Pallas: Python has no registers to load into).


class borrow:
    """`with borrow(ref) as t:` -- t is a live view of ref's elements, not a copy.

    `ref[...]` returns a copy (a value), which for large local reductions costs
    a full extra pass over memory.  A borrow is a zero-copy alternative: for
    race detection it counts as an access (a read, or a write with
    `write=True`) that lasts for the whole `with` block, so it must not
    overlap any unsynchronised access by a peer or copy.  Do not write through
    a read borrow (the interpreter checks), and do not keep `t` after the
    block.  Inputs cannot be borrowed for writing.

        with borrow(inbox) as parts, borrow(o_ref.at[me], write=True) as out:
            torch.sum(parts, 0, out=out)
    """

    __slots__ = ("ref", "write", "ctx", "view", "token")

    def __init__(self, ref: Ref, write: bool = False):
        if not isinstance(ref, Ref):
            raise KernelUsageError(f"borrow: expected a ref, got {type(ref).__name__}")
        if write and ref.info.readonly:
            raise KernelUsageError(
                f"borrow({ref.describe()}, write=True): kernel inputs are read-only")
        self.ref, self.write = ref, write

    def __enter__(self):
        self.ctx = current_context()
        self.view, self.token = self.ctx.borrow(self.ref, self.write)
        return self.view

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.ctx.end_borrow(self.ref, self.write, self.view, self.token)
        self.view = self.token = None
        return False


# ---------------------------------------------------------------------------
# Scoped allocation.


def run_scoped(fn: Callable, *specs, **named_specs):
    """Allocate buffers/semaphores for the duration of `fn(*refs, **named_refs)`.

    Specs are `Buffer(shape, dtype)` (or a tensor to copy shape/dtype from) and
    `SemaphoreType.X`.  Allocations are stack-like, so devices that run the
    same sequence of `run_scoped` get the same buffer identities, and a peer
    may copy into a scoped buffer while both are inside the scope.
    """
    ctx = current_context()
    all_specs = list(specs) + list(named_specs.values())
    names = [f"scoped[{i}]" for i in range(len(specs))] + list(named_specs)
    norm = [s if isinstance(s, SemaphoreSpec) else as_buffer(s, f"run_scoped {n}")
            for s, n in zip(all_specs, names)]
    refs = ctx.alloc_scoped(norm, names)
    try:
        result = fn(*refs[:len(specs)], **dict(zip(named_specs, refs[len(specs):])))
    except BaseException:
        ctx.free_scoped(refs, check=False)  # do not mask the real error
        raise
    ctx.free_scoped(refs, check=True)
    return result


__all__ = [
    "Buffer", "DeviceContext", "RemoteCopy", "LocalCopy",
    "device_id", "num_devices", "program_id", "num_programs",
    "remote_copy", "local_copy",
    "semaphore_signal", "semaphore_wait", "semaphore_read", "get_barrier_semaphore",
    "run_scoped", "borrow",
]
