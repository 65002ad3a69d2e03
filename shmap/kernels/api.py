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
"""
from __future__ import annotations

import operator
from typing import Callable

from .errors import KernelUsageError, capture_site
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

    Methods receive a `site` (the user's source line) so that errors and
    records can point at the kernel.  `wait` must block until the local
    semaphore is >= value and then subtract value.
    """

    device: int
    num_devices: int
    grid: tuple
    grid_index: tuple

    def read(self, ref: Ref):  # pragma: no cover - interface
        raise NotImplementedError

    def write(self, ref: Ref, value) -> None:  # pragma: no cover
        raise NotImplementedError

    def start_copy(self, copy: "AsyncCopy", site) -> None:  # pragma: no cover
        raise NotImplementedError

    def wait(self, sem: SemaphoreRef, value: int, what: str, site) -> None:  # pragma: no cover
        raise NotImplementedError

    def signal(self, sem: SemaphoreRef, inc: int, device: int, site) -> None:  # pragma: no cover
        raise NotImplementedError

    def read_semaphore(self, sem: SemaphoreRef) -> int:  # pragma: no cover
        raise NotImplementedError

    def barrier_semaphore(self) -> SemaphoreRef:  # pragma: no cover
        raise NotImplementedError

    def alloc_scoped(self, specs: list, names: list) -> list:  # pragma: no cover
        raise NotImplementedError

    def free_scoped(self, refs: list, site, check: bool) -> None:  # pragma: no cover
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
    sem.element(f"{what}: {arg}")


def _check_pair(src, dst, what):
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


class AsyncCopy:
    """Base of copy descriptors.  `target` is the destination device."""

    src: Ref
    dst: Ref
    target: int

    def start(self) -> None:
        """Begin the copy.  Returns at once; the data moves asynchronously."""
        current_context().start_copy(self, capture_site(2))


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
        current_context().wait(self.send_sem, self.src.nbytes,
                               f"wait_send of a copy from {self.src.describe()}", capture_site(2))

    def wait_recv(self) -> None:
        """Block until dst.nbytes have arrived in dst on this device."""
        current_context().wait(self.recv_sem, self.dst.nbytes,
                               f"wait_recv into {self.dst.describe()}", capture_site(2))

    def wait(self) -> None:
        """wait_send() then wait_recv(): for SPMD kernels where every device sends and receives."""
        site = capture_site(2)
        ctx = current_context()
        ctx.wait(self.send_sem, self.src.nbytes,
                 f"wait_send of a copy from {self.src.describe()}", site)
        ctx.wait(self.recv_sem, self.dst.nbytes, f"wait_recv into {self.dst.describe()}", site)

    def __repr__(self) -> str:
        return (f"remote_copy({self.src.describe()} -> device {self.target} "
                f"{self.dst.describe()})")


class LocalCopy(AsyncCopy):
    """Asynchronous copy between two buffers of this device."""

    def __init__(self, src, dst, sem, target):
        self.src, self.dst, self.sem, self.target = src, dst, sem, target

    def wait(self) -> None:
        """Block until the copy has finished."""
        current_context().wait(self.sem, self.dst.nbytes,
                               f"wait of a local copy into {self.dst.describe()}", capture_site(2))

    def __repr__(self) -> str:
        return f"local_copy({self.src.describe()} -> {self.dst.describe()})"


def remote_copy(src: Ref, dst: Ref, send_sem: SemaphoreRef, recv_sem: SemaphoreRef,
                device_id) -> RemoteCopy:
    """Descriptor of an asynchronous copy of local `src` into `dst` on `device_id`.

    `send_sem` (this device) and `recv_sem` (the destination device's copy of
    the same semaphore) are DMA semaphores; they count bytes.
    """
    what = "remote_copy"
    _check_pair(src, dst, what)
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
    ctx.signal(sem, inc, target, capture_site(2))


def semaphore_wait(sem: SemaphoreRef, value: int = 1) -> None:
    """Block until the local `sem` is >= value, then subtract value."""
    what = "semaphore_wait"
    _check_sem(sem, _SIGNALLABLE, what, "sem")
    value = operator.index(value)
    if value < 0:
        raise KernelUsageError(f"{what}: value must be >= 0, got {value}")
    current_context().wait(sem, value, f"semaphore_wait({sem.describe()}, {value})",
                           capture_site(2))


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
    site = capture_site(2)
    try:
        result = fn(*refs[:len(specs)], **dict(zip(named_specs, refs[len(specs):])))
    except BaseException:
        ctx.free_scoped(refs, site, check=False)  # do not mask the real error
        raise
    ctx.free_scoped(refs, site, check=True)
    return result


__all__ = [
    "Buffer", "DeviceContext", "RemoteCopy", "LocalCopy",
    "device_id", "num_devices", "program_id", "num_programs",
    "remote_copy", "local_copy",
    "semaphore_signal", "semaphore_wait", "semaphore_read", "get_barrier_semaphore",
    "run_scoped",
]
