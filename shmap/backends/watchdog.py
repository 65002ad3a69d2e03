"""Keeping a distributed mesh from hanging: collective signatures, watched waits, failure reports.

On the simulated mesh a wrong program is an exception at the line that is
wrong.  On one process per device the same mistakes become hangs: a rank that
raised leaves its peers blocked in their next collective, and ranks that call
different collectives deadlock or, worse, combine unrelated data.  This module
turns each into an error on every rank that names the ranks involved:

- **Signatures** (on by default, free): each collective's payload carries
  a signature of it (hash of kind / axes / shape / dtype / parameters, call
  counter, shard_map bodies finished) — a 32-element trailer that any
  reduction keeps readable (`Seal`), or 8 bytes per block of moved data —
  checked when the data arrives; a wait that stalls compares the ranks'
  published records through the store (ranks that disagree on a size can
  never complete the exchange).  A difference raises
  `CollectiveMismatchError` on every rank.  `check_collectives='strict'`
  instead all-gathers a 2-integer signature over a dedicated gloo group
  *before* each collective (no data moves on a mismatch; the groups stay
  usable); `False` drops signatures.
- **Watched waits**: a wait on a CPU (gloo) collective waits in slices; between
  slices it reads the TCPStore for reports of other ranks and raises
  `RankFailedError` when one failed or exited, and `CollectiveTimeoutError`
  after the timeout (the process group's by default), naming the ranks that
  never arrived and what each waiting rank waits for.
- **Failure reports**: a rank whose exception escapes (`sys.excepthook`), or
  whose `shmap.spawn` worker raises, writes it to the store first; a normal
  exit is written too, so a rank that returned early is named, not waited for
  (and, hearing at exit that the others failed because of it, it exits 1).
  Ranks that failed because of another wait for it to be gone before they
  leave, so a launcher names the right root cause.
- **Black boxes**: each rank writes the collective it enters into a small
  shared-memory map its same-host peers mapped at `make_mesh`; a rank that
  dies without a word (SIGKILL, a gloo abort) still tells them where it was.

The guard (`watch()`) is created by `make_mesh`, on every rank together.

A rank that gave up on a collective still has it pending inside the process
group, whose destructor would wait for it; such a process ends with
`os._exit` after its traceback is printed, so no process is left running.
"""
from __future__ import annotations

import atexit
import os
import re
import struct
import sys
import threading
import time
import traceback
import zlib
from datetime import timedelta

import torch

from ..errors import ShmapError, fmt_axes


class DistributedError(ShmapError, RuntimeError):
    """A distributed mesh could not complete a collective (base class)."""


class RankFailedError(DistributedError):
    """Another rank raised (or exited) while this one waited for it."""


class CollectiveMismatchError(DistributedError):
    """Ranks called different collectives at the same point of the program."""


class CollectiveTimeoutError(DistributedError):
    """A collective did not complete within the timeout."""


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


def _env_float(name: str):
    v = os.environ.get(name)
    return float(v) if v else None


def _env_check() -> bool | str:
    v = os.environ.get("SHMAP_CHECK_COLLECTIVES", "")
    if v.strip().lower() == "strict":
        return "strict"
    return _env_flag("SHMAP_CHECK_COLLECTIVES", True)


_OPTIONS = {
    "check_collectives": _env_check(),
    "timeout": _env_float("SHMAP_COLLECTIVE_TIMEOUT"),
    "transport": os.environ.get("SHMAP_TRANSPORT", "torch"),
    "poll": 0.25,
    "exit_grace": 2.0,
}


def configure_distributed(*, check_collectives: bool | None = None, timeout: float | None = None,
                          transport: str | None = None) -> dict:
    """Set how distributed collectives are guarded; returns the previous settings.

    - `check_collectives`: how ranks running different programs are caught
      (env `SHMAP_CHECK_COLLECTIVES`: `1`, `0` or `strict`):
      `True` (the default): each collective carries a signature of itself
      (call counter, shard_map count, kind, axes, shape, dtype, parameters)
      inside its own payload, a few extra bytes checked when it completes,
      and a wait that stalls compares the ranks' signatures through the
      store; a difference raises `CollectiveMismatchError` on every rank.
      Costs almost nothing; data may have moved when it is detected, so the
      process ends (non-zero) afterwards.
      `'strict'`: a separate signature exchange *before* each collective and
      at the end of each body (one small all-gather each): no data moves on a
      mismatch and the process groups stay usable.
      `False`: no signatures (a rank that finished early is still named; a
      stalled wait still reports who is missing).
    - `timeout`: seconds a collective may wait before `CollectiveTimeoutError`
      (default: the timeout given to `init_process_group`; env
      `SHMAP_COLLECTIVE_TIMEOUT`).
    - `transport`: `'torch'` (torch.distributed: gloo / NCCL; the default) or
      `'shm'`: CPU tensors move through `shmap.kernels.ShmTransport`, shared
      memory between the processes of one host (env `SHMAP_TRANSPORT`).
      pmax/pmin keep using torch.distributed.
    Must be set identically on every rank.
    """
    prev = {k: _OPTIONS[k] for k in ("check_collectives", "timeout", "transport")}
    if transport is not None:
        if transport not in ("torch", "shm"):
            raise ValueError(f"configure_distributed: transport must be 'torch' or 'shm', got {transport!r}.")
        _OPTIONS["transport"] = transport
    if check_collectives is not None:
        if check_collectives != "strict" and not isinstance(check_collectives, (bool, int)):
            raise ValueError("configure_distributed: check_collectives must be True, False or 'strict', "
                             f"got {check_collectives!r}.")
        _OPTIONS["check_collectives"] = check_collectives if check_collectives == "strict" else bool(
            check_collectives)
    if timeout is not None:
        if timeout <= 0:
            raise ValueError(f"configure_distributed: timeout must be > 0 seconds, got {timeout}.")
        _OPTIONS["timeout"] = float(timeout)
    return prev


def _dist():
    import torch.distributed as dist

    return dist


# --------------------------------------------------------------------------
# Per-process state over one torch.distributed world
# --------------------------------------------------------------------------
class Watch:
    """The guard of one process in one torch.distributed world."""

    def __init__(self):
        dist = _dist()
        self.world_pg = dist.group.WORLD
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        try:
            self.pg_timeout = self.store.timeout.total_seconds()
        except Exception:  # noqa: BLE001 - older stores: torch's default
            self.pg_timeout = 1800.0
        self.control = None
        if self.world > 1:
            # A gloo group of its own: signatures never queue behind data (and
            # stay on the CPU when the data goes through NCCL).
            self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.pg_timeout))
        self.counter = 0
        self.epoch = 0  # shard_map bodies completed (part of every signature)
        self._crc: dict = {}  # (kind, axes, shape, dtype, extra) -> (crc32 of its description, description)
        self.box = None  # this rank's black box: its current collective, readable by peers on its host
        self._box_key, self._box_len = None, 0
        self.boxes: dict = {}  # rank -> peer's black box (same host)
        if self.world > 1:
            try:
                self._open_boxes()
            except Exception:  # noqa: BLE001 - diagnostics only (no /dev/shm, no mmap, ...)
                self.box = None
        self.lock = threading.Lock()
        self.current = None  # (counter, kind, axes, shape, dtype, extra) of the collective in progress
        self.last = None  # the same for the last collective that completed
        self.events: dict = {}  # rank -> (status, text, first seen)
        self.reported = False
        self.status = None  # what this rank reported: "exited", "failed", "failed-in-turn"
        self.poisoned = False

    def _open_boxes(self):
        """Black boxes: each rank writes the collective it enters into a small shared-memory map that
        its peers on the same host mapped at make_mesh; a rank that dies without a word (SIGKILL, or
        gloo aborting it on a size mismatch) still tells them where it was.  No file outlives this:
        each rank unlinks its own once every rank has mapped its peers'."""
        import mmap
        import socket
        import tempfile

        host = socket.gethostname()
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix=f"shmap-box-{self.rank}-", dir=where)
        try:
            os.ftruncate(fd, _BOX)
            self.box = mmap.mmap(fd, _BOX)
        finally:
            os.close(fd)
        try:
            self.store.set(f"shmap/box/{self.rank}", f"{host}\t{path}")
            for r in range(self.world):
                if r == self.rank:
                    continue
                h, _, p = self.store.get(f"shmap/box/{r}").decode().partition("\t")
                if h == host:
                    try:
                        with open(p, "rb") as f:
                            self.boxes[r] = mmap.mmap(f.fileno(), _BOX, access=mmap.ACCESS_READ)
                    except OSError:
                        pass
            self.store.add("shmap/boxes", 1)
            deadline = time.monotonic() + min(60.0, self.pg_timeout)
            while self.store.add("shmap/boxes", 0) < self.world and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            os.unlink(path)

    def _box_write(self, n, kind, axes, shape, dtype, extra):
        """Layout: counter, epoch, description length (3 x u32), description (rewritten when it changes)."""
        key = (kind, axes, shape, dtype, extra)
        if key != self._box_key:
            self._static(kind, axes, shape, dtype, extra)
            got = self._crc.get(key)
            b = (got[1] if got is not None else describe(*key)).encode()[:_BOX - 12]
            self.box[12:12 + len(b)] = b
            self._box_key, self._box_len = key, len(b)
        _BOX_HEAD.pack_into(self.box, 0, n & 0xFFFFFFFF, self.epoch & 0xFFFFFFFF, self._box_len)

    def _box_record(self, r):
        """What rank r (same host) last entered: (counter, epoch, description, '') or None."""
        m = self.boxes.get(r)
        if m is None:
            return None
        try:
            n, epoch, k = _BOX_HEAD.unpack_from(m, 0)
            if not 0 < k <= _BOX - 12:
                return None
            return n, epoch, m[12:12 + k].decode(errors="replace"), ""
        except Exception:  # noqa: BLE001
            return None

    # ------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        return _OPTIONS["timeout"] or self.pg_timeout

    def begin(self, kind: str, axes: tuple, shape, dtype, extra: str = "", exchange: bool = False):
        """Count a collective and, in strict mode (or with `exchange`, when checks are on at all), launch
        its signature exchange (on its own group).

        `verify` waits for it and raises if the ranks disagree; the backend
        verifies before it launches the data exchange.  (Overlapping the two
        would hide the check's latency, but gloo collectives that disagree can
        crash a process instead of raising, so the data waits.)  In the
        default mode the signature travels inside the collective's payload
        instead (`seal` / `unseal`).
        """
        with self.lock:
            self.counter += 1
            n = self.counter
        self.current = (n, kind, axes, shape, dtype, extra)
        if self.box is not None:
            self._box_write(n, kind, axes, shape, dtype, extra)
        mode = _OPTIONS["check_collectives"]
        if self.control is None or not mode or (mode is True and not exchange):
            return None
        desc = describe(kind, axes, shape, dtype, extra)
        sig = torch.tensor([n, zlib.crc32(desc.encode())], dtype=torch.int64)
        out = torch.empty(self.world * 2, dtype=torch.int64)
        with torch.no_grad():
            work = _gather_into(out, sig, self.control)
        return _Pending(n, desc, sig, out, work)

    def sealing(self) -> bool:
        """Whether collectives carry their signature in their payload (the default mode)."""
        return _OPTIONS["check_collectives"] is True and self.control is not None

    def _static(self, kind, axes, shape, dtype, extra) -> int:
        key = (kind, axes, shape, dtype, extra)
        got = self._crc.get(key)
        if got is None:
            desc = describe(kind, axes, shape, dtype, extra)
            got = (zlib.crc32(desc.encode()), desc)
            if len(self._crc) < 4096:
                self._crc[key] = got
        return got[0]

    def next_signature16(self, kind, axes, shape, dtype, extra="") -> int:
        """The 16-bit signature the next collective (`begin` not yet called) will carry."""
        return signature16(self._static(kind, axes, shape, dtype, extra), self.counter + 1, self.epoch)

    def next_signature_bytes(self, kind, axes, shape, dtype, extra="") -> bytes:
        """The 8-byte signature the next collective (`begin` not yet called) will carry as moved data."""
        c = self._static(kind, axes, shape, dtype, extra)
        return struct.pack("<IHH", c, (self.counter + 1) & 0xFFFF, self.epoch & 0xFFFF)

    def seal(self, seal: "Seal"):
        """Write the current collective's signature into `seal`'s trailer (before it is launched)."""
        n, kind, axes, shape, dtype, extra = self.current
        seal.write(self._static(kind, axes, shape, dtype, extra), n, self.epoch)

    def unseal(self, seal: "Seal", ranks):
        """Check the trailer the collective delivered; `CollectiveMismatchError` if a rank's differs."""
        if not seal.ok():
            self.poisoned = True
            self._mismatch_found(ranks, "its payload's signature")

    def body_done(self):
        """A shard_map body ended: in strict mode exchange a signature; otherwise count it (signatures
        include the count, so a rank that ended a body early disagrees at its next collective)."""
        if _OPTIONS["check_collectives"] == "strict":
            return False
        self.epoch += 1
        return True

    def verify(self, pending, moved=False):
        """Wait for a signature exchange and raise `CollectiveMismatchError` if the ranks disagree
        (`moved`: it ran alongside the data exchange, which has completed)."""
        if pending is None:
            return
        self.wait(pending.work, None, None, gloo=True, signature=True)
        if not pending.matches():
            if moved:  # some ranks may still be stuck in the data exchange: compare through the store
                self.poisoned = True
                self._mismatch_found(None, "the signature exchange alongside it")
            self._mismatch(pending.n, pending.desc)

    def overlapping(self) -> bool:
        """Whether a collective without a payload signature may run its signature exchange alongside
        the data (default mode) rather than before it (strict)."""
        return _OPTIONS["check_collectives"] is True

    def check(self, kind: str, axes: tuple, shape, dtype, extra: str = ""):
        """A synchronous signature check (a collective with no data of its own, e.g. a body's end)."""
        self.verify(self.begin(kind, axes, shape, dtype, extra))
        self.done()

    def done(self):
        if self.current is not None:
            self.last = self.current
            self.current = None

    def describe_current(self) -> str:
        if self.current is None:
            return "a collective"
        n, *rest = self.current
        return f"collective #{n} ({describe(*rest)})"

    def _mismatch(self, n, desc):
        dist = _dist()
        mine = (n, desc, _user_location())
        got = [None] * self.world
        dist.all_gather_object(got, mine, group=self.control)
        groups: dict = {}
        for r, (cn, cd, loc) in enumerate(got):
            groups.setdefault((cn, cd), []).append((r, loc))
        lines = []
        for (cn, cd), members in sorted(groups.items(), key=lambda kv: kv[1][0][0]):
            ranks = [r for r, _ in members]
            locs = sorted({loc for _, loc in members if loc})
            where = f" at {', '.join(locs)}" if locs else ""
            lines.append(f"  {_ranks(ranks)}: collective #{cn}: {cd}{where}")
        raise CollectiveMismatchError(
            f"distributed mesh: the ranks called different collectives (rank {self.rank} is at collective "
            f"#{n}, {desc}):\n" + "\n".join(lines) + "\n"
            "Every rank must run the same collectives in the same order (on the simulated mesh all devices "
            "run one program). Usually a Python branch on a rank-dependent value, or an exception caught on "
            "some ranks only, sends ranks down different paths. Fix: branch per device with tensor ops "
            "(`torch.where`), or make the condition invariant first (`shmap.pmax(flag, axes)`). "
            "No data was exchanged: the process groups are still usable."
        )

    # ------------------------------------------------------------------
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
        t0 = None
        published = False
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
                    if not _transport_error(e):  # a local error (dtype, shape, ...): as it is
                        raise
                    raise self._broken(e, self._what(what, signature), ranks) from e  # e.g. a peer died
            # Still running after a slice (outside the except: errors below chain to nothing).
            now = time.monotonic()
            if t0 is None:
                t0 = now - _OPTIONS["poll"]
            if not published:
                self._publish_wait(self._what(what, signature))
                published = True
                next_compare = now + _OPTIONS["poll"]
            self._poll(self._what(what, signature), ranks, t0, now)
            if now >= next_compare and _OPTIONS["check_collectives"] and self.current is not None:
                next_compare = now + 1.0
                self._compare_records(ranks)
        if published:
            self._unpublish_wait()

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
                f"finished the program without calling it:\n{lines}\n"
                "The ranks ran different programs (a collective called on some ranks only, or a rank that "
                "returned early). Fix: make every rank call the same collectives."
            )
        if now - t0 > self.timeout:
            self.poisoned = True
            raise CollectiveTimeoutError(self._timeout_message(what, ranks, now - t0))

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
        if silent and self.current is not None:
            # What the silent ranks last entered (their black boxes, same host): a different collective
            # at the same count means gloo aborted a process on the mismatch (it does when a message is
            # larger than the receiver expects).
            mine = (self.current[0], self.epoch, describe(*self.current[1:]))
            boxes = {r: self._box_record(r) for r in members if r != self.rank}
            if any(b is not None and b[0] == mine[0] and b[:3] != mine for b in boxes.values()):
                try:
                    self._mismatch_found(ranks, "the black boxes of the ranks that died", dead=set(silent),
                                         note=f"{_ranks(silent)} died in it without a Python exception (gloo "
                                              "aborts a process that receives more data than it expects).")
                except CollectiveMismatchError as e:
                    return e
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

    # ------------------------------------------------------------------
    def report(self, status: str, text: str):
        if self.reported:
            return
        self.reported = True
        self.status = status
        try:
            self.store.set(f"shmap/event/{self.rank}", f"{status}\n{text}")
            self.store.add("shmap/nevents", 1)
        except Exception:  # noqa: BLE001 - the store may already be gone at exit
            pass


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


class _Pending:
    """A signature exchange in flight."""

    __slots__ = ("n", "desc", "sig", "out", "work")

    def __init__(self, n, desc, sig, out, work):
        self.n, self.desc, self.sig, self.out, self.work = n, desc, sig, out, work

    def matches(self) -> bool:
        return bool((self.out.view(-1, 2) == self.sig).all())


#: bytes of a black box (watch._open_boxes), and its header
_BOX = 512
_BOX_HEAD = struct.Struct("<III")

#: bits of the signature a reducing collective carries (two trailer elements per bit)
SEAL_BITS = 16


class Seal:
    """Where a collective's payload carries its signature, and how to read it back.

    `reduce` (all_reduce, reduce_scatter; any reduction, any dtype): 2 x
    SEAL_BITS trailer elements, each bit b of a 16-bit hash as a pair (b, 1 - b).
    However many ranks add (or max, min, or) them, every pair keeps exactly one
    nonzero entry, on the side of the bit, iff every rank wrote the same bits.
    `bytes` (all_gather, all_to_all, ppermute: data moved, not combined): the
    payload travels as bytes with an 8-byte signature appended to each block;
    every block received must carry this rank's.  `send` is the trailer
    region of the input (rows broadcast), `recv` that of the output (None:
    nothing received); `expect` is set when the trailer is written (for a
    reduction, when its buffer is built: `reduce_trailer`).
    """

    __slots__ = ("mode", "send", "recv", "expect")

    def __init__(self, mode, send, recv, expect=None):
        self.mode, self.send, self.recv, self.expect = mode, send, recv, expect

    def write(self, c, n, epoch):
        if self.expect is not None:  # written with the buffer
            return
        if self.mode == "reduce":
            lo, hi, self.expect = reduce_trailer(signature16(c, n, epoch), self.send.dtype)
            self.send[..., :SEAL_BITS].copy_(lo)
            self.send[..., SEAL_BITS:].copy_(hi)
        else:
            self.expect = list(struct.pack("<IHH", c, n & 0xFFFF, epoch & 0xFFFF))
            self.send.copy_(torch.tensor(self.expect, dtype=torch.uint8))

    def ok(self) -> bool:
        if self.recv is None:
            return True
        got = self.recv.tolist()
        if self.mode == "reduce":
            return list(map(bool, got)) == self.expect
        rows = got if self.recv.dim() == 2 else [got]
        return all(row == self.expect for row in rows)


def signature16(c, n, epoch) -> int:
    """16 bits of (description crc, collective count, shard_map count)."""
    h = ((c * 0x9E3779B1) ^ (n * 0x85EBCA6B) ^ (epoch * 0xC2B2AE35)) & 0xFFFFFFFF
    return (h ^ (h >> 16)) & 0xFFFF


_TRAILERS: dict = {}  # dtype -> ([256 trailer halves], [256 expected nonzero patterns])


def reduce_trailer(h, dtype):
    """(low half, high half, expected nonzero pattern) of the trailer for 16-bit signature `h`: each
    half is byte b of h as 8 bits then their 8 complements, a cached tensor of `dtype`."""
    t = _TRAILERS.get(dtype)
    if t is None:
        rows, pats = [], []
        for v in range(256):
            bits = [(v >> i) & 1 for i in range(8)]
            rows.append(torch.tensor(bits + [1 - b for b in bits], dtype=dtype))
            pats.append([bool(b) for b in bits] + [not b for b in bits])
        t = _TRAILERS[dtype] = (rows, pats)
    lo, hi = h & 0xFF, h >> 8
    return t[0][lo], t[0][hi], t[1][lo] + t[1][hi]


def sealable(dtype, n) -> bool:
    """Whether a reducing collective over `n` ranks can carry a signature in `dtype` (an 8-bit integer
    sum of n ones wraps to 0 when n is a multiple of 256; float8 has no all_reduce on gloo)."""
    if dtype.itemsize == 1 and dtype not in (torch.int8, torch.uint8, torch.bool):
        return False
    return not (dtype.itemsize == 1 and n % 256 == 0)


#: the wait slice, as the timedelta work.wait() takes (rebuilt by configure_distributed)
_POLL = [timedelta(seconds=_OPTIONS["poll"])]

_WATCH: Watch | None = None
_WATCH_LOCK = threading.Lock()


def watch() -> Watch:
    """This process's guard for the current torch.distributed world (created on first use).

    The first call is collective (it creates a process group and maps the
    black boxes): `make_mesh` makes it, on every rank while they are in step.
    """
    global _WATCH
    dist = _dist()
    w = _WATCH
    if w is not None and w.world_pg is dist.group.WORLD:
        return w
    with _WATCH_LOCK:
        if _WATCH is None or _WATCH.world_pg is not dist.group.WORLD:
            _WATCH = Watch()
            _install_hooks()
        return _WATCH


def report_failure(exc: BaseException) -> None:
    """Tell the other ranks that this one is failing with `exc` (idempotent).

    Called for you when an exception escapes (sys.excepthook) and by
    `shmap.spawn`; call it yourself if you end a rank some other way.
    """
    w = _WATCH
    if w is None:
        return
    secondary = isinstance(exc, DistributedError)
    status = "failed-in-turn" if secondary else "failed"
    msg = str(exc).strip()
    loc = _exc_location(exc)
    if secondary:  # its whole message: it names the ranks it was waiting for
        text = f"{type(exc).__name__}: {msg[:3000]}"
    else:
        first = msg.splitlines()[0] if msg else ""
        text = f"{type(exc).__name__}: {first[:500]}" + (f" (at {loc})" if loc else "")
    w.report(status, text)


def _exc_location(exc) -> str:
    tb = exc.__traceback__
    frames = traceback.extract_tb(tb) if tb is not None else []
    for fr in reversed(frames):
        if not _internal(fr.filename):
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    return ""


# --------------------------------------------------------------------------
# Hooks: report an escaping exception; never hang in a destructor
# --------------------------------------------------------------------------
_HOOKED = False


def _install_hooks():
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    prev = sys.excepthook

    def hook(etype, value, tb):
        try:
            report_failure(value)
            _error_file(value, tb)
        except Exception:  # noqa: BLE001
            pass
        prev(etype, value, tb)
        if _WATCH is not None and _WATCH.poisoned:
            _after_roots(_WATCH)
            _hard_exit(1)

    sys.excepthook = hook
    atexit.register(_at_exit)


def _error_file(exc, tb):
    """Under torchrun (elastic), record the exception in the worker's error file, as `@record` would:
    the launcher's failure summary then shows it.  A rank that failed only because of others dates its
    record a second later, so that the launcher's "root cause" (the earliest) is the rank that failed."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    import json

    ts = int(time.time()) + (1 if isinstance(exc, DistributedError) else 0)
    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)),
                                      "timestamp": str(ts)}}}
    with open(path, "w") as f:
        json.dump(data, f)


def report_exit() -> None:
    """Tell the other ranks this one finished its program (so a peer still waiting for it is told)."""
    w = _WATCH
    if w is not None and not w.reported and _live(w):
        last = describe(*w.last[1:]) if w.last else "none"
        w.report("exited", f"finished its program after collective #{w.counter} (last: {last})")


def _live(w) -> bool:
    """The world `w` guards is still up (after destroy_process_group nobody waits, and the store may be gone)."""
    dist = _dist()
    return w.control is not None and dist.is_initialized() and w.world_pg is dist.group.WORLD


def exit_barrier() -> bool:
    """After `report_exit`: wait (briefly) until every rank has finished or failed.

    A rank that ended early (it skipped collectives the others called) hears
    here that the others failed waiting for it; it then says so and returns
    True (the caller ends with a non-zero status), so no rank of a broken run
    ends 0.  Ranks that finish together pass in milliseconds; the wait is
    bounded by the collective timeout (at most 60 s), after which a rank
    leaves peers that are legitimately still running.
    """
    w = _WATCH
    if w is None or not _live(w):
        return False
    deadline = time.monotonic() + min(w.timeout, 60.0)
    while True:
        try:
            n = w.store.add("shmap/nevents", 0)
        except Exception:  # noqa: BLE001
            return False
        if n > len(w.events) + 1:
            w._read_events()
        failed = sorted(r for r, v in w.events.items() if v[0].startswith("failed"))
        if failed:
            me = re.compile(rf"\branks? (?:\d+, )*{w.rank}\b")
            if any(me.search(w.events[r][1]) for r in failed):
                who = "because this rank ended early (it skipped collectives the others called)"
            else:
                who = "after this rank finished"
            print(f"shmap: rank {w.rank} finished its program (after collective #{w.counter}), but "
                  f"{_ranks(failed)} failed {who}; ending with status 1:\n  " +
                  "\n  ".join(f"rank {r}: {w.events[r][1].splitlines()[0]}" for r in failed),
                  file=sys.stderr)
            return True
        if n >= w.world or time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _after_roots(w, limit=5.0):
    """Before a rank that failed because of others leaves: let the ranks at the root of it leave first.

    Launchers such as torchrun name the first process they see fail as the
    root cause; waiting here (bounded) for the failing ranks' `gone` marks
    makes that the rank that failed, not one that merely stopped waiting for it.
    """
    if not _live(w):
        return
    roots = sorted(r for r, v in w.events.items() if v[0] in ("failed", "exited"))
    if not roots:
        return
    deadline = time.monotonic() + limit
    try:
        while time.monotonic() < deadline and not w.store.check([f"shmap/gone/{r}" for r in roots]):
            time.sleep(0.05)
    except Exception:  # noqa: BLE001
        return
    time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))  # the launcher polls every 0.1 s or so


def _gone(w):
    """Mark this process as leaving now (read by `_after_roots` of the ranks that failed because of it)."""
    if w is not None and _live(w):
        try:
            w.store.set(f"shmap/gone/{w.rank}", "1")
        except Exception:  # noqa: BLE001
            pass


def _at_exit():
    w = _WATCH
    if w is None:
        return
    if w.poisoned:
        _hard_exit(1)
    report_exit()
    if w.status == "exited" and exit_barrier():
        _hard_exit(1)
    if w.status == "failed" and _live(w):
        # An uncaught exception (reported, traceback printed): leave now.  Tearing down process groups
        # that peers still wait in can take seconds, and a launcher that sees a peer fail first would
        # name that peer as the root cause.
        _hard_exit(1)
    _gone(w)


def _hard_exit(code):
    """Leave without running destructors that would wait for an abandoned collective."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001
            pass
    _gone(_WATCH)
    os._exit(code)


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------
def _gather_into(out, x, group):
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=True)


def _transport_error(e) -> bool:
    """Whether a failed collective failed because of the network or a peer (not its arguments)."""
    m = str(e).lower()
    return any(k in m for k in ("connection", "transport", "pair.cc", "timed out", "timeout", "peer", "socket"))


def describe(kind, axes, shape, dtype, extra="") -> str:
    dt = str(dtype).replace("torch.", "")
    s = f"{kind} over {fmt_axes(axes)} of {dt}{list(shape)}" if axes else f"{kind} ({dt}{list(shape)})"
    return s + (f" ({extra})" if extra else "")


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _internal(filename: str) -> bool:
    f = os.path.abspath(filename)
    return f.startswith(_PKG) or f.startswith(_TORCH) or "<frozen" in filename


def _user_location() -> str:
    """file:line of the innermost user frame calling into shmap (for messages)."""
    for fr in reversed(traceback.extract_stack()):
        if not _internal(fr.filename):
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    return ""
