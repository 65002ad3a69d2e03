"""Keeping a distributed mesh from hanging: collective signatures, watched waits, failure reports.

On the simulated mesh a wrong program is an exception at the line that is
wrong.  On one process per device the same mistakes become hangs: a rank that
raised leaves its peers blocked in their next collective, and ranks that call
different collectives deadlock or, worse, combine unrelated data.  This module
turns each into an error on every rank that names the ranks involved:

- **Signatures** (on by default): before each collective every rank
  all-gathers a 2-integer signature (call counter, hash of kind / axes /
  shape / dtype / parameters) over a dedicated gloo group.  A difference
  raises `CollectiveMismatchError` on every rank *before* any data moves, so
  the process groups stay usable.  `configure_distributed(check_collectives=False)`
  (or `SHMAP_CHECK_COLLECTIVES=0`) drops this per-collective round trip.
- **Watched waits**: a wait on a CPU (gloo) collective waits in slices; between
  slices it reads the TCPStore for reports of other ranks and raises
  `RankFailedError` when one failed or exited, and `CollectiveTimeoutError`
  after the timeout (the process group's by default), naming the ranks that
  never arrived and what each waiting rank waits for.
- **Failure reports**: a rank whose exception escapes (`sys.excepthook`), or
  whose `shmap.spawn` worker raises, writes it to the store first; a normal
  exit is written too, so a rank that returned early is named, not waited for.

A rank that gave up on a collective still has it pending inside the process
group, whose destructor would wait for it; such a process ends with
`os._exit` after its traceback is printed, so no process is left running.
"""
from __future__ import annotations

import atexit
import os
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


_OPTIONS = {
    "check_collectives": _env_flag("SHMAP_CHECK_COLLECTIVES", True),
    "timeout": _env_float("SHMAP_COLLECTIVE_TIMEOUT"),
    "transport": os.environ.get("SHMAP_TRANSPORT", "torch"),
    "poll": 0.25,
    "exit_grace": 2.0,
}


def configure_distributed(*, check_collectives: bool | None = None, timeout: float | None = None,
                          transport: str | None = None) -> dict:
    """Set how distributed collectives are guarded; returns the previous settings.

    - `check_collectives`: exchange a signature before each collective so that
      ranks running different programs get `CollectiveMismatchError` instead of
      a hang or silently mixed data (default True; env `SHMAP_CHECK_COLLECTIVES`).
      Costs one small all-gather per collective; turn off once a program is
      known to be rank-uniform.
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
        _OPTIONS["check_collectives"] = bool(check_collectives)
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
        self.lock = threading.Lock()
        self.current = None  # (counter, kind, axes, shape, dtype, extra) of the collective in progress
        self.last = None  # the same for the last collective that completed
        self.events: dict = {}  # rank -> (status, text, first seen)
        self.reported = False
        self.poisoned = False

    # ------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        return _OPTIONS["timeout"] or self.pg_timeout

    def begin(self, kind: str, axes: tuple, shape, dtype, extra: str = ""):
        """Count a collective and, if checks are on, launch its signature exchange (on its own group).

        `verify` waits for it and raises if the ranks disagree; the backend
        verifies before it launches the data exchange.  (Overlapping the two
        would hide the check's latency, but gloo collectives that disagree can
        crash a process instead of raising, so the data waits.)
        """
        with self.lock:
            self.counter += 1
            n = self.counter
        self.current = (n, kind, axes, shape, dtype, extra)
        if self.control is None or not _OPTIONS["check_collectives"]:
            return None
        desc = describe(kind, axes, shape, dtype, extra)
        sig = torch.tensor([n, zlib.crc32(desc.encode())], dtype=torch.int64)
        out = torch.empty(self.world * 2, dtype=torch.int64)
        with torch.no_grad():
            work = _gather_into(out, sig, self.control)
        return _Pending(n, desc, sig, out, work)

    def verify(self, pending):
        """Wait for a signature exchange and raise `CollectiveMismatchError` if the ranks disagree."""
        if pending is None:
            return
        self.wait(pending.work, None, None, gloo=True, signature=True)
        if not pending.matches():
            self._mismatch(pending.n, pending.desc)

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
    def wait(self, work, what, ranks, *, gloo: bool, signature=False):
        """Wait for `work`, watching for failed peers and the timeout.

        `what` describes the wait for messages (None: the current collective);
        `ranks` are the global ranks it needs (None: all).
        """
        if not gloo:
            work.wait()
            return
        t0 = None
        published = False
        while True:
            try:
                work.wait(_POLL[0])
                break
            except RuntimeError as e:
                if work.is_completed():
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
            self._poll(self._what(what, signature), ranks, t0, now)
        if published:
            self._unpublish_wait()

    def _what(self, what, signature=False):
        if what is not None:
            return what
        cur = self.describe_current()
        return f"the signature exchange of {cur}" if signature else cur

    def _publish_wait(self, what):
        try:
            self.store.set(f"shmap/wait/{self.rank}", f"{what} at {_user_location()}")
        except Exception:  # noqa: BLE001 - diagnostics only
            pass

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
                "The ranks ran different programs (a collective called on some ranks only). Fix: make every "
                "rank call the same collectives; shmap.configure_distributed(check_collectives=True) reports "
                "this at the first differing collective."
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
            try:
                key = f"shmap/wait/{r}"
                rec = self.store.get(key).decode(errors="replace") if self.store.check([key]) else None
            except Exception:  # noqa: BLE001
                rec = None
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
        """The collective failed outright: name the rank behind it if one reported."""
        deadline = time.monotonic() + 2 * _OPTIONS["poll"] + 0.5
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
        try:
            self.store.set(f"shmap/event/{self.rank}", f"{status}\n{text}")
            self.store.add("shmap/nevents", 1)
        except Exception:  # noqa: BLE001 - the store may already be gone at exit
            pass


class _Pending:
    """A signature exchange in flight."""

    __slots__ = ("n", "desc", "sig", "out", "work")

    def __init__(self, n, desc, sig, out, work):
        self.n, self.desc, self.sig, self.out, self.work = n, desc, sig, out, work

    def matches(self) -> bool:
        return bool((self.out.view(-1, 2) == self.sig).all())


#: the wait slice, as the timedelta work.wait() takes (rebuilt by configure_distributed)
_POLL = [timedelta(seconds=_OPTIONS["poll"])]

_WATCH: Watch | None = None
_WATCH_LOCK = threading.Lock()


def watch() -> Watch:
    """This process's guard for the current torch.distributed world (created on first use).

    The first call is collective (it creates a process group): the backend
    makes it when a distributed mesh runs its first shard_map, on every rank.
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
        except Exception:  # noqa: BLE001
            pass
        prev(etype, value, tb)
        if _WATCH is not None and _WATCH.poisoned:
            _hard_exit(1)

    sys.excepthook = hook
    atexit.register(_at_exit)


def report_exit() -> None:
    """Tell the other ranks this one finished its program (so a peer still waiting for it is told)."""
    w = _WATCH
    dist = _dist()
    # After destroy_process_group the shutdown is orderly: nobody waits, and the store may be gone.
    if w is not None and not w.reported and dist.is_initialized() and w.world_pg is dist.group.WORLD:
        last = describe(*w.last[1:]) if w.last else "none"
        w.report("exited", f"finished its program after collective #{w.counter} (last: {last})")


def _at_exit():
    w = _WATCH
    if w is None:
        return
    report_exit()
    if w.poisoned:
        _hard_exit(1)


def _hard_exit(code):
    """Leave without running destructors that would wait for an abandoned collective."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001
            pass
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
