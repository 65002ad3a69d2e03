"""Deferred, bucketed gradient reductions on the distributed mesh (importable by spawned ranks).

`run_cases` checks, on every rank, that a data-parallel backward pass
- gives the simulated mesh's gradients, bucketed or not (`bucket_bytes`);
- opens each backward pass with a small first bucket when `first_bucket_bytes` sets one, as DDP;
- sums several weights' gradients in one all_reduce (DP) or reduce-scatter
  (FSDP), while comm_log still reports one psum / psum_scatter per weight;
- launches its reductions before the backward pass ends (overlap);
- hands back ordinary tensors (no `Deferred` leaves a body's backward), by
  `torch.autograd.grad` and by `.backward()`, for plain and DTensor inputs;
- keeps double backward (create_graph) exact;
- moves weights gathered back to back (FSDP's forward, gathered up front) in
  one all_gather per bucket, still reported as one all_gather each;
- sends a bucket's signature inside its payload, at any size (no exchange beside it);
- launches only the bucket a read needs (4 ranks: a tensor-parallel read
  mid-pass leaves the data-parallel bucket filling);
- lets gradients taken inside a body, still on the wire, feed list-taking ops
  (`_foreach_*`, `stack`: an optimizer step in the body).
`forward_psum_in_flight` checks a global loss left on the wire (read where the
caller reads it; saved by `torch.save` as its value).
Returns a list of failure messages (empty: all passed).
"""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

import shmap
from shmap import P

N_WEIGHTS = 6


class Marker(torch.autograd.Function):
    """Identity whose backward notes how many all_reduces were launched when it ran."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        Marker.seen.append((_COUNT[0], _FINISHED[0]))
        return g


_COUNT = [0]  # reductions launched (a gloo all_reduce or, when small, a sealed all_gather reduced locally)
_FINISHED = [0]  # collectives finished (waited for and checked)
_RS = [0]  # gloo reduce-scatters launched
_AG = [0]  # all_gathers (of data, not a reduction's) launched


def _counting_finish(finish):
    def wrapped(self):
        _FINISHED[0] += 1
        return finish(self)
    return wrapped


def _counting_starts(start):
    """transports._start counting what it launches, by kind: every collective of data on the wire
    (a reduction's transport depends on its size, see transports.gathered_reduce)."""
    def wrapped(g, kind, *args, **kwargs):
        if kind in ("psum", "pmax", "pmin"):
            _COUNT[0] += 1
        elif kind == "all_gather":
            _AG[0] += 1
        return start(g, kind, *args, **kwargs)
    return wrapped


def _counting(fn, counter=None):
    counter = _COUNT if counter is None else counter

    def wrapped(*args, **kwargs):
        counter[0] += 1
        return fn(*args, **kwargs)
    return wrapped


def _body(ws, x):
    h = Marker.apply(torch.tanh(x @ ws[0]))  # its backward runs when only the first layer's is left
    for w in ws[1:]:
        h = torch.tanh(h @ w)
    return shmap.psum(h.sum(), "i")


def _fsdp_body(ws, x):
    h = x
    for w in ws:  # each weight arrives as row blocks and is gathered for use: its transpose reduce-scatters
        h = torch.tanh(h @ shmap.all_gather(w, "i", axis=0, tiled=True))
    return shmap.psum(h.sum(), "i")


def _fsdp_prefetch_body(ws, x):
    whole = [shmap.all_gather(w, "i", axis=k % 2, tiled=k % 3 != 2) for k, w in enumerate(ws)]  # up front
    h = x
    for k, w in enumerate(whole):
        w = w if w.dim() == 2 else w.movedim(k % 2, 0).reshape(-1, w.shape[-1])  # untiled: (n, 16/n, 16)
        h = torch.tanh(h @ w.reshape(16, 16))
    return shmap.psum(h.sum(), "i")


def _tp_body(w1, w_col, w_row, w2, x):
    h = x * w1                                        # w1's pvary over i: the i bucket
    z = shmap.psum((h @ w_col) @ w_row, "j")          # h's pvary over j: read at once in the backward
    return shmap.psum((z * w2).sum(), "i")            # w2's pvary over i: the i bucket, opened first


def _weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 16, generator=g, dtype=torch.float64) / 4 for _ in range(N_WEIGHTS)]


def _data():
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _grads(mesh, ws, x, bucket_bytes, how="grad", first=None):
    """(gradients of the weights, reductions launched, comm_log kinds, Marker.seen)."""
    f = shmap.shard_map(_body, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    prev = (shmap.configure_distributed(bucket_bytes=bucket_bytes, first_bucket_bytes=first)
            if mesh.is_distributed else None)
    _COUNT[0] = _FINISHED[0] = 0
    Marker.seen.clear()
    try:
        leaves = [w.detach().clone().requires_grad_() for w in ws]
        with shmap.comm_log() as log:
            out = f(leaves, x)
            if how == "grad":
                grads = list(torch.autograd.grad(out if not mesh.is_distributed else out.to_local(), leaves))
            else:
                (out if not mesh.is_distributed else out.to_local()).backward()
                grads = [w.grad for w in leaves]
    finally:
        if prev is not None:
            shmap.configure_distributed(**prev)
    return grads, _COUNT[0], [e.kind for e in log.events], list(Marker.seen)


def run_cases():
    fails = []
    from shmap.backends import transports

    transports._start = _counting_starts(transports._start)  # every reduction and all_gather launched
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    setattr(dist, name, _counting(getattr(dist, name), _RS))
    transports.InFlight.finish = _counting_finish(transports.InFlight.finish)
    world = dist.get_world_size()
    sim = shmap.make_mesh((world,), ("i",), distributed=False)
    mesh = shmap.make_mesh((world,), ("i",))
    ws, x = _weights(), _data()
    ref, _, ref_kinds, _ = _grads(sim, ws, x, None)

    got = {}
    for bucket in (1, 1 << 20, 16 * 16 * 8 * 2):  # one all_reduce per psum; all in one; two per bucket
        grads, count, kinds, seen = _grads(mesh, ws, x, bucket)
        got[bucket] = grads
        if kinds != ref_kinds:
            fails.append(f"bucket_bytes={bucket}: comm_log {kinds} != simulated {ref_kinds}")
        for k, (a, b) in enumerate(zip(grads, ref)):
            if type(a) is not torch.Tensor:
                fails.append(f"bucket_bytes={bucket}: weight {k}'s gradient is a {type(a).__name__}")
            elif not torch.allclose(a, b, rtol=1e-12, atol=1e-14):
                fails.append(f"bucket_bytes={bucket}: weight {k}'s gradient differs from the simulated mesh's "
                             f"by {(a - b).abs().max():.3g}")
        expect = {1: 1 + N_WEIGHTS, 1 << 20: 1 + 1, 16 * 16 * 8 * 2: 1 + N_WEIGHTS // 2}[bucket]
        if count != expect:
            fails.append(f"bucket_bytes={bucket}: {count} reductions, expected {expect} (the loss's psum "
                         "and the weights' buckets)")
        if bucket != 1 << 20 and not (seen and seen[0][0] > 1 and seen[0][1] < seen[0][0]):
            # the first layer's backward runs last: by then the later layers' buckets are on the wire,
            # launched but not waited for
            fails.append(f"bucket_bytes={bucket}: no reduction was in flight when the backward pass reached "
                         f"the first layer ((launched, finished) by then: {seen})")
    # DDP's buckets: a pass's first bucket small (two weights here), the rest in one large bucket
    for _ in range(2):  # (and again in the next backward pass)
        grads, count, _, _ = _grads(mesh, ws, x, 1 << 20, first=16 * 16 * 8 * 2)
        if count != 1 + 2:
            fails.append(f"first_bucket_bytes=4096, bucket_bytes=1 MiB: {count} reductions, expected 3 (the "
                         "loss's psum, the first bucket of two weights, one bucket of the rest)")
        if not all(torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(grads, ref)):
            fails.append("first_bucket_bytes=4096: gradients differ from the simulated mesh's")

    if world == 2:  # a + b either way: bucketing changes nothing, bit for bit
        for b in got:
            if not all(torch.equal(p, q) for p, q in zip(got[b], got[1])):
                fails.append(f"bucket_bytes={b}: gradients differ from the unbucketed ones")

    # FSDP: the weights' reduce-scatters are bucketed too
    def fsdp(m, bucket):
        f = shmap.shard_map(_fsdp_body, mesh=m, in_specs=(P("i"), P("i")), out_specs=P())
        prev = shmap.configure_distributed(bucket_bytes=bucket) if m.is_distributed else None
        _RS[0] = 0
        try:
            w = [t.detach().clone().requires_grad_() for t in ws]
            with shmap.comm_log() as log:
                out = f(w, x)
                grads = torch.autograd.grad(out.to_local() if m.is_distributed else out, w)
        finally:
            if prev is not None:
                shmap.configure_distributed(**prev)
        return grads, _RS[0], log.count("psum_scatter")

    ref, _, ref_n = fsdp(sim, None)
    for bucket, expect in ((1, N_WEIGHTS), (1 << 20, 1)):
        grads, count, n = fsdp(mesh, bucket)
        if n != ref_n or count != expect:
            fails.append(f"FSDP bucket_bytes={bucket}: {count} gloo reduce-scatters (expected {expect}), comm_log "
                         f"{n} psum_scatters (simulated {ref_n})")
        for k, (a, b) in enumerate(zip(grads, ref)):
            if type(a) is not torch.Tensor or not torch.allclose(a, b, rtol=1e-12, atol=1e-14):
                fails.append(f"FSDP bucket_bytes={bucket}: weight {k}'s gradient is a {type(a).__name__} or "
                             "differs from the simulated mesh's")

    # FSDP, every weight gathered at the top: the gathers share buckets (one all_gather each unbucketed)
    def prefetch(m, bucket):
        f = shmap.shard_map(_fsdp_prefetch_body, mesh=m, in_specs=(P("i"), P("i")), out_specs=P())
        prev = shmap.configure_distributed(bucket_bytes=bucket) if m.is_distributed else None
        _AG[0] = 0
        try:
            w = [t.detach().clone().requires_grad_() for t in ws]
            with shmap.comm_log() as log:
                out = f(w, x)
                value = out.to_local() if m.is_distributed else out
                forward = _AG[0]  # (the backward all-gathers each plain input's gradient: not counted)
                grads = torch.autograd.grad(value, w)
        finally:
            if prev is not None:
                shmap.configure_distributed(**prev)
        return value, grads, forward, log.count("all_gather")

    ref_v, ref_g, _, ref_n = prefetch(sim, None)
    for bucket, expect in ((1, N_WEIGHTS), (1 << 20, 1), (16 * 16 * 8 // world * 3, 2)):
        value, grads, count, n = prefetch(mesh, bucket)
        if n != ref_n or count != expect:
            fails.append(f"FSDP prefetch bucket_bytes={bucket}: {count} all_gathers (expected {expect}), "
                         f"comm_log {n} all_gathers (simulated {ref_n})")
        if not torch.allclose(value, ref_v, rtol=1e-12, atol=1e-14):
            fails.append(f"FSDP prefetch bucket_bytes={bucket}: the loss differs from the simulated mesh's")
        for k, (a, b) in enumerate(zip(grads, ref_g)):
            if type(a) is not torch.Tensor or not torch.allclose(a, b, rtol=1e-12, atol=1e-14):
                fails.append(f"FSDP prefetch bucket_bytes={bucket}: weight {k}'s gradient is a "
                             f"{type(a).__name__} or differs from the simulated mesh's")

    if world == 4:  # a read launches only its own bucket
        m2 = shmap.make_mesh((2, 2), ("i", "j"))
        s2 = shmap.make_mesh((2, 2), ("i", "j"), distributed=False)
        specs = (P(), P(None, "j"), P("j"), P(), P("i"))

        def tp(m):
            f = shmap.shard_map(_tp_body, mesh=m, in_specs=specs, out_specs=P())
            w = [t.detach().clone().requires_grad_() for t in (ws[0][0], ws[1], ws[2], ws[3][0])]
            out = f(*w, x)
            _COUNT[0] = 0
            grads = torch.autograd.grad(out.to_local() if m.is_distributed else out, w)
            return grads, _COUNT[0]

        ref_t, _ = tp(s2)
        grads, count = tp(m2)
        if count != 2:
            fails.append(f"2x2 mesh: {count} reductions in the backward pass, expected 2 (h's psum over j, read "
                         "at once; one bucket over i for w2, w_row, w_col and w1)")
        if not all(torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(grads, ref_t)):
            fails.append("2x2 mesh: gradients differ from the simulated mesh's")

    fails += _buckets_carry_their_signatures(mesh, sim, ws, x)
    fails += _grads_in_the_body_feed_list_ops(mesh, sim, ws, x)

    # .backward() accumulates ordinary tensors into .grad
    grads, _, _, _ = _grads(mesh, ws, x, 1 << 20, how="backward")
    for k, (a, b) in enumerate(zip(grads, ref)):
        if type(a) is not torch.Tensor or not torch.allclose(a, b, rtol=1e-12, atol=1e-14):
            fails.append(f".backward(): weight {k}'s .grad is a {type(a).__name__} or differs")

    # DTensor inputs: the gradient's local tensor is ordinary
    f = shmap.shard_map(_body, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    dws = [shmap.device_put(w, mesh, P()).requires_grad_() for w in ws]
    gs = torch.autograd.grad(f(dws, shmap.device_put(x, mesh, P("i"))).to_local(), dws)
    for k, (a, b) in enumerate(zip(gs, ref)):
        loc = a.to_local()
        if type(loc) is not torch.Tensor or not torch.allclose(loc, b, rtol=1e-12, atol=1e-14):
            fails.append(f"DTensor input: weight {k}'s gradient holds a {type(loc).__name__} or differs")

    # double backward: the reductions stay differentiable
    def second(m):
        g = shmap.shard_map(_body, mesh=m, in_specs=(P(), P("i")), out_specs=P())
        w = [t.detach().clone().requires_grad_() for t in ws]
        out = g(w, x)
        out = out.to_local() if m.is_distributed else out
        (d0,) = torch.autograd.grad(out, [w[0]], create_graph=True)
        (dd,) = torch.autograd.grad(d0.sum(), [w[1]])
        return dd

    a, b = second(mesh), second(sim)
    if not torch.allclose(a, b, rtol=1e-12, atol=1e-14):
        fails.append(f"second derivative differs from the simulated mesh's by {(a - b).abs().max():.3g}")
    return fails


def _in_body_grad_step(ws, x):
    """An optimizer step in the body (as a fused train step would write it): the gradients taken here are
    still on the wire (`Deferred`) when list-taking ops (`_foreach_*`, `stack`) read them."""
    with torch.enable_grad():
        leaves = [w.detach().requires_grad_() for w in ws]
        grads = torch.autograd.grad(_body(leaves, x), leaves)
    norm = torch.stack(torch._foreach_norm(grads)).pow(2).sum().sqrt()
    return torch._foreach_sub(ws, torch._foreach_mul(grads, 0.1)), norm


def _grads_in_the_body_feed_list_ops(mesh, sim, ws, x):
    """Deferred gradients inside a body reach `_foreach_*` ops as lists: each arrives first (a list
    once dispatched back to `Deferred` forever)."""
    def step(m):
        f = shmap.shard_map(_in_body_grad_step, mesh=m, in_specs=(P(), P("i")), out_specs=(P(), P()))
        new, norm = f(ws, x)
        return [w.to_local() if m.is_distributed else w for w in new], norm.to_local() if m.is_distributed else norm

    (got, got_norm), (ref, ref_norm) = step(mesh), step(sim)
    fails = []
    if not torch.allclose(got_norm, ref_norm, rtol=1e-12, atol=1e-14):
        fails.append(f"gradients taken in the body: norm {got_norm} != simulated {ref_norm}")
    for k, (a, b) in enumerate(zip(got, ref)):
        if type(a) is not torch.Tensor or not torch.allclose(a, b, rtol=1e-12, atol=1e-14):
            fails.append(f"gradients taken in the body: updated weight {k} is a {type(a).__name__} or differs "
                         "from the simulated mesh's")
    return fails


def _buckets_carry_their_signatures(mesh, sim, ws, x):
    """A bucket of gathers, and one of reduce-scatters, carries its signature in its payload at any size
    (it copies its parts once anyway), where a single move over the size limit checks it with an
    exchange beside the data: here the limit is 0, so every unbucketed move exchanges.  FSDP with every
    weight gathered up front, DTensor inputs (no plain input's gradient to assemble): one bucket of
    gathers forward, one of reduce-scatters backward, and no exchange."""
    from shmap.backends import guard, sealed

    fails, exchanges = [], [0]
    real_gather, real_limit = guard._gather_into, sealed._SEAL_BYTES_LIMIT

    def counting(*a, **k):
        exchanges[0] += 1
        return real_gather(*a, **k)

    def run(m, bucket):
        f = shmap.shard_map(_fsdp_prefetch_body, mesh=m, in_specs=(P("i"), P("i")), out_specs=P())
        put = (lambda t: shmap.device_put(t, m, P("i"))) if m.is_distributed else (lambda t: t)
        prev = shmap.configure_distributed(bucket_bytes=bucket) if m.is_distributed else None
        exchanges[0] = 0
        try:
            w = [put(t.detach().clone()).requires_grad_() for t in ws]
            out = f(w, put(x))
            value = out.to_local() if m.is_distributed else out
            grads = torch.autograd.grad(value, w)
            return value, [g.full_tensor() if m.is_distributed else g for g in grads], exchanges[0]
        finally:
            if prev is not None:
                shmap.configure_distributed(**prev)

    ref_v, ref_g, _ = run(sim, None)
    guard._gather_into, sealed._SEAL_BYTES_LIMIT = counting, 0
    try:
        _, _, unbucketed = run(mesh, 1)
        value, grads, bucketed = run(mesh, 1 << 20)
    finally:
        guard._gather_into, sealed._SEAL_BYTES_LIMIT = real_gather, real_limit
    if unbucketed != 2 * N_WEIGHTS or bucketed != 0:
        fails.append(f"FSDP, seal limit 0: {unbucketed} signature exchanges unbucketed (expected {2 * N_WEIGHTS}: "
                     f"a gather and a reduce-scatter a weight), {bucketed} with one bucket each way (expected 0)")
    if not (torch.allclose(value, ref_v, rtol=1e-12, atol=1e-14) and all(
            torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(grads, ref_g))):
        fails.append("FSDP, sealed buckets: the loss or a gradient differs from the simulated mesh's")
    return fails


def forward_psum_in_flight():
    """A psum that ends the forward (a global loss) leaves the body still on the wire: the backward
    pass starts without waiting for it (autograd's ones_like seed reads only its shape) and finishes it
    before its own first collective (the weight's gradient psum), which checks its signature; its value
    and the gradients are the simulated mesh's.  A psum read inside the body waits there, as before.
    Returns a list of failures."""
    fails = []
    world = dist.get_world_size()
    mesh, sim = shmap.make_mesh((world,), ("i",)), shmap.make_mesh((world,), ("i",), distributed=False)
    ws, x = _weights(), _data()

    def run(m, body):
        f = shmap.shard_map(body, mesh=m, in_specs=(P(), P("i")), out_specs=P())
        put = (lambda t, s: shmap.device_put(t, m, s)) if m.is_distributed else (lambda t, s: t.clone())
        w = put(ws[0], P()).requires_grad_()
        out = f(w, put(x, P("i")))
        local = out._local_tensor if m.is_distributed else out
        pending = type(local).__name__ == "Deferred" and local._value is None
        seeded = torch.ones_like(out)  # (autograd's seed: reads the shape only)
        still = type(local).__name__ == "Deferred" and local._value is None
        (g,) = torch.autograd.grad(out, [w], seeded)
        pending = pending and still and type(local).__name__ == "Deferred" and local._value is not None
        full = (lambda t: t.full_tensor()) if m.is_distributed else (lambda t: t)
        return pending, full(out), full(g)

    def loss(w, x):  # the psum is the body's last op
        h = torch.tanh(x @ w)
        return shmap.psum((h * h).sum() / world, "i")

    def inside(w, x):  # the psum is read by the next op
        return torch.tanh(shmap.psum(x @ w, "i")).sum()

    # A loss still on the wire is saved (metrics, a checkpoint) as its value.
    f = shmap.shard_map(loss, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    out = f(shmap.device_put(ws[0], mesh, P()).requires_grad_(), shmap.device_put(x, mesh, P("i")))
    unread = type(out._local_tensor).__name__ == "Deferred" and out._local_tensor._value is None
    buf = io.BytesIO()
    torch.save({"loss": out}, buf)  # (nothing has read it)
    got = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)["loss"]
    want = shmap.shard_map(loss, mesh=sim, in_specs=(P(), P("i")), out_specs=P())(ws[0], x)
    if not (unread and type(got.to_local()) is torch.Tensor and torch.allclose(got.full_tensor(), want, rtol=1e-12)):
        fails.append(f"torch.save of a loss still on the wire (unread before: {unread}): {got} != {want}")

    for name, body, in_flight in (("a loss's psum", loss, True), ("a psum read in the body", inside, False)):
        _, want_v, want_g = run(sim, body)
        in_flight_then_checked, value, g = run(mesh, body)
        if in_flight_then_checked != in_flight:
            fails.append(f"{name}: on the wire after the call and after ones_like, then finished by the "
                         f"backward pass: {in_flight_then_checked} (expected {in_flight})")
        if not (torch.allclose(value, want_v, rtol=1e-12, atol=1e-14) and torch.allclose(g, want_g, rtol=1e-12)):
            fails.append(f"{name}: the value or the gradient differs from the simulated mesh's")
    return fails


def recipe_step_collectives(mesh_flags):
    """{mesh: [(shmap collective, torch.distributed call, elements)]}: what one training step of the
    recipe (tiny model) puts on the wire, per mesh.  The shmap collective is the kind whose launch made
    the call (a small reduction travels as an all_gather, see transports.gathered_reduce); None for a
    call of the guard's own (a signature exchange)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from shmap.backends import transports
    from shmap.train import loop
    from tests.train.tiny import tiny

    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
                         "all_gather_into_tensor") if hasattr(dist, n)]
    pg_all_reduce = dist.ProcessGroup.allreduce  # (shmap launches all_reduces on the process group)
    descriptor = dist.ProcessGroup.__dict__["allreduce"]  # (the class attribute itself, to put back)
    start = transports._start
    current = [None]

    def starting(g, kind, shape, dtype, launch, *args, **kwargs):
        def launched(pg):
            current[0] = kind
            try:
                return launch(pg)
            finally:
                current[0] = None
        return start(g, kind, shape, dtype, launched, *args, **kwargs)

    out = {}
    for flag in mesh_flags:
        run = loop.Run(tiny(flag))
        params, opt = run.fresh_state()
        params, opt, _ = run.step(params, opt, 0)  # (warm: the first step builds its plans)
        calls, real = [], {n: getattr(dist, n) for n in names}

        def counting(name):
            def call(*args, **kwargs):
                calls.append((current[0], name, args[0].numel()))
                return real[name](*args, **kwargs)
            return call

        def counting_all_reduce(pg, tensors, *args):
            calls.append((current[0], "all_reduce", tensors[0].numel()))
            return pg_all_reduce(pg, tensors, *args)
        for n in names:
            setattr(dist, n, counting(n))
        dist.ProcessGroup.allreduce = counting_all_reduce
        transports._start = starting
        try:
            run.step(params, opt, 1)
        finally:
            for n in names:
                setattr(dist, n, real[n])
            dist.ProcessGroup.allreduce = descriptor
            transports._start = start
        out[flag] = calls
    return out


def closed_over_gradient_reads():
    """`torch.autograd.grad` of a closed-over weight hands back its reduction still on the wire (no boundary
    node reads it); `tolist`, `numpy` and `np.asarray` of it refused a tensor subclass -> their values."""
    import numpy as np

    mesh = shmap.make_mesh((torch.distributed.get_world_size(),), ("i",))
    x = torch.arange(8.0, dtype=torch.float64).reshape(8, 1)
    w = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
    y = shmap.shard_map(lambda xb: shmap.psum((xb * w).sum(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x)
    (g,) = torch.autograd.grad(y, w, torch.tensor(1.0, dtype=torch.float64))
    reads = (g.tolist(), g.numpy().tolist(), np.asarray(g).tolist(), g.item())
    # storage-level methods do not dispatch: share_memory_() killed the process
    import copy

    y = shmap.shard_map(lambda xb: shmap.psum((xb * w).sum(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x)
    (g,) = torch.autograd.grad(y, w, torch.tensor(1.0, dtype=torch.float64))
    storage = (type(g).__name__, g.share_memory_() is g and g.is_shared(), copy.deepcopy(g).tolist())
    return reads, storage


def checkpoint_around_a_call():
    """A non-reentrant checkpoint around a shard_mapped loss recomputes up to the last tensor the region saved.
    The output's assembly saved the output (to see an in-place update of it), so the recomputation went on
    through the body's psum: one more all_reduce a step than the simulated mesh's backward."""
    import torch.utils.checkpoint as cp

    out = {}
    for name, processes in (("simulated", False), ("distributed", True)):
        mesh = shmap.make_mesh((torch.distributed.get_world_size(),), ("i",), distributed=processes)
        f = shmap.shard_map(lambda x, w: shmap.pmean((torch.tanh(x @ w) ** 2).mean(), "i"), mesh=mesh,
                            in_specs=(P("i"), P()), out_specs=P())
        w = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3).requires_grad_()
        x = torch.linspace(-2, 2, 32, dtype=torch.float64).reshape(8, 4)
        loss = cp.checkpoint(f, x, w, use_reentrant=False)
        with shmap.comm_log() as log:
            (loss.full_tensor() if processes else loss).backward()
        out[name] = ([e.kind for e in log.events], w.grad.tolist())
    return out
