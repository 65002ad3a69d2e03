"""Configuration of the distributed guard: `configure_distributed` and the options it sets.

The options start from the environment (`SHMAP_CHECK_COLLECTIVES`,
`SHMAP_COLLECTIVE_TIMEOUT`, `SHMAP_TRANSPORT`, `SHMAP_BUCKET_BYTES`,
`SHMAP_FIRST_BUCKET_BYTES`), read when shmap is imported (and by `spawn`'s
ranks once their `env` is set); the guard (`guard`, `waits`) and the
transports read `_OPTIONS` at each collective.
"""
from __future__ import annotations

import math
import os
from datetime import timedelta


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


def _from_env() -> dict:
    """The options the environment sets (the defaults where it sets none)."""
    return {
        "check_collectives": _env_check(),
        "timeout": _env_float("SHMAP_COLLECTIVE_TIMEOUT"),
        "transport": os.environ.get("SHMAP_TRANSPORT", "torch"),
        "bucket_bytes": int(os.environ.get("SHMAP_BUCKET_BYTES") or 25 << 20),
        "first_bucket_bytes": int(os.environ.get("SHMAP_FIRST_BUCKET_BYTES") or 0) or "auto",
    }


_OPTIONS = {**_from_env(), "poll": 0.25, "exit_grace": 2.0}


def traced_options() -> tuple:
    """The options a captured program bakes in (whether each collective carries its signature, the
    transport, the bucket sizes): part of `shmap.jit`'s key, so a program replays only under the
    options it was captured with, and its collectives stay those an eager call makes now.  A capture
    under checks on, replayed after `configure_distributed(check_collectives=False)`, would still send
    the signature; then a rank whose call runs eagerly (a capture that failed there) sends a payload
    of another size at the same collective, which gloo answers by aborting every process."""
    o = _OPTIONS
    return (o["check_collectives"], o["transport"], o["bucket_bytes"], o["first_bucket_bytes"])


def reload_from_env():
    """Take the options from the environment again: a process that imported shmap before its
    environment was set (`spawn`'s ranks, forked from a server that preloads shmap, then given
    `env`) would otherwise run with the server's, silently."""
    _OPTIONS.update(_from_env())


#: transport name -> factory(process group) -> an object with all_reduce / all_gather / reduce_scatter /
#: ppermute / all_to_all on CPU tensors; 'torch' (torch.distributed itself) needs none.  Transports plug
#: in with `register_transport` (the shared-memory one: `shmap.kernels.transport`), so the core never
#: imports them.
_TRANSPORTS: dict = {}


def register_transport(name: str, factory):
    """Make `configure_distributed(transport=name)` move CPU tensors with `factory(process_group)`."""
    _TRANSPORTS[name] = factory


def configure_distributed(*, check_collectives: bool | None = None, timeout: float | None = None,
                          transport: str | None = None, bucket_bytes: int | None = None,
                          first_bucket_bytes: int | str | None = None) -> dict:
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
    - `bucket_bytes`: a backward pass's gradient reductions (the psums of
      pvary, the psum_scatters of all_gather) are launched together in
      buckets of about this many bytes while the pass goes on, and forward
      all_gathers issued back to back share buckets of this size (default
      25 MiB, DDP's `bucket_cap_mb`; env `SHMAP_BUCKET_BYTES`; 1: one
      collective each).  See `backends/deferred.py`.
    - `first_bucket_bytes`: the first reduction bucket of each backward pass
      (per group, kind and dtype) holds at most this many bytes, so the wire
      starts early (env `SHMAP_FIRST_BUCKET_BYTES`; never more than
      `bucket_bytes`).  `'auto'`, the default: 1 MiB (DDP's first bucket) on
      NCCL; on gloo none, every bucket `bucket_bytes` (see
      `deferred.first_bucket_bytes` for the measurement).
    Must be set identically on every rank.
    """
    prev = {k: _OPTIONS[k] for k in ("check_collectives", "timeout", "transport", "bucket_bytes",
                                     "first_bucket_bytes")}
    updates = {}  # every argument is checked before any takes effect
    for name, value in (("bucket_bytes", bucket_bytes), ("first_bucket_bytes", first_bucket_bytes)):
        if value is None:
            continue
        if name == "first_bucket_bytes" and value == "auto":
            updates[name] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"configure_distributed: {name} must be a positive int, got {value!r}. "
                             f"Fix: a number of bytes, e.g. {name}={1 << 20}.")
        updates[name] = value
    if transport is not None:
        if transport != "torch" and transport not in _TRANSPORTS:
            known = ", ".join(repr(t) for t in ["torch", *_TRANSPORTS])
            raise ValueError(f"configure_distributed: transport must be one of {known}, got {transport!r}.")
        updates["transport"] = transport
    if check_collectives is not None:
        if check_collectives != "strict" and not isinstance(check_collectives, (bool, int)):
            raise ValueError("configure_distributed: check_collectives must be True, False or 'strict', "
                             f"got {check_collectives!r}.")
        updates["check_collectives"] = check_collectives if check_collectives == "strict" else bool(
            check_collectives)
    if timeout is not None:
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
                or timeout <= 0):
            raise ValueError(f"configure_distributed: timeout must be a finite number of seconds > 0, got "
                             f"{timeout!r}. Fix: e.g. timeout=60.")
        updates["timeout"] = float(timeout)
    _OPTIONS.update(updates)
    return prev


#: the wait slice, as the timedelta work.wait() takes (rebuilt by configure_distributed)
_POLL = [timedelta(seconds=_OPTIONS["poll"])]
