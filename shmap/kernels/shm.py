"""Shared-memory runtime: the same kernels on real, truly concurrent processes.

Each rank (device) is a process on one host.  The group's memory is named
(segments.py), so a process joins by name alone (`ShmComm.connect(name, rank,
world)`), which is what a torch.distributed backend needs; `ShmGroup`
(group.py) builds a worker pool on top.

A kernel's output, scratch and scoped buffers are bump-allocated in each
rank's arena in kernel order, so the same ref names the same offset on every
rank and a remote copy is a plain `copy_` into the peer's arena; inputs stay
where the caller has them (they are read-only, and nobody copies into them).

Semantics match the interpreter (copies count bytes on DMA semaphores,
`semaphore_wait` blocks until >= value then subtracts), with copies completing
at `start()` -- one of the schedules the interpreter explores.  The
interpreter is where races are found; this runtime checks what it can cheaply:
semaphores left non-zero (at exit, and again after the next kernel's entry
barrier, when every peer's late signals have landed), waits that time out
(deadlock or a stalled peer, named with the kernel line), and failures: a rank
that raises marks itself failed and rings every doorbell, so no peer hangs.

One rank's side of the kernel API (reads, writes, copies, semaphores) is in
shm_device.py; this module holds the group (`ShmComm`) and runs kernels.
"""
from __future__ import annotations

import functools
import itertools
import os
import time

import torch

from .common import check_kernel_arity, kernel_param_names, poison_
from .errors import (
    KernelTimeoutError,
    KernelUsageError,
    PeerFailedError,
    SemaphoreLeakError,
)
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
from .segments import (
    ALIGN,
    BARRIER_SLOT,
    FIRST_SLOT,
    USER_BARRIER_SLOT,
    Segments,
    align,
    new_group_name,
)
from .shm_device import _Device

#: seconds between a watched wait's calls to its `ShmComm.watcher` (the guard's poll interval)
WATCH_EVERY = 0.25


def _kernel_key(kernel):
    """Cache key for a kernel; partials built per call compare by their contents."""
    if isinstance(kernel, functools.partial):
        try:
            key = (kernel.func, kernel.args, tuple(sorted(kernel.keywords.items())))
            hash(key)
            return key
        except TypeError:
            return kernel
    return kernel


def _spec_key(spec):
    if type(spec) in (Buffer, SemaphoreSpec):
        return spec
    if isinstance(spec, torch.Tensor):
        return ("tensor", tuple(spec.shape), spec.dtype)
    if isinstance(spec, (list, tuple)):
        return tuple(_spec_key(s) for s in spec)
    return spec


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
        # Busy-poll briefly before sleeping when every rank can have a core; with more ranks
        # than cores, polling only steals the core from the peer we wait for.
        spare = self.world <= (os.cpu_count() or 1)
        self.spin = float(os.environ.get("SHMAP_SHM_SPIN_US", "50" if spare else "0")) * 1e-6
        self.spin_yield = os.environ.get("SHMAP_SHM_SPIN_YIELD", "0") == "1"
        self.epoch = 0
        self.prev = None            # (epoch, n, slot_max, consumed, names) of the last kernel
        self._plans: dict = {}
        self.last_sync = "barrier"
        self.bank_written = [0, 0]  # how many slots of each bank this rank has written
        # Called between sleeps of a wait that did not complete at once (None: none): it may raise to
        # end the wait.  Its owner watches there what this runtime cannot see, e.g. shmap's guard reads
        # the store for peers that exited or failed outside any kernel.
        self.watcher = None

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
        """Block until ready(); errors on peer failure/timeout.

        First a short busy poll (only when ranks <= cores; SHMAP_SHM_SPIN_US
        overrides its length), then sleep on the doorbell.  The poll avoids a
        sleep/wake round trip when the peer is about to signal anyway.
        """
        spin_until = time.perf_counter() + self.spin
        while time.perf_counter() < spin_until:
            if ready():
                return
            if self.spin_yield:
                os.sched_yield()
        deadline = time.monotonic() + timeout
        bell = self.seg.bells[self.rank]
        watcher = self.watcher
        while not ready():
            self.check_peers()
            if watcher is not None:
                watcher()
            left = deadline - time.monotonic()
            if left <= 0:
                raise KernelTimeoutError(describe())
            bell.sleep(min(left, 1.0 if watcher is None else WATCH_EVERY))

    def barrier(self, n: int | None = None, epoch: int | None = None) -> None:
        """Generation barrier over ranks 0..n-1: one monotonic counter per (target, source),
        so a rank that races ahead into the next barrier cannot be mistaken for a late one."""
        n = self.world if n is None else n
        self.epoch = self.epoch + 1 if epoch is None else epoch
        seg, me, e = self.seg, self.rank, self.epoch
        for p in range(n):
            if p != me:
                seg.ctl[seg.cnt(p, BARRIER_SLOT, me)] = e
                seg.bells[p].ring()
        peers = [seg.cnt(me, BARRIER_SLOT, s) for s in range(n) if s != me]
        self.sleep_until(lambda: all(seg.ctl[i] >= e for i in peers), self.timeout, lambda: (
            f"device {me}: entry barrier {e} timed out after {self.timeout} s; not arrived: "
            + ", ".join(f"device {s}" for s in range(n) if s != me
                        and seg.ctl[seg.cnt(me, BARRIER_SLOT, s)] < e)))

    def _publish(self, dev: "_Device", names: dict) -> None:
        """Write what this rank sent during the kernel into the bank of the epoch's parity.

        Peers check it after the next entry barrier.  A peer can by then have
        finished the *next* kernel (writing the other bank) but not the one
        after, whose barrier waits for us -- so two banks are enough.
        """
        seg, me, ctl = self.seg, self.rank, self.seg.ctl
        bank = self.epoch % 2
        upto = max(dev.slot_max, self.bank_written[bank])
        for t in range(self.world):
            for slot in range(USER_BARRIER_SLOT, upto):
                ctl[seg.sent(bank, t, slot, me)] = dev.sent.get((t, slot), 0)
        self.bank_written[bank] = dev.slot_max
        self.prev = (self.epoch, dev.num_devices, dev.slot_max, dev.consumed, names)

    def _late_signals(self) -> None:
        """After the entry barrier: did signals of the previous kernel arrive after we left?"""
        if self.prev is None or self.prev[0] != self.epoch - 1:
            return  # not consecutive (a ShmGroup checks exactly from the parent instead)
        epoch, n, slot_max, consumed, names = self.prev
        seg, me, ctl = self.seg, self.rank, self.seg.ctl
        values = {}
        for slot in range(USER_BARRIER_SLOT, slot_max):
            got = sum(ctl[seg.sent(epoch % 2, me, slot, s)] for s in range(n))
            values[slot] = got - consumed.get(slot, 0)
        self._leftovers(values, names, "the previous kernel on this group ended (counting "
                        "signals that arrived after this device had left it)")

    def _leftovers(self, slots, names, when: str) -> None:
        bad = []
        for slot in slots:
            v = slots[slot] if isinstance(slots, dict) else self.seg.value(self.rank, slot)
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
            poison: bool = False, outputs: str = "copy", sync: str = "barrier",
            check_late: bool = True, out=None):
        """Run `kernel` as this rank's device; returns this rank's output(s).

        `inputs` is this rank's list of tensors (read-only in the kernel; not
        copied).  `n` (default: the group size) runs on ranks 0..n-1 only.
        `outputs`: "copy" (new tensors), "view" (views of the arena, valid
        until the next kernel on this comm), "offsets" (for ShmGroup).  Local
        outputs (`Buffer(..., local=True)`) are private tensors, returned as
        they are; `out=[tensor or None, ...]` makes them write into the
        caller's tensors instead (no copy at all).

        `sync="barrier"` (default) starts with an entry barrier, so a kernel
        may assume every peer has finished the previous one.  `sync="parity"`
        skips it and alternates between two halves of the arena and of the
        semaphores instead; that is only safe when, in every kernel, each rank
        waits for data from every other rank (so no rank can be two kernels
        ahead of another) -- true of the direct collectives in transport.py.

        A failure marks this rank failed so that peers stop instead of hanging.
        """
        n = self.world if n is None else n
        try:
            return self._run(kernel, inputs, out_shapes, scratch, tuple(grid),
                             self.timeout if timeout is None else timeout, n, epoch,
                             arena_base, poison, outputs, sync, check_late, out)
        except BaseException as e:
            if not isinstance(e, PeerFailedError):
                self.seg.mark_failed(self.rank, f"{type(e).__name__}: {e}")
            raise

    def _plan(self, kernel, inputs, out_shapes, scratch, n, grid, base, slot_base, limits,
              all_shared):
        """Refs, offsets and semaphore slots of a kernel call (cached: the hot path of
        repeated collectives should not rebuild them).  Local buffers live in private
        memory, unless `all_shared` (ShmGroup's parent reads every output from the arena)."""
        outs, single = flatten_specs(out_shapes)
        out_specs = [as_buffer(s, f"out_shapes[{i}]") for i, s in enumerate(outs)]
        scratch = [s if isinstance(s, SemaphoreSpec) else as_buffer(s, f"scratch[{i}]")
                   for i, s in enumerate(scratch)]
        names = self._names(kernel, len(inputs), len(out_specs), len(scratch))
        dev = _Device(self, n, grid, self.timeout)
        dev.top, dev.slot_top = base, slot_base
        dev.arena_limit, dev.slot_limit = limits
        refs = []
        for i, x in enumerate(inputs):
            refs.append(Ref(BufferInfo(("in", i), names[i], tuple(x.shape), x.dtype, "input")))
        out_keys, private = [], {}
        for i, spec in enumerate(out_specs):
            info = BufferInfo(("out", i), names[len(inputs) + i], spec.shape, spec.dtype, "output",
                              spec.local)
            if spec.local and not all_shared:
                private[info.key] = spec
            else:
                dev.offsets[info.key] = (dev.alloc(spec), spec)
            refs.append(Ref(info))
            out_keys.append(info.key)
        sem_names = {USER_BARRIER_SLOT: "'barrier' (BARRIER)"}
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
                info = BufferInfo(key, name, spec.shape, spec.dtype, "scratch", spec.local)
                if spec.local:  # private, and reused by later calls with this plan
                    private[key] = torch.empty(spec.shape, dtype=spec.dtype)
                else:
                    dev.offsets[key] = (dev.alloc(spec), spec)
                refs.append(Ref(info))
        return {"refs": refs, "offsets": dev.offsets, "slots": dev.slots, "top": dev.top,
                "slot_top": dev.slot_top, "names": sem_names, "out_keys": out_keys, "views": {},
                "out_specs": out_specs, "single": single, "private": private}

    def _run(self, kernel, inputs, out_shapes, scratch, grid, timeout, n, epoch, arena_base,
             poison, outputs, sync, check_late, out):
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        if sync not in ("barrier", "parity"):
            raise KernelUsageError(f"sync must be 'barrier' or 'parity', got {sync!r}")
        base, slot_base = align(arena_base), FIRST_SLOT
        limits = (self.seg.capacity, self.seg.n_slots)
        if sync == "parity":
            parity = (self.epoch + 1) % 2
            half = (self.seg.capacity - base) // 2 // ALIGN * ALIGN
            half_slots = (self.seg.n_slots - FIRST_SLOT) // 2
            base, slot_base = base + parity * half, FIRST_SLOT + parity * half_slots
            limits = (base + half, slot_base + half_slots)
        all_shared = outputs == "offsets"
        key = (_kernel_key(kernel), tuple([(x.shape, x.dtype) for x in inputs]),
               _spec_key(out_shapes), _spec_key(scratch), grid, n, base, slot_base, all_shared)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(kernel, inputs, out_shapes, scratch, n, grid, base, slot_base,
                              limits, all_shared)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = plan

        dev = _Device(self, n, grid, timeout)
        dev.offsets, dev.slots = dict(plan["offsets"]), dict(plan["slots"])
        dev.top, dev.slot_top = plan["top"], plan["slot_top"]
        dev.slot_max = plan["slot_top"]
        dev.arena_limit, dev.slot_limit = limits
        dev.sem_names = sem_names = dict(plan["names"])
        dev.views = plan["views"]
        dev.local = {("in", i): x for i, x in enumerate(inputs)}
        for k, spec in plan["private"].items():
            if isinstance(spec, torch.Tensor):  # local scratch
                dev.local[k] = spec
            elif out is not None and out[k[1]] is not None:  # write the caller's tensor
                t = out[k[1]]
                if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                    raise KernelUsageError(
                        f"out[{k[1]}] is {tuple(t.shape)} {t.dtype}, but the kernel's output "
                        f"{k[1]} is {spec.shape} {spec.dtype}")
                dev.local[k] = t
            else:
                dev.local[k] = torch.empty(spec.shape, dtype=spec.dtype)
        if poison:
            for k, (off, spec) in dev.offsets.items():
                poison_(self.seg.arenas[self.rank][off:off + spec.nbytes].view(spec.dtype))
            for k in plan["private"]:
                poison_(dev.local[k])

        if sync == "barrier" or self.last_sync != "parity":
            # (A parity kernel right after a barrier kernel still needs this barrier: the
            # barrier kernel's buffers overlap both halves.)
            # Every peer has finished the previous kernel (so our buffers are ours again)
            # before anyone writes into them.  Peers may already be signalling us for this
            # kernel, so the late-signal check uses what each peer reported it sent in the
            # previous one, not the live counters.
            self.barrier(n, epoch)
            if check_late:
                self._late_signals()
        else:
            self.epoch = self.epoch + 1 if epoch is None else epoch
        self.last_sync = sync
        first_slot = slot_base if sync == "parity" else USER_BARRIER_SLOT

        set_context(dev)
        try:
            for idx in itertools.product(*(range(g) for g in grid)):
                dev.grid_index = idx
                kernel(*plan["refs"])
        finally:
            set_context(None)
        if outputs != "offsets":
            # (A ShmGroup worker leaves this to its parent, which checks every device once all have
            # finished: a worker raising here would stop its peers before their own check, and the
            # report would name only the first device that leaked.)
            self._leftovers(range(first_slot, dev.slot_max), sem_names, "the kernel ended")
        if check_late and sync == "barrier":
            self._publish(dev, sem_names)
        else:
            self.prev = None

        if outputs == "offsets":
            return ([(dev.offsets[k][0], spec) for k, spec in zip(plan["out_keys"],
                                                                   plan["out_specs"])],
                    dev.slot_max, sem_names)
        results = []
        for k, spec in zip(plan["out_keys"], plan["out_specs"]):
            if k in dev.local:  # a local output: already private, nothing to copy
                results.append(dev.local[k])
                continue
            off = dev.offsets[k][0]
            view = self.seg.arenas[self.rank][off:off + spec.nbytes].view(spec.dtype)
            view = view.view(spec.shape)
            results.append(view.clone() if outputs == "copy" else view)
        return results[0] if plan["single"] else tuple(results)

    def _names(self, kernel, n_in, n_out, n_scr) -> list:
        check_kernel_arity(kernel, n_in, n_out, n_scr)
        return kernel_param_names(kernel, n_in + n_out + n_scr) or (
            [f"in{i}" for i in range(n_in)] + [f"out{i}" for i in range(n_out)]
            + [f"scratch{i}" for i in range(n_scr)])

    def reset_local(self) -> None:
        """Forget per-kernel state after the group's control block was reset."""
        self.epoch, self.prev, self.bank_written = 0, None, [0, 0]
        self.seg.bells[self.rank].drain()

    def close(self) -> None:
        self.seg.close()


__all__ = ["ShmComm", "Segments", "new_group_name"]
