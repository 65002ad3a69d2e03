#!/usr/bin/env python
"""Where an eager step's time goes on the distributed mesh, item by item, against plain torch.

    .venv/bin/python bench/bench_eager.py               # 2 gloo processes (about 1 minute)
    .venv/bin/python bench/bench_eager.py --world 4 --quick

An eager shard_map body runs each torch call through `ShTensor.__torch_function__`
(its type rule, the automatic pvary, a new typed value) and crosses the boundary
once per argument and output; what this adds to a step is a count times a unit
cost.  Part 1 measures the unit costs, each beside the same plain torch calls on
this rank's block in the same run: an elementwise op (the fast path), an op
through the general dispatch, an op that lifts an invariant weight (an autograd
node whose backward is a psum), a DTensor argument in and an output out, and a
backward node.  Part 2 splits the training recipe's step (`shmap-train --mesh
data=N`, the default model) into forward, backward and update against
DistributedDataParallel and torch.optim.Adam on the same rows, counts the typed
calls and boundary crossings of each shmap phase, and prints what the unit costs
account for.  Times are main-thread CPU (`time.thread_time`) of rank 0, medians
of interleaved repetitions: the Python shmap adds is CPU, and CPU time is steadier
than wall time on a busy machine.  (Wall-time ratios: `bench_distributed.py`,
`bench_train.py`.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import shmap  # noqa: E402
from shmap import P  # noqa: E402


def _cpu(fns: dict, reps: int) -> dict:
    """name -> median main-thread CPU seconds of fns[name](), the variants interleaved in rotating order."""
    import torch.distributed as dist

    names = list(fns)
    out = {k: [] for k in names}
    for i in range(reps):
        for k in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            c0 = time.thread_time()
            fns[k]()
            out[k].append(time.thread_time() - c0)
    return {k: statistics.median(v) for k, v in out.items()}


# --------------------------------------------------------------------------
# Part 1: unit costs
# --------------------------------------------------------------------------
def units_worker(k: int, reps: int) -> dict:
    """Main-thread CPU of bodies with k and with 2k items of each kind, and of the same torch calls on
    the plain block: an item costs (t(2k) - t(k)) / k, so the call's fixed costs cancel."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = shmap.make_mesh((world,), ("i",))
    torch.manual_seed(0)
    x = torch.randn(world * 8, 32)
    xg = x.clone().requires_grad_()
    block = x[:8]
    ws = [torch.randn(32, 32, requires_grad=True) for _ in range(2 * k)]
    leaves = [shmap.device_put(torch.randn(8, 8), mesh, P()) for _ in range(2 * k)]
    weights = [shmap.device_put(torch.randn(8, 8), mesh, P()).requires_grad_() for _ in range(2 * k)]
    row = lambda t: t[:1, 0].reshape(1)  # noqa: E731  (a one-element output)
    kinds = {
        "elementwise": lambda t, w, j: t * 1.0001,  # the fast path
        "general": lambda t, w, j: t.softmax(-1),  # the general dispatch (no lift)
        "lifted": lambda t, w, j: t @ w[j],  # an automatic pvary of an invariant weight
    }

    def chain(step, n):
        def body(t, *w):
            for j in range(n):
                t = step(t, w, j)
            return row(t)
        return body

    fns = {}
    for n in (k, 2 * k):
        for kind, step in kinds.items():
            n_w = 2 * k if kind == "lifted" else 0  # (every call takes all 2k weights: their entry cancels)
            f = shmap.shard_map(chain(step, n), mesh=mesh, in_specs=(P("i"),) + (P(),) * n_w, out_specs=P("i"))
            plain = chain(step, n)
            fns[f"{kind} {n}"] = lambda f=f, n_w=n_w: f(x, *ws[:n_w])
            fns[f"plain {kind} {n}"] = lambda plain=plain, n_w=n_w: plain(block, *ws[:n_w])
        grad = shmap.shard_map(chain(kinds["elementwise"], n), mesh=mesh, in_specs=(P("i"),), out_specs=P("i"))
        plain = chain(kinds["elementwise"], n)
        fns[f"backward {n}"] = lambda grad=grad: grad(xg).to_local().sum().backward()
        fns[f"plain backward {n}"] = lambda plain=plain: plain(block.clone().requires_grad_()).sum().backward()
        first = shmap.shard_map(lambda ls: ls[0], mesh=mesh, in_specs=(P(),), out_specs=P())
        ident = shmap.shard_map(lambda ls: ls, mesh=mesh, in_specs=(P(),), out_specs=P())
        fns[f"args in {n}"] = lambda first=first, n=n: first(leaves[:n])
        fns[f"args in+out {n}"] = lambda ident=ident, n=n: ident(leaves[:n])
        fns[f"grad args in {n}"] = lambda first=first, n=n: first(weights[:n])  # (a step's weights)
    t = _cpu(fns, reps)
    return t


def report_units(t: dict, k: int) -> dict:
    """Per-item costs (seconds): shmap's, plain torch's, and the difference."""
    def item(name):
        return (t[f"{name} {2 * k}"] - t[f"{name} {k}"]) / k

    per = {
        "elementwise op (fast path)": (item("elementwise"), item("plain elementwise")),
        "op through the general dispatch": (item("general"), item("plain general")),
        "op lifting an invariant weight": (item("lifted"), item("plain lifted")),
        "elementwise op, forward+backward": (item("backward"), item("plain backward")),
        "DTensor argument in": (item("args in"), 0.0),
        "DTensor argument in, requires grad": (item("grad args in"), 0.0),
        "output out (a DTensor)": (item("args in+out") - item("args in"), 0.0),
    }
    print(f"{'item':<34} {'shmap us':>9} {'plain us':>9} {'added us':>9}")
    for name, (s, p) in per.items():
        print(f"{name:<34} {s * 1e6:9.1f} {p * 1e6:9.1f} {(s - p) * 1e6:9.1f}")
    return {name: s - p for name, (s, p) in per.items()}


# --------------------------------------------------------------------------
# Part 2: the recipe's step, phase by phase
# --------------------------------------------------------------------------
def recipe_worker(steps: int) -> dict:
    import warnings

    import bench_train as bt
    import optree
    import torch.distributed as dist

    from shmap import tensor as sht
    from shmap.train import model, optim
    from shmap.train.loop import Run, _value, keep_freed_memory

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    keep_freed_memory()
    world, rank = dist.get_world_size(), dist.get_rank()
    run = Run(bt.make_cfg("default", {"data": world}))
    cfg = run.cfg
    state = dict(zip(("p", "o"), run.fresh_state()))
    net = torch.nn.parallel.DistributedDataParallel(bt.PlainModel(cfg))
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    per = cfg.batch_size // world
    rows = range(rank * per, (rank + 1) * per)
    phases = {f"{v} {p}": [] for v in ("shmap", "plain", "DDP") for p in ("forward", "backward", "update")}
    # plain: the recipe's own functions on this rank's rows and a copy of the weights, without shard_map and
    # without communication (what both frameworks add to)
    none = model.Layout(None)
    none_specs = model.param_specs(cfg, none)
    local = {"p": optree.tree_map(lambda t: t.to_local().clone(), state["p"])}
    local["o"] = optim.adam_init(local["p"])

    def shmap_step(k):
        c0 = time.thread_time()
        leaves, treedef = optree.tree_flatten(state["p"])
        for p in leaves:
            p.requires_grad_()
        loss = run.loss(state["p"], run.batch(k))
        c1 = time.thread_time()
        grads = optree.tree_unflatten(treedef, list(torch.autograd.grad(loss, leaves)))
        c2 = time.thread_time()
        scalars = optim.adam_scalars(cfg, k + 1, optim.learning_rate(cfg, k))
        with torch.no_grad():
            state["p"], state["o"], _ = run.update(state["p"], grads, state["o"], *scalars)
        _value(loss)
        c3 = time.thread_time()
        return c1 - c0, c2 - c1, c3 - c2

    def plain_step(k):
        c0 = time.thread_time()
        leaves, treedef = optree.tree_flatten(local["p"])
        for p in leaves:
            p.requires_grad_()
        loss = model.loss_fn(cfg, none, none_specs, local["p"], run.corpus.train_batch(cfg.seed, k, cfg.batch_size,
                                                                                     rows))
        c1 = time.thread_time()
        grads = optree.tree_unflatten(treedef, list(torch.autograd.grad(loss, leaves)))
        c2 = time.thread_time()
        scalars = optim.adam_scalars(cfg, k + 1, optim.learning_rate(cfg, k))
        with torch.no_grad():
            local["p"], local["o"], _ = optim.update(cfg, none_specs, local["p"], grads, local["o"], *scalars)
        float(loss)
        c3 = time.thread_time()
        return c1 - c0, c2 - c1, c3 - c2

    def ddp_step(k):
        c0 = time.thread_time()
        opt.zero_grad(set_to_none=True)
        loss = net(run.corpus.train_batch(cfg.seed, k, cfg.batch_size, rows))
        c1 = time.thread_time()
        loss.backward()
        c2 = time.thread_time()
        for g in opt.param_groups:
            g["lr"] = optim.learning_rate(cfg, k)
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.clip)
        opt.step()
        float(loss)
        c3 = time.thread_time()
        return c1 - c0, c2 - c1, c3 - c2

    variants = [("shmap", shmap_step), ("plain", plain_step), ("DDP", ddp_step)]
    for k in range(2):  # warm-up
        for _, f in variants:
            f(k)
    for k in range(2, 2 + steps):
        for name, f in variants[k % 3:] + variants[:k % 3]:
            dist.barrier()
            for phase, dt in zip(("forward", "backward", "update"), f(k)):
                phases[f"{name} {phase}"].append(dt)

    # Counts: typed calls (outermost __torch_function__) and boundary leaves per shmap phase.
    counts = {"forward": 0, "update": 0}
    depth, where = [0], ["forward"]
    inner = sht.ShTensor.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        if depth[0]:
            return inner(cls, func, types, args, kwargs)
        depth[0] += 1
        counts[where[0]] += 1
        try:
            return inner(cls, func, types, args, kwargs)
        finally:
            depth[0] -= 1

    lift_phys = sht._lift_phys

    def counting_lifts(*a):
        counts[where[0] + " lifts"] += 1
        return lift_phys(*a)

    counts["forward lifts"] = counts["update lifts"] = 0
    sht.ShTensor.__torch_function__ = classmethod(counting)
    sht._lift_phys = counting_lifts
    try:
        leaves, treedef = optree.tree_flatten(state["p"])
        for p in leaves:
            p.requires_grad_()
        loss = run.loss(state["p"], run.batch(0))
        grads = optree.tree_unflatten(treedef, list(torch.autograd.grad(loss, leaves)))
        where[0] = "update"
        with torch.no_grad():
            run.update(state["p"], grads, state["o"], *optim.adam_scalars(cfg, 1, cfg.lr))
    finally:
        sht.ShTensor.__torch_function__ = classmethod(inner)
        sht._lift_phys = lift_phys
    n = len(leaves)
    counts["forward args"], counts["update args"], counts["update outputs"] = n + 1, 4 * n, 3 * n + 1
    return {"phases": {k: statistics.median(v) for k, v in phases.items()}, "counts": counts}


def report_recipe(r: dict, unit: dict):
    ph, c = r["phases"], r["counts"]
    print("main-thread CPU ms per phase; plain: the recipe's functions on this rank's rows without shard_map "
          "or communication")
    print(f"{'phase':<10} {'shmap':>8} {'DDP':>8} {'plain':>8} {'shmap-plain':>12} {'DDP-plain':>10}   "
          "counted in shmap's phase")
    what = {"forward": f"{c['forward']} typed calls, {c['forward lifts']} lifts, {c['forward args']} arguments",
            "backward": "", "update": f"{c['update']} typed calls, {c['update args']} arguments, "
                                      f"{c['update outputs']} outputs"}
    tot = {v: 0.0 for v in ("shmap", "DDP", "plain")}
    for phase in ("forward", "backward", "update"):
        s, d, p = (ph[f"{v} {phase}"] for v in ("shmap", "DDP", "plain"))
        for v, x in zip(("shmap", "DDP", "plain"), (s, d, p)):
            tot[v] += x
        print(f"{phase:<10} {s * 1e3:8.2f} {d * 1e3:8.2f} {p * 1e3:8.2f} {(s - p) * 1e3:12.2f} {(d - p) * 1e3:10.2f}"
              f"   {what[phase]}")
    s, d, p = tot["shmap"], tot["DDP"], tot["plain"]
    print(f"{'step':<10} {s * 1e3:8.2f} {d * 1e3:8.2f} {p * 1e3:8.2f} {(s - p) * 1e3:12.2f} {(d - p) * 1e3:10.2f}"
          f"   shmap / DDP = {s / d:.2f}x")
    typing = unit["op through the general dispatch"]  # (most typed calls take the cheaper fast path)
    lift = unit["op lifting an invariant weight"] - typing
    boundary, out = unit["DTensor argument in"], unit["output out (a DTensor)"]
    weight = unit["DTensor argument in, requires grad"]
    fwd = c["forward"] * typing + c["forward lifts"] * lift + c["forward args"] * weight
    upd = c["update"] * typing + c["update args"] * boundary + c["update outputs"] * out
    print(f"unit costs x counts: forward <= {fwd * 1e3:.2f} ms (typing, lifts, arguments); update <= "
          f"{upd * 1e3:.2f} ms (typing, arguments, outputs).  Phase differences of a few ms are within this "
          "machine's run-to-run noise: compare runs.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--skip-recipe", action="store_true", help="part 1 only")
    args = ap.parse_args()
    k = 20
    print(f"torch {torch.__version__}, {args.world} gloo processes on {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f} at start); main-thread CPU of rank 0, medians.\n")
    print(f"Part 1: unit costs in a shard_map body (mesh ('i',) of {args.world}; {k} items per call, "
          "8x32 blocks, 32x32 weights), beside the same torch calls on the plain block")
    t = shmap.spawn(units_worker, k, 20 if args.quick else 200, nprocs=args.world, timeout=600)[0]
    unit = report_units(t, k)
    if args.skip_recipe:
        return
    print("\nPart 2: the recipe's step (shmap-train --mesh data=N, default model) against DDP + torch.optim.Adam")
    r = shmap.spawn(recipe_worker, 4 if args.quick else 12, nprocs=args.world, timeout=900)[0]
    report_recipe(r, unit)


if __name__ == "__main__":
    main()
