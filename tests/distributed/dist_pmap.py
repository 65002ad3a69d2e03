"""pmap and nested pmap programs, run the same on the simulated mesh and on 4 processes.

Each `run_*` function returns plain tensors and comm_log summaries; the test
runs it once in its own process (no torch.distributed world: simulated) and
once per rank under `shmap.spawn` (the distributed mesh), and compares.
"""
from __future__ import annotations

import logging

import torch

import shmap
from shmap import P

logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

F64 = torch.float64  # explicit everywhere: test modules change torch's default dtype at import


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grad_of(f, args, cot):
    """(output, gradients, forward comm, backward comm) of sum(f(*args) * cot)."""
    args = [a.detach().clone().requires_grad_() for a in args]
    with shmap.comm_log() as fwd:
        y = f(*args)
    with shmap.comm_log() as bwd:
        grads = torch.autograd.grad((_full(y) * cot).sum(), args)
    return _full(y).detach(), [_full(g).detach() for g in grads], fwd.summary(), bwd.summary()


def _data(*shape, seed=0):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def run_single():
    """A pmap of size 4: collectives, in_axes/out_axes, an invariant output."""
    out = {}
    f = shmap.pmap(lambda x, w: shmap.psum(torch.sin(x) * w, "i"), "i", in_axes=(0, None), out_axes=None)
    out["psum"] = _grad_of(f, [_data(4, 3), _data(3, seed=1)], _data(3, seed=2))

    def ring(x):
        y = shmap.ppermute(x * x, "i", [(k, (k + 1) % 4) for k in range(4)])
        return shmap.all_gather(y, "i") + shmap.axis_index("i")

    g = shmap.pmap(ring, "i", in_axes=1, out_axes=1)
    out["ring"] = _grad_of(g, [_data(2, 4, seed=3)], _data(4, 4, 2, seed=4))
    return out


def run_dtensor_input():
    """A DTensor laid out as the pmap's in_spec (Shard(0) over the world) is used in place."""
    mesh = shmap.make_mesh((4,), ("i",))
    x = _data(4, 3, seed=5)
    xd = shmap.device_put(x, mesh, P("i"))
    f = shmap.pmap(lambda v: shmap.pmean(v * v, "i") + v, "i")
    y = f(xd)
    # Laid out otherwise (on a 2-D mesh of its own): resharded, here for seed 003's nested pmap.
    grid = shmap.make_mesh((2, 2), ("r", "c"))
    data, params = torch.arange(16., dtype=F64).reshape(2, 2, 2, 2), torch.ones(2, 2, 2, 2, dtype=F64) * 0.5
    nested = outer_op(shmap.device_put(data, grid, P("r", "c")), shmap.device_put(params, grid, P(None, "c")))
    return {"placements": [str(p) for p in y.placements], "local_shape": tuple(y.to_local().shape),
            "full": y.full_tensor(), "plain": _full(f(x)), "nested": _full(nested),
            "nested_plain": _full(outer_op(data, params))}


@shmap.pmap(axis_name="model")
def inner_op(x_model_shard, params_model_shard):
    return shmap.psum(x_model_shard * params_model_shard, axis_name="model") * 2


@shmap.pmap(axis_name="data")
def outer_op(x_data_shard, params_data_shard):
    result = inner_op(x_data_shard, params_data_shard)
    return shmap.psum(result, axis_name="data")


def run_nested():
    """Seed 003's nested pmap on a 2x2 grid (rows 'data', columns 'model'), values and gradients."""
    out = {}
    out["small"] = _full(outer_op(torch.arange(4., dtype=F64).reshape(2, 2), torch.ones(2, 2, dtype=F64) * 0.5))
    out["large"] = _full(outer_op(torch.arange(16., dtype=F64).reshape(2, 2, 2, 2),
                                  torch.ones(2, 2, 2, 2, dtype=F64) * 0.5))
    out["grad"] = _grad_of(outer_op, [_data(2, 2, 3, seed=6), _data(2, 2, 3, seed=7)], _data(2, 2, 3, seed=8))

    def mixed(x, w):
        def inner(xm):
            h = torch.tanh(xm * w)
            return shmap.pmean(h, "data") + shmap.all_gather(h, "model", tiled=True)[:1]

        return shmap.psum(shmap.pmap(inner, "model")(x), "data") + x

    f = shmap.pmap(mixed, "data", in_axes=(0, None))
    out["mixed"] = _grad_of(f, [_data(2, 2, 1, seed=9), _data(1, seed=10)], _data(2, 2, 1, seed=11))
    out["shard_map"] = _grad_of(nested_shard_map, [_data(8, seed=12), _data(seed=13)], _data(8, seed=14))
    # An innermost pmap of size 1, where the outer maps leave no process to spare (it was refused on processes).
    three = shmap.pmap(lambda v: shmap.pmap(lambda u: shmap.pmap(
        lambda t: shmap.psum(t * shmap.axis_index("b"), ("a", "b", "c")), "c")(u), "b")(v), "a")
    out["inner size 1"] = _full(three(torch.arange(4., dtype=F64).reshape(2, 2, 1)))
    return out


def nested_shard_map(x, w):
    """A nested shard_map over the free axis 'j' of mesh (i=2, j=2)."""
    mesh = shmap.make_mesh((2, 2), ("i", "j"))

    def inner(x, w):
        return shmap.psum(torch.sin(x) * w, "j") + shmap.psum(x, "i")

    def outer(x, w):
        y = shmap.shard_map(inner, mesh=mesh, in_specs=(P("j"), P()), out_specs=P("j"), axis_names={"j"})(x, w)
        return y * 2 + x

    return shmap.shard_map(outer, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"), axis_names={"i"})(x, w)


def run_errors():
    """Messages for sizes that do not fit the world (returns them, or None where nothing raised)."""
    msgs = {}
    try:
        shmap.pmap(lambda v: v, "i")(torch.ones(8, dtype=F64))
    except ValueError as e:
        msgs["larger"] = str(e)
    try:
        shmap.pmap(lambda v: shmap.pmap(lambda u: u, "j")(v), "i")(torch.ones(2, 4, dtype=F64))
    except ValueError as e:
        msgs["nested"] = str(e)
    return msgs


def run_compiled():
    """torch.compile (fullgraph) of a pmap over the world taking and returning dicts, forward and
    backward, against the same pmap run eagerly; compiled first, so the mesh is created under
    tracing.  A pmap smaller than the world with autograd is refused with a clear error there."""
    # Compiled first, forward only: a pmap smaller than the world, and a nested pmap, build their meshes
    # (and process groups) while the call is traced; new axis names, so nothing was built eagerly before.
    inner = shmap.pmap(lambda b: shmap.psum(b, "m"), "m")
    first = {}
    for name, fn, arg in (("half", shmap.pmap(lambda v: shmap.psum(v * 2, "h"), "h"), _data(2, 3, seed=9)),
                          ("nested", shmap.pmap(lambda a: inner(a), "d"), _data(2, 2, 3, seed=10))):
        got = _full(torch.compile(fn, fullgraph=True, backend="aot_eager")(arg))
        first[name] = torch.equal(got, _full(fn(arg)))

    f = shmap.pmap(lambda d: {"a": shmap.psum(torch.sin(d["x"]) * d["w"], "i"), "b": d["x"] * 2}, "i",
                   in_axes=({"x": 0, "w": None},))
    x, w = _data(4, 3, seed=6), _data(3, seed=7)

    def run(fn):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        with shmap.comm_log() as log:
            y = fn({"x": xx, "w": ww})
            grads = torch.autograd.grad(_full(y["a"]).sum() + (_full(y["b"]) ** 2).sum(), (xx, ww))
        return sorted(y), [_full(y[k]).detach() for k in sorted(y)], list(grads), log.summary()

    got = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    want = run(f)
    out = {"keys": got[0], "equal": all(torch.equal(a, b) for a, b in zip(got[1] + got[2], want[1] + want[2])),
           "comm": (got[3], want[3]), "first": first}
    half = shmap.pmap(lambda v: shmap.psum(v, "i"), "i")
    try:
        v = _data(2, 3, seed=8).requires_grad_()
        torch.compile(half, fullgraph=True, backend="aot_eager")(v)
        out["half"] = None
    except Exception as e:  # noqa: BLE001 - Dynamo wraps it
        out["half"] = str(e)
    return out


def run_all():
    import torch.distributed as dist

    out = {"single": run_single(), "nested": run_nested(), "errors": run_errors(), "compiled": run_compiled()}
    if dist.is_initialized():
        out["dtensor"] = run_dtensor_input()
    return out
