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
  is listed with the wait it is stuck in;
- semaphores left non-zero at exit, with who signalled them;
- an exception on one device stops all devices and is re-raised naming it.

`explore=K` runs K seeded schedules and also checks they agree on the outputs.
Uninitialised output/scratch memory is NaN (ints: their minimum), so a kernel
that reads before writing shows it instead of passing on lucky zeros.
"""
from __future__ import annotations

import collections
import itertools
import random
import threading
from typing import Callable, Sequence

import torch

from . import races
from .api import DeviceContext, RemoteCopy
from .common import (
    check_kernel_arity,
    fit_value,
    kernel_param_names,
    normalize_inputs,
    poison_,
    same_outputs,
)
from .errors import (
    DataRaceError,
    DeadlockError,
    DeviceError,
    KernelError,
    KernelUsageError,
    ScheduleDependenceError,
    SemaphoreLeakError,
    capture_site,
    site_from_traceback,
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
    format_box,
    set_context,
)


class _Cancelled(BaseException):
    """Raised inside a device thread to unwind it when the run is aborted."""


class _Token:
    """A semaphore increment, with the clock of whoever made it (for happens-before)."""

    __slots__ = ("amount", "clock", "desc", "hint")

    def __init__(self, amount, clock, desc, hint):
        self.amount, self.clock, self.desc, self.hint = amount, clock, desc, hint


class _Sem:
    __slots__ = ("info", "flat", "tokens", "value")

    def __init__(self, info: SemaphoreInfo, flat: int):
        self.info, self.flat = info, flat
        self.tokens: collections.deque = collections.deque()
        self.value = 0

    @property
    def name(self) -> str:
        return f"'{element_name(self.info, self.flat)}' ({self.info.kind.value})"

    def add(self, tok: _Token) -> None:
        if tok.amount:
            self.tokens.append(tok)
            self.value += tok.amount

    def take(self, value: int, clock: dict) -> None:
        self.value -= value
        while value:
            tok = self.tokens[0]
            used = min(tok.amount, value)
            races.join(clock, tok.clock)
            tok.amount -= used
            value -= used
            if not tok.amount:
                self.tokens.popleft()


class _Copy:
    """A started copy: an actor of its own, stepping through read -> land."""

    def __init__(self, actor, copy, issuer, clock, site):
        self.actor, self.copy, self.issuer, self.clock, self.site = actor, copy, issuer, clock, site
        self.remote = isinstance(copy, RemoteCopy)
        self.stage = 0  # remote: 0 read pending, 1 land pending, 2 done; local: 0 -> 2
        self.data = None

    def describe(self) -> str:
        return f"{self.copy!r} started by device {self.issuer.device} at {self.site}"


class _Device(DeviceContext):
    def __init__(self, run: "_Run", device: int):
        self.run, self.device, self.num_devices = run, device, run.n
        self.grid, self.grid_index = run.grid, ()
        self.clock = {device: 1}
        self.buffers: dict = {}
        self.infos: dict = {}
        self.histories: dict = {}
        self.sems: dict = {}
        self.scoped: list = []
        self.baton = threading.Semaphore(0)
        self.status = "running"
        self.waiting = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    # -- scheduling
    def _yield(self, waiting=None) -> None:
        self.waiting = waiting
        self.run.sched.release()
        self.baton.acquire()
        if self.run.cancelled:
            raise _Cancelled()

    def _tick(self) -> None:
        self.clock[self.device] += 1

    # -- memory
    def add_buffer(self, info: BufferInfo, tensor: torch.Tensor) -> Ref:
        self.buffers[info.key] = tensor
        self.infos[info.key] = info
        if not info.readonly:
            self.histories[info.key] = races.History()
        return Ref(info)

    def sem(self, info: SemaphoreInfo, flat: int) -> _Sem:
        s = self.sems.get((info.key, flat))
        if s is None:
            s = self.sems[(info.key, flat)] = _Sem(info, flat)
        return s

    def record(self, owner: "_Device", ref: Ref, write: bool, actor: int, clock: dict,
               who: str) -> None:
        history = owner.histories.get(ref.info.key)
        if history is None:
            return
        new = races.Access(actor, clock.get(actor, 0), write, ref.box(), who)
        hit = history.check(new, clock)
        if hit is not None:
            old, overlap = hit
            raise DataRaceError(
                f"data race on device {owner.device}'s buffer '{ref.info.name}', elements "
                f"{format_box(overlap)}:\n  {old.who}\n  {new.who}\n"
                "Neither access is ordered before the other: no semaphore wait (or copy wait) "
                "connects them, so on hardware they may happen in either order or at the same "
                "time. Order them with a semaphore handshake, or give them separate buffers.\n"
                + self.run.note())

    def read(self, ref: Ref):
        site = capture_site(2)
        self._yield()
        value = self.buffers[ref.info.key][ref.torch_index()].clone()
        self.record(self, ref, False, self.device, self.clock,
                    f"read of {ref.describe()} by device {self.device} at {site}")
        return value

    def write(self, ref: Ref, value) -> None:
        site = capture_site(2)
        if ref.info.readonly:
            raise KernelUsageError(
                f"write to {ref.describe()}: kernel inputs are read-only; write an output or "
                "scratch buffer instead")
        self._yield()
        dst = self.buffers[ref.info.key][ref.torch_index()]
        value = fit_value(value, dst, ref)
        self.record(self, ref, True, self.device, self.clock,
                    f"write of {ref.describe()} by device {self.device} at {site}")
        dst.copy_(value)

    # -- copies and semaphores
    def start_copy(self, copy) -> None:
        site = capture_site()
        self._yield()
        actor = self.run.new_actor()
        clock = dict(self.clock)
        clock[actor] = 1
        self._tick()
        self.run.copies.append(_Copy(actor, copy, self, clock, site))

    def wait(self, sem: SemaphoreRef, value: int, what) -> None:
        site = capture_site()
        key, flat = sem.element(what)
        s = self.sem(sem.info, flat)
        self._yield(waiting=(s, value, what, site))
        s.take(value, self.clock)
        self.waiting = None

    def signal(self, sem: SemaphoreRef, inc: int, device: int) -> None:
        site = capture_site()
        self._yield()
        key, flat = sem.element("semaphore_signal")
        tok = _Token(inc, dict(self.clock),
                     f"semaphore_signal(+{inc}) by device {self.device} at {site}",
                     "add the matching semaphore_wait, or signal less")
        self.run.devices[device].sem(sem.info, flat).add(tok)
        self._tick()

    def read_semaphore(self, sem: SemaphoreRef) -> int:
        self._yield()
        key, flat = sem.element("semaphore_read")
        return self.sem(sem.info, flat).value

    def barrier_semaphore(self) -> SemaphoreRef:
        return SemaphoreRef(self.run.barrier_info)

    # -- borrows: one access recorded at the start and again at the end of the block
    def borrow(self, ref: Ref, write: bool):
        site = capture_site()
        self._yield()
        kind = "write" if write else "read"
        self.record(self, ref, write, self.device, self.clock,
                    f"{kind} (borrow start) of {ref.describe()} by device {self.device} at {site}")
        view = self.buffers[ref.info.key][ref.torch_index()]
        return view, (None if write else view.clone())

    def end_borrow(self, ref: Ref, write: bool, view, token) -> None:
        site = capture_site()
        self._yield()
        kind = "write" if write else "read"
        if token is not None and not same_outputs(((view,),), ((token,),)):
            # (a peer cannot have changed it without a race report, so it was the kernel)
            raise KernelUsageError(
                f"borrow of {ref.describe()} at {site} was written through, but it is a read "
                "borrow; use borrow(ref, write=True)")
        self.record(self, ref, write, self.device, self.clock,
                    f"{kind} (borrow end) of {ref.describe()} by device {self.device} at {site}")

    # -- scoped allocation (stack-like, so keys agree across devices)
    def alloc_scoped(self, specs, names) -> list:
        refs = []
        for spec, name in zip(specs, names):
            key = ("scoped", len(self.scoped))
            self.scoped.append(key)
            if isinstance(spec, SemaphoreSpec):
                if spec.kind is SemaphoreKind.BARRIER:
                    raise KernelUsageError("run_scoped: use get_barrier_semaphore() for the barrier")
                refs.append(SemaphoreRef(SemaphoreInfo(key, name, spec.kind, spec.shape)))
            else:
                info = BufferInfo(key, name, spec.shape, spec.dtype, "scoped", spec.local)
                t = torch.empty(spec.shape, dtype=spec.dtype)
                refs.append(self.add_buffer(info, poison_(t) if self.run.poison else t))
        return refs

    def free_scoped(self, refs, check: bool) -> None:
        site = capture_site()
        keys = [r.info.key for r in refs]
        if check:
            for c in self.run.copies:
                touches = ((c.issuer is self and c.copy.src.info.key in keys and c.stage == 0)
                           or (c.copy.target == self.device and c.copy.dst.info.key in keys))
                if touches:
                    raise KernelUsageError(
                        f"run_scoped at {site} exited on device {self.device} while "
                        f"{c.describe()} is still in flight and uses a scoped buffer; wait for "
                        "the copy inside the scope\n" + self.run.note())
        for key in keys:
            self.buffers.pop(key, None)
            self.infos.pop(key, None)
            self.histories.pop(key, None)
        del self.scoped[len(self.scoped) - len(keys):]

    # -- thread body
    def main(self, kernel, refs) -> None:
        set_context(self)
        self.baton.acquire()
        try:
            if self.run.cancelled:
                raise _Cancelled()
            for idx in itertools.product(*(range(g) for g in self.grid)):
                self.grid_index = idx
                kernel(*refs)
            self.status = "done"
        except _Cancelled:
            self.status = "cancelled"
        except BaseException as e:  # reported by the scheduler, naming this device
            self.status, self.error = "failed", e
        finally:
            set_context(None)
            self.run.sched.release()


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
                    cp.src.nbytes, c.clock, f"send side of {c.describe()}",
                    "call .wait_send() (or .wait()) on the sending device"))
                c.stage = 1
                return
        if cp.dst.info.key not in dst_dev.buffers:
            raise KernelUsageError(
                f"{c.describe()} landed on device {dst_dev.device}, where scoped buffer "
                f"'{cp.dst.info.name}' is not allocated (the receiver is outside the run_scoped "
                "that allocates it); synchronise before copying into scoped buffers\n" + self.note())
        dst_dev.record(dst_dev, cp.dst, True, c.actor, c.clock,
                       f"write of device {dst_dev.device}'s {cp.dst.describe()} by {c.describe()}")
        dst_dev.buffers[cp.dst.info.key][cp.dst.torch_index()].copy_(c.data)
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

    def _deadlock(self) -> DeadlockError:
        lines = []
        for d in self.devices:
            if d.status == "done":
                lines.append(f"  device {d.device}: finished the kernel")
            else:
                s, value, what, site = d.waiting
                lines.append(f"  device {d.device}: blocked in {what()} at {site}: needs {value}, "
                             f"semaphore {s.name} is {s.value}")
        return DeadlockError(
            "deadlock: every live device is blocked and no copy is in flight, so nothing can "
            "ever wake them:\n" + "\n".join(lines) + "\n"
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
    seeds = [seed] if explore is None else list(range(seed, seed + int(explore)))
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
