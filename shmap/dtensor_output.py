"""`GlobalOutput`: the DTensor a shard_map hands back where autograd will pass through it.

Why a subclass: a loss leaves a data-parallel body as a DTensor, and the caller
takes its local value (`out.to_local().sum()`, `out.full_tensor()`) before
`backward()`.  DTensor's own `to_local` runs an autograd Function whose
backward rebuilds the output's spec and calls `DTensor.from_local` (about
0.25 ms here, 7% of the CPU time of `bench_distributed.py`'s data-parallel
step); the spec is already known, cached by `dtensor.from_block`.  This subclass's
`to_local` (and `full_tensor` of a replicated output, which needs no
communication) is a Function whose backward wraps the cotangent on that spec.
Everything else is DTensor's: ops on it return plain DTensors (DTensor's
`__torch_dispatch__` unwraps subclasses), and grad_placements, a read without
grad (DTensor's `full_tensor` then hands back a plain tensor, not a psum still
on the wire), a graph of the backward pass (create_graph) or a non-contiguous
cotangent take DTensor's path.

Imported on first use (`dtensor._output_class`): torch may be built without
distributed.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from .backends.functions import _Function
from .dtensor import _cotangent_spec


class GlobalOutput(DTensor):
    """A shard_map output that requires grad (a DTensor in every other respect)."""

    __slots__ = ()

    def to_local(self, *, grad_placements=None):
        if grad_placements is None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return _LocalOf.apply(self)
        return DTensor.to_local(self, grad_placements=grad_placements)

    def full_tensor(self, *, grad_placements=None):
        if (grad_placements is None and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and all(type(p) is Replicate for p in self._spec.placements)):  # every rank holds it whole
            return _LocalOf.apply(self)
        return DTensor.full_tensor(self, grad_placements=grad_placements)

    def __reduce_ex__(self, protocol):  # pickled (torch.save) as the DTensor it is
        return DTensor.__reduce_ex__(self.detach(), protocol)


class _LocalOf(_Function):
    """GlobalOutput -> its local tensor (a view); backward: the cotangent as a DTensor where the output's
    cotangent lives (`dtensor._cotangent_spec`: a pending sum's is replicated, as `DTensor.to_local` places
    it; on the output's own spec, a Partial output's cotangent was then all-reduced to the replicated one
    its `_FromBlock` expects: the gradient came out the world size times too large)."""

    @staticmethod
    def forward(x):
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = _cotangent_spec(inputs[0]._spec)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None
        spec = ctx.spec
        if torch.is_grad_enabled() or not g.is_contiguous():  # DTensor's differentiable path, strides worked out
            from torch.distributed.tensor._utils import compute_global_tensor_info

            _, stride = compute_global_tensor_info(g, spec.mesh, spec.placements)
            return DTensor.from_local(g, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                      stride=tuple(stride))
        return DTensor.__new__(DTensor, g, spec, requires_grad=False)
