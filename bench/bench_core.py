#!/usr/bin/env python
"""Core benchmark: shmap's simulated mesh against its baselines, side by side.

Every workload is timed, in one run and interleaved, under these variants, all
computing the same math:

  plain        plain PyTorch on one device: the global computation (the physical limit)
  plain-comp   torch.compile(fullgraph=True) of the plain computation
  shmap        shmap.shard_map on the simulated mesh (8 devices in this process)
  shmap-comp   torch.compile(fullgraph=True) of the shmap computation
  shmap-jit    shmap.jit of the shmap computation (captured once, replayed: Inductor's code,
               called directly, without Dynamo's or AOT autograd's per-call wrappers)
  LocalTensor  the same SPMD program under torch.distributed._local_tensor.LocalTensorMode
               (fake process group, per-rank LocalTensor values)
  jax-eager    jax.shard_map on 8 host CPU devices, called directly (no jit)
  jax-jit      the same under jax.jit

Workloads:

  mlp-small / mlp-medium   data-parallel MLP training step on make_mesh((8,), ('batch',)):
                           weights P(), data P('batch'), loss pmean over 'batch',
                           value and grad w.r.t. all weights and biases
  matmul_basic             seed 000 on a (4, 2) mesh ('i', 'j'): in (P('i','j'), P('j',None)),
                           out P('i',None), psum over 'j'
  matmul_reduce_scatter    same, out P('i','j'), psum_scatter over 'j' (scatter_dimension=1, tiled)
  (each matmul at a compute-bound size and at the tiny design-doc size)
  train-step               mlp-small as a whole training step: forward, backward and an
                           SGD (momentum) update of the parameters; the compiled variants are
                           torch.compile(step) (Dynamo splits the graph at .backward())

The MLP's compiled variants compute value and gradient with
torch.func.grad_and_value (one graph, fullgraph=True); the eager ones with
torch.autograd.grad.

Before timing, every variant's result is checked against plain PyTorch's
(assert, relative to the reference's largest magnitude).  Times are medians
over interleaved rounds (each round times every variant once, in rotating
order; a sample runs enough calls to last --sample-ms); a ratio `shmap / X`
is the median over rounds of the per-round ratio, so slow drifts in machine
load cancel.  Nothing printed is hard-coded.

Usage:
    .venv/bin/python bench/bench_core.py            # full run (~1-3 minutes)
    .venv/bin/python bench/bench_core.py --quick    # shorter run, fewer rounds
    .venv/bin/python bench/bench_core.py --profile  # also cProfile shmap per workload

Options: --threads N (torch intra-op threads for every torch variant; default 1,
stable on a shared 2-core machine), --rounds, --sample-ms, --only SUBSTRING.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import os
import pstats
import statistics
import sys
import time

# JAX must see 8 host devices: set before jax is imported anywhere.
_flag = "--xla_force_host_platform_device_count=8"
_xla = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _xla:
    os.environ["XLA_FLAGS"] = (_xla + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import shmap  # noqa: E402
from shmap import P  # noqa: E402

N = 8  # simulated devices in every workload
VARIANTS = ("plain", "plain-comp", "shmap", "shmap-comp", "shmap-jit", "LocalTensor", "jax-eager", "jax-jit")
#: (numerator, denominator) of each ratio column
RATIOS = (("shmap", "plain"), ("shmap-comp", "plain"), ("shmap-comp", "plain-comp"), ("shmap-comp", "shmap"),
          ("shmap", "LocalTensor"), ("shmap", "jax-eager"), ("shmap-comp", "jax-jit"),
          ("shmap-jit", "plain"), ("shmap-jit", "plain-comp"), ("shmap-jit", "jax-jit"))
NOTES: list[str] = []  # honest notes printed under the tables


# ----------------------------------------------------------------------------
# Optional back ends (each may be missing; the table then says n/a and why)
# ----------------------------------------------------------------------------
def _import_jax():
    try:
        import jax
        import jax.numpy as jnp
        from jax.sharding import AxisType, NamedSharding
        from jax.sharding import PartitionSpec as JP
    except Exception as e:  # pragma: no cover - environment dependent
        NOTES.append(f"jax unavailable ({type(e).__name__}: {e}); jax columns are n/a")
        return None
    jax.config.update("jax_enable_x64", False)  # float32 everywhere, like the torch variants
    if len(jax.devices()) < N:
        NOTES.append(f"jax has {len(jax.devices())} devices (< {N}); XLA_FLAGS was set too late; jax is n/a")
        return None
    return dict(jax=jax, jnp=jnp, AxisType=AxisType, NamedSharding=NamedSharding, P=JP)


def _import_local_tensor():
    try:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except Exception as e:  # pragma: no cover - environment dependent
        NOTES.append(f"LocalTensor unavailable ({type(e).__name__}: {e}); its column is n/a")
        return None
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=N, store=FakeStore())
    return dict(dist=dist, funcol=funcol, LocalTensor=LocalTensor,
                LocalTensorMode=LocalTensorMode, init_device_mesh=init_device_mesh)


def sim_mesh(shape, names):
    """A *simulated* shmap mesh even though a (fake) torch.distributed world is
    initialised for LocalTensor: newer shmap lays make_mesh over an initialised
    world unless told `distributed=False`."""
    import inspect
    kw = {"distributed": False} if "distributed" in inspect.signature(shmap.make_mesh).parameters else {}
    mesh = shmap.make_mesh(shape, names, **kw)
    assert not getattr(mesh, "is_distributed", False), "bench needs a simulated shmap mesh"
    return mesh


# ----------------------------------------------------------------------------
# Checking and timing
# ----------------------------------------------------------------------------
def _to_torch(x):
    if isinstance(x, torch.Tensor):
        return x.detach()
    return torch.from_numpy(np.array(x))  # a writable copy of a jax array


def _flatten(x):
    if isinstance(x, (tuple, list)):
        return [leaf for item in x for leaf in _flatten(item)]
    return [x]


def check_close(name, got, ref, rtol):
    """Assert every leaf of `got` matches `ref`: max |diff| <= rtol * max |ref| (per leaf)."""
    g, r = _flatten(got), _flatten(ref)
    assert len(g) == len(r), f"{name}: {len(g)} result leaves, expected {len(r)}"
    worst = 0.0
    for k, (a, b) in enumerate(zip(g, r)):
        a, b = _to_torch(a).to(torch.float64), _to_torch(b).to(torch.float64)
        assert a.shape == b.shape, f"{name}: leaf {k} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        scale = max(b.abs().max().item(), 1e-30)
        err = (a - b).abs().max().item() / scale
        assert err <= rtol, f"{name}: leaf {k} differs from plain PyTorch: rel err {err:.2e} > {rtol:.0e}"
        worst = max(worst, err)
    return worst


def _time_sample(fn, inner):
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner
    finally:
        if gc_was:
            gc.enable()


def measure(fns, rounds, sample_s, slow_budget_s):
    """Interleaved timing: per round, one sample of every variant (rotating order).

    Callers have already run every variant once (the correctness check), so
    jit compilation and caches are warm.  A variant whose single call is so
    slow that `rounds` samples would exceed `slow_budget_s` is sampled only in
    the first few rounds (at least 3); ratios pair rounds where both exist.
    """
    names = list(fns)
    inner, active = {}, {}
    for n in names:
        one = _time_sample(fns[n], 1)
        if one < sample_s:
            one = min(one, _time_sample(fns[n], 1))
        inner[n] = max(1, min(10_000, math.ceil(sample_s / max(one, 1e-7))))
        per_sample = inner[n] * one
        active[n] = max(3, min(rounds, int(slow_budget_s / max(per_sample, 1e-9))))
    samples = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            if r < active[n]:
                samples[n].append(_time_sample(fns[n], inner[n]))
    return samples


# ----------------------------------------------------------------------------
# Workload 1: data-parallel MLP training step
# ----------------------------------------------------------------------------
def mlp_forward(params, x, act):
    """params = [w0, b0, w1, b1, ...]; tanh between layers, linear last layer."""
    h = x
    nl = len(params) // 2
    for i in range(nl):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < nl - 1:
            h = act(h)
    return h


def mlp_workload(per_dev, width, layers, jx, lt):
    g = torch.Generator().manual_seed(0)
    B = N * per_dev
    x = torch.randn(B, width, generator=g)
    t = torch.randn(B, width, generator=g)
    params = []
    for _ in range(layers):
        params.append((torch.randn(width, width, generator=g) / math.sqrt(width)).requires_grad_())
        params.append((0.1 * torch.randn(width, generator=g)).requires_grad_())

    fns, notes = {}, []

    # plain: the global step on one device
    def plain():
        loss = ((mlp_forward(params, x, torch.tanh) - t) ** 2).mean()
        grads = torch.autograd.grad(loss, params)
        return loss, grads
    fns["plain"] = plain

    # shmap: replicated params P(), data P('batch'), pmean of the per-device loss
    mesh = sim_mesh((N,), ("batch",))

    @shmap.shard_map(mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=P())
    def sh_loss(ps, xb, tb):
        return shmap.pmean(((mlp_forward(ps, xb, torch.tanh) - tb) ** 2).mean(), "batch")

    def sh_step():
        loss = sh_loss(params, x, t)
        grads = torch.autograd.grad(loss, params)
        return loss, grads
    fns["shmap"] = sh_step

    # compiled: value and grad as one functional graph
    def plain_loss(ps, x, t):
        return ((mlp_forward(ps, x, torch.tanh) - t) ** 2).mean()

    def swap(fn):
        def run(*a):
            g, v = fn(*a)
            return v, g
        return run
    plain_c = torch.compile(swap(torch.func.grad_and_value(plain_loss)), fullgraph=True,
                            dynamic=False)
    sh_c = torch.compile(swap(torch.func.grad_and_value(sh_loss)), fullgraph=True, dynamic=False)
    fns["plain-comp"] = lambda: plain_c(params, x, t)
    fns["shmap-comp"] = lambda: sh_c(params, x, t)
    # shmap.jit of the same functional step; the parameters are its plain inputs (a functional
    # step returns the gradients: nothing outside needs their autograd history)
    sh_j = shmap.jit(swap(torch.func.grad_and_value(sh_loss)))
    pd = [p.detach() for p in params]
    fns["shmap-jit"] = lambda: sh_j(pd, x, t)

    # LocalTensor: per-rank values; the loss all-reduce is differentiated through
    # (funcol.all_reduce has an autograd formula: its backward all-reduces the cotangent,
    # so each rank gets d local_r / d p), then the explicit gradient all-reduce / 8 a
    # DDP-style program writes (shmap derives that one itself: the transpose of the
    # automatic pvary of the replicated params).
    if lt is not None:
        LT, LTM, funcol = lt["LocalTensor"], lt["LocalTensorMode"], lt["funcol"]
        world = lt["dist"].group.WORLD

        def lt_run(all_ranks):
            with LTM(N):
                xl = LT({r: x[r * per_dev:(r + 1) * per_dev] for r in range(N)})
                tl = LT({r: t[r * per_dev:(r + 1) * per_dev] for r in range(N)})
                pl = [LT({r: p.detach() for r in range(N)}, requires_grad=True) for p in params]
                local = ((mlp_forward(pl, xl, torch.tanh) - tl) ** 2).mean()
                loss = funcol.all_reduce(local, "sum", world) / N          # pmean, differentiable
                grads = torch.autograd.grad(loss, pl)                  # per rank: d local_r / d p
                grads = [funcol.wait_tensor(funcol.all_reduce(gr, "sum", world)) / N for gr in grads]
                if all_ranks:  # for the check: every rank must hold the same (replicated) result
                    return [[v._local_tensors[r] for v in [loss, *grads]] for r in range(N)]
                return loss._local_tensors[0], [gr._local_tensors[0] for gr in grads]
        fns["LocalTensor"] = lambda: lt_run(False)
        lt_check = lambda: lt_run(True)  # noqa: E731
    else:
        lt_check = None

    # JAX: same body, value_and_grad of the shard_mapped loss
    if jx is not None:
        jax, jnp, JP, NS = jx["jax"], jx["jnp"], jx["P"], jx["NamedSharding"]
        jmesh = jax.make_mesh((N,), ("batch",), axis_types=(jx["AxisType"].Auto,))

        def j_loss(ps, xb, tb):
            return jax.lax.pmean(jnp.mean((mlp_forward(ps, xb, jnp.tanh) - tb) ** 2), "batch")

        j_sm = jax.shard_map(j_loss, mesh=jmesh, in_specs=(JP(), JP("batch"), JP("batch")), out_specs=JP())
        j_vg = jax.value_and_grad(j_sm)
        j_vg_jit = jax.jit(j_vg)
        jp = [jax.device_put(p.detach().numpy(), NS(jmesh, JP())) for p in params]
        jxd = jax.device_put(x.numpy(), NS(jmesh, JP("batch")))
        jtd = jax.device_put(t.numpy(), NS(jmesh, JP("batch")))
        fns["jax-eager"] = lambda: jax.block_until_ready(j_vg(jp, jxd, jtd))
        fns["jax-jit"] = lambda: jax.block_until_ready(j_vg_jit(jp, jxd, jtd))

    extra_checks = {"LocalTensor (all ranks)": lt_check} if lt_check else {}
    return fns, notes, extra_checks


# ----------------------------------------------------------------------------
# Workload 1b: the same MLP as a whole training step (forward, backward, SGD update)
# ----------------------------------------------------------------------------
def train_step_workload(per_dev, width, layers):
    g = torch.Generator().manual_seed(0)
    B = N * per_dev
    x = torch.randn(B, width, generator=g)
    t = torch.randn(B, width, generator=g)
    init = []
    for _ in range(layers):
        init.append(torch.randn(width, width, generator=g) / math.sqrt(width))
        init.append(0.1 * torch.randn(width, generator=g))
    mesh = sim_mesh((N,), ("batch",))

    @shmap.shard_map(mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=P())
    def sh_loss(ps, xb, tb):
        return shmap.pmean(((mlp_forward(ps, xb, torch.tanh) - tb) ** 2).mean(), "batch")

    def plain_loss(ps, xb, tb):
        return ((mlp_forward(ps, xb, torch.tanh) - tb) ** 2).mean()

    def make(loss_fn, compiled):
        ps = [p.clone().requires_grad_() for p in init]
        opt = torch.optim.SGD(ps, lr=1e-3, momentum=0.9)

        def step():
            opt.zero_grad()
            loss = loss_fn(ps, x, t)
            loss.backward()
            opt.step()
            return loss.detach()
        run = torch.compile(step, dynamic=False) if compiled else step
        first = [True]

        def call():  # the first call (the correctness check) also returns the updated parameters
            loss = run()
            if first[0]:
                first[0] = False
                return loss, [p.detach().clone() for p in ps]
            return loss
        return call

    fns = {"plain": make(plain_loss, False), "plain-comp": make(plain_loss, True),
           "shmap": make(sh_loss, False), "shmap-comp": make(sh_loss, True)}
    return fns, ["parameters are updated in place on every call; all variants start from the same "
                 "values (checked after the first step)"], {}


# ----------------------------------------------------------------------------
# Workload 2: seed-000 matmuls on a (4, 2) mesh
# ----------------------------------------------------------------------------
def matmul_workload(kind, m, k, n, jx, lt):
    I, J = 4, 2
    g = torch.Generator().manual_seed(1)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    mb, kb = m // I, k // J

    fns, notes = {}, []
    fns["plain"] = lambda: a @ b

    mesh = sim_mesh((I, J), ("i", "j"))
    if kind == "basic":
        sh = shmap.shard_map(lambda ab, bb: shmap.psum(ab @ bb, "j"), mesh=mesh,
                             in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", None))
    else:
        sh = shmap.shard_map(
            lambda ab, bb: shmap.psum_scatter(ab @ bb, "j", scatter_dimension=1, tiled=True),
            mesh=mesh, in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", "j"))
    fns["shmap"] = lambda: sh(a, b)
    plain_c = torch.compile(lambda a, b: a @ b, fullgraph=True, dynamic=False)
    sh_c = torch.compile(sh, fullgraph=True, dynamic=False)
    fns["plain-comp"] = lambda: plain_c(a, b)
    fns["shmap-comp"] = lambda: sh_c(a, b)
    sh_j = shmap.jit(sh)
    fns["shmap-jit"] = lambda: sh_j(a, b)

    lt_check = None
    if lt is not None:
        LT, LTM, funcol = lt["LocalTensor"], lt["LocalTensorMode"], lt["funcol"]
        dmesh = lt["mesh_ij"]
        group_j = (dmesh, 1)  # the 'j' sub-groups of the (4, 2) DeviceMesh; rank = 2 * i + j
        # reduce_scatter_tensor is deprecated in newer torch in favour of reduce_scatter_single
        rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

        def lt_body(reassemble):
            with LTM(N):
                al = LT({r: a[(r // J) * mb:(r // J + 1) * mb, (r % J) * kb:(r % J + 1) * kb] for r in range(N)})
                bl = LT({r: b[(r % J) * kb:(r % J + 1) * kb] for r in range(N)})
                if kind == "basic":
                    c = funcol.wait_tensor(funcol.all_reduce(al @ bl, "sum", group_j))
                    if not reassemble:
                        return c
                    return torch.cat([c._local_tensors[J * i] for i in range(I)], 0)
                c = funcol.wait_tensor(rs(al @ bl, "sum", 1, group_j))
                if not reassemble:
                    return c
                return torch.cat([torch.cat([c._local_tensors[J * i + j] for j in range(J)], 1)
                                  for i in range(I)], 0)
        fns["LocalTensor"] = lambda: lt_body(True)

        def lt_check():  # the out_spec promises replication along 'j' for matmul_basic
            c = lt_body(False)
            if kind == "basic":
                return [torch.cat([c._local_tensors[J * i + j] for i in range(I)], 0) for j in range(J)]
            return [lt_body(True)]

    if jx is not None:
        jax, JP, NS = jx["jax"], jx["P"], jx["NamedSharding"]
        jmesh = jax.make_mesh((I, J), ("i", "j"), axis_types=(jx["AxisType"].Auto,) * 2)
        if kind == "basic":
            jf = jax.shard_map(lambda ab, bb: jax.lax.psum(ab @ bb, "j"), mesh=jmesh,
                               in_specs=(JP("i", "j"), JP("j", None)), out_specs=JP("i", None))
        else:
            jf = jax.shard_map(
                lambda ab, bb: jax.lax.psum_scatter(ab @ bb, "j", scatter_dimension=1, tiled=True),
                mesh=jmesh, in_specs=(JP("i", "j"), JP("j", None)), out_specs=JP("i", "j"))
        jfj = jax.jit(jf)
        ja = jax.device_put(a.numpy(), NS(jmesh, JP("i", "j")))
        jb = jax.device_put(b.numpy(), NS(jmesh, JP("j", None)))
        fns["jax-eager"] = lambda: jf(ja, jb).block_until_ready()
        fns["jax-jit"] = lambda: jfj(ja, jb).block_until_ready()

    extra_checks = {"LocalTensor (all 'j' ranks)": lt_check} if lt_check else {}
    return fns, notes, extra_checks


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------
def _fmt_ms(s):
    if s is None:
        return "n/a"
    ms = s * 1e3
    return f"{ms:.3f}" if ms < 1 else (f"{ms:.2f}" if ms < 100 else f"{ms:.1f}")


def _fmt_ratio(x):
    if x is None:
        return "n/a"
    return f"{x:.0f}x" if x >= 100 else (f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x")


def _table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and shorter samples (same sizes)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every torch variant")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per workload")
    ap.add_argument("--sample-ms", type=float, default=None, help="minimum duration of one sample")
    ap.add_argument("--only", default=None, help="run workloads whose name contains this")
    ap.add_argument("--profile", action="store_true", help="cProfile the shmap variant of each workload")
    args = ap.parse_args(argv)

    rounds = args.rounds or (5 if args.quick else 15)
    sample_s = (args.sample_ms or (20.0 if args.quick else 50.0)) / 1e3
    slow_budget_s = 4.0 if args.quick else 12.0  # per variant and workload, for very slow variants
    torch.set_num_threads(args.threads)

    jx = _import_jax()
    lt = _import_local_tensor()
    if lt is not None:
        lt["mesh_ij"] = lt["init_device_mesh"]("cpu", (4, 2), mesh_dim_names=("i", "j"))

    big = (1024, 2048, 1024)
    workloads = [
        ("mlp-small (8x16, w64, 3 layers)", lambda: mlp_workload(16, 64, 3, jx, lt), 1e-4),
        ("mlp-medium (8x128, w512, 3 layers)", lambda: mlp_workload(128, 512, 3, jx, lt), 1e-4),
        ("train-step (mlp-small + SGD)", lambda: train_step_workload(16, 64, 3), 1e-4),
        ("matmul_basic {}x{} @ {}x{}".format(big[0], big[1], big[1], big[2]),
         lambda: matmul_workload("basic", *big, jx, lt), 1e-5),
        ("matmul_basic 8x16 @ 16x32", lambda: matmul_workload("basic", 8, 16, 32, jx, lt), 1e-5),
        ("matmul_reduce_scatter {}x{} @ {}x{}".format(big[0], big[1], big[1], big[2]),
         lambda: matmul_workload("rs", *big, jx, lt), 1e-5),
        ("matmul_reduce_scatter 8x16 @ 16x32", lambda: matmul_workload("rs", 8, 16, 32, jx, lt), 1e-5),
    ]
    if args.only:
        workloads = [w for w in workloads if args.only in w[0]]

    print(f"shmap bench_core: torch {torch.__version__}, "
          f"jax {jx['jax'].__version__ if jx else 'n/a'}, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs")
    print(f"torch.set_num_threads({args.threads}) for plain / shmap / LocalTensor "
          f"(torch.get_num_threads() = {torch.get_num_threads()}); "
          f"JAX: {len(jx['jax'].devices()) if jx else 0} CPU devices sharing the machine's cores (XLA thread pool)")
    print(f"{rounds} interleaved rounds per workload, samples >= {sample_s * 1e3:.0f} ms; "
          f"times are medians (ms per call), ratios are medians of per-round ratios\n")

    t_start = time.perf_counter()
    time_rows, ratio_rows, spread_rows, verdicts, profiles = [], [], [], [], []
    noisy = [False]
    for wname, build, rtol in workloads:
        fns, notes, extra = build()
        ref = fns["plain"]()
        errs = {}
        for v in VARIANTS[1:]:
            if v in fns:
                errs[v] = check_close(f"{wname} / {v}", fns[v](), ref, rtol)
        for label, chk in extra.items():
            for per_rank in chk():
                check_close(f"{wname} / {label}", per_rank, ref, rtol)
        NOTES.extend(f"{wname}: {n}" for n in notes)

        samples = measure(fns, rounds, sample_s, slow_budget_s)
        med = {v: statistics.median(samples[v]) if v in samples else None for v in VARIANTS}
        ratios = {}
        for num, den in RATIOS:
            ratios[num, den] = (statistics.median([a / b for a, b in zip(samples[num], samples[den])])
                                if num in samples and den in samples else None)
        few = [f"{v} {len(samples[v])}" for v in VARIANTS if v in samples and len(samples[v]) < rounds]
        if few:
            NOTES.append(f"{wname}: slow variant(s) sampled in fewer rounds: {', '.join(few)} (of {rounds})")
        time_rows.append([wname] + [_fmt_ms(med[v]) for v in VARIANTS])
        cells = []
        for num, den in RATIOS:
            r = ratios[num, den]
            cell = _fmt_ratio(r)
            if r is not None and abs(math.log(r / (med[num] / med[den]))) > math.log(1.25):
                cell += "*"  # the paired ratio and the ratio of medians disagree: noisy
                noisy[0] = True
            cells.append(cell)
        ratio_rows.append([wname] + cells)
        spread = []
        for v in VARIANTS:
            if v in samples and len(samples[v]) >= 4:
                q = statistics.quantiles(samples[v], n=4)
                spread.append(f"{(q[2] - q[0]) / med[v] * 100:.0f}%")
            else:
                spread.append("n/a")
        spread_rows.append([wname] + spread)
        verdicts.append((wname, ratios))
        errs_s = ", ".join(f"{v} {e:.1e}" for v, e in errs.items())
        print(f"  done {wname}: verified vs plain (max rel err: {errs_s})", flush=True)

        if args.profile:
            fn = fns["shmap"]
            reps = max(5, min(2000, int(0.5 / max(med["shmap"], 1e-6))))
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(reps):
                fn()
            pr.disable()
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("tottime").print_stats(14)
            profiles.append((wname, reps, s.getvalue()))

    print()
    print("Median time per call (ms)")
    print(_table(["workload"] + list(VARIANTS), time_rows))
    print()
    print("Ratios (time / time, medians of per-round ratios; < 1 means the first is faster)")
    print(_table(["workload"] + [f"{a}/{b}" for a, b in RATIOS], ratio_rows))
    if noisy[0]:
        print("  * differs by more than 25% from the ratio of the median times above: the machine was "
              "noisy; rerun (more --rounds) before trusting it")
    print()
    print("Spread (interquartile range / median)")
    print(_table(["workload"] + list(VARIANTS), spread_rows))
    print()
    print("Project goals (issue 9): compiled, the overhead-bound DP MLP step within 1.5x of plain eager and the "
          "8x16 seed matmuls within 3x;\n  compute-bound cases within 1.05x of torch.compile of the same math; "
          "a compiled training step faster than eager; eager shmap faster than LocalTensorMode")
    for wname, r in verdicts:
        goals = []
        small = "8x16" in wname
        if wname.startswith("mlp-small"):
            goals.append(("shmap-comp", "plain", 1.5))
            goals.append(("shmap-jit", "plain", 1.5))
        elif small:
            goals.append(("shmap-comp", "plain", 3.0))
            goals.append(("shmap-jit", "plain", 3.0))
        elif not wname.startswith("train-step"):
            goals.append(("shmap-comp", "plain-comp", 1.05))
        if wname.startswith("train-step"):
            goals.append(("shmap-comp", "shmap", 1.0))
        goals.append(("shmap", "LocalTensor", 1.0))
        cells = []
        for num, den, lim in goals:
            v = r.get((num, den))
            ok = "n/a" if v is None else ("met" if v <= lim else "NOT met")
            cells.append(f"{num}/{den} {_fmt_ratio(v)} (goal <= {lim:g}x) -> {ok}")
        print(f"  {wname}: " + "; ".join(cells))
    print()
    print("Notes:")
    for n in NOTES + [
        "LocalTensor MLP: the whole step runs under LocalTensorMode, autograd included: "
        "torch.autograd.grad goes through _functional_collectives.all_reduce (the pmean). Its "
        "backward all-reduces the loss cotangent, so the program then all-reduces the per-rank "
        "weight gradients and divides by 8 by hand (shmap derives that psum from pvary's transpose).",
        "LocalTensor and shmap calls take global tensors and return global tensors (the per-call "
        "split into per-rank views and the reassembly are timed; LocalTensorMode is entered per call).",
        "JAX inputs are placed once with device_put onto their NamedSharding (not timed); each call "
        "ends with block_until_ready. jax-eager is jax.shard_map called directly (op-by-op dispatch); "
        "the MLP uses jax.value_and_grad of the shard_mapped loss.",
        "plain-comp / shmap-comp: torch.compile(fullgraph=True, dynamic=False, default Inductor backend), compiled "
        "before timing; per call they pay Dynamo's guards and AOT autograd's runtime wrapper (tens of "
        "microseconds), which dominates the tiny workloads for both.",
        "shmap-jit: shmap.jit (shmap/jit.py), captured before timing: per call a key check (shapes, strides, "
        "dtypes, devices, requires_grad, grad mode) and Inductor's generated code called directly; comm_log "
        "events are reported by the wrapper. The MLP's shmap-jit is the same functional step as shmap-comp "
        "(torch.func.grad_and_value), given the parameters as plain tensors. Not run for train-step "
        "(its optimizer holds the parameters: shmap.jit refuses closed-over tensors).",
    ]:
        print(f"  - {n}")
    print(f"\ntotal wall time {time.perf_counter() - t_start:.1f} s")

    for wname, reps, text in profiles:
        print(f"\n=== cProfile of shmap, {wname} ({reps} calls), top by tottime ===")
        lines = text.strip().splitlines()
        start = next((i for i, l in enumerate(lines) if "ncalls" in l), 0)
        print("\n".join(lines[max(0, start - 2):]))


if __name__ == "__main__":
    main()
