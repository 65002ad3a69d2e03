"""Interop cases for the distributed mesh (importable by spawned ranks).

Custom autograd Functions (a collective in backward), torch.utils.checkpoint
(non-reentrant and reentrant, a collective in the recomputed region; the reentrant form
allows only `.backward()`, which check_case does not use: `reentrant_checkpoint`) and torch.func
transforms (grad, vjp, vmap, jacrev, jacfwd, hessian, with and without a
collective inside the transformed function) inside bodies: every rank runs
each on a simulated and on the distributed mesh and compares outputs,
gradients and comm_log (dist_cases.check_case).  Transforms *of* a
shard_mapped function from outside (`outside_transforms`: every transform
over OUTSIDE's bodies) are compared the same way; their results are plain
tensors on both meshes.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.utils.checkpoint as cp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_cases  # noqa: E402  (puts tests/ on the path)
from custom_functions import MulPsumBack  # noqa: E402
import shmap  # noqa: E402
from shmap import P  # noqa: E402


def _fn_body(w, x):
    return shmap.psum(MulPsumBack.apply(w, x).sum(), "i")


def _region(u):
    return shmap.psum(torch.sin(u), "i") * u


def _ckpt(reentrant):
    def body(x):
        return cp.checkpoint(_region, x, use_reentrant=reentrant)
    return body


def _ckpt_ending(kind):
    """A non-reentrant checkpoint whose region's last saving op is a collective's (`amax` for pmax, the
    mask of a ppermute with a hole): the recomputation stops inside it, and the simulated mesh recorded the
    collective after it, so its backward log missed the recomputed one; or (`sac`) a selective checkpoint
    around a psum, which the distributed mesh's forward launched without dispatching `shmap::psum`, so the
    recomputation's met no cached op."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    regions = {"pmax": lambda u: torch.sin(u) + shmap.pmax(u, "i"),
               "ppermute": lambda u: torch.exp(u) + shmap.ppermute(u, "i", [(0, 1), (1, 2), (2, 3)]),
               "sac": lambda u: torch.tanh(shmap.psum(torch.sin(u), "i")) * u}
    kw = dict(context_fn=functools.partial(create_selective_checkpoint_contexts, [])) if kind == "sac" else {}

    def body(x):
        return cp.checkpoint(regions[kind], x, use_reentrant=False, **kw)
    return body


def _func_grad(w, x):
    return torch.func.grad(lambda w: (torch.tanh(x @ w)).sum())(w)


def _func_grad_psum(w, x):
    return torch.func.grad(lambda w: shmap.psum(torch.tanh(x @ w).sum(), "i"))(w)


def _func_vjp_gather(x):
    y, pull = torch.func.vjp(lambda v: shmap.all_gather(torch.sin(v), "i", axis=0, tiled=True), x)
    return pull(y * y)[0]


def _vmap_collectives(x):
    """Per example r: [4] (the batch is dim 1 of the block): every collective once on the whole batch."""
    def per_example(r):
        return (shmap.psum(r, "i"), shmap.all_gather(r, "i", tiled=True), shmap.psum_scatter(r, "i", tiled=True),
                shmap.ppermute(r, "i", [(0, 1), (1, 2), (2, 3), (3, 0)]), shmap.all_to_all(r, "i", 0, 0, tiled=True),
                shmap.pmax(r * r, "i"))
    return torch.vmap(per_example, in_dims=1, out_dims=1)(x)


def _vmap_axes(x):
    """Per example r: [2, 4] (batch: the block's last dim), collectives along dim 1: the axes shift."""
    def per_example(r):
        return (shmap.all_gather(r, "i", axis=1, tiled=True),
                shmap.all_to_all(r, "i", split_axis=1, concat_axis=0, tiled=True),
                shmap.psum_scatter(torch.sin(r), "i", scatter_dimension=1, tiled=True),
                shmap.all_gather_invariant(torch.cos(r), "i", axis=1, tiled=False))
    return torch.vmap(per_example, in_dims=2)(x)


def _jacrev_psum(x):
    return torch.func.jacrev(lambda r: shmap.psum(torch.sin(r) * r.sum(), "i"))(x[0]).unsqueeze(0)


def _jacfwd_psum(x):
    return torch.func.jacfwd(lambda r: shmap.psum(torch.sin(r) * r.sum(), "i"))(x[0]).unsqueeze(0)


def _hessian_local(x):
    return torch.func.hessian(lambda r: (torch.sin(r) * r.sum()).sum())(x[0]).unsqueeze(0)


def _hessian_psum(x):
    return torch.func.hessian(lambda r: shmap.psum((torch.sin(r) * r.sum()).sum(), "i"))(x[0]).unsqueeze(0)


def _vmap_grad_psum(x):
    return torch.vmap(torch.func.grad(lambda r: shmap.psum(torch.sin(r).sum(), "i")))(x)


def _foreach_adam(a, c):
    """Adam's foreach form on positions of two types, in place on its own intermediates as
    torch.optim's foreach Adam updates, then a per-position norm (a reduction: one physical call on the distributed mesh,
    per position on the simulated one)."""
    xs = [a, c]
    m = torch._foreach_lerp(xs, torch._foreach_mul(xs, 2.0), 0.25)
    v = torch._foreach_mul(xs, xs)
    torch._foreach_addcmul_(v, xs, xs, value=0.1)
    d = torch._foreach_div(torch._foreach_sqrt(v), 3.0)  # (sqrt's backward reads its output)
    torch._foreach_add_(d, 1e-3)
    p, q = torch._foreach_addcdiv(xs, m, d, value=-0.5)
    n_p, n_q = torch._foreach_norm([p, q])
    return p * shmap.psum(n_p ** 2, "i"), q * n_q


def _grad_through(kind):
    """A body taking `torch.autograd.grad` (create_graph: differentiable again from outside) through a
    hook, an autograd.Function with a psum in its backward, or a non-reentrant checkpoint."""
    def body(w, x):
        with torch.enable_grad():
            v = w.detach().requires_grad_()
            if kind == "hook":
                v.register_hook(lambda g: g * 3)
                y = torch.tanh(x * v)
            elif kind == "function":
                y = MulPsumBack.apply(v, x)
            else:
                y = cp.checkpoint(_region, x * v, use_reentrant=False)
            (g,) = torch.autograd.grad(shmap.psum(y.sum(), "i"), v, create_graph=True)
        return g * w
    return body


CASES = [
    *[dist_cases.Case(f"autograd.grad in a body through a {kind}", (4,), ("i",), _grad_through(kind),
                      (P(), P("i")), P(), ((3,), (8, 3))) for kind in ("hook", "function", "checkpoint")],
    dist_cases.Case("torch._foreach_* ops (Adam's form, a norm)", (4,), ("i",), _foreach_adam,
                    (P("i"), P()), (P("i"), P()), ((8, 3), (5,))),
    dist_cases.Case("autograd.Function with psum in backward", (4,), ("i",), _fn_body,
                    (P(), P("i")), P(), ((3,), (8, 3))),
    dist_cases.Case("checkpoint non-reentrant", (4,), ("i",), _ckpt(False), P("i"), P("i"), ((8, 3),)),
    *[dist_cases.Case(f"checkpoint around {kind}", (4,), ("i",), _ckpt_ending(kind), P("i"), P("i"), ((8, 3),))
      for kind in ("pmax", "ppermute", "sac")],
    dist_cases.Case("grad in a body, no collective in the function", (4,), ("i",), _func_grad,
                    (P(), P("i")), P(), ((3,), (8, 3))),
    dist_cases.Case("grad in a body, psum in the function (second order)", (4,), ("i",), _func_grad_psum,
                    (P(), P("i")), P(), ((3,), (8, 3)), second_order=True),
    dist_cases.Case("vjp in a body, all_gather in the function", (4,), ("i",), _func_vjp_gather,
                    P("i"), P("i"), ((8, 3),)),
    dist_cases.Case("vmap in a body: every collective, batch dim 1", (4,), ("i",), _vmap_collectives,
                    P("i"), (P(), P("i"), P("i"), P("i"), P("i"), P()), ((16, 5),)),
    dist_cases.Case("vmap in a body: axis arguments past the batch dim", (4,), ("i",), _vmap_axes,
                    P("i"), (P("i"), P("i"), P("i"), P()), ((8, 4, 3),)),
    dist_cases.Case("vmap in a body, check_vma=False: psum, pmax, all_gather", (4,), ("i",),
                    lambda x: torch.vmap(lambda r: (shmap.psum(r, "i"), shmap.pmax(r, "i"),
                                                    shmap.all_gather(r, "i", tiled=True)), in_dims=1)(x),
                    P("i"), (P("i"), P("i"), P("i")), ((8, 3),), check_vma=False),
    dist_cases.Case("vmap in a body, no collective in the function", (4,), ("i",),
                    lambda x: torch.vmap(lambda r: r * r.sum())(x), P("i"), P("i"), ((8, 3),)),
    dist_cases.Case("jacrev in a body, psum in the function", (4,), ("i",), _jacrev_psum,
                    P("i"), P("i"), ((8, 3),)),
    dist_cases.Case("jacfwd in a body, psum in the function", (4,), ("i",), _jacfwd_psum,
                    P("i"), P("i"), ((8, 3),)),
    dist_cases.Case("hessian in a body, no collective in the function", (4,), ("i",), _hessian_local,
                    P("i"), P("i"), ((8, 3),)),
    dist_cases.Case("hessian in a body, psum in the function", (4,), ("i",), _hessian_psum,
                    P("i"), P("i"), ((8, 3),)),
    dist_cases.Case("vmap of grad in a body, psum in the function", (4,), ("i",), _vmap_grad_psum,
                    P("i"), P("i"), ((8, 3),)),
]


# The backward pass of a vmap in a body: each transpose once, with the per-example shape (as the
# forward reports its collectives).  Both meshes must report this (checked against the simulated
# mesh by check_case, and against this list).
BWD_UNDER_VMAP = {
    "vmap in a body: every collective, batch dim 1": [
        ("all_gather", ("i",), (1,)), ("all_to_all", ("i",), (4,)), ("ppermute", ("i",), (4,)),
        ("psum_scatter", ("i",), (16,))],
    "vmap in a body: axis arguments past the batch dim": [
        ("all_gather", ("i",), (2, 1)), ("all_to_all", ("i",), (8, 1)), ("psum_scatter", ("i",), (2, 16))],
    "vmap in a body, check_vma=False: psum, pmax, all_gather": [
        ("psum", ("i",), (2,)), ("psum_scatter", ("i",), (8,))],
}


def _check_vmap_backward(case) -> list[str]:
    """The distributed backward record of a vmap case against BWD_UNDER_VMAP (spelled out, so a change
    on both meshes at once is caught too)."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s) for s in case.shapes]
    mesh = shmap.make_mesh(case.mesh_shape, case.names)
    outs = shmap.shard_map(case.body, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs,
                           check_vma=case.check_vma)(*[torch.tensor(a) for a in args])
    cots = [rng.standard_normal(tuple(o.shape)) for o in outs]
    got = dist_cases.run_on(mesh, case.body, case.in_specs, case.out_specs, args, cots,
                            check_vma=case.check_vma)["bwd"]
    got = [e[:3] for e in got]
    want = BWD_UNDER_VMAP[case.name]
    return [] if got == want else [f"{case.name}: backward comm_log {got} != {want}"]


def run_cases():
    bad = []
    for case in CASES:
        try:
            found = dist_cases.check_case(case, 0)
            if case.name in BWD_UNDER_VMAP:  # also against the explicit list (both meshes agree on it)
                found += _check_vmap_backward(case)
            bad += found
        except Exception as e:  # noqa: BLE001
            import traceback
            bad.append(f"{case.name}: raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
    bad += [f"nested shard_map in a vmap in a body: {d}" for d in nested_shard_map_in_vmap()]
    return bad


# --------------------------------------------------------------------------
# torch.func from outside a shard_mapped function; one collective per vmap
# --------------------------------------------------------------------------
def _body_loss(w, x):
    return shmap.psum(torch.tanh(x @ w).sum(), "i")


def _body_gather(w, x):  # mesh (2, 2): x [4, 6] P('i', 'j'), w [6] P('j')
    y = shmap.all_gather(x * w, "j", axis=1, tiled=True)
    return shmap.psum(torch.sin(y) * y.sum(), "i")


def _body_movers(w, x):  # x [8, 3] P('i'): every collective that moves data, and a pmax
    y = torch.sin(x * w)
    y = shmap.ppermute(y, "i", [(0, 1), (1, 2), (2, 3), (3, 0)]) + shmap.pmax(y, "i")
    z = shmap.all_to_all(shmap.all_gather(y, "i", tiled=True), "i", 0, 0, tiled=True)
    return shmap.psum_scatter(z * z, "i", tiled=True)


#: (name, mesh shape, names, body, in_specs, out_specs, check_vma, argument shapes)
OUTSIDE = [
    ("psum of a loss", (4,), ("i",), _body_loss, (P(), P("i")), P(), True, ((3,), (8, 3))),
    ("sharded output", (4,), ("i",), lambda w, x: torch.tanh(x @ w), (P(), P("i")), P("i"), True,
     ((3,), (8, 3))),
    ("two axes, all_gather", (2, 2), ("i", "j"), _body_gather, (P("j"), P("i", "j")), P(None, "j"), True,
     ((6,), (4, 6))),
    ("ppermute, pmax, all_gather, all_to_all, psum_scatter", (4,), ("i",), _body_movers, (P(), P("i")),
     P("i"), True, ((3,), (8, 3))),
    ("unreduced output", (4,), ("i",), lambda w, x: torch.sin(x * w).sum(0), (P(), P("i")),
     P(unreduced={"i"}), True, ((3,), (8, 3))),
    ("unreduced input", (4,), ("i",), lambda w, x: shmap.psum(w + 0 * w, "i") * shmap.psum(x.sum(0), "i"),
     (P(unreduced={"i"}), P("i")), P(), True, ((3,), (8, 3))),
    ("check_vma=False", (4,), ("i",), lambda w, x: shmap.psum(torch.cos(x) * w, "i"), (P(), P("i")), P(),
     False, ((3,), (8, 3))),
]


def _transforms(f, args, cot):
    """Every torch.func transform of `f` (first argument transformed where one is picked)."""
    first, rest = args[0], args[1:]

    def loss(*a):
        return (f(*a) * cot).sum()

    def of_first(v):
        return f(v, *rest)

    batch = torch.stack([first, 2 * first])
    return {
        "grad": lambda: torch.func.grad(loss, argnums=tuple(range(len(args))))(*args),
        "vjp": lambda: torch.func.vjp(f, *args)[1](cot),
        "jvp": lambda: torch.func.jvp(f, tuple(args), tuple(torch.cos(a) for a in args)),
        "vmap": lambda: torch.vmap(of_first)(batch),
        "jacrev": lambda: torch.func.jacrev(of_first)(first),
        "jacfwd": lambda: torch.func.jacfwd(of_first)(first),
        "hessian": lambda: torch.func.hessian(lambda v: loss(v, *rest))(first),
        "vmap of grad": lambda: torch.vmap(torch.func.grad(lambda v: loss(v, *rest)))(batch),
        "grad of a closure": lambda: torch.func.grad(lambda s: loss(*args) * s)(torch.tensor(1.5, dtype=first.dtype)),
    }


def _flat(r):
    r = r if isinstance(r, tuple) else (r,)
    return [t for x in r for t in (_flat(x) if isinstance(x, tuple) else (x,))]


def outside_transforms():
    """Differences between the simulated and distributed meshes for torch.func transforms *of*
    shard_mapped functions (values, result types, comm_log), over OUTSIDE x every transform."""
    bad = []
    for name, shape, names, body, in_specs, out_specs, check_vma, shapes in OUTSIDE:
        rng = np.random.default_rng(len(name))
        args = [torch.tensor(rng.standard_normal(s)) for s in shapes]
        got = {}
        for dist in (False, True):
            mesh = shmap.make_mesh(shape, names, distributed=dist)
            f = shmap.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
            cot = torch.tensor(rng.standard_normal(tuple(f(*args).shape))) if not dist else got[False]["cot"]
            got[dist] = {"cot": cot}
            for what, call in _transforms(f, args, cot).items():
                try:
                    with shmap.comm_log() as log:
                        out = _flat(call())
                    got[dist][what] = (out, [(e.kind, e.axes, tuple(e.shape)) for e in log.events])
                except Exception as e:  # noqa: BLE001
                    got[dist][what] = f"{type(e).__name__}: {e}"
        for what in got[False]:
            if what == "cot":
                continue
            sim, dst = got[False][what], got[True][what]
            if isinstance(sim, str) or isinstance(dst, str):
                bad.append(f"{name} / {what}: simulated {sim if isinstance(sim, str) else 'ok'}, "
                           f"distributed {dst if isinstance(dst, str) else 'ok'}")
                continue
            (a, la), (b, lb) = sim, dst
            if [type(t) for t in b] != [torch.Tensor] * len(b):
                bad.append(f"{name} / {what}: distributed results are {[type(t).__name__ for t in b]}")
            elif len(a) != len(b) or any(x.shape != y.shape or not torch.allclose(x, y, rtol=1e-10, atol=1e-12)
                                         for x, y in zip(a, b)):
                bad.append(f"{name} / {what}: values differ: {a} vs {b}")
            if la != lb:
                bad.append(f"{name} / {what}: comm_log {lb} != simulated {la}")
            if not la and any(k in name for k in ("psum", "all_gather")):
                bad.append(f"{name} / {what}: no collective recorded")
    return bad


def dtensor_under_outside_transform():
    """The error for a DTensor argument of a shard_mapped function under torch.func.grad from outside."""
    mesh = shmap.make_mesh((4,), ("i",))
    f = shmap.shard_map(_body_loss, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    w = torch.randn(3, dtype=torch.float64)
    x = shmap.device_put(torch.randn(8, 3, dtype=torch.float64), mesh, P("i"))
    try:
        torch.func.grad(lambda w, x: f(w, x))(w, x)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def vmap_collective_count():
    """How many reductions a vmap of psum over 6 examples launches (the batching rule: one)."""
    from shmap.backends import transports

    mesh = shmap.make_mesh((4,), ("i",))
    calls = []
    real = transports._start

    def counting(g, kind, shape, *args, **kwargs):  # every collective's launch (a small psum's: an all_gather)
        if kind == "psum":
            calls.append(tuple(shape))
        return real(g, kind, shape, *args, **kwargs)

    transports._start = counting
    try:
        with shmap.comm_log() as log:
            shmap.shard_map(lambda v: torch.vmap(lambda c: shmap.psum(c, "i"), in_dims=1, out_dims=1)(v),
                            mesh=mesh, in_specs=P("i"), out_specs=P())(torch.randn(8, 6))
    finally:
        transports._start = real
    return calls, [(e.kind, tuple(e.shape)) for e in log.events]


def _nested_in_vmap(mesh):
    """A body over 'i' vmapping a nested shard_map over 'j' (TakeBlock / AssembleBlocks on the batch),
    and taking its jvp (their forward-mode rules)."""
    def outer(x, w):
        inner = shmap.shard_map(lambda b, w: shmap.psum(torch.sin(b) * w, "j"), mesh=mesh,
                                in_specs=(P("j"), P()), out_specs=P(), axis_names={"j"})
        batched = torch.vmap(inner, in_dims=(1, None), out_dims=1)
        return batched(x, w) + torch.func.jvp(lambda v: batched(v, w), (x,), (torch.cos(x),))[1]
    return shmap.shard_map(outer, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"), axis_names={"i"})


def nested_shard_map_in_vmap():
    """Differences between the simulated and distributed meshes for `_nested_in_vmap` (values, grads)."""
    rng = np.random.default_rng(3)
    x0, w0 = rng.standard_normal((8, 4, 3)), rng.standard_normal((3,))
    res = []
    for dist in (False, True):
        mesh = shmap.make_mesh((2, 2), ("i", "j"), distributed=dist)
        x, w = torch.tensor(x0, requires_grad=True), torch.tensor(w0, requires_grad=True)
        out = _nested_in_vmap(mesh)(x, w)
        out = out.full_tensor() if dist else out
        gx, gw = torch.autograd.grad((out * out).sum(), (x, w))
        res.append((out.detach(), gx, gw))
    return [f"{k}: max err {(a - b).abs().max().item()}" for k, a, b in zip(("out", "gx", "gw"), *res)
            if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-10, atol=1e-10)]


def reentrant_checkpoint():
    """Reentrant torch.utils.checkpoint (it allows only `.backward()`) around a psum, on the
    distributed and a simulated mesh -> (gradients equal, distributed comm_log, simulated comm_log)."""
    out = []
    world = torch.distributed.get_world_size()
    for m in (shmap.make_mesh((world,), ("i",)), shmap.make_mesh((world,), ("i",), distributed=False)):
        f = shmap.shard_map(_ckpt(True), mesh=m, in_specs=P("i"), out_specs=P("i"))
        x = torch.linspace(-1, 1, 4 * world, dtype=torch.float64).reshape(2 * world, 2).requires_grad_()
        with shmap.comm_log() as log:
            y = f(x)
            (y.to_local() if m.is_distributed else y).sum().backward()
        out.append((x.grad, [(e.kind, e.shape) for e in log.events]))
    return torch.allclose(out[0][0], out[1][0], rtol=1e-12, atol=1e-14), out[0][1], out[1][1]


def _shared_state_cases():
    """name -> (module, input, spec): modules whose forward writes a tensor every device shares."""
    torch.manual_seed(0)
    return {
        "BatchNorm1d in training mode": (torch.nn.BatchNorm1d(3), torch.randn(8, 3)),
        "InstanceNorm1d(track_running_stats)": (torch.nn.InstanceNorm1d(3, track_running_stats=True),
                                                torch.randn(8, 3, 5)),
        "Embedding(max_norm)": (torch.nn.Embedding(10, 4, max_norm=1.0), torch.arange(8).reshape(4, 2) % 10),
    }


def shared_state_writes():
    """Each module of `_shared_state_cases` called on sharded data, on the distributed and a simulated
    mesh -> {name: (distributed outcome, simulated outcome, every float state tensor unchanged on both)}.
    Each process wrote its own copy before (the simulated mesh refused): both refuse now, before writing."""
    world = torch.distributed.get_world_size()
    out = {}
    for name in _shared_state_cases():
        got, unchanged = [], True
        for m in (shmap.make_mesh((world,), ("i",)), shmap.make_mesh((world,), ("i",), distributed=False)):
            module, x = _shared_state_cases()[name]
            before = {k: v.clone() for k, v in module.state_dict().items() if v.is_floating_point()}
            try:
                shmap.shard_map(lambda v: module(v), mesh=m, in_specs=P("i"), out_specs=P("i"))(x)
                got.append("ran")
            except shmap.VmaError as e:
                got.append(str(e))
            unchanged &= all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
        out[name] = (got[0], got[1], unchanged)
    return out


def own_running_statistics():
    """Training-mode batch_norm on statistics of each device's own (a copy made in the body, returned) on the
    distributed and a simulated mesh -> (outputs equal, statistics equal)."""
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    x, rm, rv = torch.randn(4 * world, 3), torch.zeros(3 * world), torch.ones(3 * world)

    def own_copy(v, m, s):
        m, s = m.clone(), s.clone()
        return torch.nn.functional.batch_norm(v, m, s, training=True), m, s

    got = []
    for m in (shmap.make_mesh((world,), ("i",)), shmap.make_mesh((world,), ("i",), distributed=False)):
        outs = shmap.shard_map(own_copy, mesh=m, in_specs=P("i"), out_specs=P("i"))(x, rm, rv)
        got.append([o.full_tensor() if m.is_distributed else o for o in outs])
    return torch.equal(got[0][0], got[1][0]), all(torch.equal(a, b) for a, b in zip(got[0][1:], got[1][1:]))


def closure_without_checks():
    """check_vma=False bodies whose closed-over tensor meets a collective or the output before any varying
    value, on the distributed and a simulated mesh -> [(name, gradients equal, comm_log summaries)]: the
    closure is an unmapped argument (its cotangent psum'd), as in JAX; each rank kept its own share."""
    world = torch.distributed.get_world_size()
    bodies = {"psum": (lambda w: shmap.psum(torch.sin(w), "i"), P()),
              "all_gather": (lambda w: shmap.all_gather(torch.sin(w), "i", tiled=True), P()),
              "tile": (lambda w: torch.sin(w), P("i"))}
    out = []
    for name, (body, spec) in bodies.items():
        got = []
        for m in (shmap.make_mesh((world,), ("i",)), shmap.make_mesh((world,), ("i",), distributed=False)):
            w = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64, requires_grad=True)
            y = shmap.shard_map(lambda: body(w), mesh=m, in_specs=(), out_specs=spec, check_vma=False)()
            y = y.full_tensor() if m.is_distributed else y
            with shmap.comm_log() as log:
                (g,) = torch.autograd.grad(y, w, torch.arange(float(y.numel()), dtype=torch.float64).reshape(y.shape))
            got.append(((g * 1).detach(), log.summary()))
        out.append((name, torch.equal(got[0][0], got[1][0]), got[0][1], got[1][1]))
    return out


def manual_sgd_in_a_body():
    """Manual SGD (`p.data.add_(p.grad, alpha=-lr)`) on a float32 weight times float64 data, in a data-parallel
    body, on the distributed and a simulated mesh -> [losses per mesh]: the forward kept using the first
    step's weight (a stale memoised pvary of the promoted copy), on both meshes."""
    torch.manual_seed(0)
    s, x = torch.ones(3, dtype=torch.float32), torch.randn(8, 3, dtype=torch.float64)

    def train(w, xb):
        with torch.enable_grad():
            p = w.detach().clone().requires_grad_()
            losses = []
            for _ in range(3):
                p.grad = None
                loss = shmap.pmean(((xb * p) ** 2).sum(1).mean(), "i")
                loss.backward()
                p.data.add_(p.grad, alpha=-0.1)
                losses.append(loss.detach())
            return torch.stack(losses)

    world = torch.distributed.get_world_size()
    out = []
    for m in (shmap.make_mesh((world,), ("i",)), shmap.make_mesh((world,), ("i",), distributed=False)):
        got = shmap.shard_map(train, mesh=m, in_specs=(P(), P("i")), out_specs=P())(s, x)
        out.append((got.full_tensor() if m.is_distributed else got).tolist())
    return out
