"""Shared-memory collectives (shmap.kernels.ShmTransport) vs gloo, side by side.

    python bench/bench_kernels.py                 # 2 and 4 processes, 64 KiB / 1 MiB / 16 MiB
    python bench/bench_kernels.py --procs 2 --sizes 1M --reps 20

For each process count the script spawns that many rank processes itself.
Each rank initialises torch.distributed with gloo on loopback *and* joins a
shared-memory group, checks that both give the same results, then times the
two implementations in alternating rounds (gloo, shm, gloo, shm, ...) so that
background noise hits both alike.  A round's time is the slowest rank's.

Sizes follow nccl-tests: all_reduce moves a tensor of SIZE bytes, all_gather
produces SIZE bytes (each rank contributes SIZE/n), reduce_scatter consumes
SIZE bytes per rank.  Bus bandwidth: all_reduce SIZE*2(n-1)/n/t, the others
SIZE*(n-1)/n/t; the ratio shm/gloo is the same as gloo time / shm time.
Both sides use torch.set_num_threads(1) per rank.  If the host has fewer cores
than ranks, processes are oversubscribed; the table says so.  The load average
before the run is printed too: other work on the host makes these numbers
noisy (both sides suffer, but not always equally), so compare several runs.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shmap.kernels.segments import new_group_name  # noqa: E402
from shmap.kernels.transport import ShmTransport  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


def _fmt_size(n: int) -> str:
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:g} {unit}"
    return f"{n} B"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make(op: str, size: int, n: int, rank: int):
    """(gloo callable, shm callable, check) for one op and size (float32)."""
    numel = size // 4
    if op == "all_reduce":
        x = torch.full((numel,), float(rank + 1))
        y = x.clone()
        return (lambda: dist.all_reduce(x),
                lambda: tr.all_reduce(y, out=y),
                lambda: (x.copy_(torch.full_like(x, rank + 1.0)), dist.all_reduce(x),
                         torch.testing.assert_close(tr.all_reduce(torch.full_like(x, rank + 1.0)), x)))
    if op == "all_gather":
        per = numel // n
        x = torch.arange(per, dtype=torch.float32) + rank * per
        out = torch.empty(n * per)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: ag(out, x),
                lambda: tr.all_gather(x),
                lambda: (ag(out, x),
                         torch.testing.assert_close(tr.all_gather(x).view(-1), out)))
    if op == "reduce_scatter":
        per = numel // n
        x = torch.arange(n * per, dtype=torch.float32).view(n, per) * (rank + 1)
        out = torch.empty(per)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: rs(out, x.view(-1)),
                lambda: tr.reduce_scatter(x),
                lambda: (rs(out, x.view(-1)),
                         torch.testing.assert_close(tr.reduce_scatter(x), out)))
    raise ValueError(op)


tr: ShmTransport | None = None


def _time(fn, reps: int) -> float:
    """Seconds per call of the slowest rank (a collective is as slow as its slowest rank)."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = torch.tensor([(time.perf_counter() - t0) / reps])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def _rank_main(rank, n, port, name, sizes, reps_override, rounds, queue):
    global tr
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    cap = 4 * max(sizes) + (1 << 20)  # two halves (parity), each holding inbox + output
    tr = ShmTransport(name, rank, n, capacity=cap, timeout=120)
    results = []
    for op in OPS:
        for size in sizes:
            gloo_fn, shm_fn, check = _make(op, size, n, rank)
            check()
            reps = reps_override or max(3, min(200, (64 << 20) // size))
            for _ in range(2):  # warm-up
                gloo_fn()
                shm_fn()
            g, s = [], []
            for _ in range(rounds):
                g.append(_time(gloo_fn, reps))
                s.append(_time(shm_fn, reps))
            results.append((op, size, statistics.median(g), statistics.median(s)))
    if rank == 0:
        queue.put(results)
    tr.close()
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", default=["64K", "1M", "16M"])
    ap.add_argument("--reps", type=int, default=0, help="calls per timed round (default: by size)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating gloo/shm rounds")
    args = ap.parse_args(argv)
    sizes = [_parse_size(s) for s in args.sizes]
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {cores} CPU core(s), load average {load:.1f} before the "
          f"run; float32; medians of {args.rounds} alternating rounds")
    print("time: slowest rank's mean per call; GB/s: bus bandwidth; shm/gloo: bus-bandwidth ratio")
    print(f"{'procs':>5} {'op':<15} {'size':>9} {'gloo us':>9} {'shm us':>9} "
          f"{'gloo GB/s':>9} {'shm GB/s':>9} {'shm/gloo':>9}")
    ctx = mp.get_context("spawn")
    for n in args.procs:
        queue = ctx.SimpleQueue()
        mp.spawn(_rank_main, args=(n, _free_port(), new_group_name(), sizes, args.reps,
                                   args.rounds, queue), nprocs=n, join=True)
        for op, size, tg, ts in queue.get():
            factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
            bw_g, bw_s = size * factor / tg / 1e9, size * factor / ts / 1e9
            print(f"{n:>5} {op:<15} {_fmt_size(size):>9} {tg * 1e6:>9.0f} {ts * 1e6:>9.0f} "
                  f"{bw_g:>9.2f} {bw_s:>9.2f} {tg / ts:>8.2f}x"
                  + ("  (oversubscribed)" if n > cores else ""))


if __name__ == "__main__":
    main()
