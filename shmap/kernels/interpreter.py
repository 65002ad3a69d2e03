"""The verifying interpreter: the specification of what a kernel means.

N devices run the kernel as N Python threads, but a baton makes exactly one of
them run at a time, and a seeded scheduler decides who runs next at every
kernel API call (each read, write, copy start, signal and wait is a
scheduling point).  In-flight copies are scheduled too, as separate events
(the source is read, later the data lands), so copies can be delayed past
later work and complete out of order.  The same seed gives the same run.

On top of running the kernel, the interpreter reports what hardware hides:

- data races, with vector clocks (races.py), naming both accesses;
- deadlock: no device can run and no copy is in flight -- every blocked device
  is listed with the wait it is stuck in -- or a loop polls a semaphore
  (`semaphore_read`) that nothing left can change;
- semaphores left non-zero at exit, with who signalled them;
- an exception on one device stops all devices and is re-raised naming it.

`explore=K` runs K seeded schedules and also checks they agree on the outputs.
Uninitialised output/scratch memory is NaN (ints: their minimum), so a kernel
that reads before writing shows it instead of passing on lucky zeros.

One device's side of the kernel API (reads, writes, copies, semaphores) is in
interpreter_device.py; this module runs the devices and the copies.
"""
from __future__ import annotations

import random
import threading
from typing import Callable, Sequence

import torch

from .common import (
    check_kernel_arity,
    kernel_param_names,
    normalize_inputs,
    poison_,
    same_outputs,
)
from .errors import (
    DeadlockError,
    DeviceError,
    KernelError,
    KernelUsageError,
    ScheduleDependenceError,
    SemaphoreLeakError,
    site_from_traceback,
)
from .interpreter_device import _Copy, _Device, _Token
from .refs import (
    BufferInfo,
    SemaphoreInfo,
    SemaphoreKind,
    SemaphoreRef,
    SemaphoreSpec,
    as_buffer,
    flatten_specs,
)


class _Policy:
    """Seeded choice of who runs next.

    Seed 0 picks uniformly among runnable devices and pending copy events.
    Other seeds also draw how much a device tends to keep running (run-ahead)
    and how eager copies are to complete (delayed or prompt DMAs).
    """

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        if seed == 0:
            self.stay, self.copy_weight = 0.0, 1.0
        else:
            self.stay = self.rng.choice([0.0, 0.5, 0.9])
            self.copy_weight = self.rng.choice([0.1, 1.0, 10.0])
        self.last = None

    def pick(self, devices: list, copies: list):
        if self.last in devices and self.stay and self.rng.random() < self.stay:
            return self.last
        options = devices + copies
        weights = [1.0] * len(devices) + [self.copy_weight] * len(copies)
        choice = self.rng.choices(options, weights)[0]
        self.last = choice
        return choice


class _Run:
    """One schedule of one kernel."""

    def __init__(self, kernel, inputs, out_specs, scratch_specs, grid, seed, poison, seeds_note):
        self.kernel, self.grid, self.seed, self.poison = kernel, tuple(grid), seed, poison
        self.seeds_note = seeds_note
        self.n = len(inputs)
        self.sched = threading.Semaphore(0)
        self.cancelled = False
        self.copies: list[_Copy] = []
        self.next_actor = self.n
        self.steps = 0
        self.polls = 0  # consecutive semaphore_reads with nothing else happening (`_Device.read_semaphore`)
        self.barrier_info = SemaphoreInfo(("barrier",), "barrier", SemaphoreKind.BARRIER, ())
        self.devices = [_Device(self, d) for d in range(self.n)]

        n_in, n_out, n_scr = len(inputs[0]), len(out_specs), len(scratch_specs)
        check_kernel_arity(kernel, n_in, n_out, n_scr)
        names = kernel_param_names(kernel, n_in + n_out + n_scr) or (
            [f"in{i}" for i in range(n_in)] + [f"out{i}" for i in range(n_out)]
            + [f"scratch{i}" for i in range(n_scr)])
        self.refs = []
        for dev, xs in zip(self.devices, inputs):
            refs = []
            for i, x in enumerate(xs):
                info = BufferInfo(("in", i), names[i], tuple(x.shape), x.dtype, "input")
                refs.append(dev.add_buffer(info, x.detach().clone()))
            for i, spec in enumerate(out_specs):
                info = BufferInfo(("out", i), names[n_in + i], spec.shape, spec.dtype, "output",
                                  spec.local)
                t = torch.empty(spec.shape, dtype=spec.dtype)
                refs.append(dev.add_buffer(info, poison_(t) if poison else t))
            for i, spec in enumerate(scratch_specs):
                name, key = names[n_in + n_out + i], ("scratch", i)
                if isinstance(spec, SemaphoreSpec):
                    if spec.kind is SemaphoreKind.BARRIER:
                        refs.append(SemaphoreRef(self.barrier_info))
                    else:
                        refs.append(SemaphoreRef(SemaphoreInfo(key, name, spec.kind, spec.shape)))
                else:
                    info = BufferInfo(key, name, spec.shape, spec.dtype, "scratch", spec.local)
                    t = torch.empty(spec.shape, dtype=spec.dtype)
                    refs.append(dev.add_buffer(info, poison_(t) if poison else t))
            self.refs.append(refs)
        self.n_out = n_out

    def note(self) -> str:
        return (f"(schedule seed={self.seed}, step {self.steps}; replay with "
                f"interpret(..., seed={self.seed}){self.seeds_note})")

    def new_actor(self) -> int:
        self.next_actor += 1
        return self.next_actor

    # -- copy events, run by the scheduler thread
    def _copy_event(self, c: _Copy) -> None:
        cp = c.copy
        src_dev, dst_dev = c.issuer, self.devices[cp.target]
        if c.stage == 0:
            data = src_dev.buffers[cp.src.info.key][cp.src.torch_index()].clone()
            src_dev.record(src_dev, cp.src, False, c.actor, c.clock,
                           f"read of {cp.src.describe()} by {c.describe()}")
            c.data = data
            if c.remote:
                src_dev.sem(cp.send_sem.info, cp.send_sem.element("")[1]).add(_Token(
                    cp.src.nbytes, dict(c.clock), f"send side of {c.describe()}",
                    "call .wait_send() (or .wait()) on the sending device"))
                # The landing is an epoch of its own: waiting for the send side says the source was read,
                # not that the data has landed (the two shared an epoch, so a sender's wait_send, then a
                # signal, ordered the receiver's read after the landing: a missing wait_recv went unseen).
                c.clock = dict(c.clock)
                c.clock[c.actor] = c.clock.get(c.actor, 0) + 1
                c.stage = 1
                return
        if cp.dst.info.key not in dst_dev.buffers:
            raise KernelUsageError(
                f"{c.describe()} landed on device {dst_dev.device}, where scoped buffer "
                f"'{cp.dst.info.name}' is not allocated (the receiver is outside the run_scoped "
                "that allocates it); synchronise before copying into scoped buffers\n" + self.note())
        there = dst_dev.buffers[cp.dst.info.key]
        if tuple(there.shape) != tuple(cp.dst.info.shape) or there.dtype != cp.dst.info.dtype:
            # (each device allocates its scoped buffers itself: a device that allocated this one otherwise
            # would receive bytes of another layout; shared memory reinterprets them, the copy cast them)
            raise KernelUsageError(
                f"{c.describe()} landed on device {dst_dev.device}, whose buffer '{cp.dst.info.name}' is "
                f"{str(there.dtype).replace('torch.', '')}{list(there.shape)} but the sender's is "
                f"{str(cp.dst.info.dtype).replace('torch.', '')}{list(cp.dst.info.shape)}: the devices allocated "
                "it differently. Fix: allocate scoped buffers alike on every device\n" + self.note())
        dst_dev.record(dst_dev, cp.dst, True, c.actor, c.clock,
                       f"write of device {dst_dev.device}'s {cp.dst.describe()} by {c.describe()}")
        there[cp.dst.torch_index()].copy_(c.data)
        c.data = None
        sem = cp.recv_sem if c.remote else cp.sem
        side = "receive side of " if c.remote else ""
        hint = ("call .wait_recv() (or .wait()) on the receiving device" if c.remote
                else "call .wait() on the copy")
        dst_dev.sem(sem.info, sem.element("")[1]).add(
            _Token(cp.dst.nbytes, c.clock, f"{side}{c.describe()}", hint))
        c.stage = 2

    # -- the scheduler
    def execute(self) -> list:
        for dev, refs in zip(self.devices, self.refs):
            dev.thread = threading.Thread(target=dev.main, args=(self.kernel, refs), daemon=True,
                                          name=f"shmap-kernel-device-{dev.device}")
            dev.thread.start()
        policy = _Policy(self.seed)
        error: BaseException | None = None
        try:
            while True:
                failed = [d for d in self.devices if d.status == "failed"]
                if failed:
                    error = self._device_error(failed[0])
                    break
                ready = [d for d in self.devices if d.status == "running"
                         and (d.waiting is None or d.waiting[0].value >= d.waiting[1])]
                if not ready and not self.copies:
                    if all(d.status == "done" for d in self.devices):
                        break
                    error = self._deadlock()
                    break
                choice = policy.pick(ready, self.copies)
                self.steps += 1
                if isinstance(choice, _Device):
                    choice.baton.release()
                    self.sched.acquire()
                else:
                    self.polls = 0
                    self._copy_event(choice)
                    if choice.stage == 2:
                        self.copies.remove(choice)
        except KernelError as e:  # raised by a copy event
            error = e
        finally:
            self._stop()
        if error is not None:
            raise error
        self._check_semaphores()
        outs = []
        for dev in self.devices:
            outs.append([dev.buffers[("out", i)].clone() for i in range(self.n_out)])
        return outs

    def _stop(self) -> None:
        """Unwind every device thread still alive (blocked at a scheduling point)."""
        self.cancelled = True
        for dev in self.devices:
            if dev.status == "running" and dev.thread is not None and dev.thread.is_alive():
                dev.baton.release()
                self.sched.acquire()
        for dev in self.devices:
            if dev.thread is not None:
                dev.thread.join(timeout=5)

    def _device_error(self, dev: _Device) -> BaseException:
        e = dev.error
        others = self.n - 1
        if isinstance(e, KernelError) and not isinstance(e, KernelUsageError):
            return e
        site = site_from_traceback(e.__traceback__)
        err = DeviceError(
            f"device {dev.device} raised {type(e).__name__}: {e}\n  at {site}\n"
            f"The other {others} device(s) were stopped. " + self.note())
        err.__cause__ = e
        return err

    def _states(self) -> list:
        lines = []
        for d in self.devices:
            if d.status == "done":
                lines.append(f"  device {d.device}: finished the kernel")
            elif d.polling is not None:
                sem, site = d.polling
                lines.append(f"  device {d.device}: polls semaphore_read of {sem.describe()} in a loop at "
                             f"{site or '?'}, which returns {d.sem(sem.info, sem.element('semaphore_read')[1]).value}")
            elif d.waiting is None:
                lines.append(f"  device {d.device}: running")
            else:
                s, value, what, where = d.waiting
                lines.append(f"  device {d.device}: blocked in {what()} at {where}: needs {value}, "
                             f"semaphore {s.name} is {s.value}")
        return lines

    def livelock(self) -> DeadlockError:
        """A loop of semaphore_reads that nothing can end (`_Device.read_semaphore`)."""
        return DeadlockError(
            f"deadlock: {self.polls - 1} semaphore_reads in a row with no other kernel call and no copy moving: "
            "a loop polls a semaphore that nothing left can change:\n" + "\n".join(self._states()) + "\n"
            "Fix: wait for the semaphore (semaphore_wait) rather than polling it, and check that some device "
            "signals it.\n" + self.note())

    def _deadlock(self) -> DeadlockError:
        return DeadlockError(
            "deadlock: every live device is blocked and no copy is in flight, so nothing can "
            "ever wake them:\n" + "\n".join(self._states()) + "\n"
            "Typical causes: a wait_recv with no matching start() on the sender, waiting for "
            "more bytes than were sent, or a semaphore_wait that nobody signals.\n" + self.note())

    def _check_semaphores(self) -> None:
        lines = []
        for d in self.devices:
            for s in d.sems.values():
                if s.value:
                    origin = "; ".join(f"{t.desc} ({t.hint})" for t in list(s.tokens)[:3])
                    lines.append(f"  device {d.device}: semaphore {s.name} = {s.value}, left by "
                                 f"{origin}")
        if lines:
            raise SemaphoreLeakError(
                f"kernel exited with {len(lines)} semaphore(s) not at zero (every semaphore must "
                "be back at 0 when the kernel ends, or the next kernel inherits stray counts):\n"
                + "\n".join(lines) + "\n" + self.note())


def interpret(kernel: Callable, inputs_per_device: Sequence, out_shapes, *, scratch=(),
              grid: tuple = (), seed: int = 0, explore: int | None = None,
              poison: bool = True) -> list:
    """Run `kernel` on `len(inputs_per_device)` simulated devices and verify it.

    kernel(*input_refs, *output_refs, *scratch_refs) runs once per point of
    `grid` on every device.  `inputs_per_device[d]` is device d's list of input
    tensors (read-only inside the kernel); `out_shapes` is a `Buffer` (or
    tensor) or a sequence of them; `scratch` lists `Buffer`s and
    `SemaphoreType`s.  Returns, per device, the output tensor (or a tuple of
    them when `out_shapes` is a sequence).

    Raises DataRaceError, DeadlockError, SemaphoreLeakError, DeviceError (an
    exception on one device), ScheduleDependenceError (schedules disagree).
    `explore=K` runs the K schedules seed, seed+1, ..., seed+K-1.
    """
    per_dev = normalize_inputs(inputs_per_device)
    outs, single = flatten_specs(out_shapes)
    out_specs = [as_buffer(s, f"out_shapes[{i}]") for i, s in enumerate(outs)]
    scratch_specs = [s if isinstance(s, SemaphoreSpec) else as_buffer(s, f"scratch[{i}]")
                     for i, s in enumerate(scratch)]
    if explore is not None and (isinstance(explore, bool) or not isinstance(explore, int) or explore < 1):
        raise KernelUsageError(f"interpret: explore must be a positive int (the number of schedules to run) or "
                               f"None, got {explore!r}. Fix: e.g. explore=4.")
    if not (isinstance(grid, (tuple, list)) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 1
                                            for g in grid)):
        raise KernelUsageError(f"interpret: grid must be a tuple of positive ints, got {grid!r}. "
                               "Fix: e.g. grid=(4,), or () for one run per device.")
    seeds = [seed] if explore is None else list(range(seed, seed + explore))
    note = "" if explore is None else f"; found exploring seeds {seeds[0]}..{seeds[-1]}"
    first = None
    for s in seeds:
        result = _Run(kernel, per_dev, out_specs, scratch_specs, grid, s, poison, note).execute()
        if first is None:
            first, first_seed = result, s
        elif not same_outputs(first, result):
            raise ScheduleDependenceError(
                f"outputs differ between schedule seed={first_seed} and seed={s} although neither "
                "run reported a race: the kernel's result depends on timing (e.g. a branch on "
                "semaphore_read, or a wait that consumes whichever of several copies lands first)")
    if single:
        return [o[0] for o in first]
    return [tuple(o) for o in first]


__all__ = ["interpret", "Buffer"]
