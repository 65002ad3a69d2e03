"""Recording the collectives a program performs.

`with shmap.comm_log() as log:` records every communicating collective that
runs inside the block, forward or backward (a backward collective is recorded
when autograd executes it), with its kind, axes and per-device payload.  Tests
use it to assert the communication autodiff produces; users use it to see what
their program costs.  `pvary` and the own-block slice are not recorded: they
communicate nothing.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass

#: Kinds that move data between devices (what `count()` counts): each collective of
#: `collectives.COLLECTIVES` that reports its own events, and "kernel" (`kernels.bridge.call`).
COMMUNICATING: set = {"kernel"}


#: collectives that report the one they perform
_ALIASES = {"pmean": "psum", "pshuffle": "ppermute"}


def register_communicating(kind: str):
    """Count events of `kind` as communication (collectives.py registers its collectives)."""
    COMMUNICATING.add(kind)


@dataclass(frozen=True)
class CommEvent:
    """One collective: `kind`, mesh `axes`, per-device payload `bytes`, input block `shape` and `dtype`
    (its name, e.g. "torch.float32")."""

    kind: str
    axes: tuple
    bytes: int
    shape: tuple = ()
    dtype: str = ""


class CommLog:
    """The collectives recorded inside a `comm_log()` block."""

    def __init__(self):
        self.events: list[CommEvent] = []

    def count(self, kind: str | None = None) -> int:
        """Number of communicating collectives (of `kind`, if given: one of `COMMUNICATING`; any other
        name raises, so that a misspelt kind fails an `assert log.count(...) == 0` instead of passing it)."""
        if kind is not None:
            if kind not in COMMUNICATING and not any(e.kind == kind for e in self.events):
                also = (f" {kind} is recorded as the {_ALIASES[kind]} it performs: count({_ALIASES[kind]!r})."
                        if kind in _ALIASES else "")
                raise ValueError(
                    f"CommLog.count: kind {kind!r} is not a collective comm_log records; it records "
                    f"{', '.join(repr(k) for k in sorted(COMMUNICATING))}.{also} Fix: pass one of those, or no "
                    "kind to count every communicating collective."
                )
            return sum(1 for e in self.events if e.kind == kind)
        return sum(1 for e in self.events if e.kind in COMMUNICATING)

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events if e.kind in COMMUNICATING)

    def summary(self) -> dict:
        return dict(Counter(e.kind for e in self.events if e.kind in COMMUNICATING))

    def __len__(self):
        return len(self.events)

    def __repr__(self):
        return f"CommLog({self.summary()}, bytes={self.total_bytes})"


# Process-wide, not thread-local: autograd runs CUDA backward passes on its own
# device threads, and those collectives must land in the user's log too.
_LOGS: list[CommLog] = []
_LOCK = threading.Lock()


def _active() -> list:
    return _LOGS


@contextlib.contextmanager
def comm_log():
    """Record collectives performed inside the block; yields a `CommLog`.

    The log is process-wide: it also records collectives other threads run while the block is open
    (autograd runs a GPU backward pass on threads of its own, whose collectives belong in it).  To
    count one function's collectives, run nothing else meanwhile."""
    log = CommLog()
    logs = _active()
    logs.append(log)
    try:
        yield log
    finally:
        logs.remove(log)


def record(event: CommEvent) -> None:
    """Append `event` to every active log (nested logs all see it)."""
    if _LOGS:
        with _LOCK:
            for log in _LOGS:
                log.events.append(event)
