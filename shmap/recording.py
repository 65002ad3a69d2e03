"""Recording communication on the simulated mesh: the autograd node that logs a collective and
its transpose.

Physical data movement is done by plain torch ops around it (`backends/simulated.py`); `LogComm`
only reports, through `ops.record`, which collective a real device would perform in each
direction.  `event` builds the `comm.CommEvent` both meshes report.
"""
from __future__ import annotations

import dataclasses

import torch

from . import comm, ops


class LogComm(torch.autograd.Function):
    """Identity that records `fwd` when run and `bwd` when transposed.

    Its backward is itself with the events swapped, so transposing any number
    of times records the right collective each time (second order included).
    """

    generate_vmap_rule = True  # torch.func transforms of a shard_mapped function (from outside)

    @classmethod
    def apply(cls, *args):
        # Function.apply binds the arguments of a Function with setup_context to forward's
        # signature (inspect.signature, ~70 us) on every call, to fill in defaults; there are none
        # here and every call passes all three. Under a torch.func transform the full path runs.
        if torch._C._are_functorch_transforms_active():
            return _FUNCTION_APPLY(cls, *args)
        return _C_APPLY.__get__(None, cls)(*args)

    @staticmethod
    def forward(x, fwd, bwd):
        if fwd is not None:
            ops.record(fwd, x)
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.events = (inputs[1], inputs[2])

    @staticmethod
    def jvp(ctx, t, _fwd, _bwd):
        # Forward mode: the tangent moves in the same collective as the primal (JAX's psum takes
        # both as operands of one collective), so it is not reported again; nor on processes.
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        fwd, bwd = ctx.events
        # Without create_graph this only records (no node is built).  Transposed again (a second
        # derivative), a linear collective is itself; pmax / pmin are not linear: their linearisation is a
        # psum of the tangent on the devices holding the extremum (`Pextremum.jvp` on processes).
        if fwd is not None and fwd.kind in _NONLINEAR:
            fwd = dataclasses.replace(fwd, kind="psum")
        return log_comm(g, bwd, fwd), None, None


_NONLINEAR = frozenset({"pmax", "pmin"})
_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"].__func__
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]


def log_comm(phys, fwd, bwd):
    """Attach the (forward, transpose) communication events to `phys`."""
    if fwd is None and bwd is None:
        return phys
    # A vmap's batched value does not show requires_grad (autograd runs below it): the node is
    # needed whenever grad mode is on, or its backward would report no transpose.
    if not (torch.is_grad_enabled() and (phys.requires_grad or _functorch_wrapped(phys))):
        if fwd is not None:
            ops.record(fwd, phys)
        return phys
    return LogComm.apply(phys, fwd, bwd)


def event(kind, axes, logical_shape, dtype):
    # int(): under torch.compile with dynamic shapes a size may be symbolic; an event reports
    # concrete bytes, so its sizes are specialised (guarded) in the compiled graph.
    shape = tuple(int(s) for s in logical_shape)
    numel = 1
    for s in shape:
        numel *= s
    return comm.CommEvent(kind, tuple(axes), numel * dtype.itemsize, shape, str(dtype))

