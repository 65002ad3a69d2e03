"""`shmap.spawn`: run a function on N local processes forming a torch.distributed world.

`torchrun` is the launcher for real jobs (docs/distributed.md).  This is for
tests, benchmarks and quick experiments on one machine: it hosts the
rendezvous store in the calling process (so the store outlives any rank),
starts one process per rank, returns every rank's result, and turns failures
into one exception that says what each rank did.  It never leaves a process
running: ranks still alive once the others are done are given a short grace
period and then killed.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import queue
import re
import sys
import time
import traceback
from datetime import timedelta

from .backends.watchdog import DistributedError


class SpawnError(DistributedError):
    """At least one rank of `shmap.spawn` failed; `.errors` maps rank -> (type name, message, traceback)."""

    def __init__(self, message, errors, results):
        super().__init__(message)
        self.errors = errors
        self.results = results


def spawn(fn, *args, nprocs: int, backend: str = "gloo", timeout: float = 60.0, grace: float = 10.0,
          env: dict | None = None):
    """Run `fn(*args)` on `nprocs` processes of a fresh torch.distributed world; list of results by rank.

    `fn` must be importable (a module-level function); its results must be
    picklable.  `timeout` is the process groups' timeout in seconds (a bound
    on any hang); `grace` how long ranks may outlive the first failure before
    they are killed.  Raises `SpawnError` naming each failed rank and its
    exception, root causes first.

    `backend`: the process groups' backend ("gloo"; "nccl" on GPUs).  `env`:
    environment variables set in every rank before `fn` runs (e.g.
    `{"SHMAP_CHECK_COLLECTIVES": "strict"}`), over this process's own
    `SHMAP_*` variables, which the ranks also get as they are now (the
    ranks are forked from a server started at the first `spawn`, whose
    environment would otherwise be that of its start).
    """
    import torch.distributed as dist

    _check_arguments(fn, nprocs, backend, timeout, grace, env)
    try:  # fn travels pickled, unpickled after the child has this process's sys.path
        job = pickle.dumps((fn, args))
    except Exception as e:  # noqa: BLE001 - pickle raises several types
        raise TypeError(
            f"shmap.spawn: fn and args must be picklable to reach the ranks ({type(e).__name__}: {e}). Fix: pass "
            "a function defined at module level (not a lambda, closure or method of a local class), and "
            "arguments that pickle."
        ) from e
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(job, list(sys.path), r, nprocs, store.port, backend, timeout,
                                          _rank_env(env), out), daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    results, errors, dead = {}, {}, {}
    first_failure = None
    deadline = time.monotonic() + timeout * 4 + 60
    try:
        while len(results) + len(errors) < nprocs:
            now = time.monotonic()
            if first_failure is not None and now > first_failure + grace:
                break
            if now > deadline:
                break
            try:
                rank, ok, payload = out.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r in results or r in errors or p.is_alive():
                        continue
                    dead.setdefault(r, time.monotonic())
                    # A result put just before exiting may still be in the pipe: give it a moment.
                    if p.exitcode != 0 or time.monotonic() - dead[r] > 2.0:
                        errors[r] = ("ProcessDied", _died(p.exitcode), "")
                        first_failure = first_failure or time.monotonic()
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                first_failure = first_failure or time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=max(0.0, 2.0 if errors or len(results) < nprocs else 10.0))
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join(5)
                if r not in results and r not in errors:
                    why = (f"still running {grace:g} s after the first failure" if first_failure is not None
                           else "still running at the deadline (4 x timeout + 60 s)")
                    errors[r] = ("Killed", why + "; killed", "")
        del store
    if errors:
        raise SpawnError(_summary(errors, nprocs, results), errors, results)
    return [results[r] for r in range(nprocs)]


def _rank_env(env):
    """What `_worker` sets: this process's `SHMAP_*` variables now, then `env`."""
    return {**{k: v for k, v in os.environ.items() if k.startswith("SHMAP_")}, **(env or {})}


def _check_arguments(fn, nprocs, backend, timeout, grace, env):
    def bad(name, rule, value, fix):
        raise ValueError(f"shmap.spawn: {name} must be {rule}, got {value!r}. Fix: {fix}.")

    if not callable(fn):
        raise TypeError(f"shmap.spawn: fn must be a function, got {type(fn).__name__}.")
    if type(nprocs) is not int or nprocs < 1:  # (bool is not int here)
        bad("nprocs", "a positive int (the number of ranks)", nprocs, "e.g. nprocs=2")
    if not isinstance(backend, str):
        bad("backend", "a torch.distributed backend name", backend, "backend='gloo' (CPU) or 'nccl' (GPUs)")
    for name, value, least in (("timeout", timeout, 0.0), ("grace", grace, None)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value <= 0 if least is not None else value < 0):
            bad(name, "a finite number of seconds" + (" > 0" if least is not None else " >= 0"), value,
                f"e.g. {name}={60 if least is not None else 10}")
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
        bad("env", "a dict of environment variables (str keys)", env, "e.g. env={'OMP_NUM_THREADS': '1'}")


def _died(code) -> str:
    """Why a rank ended without a result, as far as its exit code says."""
    import signal

    msg = f"exited with code {code} without a result"
    if code == 1:
        msg += ("; if no rank said why, the calling script may lack an `if __name__ == '__main__':` guard: each "
                "rank starts by importing it, as multiprocessing does, and its top level then calls spawn again "
                "(which multiprocessing refuses). Fix: put the spawn call under that guard")
    if code is not None and code < 0:
        try:
            msg += f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
        if code == -signal.SIGABRT:
            msg += ("; if its stderr shows gloo's 'Received data size doesn't match expected size' (or "
                    "'op.preamble.length <= op.nbytes'), a peer sent it a larger block than it expected: the "
                    "ranks called a ppermute or all_to_all with different shapes (a sender with nothing to "
                    "receive cannot notice), a backward pass's gradient reduction differs between the ranks (a "
                    "replicated weight of different shapes on different ranks, a weight used on some ranks "
                    "only, a rank that skipped backward()), or a shard_map output has a different shape on "
                    "different ranks (sliced by a Python number that differs by rank), which DTensor's "
                    "full_tensor() then gathers")
    return msg


#: what gloo says when a peer went away while this rank waited for it (a collective of torch.distributed's
#: or DTensor's own, which shmap's guard does not watch): the rank is a victim, not the cause
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _peer_gone(name, msg) -> bool:
    return name == "RuntimeError" and any(p in msg for p in _PEER_GONE)


def _summary(errors, nprocs, results=()) -> str:
    def key(item):
        name, msg = item[1][0], item[1][1]
        secondary = name in ("RankFailedError", "CollectiveTimeoutError", "Killed", "ProcessDied") or \
            _peer_gone(name, msg)
        return (secondary, item[0])

    lines = [f"shmap.spawn: {len(errors)} of {nprocs} ranks failed:"]
    for r, (name, msg, _) in sorted(errors.items(), key=key):
        first = msg.strip().splitlines()[0] if msg.strip() else ""
        lines.append(f"  rank {r}: {name}: {first}")
    odd = [m.group(1) for _, msg, _ in errors.values() for m in [re.search(r"Rank (\d+) is the odd one out", msg)]
           if m]
    peer_gone = any(_peer_gone(name, m) for name, m, _ in errors.values())
    for r in sorted(results):
        # A rank that returned while the others failed: name it if they say it ended without them.
        named = any(re.search(rf"\branks? (?:\d+, )*{r}\b[^\n]*finished the program", m) for _, m, _ in errors.values())
        if named and odd:
            lines.append(f"  rank {r}: returned after its program's last collective, while rank {odd[0]} went on "
                         f"to another: rank {odd[0]} likely ran collectives the others never call")
        elif named:
            lines.append(f"  rank {r}: returned early: the others still waited for it in a collective "
                         "(it skipped collectives they called)")
        elif peer_gone:
            lines.append(f"  rank {r}: returned while others were in a collective with it (gloo: its connection "
                         "closed): it likely skipped a collective they called, one of torch.distributed's or "
                         "DTensor's own (full_tensor, a checkpoint save), which shmap's guard does not watch")
    root = sorted(errors.items(), key=key)[0]
    if root[1][2]:
        lines.append(f"traceback of rank {root[0]}:\n{root[1][2]}")
    return "\n".join(lines)


def _context():
    """forkserver where available: torch is imported once by the server, not by every rank."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # DTensor.from_local imports torch._dynamo on first use: ~1 s per rank unless preloaded.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
                                    "shmap"])
        return ctx
    return mp.get_context("spawn")


def _worker(job, path, rank, world, port, backend, timeout, env, out):
    import torch
    import torch.distributed as dist

    from .backends import config, watchdog

    try:  # the world's set-up: a failure here (an unknown backend, say) is this rank's error too
        for k in [k for k in os.environ if k.startswith("SHMAP_") and k not in env]:
            del os.environ[k]  # (the forkserver's, from its start: the parent has dropped it since)
        os.environ.update({k: str(v) for k, v in env.items()})
        config.reload_from_env()  # (shmap was imported by the forkserver, before `env` was set)
        sys.path[:] = path + [p for p in sys.path if p not in path]
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
    except BaseException as e:  # noqa: BLE001 - reported to the parent; no peer to tell yet
        out.put((rank, False, (type(e).__name__, f"setting up the process group (backend={backend!r}): {e}",
                               traceback.format_exc())))
        out.close()
        out.join_thread()
        os._exit(1)
    try:
        fn, args = pickle.loads(job)
        result = fn(*args)
        payload = pickle.dumps(result)
    except BaseException as e:  # noqa: BLE001 - reported to the peers and the parent
        watchdog.report_failure(e)
        out.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
        _finish(out, failed=True)
        return
    out.put((rank, True, payload))
    _finish(out, failed=False)


def _finish(out, failed):
    from .backends import watchdog

    out.close()
    out.join_thread()
    w = watchdog._WATCH
    if failed or (w is not None and w.poisoned):
        watchdog._hard_exit(1 if failed else 0)
    watchdog.shutdown_distributed()  # (exits 1 if the others failed waiting for this rank; its result is sent)
