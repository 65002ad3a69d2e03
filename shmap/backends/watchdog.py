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

This module keeps the process's guard and its exit; the rest lives beside it:
`config` (`configure_distributed`), `signatures` (`Seal`), `guard` (`Watch`),
`waits` (watched waits) and `shmap.errors` (the errors).  Their names stay
importable from here.
"""
from __future__ import annotations

import atexit
import os
import re
import sys
import time
import traceback

from ..errors import (  # noqa: F401  (re-exported)
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    RankFailedError,
)
from .config import _OPTIONS, _POLL, _env_check, _env_flag, _env_float, configure_distributed  # noqa: F401
from .guard import _BOX, _BOX_HEAD, Watch, _dist, _gather_into  # noqa: F401
from .signatures import (  # noqa: F401
    SEAL_BITS,
    _TRAILERS,
    Seal,
    _Pending,
    describe,
    reduce_trailer,
    sealable,
    signature16,
)
from .waits import (  # noqa: F401
    _PKG,
    _TORCH,
    _WAITER,
    _WATCH_LOCK,
    WatchedWaits,
    _internal,
    _ranks,
    _transport_error,
    _user_location,
    _Waiter,
    _waiter,
)


_WATCH: Watch | None = None


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


def shutdown_distributed() -> None:
    """End this process's part of a distributed run, as `jax.distributed.shutdown` does: call it last.

    In order: tell the other ranks this one finished (`report_exit`), wait
    until every rank has finished or failed (`exit_barrier`: milliseconds when
    they finish together, at most the collective timeout capped at 60 s), then
    destroy the process groups.  Calling `torch.distributed.destroy_process_group()`
    directly skips the first two: a peer still waiting for this rank then
    hears only that its connection closed, not that it finished, and a rank
    that ended early is not told that the others failed because of it.  If
    they did, this says so and ends the process with status 1, as it would at
    interpreter exit, so that no rank of a broken run ends 0.  A rank that
    raises should not call it: its uncaught exception is reported to the
    others (`sys.excepthook`).  Without a process group it does nothing.
    """
    dist = _dist()
    if not dist.is_initialized():
        return
    w = _WATCH
    if w is not None:
        _finish_program(w)
    _gone(w)
    dist.destroy_process_group()


def _finish_program(w) -> None:
    """The common part of a rank's end (at interpreter exit, or `shutdown_distributed`): a poisoned
    guard ends the process with status 1; otherwise report "finished" and wait for the others, ending
    with status 1 if they failed because this rank ended early."""
    if w.poisoned:
        _hard_exit(1)
    report_exit()
    if w.status == "exited" and exit_barrier():
        _hard_exit(1)


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
            if any("is the odd one out" in w.events[r][1] for r in failed):
                who = "waiting in a collective this rank never calls (it likely ran collectives the others never call)"
            elif any(me.search(w.events[r][1]) for r in failed):
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
    _finish_program(w)
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
