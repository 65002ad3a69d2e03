"""`shmap.jit` on the distributed mesh: what each spawned rank runs (see test_dist_jit.py).

Every case compares a jitted call with the same program run eagerly on the
same ranks: values and gradients (bit for bit with `backend="eager"`, which
replays eager's kernels; to 1e-12 with Inductor), and the `comm_log` events
of every call, first (the capture) and later (replays).  Arguments are plain
tensors (global values every rank holds) or DTensors laid out as the
in_specs; outputs are DTensors, as eagerly.  Each case returns a list of
failures (empty: all good).
"""
from __future__ import annotations

import time
import warnings

import torch

import shmap
from shmap import P

from dist_compile import _collectives, _run, _same, _value


def _run_whole(f, args):
    """`dist_compile._run` with every gradient whole (a DTensor argument's is a DTensor)."""
    outs, grads, events = _run(f, args)
    return outs, [_value(g) for g in grads], events


def _put(args, mesh, specs):
    return [shmap.device_put(a, mesh, s) for a, s in zip(args, specs)]


def collectives():
    """Every collective, forward and backward, through a jitted call; both backends, plain and DTensor
    arguments, with and without gradients."""
    mesh = shmap.make_mesh((2,), ("i",))
    specs = (P("i"), P("i"), P("i"), P("i"))
    f = shmap.shard_map(_collectives, mesh=mesh, in_specs=specs, out_specs=(P(), P(), P()))
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64),
             torch.randn(6, generator=g).to(torch.bfloat16), torch.full((4,), 2 ** 30, dtype=torch.int32)]
    bad = []
    for name, args in (("plain", plain), ("DTensor", _put(plain, mesh, specs))):
        want = _run_whole(f, args)
        with torch.no_grad(), shmap.comm_log() as log:
            want_ng = [_value(o) for o in f(*args)]
        want_ng_events = log.events
        for backend in ("eager", "inductor"):
            j = shmap.jit(f, backend=backend)
            for call in range(2):  # the capture, then a replay: the same values and events
                bad += _same(f"jit {backend}, {name} arguments, call {call}", _run_whole(j, args), want,
                             exact=backend == "eager")
                with torch.no_grad(), shmap.comm_log() as log:
                    got = j(*args)
                if log.events != want_ng_events:
                    bad.append(f"jit {backend}, {name}, no grad, call {call}: comm_log {log.events} vs "
                               f"{want_ng_events}")
                if not all(type(o).__name__ == "DTensor" for o in got):
                    bad.append(f"jit {backend}, {name}: outputs {[type(o).__name__ for o in got]}, not DTensors")
                if not all(torch.allclose(_value(a), b, rtol=1e-12, atol=1e-12) for a, b in zip(got, want_ng)):
                    bad.append(f"jit {backend}, {name}, no grad, call {call}: {got} vs {want_ng}")
            if j.traces != 2:  # one capture with gradients, one without
                bad.append(f"jit {backend}, {name}: {j.traces} captures, expected 2")
    return bad


def dtensor_gradients():
    """The gradient of a DTensor argument is a DTensor on the argument's layout, as eagerly (sharded,
    replicated); a jitted call's output feeds an eager shard_map, whose gradient flows back through it."""
    mesh = shmap.make_mesh((2,), ("i",))

    def body(w, b, x):
        h = torch.tanh(x @ shmap.all_gather(w, "i", axis=0, tiled=True) + b)
        return shmap.psum((h * h).sum(), "i"), h

    f = shmap.shard_map(body, mesh=mesh, in_specs=(P("i"), P(), P("i")), out_specs=(P(), P("i")))
    g = torch.Generator().manual_seed(4)
    args = _put([torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64),
                 torch.randn(4, 6, generator=g, dtype=torch.float64)], mesh, (P("i"), P(), P("i")))
    bad = []
    results = []
    for fn in (f, shmap.jit(f, backend="eager")):
        leaves = [a.detach().requires_grad_() for a in args[:2]] + [args[2]]
        with shmap.comm_log() as log:
            out, h = fn(*leaves)
            # an eager shard_map after the jitted one, on its output
            tail = shmap.shard_map(lambda v: shmap.psum(v.sum(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(h)
            grads = torch.autograd.grad(out + tail, leaves[:2])
        results.append((grads, log.events))
        for gr, a in zip(grads, leaves):
            if type(gr).__name__ != "DTensor" or gr.placements != a.placements or gr.shape != a.shape:
                bad.append(f"dtensor gradients: {type(gr).__name__} {getattr(gr, 'placements', None)} for "
                           f"{a.placements}")
    (g0, e0), (g1, e1) = results
    bad += [f"dtensor gradients differ: {_value(a)} vs {_value(b)}" for a, b in zip(g0, g1)
            if not torch.equal(_value(a), _value(b))]
    if e0 != e1:
        bad.append(f"dtensor gradients: comm_log differs:\n  jit   {e1}\n  eager {e0}")
    return bad


def output_into_jit():
    """An eager shard_map's output that requires grad (a `GlobalOutput`) is a DTensor argument to a jitted
    call like any other: captured once and replayed (not run eagerly), values and gradients as eager's."""
    mesh = shmap.make_mesh((2,), ("i",))
    head = shmap.shard_map(lambda v: torch.sin(v) * 3, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    f = shmap.shard_map(lambda v: shmap.psum((v * v).sum(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    j = shmap.jit(f, backend="eager")
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)
    bad, want = [], None
    for call, fn in enumerate((f, j, j)):  # eager, the capture, a replay
        leaf = x.clone().requires_grad_()
        out = fn(head(leaf))
        got = (out.to_local().detach(), torch.autograd.grad(out, leaf)[0])
        if want is None:
            want = got
        elif not all(torch.equal(a, b) for a, b in zip(got, want)):
            bad.append(f"output into jit, call {call}: {got} != {want}")
    if len(j._cache) != 1:
        bad.append(f"output into jit: {len(j._cache)} captures, expected 1 (a GlobalOutput argument ran eagerly)")
    return bad


def training_step():
    """The recipe's step shape: DTensor parameters in dicts (FSDP-sharded and replicated), a loss whose
    gradients are taken outside the call, an update under no_grad whose scalars are tensors (a new
    learning rate each step: no new capture); three steps equal eager's bit for bit, comm_log too."""
    mesh = shmap.make_mesh((2,), ("i",))
    specs = {"w": P("i"), "b": P()}

    def loss_body(p, x):
        h = torch.tanh(x @ shmap.all_gather(p["w"], "i", axis=0, tiled=True) + p["b"])
        return shmap.pmean((h * h).mean(), "i")

    def update_body(p, g, lr):
        return {k: p[k] - lr * g[k] for k in p}

    loss = shmap.shard_map(loss_body, mesh=mesh, in_specs=(specs, P("i")), out_specs=P())
    update = shmap.shard_map(update_body, mesh=mesh, in_specs=(specs, specs, P()), out_specs=specs)
    g = torch.Generator().manual_seed(6)
    p0 = {"w": shmap.device_put(torch.randn(6, 5, generator=g, dtype=torch.float64), mesh, P("i")),
          "b": shmap.device_put(torch.randn(5, generator=g, dtype=torch.float64), mesh, P())}
    xs = [shmap.device_put(torch.randn(4, 6, generator=g, dtype=torch.float64), mesh, P("i")) for _ in range(3)]

    def train(loss_fn, update_fn):
        p = {k: v.detach() for k, v in p0.items()}
        out = []
        with shmap.comm_log() as log:
            for k, x in enumerate(xs):
                leaves = [p["w"].requires_grad_(), p["b"].requires_grad_()]
                value = loss_fn(p, x)
                gw, gb = torch.autograd.grad(value, leaves)
                with torch.no_grad():
                    p = update_fn(p, {"w": gw, "b": gb}, torch.tensor(0.1 / (k + 1), dtype=torch.float64))
                out.append(_value(value).detach())
        return out + [_value(v) for v in p.values()], log.events

    want, want_events = train(loss, update)
    jl, ju = shmap.jit(loss, backend="eager"), shmap.jit(update, backend="eager")
    got, events = train(jl, ju)
    bad = [f"training step: {a} vs {b}" for a, b in zip(got, want) if not torch.equal(a, b)]
    if events != want_events:
        bad.append(f"training step: comm_log differs:\n  jit   {events}\n  eager {want_events}")
    if (jl.traces, ju.traces) != (1, 1):
        bad.append(f"training step: {jl.traces} loss and {ju.traces} update captures, expected one each")
    return bad


def pmap_call():
    """A pmap over the world, taking and returning dicts, jitted (both backends): values, gradients and
    comm_log equal eager's, with and without gradients, on the capture and on a replay."""
    f = shmap.pmap(lambda d: {"a": shmap.psum(torch.sin(d["x"]) * d["w"], "i"), "b": d["x"] * 2}, "i",
                   in_axes=({"x": 0, "w": None},))
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)

    def run(fn):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        with shmap.comm_log() as log:
            y = fn({"x": xx, "w": ww})
            grads = torch.autograd.grad(_value(y["a"]).sum() + (_value(y["b"]) ** 2).sum(), (xx, ww))
        with torch.no_grad(), shmap.comm_log() as log_ng:
            y_ng = fn({"x": x, "w": w})
        return ([_value(y[k]).detach() for k in sorted(y)] + [_value(y_ng[k]) for k in sorted(y_ng)], list(grads),
                log.events + log_ng.events)

    want = run(f)
    bad = []
    for backend in ("eager", "inductor"):
        j = shmap.jit(f, backend=backend)
        for call in range(2):
            bad += _same(f"pmap, jit {backend}, call {call}", run(j), want, exact=backend == "eager")
        if j.traces != 2:
            bad.append(f"pmap, jit {backend}: {j.traces} captures, expected 2 (with and without gradients)")
    return bad


def waits_on_the_calling_thread():
    """A replayed all_reduce or all_gather is waited for on the calling thread, in slices, as eagerly
    (shmap's own ops: `shmap/backends/traced.py`); a reduce_scatter, whose gloo wait takes no timeout, on
    the helper thread.  Counted by the helper's submissions during replays (both backends)."""
    from shmap.backends import waits

    mesh = shmap.make_mesh((2,), ("i",))
    x = torch.randn(8, 3000, dtype=torch.float64)  # the psum's 12000 elements: an all_reduce, not a small gather
    bodies = {"psum": (lambda v: shmap.psum(v, "i"), P()),
              "all_gather": (lambda v: shmap.all_gather_invariant(v, "i"), P()),
              "psum_scatter": (lambda v: shmap.psum_scatter(v, "i", tiled=True), P("i"))}
    bad = []
    submit = waits._Waiter.submit
    for backend in ("eager", "inductor"):
        for kind, (body, out) in bodies.items():
            f = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=out)
            j = shmap.jit(f, backend=backend)
            j(x)  # the capture
            calls = []
            waits._Waiter.submit = lambda self, work, _calls=calls: (_calls.append(work), submit(self, work))[1]
            try:
                got = j(x)
            finally:
                waits._Waiter.submit = submit
            if not torch.equal(_value(got), _value(f(x))):
                bad.append(f"calling-thread waits, {backend}, {kind}: a replay differs from eager")
            want = 1 if kind == "psum_scatter" else 0
            if len(calls) != want:
                bad.append(f"calling-thread waits, {backend}, {kind}: {len(calls)} waits on the helper thread, "
                           f"expected {want}")
    return bad


def options_changed_after_capture():
    """A program captured with checks on, called after `configure_distributed(check_collectives=False)`,
    sends what an eager call sends now (no signature in the payload): here rank 1 runs the function
    eagerly, as a rank whose capture failed would, and meets rank 0's call on the wire (a replay of the
    checks-on capture would send the signature, a payload of another size: gloo aborts every rank).
    Back under checks on, the first capture replays again (no third)."""
    import torch.distributed as dist

    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(lambda v: shmap.psum(v * 2, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    x = torch.arange(8192, dtype=torch.float32)
    want = _value(f(x))
    bad = []
    for backend in ("eager", "inductor"):
        j = shmap.jit(f, backend=backend)
        j(x)  # the capture, checks on
        prev = shmap.configure_distributed(check_collectives=False)
        try:
            for call in range(2):  # (the second: the checks-off capture's replay, through the fast path)
                got = j.eager(x) if dist.get_rank() == 1 else j(x)
                if not torch.equal(_value(got), want):
                    bad.append(f"options changed, {backend}, call {call}: {got} vs {want}")
        finally:
            shmap.configure_distributed(**prev)
        if not torch.equal(_value(j(x)), want) or j.traces != (1 if dist.get_rank() == 1 else 2):
            bad.append(f"options changed, {backend}: back under checks on, {j.traces} captures")
    return bad


def one_rank_eager():
    """A call jit could not capture runs `f` eagerly on that rank (jit's rule, for a failure before the
    call communicated), and a capture can fail on one rank only: then that rank's eager collectives
    meet the others' replays, so they must be the same on the wire.  Rank 1 runs `f` eagerly, the
    others the jitted program (the capture, then a replay), checks on and off, both backends, on 2
    and 4 processes (on 4 the small psums run as gathered reductions): every collective but
    ppermute, forward and backward.  Not the same on the wire, so not here (shmap/jit.py's docstring
    says so): a ppermute (point-to-point sends eagerly, an all_to_all in a graph).  With checks off,
    Inductor once launched a reduce_scatter before the psums that came first (a dependency through an
    empty tensor, folded away; `traced._depend`): gloo aborted the eager rank.  Inductor may skip a
    bfloat16 rounding eager code performs (its `emulate_precision_casts` is off by default): on 4
    processes the bfloat16 psum, reduced inside the graph, then differed by an ulp from the eager
    rank's, so Inductor is asked to emulate it here and the values must agree to 1e-12.
    -> [differences]"""
    import functools

    import torch._inductor.config as inductor_config
    import torch.distributed as dist

    from dist_compile import _collectives

    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = shmap.make_mesh((n,), ("i",))
    g = torch.Generator().manual_seed(0)
    body = functools.partial(_collectives, ppermute=lambda v, axis, perm: v)  # (no ppermute: see above)
    f = shmap.shard_map(body, mesh=mesh, in_specs=(P("i"),) * 4, out_specs=(P(), P(), P()))
    args = [torch.randn(4 * n, 4, generator=g, dtype=torch.float64),
            torch.randn(4 * n, 3, generator=g, dtype=torch.float64),
            torch.randn(3 * n, generator=g).to(torch.bfloat16), torch.full((2 * n,), 2 ** 30, dtype=torch.int32)]
    bad = []
    for checks in (True, False):
        prev = shmap.configure_distributed(check_collectives=checks)
        try:
            want = _run_whole(f, args)
            for backend in ("eager", "inductor"):
                j = shmap.jit(f, backend=backend)
                with inductor_config.patch(emulate_precision_casts=True):
                    for call in range(2):  # the capture, then a replay
                        got = _run_whole(j.eager if rank == 1 else j, args)
                        bad += _same(f"{n} processes, checks {'on' if checks else 'off'}, rank 1 eager, the "
                                     f"others jit {backend}, call {call}", got, want, exact=backend == "eager")
        finally:
            shmap.configure_distributed(**prev)
    return bad


def checks_off_partial_permutation():
    """With checks off, `_collectives` (a ppermute that only rank 0 sends in, so the ranks' graphs
    differ) jitted by Inductor and compiled equals eager.  Its backward's psum_scatter is fed, on rank
    1 only, by zeros that depend on no tangent; with no signature trailer nothing tied that collective
    to its place, and AOT autograd's partitioner moved it into rank 1's forward graph: the ranks met
    different collectives and gloo aborted both (`traced._depend`).  -> [differences]"""
    from dist_compile import _collectives

    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(_collectives, mesh=mesh, in_specs=(P("i"),) * 4, out_specs=(P(), P(), P()))
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64),
            torch.randn(6, generator=g).to(torch.bfloat16), torch.full((4,), 2 ** 30, dtype=torch.int32)]
    prev = shmap.configure_distributed(check_collectives=False)
    bad = []
    try:
        want = _run_whole(f, args)
        for name, fn in (("jit inductor", shmap.jit(f)), ("torch.compile", torch.compile(f))):
            for call in range(2):
                bad += _same(f"checks off, {name}, call {call}", _run_whole(fn, args), want, exact=False)
    finally:
        shmap.configure_distributed(**prev)
    return bad


def partial_permutation_dtypes():
    """A ppermute that only rank 0 sends in, and an all_to_all, of bool, int8, float32 and complex64,
    checks on and off, jitted and compiled: equal to eager, dtype included (the zeros of the rank that
    receives nothing are tied to the collective by `traced._depend`, which a bool takes by an or).
    -> [differences]"""
    mesh = shmap.make_mesh((2,), ("i",))

    def body(v):
        return shmap.ppermute(v, "i", [(0, 1)]), shmap.all_to_all(v, "i", 0, 0, tiled=True)
    f = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P("i")))
    bad = []
    for checks in (True, False):
        prev = shmap.configure_distributed(check_collectives=checks)
        try:
            for dt in (torch.bool, torch.int8, torch.float32, torch.complex64):
                x = (torch.arange(8) % 3 == 0) if dt == torch.bool else (torch.arange(8) - 3).to(dt)
                want = [_value(t) for t in f(x)]
                for name, fn in (("jit", shmap.jit(f)), ("torch.compile", torch.compile(f))):
                    got = [_value(t) for t in fn(x)]
                    if not all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want)):
                        bad.append(f"partial ppermute / all_to_all of {dt}, checks {checks}, {name}: {got} vs {want}")
        finally:
            shmap.configure_distributed(**prev)
    return bad


def peer_fails_during_capture():
    """Rank 1 fails before the jitted call; rank 0's capture (AOT autograd's first call runs the program)
    fails in its collective.  Rank 0 must raise that failure, not run `f` again eagerly as for a call
    that could not be captured (which would repeat collectives the others have passed): it returns
    (the error's type, whether jit warned of a fallback, how many times f's body ran eagerly)."""
    import torch.distributed as dist

    from shmap.backends.traced import tracing

    mesh = shmap.make_mesh((2,), ("i",))
    ran = []

    def body(v):
        if not tracing():  # (the capture runs it on traced tensors)
            ran.append(1)
        return shmap.psum(v * 2, "i")
    # (backend "eager": no Inductor compilation, which on a loaded machine could outlast spawn's grace)
    j = shmap.jit(shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()), backend="eager")
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails before the call")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            j(torch.ones(4, requires_grad=True))
            error = None
        except Exception as e:  # noqa: BLE001 - the type is the result
            error = type(e).__name__
    return error, any("could not capture" in str(w.message) for w in caught), len(ran)


def run_cases():
    import traceback

    bad = []
    for case in (collectives, dtensor_gradients, output_into_jit, training_step, pmap_call, waits_on_the_calling_thread,
                 options_changed_after_capture, one_rank_eager, checks_off_partial_permutation,
                 partial_permutation_dtypes):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                bad += case()
            except Exception:  # noqa: BLE001 - reported with the case's name
                bad.append(f"{case.__name__}: {traceback.format_exc()}")
        # a call jit could not capture runs eagerly (equal values): it must not pass as a replay
        bad += [f"{case.__name__}: {w.message}" for w in caught if "could not capture" in str(w.message)]
    return bad


def hang(slow_rank, timeout):
    """`slow_rank` never reaches the jitted psum's replay; the others time out naming it."""
    shmap.configure_distributed(timeout=timeout)
    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.jit(shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()))
    f(torch.ones(4))  # captured on every rank
    if torch.distributed.get_rank() == slow_rank:
        time.sleep(120)
    f(torch.ones(4))
    return "finished"


def mismatch():
    """A jitted program that differs on rank 1 (pmax where rank 0 has psum): reported on every rank."""
    mesh = shmap.make_mesh((2,), ("i",))
    body = (lambda v: shmap.pmax(v, "i")) if torch.distributed.get_rank() == 1 else (lambda v: shmap.psum(v, "i"))
    f = shmap.jit(shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))
    try:
        f(torch.ones(4))
    except shmap.CollectiveMismatchError as e:
        return str(e)
    return "not raised"
