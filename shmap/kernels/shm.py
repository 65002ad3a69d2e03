"""Shared-memory runtime: the same kernels on real, truly concurrent processes.

Each rank (device) is a process on one host.  The group's memory is named, so
a process joins by name alone (`ShmComm.connect(name, rank, world)`), which is
what a torch.distributed backend needs; `ShmGroup` (group.py) builds a worker
pool on top.

Layout (files in /dev/shm, mapped by every rank):

- one *arena* per rank: that rank's output, scratch and scoped buffers,
  bump-allocated in kernel order, so the same ref names the same offset on
  every rank and a remote copy is a plain `copy_` into the peer's arena;
- one *control* block of int64 words: per semaphore, one counter per
  (target rank, slot, source rank) and one "consumed" counter per (target,
  slot).  Every word has a single writer (the source, resp. the target), so no
  atomic read-modify-write is needed: aligned 8-byte stores are atomic on
  x86-64 and arm64, and the doorbell below orders them;
- one named POSIX semaphore per rank as a *doorbell*: after bumping a counter
  of rank t, the writer rings t's doorbell; a waiter re-checks its counters
  whenever it wakes, so it sleeps in the kernel instead of spinning (this host
  may run more ranks than cores).

Semantics match the interpreter (copies count bytes on DMA semaphores,
`semaphore_wait` blocks until >= value then subtracts), with copies completing
at `start()` -- one of the schedules the interpreter explores.  The
interpreter is where races are found; this runtime checks what it can cheaply:
semaphores left non-zero (at exit, and again after the next kernel's entry
barrier, when every peer's late signals have landed), waits that time out
(deadlock or a stalled peer, named with the kernel line), and failures: a rank
that raises marks itself failed and rings every doorbell, so no peer hangs.
"""
from __future__ import annotations

import itertools
import mmap
import os
import tempfile
import time
import uuid

import _multiprocessing  # the C implementation behind multiprocessing's semaphores
import torch

from .api import DeviceContext, RemoteCopy
from .errors import (
    KernelError,
    KernelTimeoutError,
    KernelUsageError,
    PeerFailedError,
    SemaphoreLeakError,
)
from .interpreter import check_kernel_arity, kernel_param_names, poison_
from .refs import (
    Buffer,
    BufferInfo,
    Ref,
    SemaphoreInfo,
    SemaphoreKind,
    SemaphoreRef,
    SemaphoreSpec,
    as_buffer,
    element_name,
    flatten_specs,
    set_context,
)

_MAGIC = 0x73686D61704B524E  # "shmapKRN"
_HEADER = 8                  # int64 words: magic, world, slots, capacity, ...
_ERR_BYTES = 2048            # per-rank failure message
_ALIGN = 64
_BARRIER_SLOT, _USER_BARRIER_SLOT, _FIRST_SLOT = 0, 1, 2
_SEMAPHORE = 1  # multiprocessing.synchronize.SEMAPHORE


def align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_group_name() -> str:
    """A fresh group name (names must be unique per live group)."""
    return f"shmap-{os.getpid()}-{uuid.uuid4().hex[:10]}"


class _Doorbell:
    """A named counting semaphore: `ring()` from anyone, `sleep()` by its owner."""

    def __init__(self, name: str, create: bool):
        self.name = name
        maxv = _multiprocessing.SemLock.SEM_VALUE_MAX
        if create:
            self._sem = _multiprocessing.SemLock(_SEMAPHORE, 0, maxv, name, False)
        else:
            self._sem = _multiprocessing.SemLock._rebuild(0, _SEMAPHORE, maxv, name)

    def ring(self) -> None:
        try:
            self._sem.release()
        except ValueError:  # already at SEM_VALUE_MAX: the owner will wake anyway
            pass

    def sleep(self, timeout: float) -> None:
        if self._sem.acquire(True, max(timeout, 0.0)):
            while self._sem.acquire(False):  # collapse a burst of rings into one wake-up
                pass

    def drain(self) -> None:
        while self._sem.acquire(False):
            pass

    def unlink(self) -> None:
        try:
            _multiprocessing.sem_unlink(self.name)
        except FileNotFoundError:
            pass


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class Segments:
    """The named shared memory of one group (see the module docstring)."""

    def __init__(self, name, world, n_slots, capacity, create):
        self.name, self.world, self.n_slots, self.capacity = name, world, n_slots, capacity
        d = segment_dir()
        self.ctl_path = os.path.join(d, f"{name}.ctl")
        self.arena_paths = [os.path.join(d, f"{name}.arena{r}") for r in range(world)]
        self.bell_names = [f"/{name}.bell{r}" for r in range(world)]
        self.cnt_base = _HEADER + world
        self.cons_base = self.cnt_base + world * n_slots * world
        self.err_offset = (self.cons_base + world * n_slots) * 8
        self.ctl_bytes = self.err_offset + world * _ERR_BYTES
        if create:
            self._create()
        self.bells = [_Doorbell(b, create=False) for b in self.bell_names] if not create \
            else self._created_bells
        self._ctl_map = _map(self.ctl_path, self.ctl_bytes)
        self.ctl = memoryview(self._ctl_map).cast("q")
        self._arena_maps = [_map(p, capacity) for p in self.arena_paths]
        self.arenas = [torch.frombuffer(m, dtype=torch.uint8) for m in self._arena_maps]
        if create:
            self.ctl[0:4] = memoryview(bytearray(
                torch.tensor([_MAGIC, world, n_slots, capacity], dtype=torch.int64).numpy()
                .tobytes())).cast("q")

    @classmethod
    def create(cls, name: str, world: int, *, capacity: int, n_slots: int = 256) -> "Segments":
        return cls(name, world, n_slots, align(capacity), create=True)

    @classmethod
    def attach(cls, name: str, *, timeout: float = 30.0) -> "Segments":
        """Open a group created elsewhere, waiting up to `timeout` s for it to appear."""
        path = os.path.join(segment_dir(), f"{name}.ctl")
        deadline = time.monotonic() + timeout
        while True:
            try:
                m = _map(path, _HEADER * 8)
                head = memoryview(m).cast("q")
                magic, world, n_slots, capacity = (int(v) for v in head[:4])
                head.release()
                m.close()
                if magic == _MAGIC:
                    return cls(name, world, n_slots, capacity, create=False)
            except (FileNotFoundError, ValueError, OSError):
                pass
            if time.monotonic() > deadline:
                raise KernelTimeoutError(
                    f"shared-memory group {name!r} did not appear in {segment_dir()} within "
                    f"{timeout} s; is rank 0 running and using the same name?")
            time.sleep(0.01)

    def _create(self) -> None:
        self.unlink()  # a stale group of the same name (a crashed run) is replaced
        self._created_bells = [_Doorbell(b, create=True) for b in self.bell_names]
        for p in self.arena_paths + [self.ctl_path]:
            size = self.ctl_bytes if p == self.ctl_path else self.capacity
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                if hasattr(os, "posix_fallocate") and size:
                    try:  # reserve now: running out of /dev/shm later is a SIGBUS
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        raise KernelUsageError(
                            f"cannot reserve {size} bytes in {segment_dir()} for {p}: {e}; "
                            "lower `capacity` or enlarge /dev/shm") from None
            finally:
                os.close(fd)

    # -- control words
    def cnt(self, target: int, slot: int, source: int) -> int:
        return self.cnt_base + (target * self.n_slots + slot) * self.world + source

    def cons(self, target: int, slot: int) -> int:
        return self.cons_base + target * self.n_slots + slot

    def value(self, target: int, slot: int) -> int:
        b = self.cnt(target, slot, 0)
        return sum(self.ctl[b:b + self.world]) - self.ctl[self.cons(target, slot)]

    def failed(self, rank: int) -> bool:
        return bool(self.ctl[_HEADER + rank])

    def mark_failed(self, rank: int, message: str) -> None:
        raw = message.encode("utf-8", "replace")[:_ERR_BYTES - 1]
        off = self.err_offset + rank * _ERR_BYTES
        self._ctl_map[off:off + len(raw) + 1] = raw + b"\0"
        self.ctl[_HEADER + rank] = 1
        for b in self.bells:
            b.ring()

    def failure_message(self, rank: int) -> str:
        off = self.err_offset + rank * _ERR_BYTES
        raw = bytes(self._ctl_map[off:off + _ERR_BYTES])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def reset(self) -> None:
        """Zero every counter and failure flag (only while no rank is in a kernel)."""
        zero = memoryview(bytes(self.ctl_bytes - _HEADER * 8))
        self._ctl_map[_HEADER * 8:self.ctl_bytes] = zero
        for b in self.bells:
            b.drain()

    def unlink(self) -> None:
        """Remove the names (mapped memory stays valid for whoever has it open)."""
        for p in self.arena_paths + [self.ctl_path]:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        for b in self.bell_names:
            try:
                _multiprocessing.sem_unlink(b)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.arenas = []
        try:
            self.ctl.release()
            self._ctl_map.close()
            for m in self._arena_maps:
                m.close()
        except BufferError:  # a tensor still views the memory; the OS frees it at exit
            pass


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
        self.slot_top = _FIRST_SLOT
        self.scoped: list = []

    # -- allocation
    def alloc(self, spec: Buffer) -> int:
        off = self.top
        self.top = align(off + spec.nbytes)
        if self.top > self.seg.capacity:
            raise KernelUsageError(
                f"the kernel's buffers need more than the group's arena of {self.seg.capacity} "
                "bytes per rank; create the group with a larger capacity")
        return off

    def alloc_slots(self, spec: SemaphoreSpec) -> int:
        slot = self.slot_top
        self.slot_top += spec.count
        if self.slot_top > self.seg.n_slots:
            raise KernelUsageError(
                f"the kernel uses more than {self.seg.n_slots - _FIRST_SLOT} semaphores")
        return slot

    def tensor(self, rank: int, info: BufferInfo) -> torch.Tensor:
        t = self.local.get(info.key)
        if t is not None:
            return t
        off, spec = self.offsets[info.key]
        return self.seg.arenas[rank][off:off + spec.nbytes].view(spec.dtype).view(spec.shape)

    def slot(self, sem: SemaphoreRef, what: str) -> int:
        key, flat = sem.element(what)
        if key == ("barrier",):
            return _USER_BARRIER_SLOT
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
        value = torch.as_tensor(value, dtype=dst.dtype)
        if torch.broadcast_shapes(value.shape, dst.shape) != dst.shape:
            raise KernelUsageError(
                f"write to {ref.describe()}: value of shape {tuple(value.shape)} does not fit "
                f"a ref of shape {tuple(dst.shape)}")
        dst.copy_(value)

    def start_copy(self, copy, site) -> None:
        src = self.tensor(self.device, copy.src.info)[copy.src.torch_index()]
        dst = self.tensor(copy.target, copy.dst.info)[copy.dst.torch_index()]
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
        if target != self.device:
            self.seg.bells[target].ring()

    def signal(self, sem: SemaphoreRef, inc: int, device: int, site) -> None:
        self._bump(device, self.slot(sem, "semaphore_signal"), inc)

    def read_semaphore(self, sem: SemaphoreRef) -> int:
        return self.seg.value(self.device, self.slot(sem, "semaphore_read"))

    def wait(self, sem: SemaphoreRef, value: int, what: str, site) -> None:
        slot = self.slot(sem, what)
        seg, me = self.seg, self.device
        if seg.value(me, slot) < value:
            self.comm.sleep_until(lambda: seg.value(me, slot) >= value, self.timeout, lambda: (
                f"device {me}: {what} at {site} did not complete within {self.timeout} s: "
                f"needs {value}, semaphore {sem.describe()} ({sem.kind.value}) is "
                f"{seg.value(me, slot)}. Probably a deadlock (run the kernel under "
                "kernels.interpret for a diagnosis) or a stalled peer"))
        seg.ctl[seg.cons(me, slot)] += value

    def barrier_semaphore(self) -> SemaphoreRef:
        return SemaphoreRef(SemaphoreInfo(("barrier",), "barrier", SemaphoreKind.BARRIER, ()))

    # -- scoped allocation: stack-like, mirrored on every rank
    def alloc_scoped(self, specs, names) -> list:
        refs = []
        for spec, name in zip(specs, names):
            key = ("scoped", len(self.scoped))
            self.scoped.append((key, self.top, self.slot_top))
            if isinstance(spec, SemaphoreSpec):
                self.slots[key] = self.alloc_slots(spec)
                refs.append(SemaphoreRef(SemaphoreInfo(key, name, spec.kind, spec.shape)))
            else:
                self.offsets[key] = (self.alloc(spec), spec)
                refs.append(Ref(BufferInfo(key, name, spec.shape, spec.dtype, "scoped")))
        return refs

    def free_scoped(self, refs, site, check: bool) -> None:
        for _ in refs:
            key, top, slot_top = self.scoped.pop()
            self.offsets.pop(key, None)
            self.slots.pop(key, None)
            self.top = top
            self.slot_top = max(self.slot_top, slot_top) if False else self.slot_top
        # Semaphore slots are not reused within a kernel: the exit check must see them all.


class ShmComm:
    """One rank of a shared-memory group: runs kernels as device `rank`.

    Create it in each rank's process with `ShmComm.connect(name, rank, world)`
    (rank 0 creates the memory, the others attach by name), then call
    `run(kernel, inputs, out_shapes, ...)` in SPMD fashion: every rank calls
    it with the same kernel and shapes, and gets its own outputs.
    """

    def __init__(self, segments: Segments, rank: int, *, timeout: float = 60.0):
        if not 0 <= rank < segments.world:
            raise KernelUsageError(f"rank {rank} is out of range for a group of {segments.world}")
        self.seg, self.rank, self.world, self.timeout = segments, rank, segments.world, timeout
        self.epoch = 0
        self.prev_slots = _FIRST_SLOT
        self.kernel_names: dict = {}

    @classmethod
    def connect(cls, name: str, rank: int, world_size: int, *, capacity: int = 64 << 20,
                n_slots: int = 256, timeout: float = 60.0) -> "ShmComm":
        """Join group `name`: rank 0 creates it, others attach; returns once all have joined."""
        if rank == 0:
            seg = Segments.create(name, world_size, capacity=capacity, n_slots=n_slots)
        else:
            seg = Segments.attach(name, timeout=timeout)
            if seg.world != world_size:
                raise KernelUsageError(
                    f"group {name!r} has {seg.world} ranks, this process expected {world_size}")
        comm = cls(seg, rank, timeout=timeout)
        comm.barrier()
        if rank == 0:
            seg.unlink()  # everyone has it mapped; nothing leaks if a rank crashes later
        return comm

    # -- synchronisation primitives
    def check_peers(self) -> None:
        for r in range(self.world):
            if r != self.rank and self.seg.failed(r):
                raise PeerFailedError(
                    f"device {self.rank} stopped because device {r} failed: "
                    f"{self.seg.failure_message(r)}")

    def sleep_until(self, ready, timeout: float, describe) -> None:
        """Block (in the kernel, not spinning) until ready(); errors on peer failure/timeout."""
        deadline = time.monotonic() + timeout
        bell = self.seg.bells[self.rank]
        while not ready():
            self.check_peers()
            left = deadline - time.monotonic()
            if left <= 0:
                raise KernelTimeoutError(describe())
            bell.sleep(min(left, 1.0))

    def barrier(self, n: int | None = None, epoch: int | None = None) -> None:
        """Generation barrier over ranks 0..n-1: one monotonic counter per (target, source),
        so a rank that races ahead into the next barrier cannot be mistaken for a late one."""
        n = self.world if n is None else n
        self.epoch = self.epoch + 1 if epoch is None else epoch
        seg, me, e = self.seg, self.rank, self.epoch
        for p in range(n):
            if p != me:
                seg.ctl[seg.cnt(p, _BARRIER_SLOT, me)] = e
                seg.bells[p].ring()
        peers = [seg.cnt(me, _BARRIER_SLOT, s) for s in range(n) if s != me]
        self.sleep_until(lambda: all(seg.ctl[i] >= e for i in peers), self.timeout, lambda: (
            f"device {me}: entry barrier {e} timed out after {self.timeout} s; not arrived: "
            + ", ".join(f"device {s}" for s in range(n) if s != me
                        and seg.ctl[seg.cnt(me, _BARRIER_SLOT, s)] < e)))

    def _leftovers(self, slots, names, when: str) -> None:
        bad = []
        for slot in slots:
            v = self.seg.value(self.rank, slot)
            if v:
                bad.append(f"  device {self.rank}: semaphore {names.get(slot, f'#{slot}')} = {v}")
        if bad:
            raise SemaphoreLeakError(
                f"{when} with {len(bad)} semaphore(s) not at zero (every semaphore must be back "
                "at 0 when the kernel ends):\n" + "\n".join(bad)
                + "\nRun the kernel under kernels.interpret to see who signalled them.")

    # -- running a kernel
    def run(self, kernel, inputs, out_shapes, *, scratch=(), grid=(), timeout=None,
            n: int | None = None, epoch: int | None = None, arena_base: int = 0,
            poison: bool = False, copy_outputs: bool = True):
        """Run `kernel` as this rank's device; returns this rank's output(s).

        `inputs` is this rank's list of tensors.  `n` (default: the group
        size) runs the kernel on ranks 0..n-1 only.  A failure here marks the
        rank failed so that peers stop instead of hanging.
        """
        n = self.world if n is None else n
        try:
            return self._run(kernel, inputs, out_shapes, scratch, tuple(grid),
                             self.timeout if timeout is None else timeout, n, epoch,
                             arena_base, poison, copy_outputs)
        except BaseException as e:
            if not isinstance(e, PeerFailedError):
                self.seg.mark_failed(self.rank, f"{type(e).__name__}: {e}")
            raise

    def _run(self, kernel, inputs, out_shapes, scratch, grid, timeout, n, epoch, arena_base,
             poison, copy_outputs):
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        outs, single = flatten_specs(out_shapes)
        out_specs = [as_buffer(s, f"out_shapes[{i}]") for i, s in enumerate(outs)]
        scratch = [s if isinstance(s, SemaphoreSpec) else as_buffer(s, f"scratch[{i}]")
                   for i, s in enumerate(scratch)]
        names = self._names(kernel, len(inputs), len(out_specs), len(scratch))

        dev = _Device(self, n, grid, timeout)
        dev.top = align(arena_base)
        refs = []
        for i, x in enumerate(inputs):
            info = BufferInfo(("in", i), names[i], tuple(x.shape), x.dtype, "input")
            dev.local[info.key] = x
            refs.append(Ref(info))
        for i, spec in enumerate(out_specs):
            info = BufferInfo(("out", i), names[len(inputs) + i], spec.shape, spec.dtype, "output")
            dev.offsets[info.key] = (dev.alloc(spec), spec)
            refs.append(Ref(info))
        sem_names = {_USER_BARRIER_SLOT: "'barrier' (BARRIER)"}
        for i, spec in enumerate(scratch):
            name, key = names[len(inputs) + len(out_specs) + i], ("scratch", i)
            if isinstance(spec, SemaphoreSpec):
                if spec.kind is SemaphoreKind.BARRIER:
                    refs.append(dev.barrier_semaphore())
                    continue
                info = SemaphoreInfo(key, name, spec.kind, spec.shape)
                dev.slots[key] = first = dev.alloc_slots(spec)
                for flat in range(spec.count):
                    sem_names[first + flat] = f"'{element_name(info, flat)}' ({spec.kind.value})"
                refs.append(SemaphoreRef(info))
            else:
                info = BufferInfo(key, name, spec.shape, spec.dtype, "scratch")
                dev.offsets[key] = (dev.alloc(spec), spec)
                refs.append(Ref(info))
        if poison:
            for key, (off, spec) in dev.offsets.items():
                poison_(dev.tensor(self.rank, BufferInfo(key, "", spec.shape, spec.dtype, "")))

        # Entry barrier: every peer has finished the previous kernel (so our buffers are ours
        # again, and its late signals have landed) before anyone writes into them.
        self.barrier(n, epoch)
        self._leftovers(range(_USER_BARRIER_SLOT, self.prev_slots), self.kernel_names,
                        "the previous kernel on this group ended")
        self.prev_slots, self.kernel_names = dev.slot_top, sem_names

        set_context(dev)
        try:
            for idx in itertools.product(*(range(g) for g in grid)):
                dev.grid_index = idx
                kernel(*refs)
        finally:
            set_context(None)
        self._leftovers(range(_USER_BARRIER_SLOT, dev.slot_top), sem_names, "the kernel ended")
        self.prev_slots = _FIRST_SLOT if not copy_outputs else self.prev_slots

        results = []
        for i, spec in enumerate(out_specs):
            off, _ = dev.offsets[("out", i)]
            if copy_outputs:
                results.append(dev.tensor(self.rank, BufferInfo(("out", i), "", spec.shape,
                                                                spec.dtype, "")).clone())
            else:
                results.append((off, spec))
        if not copy_outputs:
            return results
        return results[0] if single else tuple(results)

    def _names(self, kernel, n_in, n_out, n_scr) -> list:
        check_kernel_arity(kernel, n_in, n_out, n_scr)
        return kernel_param_names(kernel, n_in + n_out + n_scr) or (
            [f"in{i}" for i in range(n_in)] + [f"out{i}" for i in range(n_out)]
            + [f"scratch{i}" for i in range(n_scr)])

    def reset_local(self) -> None:
        """Forget per-kernel state after the group's control block was reset."""
        self.epoch, self.prev_slots, self.kernel_names = 0, _FIRST_SLOT, {}
        self.seg.bells[self.rank].drain()

    def close(self) -> None:
        self.seg.close()


__all__ = ["ShmComm", "Segments", "new_group_name", "KernelError"]
