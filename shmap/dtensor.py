"""Global values on a mesh: DTensor interop and `device_put` (pictures of them: visualize.py).

On a distributed mesh the global values at a shard_map boundary are PyTorch
`DTensor`s: a spec and a tuple of DTensor placements (one per mesh axis) say
the same thing, so a DTensor laid out as the in_spec is used in place (its
local tensor *is* the block), and outputs come back as DTensors placed by
their out_specs.  A spec entry naming several axes in mesh order is one
`Shard` per axis; in any other order (e.g. `P(('j', 'i'))` on mesh (i, j)) the
more major axes that come later in the mesh are `_StridedShard`s, DTensor's
encoding of exactly that block order.  A pending sum (`P(..., unreduced=...)`)
is `Partial()` along its axes.

On a simulated mesh there is one process holding every device, so a global
value is just a tensor: `device_put` returns it (on the mesh's device) and the
spec only matters when it is passed to `shard_map`.
"""
from __future__ import annotations

import itertools
import math
import weakref

import torch

from .backends.deferred import Deferred, arrived
from .backends.functions import _Function
from .errors import as_tensor_arg
from .mesh import Mesh, PartitionSpec


def is_dtensor(x) -> bool:
    return isinstance(x, _DTENSOR[0] if _DTENSOR else _dtensor_class())


def _dtensor_class():
    """DTensor (or `()` in a torch built without distributed), imported once: every boundary crossing asks."""
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch built without distributed
            DTensor = ()
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


_DTENSOR: list = []


def _output_class():
    """`dtensor_output.GlobalOutput`, imported once."""
    if not _OUTPUT:
        from .dtensor_output import GlobalOutput

        _OUTPUT.append(GlobalOutput)
    return _OUTPUT[0]


_OUTPUT: list = []


def plain_types() -> tuple:
    """DTensor and `GlobalOutput` (a shard_map output: a DTensor in all but its `to_local`), the types the
    boundary's shortcut and shmap.jit take as DTensors (not another subclass); () without distributed."""
    cls = _DTENSOR[0] if _DTENSOR else _dtensor_class()
    return () if cls == () else (cls, _output_class())


# --------------------------------------------------------------------------
# Specs <-> placements
# --------------------------------------------------------------------------
def placements(mesh: Mesh, spec: PartitionSpec) -> tuple:
    """The DTensor placements (one per mesh axis) that lay a value out as `spec` on `mesh`.

    For a dimension split over axes `(a_1, ..., a_k)` (major first), axis `a`
    gets `Shard(d)` when no more-major axis of the tuple comes after it in the
    mesh, and `_StridedShard(d, split_factor=f)` otherwise, `f` being the
    product of the sizes of those axes.  Axes the spec lists as `unreduced`
    (a pending sum) are `Partial()`.
    """
    key = (id(mesh), spec)
    got = _PLACEMENTS.get(key)
    if got is not None and got[0] is mesh:
        return got[1]
    from torch.distributed.tensor import Partial, Replicate, Shard

    pos = {a: k for k, a in enumerate(mesh.axis_names)}
    out = [Partial() if a in spec.unreduced else Replicate() for a in mesh.axis_names]
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        for t, a in enumerate(axes):
            sf = math.prod(mesh.shape[b] for b in axes[:t] if pos[b] > pos[a])
            out[pos[a]] = Shard(d) if sf == 1 else _strided(d, sf)
    if len(_PLACEMENTS) >= 4096:
        _PLACEMENTS.clear()
    _PLACEMENTS[key] = (mesh, tuple(out))
    return tuple(out)


#: (id(mesh), spec) -> (mesh, placements): each boundary crossing asks again
_PLACEMENTS: dict = {}


def _strided(dim, split_factor):
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - torch too old
        raise NotImplementedError(
            "this torch has no DTensor _StridedShard, so a spec entry whose axes are not in mesh order "
            "(e.g. P(('j', 'i')) on mesh (i, j)) cannot be a DTensor. Fix: list the axes in mesh order, "
            "or upgrade torch."
        ) from None
    return _StridedShard(dim, split_factor=split_factor)


def spec_from_placements(mesh: Mesh, pls, ndim: int) -> PartitionSpec:
    """The spec of a DTensor layout (inverse of `placements`); `Partial()` is `unreduced`."""
    from torch.distributed.tensor import Partial, Replicate

    per_dim: dict = {}
    unreduced = set()
    for a, p in zip(mesh.axis_names, pls):
        if isinstance(p, Replicate):
            continue
        if p == Partial():
            unreduced.add(a)
            continue
        d = getattr(p, "dim", None)
        if d is None:
            raise ValueError(
                f"spec_from_placements: placement {p} on mesh axis {a!r} is a pending reduction other than a "
                "sum, which a PartitionSpec cannot express. Fix: x.redistribute(x.device_mesh, "
                "[Replicate() if p.is_partial() else p for p in x.placements]) first."
            )
        per_dim.setdefault(d % max(ndim, 1), []).append(a)
    entries = [None] * ndim
    for d, axes in per_dim.items():
        for order in itertools.permutations(axes):
            got = placements(mesh, PartitionSpec(*([None] * d + [order])))
            if all(got[mesh.axis_names.index(a)] == pls[mesh.axis_names.index(a)] for a in axes):
                entries[d] = order if len(order) > 1 else order[0]
                break
        else:
            raise ValueError(f"spec_from_placements: no spec lays dimension {d} out as {tuple(pls)}.")
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries, unreduced=frozenset(unreduced))


def global_shape(block_shape, mesh: Mesh, spec: PartitionSpec) -> tuple:
    return tuple(
        s * math.prod(mesh.shape[a] for a in spec.dim_axes(d)) for d, s in enumerate(block_shape)
    )


def block_shape(shape, mesh: Mesh, spec: PartitionSpec) -> tuple:
    """`global_shape`'s inverse: the shape of each device's block of a global value of `shape`."""
    return tuple(s // math.prod(mesh.shape[a] for a in spec.dim_axes(d)) for d, s in enumerate(shape))


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


# --------------------------------------------------------------------------
# The shard_map boundary on a distributed mesh
# --------------------------------------------------------------------------
def local_block(x, mesh: Mesh, spec: PartitionSpec):
    """This rank's block of DTensor `x` laid out as `spec` (no data movement), or a clear error.

    `DTensor.to_local` is an autograd Function even without autograd, and its
    backward builds each gradient with `DTensor.from_local` (a new spec, a
    stride computation and another Function per weight).  A step over many
    small tensors pays for that at every boundary, so: without autograd the
    local tensor itself; with it, `_ToBlock`, whose backward wraps the
    cotangent on a cached spec.  A pending sum (`Partial`, whose gradient
    placement differs) keeps DTensor's own path.

    `_ToBlock` is also where the body's deferred gradient reductions are read
    (what `boundary.Arrive` does for other inputs): created when the body
    starts, it runs after every node of the body, and one node per weight
    instead of two is one autograd Function less per weight and step.
    """
    pls = placements(mesh, spec)
    s = x._spec
    if s.mesh is not mesh.device_mesh or (s.placements is not pls and s.placements != pls):
        from .backends.distributed import check_dtensor_layout

        check_dtensor_layout(x, mesh, spec, pls)
    key = (id(mesh), spec, x.shape, x._local_tensor.shape)
    try:
        seen = key in _LOCAL_OK  # (one set lookup per argument once seen)
    except TypeError:  # symbolic sizes (torch.compile's dynamic shapes) do not hash
        seen = key = None
    if not seen:
        from .backends.boundary import check_local_shape

        check_local_shape(x, mesh, spec)
        if key is not None and len(_LOCAL_OK) < 4096:
            _LOCAL_OK.add(key)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x._local_tensor
    if spec.unreduced:
        return x.to_local()
    return _ToBlock.apply(x, mesh, spec)


class _ToBlock(_Function):
    """DTensor -> its local block (a view); backward: the cotangent, once arrived (`deferred`), as a
    DTensor with `x`'s layout."""

    @staticmethod
    def forward(x, mesh, spec):
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.mesh, ctx.spec = inputs
        ctx.shape = tuple(x.shape)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None
        g = arrived(g)
        if not torch.is_grad_enabled() and g.is_contiguous():
            return new_dtensor(g, _dtensor_spec(ctx.mesh, ctx.spec, ctx.shape, g.dtype)), None, None
        # A graph of the backward (create_graph) or a strided cotangent: DTensor's own, differentiable path.
        from torch.distributed.tensor._utils import compute_global_tensor_info

        _, stride = compute_global_tensor_info(g, ctx.mesh.device_mesh, placements(ctx.mesh, ctx.spec))
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(g, ctx.mesh.device_mesh, placements(ctx.mesh, ctx.spec), run_check=False,
                                  shape=torch.Size(ctx.shape), stride=tuple(stride)), None, None


def new_dtensor(local, dspec, requires_grad=False):
    """`DTensor(local, dspec, requires_grad=...)` without `DTensor.__init__`.

    The constructor is `DTensor.__new__` (C); `__init__` only calls
    `Tensor.__init__`, but through two Python wrappers (Dynamo's disable and
    export's marker) that cost more than the constructor, at every output of
    every call.  (shmap never lets Dynamo trace this: a shard_mapped call is
    one graph node.)
    """
    cls = _dtensor_class()
    return cls.__new__(cls, local, dspec, requires_grad=requires_grad)


def from_block(block, mesh: Mesh, spec: PartitionSpec, logical_shape=None):
    """A DTensor placed by `spec` whose local tensor is `block` (differentiable, no data movement).

    Built directly on a cached spec: `DTensor.from_local` makes a new spec,
    computes strides and runs its autograd Function on every call (about
    0.2 ms), which dominates a step over many small tensors or a small step.
    Without autograd (an optimizer step's outputs, say) no Function at all;
    with it `_FromBlock`.  A pending sum (`Partial`, whose cotangent is
    placed differently) keeps DTensor's own path.
    """
    logical_shape = tuple(block.shape) if logical_shape is None else tuple(logical_shape)
    if not all(type(s) is int for s in logical_shape):
        # Symbolic sizes (torch.compile's dynamic shapes): DTensor's path.
        from torch.distributed.tensor import DTensor

        shape = global_shape(logical_shape, mesh, spec)
        return DTensor.from_local(block, mesh.device_mesh, placements(mesh, spec), run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(shape))
    key = (id(mesh), spec, logical_shape, block.dtype)  # by the block's shape: no global shape to compute
    got = _BLOCK_SPECS.get(key)
    if got is None or got[0] is not mesh:
        got = _BLOCK_SPECS[key] = (mesh, _dtensor_spec(mesh, spec, global_shape(logical_shape, mesh, spec),
                                                       block.dtype))
        if len(_BLOCK_SPECS) >= 4096:
            _BLOCK_SPECS.clear()
    return on_spec(block, got[1])


def on_spec(block, dspec):
    """A DTensor on `dspec` whose local tensor is `block`: differentiable (`_FromBlock`) when grad mode is on
    and `block` requires grad, else no Function at all (`from_block`; shmap.jit's DTensor boundary)."""
    if torch.is_grad_enabled() and block.requires_grad:
        return _FromBlock.apply(block, dspec)
    return new_dtensor(_alias(block), dspec)


def _plainly_eager(block) -> bool:
    """Whether `block` is a real tensor (or a psum still on the wire) outside any capture: no dispatch mode
    (fake, proxy, functional) and no Dynamo."""
    return (type(block) in (torch.Tensor, Deferred) and not torch._C._len_torch_dispatch_stack()
            and not torch.compiler.is_compiling())


def _cotangent_spec(dspec):
    """Where an output's cotangent lives: as the output, but replicated along its pending-sum (`Partial`)
    axes, since every term of a sum has the sum's cotangent."""
    from torch.distributed.tensor import Partial, Replicate

    if not any(isinstance(p, Partial) for p in dspec.placements):
        return dspec
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    pls = tuple(Replicate() if isinstance(p, Partial) else p for p in dspec.placements)
    return DTensorSpec(dspec.mesh, pls, tensor_meta=dspec.tensor_meta)


def _alias(block):
    """A new tensor object on `block`'s data (a view), or a forward psum still on the wire as it is:
    a view would wait for it (`deferred.forward_psum`), and the output DTensor is its only holder."""
    if type(block) is torch.Tensor or torch.compiler.is_compiling():  # (Dynamo never meets a Deferred)
        return block.view_as(block)
    return block if type(block) is Deferred else block.view_as(block)


class _FromBlock(_Function):
    """Block -> the DTensor holding it (a view, on a cached spec); backward: the cotangent's local block.

    As `DTensor.from_local`'s Function: a cotangent placed otherwise is
    redistributed to the output's placements first; under create_graph the
    local block is taken differentiably (`to_local`).  A plain cotangent is
    the global value, as a plain argument is: this rank's block of it.

    The backward reads the output's version: an in-place update of the
    DTensor (`out.mul_(3)`) writes the block, which the body's own backward
    nodes may have saved (tanh saves its output), but bumps only the
    DTensor's version counter, so autograd's check would pass and the
    gradient be silently wrong.  The backward counts the update on the block
    then, so that such a node raises autograd's own error, as on the
    simulated mesh, and a pass that needs no such node goes on.  The output
    is held weakly, not saved for the backward pass: a non-reentrant
    checkpoint around the call recomputes up to its last saved tensor, and a
    saved output made it recompute the body's collectives too (an extra
    all_reduce a step).
    """

    @staticmethod
    def forward(block, dspec):
        if block.requires_grad and _plainly_eager(block):  # (a capture traces DTensor's own type)
            cls = _output_class()
            return cls.__new__(cls, _alias(block), dspec, requires_grad=True)
        return new_dtensor(_alias(block), dspec, block.requires_grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dspec = inputs[1]
        ctx.output, ctx.version = weakref.ref(output), output._version
        ctx.local = output._local_tensor  # (a view of the block: it shares the block's version counter)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, g):
        out = ctx.output()
        if out is not None and out._version != ctx.version:
            # The update wrote the block without counting on it: counted now, so that a node of the body
            # that saved the block (tanh saves its output) raises autograd's own error, and one that did not
            # (sin saves its input) differentiates on, as on the simulated mesh and in plain torch.
            torch.autograd.graph.increment_version(ctx.local)
            ctx.version = out._version
        if g is None:
            return None, None
        want = _cotangent_spec(ctx.dspec)
        if not is_dtensor(g):  # the global cotangent every rank holds: this rank's block of it
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor._dtensor_spec import DTensorSpec
            from torch.distributed.tensor._redistribute import redistribute_local_tensor

            whole = DTensorSpec(want.mesh, (Replicate(),) * want.mesh.ndim, tensor_meta=want.tensor_meta)
            return redistribute_local_tensor(g, whole, want), None
        if g._spec.placements != want.placements:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec
            from torch.distributed.tensor._redistribute import redistribute_local_tensor

            target = DTensorSpec(want.mesh, want.placements, tensor_meta=g._spec.tensor_meta)
            return redistribute_local_tensor(g._local_tensor, g._spec, target), None
        if torch.is_grad_enabled():
            return g.to_local(), None
        local = g._local_tensor
        return local.view_as(local), None


#: (id(mesh), spec, global shape, dtype) -> (mesh, DTensorSpec): the specs `from_block` builds on
_SPECS: dict = {}
#: (id(mesh), spec, block shape, dtype) -> (mesh, DTensorSpec): the same, found by the block's shape
_BLOCK_SPECS: dict = {}
#: (mesh, spec, global shape, local shape) of DTensor arguments whose blocks were checked (`local_block`)
_LOCAL_OK: set = set()


def _dtensor_spec(mesh: Mesh, spec: PartitionSpec, shape, dtype):
    key = (id(mesh), spec, shape, dtype)
    got = _SPECS.get(key)
    if got is None or got[0] is not mesh:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), dtype)
        got = (mesh, DTensorSpec(mesh.device_mesh, placements(mesh, spec), tensor_meta=meta))
        if len(_SPECS) >= 4096:
            _SPECS.clear()
        _SPECS[key] = got
    return got[1]


# --------------------------------------------------------------------------
# device_put
# --------------------------------------------------------------------------
def device_put(x, mesh: Mesh, spec: PartitionSpec):
    """Lay the global value `x` out on `mesh` as `spec`.

    - Distributed mesh: returns a `DTensor` placed by `spec`.  A plain tensor is
      a global value every rank holds: each rank keeps a compact copy of its
      block (no communication; the gradient of `x` is whole on every rank); with
      `unreduced` axes it becomes a pending sum held by their first device.
      A DTensor is redistributed (this is the explicit reshard a mismatched
      shard_map argument needs).
    - Simulated mesh: returns the global tensor itself (on the mesh's device),
      a DTensor gathered first; every device of a simulated mesh lives in this
      process, so a layout is only cut when the value enters a shard_map.
    """
    from .shard_map import _check_spec

    if not isinstance(mesh, Mesh):
        raise TypeError(f"device_put: mesh must be a shmap.Mesh, got {type(mesh).__name__}.")
    if not isinstance(x, torch.Tensor):
        x = as_tensor_arg("device_put", "x", x)
    _check_spec(spec, "spec", x.shape, mesh, mesh.axis_names, "device_put", what="x")
    if not mesh.is_distributed:
        if is_dtensor(x):
            x = x.full_tensor()
        return x.to(mesh.device) if mesh.device is not None else x
    target = placements(mesh, spec)
    if is_dtensor(x):
        if x.device_mesh == mesh.device_mesh:
            if tuple(x.placements) == target:
                return x
            try:
                return x.redistribute(mesh.device_mesh, target)
            except Exception:  # noqa: BLE001 - layouts DTensor cannot convert directly
                pass
        x = x.full_tensor()
    if mesh.device is not None and x.device != mesh.device:
        x = x.to(mesh.device)
    from . import context
    from .backends import for_mesh

    backend = for_mesh(mesh)
    body = context.Body(mesh=mesh, axes=mesh.axis_names, check_vma=True, backend=backend)
    block, _ = backend.split(x, spec, body)
    if block.untyped_storage().nbytes() > block.numel() * block.element_size():
        # A block cut from the global tensor gets its own compact storage: a view would keep the whole
        # tensor alive on every rank (FSDP's 1/N would be N/N until the first update) with strides
        # the next state does not have (a torch.compile'd step would recompile on them).
        block = block.clone(memory_format=torch.contiguous_format)
    return from_block(block, mesh, spec)
