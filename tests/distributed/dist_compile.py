"""torch.compile on the distributed mesh: what each spawned rank runs (see test_dist_compile.py).

Every case compiles with `fullgraph=True` and compares with the same program
run eagerly on the same ranks: values and gradients bit for bit (AOT
autograd with the eager kernels, `aot_eager`: it traces the body and its
functional collectives; Inductor's own arithmetic may differ in the last
bit, so its case compares with `assert_close`), and the `comm_log` events of
every call.  Each case returns a list of failures (empty: all good).
"""
from __future__ import annotations

import functools
import time
import traceback

import optree
import torch

import shmap
from shmap import P


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _capturing(graphs):
    """aot_eager that keeps the text of every graph it compiles (forward and backward)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        return boxed_nop(gm, example_inputs)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def _value(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(f, args):
    """(outputs, gradients, comm_log events) of one forward and backward."""
    args = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    with shmap.comm_log() as log:
        outs = f(*args)
        outs = [_value(o) for o in (outs if isinstance(outs, tuple) else (outs,))]
        diff = [o for o in outs if o.requires_grad]
        grads = torch.autograd.grad(diff, [a for a in args if a.requires_grad],
                                    [torch.cos(torch.ones_like(o)) for o in diff])
    return [o.detach() for o in outs], list(grads), log.events


def _same(name, got, want, exact=True):
    bad = [] if len(got[0] + got[1]) == len(want[0] + want[1]) else [f"{name}: a different number of values"]
    for i, (a, b) in enumerate(zip(got[0] + got[1], want[0] + want[1])):
        ok = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-12, atol=1e-12)
        if not ok:
            bad.append(f"{name}: value {i} differs: {a} vs {b}")
    if got[2] != want[2]:
        bad.append(f"{name}: comm_log differs:\n  compiled {got[2]}\n  eager    {want[2]}")
    return bad


# --------------------------------------------------------------------------
# Every collective, forward and backward
# --------------------------------------------------------------------------
def _collectives(x, y, h, k, ppermute=shmap.ppermute):
    """(`ppermute`: the identity to leave the ppermutes out, `dist_jit.one_rank_eager`)"""
    a = shmap.all_gather_invariant(x, "i", tiled=True)                        # [8, 4]
    b = shmap.psum_scatter(a * y.sum(), "i", scatter_dimension=0, tiled=True)  # [4, 4]
    c = ppermute(b, "i", [(0, 1), (1, 0)]) * shmap.axis_index("i")
    d = shmap.all_to_all(c, "i", 1, 0, tiled=True)                            # [8, 2]
    e = shmap.all_gather(d, "i", axis=1, tiled=False)                         # [8, 2, 2] (varying)
    f = ppermute(e, "i", [(0, 1)])                                            # rank 0 gets zeros
    hs = shmap.psum(h, "i")                                                   # bfloat16: summed in float32
    ks = shmap.psum(k * 1000, "i")                                            # int32: wraps as eagerly
    loss = shmap.pmean(torch.sin(d).sum() + (f * f).sum() + hs.double().sum(), "i")
    return loss, shmap.pmax(x, "i") - shmap.pmin(x, "i"), ks


def collectives():
    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(_collectives, mesh=mesh, in_specs=(P("i"), P("i"), P("i"), P("i")),
                        out_specs=(P(), P(), P()))
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64),
            torch.randn(6, generator=g).to(torch.bfloat16).requires_grad_(),
            torch.full((4,), 2 ** 30, dtype=torch.int32)]
    want = _run(f, args)
    graphs = []
    cf = torch.compile(f, fullgraph=True, backend=_capturing(graphs))
    bad = []
    for call in range(2):  # the second call runs the cached graphs: the same events again
        bad += _same(f"collectives (call {call})", _run(cf, args), want)
    text = "\n".join(graphs)
    for op in (_IN_GRAPH["all_reduce"], _IN_GRAPH["all_gather_into_tensor"],
               "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.all_to_all_single",
               "_c10d_functional.wait_tensor", "shmap.coll_begin", "shmap.coll_wait", "shmap.coll_record",
               "shmap.body_end"):
        if op not in text:
            bad.append(f"collectives: no {op} in the compiled graphs")
    if len(graphs) != 2:
        bad.append(f"collectives: {len(graphs)} graphs compiled, expected a forward and a backward")
    kinds = {e.kind for e in want[2]}
    if not {"all_gather_invariant", "psum_scatter", "ppermute", "all_to_all", "all_gather", "psum", "pmax",
            "pmin"} <= kinds:
        bad.append(f"collectives: eager comm_log lacks kinds: {kinds}")
    return bad


#: a collective as a graph on gloo names it: all_reduce and all_gather are shmap's own ops (waited for on
#: the calling thread: see `shmap/backends/traced.py`), the others functional collectives
_IN_GRAPH = {"all_reduce": "shmap.gloo_all_reduce.default", "all_gather_into_tensor": "shmap.gloo_all_gather.default",
             "reduce_scatter_tensor": "_c10d_functional.reduce_scatter_tensor.default"}


# --------------------------------------------------------------------------
# The backward's reductions bucketed in the graph, as eagerly
# --------------------------------------------------------------------------
def _gloo_ops(fn):
    """{gloo operation: count} of one call of `fn`, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key[5:]: e.count for e in prof.key_averages() if e.key.startswith("gloo:")}


def _tanh_layers(h, ws):
    for w in ws:
        h = torch.tanh(h @ w)
    return h


def _weights_and_input(n, seed):
    """`n` 16x16 float64 weights and an (8, 16) input, from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    ws = [0.3 * torch.randn(16, 16, generator=g, dtype=torch.float64) for _ in range(n)]
    return ws, torch.randn(8, 16, generator=g, dtype=torch.float64)


def bucketed():
    """Six replicated weights (DP: each gradient's psum) and two sharded ones (FSDP: gathered ahead of use;
    each gradient a psum_scatter): the compiled graphs move them in one all_gather (forward), one
    all_reduce and one reduce_scatter (backward), as the eager buckets do, not one collective per weight;
    values and comm_log equal eager's."""
    mesh = shmap.make_mesh((2,), ("i",))

    def body(ws, vs, x):
        h = _tanh_layers(x, ws)
        h = _tanh_layers(h, [shmap.all_gather(v, "i", tiled=True) for v in vs])  # gathered ahead, as the recipe
        return shmap.psum((h * h).sum(), "i")

    f = shmap.shard_map(body, mesh=mesh, in_specs=([P()] * 6, [P("i")] * 2, P("i")), out_specs=P())
    ws, x = _weights_and_input(8, seed=3)

    def run(fn):
        leaves = [w.detach().requires_grad_() for w in ws]
        with shmap.comm_log() as log:
            out = fn(leaves[:6], leaves[6:], x)
            grads = torch.autograd.grad(out, leaves)
        return [_value(out).detach()], list(grads), log.events

    want = run(f)
    graphs = []
    cf = torch.compile(f, fullgraph=True, backend=_capturing(graphs))
    bad = _same("bucketed", run(cf), want)
    eager_ops, compiled_ops = _gloo_ops(lambda: run(f)), _gloo_ops(lambda: run(cf))
    if compiled_ops != eager_ops:
        bad.append(f"bucketed: the compiled call's gloo operations {compiled_ops} differ from eager's {eager_ops}")
    forward, backward = graphs if len(graphs) == 2 else ("", "")
    ops = ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor")
    counts = [{op: g.count(_IN_GRAPH[op]) for op in ops} for g in (forward, backward)]
    want_counts = [{"all_gather_into_tensor": 1, "all_reduce": 1, "reduce_scatter_tensor": 0},  # + the loss's psum
                   {"all_gather_into_tensor": 2, "all_reduce": 1, "reduce_scatter_tensor": 1}]
    # (the backward's two all_gathers assemble the gradients of the sharded weights, passed as plain global
    # tensors: the boundary's traffic, one per input, not the program's collectives)
    if counts != want_counts:
        bad.append(f"bucketed: the (forward, backward) graphs have {counts} collectives, expected {want_counts} "
                   f"(the 2 gathers, the 6 psums and the 2 psum_scatters bucketed); {len(graphs)} graphs")
    if sum(e.kind == "psum" for e in want[2]) != 7:  # comm_log: the program's collectives, not the buckets
        bad.append(f"bucketed: eager comm_log {want[2]}")
    return bad


def full_buckets():
    """A traced backward pass opens no small first bucket: its launch would complete where the graph
    launches it, overlapping nothing.  Six 2 KiB gradients with a 1 KiB first bucket: eagerly two
    reductions (the first weight's alone, then the rest), compiled one; values and comm_log equal."""
    mesh = shmap.make_mesh((2,), ("i",))

    def body(ws, x):
        h = _tanh_layers(x, ws)
        return (h * h).sum().reshape(1)  # each rank's share: the backward's psums are its only collectives

    f = shmap.shard_map(body, mesh=mesh, in_specs=([P()] * 6, P("i")), out_specs=P("i"))
    ws, x = _weights_and_input(6, seed=5)

    def run(fn):
        leaves = [w.detach().requires_grad_() for w in ws]
        with shmap.comm_log() as log:
            out = fn(leaves, x)
            grads = torch.autograd.grad(out.to_local().sum(), leaves)
        return [out.to_local().detach()], list(grads), log.events

    prev = shmap.configure_distributed(first_bucket_bytes=1024)
    try:
        graphs = []
        cf = torch.compile(f, fullgraph=True, backend=_capturing(graphs))
        bad = _same("full buckets", run(cf), run(f))
        eager_ops, compiled_ops = _gloo_ops(lambda: run(f)), _gloo_ops(lambda: run(cf))
    finally:
        shmap.configure_distributed(first_bucket_bytes=prev["first_bucket_bytes"])

    def reductions(ops):  # (nothing else here moves data: the weights are replicated, x needs no gradient)
        return ops.get("all_reduce", 0) + ops.get("all_gather", 0)
    if reductions(eager_ops) != 2 or reductions(compiled_ops) != 1:
        bad.append(f"full buckets: gloo operations eager {eager_ops}, compiled {compiled_ops} (expected 2 "
                   "reductions and 1)")
    backward = graphs[1] if len(graphs) == 2 else ""
    n = backward.count(_IN_GRAPH["all_reduce"]) + backward.count(_IN_GRAPH["all_gather_into_tensor"])
    if n != 1:
        bad.append(f"full buckets: {len(graphs)} graphs; the backward's has {n} reductions, expected 1")
    return bad


def sealed_buckets():
    """FSDP's buckets compiled (every weight gathered up front, one bucket each way), with the size limit
    for a signature in the payload at 0: a bucket still carries its own (as eagerly), so no exchange runs
    beside the data, and compiled equals eager."""
    from shmap.backends import guard, sealed

    mesh = shmap.make_mesh((2,), ("i",))

    def body(x, *ws):
        whole = [shmap.all_gather(w, "i", axis=0, tiled=True) for w in ws]
        h = x
        for w in whole:
            h = torch.tanh(h @ w)
        return shmap.psum(h.sum(), "i")

    f = shmap.shard_map(body, mesh=mesh, in_specs=(P("i"),) * 4, out_specs=P())
    g = torch.Generator().manual_seed(3)
    args = [shmap.device_put(t, mesh, P("i")) for t in  # (DTensors: no plain input's gradient to gather)
            [torch.randn(4, 8, generator=g, dtype=torch.float64)] + [
                torch.randn(8, 8, generator=g, dtype=torch.float64) / 3 for _ in range(3)]]
    exchanges, real = [0], (guard._gather_into, sealed._SEAL_BYTES_LIMIT)

    def counting(*a, **k):
        exchanges[0] += 1
        return real[0](*a, **k)

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    guard._gather_into, sealed._SEAL_BYTES_LIMIT = counting, 0
    try:
        want = _run(f, args)
        eager = exchanges[0]
        _run(cf, args)  # compiles
        exchanges[0] = 0
        got = _run(cf, args)
    finally:
        guard._gather_into, sealed._SEAL_BYTES_LIMIT = real[0], real[1]
    bad = _same("sealed buckets", got, want)
    if exchanges[0] or eager:
        bad.append(f"sealed buckets: {eager} signature exchanges eagerly, {exchanges[0]} compiled (expected 0)")
    return bad


def gathered_outputs():
    """Gathers in one bucket whose values leave the body as they are (one directly, one through an op),
    with and without autograd: compiled equals eager (a bucketed value is read even when no op in the
    body reads it)."""
    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(lambda v, u: (shmap.all_gather(v, "i", tiled=True), shmap.all_gather(u, "i", tiled=True) * 2),
                        mesh=mesh, in_specs=(P("i"), P("i")), out_specs=(P("i"), P("i")))
    args = [torch.arange(8.0, dtype=torch.float64), torch.arange(8.0, dtype=torch.float64) + 10]
    bad = _same("gathered outputs", _run(torch.compile(f, fullgraph=True, backend="aot_eager"), args), _run(f, args))
    with torch.no_grad():
        want = [_value(t) for t in f(*args)]
        got = [_value(t) for t in torch.compile(f, fullgraph=True, backend="aot_eager")(*args)]
    if not all(torch.equal(a, b) for a, b in zip(got, want)):
        bad.append(f"gathered outputs (no grad): {got} vs {want}")
    return bad


def pytree_outputs():
    """DTensor arguments in dicts and dict outputs, as the recipe's update takes and returns them,
    under no_grad: one graph (fullgraph=True), equal to eager.  A dict output used to be a graph
    break, after which Dynamo ran the call's Python and it failed on DTensor arguments."""
    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(lambda p, o, k, lr: ({n: v - lr * o["mu"][n] for n, v in p.items()},
                                             {"mu": {n: v * k for n, v in o["mu"].items()}}),
                        mesh=mesh, in_specs=({"a": P(), "b": P("i")}, {"mu": {"a": P(), "b": P("i")}}, None, None),
                        out_specs=({"a": P(), "b": P("i")}, {"mu": {"a": P(), "b": P("i")}}))
    g = torch.Generator().manual_seed(2)
    put = lambda x, s: shmap.device_put(x, mesh, s)  # noqa: E731
    p = {"a": put(torch.randn(3, generator=g), P()), "b": put(torch.randn(4, generator=g), P("i"))}
    o = {"mu": {"a": put(torch.randn(3, generator=g), P()), "b": put(torch.randn(4, generator=g), P("i"))}}
    with torch.no_grad():
        want = f(p, o, 2, 0.5)
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(p, o, 2, 0.5)
    if type(got[0]) is not dict or list(got[1]["mu"]) != ["a", "b"]:
        return [f"pytree outputs: containers {got}"]
    flat = lambda t: [_value(x) for x in optree.tree_leaves(t)]  # noqa: E731
    if not all(torch.equal(a, b) for a, b in zip(flat(got), flat(want))):
        return [f"pytree outputs: {got} vs {want}"]
    return []


# --------------------------------------------------------------------------
# A training step: loss, torch.autograd.grad, an Adam update, in one graph
# --------------------------------------------------------------------------
def _loss(mesh):
    @shmap.shard_map(mesh=mesh, in_specs=((P("i"), P(), P()), P("i"), P("i")), out_specs=P())
    def loss(ps, x, t):
        w0 = shmap.all_gather(ps[0], "i", tiled=True)    # FSDP: its transpose is a psum_scatter
        h = torch.tanh(x @ w0 + ps[1])
        return shmap.pmean(((h @ ps[2] - t) ** 2).mean(), "i")   # ps[1], ps[2]: the lift's psum (DP)
    return loss


def _adam_step(loss):
    def step(ps, mu, nu, x, t, k):
        value = loss(ps, x, t)
        grads = torch.autograd.grad(value, ps)
        b1, b2, lr = 0.9, 0.999, 0.01
        mu = [b1 * m + (1 - b1) * g for m, g in zip(mu, grads)]
        nu = [b2 * v + (1 - b2) * g * g for v, g in zip(nu, grads)]
        ps = [p - lr * (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + 1e-8) for p, m, v in zip(ps, mu, nu)]
        return value.detach(), [p.detach() for p in ps], mu, nu
    return step


def training_step(dtensors):
    """Plain tensors (global values every rank holds) or DTensors laid out as the in_specs."""
    mesh = shmap.make_mesh((2,), ("i",))
    g = torch.Generator().manual_seed(1)
    ps = [torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64),
          torch.randn(8, 2, generator=g, dtype=torch.float64)]
    x, t = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)
    if dtensors:
        ps = [shmap.device_put(p, mesh, s) for p, s in zip(ps, (P("i"), P(), P()))]
        x, t = shmap.device_put(x, mesh, P("i")), shmap.device_put(t, mesh, P("i"))
    step = _adam_step(_loss(mesh))
    results = []
    for compiled in (False, True):
        fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        state = ([p.detach().clone().requires_grad_() for p in ps], [torch.zeros_like(p) for p in ps],
                 [torch.zeros_like(p) for p in ps])
        with shmap.comm_log() as log:
            with torch._dynamo.config.patch(trace_autograd_ops=True):  # torch.autograd.grad in the graph
                values = []
                for k in (1, 2, 3):  # a tensor: a new value is not a recompile
                    value, *state = fn(*state, x, t, torch.tensor(float(k), dtype=torch.float64))
                    state[0] = [p.requires_grad_() for p in state[0]]
                    values.append(_value(value))
        results.append((values, [_value(p) for p in state[0]], log.events))
    (v0, p0, e0), (v1, p1, e1) = results
    name = f"training step ({'DTensor' if dtensors else 'plain tensor'} inputs)"
    bad = [f"{name}: differs: {a} vs {b}" for a, b in zip(v0 + p0, v1 + p1) if not torch.equal(a, b)]
    if e0 != e1:
        bad.append(f"{name}: comm_log differs:\n  compiled {e1}\n  eager    {e0}")
    if not (e0 and {e.kind for e in e0} == {"all_gather", "psum_scatter", "psum"}):
        bad.append(f"{name}: unexpected events {e0}")
    return bad


# --------------------------------------------------------------------------
# Inductor; compiled and eager calls interleaved; the guard in strict mode
# --------------------------------------------------------------------------
def inductor():
    """Inductor's lowering of the functional collectives and the guard ops, forward and backward (three
    collectives in a row: the guard ops keep their order through Inductor's reorderings); an eager call
    between two compiled ones (one guard counter, one signature sequence)."""
    mesh = shmap.make_mesh((2,), ("i",))

    def body(a, b, c):
        gather = functools.partial(shmap.all_gather, axis_name="i", tiled=True)
        return shmap.psum((gather(a) @ gather(b) @ gather(c)).sum(), "i")

    f = shmap.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i"), P("i")), out_specs=P())
    g = torch.Generator().manual_seed(2)
    args = [torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    want = _run(f, args)
    cf = torch.compile(f, fullgraph=True)
    bad = _same("inductor", _run(cf, args), want, exact=False)
    bad += _same("eager after compiled", _run(f, args), want)
    bad += _same("inductor again", _run(cf, args), want, exact=False)
    return bad


def strict_mismatch():
    """Strict checks, a compiled program that differs on rank 1: reported on every rank, before any data
    moves, and the world goes on."""
    prev = shmap.configure_distributed(check_collectives="strict")
    try:
        mesh = shmap.make_mesh((2,), ("i",))
        rank = _rank()
        body = (lambda v: shmap.pmax(v, "i")) if rank == 1 else (lambda v: shmap.psum(v, "i"))
        f = torch.compile(shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()), fullgraph=True,
                          backend="aot_eager")
        try:
            f(torch.ones(4))
        except shmap.CollectiveMismatchError as e:
            msg = str(e)
            need = ("rank 0: collective #", "psum over 'i'", "rank 1: collective #", "pmax over 'i'")
            bad = [f"strict mismatch: {n!r} not in: {msg}" for n in need if n not in msg]
        else:
            bad = ["strict mismatch: not raised"]
        ok = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
        got = torch.compile(ok, fullgraph=True, backend="aot_eager")(torch.arange(4.0)).full_tensor().tolist()
        if got != [2.0, 4.0]:
            bad.append(f"strict mismatch: the world did not go on: {got}")
        return bad
    finally:
        shmap.configure_distributed(check_collectives=prev["check_collectives"])


def alongside_mismatch():
    """Default checks, a compiled all_gather too large for a signature in its payload (512 KiB in all),
    gathered along another axis on rank 1: the same bytes move, and the signature exchange that ran
    alongside them reports the mismatch on every rank (as eagerly; the world cannot go on after data
    moved under a mismatch).  Returns the message."""
    mesh = shmap.make_mesh((2,), ("i",))
    axis = 1 if _rank() == 1 else 0
    f = torch.compile(shmap.shard_map(lambda v: shmap.all_gather(v, "i", axis=axis, tiled=True), mesh=mesh,
                                      in_specs=P("i"), out_specs=P("i")), fullgraph=True, backend="aot_eager")
    try:
        f(torch.ones(1024, 128))  # each rank's block: 512 x 128 float32 = 256 KiB; the gather moves 2 of them
    except shmap.CollectiveMismatchError as e:
        return str(e)
    return "not raised"


# --------------------------------------------------------------------------
# A hang is not silent: the watched wait inside the compiled graph
# --------------------------------------------------------------------------
def expect_stalled_rank_named(hang_fn):
    """Run `hang_fn(1, 2.0)` on two spawned ranks (rank 1 never reaches a collective; a 2 s timeout):
    within 60 s rank 0 raises CollectiveTimeoutError naming rank 1 and the psum, and rank 1 is killed.
    (The test files' check, for the compiled and the jitted cases.)"""
    import pytest

    t0 = time.monotonic()
    with pytest.raises(shmap.SpawnError) as info:
        shmap.spawn(hang_fn, 1, 2.0, nprocs=2, timeout=60, grace=2.0)
    assert time.monotonic() - t0 < 60
    err = info.value
    assert err.errors[1][0] == "Killed", err
    name, msg, _ = err.errors[0]
    assert name == "CollectiveTimeoutError", (name, msg)
    assert "rank 1: not waiting in any collective" in msg and "psum over 'i'" in msg, msg


def hang(slow_rank, timeout):
    """`slow_rank` never reaches the compiled psum; the others time out naming it."""
    shmap.configure_distributed(timeout=timeout)
    mesh = shmap.make_mesh((2,), ("i",))
    f = torch.compile(shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()),
                      fullgraph=True, backend="aot_eager")
    f(torch.ones(4))  # compiled on every rank
    if _rank() == slow_rank:
        time.sleep(120)
    f(torch.ones(4))
    return "finished"


# --------------------------------------------------------------------------
# The training recipe with --compile (the loss, forward and backward, compiled)
# --------------------------------------------------------------------------
def recipe(mesh="fsdp=2", steps=1):
    """`shmap.train` with `compile=True` on this world gives the eager run's losses, bit for bit.  The
    recipe calls `torch.compile(loss)`; here with AOT autograd and eager kernels (Inductor on the same
    recipe is minutes of C++ compilation on two cores; the `inductor` case covers its lowering)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from shmap.train import loop
    from tests.train.tiny import tiny

    def losses(compile_):
        r = loop.train(tiny(mesh, steps=steps, compile=compile_), log=lambda *a: None)
        return [x["train_loss"] for x in r["history"] if "train_loss" in x] + [r["final_val_loss"]]

    eager = losses(False)  # the recipe's `torch.compile(loss)`, with backend="aot_eager":
    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="aot_eager")
    try:
        compiled = losses(True)
    finally:
        torch.compile = compile_
    if len(eager) != steps + 1 or compiled != eager:
        return [f"recipe --mesh {mesh} --compile: losses {compiled}, eager {eager}"]
    return []


def unread_psum():
    """An eager psum that ends a body (a loss) is handed on still on the wire (`deferred.forward_psum`);
    a compiled graph's first collective finishes it first, as an eager collective does, so its signature
    is checked even if nobody reads it.  Its value is the psum's."""
    mesh = shmap.make_mesh((2,), ("i",))
    loss = shmap.shard_map(lambda x: shmap.psum((x * x).sum(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    cf = torch.compile(shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()),
                       fullgraph=True, backend="aot_eager")
    x = torch.arange(8.0, dtype=torch.float64)
    want = _value(cf(x))  # (compiles)
    out = loss(x.requires_grad_())  # (a psum under autograd: through its Function, where it is handed on)
    local = out._local_tensor
    if type(local).__name__ != "Deferred" or local._value is not None:
        return [f"unread psum: not on the wire after the call ({type(local).__name__})"]
    got = _value(cf(x.detach()))
    bad = [] if local._value is not None else ["unread psum: still on the wire after a compiled collective"]
    if not (torch.equal(got, want) and out.full_tensor().item() == (x * x).sum().item()):  # (exact: integers)
        bad.append(f"unread psum: values {got}, {out.full_tensor()} (expected {want}, {(x * x).sum()})")
    return bad



def read_only_arguments():
    """Arguments stay read-only in a compiled body (storage_key under tracing): an in-place update of one
    raises, an update of its pvary writes a copy, and the caller's tensors are untouched (they were written,
    each rank its own block); a Python number the body closes over is guarded (compile.python_state)."""
    mesh = shmap.make_mesh((2,), ("i",))
    bad = []
    x = torch.ones(4)

    def writes_argument(v):
        v.add_(1)
        return shmap.psum(v.sum(), "i")

    try:
        torch.compile(shmap.shard_map(writes_argument, mesh=mesh, in_specs=P("i"), out_specs=P()),
                      backend="aot_eager")(x)
        bad.append("read-only: an in-place update of an argument ran under compile")
    except Exception as e:  # noqa: BLE001  (Dynamo wraps it: TorchRuntimeError)
        if "in-place update of argument 0 ('v')" not in str(e):
            bad.append(f"read-only: {type(e).__name__}: {str(e)[:300]}")
    if not torch.equal(x, torch.ones(4)):
        bad.append(f"read-only: the caller's tensor became {x.tolist()}")
    w = torch.zeros(2)

    def writes_its_pvary(v, w):
        u = shmap.pvary(w, "i")
        u.add_(v)
        return u

    f = shmap.shard_map(writes_its_pvary, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
    got = _value(torch.compile(f, backend="aot_eager")(torch.arange(4.0), w))
    if not torch.equal(got, torch.arange(4.0)) or not torch.equal(w, torch.zeros(2)):
        bad.append(f"pvary then in place: output {got.tolist()}, the caller's w {w.tolist()} "
                   "(want [0, 1, 2, 3], zeros)")
    scale = {"s": 2.0}
    g = torch.compile(shmap.shard_map(lambda v: shmap.psum(v * scale["s"], "i"), mesh=mesh, in_specs=P("i"),
                                      out_specs=P()), backend="aot_eager")
    first = _value(g(x)).tolist()
    scale["s"] = 5.0
    if (first, _value(g(x)).tolist()) != ([4.0, 4.0], [10.0, 10.0]):
        bad.append(f"python state: {first} then {_value(g(x)).tolist()} (want [4, 4] then [10, 10])")
    return bad


def dynamic_sizes():
    """Symbolic sizes (dynamic=True, or Dynamo's own after a second batch size) with collectives whose wire
    size depends on them: the compiled call raised (a symbolic byte count in a signature's spec)."""
    mesh = shmap.make_mesh((2,), ("i",))

    def body(x):
        g = shmap.all_gather(x * 2, "i", tiled=True)
        return g + shmap.all_to_all(g, "i", 0, 0, tiled=True) + shmap.ppermute(g, "i", [(0, 1), (1, 0)])

    f = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    bad = []
    for kw in (dict(dynamic=True), {}):
        torch._dynamo.reset()
        cf = torch.compile(f, fullgraph=True, backend="aot_eager", **kw)
        for n in (4, 6):
            x = torch.arange(3.0 * n).reshape(n, 3)
            got, want = _value(cf(x)), _value(f(x))
            if not torch.equal(got, want):
                bad.append(f"dynamic sizes {kw} n={n}: {got} != {want}")
    return bad

CASES = {"collectives": collectives, "bucketed": bucketed, "full buckets": full_buckets,
         "sealed buckets": sealed_buckets,
         "gathered outputs": gathered_outputs,
         "pytree outputs": pytree_outputs, "plain step": lambda: training_step(False),
         "DTensor step": lambda: training_step(True), "inductor": inductor, "strict": strict_mismatch,
         "recipe": recipe, "unread psum": unread_psum,
         "read-only arguments": read_only_arguments, "dynamic sizes": dynamic_sizes}


def run_cases(names=None):
    bad = []
    for name in names or CASES:
        try:
            bad += CASES[name]()
        except Exception as e:  # noqa: BLE001
            bad.append(f"{name}: raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
    return bad
