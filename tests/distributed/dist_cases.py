"""What each rank runs in the distributed tests (importable by spawned ranks).

A *case* is a shard_map program with inputs and output cotangents.  Every
rank runs it twice, on a simulated mesh (`make_mesh(..., distributed=False)`)
and on the distributed mesh over the 4-process world, and compares outputs,
first-order gradients of `sum(out * cotangent)`, and the collectives
`comm_log` records forward and backward.  The simulated mesh is the oracle
here (tests/test_generated.py ties it to JAX and the numpy reference).
"""
from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shmap  # noqa: E402
from shmap import P  # noqa: E402

# DTensor warns about sequential all_gathers whenever full_tensor() gathers a
# value split over two mesh axes; the tests do that on purpose.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

RTOL, ATOL = 1e-10, 1e-10


@dataclass
class Case:
    """A program: `body` over a mesh, global input shapes, specs, and check_vma."""

    name: str
    mesh_shape: tuple
    names: tuple
    body: object
    in_specs: tuple
    out_specs: tuple
    shapes: tuple
    check_vma: bool = True
    second_order: bool = False
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------
# Running one program on a mesh
# --------------------------------------------------------------------------
def _events(log):
    return sorted((e.kind, tuple(e.axes), tuple(e.shape), e.dtype, e.bytes) for e in log.events)


def run_on(mesh, body, in_specs, out_specs, args, cots, check_vma=True, second_order=False):
    """(outputs, grads, forward events, backward events[, second-order grads]) as plain tensors."""
    f = shmap.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    xs = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in args]
    with shmap.comm_log() as fwd:
        outs = f(*xs)
    if not isinstance(outs, tuple):
        outs = (outs,)
    placements = None
    if mesh.is_distributed:
        placements = [tuple(o.placements) for o in outs]
        outs = tuple(o.full_tensor() for o in outs)
    loss = sum((o * torch.tensor(c, dtype=o.dtype)).sum() for o, c in zip(outs, cots))
    with shmap.comm_log() as bwd:
        grads = torch.autograd.grad(loss, xs, allow_unused=True, create_graph=second_order)
    result = {
        "outs": [o.detach() for o in outs],
        "grads": [None if g is None else g.detach() for g in grads],
        "fwd": _events(fwd),
        "bwd": _events(bwd),
        "placements": placements,
    }
    if second_order:
        gnorm = sum((g * g).sum() for g in grads if g is not None)
        with shmap.comm_log() as bwd2:
            g2 = torch.autograd.grad(gnorm, xs, allow_unused=True)
        result["grads2"] = [None if g is None else g.detach() for g in g2]
        result["bwd2"] = _events(bwd2)
    return result


def compare(name, sim, dist) -> list[str]:
    """Differences between the simulated and the distributed run of one program."""
    bad = []
    for key in ("outs", "grads", "grads2"):
        if key not in sim:
            continue
        for k, (a, b) in enumerate(zip(sim[key], dist[key])):
            if (a is None) != (b is None):
                bad.append(f"{name}: {key}[{k}] is None on one mesh only")
            elif a is not None and a.dtype != b.dtype:
                bad.append(f"{name}: {key}[{k}] is {a.dtype} simulated but {b.dtype} distributed")
            elif a is not None and (a.shape != b.shape or not torch.allclose(a, b, rtol=RTOL, atol=ATOL)):
                err = (a - b).abs().max().item() if a.shape == b.shape else "shape"
                bad.append(f"{name}: {key}[{k}] differs (max abs err {err}; shapes {tuple(a.shape)} "
                           f"vs {tuple(b.shape)})")
    for key in ("fwd", "bwd", "bwd2"):
        if key in sim and sim[key] != dist[key]:
            bad.append(f"{name}: comm_log {key} differs:\n  simulated   {sim[key]}\n  distributed {dist[key]}")
    return bad


def check_case(case: Case, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    args = [rng.standard_normal(s) for s in case.shapes]
    sim_mesh = shmap.make_mesh(case.mesh_shape, case.names, distributed=False)
    dist_mesh = shmap.make_mesh(case.mesh_shape, case.names)
    kw = dict(check_vma=case.check_vma, second_order=case.second_order)
    # Output shapes come from a simulated run; the cotangents must be the same on every rank.
    probe = shmap.shard_map(case.body, mesh=sim_mesh, in_specs=case.in_specs, out_specs=case.out_specs,
                            check_vma=case.check_vma)(*[torch.tensor(a) for a in args])
    probe = probe if isinstance(probe, tuple) else (probe,)
    cots = [rng.standard_normal(tuple(o.shape)) for o in probe]
    sim = run_on(sim_mesh, case.body, case.in_specs, case.out_specs, args, cots, **kw)
    dist = run_on(dist_mesh, case.body, case.in_specs, case.out_specs, args, cots, **kw)
    bad = compare(case.name, sim, dist)
    want = [shmap.dtensor.placements(dist_mesh, s) for s in _leaf_specs(case.out_specs, len(probe))]
    if dist["placements"] != want:
        bad.append(f"{case.name}: output placements {dist['placements']} != {want}")
    return bad


def _leaf_specs(out_specs, n):
    return list(out_specs) if isinstance(out_specs, (tuple, list)) else [out_specs] * n


def check_program(program, seed) -> list[str]:
    """A generated `programs.Program` (tests/programs.py) as a Case."""
    import programs as pg

    case = Case(
        name="generated", mesh_shape=program.mesh_shape, names=program.axis_names,
        body=pg.render_torch_body(program, check_types=True),
        in_specs=tuple(P(*s) for s in program.in_specs), out_specs=tuple(P(*s) for s in program.out_specs),
        shapes=tuple(i.global_shape for i in program.inputs),
    )
    return [f"{b}\n{program}" for b in check_case(case, seed)]


# --------------------------------------------------------------------------
# Hand-written programs: every collective, tuples in both orders, lifts
# --------------------------------------------------------------------------
def _hand_cases() -> list[Case]:
    C = []
    ij = ((2, 2), ("i", "j"))

    C.append(Case("psum over (j, i) of a (i, j)-split value", *ij,
                  lambda x: shmap.psum(torch.sin(x), ("j", "i")), (P(("i", "j")),), P(), ((8, 3),)))
    C.append(Case("pmean / pmax / pmin", *ij,
                  lambda x: (shmap.pmean(x, "i"), shmap.pmax(x * 2, ("i", "j")), shmap.pmin(x, "j")),
                  (P("i", "j"),), (P(None, "j"), P(), P("i")), ((4, 6),)))
    C.append(Case("all_gather untiled axis=1 over (j, i); invariant tiled over i", *ij,
                  lambda x: (shmap.all_gather(x, ("j", "i"), axis=1),
                             shmap.all_gather_invariant(torch.cos(x), "i", axis=0, tiled=True)),
                  (P(("i", "j")),), (P(("i", "j")), P("j")), ((8, 3),)))
    C.append(Case("psum_scatter untiled over (j, i), tiled over i", *ij,
                  lambda x: (shmap.psum_scatter(x, ("j", "i"), scatter_dimension=1),
                             shmap.psum_scatter(x.sum(1), "i", scatter_dimension=0, tiled=True)),
                  (P(("i", "j")),), (P(("j", "i")), P(("i", "j"))), ((8, 4, 3),)))
    C.append(Case("ppermute over (j, i) with a hole; pshuffle over i", *ij,
                  lambda x: (shmap.ppermute(x, ("j", "i"), [(0, 1), (1, 3), (3, 2)]),
                             shmap.pshuffle(x, "i", [1, 0])),
                  (P(("i", "j")),), (P(("i", "j")), P(("i", "j"))), ((8, 2),)))
    C.append(Case("all_to_all untiled and tiled over (j, i)", *ij,
                  lambda x: (shmap.all_to_all(x, ("j", "i"), 0, 1),
                             shmap.all_to_all(x, ("j", "i"), 1, 0, tiled=True)),
                  (P(("i", "j")),), (P(("j", "i")), P(("j", "i"))), ((16, 8),)))
    C.append(Case("axis_index over (j, i) and a closed-over parameter", *ij,
                  _closure_body(), (P("i"),), P("i"), ((4, 3),)))
    C.append(Case("replicated weight, batch-sharded data: one psum of its gradient", (4,), ("i",),
                  lambda x, w: shmap.psum(((x @ w) ** 2).sum(), "i"), (P("i"), P()), P(), ((8, 5), (5, 2))))
    # an invariant 0-d float64 and a varying 0-d float32: torch promotes the per-device values to float64
    # (the simulated mesh, where the varying one is physically 1-d, gave float32)
    C.append(Case("mixed dtypes of 0-d invariant and varying values", *ij,
                  lambda x: (shmap.psum(x.sum(), ("i", "j")) + x.sum().float() * 0.5).reshape(1),
                  (P(("i", "j")),), P(("i", "j")), ((8, 3),)))
    # an elementwise result of a value split along a later dim, viewed: a process holds it contiguous (the
    # simulated mesh's rows interleaved the devices, and torch refused the view)
    C.append(Case("view of an elementwise result of a value split along dim 1", *ij,
                  lambda x: (torch.relu(x) * 2).view(-1).view_as(x.reshape(-1)) + 1,
                  (P(None, ("i", "j")),), P(("i", "j")), ((4, 8),)))
    C.append(Case("invariant output tiled along an axis it does not vary on", *ij,
                  lambda x: shmap.psum(x, "j"), (P("i", "j"),), P("i", ("j",)), ((4, 4),)))
    C.append(Case("1x4 mesh: tuple spec with a size-1 axis", (1, 4), ("a", "b"),
                  lambda x: shmap.all_gather(x * 2, ("b", "a"), tiled=True), (P(("b", "a")),), P(("a", "b")),
                  ((8, 2),)))
    C.append(Case("check_vma=False: unmapped input and output", *ij,
                  lambda x, w: shmap.psum(x * w, "i"), (P("i"), P()), P(None), ((4, 3), (2, 3)),
                  check_vma=False))
    C.append(Case("check_vma=False: all_gather and psum_scatter", *ij,
                  lambda x: shmap.psum_scatter(shmap.all_gather(x, "j", tiled=True), "j", tiled=True),
                  (P("i", "j"),), P("i", "j"), ((4, 4),), check_vma=False))
    C.append(Case("unreduced output: a Partial DTensor", *ij,
                  lambda x: (shmap.pcast(x * 2, "j", to="unreduced"), shmap.pcast(torch.sin(x), ("i", "j"),
                                                                                  to="unreduced")),
                  (P("i", "j"),), (P("i", unreduced={"j"}), P(None, unreduced={"i", "j"})), ((4, 6),)))
    C.append(Case("unreduced input: a pending sum of a global value", *ij,
                  lambda u, x: shmap.psum(u * 3 + u, "i") * x, (P(None, unreduced={"i"}), P("j")), P("j"),
                  ((4,), (8, 4))))
    C.append(Case("unreduced: accumulate pending gradients, reduce once", (4,), ("i",),
                  lambda x, w: shmap.psum(sum(shmap.pcast(2 * mb.T @ (mb @ w), "i", to="unreduced")
                                              for mb in x.chunk(3)), "i"),
                  (P("i"), P()), P(), ((24, 3), (3,))))
    C.append(Case("second order: psum, all_gather, ppermute", *ij,
                  lambda x, w: shmap.psum((shmap.all_gather(torch.sin(x @ w), ("j", "i"), tiled=True) ** 2).sum()
                                          + shmap.ppermute(x, "i", [(0, 1), (1, 0)]).sum() ** 2, ("i", "j")),
                  (P(("i", "j")), P()), P(), ((8, 3), (3, 2)), second_order=True))
    C.append(Case("second order: psum_scatter, all_to_all, all_gather_invariant", *ij,
                  lambda x: shmap.psum((shmap.all_to_all(shmap.psum_scatter(x * x, ("i", "j"), tiled=True),
                                                          ("j", "i"), 0, 0, tiled=True) ** 3).sum()
                                       + shmap.all_gather_invariant(x, "j", tiled=True).sum(), ("i", "j")),
                  (P("j"),), P(), ((32, 4),), second_order=True))
    # pmax's cotangent is invariant and meets a varying mask: the second derivative needs that lift's psum
    # (the distributed mesh lost every device's term through the cotangent: zeros, silently)
    C.append(Case("second order: pmax and pmin times the varying value", *ij,
                  lambda x: shmap.psum((shmap.pmax(x ** 3, "i") ** 2 * x).sum()
                                       + (shmap.pmin(torch.sin(x), ("i", "j")) * x ** 2).sum(), ("i", "j")),
                  (P(("i", "j")),), P(), ((8, 3),), second_order=True))
    # the transpose of a tiled psum_scatter of a varying value (an all_gather bucketed as a forward gather)
    # came back without its history: the second derivative raised, or lost the term with allow_unused
    C.append(Case("second order: tiled psum_scatter of a varying value", (4,), ("i",),
                  lambda x: torch.sin(shmap.psum_scatter(x, "i", tiled=True)), (P("i"),), P("i"), ((16, 2),),
                  second_order=True))
    # a plain input's gradient with a stride-0 part (the cotangent of a sum) in its gather's bucket: on 4
    # processes the sealed gather's byte view of that part raised
    C.append(Case("second order: a sum's stride-0 cotangent gathered to a plain input", (4,), ("i",),
                  lambda x0, x1: ((x0.sum(1, keepdim=True) + x1.sum()).reshape(-1),
                                  torch.abs(shmap.psum_scatter(x1, "i", tiled=True)).reshape(-1)),
                  (P(None, "i"), P(None, "i")), P("i"), ((8, 8), (4, 4)), second_order=True))
    return C


def _closure_body():
    w = torch.tensor(np.random.default_rng(7).standard_normal((3, 3)), requires_grad=False)

    def body(x):
        k = shmap.axis_index(("j", "i")).to(x.dtype)
        return shmap.psum(torch.tanh(x @ w) * (k + 1), "j")
    return body


HAND = _hand_cases()


# --------------------------------------------------------------------------
# Worker entry points (run on every rank by shmap.spawn)
# --------------------------------------------------------------------------
def run_hand_cases(names=None, seed=0):
    bad = []
    for case in HAND:
        if names is None or case.name in names:
            try:  # errors are deterministic, so every rank skips to the next case together
                bad += check_case(case, seed)
            except Exception as e:  # noqa: BLE001
                import traceback
                bad.append(f"{case.name}: raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
    return bad


def run_programs(programs_and_seeds):
    bad = []
    for program, seed in programs_and_seeds:
        try:
            bad += check_program(program, seed)
        except Exception as e:  # noqa: BLE001
            bad.append(f"raised {type(e).__name__}: {e}\n{program}")
    return bad


def rank():
    import torch.distributed as dist
    return dist.get_rank()


def world():
    import torch.distributed as dist
    return dist.get_world_size()


def guard_settings():
    """This rank's guard settings (`configure_distributed()` returns them unchanged)."""
    import shmap
    return shmap.configure_distributed()


def grad_of_global_input():
    """A sharded plain-tensor input's gradient is whole on every rank (the boundary transpose)."""
    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    x = torch.arange(8.0, dtype=torch.float64).reshape(8, 1).requires_grad_()
    y = shmap.shard_map(lambda b: b * b, mesh=mesh, in_specs=P(("j", "i")), out_specs=P(("j", "i")))(x)
    y.full_tensor().sum().backward()
    return x.grad.flatten().tolist(), math.prod(mesh.axis_sizes)


def fail_on_odd_ranks():
    if rank() % 2:
        raise KeyError(f"odd rank {rank()}")
    return rank()


def run_hand_cases_over_shm(names=None, seed=0):
    """The hand-written cases with collectives moved through shared memory (ShmTransport)."""
    prev = shmap.configure_distributed(transport="shm")
    try:
        return run_hand_cases(names, seed)
    finally:
        shmap.configure_distributed(**prev)
