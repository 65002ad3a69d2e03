"""`shmap.jit` on the distributed mesh: DTensor arguments and outputs of a captured call.

A captured program takes and returns plain tensors.  On the distributed mesh
(one process per device) the global values around a shard_mapped call are
DTensors, so a jitted call crosses that boundary once on each side:

- **Key.**  A DTensor argument is keyed by its layout (device mesh,
  placements, global shape and stride) and by its local tensor's key (shape,
  strides, dtype, device, requires_grad), so a call with another layout traces
  again.
- **Trace.**  The program's input is the argument's local tensor.  Inside the
  trace the DTensor is rebuilt on the argument's spec, so `f` sees what it
  sees eagerly; a DTensor output is traced to its local tensor and its spec
  kept.  The shard_maps in `f` run their bodies' collectives as traced ops
  (`backends/traced.py`: torch's functional collectives between the guard's
  ops), so every replay counts, checks and watches its collectives as an
  eager call does, and reports the same `comm_log` events.
- **Replay.**  One autograd Function (`Locals`) takes every DTensor
  argument's local tensor (its backward puts each gradient on its argument's
  spec, as `DTensor.to_local`'s does); each output's local tensor becomes a
  DTensor on its traced spec (`dtensor.on_spec`, as a shard_map's outputs
  do: differentiable, no spec or stride computed per call).

What stays eager's only: the shard_map boundary's per-argument checks run at
trace time (a DTensor with another layout is another key, hence traced and
checked); and every rank traces on its own first call, which needs no
communication (the traced collectives run at replay).
"""
from __future__ import annotations

import torch

from .backends.functions import _Function
from .cow import storage_key
from .dtensor import _cotangent_spec, new_dtensor, on_spec, plain_types


def is_plain_dtensor(x) -> bool:
    return type(x) in plain_types()


def leaf_key(x, first, storages, k):
    """The key of DTensor argument `x` (position `k`; `first`: its first position in the call)."""
    local = x._local_tensor
    ptr = storage_key(local)
    shared = k if ptr is None else storages.setdefault(ptr, k)
    s = x._spec
    return ("DTensor", first, shared, s.mesh, s.placements, x.shape, x.stride(), local.shape, local.stride(),
            local.dtype, local.device, x.requires_grad)


def locals_of(tensors, positions):
    """`tensors` with each DTensor (at `positions`) replaced by its local tensor (`_locals`)."""
    out = list(tensors)
    for k, t in zip(positions, _locals([tensors[k] for k in positions])):
        out[k] = t
    return out


def _locals(dts):
    """The local tensors of DTensors `dts`: differentiable (one autograd Function for all of them) when
    grad mode is on and one of them requires grad."""
    if torch.is_grad_enabled() and any(d.requires_grad for d in dts):
        return Locals.apply(*dts)
    return [d._local_tensor for d in dts]


class Locals(_Function):
    """DTensors -> their local tensors (views); backward: each local cotangent as a DTensor.

    The cotangent's spec is where the value's cotangent lives
    (`dtensor._cotangent_spec`: a pending sum's is replicated, as
    `DTensor.to_local`'s default places it), for an argument and for a
    traced output alike.  (An argument's own spec put a Partial argument's
    gradient as a pending sum: its value was the world size times the
    gradient's.)
    """

    @staticmethod
    def forward(*xs):
        return tuple(x._local_tensor.view_as(x._local_tensor) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        xs = inputs
        ctx.specs = [_cotangent_spec(x._spec) for x in xs]
        ctx.set_materialize_grads(False)
        const = [t for t, x in zip(output, xs) if not x.requires_grad]
        if const:  # (no gradient is computed for them in the captured backward)
            ctx.mark_non_differentiable(*const)

    @staticmethod
    def backward(ctx, *gs):
        return tuple(None if g is None else new_dtensor(g.contiguous(), s) for g, s in zip(gs, ctx.specs))


# --------------------------------------------------------------------------
# Inside the trace
# --------------------------------------------------------------------------
def trace_outputs(outs, out_info):
    """Each DTensor output of the trace -> its local tensor; its spec is kept in `out_info["dspecs"]`."""
    pos = [k for k, o in enumerate(outs) if is_plain_dtensor(o)]
    if not pos:
        return outs
    dts = [outs[k] for k in pos]
    outs = list(outs)
    for k, d, t in zip(pos, dts, _locals(dts)):
        outs[k] = t
        out_info["dspecs"][k] = d._spec
    return outs


def wrap_outputs(outs, dspecs):
    """Replay: the program's local outputs -> the DTensors the trace returned (positions in `dspecs`)."""
    outs = list(outs)
    for k, spec in dspecs.items():
        outs[k] = on_spec(outs[k], spec)
    return outs
