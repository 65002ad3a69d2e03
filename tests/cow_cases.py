"""In-place updates of values that share memory (a pvary or collective result; shmap/cow.py), run
the same way on either mesh: `run(mesh)` -> {case: result}, each result the global values (and
gradients) as lists, or the exception's type and its message's start.  test_cow.py checks them on
the simulated mesh against plain PyTorch; test_dist_interop.py checks that 2 processes give the same."""
from __future__ import annotations

import torch

import shmap
from shmap import P


def _get(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).tolist()


def _pvary_then_write(x):
    z = x * 1
    y = shmap.pvary(z, "i")
    y.mul_(10.0)  # a new value (JAX): z keeps its values on both meshes
    return z, y


def _write_through_view(x):
    y = shmap.pvary(x * 1, "i")
    y[0:2].mul_(10.0)
    return y


def _write_through_data(x):
    y = shmap.pvary(x * 1, "i")
    y.data.mul_(10.0)  # (`.data` is a view too)
    return y


def _write_after_view(x):
    y = shmap.pvary(x * 1, "i")
    v = y[0:2]
    y.mul_(10.0)
    return v


def _write_then_view(x):
    y = shmap.pvary(x * 1, "i")
    y.mul_(10.0)
    y.view(2, 2)[1].add_(shmap.axis_index("i") * 1.0)  # y has its own memory now: views follow it
    return y


def _clone_then_view(x):
    y = shmap.pvary(x * 1, "i").clone()
    y[0:2].mul_(10.0)
    return y


def _gather_argument(x):
    y = shmap.all_gather(x, "i", tiled=True)  # (on the simulated mesh a view of the argument's memory)
    y.mul_(3.0)
    return y


def _input_written_after(coll):
    def body(x):
        z = x * 1
        y = coll(z)
        z.add_(100.0)  # y keeps what the collective saw (a view of z on the simulated mesh; z itself for
        return y  # pvary, and for pmax of an invariant value; a gather waiting in its bucket on processes)
    return body


def _same_dtype_cast(x):
    y = shmap.pvary(x.float() * 1, "i")
    y.float().add_(1.0)  # (`.float()` of a float32 value is a view of it)
    return y


def _aten_overload(x):
    torch.ops.aten.mul_.Tensor(x, 2.0)  # an argument: read-only through aten's in-place overloads too
    return x


def _data_assignment(x):
    x.data = torch.zeros_like(x)
    return x


class _AddOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v):
        v.add_(1.0)
        ctx.mark_dirty(v)
        return v

    @staticmethod
    def backward(ctx, g):
        return g


def _function_write(x):
    return _AddOne.apply(shmap.pvary(x * 1, "i"))  # (the Function's forward sees the shared memory)


def _vmap_write(x):
    return torch.vmap(lambda r: r.add_(1.0))(shmap.pvary(x * 1, "i"))


COLLECTIVES = {
    "psum": (lambda x: shmap.psum(x, "i"), P()),
    "all_gather": (lambda x: shmap.all_gather(x, "i", tiled=True), P("i")),
    "all_gather_invariant": (lambda x: shmap.all_gather_invariant(x, "i", tiled=True), P()),
    "psum_scatter": (lambda x: shmap.psum_scatter(shmap.all_gather(x, "i", tiled=True), "i", tiled=True), P("i")),
    "ppermute": (lambda x: shmap.ppermute(x, "i", [(k, (k + 1) % shmap.axis_size("i"))
                                                   for k in range(shmap.axis_size("i"))]), P("i")),
    "all_to_all": (lambda x: shmap.all_to_all(x, "i", 0, 0, tiled=True), P("i")),
    "pmax": (lambda x: shmap.pmax(x, "i"), P()),
    "pvary": (lambda x: shmap.pvary(x.sum(), "i").reshape(1), P("i")),
}


def run(mesh) -> dict:
    out = {}
    x = torch.arange(4.0, dtype=torch.float32)  # (whatever the default dtype: the ranks use float32)
    cases = {"pvary_then_write": (_pvary_then_write, P(), (P(), P("i"))),
             "write_through_view": (_write_through_view, P(), P("i")),
             "write_after_view": (_write_after_view, P(), P("i")),
             "write_through_data": (_write_through_data, P(), P("i")),
             "write_then_view": (_write_then_view, P(), P("i")),
             "clone_then_view": (_clone_then_view, P(), P("i")),
             "gather_argument": (_gather_argument, P("i"), P("i"))}
    cases.update({"input_written_after: " + k: (_input_written_after(f), P(), P("i") if k != "pmax" else P())
                  for k, f in (("all_gather", lambda z: shmap.all_gather(z, "i", tiled=True)),
                               ("all_to_all", lambda z: shmap.all_to_all(shmap.pvary(z, "i"), "i", 0, 0, tiled=True)),
                               ("pvary", lambda z: shmap.pvary(z, "i")), ("pmax", lambda z: shmap.pmax(z, "i")))})
    cases.update({"same_dtype_cast": (_same_dtype_cast, P(), P("i")), "aten_overload": (_aten_overload, P("i"), P("i")),
                  "data_assignment": (_data_assignment, P(), P()), "function_write": (_function_write, P(), P("i")),
                  "vmap_write": (_vmap_write, P(), P("i")), "function_write_after_clone":
                  (lambda x: _AddOne.apply(shmap.pvary(x * 1, "i").clone()), P(), P("i"))})
    for name, (body, ins, outs) in cases.items():
        xin = x.clone()
        try:
            res = shmap.shard_map(body, mesh=mesh, in_specs=ins, out_specs=outs)(xin)
            out[name] = [_get(r) for r in res] if isinstance(res, tuple) else _get(res)
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e)[:70])
        out[name + " (argument after)"] = xin.tolist()
    for name, (coll, spec) in COLLECTIVES.items():  # the result updated in place, under grad
        w = torch.arange(1.0, 5.0, dtype=torch.float32, requires_grad=True)

        def body(v, coll=coll):
            y = coll(v * 1)
            y.mul_(3.0)
            return y

        res = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=spec)(w)
        (res.full_tensor() if hasattr(res, "full_tensor") else res).pow(2).sum().backward()
        out["in place under grad: " + name] = (_get(res), w.grad.tolist())
    return out


def out_of_place(mesh) -> dict:
    """The collectives' cases written out of place (`y = y * 3`): what the in-place ones must give."""
    out = {}
    for name, (coll, spec) in COLLECTIVES.items():
        w = torch.arange(1.0, 5.0, dtype=torch.float32, requires_grad=True)
        res = shmap.shard_map(lambda v, coll=coll: coll(v * 1) * 3.0, mesh=mesh, in_specs=P("i"), out_specs=spec)(w)
        (res.full_tensor() if hasattr(res, "full_tensor") else res).pow(2).sum().backward()
        out["in place under grad: " + name] = (_get(res), w.grad.tolist())
    return out


def on_processes():
    """run() on 2 processes (spawn target)."""
    r = run(shmap.make_mesh((2,), ("i",)))
    shmap.shutdown_distributed()
    return r
