"""Watched waits: a wait on a collective that watches the store for failed, exited or diverging peers.

A wait on a CPU (gloo) collective waits in slices; between slices it reads
the TCPStore for reports of other ranks and raises `RankFailedError` when one
failed or exited, `CollectiveMismatchError` when a stalled rank waits in a
different collective, and `CollectiveTimeoutError` after the timeout, naming
the ranks that never arrived and what each waiting rank waits for.
`WatchedWaits` is the part of the guard (`guard.Watch`) that does this.
"""
from __future__ import annotations

import os
import re
import threading
import time
import traceback

import torch

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError
from .config import _OPTIONS, _POLL
from .signatures import describe

#: how a finished rank's report names the collective it finished after (watchdog.report_exit)
_AFTER = re.compile(r"after collective #(\d+)")

#: guards the creation of this process's guard (`watchdog.watch`) and of the waiter thread
_WATCH_LOCK = threading.Lock()


class Stall:
    """What a wait does once it has lasted a poll interval, and then every interval: publish where this
    rank waits, poll the store for failed and exited peers and for the timeout, and (checks on) compare
    the group's published wait records once a second.  `tick()` is called between a wait's slices
    (`WatchedWaits.wait`: each slice is an interval, `every=0`) or between the sleeps of the
    shared-memory transport's kernels (`shm_run._run_shm`), which wake on every signal: there a tick
    within `every` seconds of the last (or of `begun`, when the wait started) returns at once, so a
    wait that completes within the interval never touches the store."""

    __slots__ = ("w", "what", "ranks", "signature", "begun", "every", "due", "published", "next_compare")

    def __init__(self, w, what, ranks, signature=False, begun=None, every=None):
        self.w, self.what, self.ranks, self.signature = w, what, ranks, signature
        self.begun = time.monotonic() if begun is None else begun
        self.every = _OPTIONS["poll"] if every is None else every
        self.due = self.begun + self.every
        self.published = False

    def tick(self):
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + self.every
        w = self.w
        what = w._what(self.what, self.signature)
        if not self.published:
            w._publish_wait(what)
            self.published = True
            self.next_compare = now + _OPTIONS["poll"]
        w._poll(what, self.ranks, self.begun, now)
        if now >= self.next_compare and _OPTIONS["check_collectives"] and w.current is not None:
            self.next_compare = now + 1.0
            w._compare_records(self.ranks)

    def close(self):
        if self.published:
            self.w._unpublish_wait()


class WatchedWaits:
    """The watched waits of the guard `guard.Watch` (and the messages that name the ranks involved)."""

    def wait(self, work, what, ranks, *, gloo: bool, signature=False, blocking=False):
        """Wait for `work`, watching for failed peers and the timeout.

        `what` describes the wait for messages (None: the current collective);
        `ranks` are the global ranks it needs (None: all).  `blocking`: the
        work's `wait` ignores its timeout (gloo's reduce_scatter does), so a
        helper thread waits for it while this one watches.
        """
        if not gloo:
            work.wait()
            return
        if blocking:
            done, err = _waiter().submit(work)
        stall = None  # (made when the first slice runs out: most waits complete within it)
        while True:
            try:
                if not blocking:
                    work.wait(_POLL[0])
                    break
                if done.wait(_OPTIONS["poll"]):
                    if err:
                        raise err[0]
                    break
            except RuntimeError as e:
                if blocking and not err:
                    raise
                if blocking or work.is_completed():
                    if not blocking:
                        e = _outcome(work, e)
                        if e is None:
                            break  # the slice ran out just as the work completed: a success
                    if not _transport_error(e):  # a local error (dtype, shape, ...): as it is
                        raise e
                    raise self._broken(e, self._what(what, signature), ranks) from e  # e.g. a peer died
            if stall is None:  # still running after a slice (outside the except: errors below chain to nothing)
                stall = Stall(self, what, ranks, signature, begun=time.monotonic() - _OPTIONS["poll"], every=0)
            stall.tick()
        if stall is not None:
            stall.close()

    def _what(self, what, signature=False):
        if what is not None:
            return what
        cur = self.describe_current()
        return f"the signature exchange of {cur}" if signature else cur

    def _publish_wait(self, what):
        """Tell the other ranks where this one waits (the record stall-time checks and messages read)."""
        n, desc = (self.current[0], describe(*self.current[1:])) if self.current else (0, "")
        try:
            self.store.set(f"shmap/wait/{self.rank}", f"{n}\t{self.epoch}\t{desc}\t{what} at {_user_location()}")
        except Exception:  # noqa: BLE001 - diagnostics only
            pass

    def _record(self, r):
        """Rank r's wait record: (counter, epoch, description, where) or None."""
        key = f"shmap/wait/{r}"
        try:
            if not self.store.check([key]):
                return None
            n, epoch, desc, where = self.store.get(key).decode(errors="replace").split("\t", 3)
            return int(n), int(epoch), desc, where
        except Exception:  # noqa: BLE001
            return None

    def _compare_records(self, ranks):
        """A stalled wait: a rank of the group that waits in a different collective at the same count
        is a mismatch (e.g. ranks that disagree on a shape, whose data exchange can never complete)."""
        n = self.current[0]
        mine = (n, self.epoch, describe(*self.current[1:]))
        members = [r for r in (range(self.world) if ranks is None else ranks) if r != self.rank]
        if len(members) > 32:  # a large group: a rotating window per round, to spare the store
            self._window = (getattr(self, "_window", 0) + 32) % len(members)
            members = (members[self._window:] + members[:self._window])[:32]
        for r in members:
            rec = self._record(r)
            if rec is not None and rec[0] == n and rec[:3] != mine:
                self.poisoned = True
                self._mismatch_found(ranks, "a stalled wait")

    def _mismatch_found(self, ranks, how, dead=(), note=""):
        """Raise `CollectiveMismatchError` listing what each rank of the group called (from the store;
        for `dead` ranks, and live ones that stay silent, from their black boxes)."""
        n = self.current[0]
        desc = describe(*self.current[1:])
        self._publish_wait(self.describe_current())
        members = [r for r in (range(self.world) if ranks is None else ranks)]
        recs = {self.rank: self._record(self.rank) or (n, self.epoch, desc, "")}
        deadline = time.monotonic() + 2.0
        while True:  # the others publish theirs when they detect it too, or when their wait stalls
            late = time.monotonic() > deadline
            for r in members:
                if r not in recs:
                    rec = self._box_record(r) if r in dead or late else self._record(r)
                    if rec is not None and rec[0] >= n:
                        recs[r] = rec
            if len(recs) == len(members) or late:
                break
            time.sleep(0.05)
        epochs = {rec[1] for rec in recs.values()}
        groups: dict = {}
        for r, (cn, ep, cd, where) in recs.items():
            loc = where.rpartition(" at ")[2] if " at " in where else ""
            key = (cn, cd) if len(epochs) == 1 else (cn, f"{cd}, after {ep} shard_map bodies")
            groups.setdefault(key, []).append((r, loc))
        lines = []
        for (cn, cd), got in sorted(groups.items(), key=lambda kv: min(r for r, _ in kv[1])):
            locs = sorted({loc for _, loc in got if loc})
            where = f" at {', '.join(locs)}" if locs else ""
            lines.append(f"  {_ranks([r for r, _ in got])}: collective #{cn}: {cd}{where}")
        silent = sorted(set(members) - set(recs))
        if silent:
            lines.append(f"  {_ranks(silent)}: not waiting in collective #{n} (still computing, elsewhere, "
                         "or dead)")
        if len(groups) == 1 and not silent:
            lines.append("  (the same call everywhere here: the ranks disagree on how many collectives or "
                         "shard_map bodies came before it)")
        raise CollectiveMismatchError(
            f"distributed mesh: the ranks called different collectives (found by {how}; rank {self.rank} is "
            f"at collective #{n}, {desc}):\n" + "\n".join(lines) + "\n" + (note + "\n" if note else "") +
            "Every rank must run the same collectives in the same order (on the simulated mesh all devices "
            "run one program). Usually a Python branch on a rank-dependent value, or an exception caught on "
            "some ranks only, sends ranks down different paths. Fix: branch per device with tensor ops "
            "(`torch.where`), or make the condition invariant first (`shmap.pmax(flag, axes)`). "
            "Data may have been exchanged, so this process ends with a non-zero status; "
            "configure_distributed(check_collectives='strict') checks before any data moves."
        )

    def _unpublish_wait(self):
        try:
            self.store.delete_key(f"shmap/wait/{self.rank}")
        except Exception:  # noqa: BLE001
            pass

    def _read_events(self):
        """New failure/exit reports of other ranks (one store round trip when there are none)."""
        try:
            n = self.store.add("shmap/nevents", 0)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to learn
            return
        if n <= len(self.events) + (1 if self.reported else 0):
            return
        for r in range(self.world):
            if r == self.rank or r in self.events:
                continue
            key = f"shmap/event/{r}"
            try:
                if self.store.check([key]):
                    status, _, text = self.store.get(key).decode(errors="replace").partition("\n")
                    self.events[r] = (status, text, time.monotonic())
            except Exception:  # noqa: BLE001
                return

    def _poll(self, what, ranks, t0, now):
        self._read_events()
        failed = {r: v for r, v in self.events.items() if v[0].startswith("failed")}
        if failed:
            self.poisoned = True
            raise RankFailedError(self._failed_message(failed, what))
        exited = {
            r: v for r, v in self.events.items()
            if v[0] == "exited" and (ranks is None or r in ranks) and now - v[2] > _OPTIONS["exit_grace"]
        }
        if exited:
            self.poisoned = True
            lines = "\n".join(f"  rank {r}: {v[1]}" for r, v in sorted(exited.items()))
            raise RankFailedError(
                f"distributed mesh: rank {self.rank} waits in {what}, but {_ranks(list(exited))} of its group "
                f"finished the program without calling it:\n{lines}\n" + self._odd_one_out(exited, ranks)
                + "Fix: make every rank call the same collectives."
            )
        others = [r for r in (range(self.world) if ranks is None else ranks) if r != self.rank]
        gone = [r for r in others if r not in self.events and self.peer_gone(r)]
        if gone:  # ended without a report: killed, out of memory, a crash (same host: `Watch.peer_gone`)
            self._read_events()  # (a report written just after the first read: the next poll names it)
            gone = [r for r in gone if r not in self.events]
        if gone:
            self.poisoned = True
            raise self._died_in_mismatch(ranks, gone, others) or RankFailedError(self._gone_message(gone, what))
        if now - t0 > self.timeout:
            self.poisoned = True
            raise CollectiveTimeoutError(self._timeout_message(what, ranks, now - t0))

    def _died_in_mismatch(self, ranks, dead, others):
        """`_boxes_mismatch` for ranks that died without a word: gloo aborts a process on a mismatch (it
        does when a message is larger than the receiver expects)."""
        return self._boxes_mismatch(ranks, others, dead, "the black boxes of the ranks that died",
                                    f"{_ranks(dead)} died in it without a Python exception (gloo aborts a "
                                    "process that receives more data than it expects).")

    def _boxes_mismatch(self, ranks, others, dead, how, note):
        """`CollectiveMismatchError` when a rank of `others` last entered (its black box, same host) a
        different collective at this one's count, else None; `dead` ranks are described by their boxes."""
        if self.current is None:
            return None
        mine = (self.current[0], self.epoch, describe(*self.current[1:]))
        boxes = [self._box_record(r) for r in others]
        if not any(b is not None and b[0] == mine[0] and b[:3] != mine for b in boxes):
            return None
        try:
            self._mismatch_found(ranks, how, dead=set(dead), note=note)
        except CollectiveMismatchError as e:
            return e
        return None

    def _gone_message(self, gone, what):
        lines = []
        for r in gone:
            box = self._box_record(r)
            lines.append(f"  rank {r}: last entered collective #{box[0]} ({box[2]})" if box else
                         f"  rank {r}: entered no collective")
        return (
            f"distributed mesh: rank {self.rank} waits in {what}, but {_ranks(gone)} stopped answering: its "
            "process ended and it reported nothing, so it probably died without a Python exception (killed, "
            "out of memory, or a crash). Check the log of " + _ranks(gone) + ".\n" + "\n".join(lines)
        )

    def _odd_one_out(self, exited, ranks) -> str:
        """Who more likely ran the other program: when most of the group finished together, after
        the same collective, and this rank is past it, this rank ran collectives they never call (a
        shard_map run more times on it); naming them "returned early" blamed the ranks that were right."""
        counts = set()
        for _, text, _ in exited.values():
            m = _AFTER.search(text)
            counts.add(int(m.group(1)) if m else None)
        group = self.world if ranks is None else len(ranks)
        mine = self.current[0] if self.current else None
        if len(counts) == 1 and None not in counts and mine is not None and mine > min(counts) \
                and 2 * len(exited) > group:  # (a strict majority: with 2 ranks either may be the odd one)
            return (f"Rank {self.rank} is the odd one out: {len(exited)} of the {group} ranks of its group finished "
                    f"together after collective #{min(counts)}, and this rank went on to #{mine}, so it likely "
                    "calls collectives they never call (a shard_map or a collective run more times on it); "
                    "if not, they returned early. ")
        return ("The ranks ran different programs (a collective called on some ranks only, or a rank that "
                "returned early). ")

    def _failed_message(self, failed, what):
        root = sorted(r for r, v in failed.items() if v[0] == "failed")
        if not root:  # only ranks that gave up on a collective themselves: pass on what they found
            lines = "\n".join(f"  rank {r}: " + v[1].replace("\n", "\n    ") for r, v in sorted(failed.items()))
            return (
                f"distributed mesh: rank {self.rank} stopped waiting in {what} because "
                f"{_ranks(list(failed))} gave up first:\n{lines}"
            )
        lines = "\n".join(f"  rank {r}: {failed[r][1].splitlines()[0]}" for r in root)
        return (
            f"distributed mesh: {_ranks(root)} failed, so rank {self.rank} stopped waiting in {what}:\n{lines}\n"
            f"Fix the error on {_ranks(root)} (its traceback is in that rank's output)."
        )

    def _timeout_message(self, what, ranks, elapsed):
        members = list(range(self.world)) if ranks is None else list(ranks)
        lines = []
        for r in members:
            if r == self.rank:
                lines.append(f"  rank {r} (this one): waits in {what}")
                continue
            rec = self._record(r)
            rec = rec[3] if rec else None
            lines.append(
                f"  rank {r}: waits in {rec}" if rec else
                f"  rank {r}: not waiting in any collective (still computing, hung, or dead)"
            )
        return (
            f"distributed mesh: {what} did not complete within {elapsed:.1f} s "
            f"(timeout {self.timeout:g} s) on rank {self.rank}. Ranks of its group:\n" + "\n".join(lines) + "\n"
            "Fix: find why the ranks that are not waiting never arrive; raise the timeout with "
            "shmap.configure_distributed(timeout=...) if the wait is legitimate."
        )

    def _broken(self, err, what, ranks):
        """The collective failed outright: name the rank behind it (one that reported, or one that
        went silent)."""
        self._publish_wait(what)  # the other survivors see this rank is alive, and where
        deadline = time.monotonic() + 2 * _OPTIONS["poll"] + 1.0
        while True:  # a dying rank reports just before its connections close: give it a moment
            self._read_events()
            relevant = {r: v for r, v in self.events.items() if ranks is None or r in ranks or v[0] == "failed"}
            if relevant or time.monotonic() > deadline:
                break
            time.sleep(_OPTIONS["poll"] / 2)
        self.poisoned = True
        failed = {r: v for r, v in relevant.items() if v[0].startswith("failed")}
        if failed:
            return RankFailedError(self._failed_message(failed, what))
        if relevant:
            lines = "\n".join(f"  rank {r}: {v[1]}" for r, v in sorted(relevant.items()))
            return RankFailedError(
                f"distributed mesh: {what} failed on rank {self.rank} because {_ranks(list(relevant))} left:\n"
                f"{lines}\nThe ranks ran different programs (a collective called on some ranks only)."
            )
        if "timed out" in str(err).lower():  # the process group's own timeout fired first
            return CollectiveTimeoutError(
                f"{self._timeout_message(what, ranks, self.pg_timeout)}\n(torch.distributed: {err})"
            )
        members = list(range(self.world)) if ranks is None else list(ranks)
        silent = [r for r in members if r != self.rank and self._record(r) is None]
        if silent:
            found = self._died_in_mismatch(ranks, silent, [r for r in members if r != self.rank])
            if found is not None:
                return found
        if silent:
            return RankFailedError(
                f"distributed mesh: {what} failed on rank {self.rank} because {_ranks(silent)} stopped "
                f"answering: its connection closed and it reported nothing, so it probably died without a "
                f"Python exception (killed, out of memory, or a crash). Check the log of {_ranks(silent)}.\n"
                f"(torch.distributed: {str(err).splitlines()[0][:300]})"
            )
        return RankFailedError(
            f"distributed mesh: {what} failed on rank {self.rank}: {err}\n"
            "No rank reported an error first; a peer process probably died without a Python exception "
            "(killed, out of memory, or a crash). Check the other ranks' logs."
        )

    def transport_failed(self, err, ranks, elapsed):
        """A registered transport's collective raised (the shared-memory kernels' own checks: a semaphore
        left counting when a peer sent more than this rank expected, a peer's kernel error, its own
        timeout): a rank that entered another collective at the same count (its black box, same host) is
        the cause, named as a mismatch; a timeout names where each rank waits, as the guard's own does;
        otherwise the transport's error stands.  `elapsed`: seconds since the collective started."""
        if isinstance(err, TimeoutError):
            what = self._what(None)
            self.poisoned = True
            return CollectiveTimeoutError(f"{self._timeout_message(what, ranks, elapsed)}\n(the transport: "
                                          f"{type(err).__name__}: {str(err).splitlines()[0][:300]})")
        if not _OPTIONS["check_collectives"]:
            return err
        others = [r for r in (range(self.world) if ranks is None else ranks) if r != self.rank]
        return self._boxes_mismatch(ranks, others, others, "the shared-memory transport's kernel failing",
                                    f"(the transport: {type(err).__name__}: {str(err).splitlines()[0][:300]})") or err


class _Waiter:
    """A daemon thread that waits for works whose `wait` ignores its timeout (one at a time, in order)."""

    def __init__(self):
        import queue

        self.q = queue.SimpleQueue()
        threading.Thread(target=self._run, name="shmap-waiter", daemon=True).start()

    def _run(self):
        while True:
            work, done, err = self.q.get()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the watching thread
                err.append(e)
            done.set()

    def submit(self, work):
        done, err = threading.Event(), []
        self.q.put((work, done, err))
        return done, err


_WAITER: list = []


def _waiter() -> _Waiter:
    if not _WAITER:
        with _WATCH_LOCK:
            if not _WAITER:
                _WAITER.append(_Waiter())
    return _WAITER[0]


def _outcome(work, e):
    """The error a completed `work`, whose sliced wait raised `e`, completed with (None: it succeeded).

    `Work.wait(timeout)` decides under its lock that the slice ran out and
    raises "Operation timed out!"; the work can complete in the microseconds
    before the caller asks `is_completed()`.  Read that way, a collective that
    succeeded was reported as timed out (a loaded 4-process run did, about once
    in 40 runs).  A completed work's own wait returns at once, or raises the
    error it completed with, which names the cause better than the slice's.
    (A wait with the slice's timeout: should the work be in some other state,
    this reports the slice's error, as before, rather than wait unwatched.)
    """
    try:
        work.wait(_POLL[0])
    except RuntimeError as real:
        return real
    return None


def _transport_error(e) -> bool:
    """Whether a failed collective failed because of the network or a peer (not its arguments)."""
    m = str(e).lower()
    return any(k in m for k in ("connection", "transport", "pair.cc", "timed out", "timeout", "peer", "socket"))


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _internal(filename: str) -> bool:
    """shmap's, torch's, or generated code (`<eval_with_key>`, a compiled graph): not the user's line."""
    if filename.startswith("<") and not filename.startswith("<stdin") and not filename.startswith("<ipython"):
        return True
    f = os.path.abspath(filename)
    return f.startswith(_PKG) or f.startswith(_TORCH)


def _user_location() -> str:
    """file:line of the innermost user frame calling into shmap (for messages)."""
    for fr in reversed(traceback.extract_stack()):
        if not _internal(fr.filename):
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    return ""
