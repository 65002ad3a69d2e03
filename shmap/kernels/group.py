"""A pool of worker processes, one per device, running kernels on shared memory.

`ShmGroup(n)` spawns n workers once (each attaches to the group's shared
memory by name, as a `ShmComm`) and then runs any number of kernels:
`group.run(kernel, inputs_per_device, out_shapes, ...)` has the same signature
and result as `interpret`, so tests and the shard_map bridge can switch runtime
by switching the function.  Inputs are staged straight into each worker's
arena and outputs read straight out of it; only the kernel (by reference: a
module-level function or a functools.partial of one) and small specs travel
through the pipes.

Failure handling: a worker whose kernel raises marks itself failed in shared
memory and rings every doorbell, so its peers stop at their next wait; the
parent also watches process sentinels, so a worker that dies outright (killed,
segfault) is marked failed on its behalf.  The parent re-raises the root cause
(the first error that is not "a peer failed"), naming the device, and resets
the shared state so the group stays usable.  A worker that has not reported
within the timeout after a peer failed is terminated and the group is closed.
(A kernel's own running time is not bounded, but its waits are, and so is a
loop polling `semaphore_read` on a value that does not change: `shm_device`.)
"""
from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import pickle
import time
import traceback

import torch
import torch.multiprocessing as tmp

from . import errors as kerrors
from .errors import (
    DeviceError,
    KernelError,
    KernelUsageError,
    PeerFailedError,
    SemaphoreLeakError,
    site_from_traceback,
)
from .common import normalize_inputs
from .refs import SemaphoreSpec, as_buffer, flatten_specs
from .segments import Segments, align, new_group_name
from .shm import ShmComm


def _error_payload(rank: int, e: BaseException) -> dict:
    return {
        "rank": rank,
        "type": type(e).__name__,
        "kernel_error": isinstance(e, KernelError) and not isinstance(e, KernelUsageError),
        "peer_failed": isinstance(e, PeerFailedError),
        "message": str(e),
        "site": str(site_from_traceback(e.__traceback__)),
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
    }


def _rebuild_error(p: dict) -> KernelError:
    if p["kernel_error"]:
        cls = getattr(kerrors, p["type"], KernelError)
        return cls(p["message"])
    return DeviceError(
        f"device {p['rank']} raised {p['type']}: {p['message']}\n  at {p['site']}\n"
        f"The other devices were stopped.\n--- traceback in device {p['rank']}'s process ---\n"
        f"{p['traceback']}")


def _worker_main(name: str, rank: int, conn, timeout: float) -> None:
    torch.set_num_threads(1)  # one device per process; n processes share the cores
    seg = Segments.attach(name, timeout=timeout)
    comm = ShmComm(seg, rank, timeout=timeout)
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "close":
            break
        if msg[0] == "reset":
            comm.reset_local()
            conn.send(("ok", None))
            continue
        _, kernel_bytes, in_layout, outs, scratch, grid, t_out, n, epoch, base, poison = msg
        try:
            kernel = pickle.loads(kernel_bytes)
            inputs = [seg.arenas[rank][off:off + nb].view(dt).view(shape)
                      for off, nb, shape, dt in in_layout]
            res, slot_max, names = comm.run(
                kernel, inputs, outs, scratch=scratch, grid=grid, timeout=t_out, n=n, epoch=epoch,
                arena_base=base, poison=poison, outputs="offsets", check_late=False)
            conn.send(("ok", ([(off, spec.shape, spec.dtype) for off, spec in res], slot_max,
                              names)))
        except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
            conn.send(("error", _error_payload(rank, e)))
    comm.close()
    conn.close()
    os._exit(0)  # skip interpreter teardown (seconds with torch loaded); nothing to flush


class ShmGroup:
    """n worker processes sharing memory; `run` has `interpret`'s signature.

    `capacity` is each device's arena in bytes (inputs + outputs + scratch of
    one kernel call); `timeout` bounds every wait inside a kernel.
    """

    def __init__(self, n: int, *, capacity: int = 64 << 20, timeout: float = 60.0,
                 n_slots: int = 256, start_timeout: float = 120.0):
        self.size, self.timeout = int(n), float(timeout)
        self.name = new_group_name()
        self.broken: str | None = None
        self.epoch = 0
        self.procs, self.conns = [], []
        self.seg = Segments.create(self.name, self.size, capacity=capacity, n_slots=n_slots)
        try:
            ctx = tmp.get_context("spawn")
            for r in range(self.size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(self.name, r, child, self.timeout),
                                daemon=True, name=f"shmap-shm-device-{r}")
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            deadline = time.monotonic() + start_timeout
            for r, (p, c) in enumerate(zip(self.procs, self.conns)):
                while not c.poll(0.05):
                    if not p.is_alive() or time.monotonic() > deadline:
                        raise KernelError(f"shared-memory worker {r} failed to start "
                                          f"(exit code {p.exitcode})")
                c.recv()
        except BaseException:
            self.close()
            raise
        self.seg.unlink()  # every worker has it mapped
        atexit.register(self.close)

    # -- running kernels
    def run(self, kernel, inputs_per_device, out_shapes, *, scratch=(), grid=(), timeout=None,
            poison: bool = False) -> list:
        """Run `kernel` on devices 0..len(inputs_per_device)-1; returns per-device outputs."""
        if self.broken:
            raise KernelError(f"this ShmGroup is unusable: {self.broken}; create a new one")
        per_dev = normalize_inputs(inputs_per_device)
        n = len(per_dev)
        if n > self.size:
            raise KernelUsageError(f"{n} devices requested but the group has {self.size} workers")
        outs, single = flatten_specs(out_shapes)
        out_specs = [as_buffer(s, f"out_shapes[{i}]") for i, s in enumerate(outs)]
        scratch = [s if isinstance(s, SemaphoreSpec) else as_buffer(s, f"scratch[{i}]")
                   for i, s in enumerate(scratch)]
        try:
            kernel_bytes = pickle.dumps(kernel)
        except Exception as e:  # lambdas, closures, bound methods of local classes
            raise KernelUsageError(
                f"run_shm/ShmGroup.run send the kernel to worker processes by reference, so it "
                f"must be a module-level function (or a functools.partial of one); "
                f"{kernel!r} cannot be pickled: {e}") from None

        layout, top = [], 0
        for x in per_dev[0]:
            nb = x.numel() * x.element_size()
            layout.append((top, nb, tuple(x.shape), x.dtype))
            top = align(top + nb)
        if top > self.seg.capacity:
            raise KernelUsageError(
                f"inputs need {top} bytes per device, more than the group's arena "
                f"({self.seg.capacity}); create ShmGroup(..., capacity=...) larger")
        for r, xs in enumerate(per_dev):
            for (off, nb, shape, dt), x in zip(layout, xs):
                self.seg.arenas[r][off:off + nb].view(dt).view(shape).copy_(x)

        self.epoch += 1
        t_out = self.timeout if timeout is None else float(timeout)
        msg = ("run", kernel_bytes, layout, out_specs, scratch, tuple(grid), t_out, n,
               self.epoch, top, poison)
        for r in range(n):
            self.conns[r].send(msg)
        replies = self._collect(n, t_out)
        errors = [p for kind, p in replies.values() if kind == "error"]
        if errors:
            root = sorted(errors, key=lambda p: (p["peer_failed"], p["rank"]))[0]
            err = _rebuild_error(root)
            self._reset()
            raise err
        self._check_semaphores(n, replies)
        results = []
        for r in range(n):
            outs_r = [self.seg.arenas[r][off:off + _nbytes(shape, dt)].view(dt).view(shape)
                      .clone() for off, shape, dt in replies[r][1][0]]
            results.append(outs_r[0] if single else tuple(outs_r))
        return results

    def _check_semaphores(self, n: int, replies: dict) -> None:
        """Exact leftover check: every worker has left the kernel and none has started another,
        so the counters are final (a worker's own exit check can miss late signals)."""
        bad = []
        for r in range(n):
            _, slot_max, names = replies[r][1]
            for slot in range(1, slot_max):
                v = self.seg.value(r, slot)
                if v:
                    bad.append(f"  device {r}: semaphore {names.get(slot, f'#{slot}')} = {v}")
        if bad:
            self._reset()
            raise SemaphoreLeakError(
                f"the kernel ended with {len(bad)} semaphore(s) not at zero (every semaphore must "
                "be back at 0 when the kernel ends):\n" + "\n".join(bad)
                + "\nRun the kernel under kernels.interpret to see who signalled them.")

    def _collect(self, n: int, timeout: float) -> dict:
        """Replies of workers 0..n-1, watching for workers that die or never answer."""
        replies: dict = {}
        waiting = {r: self.conns[r] for r in range(n)}
        grace_deadline = None
        while waiting:
            ready = multiprocessing.connection.wait(
                list(waiting.values()) + [self.procs[r].sentinel for r in waiting], timeout=0.5)
            for r in list(waiting):
                c = waiting[r]
                if c in ready or c.poll(0):
                    try:
                        replies[r] = c.recv()
                    except (EOFError, OSError):
                        replies[r] = ("error", self._died(r))
                    del waiting[r]
                elif not self.procs[r].is_alive():
                    replies[r] = ("error", self._died(r))
                    del waiting[r]
            if any(k == "error" for k, _ in replies.values()) and grace_deadline is None:
                grace_deadline = time.monotonic() + timeout + 5.0
            if grace_deadline is not None and time.monotonic() > grace_deadline and waiting:
                for r in waiting:
                    self.procs[r].terminate()
                    replies[r] = ("error", {
                        "rank": r, "type": "KernelTimeoutError", "kernel_error": True,
                        "peer_failed": True, "site": "?", "traceback": "",
                        "message": f"device {r} did not stop after a peer failed; terminated"})
                self.broken = f"worker(s) {sorted(waiting)} had to be terminated"
                waiting.clear()
        return replies

    def _died(self, r: int) -> dict:
        code = self.procs[r].exitcode
        msg = f"device {r}'s process exited unexpectedly (exit code {code})"
        self.seg.mark_failed(r, msg)  # wake its peers: they stop instead of waiting for it
        self.broken = msg
        return {"rank": r, "type": "DeviceError", "kernel_error": True, "peer_failed": False,
                "message": msg, "site": "?", "traceback": ""}

    def _reset(self) -> None:
        """After a failed kernel: clear counters and failure flags so the group can be reused."""
        if self.broken:
            self.close()
            return
        for c in self.conns:
            c.send(("reset",))
        for c in self.conns:
            c.recv()
        self.seg.reset()
        self.epoch = 0

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close",))
            except (OSError, BrokenPipeError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        if getattr(self, "seg", None) is not None:
            self.seg.unlink()
            self.seg.close()
            self.seg = None
        self.broken = self.broken or "closed"
        atexit.unregister(self.close)

    def __enter__(self) -> "ShmGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


_default: ShmGroup | None = None


def run_shm(kernel, inputs_per_device, out_shapes, *, scratch=(), grid=(), timeout=None,
            poison: bool = False, group: ShmGroup | None = None) -> list:
    """`interpret`'s signature on real processes.

    Without `group`, uses a process-wide pool of max(n, 4) workers, started on
    first use and replaced if it breaks.
    """
    global _default
    if group is None:
        n = len(inputs_per_device)
        if _default is None or _default.broken or _default.size < n:
            if _default is not None:
                _default.close()
            _default = ShmGroup(max(n, 4))
        group = _default
    return group.run(kernel, inputs_per_device, out_shapes, scratch=scratch, grid=grid,
                     timeout=timeout, poison=poison)


__all__ = ["ShmGroup", "run_shm"]
