"""Per-rank checks of the shard_map boundary on a distributed mesh (DTensor in, DTensor out)."""
from __future__ import annotations

import itertools
import logging

import torch

import shmap
from shmap import P

logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _block(x, mesh, spec, coords):
    """The block of global `x` that the device at `coords` holds (by the spec's definition)."""
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        if not axes:
            continue
        n, idx = 1, 0
        for a in axes:
            idx = idx * mesh.shape[a] + coords[a]
            n *= mesh.shape[a]
        b = x.shape[d] // n
        x = x.narrow(d, idx * b, b)
    return x


def dtensor_boundary():
    """Returns a list of failed checks (empty when all hold)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    bad = []

    def check(cond, what):
        if not cond:
            bad.append(what)

    rank = dist.get_rank()
    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    coords = dict(zip(mesh.axis_names, divmod(rank, 2)))
    x = torch.arange(32.0, dtype=torch.float64).reshape(8, 4)

    # device_put: a plain global value -> DTensor; tuple entries in both orders.
    for spec, want in [
        (P(("i", "j")), (Shard(0), Shard(0))),
        (P(("j", "i")), (_StridedShard(0, split_factor=2), Shard(0))),
        (P("j", "i"), (Shard(1), Shard(0))),
        (P(None, "j"), (Replicate(), Shard(1))),
        (P(), (Replicate(), Replicate())),
    ]:
        dt = shmap.device_put(x, mesh, spec)
        check(tuple(dt.placements) == want, f"device_put {spec}: placements {dt.placements} != {want}")
        check(torch.equal(dt.to_local(), _block(x, mesh, spec, coords)), f"device_put {spec}: wrong block")
        check(torch.equal(dt.full_tensor(), x), f"device_put {spec}: full_tensor differs")

    # A DTensor laid out as the in_spec is used in place (its local tensor is the block).
    dt = shmap.device_put(x, mesh, P(("j", "i")))
    seen = {}

    def body(b):
        seen["ptr"] = b._phys.data_ptr()
        seen["repr"] = repr(b)
        return shmap.psum(b * 2, "i")

    f = shmap.shard_map(body, mesh=mesh, in_specs=P(("j", "i")), out_specs=P("j"))
    y = f(dt)
    check(seen["ptr"] == dt.to_local().data_ptr(), "matching DTensor was copied instead of used in place")
    here = f"rank {rank} (i={coords['i']}, j={coords['j']}): tensor("
    check(here in seen["repr"] and "varying along {'i', 'j'}" in seen["repr"], f"printout: {seen['repr']}")
    sim = shmap.shard_map(lambda b: shmap.psum(b * 2, "i"), mesh=shmap.make_mesh((2, 2), ("i", "j"),
                          distributed=False), in_specs=P(("j", "i")), out_specs=P("j"))(x)
    check(torch.allclose(y.full_tensor(), sim), "DTensor input: output differs from the simulated mesh")
    check(tuple(y.placements) == (Replicate(), Shard(0)), f"output placements {y.placements}")

    # A mismatched layout is refused with the fix; device_put is the explicit reshard.
    try:
        f(shmap.device_put(x, mesh, P("i")))
        bad.append("mismatched DTensor layout was accepted")
    except shmap.SpecError as e:
        check("device_put" in str(e) and "P(('j', 'i'))" in str(e), f"unhelpful message: {e}")
    y2 = f(shmap.device_put(shmap.device_put(x, mesh, P("i")), mesh, P(("j", "i"))))
    check(torch.allclose(y2.full_tensor(), sim), "resharded DTensor input: output differs")

    # Gradients flow back to a DTensor leaf with its own placements.
    leaf = shmap.device_put(x, mesh, P(("j", "i"))).detach().requires_grad_()
    (f(leaf).full_tensor() ** 2).sum().backward()
    xs = x.clone().requires_grad_()
    sim_f = shmap.shard_map(lambda b: shmap.psum(b * 2, "i"), mesh=shmap.make_mesh((2, 2), ("i", "j"),
                            distributed=False), in_specs=P(("j", "i")), out_specs=P("j"))
    (sim_f(xs) ** 2).sum().backward()
    check(tuple(leaf.grad.placements) == tuple(leaf.placements), f"grad placements {leaf.grad.placements}")
    check(torch.allclose(leaf.grad.full_tensor(), xs.grad), "DTensor leaf gradient differs")

    # Outputs: tuple entries in both orders, unmapped axes, scalars.
    g = shmap.shard_map(
        lambda b: (b, shmap.psum(b, ("i", "j")), shmap.psum(b.sum(), ("j", "i")), shmap.psum(b, "i")),
        mesh=mesh, in_specs=P(("j", "i")), out_specs=(P(("j", "i")), P(), P(), P("j")))
    outs = g(x)
    want_pl = [(_StridedShard(0, split_factor=2), Shard(0)), (Replicate(), Replicate()),
               (Replicate(), Replicate()), (Replicate(), Shard(0))]
    check([tuple(o.placements) for o in outs] == want_pl, f"output placements {[o.placements for o in outs]}")
    check(torch.equal(outs[0].full_tensor(), x), "P(('j','i')) round trip differs")
    check(outs[2].full_tensor().item() == x.sum().item(), "scalar psum differs")

    # visualize_sharding reads a DTensor's own layout.
    pic = shmap.visualize_sharding(outs[0])
    check(pic == shmap.visualize_sharding(x, mesh, P(("j", "i"))), "visualize_sharding(DTensor) differs")
    check("0:2" in pic and "rank" in pic, f"picture:\n{pic}")

    # make_mesh names both sizes when the shape does not fit the world.
    try:
        shmap.make_mesh((3,), ("i",))
        bad.append("make_mesh((3,)) on a world of 4 was accepted")
    except ValueError as e:
        check("3" in str(e) and "4" in str(e) and "distributed=False" in str(e), f"make_mesh message: {e}")

    # A DTensor given to a simulated mesh is refused with the fix.
    try:
        shmap.shard_map(lambda b: b, mesh=shmap.make_mesh((2, 2), ("i", "j"), distributed=False),
                        in_specs=P("i"), out_specs=P("i"))(dt)
        bad.append("DTensor on a simulated mesh was accepted")
    except TypeError as e:
        check("full_tensor" in str(e), f"message: {e}")

    # A pending sum (Partial DTensor) is used in place as an unreduced input.
    part = shmap.device_put(x, mesh, P("j", unreduced={"i"}))
    check(tuple(part.placements) == (Partial(), Shard(0)), f"unreduced placements {part.placements}")
    check(torch.equal(part.full_tensor(), x), "Partial DTensor's value differs")
    seen.clear()
    h = shmap.shard_map(body, mesh=mesh, in_specs=P("j", unreduced={"i"}), out_specs=P("j"))
    check(torch.allclose(h(part).full_tensor(), 2 * x), "unreduced input: wrong psum")
    check(seen["ptr"] == part.to_local().data_ptr(), "Partial DTensor was copied instead of used in place")
    check("pending sum over 'i'" in shmap.visualize_sharding(part), shmap.visualize_sharding(part))
    # A pending max has no spec.
    from torch.distributed.tensor import DTensor
    pmax = DTensor.from_local(torch.ones(2), mesh.device_mesh, (Partial("max"), Replicate()), run_check=False)
    try:
        shmap.visualize_sharding(pmax)
        bad.append("visualize_sharding of a Partial('max') DTensor was accepted")
    except ValueError as e:
        check("Partial" in str(e) or "pending reduction" in str(e), f"message: {e}")
    bad += _output_cotangents(mesh)
    bad += _one_node_per_weight(mesh)
    bad += _outputs_updated_in_place(mesh)
    bad += _pending_sums_differentiated(mesh)
    bad += _output_local_values(mesh)
    return bad


def _pending_sums_differentiated(mesh):
    """A pending sum's cotangent is replicated (every term of a sum has the sum's cotangent), as
    `DTensor.to_local` places it: a Partial output read through `to_local()` (a shard_map with an unreduced
    in_spec does; `device_put` to an unreduced spec makes one), and a Partial argument of `shmap.jit`, got
    their gradients the world size times too large."""
    bad = []
    x = torch.arange(16.0, dtype=torch.float64).reshape(4, 4)
    spec = P(unreduced={"i"})
    reduce = shmap.shard_map(lambda u: shmap.psum(u, "i"), mesh=mesh, in_specs=spec, out_specs=P())
    pend = shmap.shard_map(lambda b: b, mesh=mesh, in_specs=P("i"), out_specs=spec)  # the row blocks' sum
    ones = torch.ones_like(x)
    for name, run in (("through device_put", lambda v: reduce(shmap.device_put(v, mesh, spec)).full_tensor()),
                      ("an unreduced output into an unreduced in_spec", lambda v: reduce(pend(v)).full_tensor()),
                      ("to_local of an unreduced output", lambda v: pend(v).to_local())):
        v = x.clone().requires_grad_()
        run(v).sum().backward()
        if not torch.equal(v.grad, ones):
            bad.append(f"{name}: gradient {v.grad.flatten().tolist()}, not ones")
    for name, fn in (("eager", reduce), ("jit", shmap.jit(reduce, backend="eager"))):
        d = shmap.device_put(x, mesh, spec).detach().requires_grad_()  # a Partial leaf, value x
        fn(d).full_tensor().sum().backward()
        if not torch.equal(d.grad.full_tensor(), ones):
            bad.append(f"{name}: a Partial argument's gradient {d.grad.full_tensor().flatten().tolist()} "
                       f"({d.grad.placements}), not ones")
    return bad


def _outputs_updated_in_place(mesh):
    """What the simulated mesh does with its plain outputs: an output updated in place after the call is
    refused by a backward pass whose body saved it, with torch's own error (the DTensor's version counter
    is not its block's: the gradient was silently wrong), and differentiated as plain torch does where the
    body did not save it (every such update was refused); an argument returned as it is comes back as a
    new tensor (an update of it would write only this rank's block of the caller's tensor); a plain
    cotangent is the global one; is_grads_batched over a collective is refused with the fix (torch's legacy
    batching has no rule)."""
    from shmap.errors import InPlaceOutputError, TransformError

    bad = []
    spec = P(("i", "j"))
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)
    w = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    for fn in (torch.tanh, torch.sin):  # tanh saves its output, sin its input
        outs = []
        for m in (mesh, shmap.make_mesh(mesh.axis_sizes, mesh.axis_names, distributed=False)):
            out = shmap.shard_map(lambda w, x: fn(x * w), mesh=m, in_specs=(P(), spec), out_specs=spec)(w, x)
            out.mul_(3)
            try:
                (g,) = torch.autograd.grad(((out.full_tensor() if m.is_distributed else out) ** 2).sum(), w)
                outs.append(g)
            except InPlaceOutputError:
                outs.append("InPlaceOutputError")
            except RuntimeError as e:
                outs.append("modified by an inplace operation" if "modified by an inplace operation" in str(e)
                            else str(e))
        want = torch.autograd.grad(((fn(x * w) * 3) ** 2).sum(), w)[0] if fn is torch.sin else \
            "modified by an inplace operation"
        for name, got in zip(("distributed", "simulated"), outs):
            same = torch.allclose(got, want) if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) \
                else got == want
            if not same:
                bad.append(f"{fn.__name__} output updated in place, then backward, {name}: {got}, not {want}")

    again = shmap.shard_map(lambda w, x: torch.tanh(x * w), mesh=mesh, in_specs=(P(), spec), out_specs=spec)
    loss = again(w, x).to_local().sum()
    loss.backward()
    try:
        loss.backward()  # a second pass without retain_graph: torch's own error, not an in-place one
        bad.append("a second backward pass without retain_graph: no error")
    except InPlaceOutputError:
        bad.append("a second backward pass without retain_graph was reported as an in-place update")
    except RuntimeError as e:
        if "second time" not in str(e):
            raise

    y = torch.arange(8.0)
    same = shmap.shard_map(lambda v: v, mesh=mesh, in_specs=spec, out_specs=spec)(y)
    same.to_local().add_(100)
    if not torch.equal(y, torch.arange(8.0)):
        bad.append(f"an argument returned as it is aliases the caller's tensor: {y.tolist()}")

    f = shmap.shard_map(lambda w, x: torch.sin(x * w), mesh=mesh, in_specs=(P(), spec), out_specs=spec)
    (g,) = torch.autograd.grad(f(w, x), w, torch.arange(8, dtype=torch.float64))  # a plain cotangent
    if not torch.allclose(g, (torch.cos(x * 0.5) * x * torch.arange(8)).sum()):
        bad.append(f"a plain cotangent of a sharded output: gradient {g} is not the global one's")
    # ... and of a pending sum (a Partial output): every term's cotangent is the global one (DTensor's own
    # Function raised AttributeError 'placements' on a plain tensor); a DTensor cotangent gives the same.
    xs = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4).requires_grad_()
    pend = shmap.shard_map(lambda v: torch.sin(v) * 2, mesh=mesh, in_specs=P("i", "j"),
                           out_specs=P(None, "j", unreduced={"i"}))
    ct = torch.arange(8, dtype=torch.float64).reshape(2, 4)
    want = 2 * torch.cos(xs.detach()) * ct.repeat(2, 1)
    for how, c in (("plain", ct), ("DTensor", shmap.device_put(ct, mesh, P(None, "j")))):
        (gx,) = torch.autograd.grad(pend(xs), xs, c)
        if not torch.allclose(gx, want):
            bad.append(f"a {how} cotangent of a pending-sum output: gradient {gx} (want {want})")

    x8 = torch.arange(64.0).reshape(8, 8)
    for sp in (P("i"), P(None, ("i", "j")), P("i", "j")):  # a block of its own: no view of the whole tensor
        loc = shmap.device_put(x8, mesh, sp).to_local()
        if not loc.is_contiguous() or loc.untyped_storage().nbytes() != loc.numel() * loc.element_size():
            bad.append(f"device_put {sp}: the block is a view of the whole tensor (strides {loc.stride()}, "
                       f"storage {loc.untyped_storage().nbytes()} bytes)")

    dw = shmap.device_put(torch.ones(8, dtype=torch.float64), mesh, P())
    try:  # a DTensor closed over (not an argument): shmap's message, not DTensor's "mixed" error
        shmap.shard_map(lambda v: v * dw, mesh=mesh, in_specs=spec, out_specs=spec)(x)
        bad.append("a DTensor closed over by a body: no error")
    except shmap.VmaError as e:
        if "closes over" not in str(e) or "full_tensor()" not in str(e):
            bad.append(f"a DTensor closed over by a body: {e}")

    try:
        torch.autograd.grad(f(w, x).to_local(), w, torch.eye(2, dtype=torch.float64), is_grads_batched=True)
        bad.append("is_grads_batched over a collective: no error")
    except TransformError as e:
        if "torch.func.jacrev" not in str(e):
            bad.append(f"is_grads_batched over a collective: the message gives no fix: {e}")
    xs = torch.arange(4.0, requires_grad=True)  # no collective in the body: the gradient's own gather
    o = shmap.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P(("i", "j")), out_specs=P(("i", "j")))(xs)
    try:
        torch.autograd.grad(o.to_local(), xs, torch.ones(3, 1), is_grads_batched=True)
        bad.append("is_grads_batched over a sharded plain argument: no error")
    except TransformError as e:
        if "sharded plain argument" not in str(e) or "torch.func.jacrev" not in str(e):
            bad.append(f"is_grads_batched over a sharded plain argument: {e}")
    return bad


def _one_node_per_weight(mesh):
    """A replicated DTensor weight used with sharded data (DP) enters the graph through one node,
    which also reads its deferred gradient psum: the gradient is right, and no `Arrive` node is left."""
    bad = []
    w = shmap.device_put(torch.arange(4.0), mesh, P()).requires_grad_()
    x = torch.arange(16.0).reshape(4, 4)
    f = shmap.shard_map(lambda x, w: (x * w).sum().reshape(1), mesh=mesh, in_specs=(P(("i", "j")), P()),
                        out_specs=P(("i", "j")))
    out = f(x, w).to_local().sum()
    names, stack, seen = [], [out.grad_fn], set()
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        names.append(type(n).__name__)
        stack.extend(m for m, _ in n.next_functions)
    if not any("ToBlock" in s for s in names) or any("Arrive" in s for s in names):
        bad.append(f"a DTensor weight's boundary nodes: {sorted(set(names))}")
    (g,) = torch.autograd.grad(out, [w])
    if not torch.equal(g.full_tensor(), x.sum(0)):
        bad.append(f"DP weight gradient {g.full_tensor().tolist()} != {x.sum(0).tolist()}")
    return bad


def _output_cotangents(mesh):
    """A DTensor output's cotangent, in its own placements or another's, to first and second order
    (the output is built on a cached spec by `dtensor._FromBlock`, not `DTensor.from_local`)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    bad = []
    f = shmap.shard_map(lambda v: torch.sin(v) * 3, mesh=mesh, in_specs=P(("i", "j")), out_specs=P(("i", "j")))
    x = torch.linspace(-1, 1, 8, dtype=torch.float64).requires_grad_()
    ct = torch.arange(8, dtype=torch.float64)
    want = torch.cos(x.detach()) * 3 * ct
    out = f(x)
    dm = mesh.device_mesh
    other, = torch.autograd.grad(out, x, distribute_tensor(ct, dm, [Replicate(), Replicate()]), retain_graph=True)
    own, = torch.autograd.grad(out, x, distribute_tensor(ct, dm, [Shard(0), Shard(0)]), create_graph=True)
    second, = torch.autograd.grad(own.sum(), x)
    if type(other) is not torch.Tensor or not torch.allclose(other, want):
        bad.append(f"a Replicate cotangent of a Shard output: gradient {other} != {want}")
    if not torch.allclose(own.detach(), want):
        bad.append(f"the output's own cotangent: gradient {own} != {want}")
    if not torch.allclose(second, -torch.sin(x.detach()) * 3 * ct):
        bad.append("the second derivative through a DTensor output differs from -3 sin(x) * ct")
    return bad


def _output_local_values(mesh):
    """An output that requires grad is a `GlobalOutput` (a DTensor whose `to_local`, and `full_tensor` when
    replicated, skip DTensor's spec rebuilding in the backward pass): the values and gradients, to second
    order, are those of DTensor's own methods called on it, also with `grad_placements` and a
    non-contiguous cotangent; ops on it return plain DTensors; torch.save keeps it a DTensor; and an
    output without grad is a plain DTensor."""
    import io

    from torch.distributed.tensor import DTensor, Replicate

    from shmap.dtensor_output import GlobalOutput

    bad = []
    x = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(8, 2).requires_grad_()
    bodies = {P(("i", "j")): lambda v: torch.sin(v) * 3,
              P(): lambda v: shmap.psum(torch.sin(v).T @ v, ("i", "j"))}
    ways = {"to_local": (lambda o: o.to_local(), lambda o: DTensor.to_local(o)),
            "full_tensor": (lambda o: o.full_tensor(), lambda o: DTensor.full_tensor(o)),
            "grad_placements": (lambda o: o.to_local(grad_placements=o.placements),
                                lambda o: DTensor.to_local(o, grad_placements=o.placements)),
            "strided cotangent": (lambda o: o.to_local().t(), lambda o: DTensor.to_local(o).t())}
    for spec, body in bodies.items():
        f = shmap.shard_map(body, mesh=mesh, in_specs=P(("i", "j")), out_specs=spec)
        out = f(x)
        if type(out) is not GlobalOutput or not isinstance(out, DTensor):
            bad.append(f"out_specs {spec}: an output that requires grad is {type(out).__name__}")
        for name, (take, take_plain) in ways.items():
            got, want = take(f(x)), take_plain(f(x))
            ct = torch.arange(1.0, got.numel() + 1, dtype=torch.float64).reshape(got.shape)
            g1, = torch.autograd.grad(got, x, ct, create_graph=True)
            w1, = torch.autograd.grad(want, x, ct, create_graph=True)
            g2, = torch.autograd.grad(g1.sum(), x)
            w2, = torch.autograd.grad(w1.sum(), x)
            if not (torch.equal(got.detach(), want.detach()) and torch.equal(g1.detach(), w1.detach())
                    and torch.equal(g2, w2)):
                bad.append(f"out_specs {spec}, {name}: values or gradients differ from DTensor's own method")
            g0, = torch.autograd.grad(take(f(x)), x, ct)  # (no graph of the backward: the short way)
            if not torch.equal(g0, w1.detach()):
                bad.append(f"out_specs {spec}, {name}: a first-order gradient differs from DTensor's")
    out = f(x)  # (replicated)
    if type(out * 2) is not DTensor or type(out.detach()) is not DTensor:
        bad.append(f"ops on a GlobalOutput: {type(out * 2).__name__}, detach {type(out.detach()).__name__}")
    if tuple(out.placements) != (Replicate(), Replicate()):
        bad.append(f"placements {out.placements}")
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    if type(back) is not DTensor or not torch.equal(back.to_local(), out.to_local().detach()):
        bad.append(f"torch.save of a GlobalOutput loads as {type(back).__name__}")
    later = f(x)  # read without grad below: DTensor's own way, a plain tensor (not a psum still on the wire)
    with torch.no_grad():
        if type(f(x)) is not DTensor:
            bad.append("an output without grad is not a plain DTensor")
        whole = later.full_tensor()
        if type(whole) is not torch.Tensor or not torch.equal(whole, out.to_local().detach()):
            bad.append(f"full_tensor of a GlobalOutput, read without grad: {type(whole).__name__}")
    return bad


def strided_three_axes():
    """On a (2, 2, 2) mesh of 8 ranks: every order of a 3-axis tuple entry, through DTensor."""
    import torch.distributed as dist

    bad = []
    rank = dist.get_rank()
    mesh = shmap.make_mesh((2, 2, 2), ("i", "j", "k"))
    sim = shmap.make_mesh((2, 2, 2), ("i", "j", "k"), distributed=False)
    coords = dict(zip(mesh.axis_names, [(rank >> 2) & 1, (rank >> 1) & 1, rank & 1]))
    x = torch.arange(16.0, dtype=torch.float64).reshape(16, 1)
    for order in itertools.permutations(("i", "j", "k")):
        spec = P(order)
        dt = shmap.device_put(x, mesh, spec)
        if not torch.equal(dt.to_local(), _block(x, mesh, spec, coords)):
            bad.append(f"{spec}: local block {dt.to_local().flatten().tolist()}")
        if not torch.equal(dt.full_tensor(), x):
            bad.append(f"{spec}: full_tensor {dt.full_tensor().flatten().tolist()}")
        body = lambda b: shmap.ppermute(b, order, [(t, (t + 1) % 8) for t in range(8)])  # noqa: E731
        out = shmap.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(dt)
        want = shmap.shard_map(body, mesh=sim, in_specs=spec, out_specs=spec)(x)
        if not torch.equal(out.full_tensor(), want):
            bad.append(f"{spec}: shard_map output {out.full_tensor().flatten().tolist()}")
        # A group over two of the three axes (a subgroup created on first use).
        body2 = lambda b: shmap.psum(b, ("k", "i"))  # noqa: E731
        out2 = shmap.shard_map(body2, mesh=mesh, in_specs=spec, out_specs=P("j"))(dt)
        want2 = shmap.shard_map(body2, mesh=sim, in_specs=spec, out_specs=P("j"))(x)
        if not torch.equal(out2.full_tensor(), want2):
            bad.append(f"{spec}: psum over ('k', 'i') {out2.full_tensor().flatten().tolist()}")
    return bad


def malformed_dtensors():
    """On mesh (i=2, j=2): a DTensor whose local blocks are not its global shape cut by the spec (built with
    from_local from blocks of other shapes: it ran the body on blocks of different shapes per rank) and a
    DTensor on another DeviceMesh (the message showed two identical-looking layouts) -> the messages."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    dm = mesh.device_mesh
    rows = 3 if dm.get_coordinate()[0] == 0 else 1
    bad = DTensor.from_local(torch.ones(rows, 2), dm, [Shard(0), Shard(1)], run_check=False,
                             shape=torch.Size([4, 4]), stride=(4, 1))
    f = shmap.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P("i", "j"), out_specs=P("i", "j"))
    out = []
    for x in (bad, DTensor.from_local(torch.ones(2, 2), DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("i", "j")),
                                      [Shard(0), Shard(1)], run_check=False, shape=torch.Size([4, 4]),
                                      stride=(4, 1))):
        try:
            f(x)
            out.append("accepted")
        except shmap.SpecError as e:
            out.append(str(e))
    good = shmap.device_put(torch.arange(16.0).reshape(4, 4), mesh, P("i", "j"))  # (a well-formed one still runs)
    out.append(torch.equal(f(good).full_tensor(), torch.arange(16.0).reshape(4, 4) * 2))
    return out


def value_shaped_results():
    """On mesh (i=2, j=2): ops whose result's shape depends on the values (unique, a boolean mask, nonzero)
    -> [(case, simulated outcome, its comm_log, distributed outcome, its comm_log)]: where the shapes differ by device
    both meshes raise the same error (each rank knew only its own shape: it went on, and a later collective
    or output mixed blocks of different shapes); where they agree, the same values."""
    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    sim = shmap.make_mesh((2, 2), ("i", "j"), distributed=False)
    x = torch.tensor([[1., 1., 2., 2.], [1., 2., 3., 4.], [5., 5., 5., 5.], [1., 2., 3., 3.]])
    cases = [
        ("unique, varying over (i, j)", lambda v: torch.unique(v)[None], P("i", "j"), P("i", "j")),
        ("a boolean mask, varying over i", lambda v: v[v > 1.5][None], P("i"), P("i")),
        ("nonzero, varying over j", lambda v: torch.nonzero(v > 2).float(), P(None, "j"), P("j")),
        ("unique with counts, the counts differing", lambda v: torch.unique(v, return_counts=True)[1][None].float(),
         P("i", "j"), P("i", "j")),
        ("nonzero, the same shape everywhere", lambda v: torch.nonzero(v > 0).float(), P("i"), P("i")),
        ("a mask, then a psum", lambda v: shmap.psum(v[v > 0].sum(), "i"), P("i"), P()),
        ("nonzero of an invariant value", lambda v: torch.nonzero(v > 2).float(), P(), P()),
    ]
    out = []
    for name, f, ins, outs in cases:
        got = []
        for m in (sim, mesh):
            with shmap.comm_log() as log:
                try:
                    r = shmap.shard_map(f, mesh=m, in_specs=ins, out_specs=outs)(x)
                    got.append(("ok", (r.full_tensor() if hasattr(r, "full_tensor") else r).tolist()))
                except shmap.VmaError as e:
                    got.append(("VmaError", str(e)))
            got.append([(e.kind, e.axes, e.bytes) for e in log.events])
        out.append((name, *got))
    return out
