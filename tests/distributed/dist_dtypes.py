"""What each rank runs in test_dist_dtypes.py: every collective x dtype on both meshes, compared exactly.

Every rank runs the same programs on a simulated mesh and on the distributed
mesh over the world and returns the differences (an empty list when the
meshes agree: same dtype, same bits, same comm_log).  Importable by spawned ranks.
"""
from __future__ import annotations

import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shmap  # noqa: E402
from shmap import P  # noqa: E402

logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.bfloat16, torch.float16,
          torch.complex64]


def sample(dtype, shape, seed=0, exact=True):
    """Integer-valued data (int8 sums wrap), or with exact=False random 16-bit floats whose sums round."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point and not exact:
        return (torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-1])).to(dtype)
    v = torch.randint(-100, 100, shape, generator=g)
    if dtype.is_complex:
        return torch.complex(v.float(), torch.randint(-100, 100, shape, generator=g).float()).to(dtype)
    if dtype.is_floating_point:
        return (v % 64 - 32).to(dtype)
    return v.to(dtype)


def _collectives(dtype, axes, pending):
    """(body, out_specs) computing every collective over `axes` of a block of shape (2, 4).

    `pending`: also return a pending sum (a Partial DTensor on the distributed mesh, which DTensor's
    own `full_tensor()` reduces: gloo lacks int16, and sums 16-bit floats rounding at every step).
    """
    n_perm = [(0, 1), (1, 3), (3, 2)]

    def body(x):
        out = [
            shmap.psum(x, axes),
            shmap.pmean(x, axes),
            shmap.psum_scatter(x, axes, scatter_dimension=1, tiled=True),
            shmap.psum_scatter(x.T, axes, scatter_dimension=0),
            shmap.all_gather(x, axes, tiled=True),
            shmap.all_gather_invariant(x, axes, axis=1),
            shmap.ppermute(x, axes, n_perm),
            shmap.pshuffle(x, axes, [2, 0, 3, 1]),
            shmap.all_to_all(x, axes, 1, 0, tiled=True),
            shmap.all_to_all(x.T, axes, 0, 1),
        ]
        if pending:
            out.append(shmap.pcast(x if dtype != torch.bool else x.to(torch.int32), axes, to="unreduced"))
        if not dtype.is_complex:
            out += [shmap.pmax(x, axes), shmap.pmin(x, axes)]
        return tuple(out)

    t = axes if isinstance(axes, tuple) else (axes,)
    v = P(t)
    outs = [P(), P(), P(None, t), P(t), v, P(), v, v, v, P(None, t)] + ([P(unreduced=set(t))] if pending else [])
    if not dtype.is_complex:
        outs += [P(), P()]
    return body, tuple(outs)


def _events(log):
    return sorted((e.kind, tuple(e.axes), tuple(e.shape), e.dtype, e.bytes) for e in log.events)


def _run(mesh, body, in_spec, out_specs, x):
    f = shmap.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_specs)
    with shmap.comm_log() as log:
        outs = f(x)
    if mesh.is_distributed:  # (DTensor's own gather cannot move int16 over gloo; int32 holds it exactly)
        outs = tuple(o.to(torch.int32).full_tensor().to(o.dtype) if o.dtype == torch.int16 else o.full_tensor()
                     for o in outs)
    return outs, _events(log)


def _compare(name, sim, dist):
    bad = []
    (so, se), (do, de) = sim, dist
    for k, (a, b) in enumerate(zip(so, do)):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            bad.append(f"{name}: output {k}: simulated {a.dtype}{tuple(a.shape)} {a.flatten()[:6].tolist()} vs "
                       f"distributed {b.dtype}{tuple(b.shape)} {b.flatten()[:6].tolist()}")
    if se != de:
        bad.append(f"{name}: comm_log differs:\n  simulated   {se}\n  distributed {de}")
    return bad


def every_collective_every_dtype(transport="gloo"):
    """On a 4-rank world: over 'i' of a (4,) mesh and (on gloo) over ('j', 'i') of a (2, 2) mesh."""
    prev = shmap.configure_distributed(transport=transport) if transport != "gloo" else None
    bad = []
    try:
        meshes = [((4,), ("i",), "i", P("i")), ((2, 2), ("i", "j"), ("j", "i"), P(("i", "j")))]
        for shape, names, axes, spec in meshes if transport == "gloo" else meshes[:1]:
            sim_mesh = shmap.make_mesh(shape, names, distributed=False)
            dist_mesh = shmap.make_mesh(shape, names)
            # (the tuple: one dtype per wire path -- native, counted, byte view / upcast, float32 sums)
            for dtype in DTYPES if len(shape) == 1 else (torch.int8, torch.bool, torch.int16, torch.bfloat16):
                for exact in (True, False) if dtype in (torch.bfloat16, torch.float16) else (True,):
                    body, outs = _collectives(dtype, axes, pending=exact and dtype != torch.int16)
                    x = sample(dtype, (8, 4), seed=len(bad), exact=exact)
                    name = f"{dtype} over {axes} ({transport}{'' if exact else ', rounding sums'})"
                    try:
                        bad += _compare(name, _run(sim_mesh, body, spec, outs, x),
                                        _run(dist_mesh, body, spec, outs, x))
                    except Exception as e:  # noqa: BLE001 - deterministic: every rank skips together
                        import traceback
                        bad.append(f"{name}: raised {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    finally:
        if prev is not None:
            shmap.configure_distributed(**prev)
    return bad


def rounding_sums():
    """Random float32 and float64 blocks, whose sums round at every addition: a small psum or pmean (an
    all_gather reduced on each rank, see transports.gathered_reduce) gives the simulated mesh's bits on
    4 ranks too, over one axis and over two (a ring all_reduce adds in another order), of a value split
    along both or of an invariant one; compiled, too."""
    import torch._dynamo

    bad = []
    ij = ((2, 2), ("i", "j"))
    for shape, names, axes, spec in [((4,), ("i",), "i", P("i")), (*ij, ("j", "i"), P(("j", "i"))),
                                     (*ij, ("i", "j"), P(("i", "j"))),
                                     # two device dims summed at once, in either order; an invariant value
                                     # (its implicit pvary: 4 real copies, whose sum is not 4 * x)
                                     (*ij, ("i", "j"), P("i", "j")), (*ij, ("j", "i"), P("i", "j")),
                                     (*ij, ("i", "j"), P())]:
        sim_mesh = shmap.make_mesh(shape, names, distributed=False)
        dist_mesh = shmap.make_mesh(shape, names)
        for dtype in (torch.float32, torch.float64):
            x = sample(torch.float32, (8, 64), seed=7, exact=False).to(dtype) * 3.1
            body = lambda v: (shmap.psum(v, axes), shmap.pmean(v * v, axes))  # noqa: E731
            sim = _run(sim_mesh, body, spec, (P(), P()), x)
            bad += _compare(f"{dtype} over {axes} (rounding sums)", sim, _run(dist_mesh, body, spec, (P(), P()), x))
            if axes == "i":  # compiled: the graph gathers and reduces as eagerly
                f = torch.compile(shmap.shard_map(body, mesh=dist_mesh, in_specs=spec, out_specs=(P(), P())),
                                  fullgraph=True, backend="aot_eager")
                got = tuple(o.full_tensor() for o in f(x))
                if not all(torch.equal(a, b) for a, b in zip(got, sim[0])):
                    bad.append(f"{dtype} over {axes} (rounding sums, compiled): differs from the simulated mesh")
                torch._dynamo.reset()
    bad += _mixed_dtype_gradients()
    return bad


def _mixed_dtype_gradients():
    """A replicated weight times data of a wider dtype (bfloat16 times float32, float32 times float64):
    the weight's implicit pvary is of its promoted copy, as in JAX, so its cotangent is summed over the
    devices in the wider dtype and rounded once, on both meshes (the distributed mesh summed the
    per-rank gradients already rounded to the weight's dtype: for bfloat16, wrong in the 3rd digit)."""
    bad = []
    sim_mesh = shmap.make_mesh((4,), ("i",), distributed=False)
    dist_mesh = shmap.make_mesh((4,), ("i",))
    gen = torch.Generator().manual_seed(3)
    # Integers whose sums are exact in the wide dtype but not in the narrow one (each rank's too).
    for wd, xd, bits in [(torch.bfloat16, torch.float32, 10), (torch.float32, torch.float64, 23)]:
        x = torch.randint(-2 ** bits, 2 ** bits, (8, 64), generator=gen).to(xd)
        w0 = torch.randint(-8, 8, (64,), generator=gen).to(wd)
        grads = []
        for mesh in (sim_mesh, dist_mesh):
            w = w0.clone().requires_grad_()
            f = shmap.shard_map(lambda w, x: shmap.psum((w * x).sum(), "i"), mesh=mesh, in_specs=(P(), P("i")),
                                out_specs=P())
            out = f(w, x)
            (out.full_tensor() if mesh.is_distributed else out).backward()
            grads.append(w.grad)  # (a plain tensor in, its plain gradient out, on both meshes)
        truth = x.sum(0).to(wd)  # (summed exactly in the wide dtype, rounded once)
        for name, g in zip(("simulated", "distributed"), grads):
            if g.dtype != wd or not torch.equal(g, truth):
                bad.append(f"{wd} weight times {xd} data: the {name} mesh's gradient {g.dtype} "
                           f"{g[:4].tolist()} is not the sum rounded once {truth[:4].tolist()}")
    return bad


def errors_and_unreduced():
    """Errors that must read the same on both meshes, and an implicitly unreduced output."""
    bad = []
    mesh = shmap.make_mesh((4,), ("i",))
    sim = shmap.make_mesh((4,), ("i",), distributed=False)

    def message(m, body, x, in_spec=P("i"), out_spec=P("i")):
        try:
            shmap.shard_map(body, mesh=m, in_specs=in_spec, out_specs=out_spec)(x)
        except shmap.ShmapError as e:
            return type(e).__name__, str(e)
        return None

    def bump(x):
        x.add_(1)
        return x

    for name, body, x in [
        ("complex pmax", lambda x: shmap.pmax(x, "i"), torch.zeros(8, dtype=torch.complex64)),
        ("in-place on an input", bump, torch.zeros(8)),
        ("in-place on a requires_grad input", bump, torch.zeros(8, requires_grad=True)),
    ]:
        a, b = message(sim, body, x), message(mesh, body, x)
        if a is None or a != b:
            bad.append(f"{name}: simulated raised {a}, distributed {b}")
    # Python control flow on a varying value: worded for the mesh it runs on
    got = message(mesh, lambda x: x if x.sum() > 0 else -x, torch.randn(8))
    if got is None or got[0] != "VaryingControlFlowError" or "simulated mesh refuses" in got[1] or "Each process" not in got[1]:
        bad.append(f"varying control flow on the distributed mesh: {got}")
    # out_specs unreduced along an axis the value varies on: a pending sum, as JAX (a Partial DTensor)
    x = torch.arange(8.0)
    f = shmap.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P("i"), out_specs=P(unreduced={"i"}))
    out = f(x)
    from torch.distributed.tensor import Partial

    if tuple(out.placements) != (Partial(),):
        bad.append(f"implicit unreduced output: placements {out.placements}")
    want = shmap.shard_map(lambda b: b * 2, mesh=sim, in_specs=P("i"), out_specs=P(unreduced={"i"}))(x)
    if not torch.equal(out.full_tensor(), want) or want.tolist() != [24.0, 32.0]:
        bad.append(f"implicit unreduced output: {out.full_tensor()} vs simulated {want}")
    return bad


def quick_and_general_collectives():
    """On mesh (i=2, j=2): every psum and all_gather `backends/quick.py` takes (one axis of 2 processes,
    float32/64 and int32/64, any shape, layout, axis and tiling, varying or invariant operands) gives what
    the general path gives, which it is checked against call by call (the general path forced by turning
    the short ways off): the same bits, dtype, shape and type, the same comm_log and the same collective
    count; the simulated mesh's values too; with checks on (default) and off.  The two ways send the same
    bytes: with rank 0 alone taking the short way, every rank gets the same result.  Cases it must leave to
    the general path (bool, bfloat16, an axis tuple, strict mode, a payload too big to seal) are not
    taken.  -> [differences]"""
    from shmap.backends import distributed, quick

    taken = []

    def counting(name):
        def short_way(backend, x, *args):
            out = getattr(quick, name)(backend, x, *args)
            taken.append(out is not None)
            return out
        return short_way

    def general(*args):
        return None

    bad = []
    mesh, sim = shmap.make_mesh((2, 2), ("i", "j")), shmap.make_mesh((2, 2), ("i", "j"), distributed=False)
    ag, agi = shmap.all_gather, shmap.all_gather_invariant
    cases = []
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        cases += [(f"psum of {dtype} over i", dtype, lambda v: shmap.psum(v, "i"), P("i"), P(None, "j"), True),
                  (f"psum of {dtype} over j, a transposed block", dtype, lambda v: shmap.psum(v.T * 1, "j").T,
                   P("i", "j"), P("i"), True),
                  (f"psum of {dtype}, an invariant value", dtype, lambda v: shmap.psum(v[0, 0], "j"), P(), P(), True),
                  (f"all_gather of {dtype} over i, tiled", dtype, lambda v: ag(v, "i", tiled=True), P("i"), P("i"),
                   True),
                  (f"all_gather of {dtype} over i, axis 1", dtype, lambda v: ag(v, "i", axis=1), P("i"), P("i"), True),
                  (f"all_gather_invariant of {dtype} over i, tiled, axis -1", dtype,
                   lambda v: agi(v, "i", axis=-1, tiled=True), P("i"), P(), True),
                  (f"all_gather of {dtype} over j, a transposed block", dtype, lambda v: ag(v.T * 1, "j", tiled=True),
                   P("i", "j"), P("i", "j"), True),
                  (f"all_gather of {dtype}, an invariant value", dtype, lambda v: ag(v, "j"), P(), P("j"), True)]
    cases += [("psum of an empty block", torch.float32, lambda v: shmap.psum(v[:, :0], "i"), P("i"), P(None, "j"),
               True),
              ("psum of bool (counted: the general path)", torch.bool, lambda v: shmap.psum(v, "i"), P("i"),
               P(None, "j"), False),
              ("psum of bfloat16 (summed in float32: the general path)", torch.bfloat16,
               lambda v: shmap.psum(v, "i"), P("i"), P(None, "j"), False),
              ("psum over ('i', 'j') (the general path)", torch.float32, lambda v: shmap.psum(v, ("i", "j")),
               P("i", "j"), P(), False),
              ("all_gather of bool (the general path)", torch.bool, lambda v: ag(v, "i", tiled=True), P("i"), P("i"),
               False),
              ("all_gather of a scalar", torch.float32, lambda v: ag(v[0, 0], "i"), P("i"), P("i"), True),
              ("all_gather of an empty block (the general path)", torch.float32, lambda v: ag(v[:, :0], "i"), P("i"),
               P("i"), False),
              ("all_gather of 320 KiB (too big to seal: the general path)", torch.float32,
               lambda v: ag(v.repeat(1, 6700), "i", tiled=True), P("i"), P("i"), False)]
    real = distributed.Distributed.quick_psum, distributed.Distributed.quick_all_gather
    cases = [(n, dt, f, i, o, q, True) for n, dt, f, i, o, q in cases] + [
        ("psum over i, checks off", torch.float32, cases[0][2], P("i"), P(None, "j"), True, False),
        ("psum over i, strict (the general path)", torch.float32, cases[0][2], P("i"), P(None, "j"), False, "strict"),
        ("all_gather over i, checks off", torch.float32, cases[3][2], P("i"), P("i"), True, False),
        ("all_gather over i, strict (the general path)", torch.float32, cases[3][2], P("i"), P("i"), False, "strict"),
        ("all_gather of 320 KiB, checks off", torch.float32, cases[-1][2], P("i"), P("i"), True, False)]
    for name, dtype, f, ins, outs, quick_expected, checks in cases:
        prev = shmap.configure_distributed(check_collectives=checks)
        x = sample(dtype, (4, 6), seed=len(name))
        results, types = [], {}

        def typed(out, way):
            types[way] = (shmap.vma(out), out.dtype, tuple(out.shape))  # (the per-device type)
            return out
        for way in ("quick", "general", "simulated", "mixed"):  # mixed: rank 0 the short way, the others not
            short = way == "quick" or (way == "mixed" and torch.distributed.get_rank() == 0)
            distributed.Distributed.quick_psum = counting("quick_psum") if short else general
            distributed.Distributed.quick_all_gather = counting("quick_all_gather") if short else general
            del taken[:]
            counter = _guard_counter()
            try:
                results.append(_run(sim if way == "simulated" else mesh, lambda v, f=f, way=way: (typed(f(v), way),),
                                    ins, (outs,), x))
            finally:
                distributed.Distributed.quick_psum, distributed.Distributed.quick_all_gather = real
            if way == "quick":
                used, q_count = any(taken), _guard_counter() - counter
            elif way == "general":
                g_count = _guard_counter() - counter
        if used != quick_expected:
            bad.append(f"{name}: the short way {'was' if used else 'was not'} taken")
        if not types["quick"] == types["general"] == types["simulated"]:
            bad.append(f"{name}: per-device types differ: {types}")
        if q_count != g_count:
            bad.append(f"{name}: {q_count} collectives counted the short way, {g_count} the general way")
        shmap.configure_distributed(**prev)
        bad += _compare(f"{name} (short way vs general)", results[1], results[0])
        bad += _compare(f"{name} (short way vs simulated)", results[2], results[0])
        bad += _compare(f"{name} (rank 0 the short way, the others the general one)", results[3], results[0])
    return bad


def _guard_counter():
    from shmap.backends import watchdog

    return watchdog.watch().counter
