"""Ctrl-C under torchrun: every rank stops after the same step, so the save is one collective.

torchrun passes Ctrl-C (SIGINT) on to every worker, and each is somewhere
else when it lands: one in a step's collective, another in a save's barrier.
Raising there would leave the others waiting in a collective that never
completes (torchrun kills them 30 s later, with nothing saved).  So under
torchrun SIGINT only sets a flag; after each step the ranks add their flags
in a small all_reduce on a group of their own, launched at the end of one
step and read at the end of the next (the step never waits for it), and all
stop together once any rank asked.  A second Ctrl-C stops at once.
"""
from __future__ import annotations

import signal
from datetime import timedelta

import torch
import torch.distributed as dist

#: how long a rank waits for the others' flags (a dead peer is the guard's to report; this only bounds it)
TIMEOUT = timedelta(seconds=120)


class AgreedStop:
    """SIGINT sets a flag; `after_step()` is True on every rank at the same step once any rank's was set."""

    def __init__(self):
        # (collective: built where every rank is in step, right after the mesh; `start` installs the handler)
        self.group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        self.requested = False
        self.pending = None
        self.closed = True
        self.previous = None

    def start(self):
        self.closed = False
        self.previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: KeyboardInterrupt at once

    def after_step(self) -> bool:
        stop = self._read()
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        self.pending = (dist.all_reduce(flag, group=self.group, async_op=True), flag)
        return stop

    def _read(self) -> bool:
        if self.pending is None:
            return False
        work, flag = self.pending
        self.pending = None
        work.wait(TIMEOUT)
        return bool(flag.item())

    def close(self, exchange=True) -> bool:
        """Restore the handler; with `exchange` (every rank got here), finish the last exchange and agree once
        more: whether any rank asked to stop, the same answer on every rank."""
        if self.closed:
            return False
        self.closed = True
        try:
            if not exchange:
                return self.requested
            stop = self._read()
            flag = torch.tensor([int(self.requested)], dtype=torch.int32)
            dist.all_reduce(flag, group=self.group, async_op=True).wait(TIMEOUT)
            return stop or bool(flag.item())
        finally:
            signal.signal(signal.SIGINT, self.previous)
