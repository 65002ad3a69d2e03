#!/usr/bin/env python
"""The training recipe (shmap.train) against plain PyTorch, DDP and FSDP2, side by side.

    .venv/bin/python bench/bench_train.py            # default model (Config(): 4 layers, d=128, ...)
    .venv/bin/python bench/bench_train.py --small    # a quick run on a smaller model
    python bench/bench_train.py --device cuda --large --worlds ""   # part 1 on a GPU

Part 1, simulated (one process, 8 simulated devices): `Run.step` (loss, grad,
clip, Adam) on `fsdp=2,tensor=4` vs `--mesh none` (the same functions without
shard_map: the reference and the speed limit), and `data=8`, `fsdp=8` for
reference.  Goal: fsdp=2,tensor=4 <= 1.2x the plain step.

Part 2, on 2 and 4 gloo processes (`shmap.spawn`, localhost): shmap `data=N`
vs `torch.nn.parallel.DistributedDataParallel`, and shmap `fsdp=N` vs FSDP2
(`torch.distributed.fsdp.fully_shard`), the same model (the recipe's
`model.forward` with `Layout(None)` on parameters held in an `nn.Module`),
the same init, the same per-rank rows of the same batches, global-norm
clipping and `torch.optim.Adam` with the recipe's schedule.  Tokens/s and
shmap / baseline.  Goal: >= 1.0x.

`--compile`: Part 2 with every variant's loss (forward and backward) and
update (clipping and Adam) compiled by Inductor (shmap: `shmap-train
--compile`; DDP and FSDP2: `torch.compile` of the module and of
`clip_grad_norm_` + `Adam.step`, whose learning rate is then a tensor).

Part 3, memory per process: bytes of parameters + Adam state each rank holds
(`DTensor.to_local()` sizes; exact), and the peak RSS growth over two steps
of a fresh process per variant (`ru_maxrss`).  FSDP should hold about 1/N.

Part 4, MFU: model FLOPs per step / step time, against a float32 matmul peak
measured in this run (interleaved with part 1, same thread count).

Every comparison is interleaved (A, B, A, B, ... in rotating order, each step
after a barrier on gloo) and reported as medians; a ratio is the median of the
per-round ratios, so drifts in the machine's load cancel.  The load average is
printed; on a shared machine compare ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optree  # noqa: E402
import torch  # noqa: E402

import shmap  # noqa: E402
from shmap.train import model, optim  # noqa: E402
from shmap.train.config import Config, validate  # noqa: E402
from shmap.train.loop import Run, _value, keep_freed_memory  # noqa: E402

SMALL = dict(layers=2, embed_dim=64, heads=4, mlp_dim=256, seq_len=64, batch_size=16)
#: for an accelerator (--device cuda): the default model is too small to keep a GPU busy
LARGE = dict(layers=8, embed_dim=512, heads=8, mlp_dim=2048, seq_len=256, batch_size=32)
SIZES = {"small": SMALL, "default": {}, "large": LARGE}
QUIET = dict(out=None, progress=False, sample_len=0, eval_batches=1)


def make_cfg(size: str, mesh, device: str = "cpu") -> Config:
    return validate(Config(mesh=mesh, device=device, **QUIET, **SIZES[size]))


# --------------------------------------------------------------------------
# FLOPs, sizes, the matmul peak
# --------------------------------------------------------------------------
def model_flops(cfg: Config) -> tuple[float, int]:
    """(FLOPs of one training step, matmul parameters N).

    6 * N * tokens + 12 * layers * batch * seq^2 * d: N counts the parameters
    that take part in a matmul (qkv, attention out, MLP in/out, output kernel;
    not the embedding/position lookups or the norms), 2 FLOPs a multiply-add,
    backward twice the forward; attention's q.k and p.v are 4 * b * s^2 * d
    forward, counted in full (no causal discount, as PaLM's MFU).
    """
    d, m, L, v = cfg.embed_dim, cfg.mlp_dim, cfg.layers, cfg.vocab_size
    n_matmul = L * (3 * d * d + d * d + 2 * d * m) + d * v
    tokens = cfg.batch_size * cfg.seq_len
    return 6.0 * n_matmul * tokens + 12.0 * L * cfg.batch_size * cfg.seq_len ** 2 * d, n_matmul


def matmul_gflops(n=1024, reps=3, device="cpu") -> float:
    """GFLOP/s of an n x n float32 matmul (best of `reps`) with the current thread count (or on `device`)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def local_bytes(tree) -> int:
    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    return sum(nbytes(t) for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def _median_ratio(a, b):
    return statistics.median(x / y for x, y in zip(a, b))


# --------------------------------------------------------------------------
# Part 1: simulated
# --------------------------------------------------------------------------
SIM_MESHES = [("none", None), ("fsdp=2,tensor=4", {"fsdp": 2, "tensor": 4}), ("data=8", {"data": 8}),
              ("fsdp=8", {"fsdp": 8})]


def simulated(args):
    states = {}
    for name, mesh in SIM_MESHES:
        run = Run(make_cfg(args.size, mesh, args.device))
        params, opt = run.fresh_state()
        states[name] = [run, params, opt]
    names = list(states)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    peaks = []
    for r in range(args.warmup + args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            run, params, opt = states[n]
            gc.collect()
            t0 = time.perf_counter()
            params, opt, metrics = run.step(params, opt, r)
            loss = _value(metrics["train_loss"])  # the step is done when its loss is read
            dt = time.perf_counter() - t0
            states[n][1:] = [params, opt]
            losses[n].append(loss)
            if r >= args.warmup:
                times[n].append(dt)
        if r >= args.warmup:
            peaks.append(matmul_gflops(device=args.device))
    return times, losses, peaks


# --------------------------------------------------------------------------
# Part 2: gloo processes
# --------------------------------------------------------------------------
class PlainModel(torch.nn.Module):
    """The recipe's model as an nn.Module: its parameters in a ParameterDict, its forward the recipe's
    `model.loss_fn` with `Layout(None)` (plain PyTorch, no collectives)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.layout = model.Layout(None)
        self.specs = model.param_specs(cfg, self.layout)
        init = model.init_params(cfg)
        paths, leaves, self.treedef = optree.tree_flatten_with_path(init)
        self.keys = ["__".join(p) for p in paths]
        self.flat = torch.nn.ParameterDict({k: torch.nn.Parameter(t.clone()) for k, t in zip(self.keys, leaves)})

    def forward(self, tokens):
        params = optree.tree_unflatten(self.treedef, [self.flat[k] for k in self.keys])
        return model.loss_fn(self.cfg, self.layout, self.specs, params, tokens)


def _baseline(cfg: Config, kind: str, compile_: bool = False):
    import torch.distributed as dist

    net = PlainModel(cfg)
    if kind == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit at the root: the recipe's forward is one function over every layer, so
        # per-layer units (whose hooks fire on each submodule's forward) have nothing to hook.
        fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    # --compile, as shmap-train --compile: the loss (forward and backward) and the update (clipping and
    # Adam) compiled.  A learning rate that changes every step must then be a tensor (a float is a
    # recompile per step), which foreach Adam takes only with capturable=True.
    lr = torch.tensor(cfg.lr, dtype=torch.float64) if compile_ else cfg.lr
    opt = torch.optim.Adam(net.parameters(), lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                           capturable=compile_)
    run = torch.compile(net) if compile_ else net

    def update():
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.clip)
        opt.step()

    update_ = torch.compile(update) if compile_ else update

    def step(tokens, k):
        opt.zero_grad(set_to_none=True)
        loss = run(tokens)
        loss.backward()
        for g in opt.param_groups:
            if compile_:
                g["lr"].fill_(optim.learning_rate(cfg, k))
            else:
                g["lr"] = optim.learning_rate(cfg, k)
        update_()
        return loss.detach()

    def state_bytes():
        return local_bytes(list(net.parameters())) + local_bytes(
            [t for s in opt.state.values() for t in s.values()])

    return step, state_bytes


def _variants(size: str, world: int, which, compile_: bool = False):
    """name -> (step(k) -> loss value, state_bytes()) on this rank (`compile_`: every variant's loss compiled)."""
    import torch.distributed as dist

    out = {}
    data_run = None
    for name in which:
        if name.startswith("shmap"):
            mesh = {"data": world} if name == "shmap data" else {"fsdp": world}
            run = Run(dataclasses.replace(make_cfg(size, mesh), compile=compile_))
            data_run = data_run or run
            params, opt = run.fresh_state()
            st = {"p": params, "o": opt}

            def step(k, run=run, st=st):
                st["p"], st["o"], m = run.step(st["p"], st["o"], k)
                return _value(m["train_loss"])

            out[name] = (step, lambda st=st: local_bytes(st["p"]) + local_bytes(st["o"]))
        else:
            cfg = make_cfg(size, {"data": world})  # batch and schedule as data=N
            data_run = data_run or Run(cfg)
            base, sb = _baseline(cfg, "ddp" if name == "DDP" else "fsdp2", compile_)
            rank = dist.get_rank()
            per = cfg.batch_size // world
            rows = range(rank * per, (rank + 1) * per)  # the rows shmap's data=N / fsdp=N read here
            corpus = data_run.corpus

            def step(k, base=base, cfg=cfg, rows=rows, corpus=corpus):
                return float(base(corpus.train_batch(cfg.seed, k, cfg.batch_size, rows), k))

            out[name] = (step, sb)
    return out


def _allocator():
    """As `shmap-train` runs (`keep_freed_memory`), unless --glibc-default: every variant alike."""
    if os.environ.get("BENCH_KEEP_FREED", "1") == "1":
        keep_freed_memory()


def gloo_worker(size, warmup, repeats, threads, names, compile_=False):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    _allocator()
    world = dist.get_world_size()
    variants = _variants(size, world, names, compile_)
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    losses = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            gc.collect()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = variants[n][0](r)
            c1 = time.thread_time()  # this rank's main thread: its Python and kernels, no waiting
            dist.barrier()  # the step is done when every rank is
            dt = time.perf_counter() - t0
            losses[n].append(loss)
            if r >= warmup:
                times[n].append(dt)
                cpu[n].append(c1 - c0)
    colls = {n: count_collectives(variants[n][0], warmup + repeats) for n in names}
    for n in names:  # a baseline's loss is its rank's rows' mean: average over the ranks (shmap's is global)
        if not n.startswith("shmap"):
            t = torch.tensor(losses[n], dtype=torch.float64)
            dist.all_reduce(t)
            losses[n] = (t / world).tolist()
    return {"times": times, "cpu": {n: statistics.median(v) for n, v in cpu.items()}, "losses": losses,
            "collectives": colls,
            "state_bytes": {n: v[1]() for n, v in variants.items()},
            "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def count_collectives(step, k):
    """The gloo operations of one step (count by kind, and ms inside them), from torch.profiler."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(k)
    kinds, ms = {}, 0.0
    for e in prof.key_averages():
        if e.key.startswith("gloo:"):
            kinds[e.key[5:]] = kinds.get(e.key[5:], 0) + e.count
            ms += e.cpu_time_total / 1e3
    return kinds, ms


def mem_worker(size, threads, name):
    """A fresh process: peak RSS growth over building one variant and running two steps."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    _allocator()
    import torch.distributed as dist

    Run(make_cfg(size, {"data": dist.get_world_size()}))  # corpus and imports: not the variant's
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    v = _variants(size, dist.get_world_size(), [name])[name]
    for k in range(2):
        v[0](k)
    return {"rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "state_bytes": v[1]()}


# --------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help=f"a smaller model for a quick run: {SMALL}")
    ap.add_argument("--large", action="store_true", help=f"a larger model (for --device cuda): {LARGE}")
    ap.add_argument("--repeats", type=int, default=8, help="timed steps per variant (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    ap.add_argument("--worlds", default="2,4", help="gloo world sizes (default 2,4; '' skips part 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads in every process (default 1: stable on a shared 2-core box)")
    ap.add_argument("--no-checks", action="store_true",
                    help="shmap's per-collective signature checks off on gloo (SHMAP_CHECK_COLLECTIVES=0; default on)")
    ap.add_argument("--no-memory", action="store_true", help="skip part 3's fresh-process RSS runs")
    ap.add_argument("--skip-sim", action="store_true", help="skip part 1")
    ap.add_argument("--device", default="cpu",
                    help="part 1 on this torch device (shmap-train --device; e.g. cuda: the simulated mesh on one GPU, "
                         "and the matmul peak measured there); parts 2-4 stay gloo on the CPU")
    ap.add_argument("--compile", action="store_true",
                    help="part 2 with every variant's loss and update compiled (shmap-train --compile; torch.compile "
                         "of the DDP / FSDP2 module and its optimizer step); the warm-up steps absorb the compilation")
    ap.add_argument("--glibc-default", action="store_true",
                    help="leave glibc's malloc trimming as it is (default: keep freed memory, as shmap-train does)")
    args = ap.parse_args()
    args.size = "small" if args.small else "large" if args.large else "default"
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["BENCH_KEEP_FREED"] = "0" if args.glibc_default else "1"
    _allocator()
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    env = {"OMP_NUM_THREADS": args.threads, "SHMAP_CHECK_COLLECTIVES": 0 if args.no_checks else 1,
           "BENCH_KEEP_FREED": os.environ["BENCH_KEEP_FREED"]}
    cfg = make_cfg(args.size, None)
    flops, n_mm = model_flops(cfg)
    n_all = model.count_params(model.init_params(cfg))
    tokens = cfg.batch_size * cfg.seq_len
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {args.threads} torch thread(s) per process "
          f"(OMP_NUM_THREADS={args.threads}); load average {os.getloadavg()[0]:.1f} at start.")
    print(f"model: {cfg.layers} layers, d={cfg.embed_dim}, heads {cfg.heads}, mlp {cfg.mlp_dim}, seq {cfg.seq_len}, "
          f"batch {cfg.batch_size} ({tokens} tokens/step), {cfg.dtype}, block {cfg.block}; "
          f"{n_all / 1e6:.3f}M parameters ({n_mm / 1e6:.3f}M in matmuls).")
    print(f"FLOPs/step = 6*N_matmul*tokens + 12*layers*batch*seq^2*d = {flops / 1e9:.2f} GFLOP.")
    memory = ("leaves glibc's malloc as it is" if args.glibc_default
              else "keeps freed memory, as shmap-train does (keep_freed_memory)")
    print(f"{args.warmup} warm-up + {args.repeats} timed steps per variant, interleaved; medians. Every process "
          f"{memory}.\n")

    peak = None
    if not args.skip_sim:
        times, losses, peaks = simulated(args)
        peak = statistics.median(peaks)
        base = times["none"]
        print(f"Part 1: simulated mesh (one process, --device {args.device}), Run.step = loss + grad + clip + Adam")
        head = (f"  {'mesh':<16} {'ms/step':>9} {'tokens/s':>9} {'/ none':>7} {'GFLOP/s':>8} {'MFU':>6} "
                f"{'loss@last':>10}")
        print(head)
        print("  " + "-" * (len(head) - 2))
        for n in times:
            t = statistics.median(times[n])
            ratio = _median_ratio(times[n], base)
            print(f"  {n:<16} {t * 1e3:9.0f} {tokens / t:9.0f} {ratio:6.2f}x {flops / t / 1e9:8.2f} "
                  f"{flops / t / 1e9 / peak:6.1%} {losses[n][-1]:10.6f}")
        dev = max(abs(losses[n][i] - losses["none"][i]) for n in losses for i in range(len(losses[n])))
        where = args.device if args.device != "cpu" else f"{args.threads} thread(s)"
        print(f"  matmul peak (1024x1024 float32, {where}, median of {len(peaks)} rounds "
              f"interleaved with the steps): {peak:.1f} GFLOP/s")
        print(f"  every mesh's losses equal --mesh none's to {dev:.1e} over all {len(losses['none'])} steps")
        r = _median_ratio(times["fsdp=2,tensor=4"], base)
        print(f"  goal fsdp=2,tensor=4 <= 1.2x none: {r:.2f}x -> {'met' if r <= 1.2 else 'MISSED'} "
              f"(load {os.getloadavg()[0]:.1f})\n")
    if peak is None:
        peak = statistics.median(matmul_gflops() for _ in range(3))

    if worlds:
        names = ["shmap data", "DDP", "shmap fsdp", "FSDP2"]
        print("Part 2: gloo processes (shmap.spawn, localhost); global batch split over the ranks; a step is "
              "barrier .. step .. barrier")
        print(f"  DDP: DistributedDataParallel; FSDP2: fully_shard at the root (one unit); both torch.optim.Adam "
              f"(torch's default implementation, on CPU tensors its per-tensor loop) + clip_grad_norm_({cfg.clip}).")
        print(f"  shmap's collective signature checks: {'off' if args.no_checks else 'on (the default)'}.")
        if args.compile:
            print("  --compile: every variant's loss (forward and backward) and update (clipping, Adam) torch.compile'd "
                  "(Inductor): shmap-train --compile; torch.compile of the DDP / FSDP2 module and of clip_grad_norm_ + "
                  "Adam.step (capturable=True, a tensor lr).")
        print("  MFU: FLOPs/step / step time / (matmul peak x min(ranks x threads, cores)).  CPU: the main thread's CPU\n"
              "  time in a step (median over ranks and steps): its Python and kernels, not its waits; with more ranks\n"
              "  than cores, it is what sets the throughput.")
        head = (f"  {'N':>2} {'variant':<11} {'ms/step':>9} {'CPU ms':>7} {'tokens/s':>9} {'shmap/base':>10} "
                f"{'MFU':>6} {'loss@0':>9} {'loss@last':>10}  gloo ops in one step (ms inside them, rank 0)")
        print(head)
        print("  " + "-" * (len(head) - 2))
        results = {}
        for w in worlds:
            res = shmap.spawn(gloo_worker, args.size, args.warmup, args.repeats, args.threads, names, args.compile,
                              nprocs=w, timeout=600, env=env)
            results[w] = res
            tm = res[0]["times"]
            cores = min(w * args.threads, os.cpu_count())
            goals = []
            for n in names:
                t = statistics.median(tm[n])
                pair = {"shmap data": "DDP", "shmap fsdp": "FSDP2"}.get(n)
                ratio = f"{_median_ratio(tm[pair], tm[n]):9.2f}x" if pair else ""
                if pair:
                    goals.append(f"{n} {_median_ratio(tm[pair], tm[n]):.2f}x")
                ls = res[0]["losses"][n]
                kinds, ms = res[0]["collectives"][n]
                desc = " ".join(f"{v}x{k}" for k, v in sorted(kinds.items()))
                c = statistics.median(r["cpu"][n] for r in res)
                print(f"  {w:>2} {n:<11} {t * 1e3:9.0f} {c * 1e3:7.0f} {tokens / t:9.0f} {ratio:>10} "
                      f"{flops / t / 1e9 / (peak * cores):6.1%} {ls[0]:9.5f} {ls[-1]:10.6f}  {desc} ({ms:.0f} ms)")
            print(f"     shmap/base = tokens/s shmap / baseline (median per-round time baseline / shmap); "
                  f"goal >= 1.0x: {', '.join(goals)}; load {os.getloadavg()[0]:.1f}")

        print("\nPart 3: memory per rank: parameters + Adam state (mu, nu / exp_avg, exp_avg_sq) held, exact")
        full = n_all * 4 * 3
        head = f"  {'N':>2} " + " ".join(f"{n:>13}" for n in names) + "   (bytes; unsharded params+mu+nu = " \
            f"{full})"
        print(head)
        for w, res in results.items():
            row = " ".join(f"{res[0]['state_bytes'][n]:>13}" for n in names)
            print(f"  {w:>2} {row}")
            for n in ("shmap fsdp", "FSDP2"):
                held = [r["state_bytes"][n] for r in res]
                print(f"     {n}: per rank {held}, {max(held) / full:.3f} of the whole (1/N = {1 / w:.3f})")
            print(f"     peak RSS per rank (whole process, all four variants): "
                  f"{[r['maxrss_kb'] // 1024 for r in res]} MiB")
        if not args.no_memory:
            print("  Peak RSS growth in a fresh process per variant (build + 2 steps; ru_maxrss, MiB per rank):")
            for w in worlds:
                for n in ("shmap data", "shmap fsdp"):
                    r = shmap.spawn(mem_worker, args.size, args.threads, n, nprocs=w, timeout=600,
                                    env=env)
                    print(f"  {w:>2} {n:<11} RSS +{[round(x['rss_kb'] / 1024, 1) for x in r]} MiB, "
                          f"params+opt {[x['state_bytes'] for x in r]} bytes")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.1f} at the end.")


if __name__ == "__main__":
    main()
