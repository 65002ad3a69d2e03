"""Named shared memory for one group of ranks: arenas, control words, doorbells.

Files in /dev/shm (or the temp dir), mapped by every rank, and one named POSIX
semaphore per rank:

- one *arena* per rank, holding that rank's output, scratch and scoped
  buffers of the current kernel (see shm.py for how they are laid out);
- one *control* block of int64 words.  Per semaphore slot there is one
  counter per (target rank, slot, source rank), one "consumed" counter per
  (target, slot), and two banks of "sent during the last kernel" words (for
  the late-signal check).  Every word has a single writer, so no atomic
  read-modify-write is needed: aligned 8-byte stores are atomic on x86-64 and
  arm64, and the doorbell below orders them;
- per rank a *doorbell*: after bumping a counter of rank t, the writer rings
  t's doorbell; a waiter re-checks its counters whenever it wakes, so it can
  sleep in the kernel instead of spinning (this host may run more ranks than
  cores).  The doorbell is the semaphore implementation behind Python's
  multiprocessing (`_multiprocessing.SemLock`), opened by name.

The creator unlinks every name as soon as all ranks have attached, so a crash
later leaks nothing.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
import uuid

import _multiprocessing  # the C implementation behind multiprocessing's semaphores
import torch

from .errors import KernelTimeoutError, KernelUsageError

_MAGIC = 0x73686D61704B524E  # "shmapKRN"
_HEADER = 8                  # int64 words: magic, world, slots, capacity, ...
_ERR_BYTES = 2048            # per-rank failure message
ALIGN = 64
BARRIER_SLOT, USER_BARRIER_SLOT, FIRST_SLOT = 0, 1, 2  # reserved semaphore slots
_SEMAPHORE = 1  # multiprocessing.synchronize.SEMAPHORE


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
        self.sent_base = self.cnt_base + world * n_slots * world
        self.cons_base = self.sent_base + 2 * world * n_slots * world
        self.err_offset = (self.cons_base + world * n_slots) * 8
        self.ctl_bytes = self.err_offset + world * _ERR_BYTES
        if create:
            self._create()
        self.bells = [_Doorbell(b, create=create) for b in self.bell_names]
        self._ctl_map = _map(self.ctl_path, self.ctl_bytes)
        self.ctl = memoryview(self._ctl_map).cast("q")
        self._arena_maps = [_map(p, capacity) for p in self.arena_paths]
        self.arenas = [torch.frombuffer(m, dtype=torch.uint8) for m in self._arena_maps]
        if create:  # the magic word goes last: attachers poll for it
            self.ctl[1], self.ctl[2], self.ctl[3] = world, n_slots, capacity
            self.ctl[0] = _MAGIC

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

    def sent(self, bank: int, target: int, slot: int, source: int) -> int:
        """What `source` sent to (target, slot) during its last kernel of epoch parity `bank`."""
        return (self.sent_base + bank * self.world * self.n_slots * self.world
                + (target * self.n_slots + slot) * self.world + source)

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
