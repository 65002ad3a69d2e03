"""Happens-before race detection with vector clocks.

Each *actor* (a device, or one in-flight copy: a DMA engine works concurrently
with the device that started it) has a vector clock, a dict actor -> epoch.
Synchronisation moves clocks:

- a signal, and a copy's completion, attach the sender's clock to the
  semaphore increment they make ("token");
- a wait that consumes tokens joins their clocks into the waiter's clock;
- starting a copy gives the copy the starter's clock (it sees everything the
  starter did before `start()`, and nothing after).

An access is recorded as (actor, actor's epoch, read/write, box).  A later
access by actor B with clock V is ordered after a recorded access by A at
epoch e iff e <= V[A].  Two overlapping accesses, at least one a write, with
neither ordered after the other, are a data race -- whatever order the
schedule happened to run them in.  That is why a single run catches races
that real hardware would only hit under rare timing; schedule exploration
covers what remains (which of several pending tokens a wait consumes).

Boxes are tuples of ranges in the buffer's base coordinates (see refs.py), so
overlap and containment are computed per dimension without touching data.
"""
from __future__ import annotations

from dataclasses import dataclass

Clock = dict


def join(into: dict, other: dict) -> None:
    """into := max(into, other), component-wise."""
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _range_overlap(a: range, b: range):
    if not a or not b:
        return None
    if a.step == 1 and b.step == 1:
        lo, hi = max(a.start, b.start), min(a.stop, b.stop)
        return range(lo, hi) if lo < hi else None
    small, big = (a, b) if len(a) <= len(b) else (b, a)
    hits = [x for x in small if x in big]
    return range(hits[0], hits[-1] + 1) if hits else None


def box_overlap(a: tuple, b: tuple):
    """Bounding box of the elements two boxes share, or None if disjoint."""
    out = []
    for ra, rb in zip(a, b):
        r = _range_overlap(ra, rb)
        if r is None:
            return None
        out.append(r)
    return tuple(out)


def _range_covers(big: range, small: range) -> bool:
    if not small:
        return True
    if big.step == 1 and small.step == 1:
        return big.start <= small.start and small.stop <= big.stop
    return all(x in big for x in small)


def box_covers(big: tuple, small: tuple) -> bool:
    return all(_range_covers(b, s) for b, s in zip(big, small))


@dataclass
class Access:
    """One recorded access; `who` is a ready-to-print description with the source line."""

    actor: int
    epoch: int
    write: bool
    box: tuple
    who: str


class History:
    """Accesses to one buffer of one device that a future access could race with."""

    __slots__ = ("records",)

    def __init__(self):
        self.records: list[Access] = []

    def check(self, new: Access, clock: dict):
        """Return (earlier access, overlap box) of the first race with `new`, or None.

        Then record `new`, and forget accesses it makes redundant: anything a
        write covers and is ordered after (a later access racing with the old
        one would race with this write too), and same-actor, same-epoch
        accesses of the same kind that it covers.
        """
        for old in self.records:
            if not (old.write or new.write) or old.actor == new.actor:
                continue
            if old.epoch <= clock.get(old.actor, 0):
                continue  # old happens-before new
            overlap = box_overlap(old.box, new.box)
            if overlap is not None:
                return old, overlap
        keep = []
        for old in self.records:
            ordered = old.actor == new.actor or old.epoch <= clock.get(old.actor, 0)
            if new.write and ordered and box_covers(new.box, old.box):
                continue
            if (old.actor == new.actor and old.epoch == new.epoch and old.write == new.write
                    and box_covers(new.box, old.box)):
                continue
            keep.append(old)
        keep.append(new)
        self.records = keep
        return None
