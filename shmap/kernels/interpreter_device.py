"""One device of the verifying interpreter (interpreter.py): its kernel API calls.

`_Device` is the `DeviceContext` a kernel sees on one device thread: reads and writes (checked
for races with vector clocks, races.py), copies (`_Copy`: an actor of its own, read then land),
semaphores (`_Sem`: counts made of `_Token`s that carry their signaller's clock, for
happens-before) and scoped allocations.  Each call is a scheduling point: it yields the baton to
the run (`interpreter._Run`), which picks who runs next.
"""
from __future__ import annotations

import collections
import itertools
import threading

import torch

from . import races
from .api import DeviceContext, RemoteCopy
from .common import fit_value, poison_, same_outputs
from .errors import DataRaceError, KernelUsageError, capture_site
from .refs import (
    BufferInfo,
    Ref,
    SemaphoreInfo,
    SemaphoreKind,
    SemaphoreRef,
    SemaphoreSpec,
    element_name,
    format_box,
    set_context,
)


#: consecutive semaphore_reads, over all devices, with no other event between them: a poll that cannot end
#: (a device alone keeps the baton for about 20 steps at most in the stickiest schedule: 0.95 ** 20000 is 0)
POLL_LIMIT = 20000


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
        """Consume `value` from the oldest tokens, joining the clocks of what the wait is ordered after.

        A DMA semaphore counts bytes, and a copy's bytes land in no promised order: a wait for part of a
        copy's bytes does not order the waiter after any one of them, so only the wait that consumes a
        token's last byte joins its clock (joined at once, a wait for 16 of 32 bytes let the waiter read
        the other 16 unreported).  A signal's increment is made at once: any part of it orders."""
        self.value -= value
        dma = self.info.kind is SemaphoreKind.DMA
        while value:
            tok = self.tokens[0]
            used = min(tok.amount, value)
            if not dma or used == tok.amount:
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
        self.polling = None  # (semaphore, site) of a semaphore_read with no other call since
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    # -- scheduling
    def _yield(self, waiting=None, poll=False) -> None:
        if not poll:  # progress: any call but a semaphore_read (see `read_semaphore`)
            self.run.polls = 0
            self.polling = None
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
        """A scheduling point that changes nothing: a loop of them with no other event in between (no
        device calls anything else, no copy moves) can never see a new value, so it is reported as the
        deadlock it is, once it has gone on for far longer than any schedule runs a device alone."""
        run = self.run
        run.polls += 1
        self.polling = (sem, capture_site() if run.polls > POLL_LIMIT - 1000 else None)  # (the site: for the error)
        if run.polls > POLL_LIMIT:
            raise run.livelock()
        self._yield(poll=True)
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
