"""One rank's kernel context in the shared-memory runtime (shm.py): its kernel API calls.

`_Device` is the `DeviceContext` a kernel sees on one rank: reads and writes on its own arena,
copies into a peer's arena (completing at `start()`), semaphores in the shared slots (waits time
out naming the kernel line; a failed peer is reported, not waited on), scoped allocations.
"""
from __future__ import annotations

import time

import torch

from .api import DeviceContext, RemoteCopy
from .common import fit_value
from .errors import KernelTimeoutError, KernelUsageError, capture_site
from .refs import (
    Buffer,
    BufferInfo,
    Ref,
    SemaphoreInfo,
    SemaphoreKind,
    SemaphoreRef,
    SemaphoreSpec,
    element_name,
)
from .segments import FIRST_SLOT, USER_BARRIER_SLOT, align


class _Device(DeviceContext):
    """One rank's kernel context for one kernel call."""

    def __init__(self, comm: "ShmComm", n: int, grid: tuple, timeout: float):
        self.comm, self.seg = comm, comm.seg
        self.device, self.num_devices = comm.rank, n
        self.grid, self.grid_index = grid, ()
        self.timeout = timeout
        self.local: dict = {}     # key -> tensor of an input (not in shared memory)
        self.offsets: dict = {}   # key -> (offset, Buffer) in every rank's arena
        self.slots: dict = {}     # semaphore key -> first slot
        self.top = 0
        self.slot_top = self.slot_max = FIRST_SLOT
        self.arena_limit, self.slot_limit = comm.seg.capacity, comm.seg.n_slots
        self.views: dict = {}
        self.sent: dict = {}      # (target, slot) -> amount signalled in this kernel
        self.consumed: dict = {}  # slot -> amount waited for in this kernel
        self.sem_names: dict = {}
        self.polls: dict = {}     # slot -> (value last read, when first read so): a poll is bounded as a wait
        self.scoped: list = []

    # -- allocation
    def alloc(self, spec: Buffer) -> int:
        off = self.top
        self.top = align(off + spec.nbytes)
        if self.top > self.arena_limit:
            raise KernelUsageError(
                f"the kernel's buffers need more than the {self.arena_limit} bytes of arena "
                f"available per rank (capacity {self.seg.capacity}); create the group with a "
                "larger capacity")
        return off

    def alloc_slots(self, spec: SemaphoreSpec) -> int:
        slot = self.slot_top
        self.slot_top += spec.count
        self.slot_max = max(self.slot_max, self.slot_top)  # the exit check covers them all
        if self.slot_top > self.slot_limit:
            raise KernelUsageError(
                f"the kernel uses more semaphores than the group has ({self.seg.n_slots} slots)")
        return slot

    def tensor(self, rank: int, info: BufferInfo) -> torch.Tensor:
        t = self.local.get(info.key)
        if t is not None:
            return t
        off, spec = self.offsets[info.key]
        t = self.views.get((rank, off, spec))
        if t is None:  # views of the arena are cached with the kernel's plan
            t = self.seg.arenas[rank][off:off + spec.nbytes].view(spec.dtype).view(spec.shape)
            self.views[(rank, off, spec)] = t
        return t

    def slot(self, sem: SemaphoreRef, what: str) -> int:
        key, flat = sem.element(what)
        if key == ("barrier",):
            return USER_BARRIER_SLOT
        return self.slots[key] + flat

    # -- data
    def read(self, ref: Ref):
        return self.tensor(self.device, ref.info)[ref.torch_index()].clone()

    def write(self, ref: Ref, value) -> None:
        if ref.info.readonly:
            raise KernelUsageError(
                f"write to {ref.describe()}: kernel inputs are read-only; write an output or "
                "scratch buffer instead")
        dst = self.tensor(self.device, ref.info)[ref.torch_index()]
        dst.copy_(fit_value(value, dst, ref))

    def start_copy(self, copy) -> None:
        src = self.tensor(self.device, copy.src.info)[copy.src.torch_index()]
        dst = self.tensor(copy.target, copy.dst.info)[copy.dst.torch_index()]
        if _overlap(src, dst):
            # Source and destination in one buffer (a shift within it, a copy to oneself): read the source
            # whole first, as the interpreter does (an in-place copy_ of overlapping strided views smeared
            # the first element across a row, silently, or raised for contiguous ones).
            src = src.clone()
        dst.copy_(src)
        if isinstance(copy, RemoteCopy):
            self._bump(copy.target, self.slot(copy.recv_sem, "recv_sem"), copy.dst.nbytes)
            self._bump(self.device, self.slot(copy.send_sem, "send_sem"), copy.src.nbytes)
        else:
            self._bump(self.device, self.slot(copy.sem, "sem"), copy.dst.nbytes)

    # -- semaphores
    def _bump(self, target: int, slot: int, inc: int) -> None:
        i = self.seg.cnt(target, slot, self.device)
        self.seg.ctl[i] += inc
        self.sent[(target, slot)] = self.sent.get((target, slot), 0) + inc
        if target != self.device:
            self.seg.bells[target].ring()

    def signal(self, sem: SemaphoreRef, inc: int, device: int) -> None:
        self._bump(device, self.slot(sem, "semaphore_signal"), inc)

    def read_semaphore(self, sem: SemaphoreRef) -> int:
        slot = self.slot(sem, "semaphore_read")
        value = self.seg.value(self.device, slot)
        now = time.monotonic()
        seen = self.polls.get(slot)
        if seen is None or seen[0] != value:
            self.polls[slot] = (value, now)
        elif now - seen[1] > self.timeout:  # a loop polling a semaphore nobody signals: bounded as a wait is
            raise KernelTimeoutError(
                f"device {self.device}: semaphore_read of {sem.describe()} at {capture_site()} has returned "
                f"{value} for longer than the timeout ({self.timeout} s). A loop that polls a semaphore no peer "
                "signals never ends: wait for it instead (semaphore_wait), or run the kernel under "
                "kernels.interpret for a diagnosis.")
        return value

    def wait(self, sem: SemaphoreRef, value: int, what) -> None:
        slot = self.slot(sem, what)
        seg, me = self.seg, self.device
        if seg.value(me, slot) < value:
            self.comm.sleep_until(lambda: seg.value(me, slot) >= value, self.timeout, lambda: (
                f"device {me}: {what()} at {capture_site()} did not complete within "
                f"{self.timeout} s: "
                f"needs {value}, semaphore {sem.describe()} ({sem.kind.value}) is "
                f"{seg.value(me, slot)}. Probably a deadlock (run the kernel under "
                "kernels.interpret for a diagnosis) or a stalled peer"))
        seg.ctl[seg.cons(me, slot)] += value
        self.consumed[slot] = self.consumed.get(slot, 0) + value

    def barrier_semaphore(self) -> SemaphoreRef:
        return SemaphoreRef(SemaphoreInfo(("barrier",), "barrier", SemaphoreKind.BARRIER, ()))

    def borrow(self, ref: Ref, write: bool):
        return self.tensor(self.device, ref.info)[ref.torch_index()], None

    def end_borrow(self, ref: Ref, write: bool, view, token) -> None:
        pass

    # -- scoped allocation: stack-like, mirrored on every rank
    def alloc_scoped(self, specs, names) -> list:
        refs = []
        for spec, name in zip(specs, names):
            key = ("scoped", len(self.scoped))
            self.scoped.append((key, self.top, self.slot_top))
            if isinstance(spec, SemaphoreSpec):
                self.slots[key] = first = self.alloc_slots(spec)
                info = SemaphoreInfo(key, name, spec.kind, spec.shape)
                for flat in range(spec.count):
                    self.sem_names.setdefault(
                        first + flat, f"'{element_name(info, flat)}' ({spec.kind.value}, scoped)")
                refs.append(SemaphoreRef(info))
            elif spec.local:
                self.local[key] = torch.empty(spec.shape, dtype=spec.dtype)
                refs.append(Ref(BufferInfo(key, name, spec.shape, spec.dtype, "scoped", True)))
            else:
                self.offsets[key] = (self.alloc(spec), spec)
                refs.append(Ref(BufferInfo(key, name, spec.shape, spec.dtype, "scoped")))
        return refs

    def free_scoped(self, refs, check: bool) -> None:
        for _ in refs:
            key, top, slot_top = self.scoped.pop()
            self.offsets.pop(key, None)
            self.local.pop(key, None)
            self.slots.pop(key, None)
            self.top, self.slot_top = top, slot_top


def _overlap(a, b) -> bool:
    """Whether two views' byte ranges intersect (buffers share one shared-memory arena, so their storages
    do not tell them apart)."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        lo = t.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
