"""Distributed mesh: shmap's collectives vs raw torch.distributed, and a data-parallel step.

    .venv/bin/python bench/bench_distributed.py [--quick]

Part 1, on 2 and 4 gloo processes (localhost): each collective called in a
shard_map body vs the raw `torch.distributed` call on the same block, at
4 KiB, 1 MiB and 16 MiB per device.  shmap is timed in its default
configuration (mismatch checks on: the signature rides in the payload;
hang detection on), with checks off (`check_collectives=False`) and strict
(`check_collectives='strict'`: a signature exchange before each collective).
The raw calls work in place on preallocated buffers (`raw`) or write a fresh
output (`raw+alloc`, a clone for all_reduce); shmap's collectives are
functional, so `raw+alloc` is the like-for-like baseline.  Medians of
per-call times, the variants alternating call by call in rotating order; a ratio
(shmap / raw+alloc, 1.00 = same) is the median of the per-round ratios, so drifts
in the machine's load cancel.

Part 2: a data-parallel loss/grad step where every rank computes the same
global loss over its batch shard, written with shmap (default
configuration, and checks off), with `torch.nn.parallel.DistributedDataParallel`
(DDP), and with `torch.distributed.nn.functional.all_reduce`.  It counts the
torch.distributed collectives and bytes of the backward pass, compares each
gradient with the single-process gradient of the same global loss, and times
the step (ratio shmap / DDP).  DDP's step does not compute the global loss;
shmap's step with DDP's communication (each rank keeps its share of the loss,
out_specs P('i'); one all_reduce, of the gradients) is timed beside it, with
checks on (the default) and off: the difference is what the guard costs;
and jitted (`shmap.jit`: the step captured once, compiled by Inductor and
replayed, the guard's checks inside the replay), which takes the body's
per-op Python off the step.

All figures come from one run, side by side.  Timings on a shared or
oversubscribed machine are noisy: compare ratios within one run only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import shmap  # noqa: E402
from shmap import P  # noqa: E402

SIZES = [(4 << 10, "4 KiB"), (1 << 20, "1 MiB"), (16 << 20, "16 MiB")]
COLLECTIVES = ["psum", "all_gather", "psum_scatter", "ppermute", "all_to_all"]


# --------------------------------------------------------------------------
# Part 1: one collective, shmap vs raw (runs on every rank)
# --------------------------------------------------------------------------
def _raw_op(name, x, world, rank, alloc):
    """The torch.distributed call on block `x`: in place on preallocated buffers, or (`alloc`)
    writing a fresh output as a functional API must (a clone for all_reduce)."""
    import torch.distributed as dist

    bufs = {}

    def buf(key, make):
        if alloc or key not in bufs:
            bufs[key] = make()
        return bufs[key]

    if name == "psum":
        return lambda: dist.all_reduce(x.clone() if alloc else x)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(buf("o", lambda: x.new_empty(world * x.numel())), x)
    if name == "psum_scatter":
        return lambda: dist.reduce_scatter_tensor(buf("o", lambda: x.new_empty(x.numel() // world)), x)
    if name == "ppermute":
        def ring():
            out = buf("o", lambda: torch.empty_like(x))
            ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, out, (rank - 1) % world)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return ring
    if name == "all_to_all":
        return lambda: dist.all_to_all_single(buf("o", lambda: torch.empty_like(x)), x)
    raise ValueError(name)


def _shmap_op(name, world):
    ring = [(s, (s + 1) % world) for s in range(world)]
    return {
        "psum": lambda b: shmap.psum(b, "i"),
        "all_gather": lambda b: shmap.all_gather(b, "i", tiled=True),
        "psum_scatter": lambda b: shmap.psum_scatter(b, "i", tiled=True),
        "ppermute": lambda b: shmap.ppermute(b, "i", ring),
        "all_to_all": lambda b: shmap.all_to_all(b, "i", 0, 0, tiled=True),
    }[name]


def collective_worker(sizes, quick):
    """Per-call times of every variant, the variants alternating call by call inside one body.

    Alternating call by call (rather than timing blocks one after another)
    puts every variant under the same load, which on a shared machine
    drifts by more than the differences being measured; a barrier before each
    call starts it with every rank ready (so no call inherits its
    predecessor's stragglers); medians of per-call times shrug off outliers.
    """
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = shmap.make_mesh((world,), ("i",))
    variants = ("raw", "raw+alloc", "off", "default", "strict")
    modes = {"off": False, "default": True, "strict": "strict"}
    results = {}
    for nbytes, label in sizes:
        n = nbytes // 4
        calls = max(6, min(300, (32 << 20) // nbytes)) // (3 if quick else 1)
        for name in COLLECTIVES:
            x = torch.randn(n)
            raws = {"raw": _raw_op(name, x.clone(), world, rank, False),
                    "raw+alloc": _raw_op(name, x.clone(), world, rank, True)}
            op = _shmap_op(name, world)
            times = {v: [] for v in variants}

            def body(b):
                for it in range(2 + calls):  # two warm-up rounds
                    # rotating order: a gloo call's latency depends on what ran just before it
                    for v in variants[it % len(variants):] + variants[:it % len(variants)]:
                        if v in raws:
                            dist.barrier()  # every call starts with every rank ready
                            t0 = time.perf_counter()
                            raws[v]()
                        else:
                            shmap.configure_distributed(check_collectives=modes[v])
                            dist.barrier()
                            t0 = time.perf_counter()
                            op(b)
                        if it >= 2:
                            times[v].append(time.perf_counter() - t0)
                return shmap.psum(b[:1] * 0, "i")

            shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())(x.repeat(world))
            results[(label, name)] = {v: statistics.median(t) for v, t in times.items()}
            base = times["raw+alloc"]
            results[(label, name)]["ratio"] = {v: statistics.median(a / b for a, b in zip(times[v], base))
                                               for v in ("default", "off", "strict")}
    shmap.configure_distributed(check_collectives=True)
    return results


# --------------------------------------------------------------------------
# Part 2: the data-parallel step
# --------------------------------------------------------------------------
class CountCollectives:
    """Counts torch.distributed data collectives (and bytes) while active, by patching the module."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "all_to_all_single", "batch_isend_irecv")

    def __init__(self, control_group=None):
        import torch.distributed as dist

        self.dist, self.control = dist, control_group
        self.calls, self.bytes, self._saved = {}, 0, {}
        self._inside = 0  # > 0 inside a patched torch.distributed call (its own pg.allreduce is not counted again)

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(self.dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kw):
                group = kw.get("group")
                if group is None or group is not self.control:  # shmap's signature checks are not data
                    t = args[0] if _name == "all_reduce" else (args[1] if len(args) > 1 else None)
                    if isinstance(t, torch.Tensor):
                        self.calls[_name] = self.calls.get(_name, 0) + 1
                        self.bytes += t.numel() * t.element_size()
                self._inside += 1
                try:
                    return _fn(*args, **kw)
                finally:
                    self._inside -= 1
            setattr(self.dist, name, wrapper)
        # shmap launches its all_reduces on the process group itself (transports._pg_all_reduce)
        pg_class = self.dist.ProcessGroup
        self._pg_allreduce = pg_class.__dict__["allreduce"]  # (the class attribute itself, to put back)
        real = pg_class.allreduce

        def pg_allreduce(pg, tensors, *args, **kw):
            if pg is not self.control and not self._inside:
                self.calls["all_reduce"] = self.calls.get("all_reduce", 0) + 1
                self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            return real(pg, tensors, *args, **kw)
        pg_class.allreduce = pg_allreduce
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self.dist, name, fn)
        self.dist.ProcessGroup.allreduce = self._pg_allreduce


def dp_worker(d_in, d_hidden, batch_per_rank, steps):
    import warnings

    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    from shmap.backends import watchdog

    warnings.filterwarnings("ignore")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = shmap.make_mesh((world,), ("i",))
    torch.manual_seed(0)
    x = torch.randn(batch_per_rank * world, d_in)
    y = torch.randn(batch_per_rank * world, 1)
    w1 = torch.randn(d_in, d_hidden) / d_in ** 0.5
    w2 = torch.randn(d_hidden, 1) / d_hidden ** 0.5
    n = x.shape[0]

    def local_loss(xb, yb, a, b):
        return ((torch.relu(xb @ a) @ b - yb) ** 2).sum() / n

    def fresh():
        """New leaves for the weights (every variant starts from the same values)."""
        return w1.clone().requires_grad_(), w2.clone().requires_grad_()

    # The truth: one process, the whole batch.
    a0, b0 = fresh()
    local_loss(x, y, a0, b0).backward()
    true = (a0.grad, b0.grad)

    def rel_err(g, t):
        return ((g - t).norm() / t.norm()).item()

    out = {}

    # shmap: the batch is split over 'i', the weights are replicated (P()).
    step = shmap.shard_map(lambda xb, yb, a, b: shmap.psum(local_loss(xb, yb, a, b), "i"), mesh=mesh,
                           in_specs=(P("i"), P("i"), P(), P()), out_specs=P())
    a, b = fresh()
    loss = step(x, y, a, b).full_tensor()
    with shmap.comm_log() as log, CountCollectives(watchdog.watch().control) as cnt:
        loss.backward()
    out["shmap"] = dict(calls=cnt.calls, bytes=cnt.bytes, log=log.summary(), log_bytes=log.total_bytes,
                        err=max(rel_err(a.grad, true[0]), rel_err(b.grad, true[1])),
                        ratio=(a.grad.norm() / true[0].norm()).item())

    # shmap with DDP's communication: each rank keeps its shard's share of the loss (out_specs P("i"));
    # the backward's psum of the replicated weights' gradients is then the step's only collective.
    shares = shmap.shard_map(lambda xb, yb, a, b: local_loss(xb, yb, a, b).reshape(1), mesh=mesh,
                             in_specs=(P("i"), P("i"), P(), P()), out_specs=P("i"))

    def shares_step(a, b):
        shares(x, y, a, b).to_local().sum().backward()

    a, b = fresh()
    with shmap.comm_log() as log, CountCollectives(watchdog.watch().control) as cnt:
        shares_step(a, b)
    out["shmap shares"] = dict(calls=cnt.calls, bytes=cnt.bytes, log=log.summary(), log_bytes=log.total_bytes,
                               err=max(rel_err(a.grad, true[0]), rel_err(b.grad, true[1])),
                               ratio=(a.grad.norm() / true[0].norm()).item())

    # torch.distributed.nn: every rank all-reduces its shard's loss into the same global loss.
    lo, hi = rank * batch_per_rank, (rank + 1) * batch_per_rank
    a, b = fresh()
    loss = dnn.all_reduce(local_loss(x[lo:hi], y[lo:hi], a, b))
    with CountCollectives() as cnt:
        loss.backward()
    out["tdnn"] = dict(calls=dict(cnt.calls), bytes=cnt.bytes,
                       err=max(rel_err(a.grad, true[0]), rel_err(b.grad, true[1])),
                       ratio=(a.grad.norm() / true[0].norm()).item())
    # ... and the usual fix-up: all-reduce the replicated weights' gradients (DDP-style).
    with CountCollectives() as cnt2:
        for p in (a, b):
            dist.all_reduce(p.grad)
    calls = dict(out["tdnn"]["calls"])
    for k, v in cnt2.calls.items():
        calls[k] = calls.get(k, 0) + v
    out["tdnn+ddp"] = dict(calls=calls, bytes=out["tdnn"]["bytes"] + cnt2.bytes,
                           err=max(rel_err(a.grad, true[0]), rel_err(b.grad, true[1])),
                           ratio=(a.grad.norm() / true[0].norm()).item())

    # DDP: the same MLP as a module; each rank's loss is its shard's share scaled by the world size, so
    # DDP's averaged gradient is the global loss's.
    model = torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(d_hidden, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w1.T)
        model[2].weight.copy_(w2.T)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    xs, ys = x[lo:hi].contiguous(), y[lo:hi].contiguous()

    def ddp_step():
        ddp.zero_grad(set_to_none=True)
        (((ddp(xs) - ys) ** 2).sum() * (world / n)).backward()

    ddp_step()
    out["ddp"] = dict(err=max(rel_err(model[0].weight.grad.T, true[0]), rel_err(model[2].weight.grad.T, true[1])))

    # Step time (forward + backward), the variants interleaved in rotating order, each after a barrier
    # (the first of a round pays for memory the others then reuse; rotating spreads that alike).
    def shmap_step(checks):
        shmap.configure_distributed(check_collectives=checks)
        a, b = fresh()
        return lambda: step(x, y, a, b).full_tensor().backward()

    # ... and the same step jitted (`shmap.jit`: captured once, compiled by Inductor, replayed with none of
    # the body's Python; the guard's checks run inside the replay)
    jitted = shmap.jit(lambda x, y, a, b: shares(x, y, a, b).to_local())

    def jit_run():
        a, b = fresh()
        return lambda: jitted(x, y, a, b).sum().backward()

    from torch.profiler import ProfilerActivity, profile

    a, b = fresh()
    jitted(x, y, a, b).sum().backward()  # (the capture)
    a, b = fresh()
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # (a replay's collectives run inside graph
        jitted(x, y, a, b).sum().backward()                   # ops: counted as gloo operations)
    gloo = {e.key[5:]: e.count for e in prof.key_averages() if e.key.startswith("gloo:")}
    gloo.pop("barrier", None)
    out["shares jit"] = dict(calls=gloo, bytes=None, err=max(rel_err(a.grad, true[0]), rel_err(b.grad, true[1])),
                             ratio=(a.grad.norm() / true[0].norm()).item())

    def shares_run(checks=True):
        shmap.configure_distributed(check_collectives=checks)
        a, b = fresh()
        return lambda: shares_step(a, b)

    def tdnn_run():
        a, b = fresh()

        def run():
            dnn.all_reduce(local_loss(x[lo:hi], y[lo:hi], a, b)).backward()
            for p in (a, b):
                dist.all_reduce(p.grad)
        return run

    prepare = {"shmap": lambda: shmap_step(True), "shmap (checks off)": lambda: shmap_step(False),
               "shmap shares": shares_run, "shares (checks off)": lambda: shares_run(False), "ddp": lambda: ddp_step,
               "tdnn+ddp": tdnn_run, "shares jit": jit_run}
    names = list(prepare)
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}
    for i in range(steps):
        for key in names[i % len(names):] + names[:i % len(names)]:
            run = prepare[key]()  # fresh leaves (untimed)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            run()
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.thread_time() - c0)  # the main thread's Python and kernels, not its waits
    shmap.configure_distributed(check_collectives=True)
    out["times"] = {k: statistics.median(v) for k, v in times.items()}
    out["cpu"] = {k: statistics.median(v) for k, v in cpu.items()}
    out["ratios"] = {k: statistics.median(a / b for a, b in zip(v, times["ddp"])) for k, v in times.items()}
    return out


# --------------------------------------------------------------------------
def _us(t):
    return f"{t * 1e6:9.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--skip-part1", action="store_true", help="only part 2 (the data-parallel step)")
    ap.add_argument("--sizes", default="4 KiB,1 MiB,16 MiB", help="Part 1 block sizes, from: 4 KiB,1 MiB,16 MiB")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"torch {torch.__version__}, gloo on {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f} at start).\n")
    print("Part 1: one collective on each device's block; microseconds per call (median; the five variants")
    print("  alternate call by call in rotating order, each call after a barrier, so the machine's load hits each alike).")
    print("  raw: torch.distributed in place on preallocated buffers; raw+alloc: the same call writing a fresh")
    print("  output (a clone for all_reduce), as any functional API must; shmap in a shard_map body: default")
    print("  (mismatch + hang checks on, signature in the payload), off (check_collectives=False), strict")
    print("  (a signature exchange first). Ratios are to raw+alloc.")
    head = (f"{'world':>5} {'size':>7} {'collective':>13} {'raw':>9} {'raw+alloc':>9} {'default':>9} "
            f"{'/alloc':>6} {'off':>9} {'/alloc':>6} {'strict':>9} {'/alloc':>6}")
    print(head)
    print("-" * len(head))
    for world in ([] if args.skip_part1 else worlds):
        sizes = [sz for sz in SIZES if sz[1] in args.sizes.split(",")]
        res = shmap.spawn(collective_worker, sizes, args.quick, nprocs=world, timeout=600)[0]
        for (label, name), t in res.items():
            a, q = t["raw+alloc"], t["ratio"]
            print(f"{world:>5} {label:>7} {name:>13} {_us(t['raw'])} {_us(a)} {_us(t['default'])} "
                  f"{q['default']:6.2f} {_us(t['off'])} {q['off']:6.2f} {_us(t['strict'])} {q['strict']:6.2f}")
    print("\nPart 2: data-parallel loss/grad step (MLP 512-512-1, 64 rows per rank); every rank computes the "
          "same global loss.")
    print("Backward-pass torch.distributed collectives and bytes; gradient error vs the single-process "
          "gradient (relative; |grad|/|true| in brackets).")
    for world in worlds:
        r = shmap.spawn(dp_worker, 512, 512, 64, 10 if args.quick else 200, nprocs=world, timeout=300)[0]
        print(f"\n  world {world}:")
        for key, what in (("shmap", "shmap (psum of the loss; pvary'd weights)"),
                          ("shmap shares", "shmap, per-rank loss shares (DDP's communication)"),
                          ("shares jit", "  ... jitted (a replay)"),
                          ("tdnn", "torch.distributed.nn.functional.all_reduce"),
                          ("tdnn+ddp", "  ... + all_reduce of each weight's gradient")):
            v = r[key]
            n = sum(v["calls"].values())
            nbytes = "  (gloo)" if v["bytes"] is None else f"{v['bytes']:>8}"
            print(f"    {what:<48} {n} collectives {v['calls']}, {nbytes} bytes; "
                  f"grad error {v['err']:.2e} (x{v['ratio']:.2f})")
        s, t = r["shmap"], r["tdnn+ddp"]
        print(f"    shmap's comm_log agrees: {s['log']} , {s['log_bytes']} bytes")
        print(f"    shmap saves {sum(t['calls'].values()) - sum(s['calls'].values())} collective(s) and "
              f"{t['bytes'] - s['bytes']} bytes per step vs the torch.distributed.nn version, whose gradient is "
              f"x{t['ratio']:.2f} (world size {world}) once all-reduced, and unsynchronised before.")
        print(f"    DistributedDataParallel: grad error {r['ddp']['err']:.2e}")
        tm, q = r["times"], r["ratios"]
        print(f"    step time (median; ratios are medians of per-step ratios): shmap (default) "
              f"{tm['shmap'] * 1e3:.2f} ms = x{q['shmap']:.2f} DDP, checks off {tm['shmap (checks off)'] * 1e3:.2f} ms "
              f"= x{q['shmap (checks off)']:.2f}, DDP {tm['ddp'] * 1e3:.2f} ms, torch.distributed.nn+all_reduce "
              f"{tm['tdnn+ddp'] * 1e3:.2f} ms = x{q['tdnn+ddp']:.2f}")
        print(f"    with DDP's communication (per-rank loss shares: one all_reduce, as DDP; default checks): "
              f"{tm['shmap shares'] * 1e3:.2f} ms = x{q['shmap shares']:.2f} DDP; checks off "
              f"{tm['shares (checks off)'] * 1e3:.2f} ms = x{q['shares (checks off)']:.2f} (what the guard costs: "
              f"the difference)")
        print(f"    the same step jitted (shmap.jit: Inductor's code replayed, default checks inside): "
              f"{tm['shares jit'] * 1e3:.2f} ms = x{q['shares jit']:.2f} DDP")
        c = r["cpu"]
        print(f"    main-thread CPU per step (rank 0; steadier than wall time on a busy machine): shares "
              f"{c['shmap shares'] * 1e3:.2f} ms = x{c['shmap shares'] / c['ddp']:.2f} DDP's {c['ddp'] * 1e3:.2f} ms; "
              f"shares with checks off {c['shares (checks off)'] * 1e3:.2f} ms; jitted {c['shares jit'] * 1e3:.2f} ms; "
              f"default {c['shmap'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
