"""Distributed mesh: one process per device, collectives on torch.distributed.

A body value's physical tensor is this rank's block (`_paxes == ()`); its
device variance is metadata only, checked by the same rules as on the
simulated mesh.  Each collective is a `torch.autograd.Function` whose backward
*calls the transpose collective* (itself a Function, so higher derivatives
transpose again), and records the same `comm.CommEvent`s the simulated
backend records, so `comm_log` reads the same on both:

    psum          <-> pvary (the automatic lift too): all_reduce / nothing
    all_gather    <-> psum_scatter: all_gather / reduce_scatter
    all_gather_invariant <-> own-block slice (no communication)
    ppermute      <-> ppermute with the inverse permutation
    all_to_all    <-> all_to_all with split and concat swapped

Axis tuples are linearised major-to-minor in the tuple's order; a process
group over several mesh axes orders its ranks in mesh order, so results are
permuted between the two where they differ.  Every wait is watched
(`watchdog`): a failing or diverging rank is reported instead of hung on.

At the boundary, `split` takes this rank's block of a global value (a DTensor
whose layout matches the in_spec is used in place; a plain tensor is a global
value every rank holds) and `assemble` returns a `DTensor` whose placements
follow the out_spec (`Partial` along the axes of a pending sum).

This module holds the backend (`Distributed`); beside it: `groups` (process
groups), `transports` (raw collectives), `functions` (the collectives'
autograd Functions) and `boundary` (the boundary's Functions).  Their names
stay importable from here.
"""
from __future__ import annotations

import itertools
import math

import optree
import torch

from .. import batching, dtensor, per_device
from ..errors import SpecError, op_name
from . import quick, traced, watchdog
from .deferred import Deferred
from .boundary import (  # noqa: F401  (re-exported)
    Arrive,
    AssembleBlocks,
    PendingTerm,
    PendingTermT,
    ScaleGrad,
    TakeBlock,
    _transformed,
    _unwrapped,
    check_not_dtensor,
    _assemble_blocks,
    _take_block,
    check_dtensor_layout,
)
from .functions import (  # noqa: F401
    AllGather,
    AllGatherInvariant,
    AllToAll,
    OwnBlock,
    Ppermute,
    Psum,
    PsumScatter,
    PsumUnchecked,
    Pextremum,
    Pvary,
    _grad,
    _record,
)
from .groups import Group, _dist
from .protocol import Backend
from .transports import (  # noqa: F401
    _MOVABLE,
    _all_gather,
    _all_reduce,
    _all_to_all,
    _as_bytes,
    _chunks,
    _gather_rows,
    _own_block,
    _ppermute,
    _psum_scatter,
    _reduce_dtype,
    _run,
    _run_shm,
)


class Distributed(Backend):
    """Physical collectives and the global<->per-device boundary for one rank (`protocol.Backend`)."""

    name = "distributed"
    #: a value is this rank's block, with no device dims
    device_dims = False

    def __init__(self, mesh):
        dist = _dist()
        self.mesh = mesh
        self.dm = mesh.device_mesh
        self.rank = dist.get_rank()
        pos = (mesh.devices == self.rank).nonzero()
        self.coords = dict(zip(mesh.axis_names, pos[0].tolist()))
        self._pgs: dict = {}
        self._groups: dict = {}
        self._starts: dict = {}
        self._spec_vma: dict = {}  # spec -> the type of its blocks (`enter_block`)
        # Built by make_mesh, on every rank together: the guard's own process
        # group, and the groups over several (not all) axes of a mesh of up to
        # 3 axes, so that no later wait is an unwatched group creation
        # (creating a group is collective over the world).
        self.watch = watchdog.watch()
        names = mesh.axis_names
        partial = [c for k in range(2, len(names)) for c in itertools.combinations(names, k)]
        if len(partial) <= 3:
            for axes in partial:
                self._pg(axes)

    # ------------------------------------------------------------------
    # Groups
    # ------------------------------------------------------------------
    def group(self, axes) -> Group:
        axes = tuple(axes)
        g = self._groups.get(axes)
        if g is None:
            with traced.untraced():  # built from the mesh's real device tensor, also while tracing
                g = self._make_group(axes)
            self._groups[axes] = g
        return g

    def _make_group(self, axes) -> Group:
        mesh = self.mesh
        sizes = [mesh.shape[a] for a in axes]
        n = math.prod(sizes)
        ranks = []
        for idx in itertools.product(*(range(s) for s in sizes)):
            c = dict(self.coords)
            c.update(zip(axes, idx))
            ranks.append(int(mesh.devices[tuple(c[a] for a in mesh.axis_names)]))
        index = ranks.index(self.rank)
        order = sorted(ranks)  # a process group ranks its members by global rank
        g2t = [ranks.index(r) for r in order]
        if g2t == list(range(n)):
            g2t = None
        return Group(axes, n, index, ranks, g2t, self)

    def _pg(self, axes):
        """A process group over the mesh axes `axes` (any order: its ranks follow the mesh's), cached per set."""
        key = frozenset(axes)
        pg = self._pgs.get(key)
        if pg is not None:
            return pg
        dist = _dist()
        mesh = self.mesh
        if len(axes) == 1:
            pg = self.dm.get_group(axes[0])
        elif len(axes) == len(mesh.axis_names):
            pg = dist.group.WORLD
        else:
            # Every rank creates every group of the partition (new_group is
            # collective over the world); SPMD programs reach here together.
            dims = sorted(mesh.axis_names.index(a) for a in axes)  # mesh order
            rest = [d for d in range(len(mesh.axis_names)) if d not in dims]
            t = mesh.devices.permute(rest + dims).reshape(-1, math.prod(mesh.shape[a] for a in axes))
            from datetime import timedelta

            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():  # (real groups, also when torch.compile traces the first use)
                pg, _ = dist.new_subgroups_by_enumeration(
                    [row.tolist() for row in t], timeout=timedelta(seconds=self.watch.pg_timeout)
                )
        self._pgs[key] = pg
        return pg

    # ------------------------------------------------------------------
    # Boundary
    # ------------------------------------------------------------------
    def split(self, x: torch.Tensor, spec, body):
        """Global value -> (this rank's block, the axes it varies along).

        A DTensor whose placements match `spec` is used in place (its local
        tensor); any other DTensor is refused with the fix.  A plain tensor is
        a global value every rank holds: the block is a view of it, and its
        gradient (assembled from every rank's block) is complete on every rank.
        The axes are handed to `input_value`, which types the value.
        """
        axes = body.order(spec.axes())
        transformed = _transformed()  # a torch.func transform from outside: plain tensors in and out
        if transformed:
            check_not_dtensor(x, spec)
        if dtensor.is_dtensor(x):
            x = dtensor.local_block(x, self.mesh, spec)  # (its backward reads the deferred reductions)
            return (Arrive.apply(x) if spec.unreduced and _grad(x) else x), axes
        starts = self._block_starts(spec, x.shape)
        if starts:
            x = TakeBlock.apply(x, self, spec, body) if _grad(x) else _take_block(x, starts)
        if spec.unreduced:
            # A pending sum of a global value: the first device along the axes holds it, the others zeros.
            first = all(self.coords[a] == 0 for a in spec.unreduced)
            x = PendingTerm.apply(x, first) if _grad(x) else (x if first else torch.zeros_like(x))
        if _grad(x) and not transformed:  # (a transform's backward builds a graph: nothing is deferred)
            x = Arrive.apply(x)  # the body's gradient reductions are read here, last (see `deferred`)
        return x, axes

    @property
    def block_types(self):
        """The arguments `enter_block` takes: DTensors (`dtensor.plain_types`; () in a torch without them)."""
        return dtensor.plain_types()

    def enter_block(self, x, spec, body):
        """`split` and `input_value` in one for the common argument, a DTensor laid out as `spec`
        in a typed top-level body outside any torch.func transform: (this rank's block, its type),
        or None for the general path (which `split` is).  A step over many weights crosses the
        boundary once per weight, and per call the general path's generality costs more than this."""
        if spec.unreduced or not body.check_vma or (self.mesh.device is not None and x.device != self.mesh.device) \
                or _transformed():
            return None
        got = self._spec_vma.get(spec)
        if got is None:
            got = self._spec_vma[spec] = frozenset(spec.axes())
        return dtensor.local_block(x, self.mesh, spec), got  # (the layout checked; `_ToBlock` under autograd)

    def _block_starts(self, spec, shape):
        """{dim: (start, length)} of this rank's block along each split dimension (remembered)."""
        if not all(type(s) is int for s in shape):  # symbolic sizes (torch.compile dynamic shapes)
            return self._block_starts_uncached(spec, shape)
        key = (spec, tuple(shape))
        got = self._starts.get(key)
        if got is None:
            got = self._starts[key] = self._block_starts_uncached(spec, shape)
            if len(self._starts) > 4096:
                self._starts.clear()
        return got

    def _block_starts_uncached(self, spec, shape):
        out = {}
        for d in range(len(spec)):
            axes = spec.dim_axes(d)
            if not axes:
                continue
            n = math.prod(self.mesh.shape[a] for a in axes)
            idx = self.linear_index(axes)
            size = shape[d] // n
            out[d] = (idx * size, size)
        return out

    def describe_device(self) -> str:
        """`rank 2 (i=1, j=0)`: how a body value's printout names this device."""
        return f"rank {self.rank} (" + ", ".join(f"{a}={i}" for a, i in self.coords.items()) + ")"

    def linear_index(self, axes) -> int:
        """This device's position along `axes`, major-to-minor in the tuple's order."""
        i = 0
        for a in axes:
            i = i * self.mesh.shape[a] + self.coords[a]
        return i

    def assemble(self, phys, paxes, spec, body, logical_shape):
        """This rank's block -> the global value as a DTensor placed by `spec`.

        `paxes` is `()` (a block has no device dims).  Axes the spec leaves out are
        `Replicate`: with check_vma every rank holds the same block along them;
        with check_vma=False the caller vouches for it and the cotangent is
        divided by their size (JAX's defensive transpose, as on the simulated
        mesh).  Axes the spec lists as unreduced are `Partial`: the block is
        this rank's term of the pending sum (see `unreduced_output`).
        """
        if not getattr(body, "_exit_checked", False):
            # The end of each body counts (default: every later signature
            # includes the count) or, in strict mode, exchanges a signature: a
            # rank that skipped a collective meets the others' here, not later.
            body._exit_checked = True
            if traced.tracing():  # torch.compile: counted (or exchanged) when the graph runs
                traced.body_end(logical_shape, phys.dtype, f"first out_spec {spec}", phys)
            elif not self.watch.body_done():
                self.watch.check("end of shard_map body", (), logical_shape, phys.dtype, f"first out_spec {spec}")
        transformed = _transformed()
        if not body.check_vma:
            named = set(spec.axes())
            drop = [a for a in body.axes if a not in named]
            if drop:
                n = math.prod(body.sizes[a] for a in drop)
                if transformed or (torch.is_grad_enabled() and phys.requires_grad):
                    phys = ScaleGrad.apply(phys, 1.0 / n)
        if transformed:  # the global value as a plain tensor, as the simulated mesh returns it
            if isinstance(_unwrapped(phys), Deferred):  # a forward psum still on the wire (`deferred`): landed
                phys = phys.view_as(phys)
            return AssembleBlocks.apply(phys, self, spec, body) if spec.axes() else phys
        return dtensor.from_block(phys, self.mesh, spec, tuple(logical_shape))

    def input_value(self, phys, paxes, body):
        """Type a block: it varies along the axes its spec names (`paxes` from `split`).

        With check_vma=False every value counts as varying on every axis, and
        the cotangent of an unmapped input is psum'd (JAX's defensive transpose).
        """
        if body.check_vma:
            return phys, (), frozenset(paxes)
        added = tuple(a for a in body.axes if a not in paxes)
        if added:
            phys = self.lift(phys, phys.shape, added, body)
        return phys, (), frozenset(body.axes)

    def unreduced_input(self, phys, paxes, axes, body):
        """A pending sum along `axes`: `split` already made the block this rank's term.

        (A `Partial` DTensor brings its own terms; a plain tensor's value is
        held by the first device along `axes`, zeros elsewhere.)
        """
        return phys, paxes

    def unreduced_output(self, phys, paxes, axes, body):
        """A pending sum leaves as it is: `assemble` places it `Partial` along `axes`.

        No collective runs; the DTensor reduces when it is redistributed (e.g.
        by `full_tensor()`).  Under a torch.func transform from outside, where
        the output is a plain tensor, the terms are summed here (boundary
        traffic, not reported: the simulated mesh sums them the same way).
        """
        if _transformed():
            return Psum.apply(phys, self.group(axes), False), tuple(a for a in paxes if a not in axes)
        return phys, paxes

    # ------------------------------------------------------------------
    # Automatic pvary: an identity whose transpose is a real psum
    # ------------------------------------------------------------------
    def lift(self, phys, logical_shape, added_axes, body):
        if not (torch.is_grad_enabled() and phys.requires_grad):
            return phys
        return Pvary.apply(phys, self.group(added_axes))

    # ------------------------------------------------------------------
    # psum: varying{A} -> invariant{A}        transpose: pvary
    # ------------------------------------------------------------------
    # the common eager psum's and all_gather's short ways (quick.py; the backend is their first argument)
    quick_psum, quick_all_gather = quick.quick_psum, quick.quick_all_gather

    def psum(self, phys, paxes, axes, body, shape, unchecked):
        g = self.group(axes)
        if _grad(phys):
            return (PsumUnchecked if unchecked else Psum).apply(phys, g), ()
        _record("psum", axes, shape, phys.dtype)
        return _all_reduce(phys, g, "psum"), ()

    # ------------------------------------------------------------------
    # pmax / pmin: varying{A} -> invariant{A}  (subgradient as the simulated mesh)
    # ------------------------------------------------------------------
    def pextremum(self, kind, phys, paxes, axes, body, shape, unchecked):
        g = self.group(axes)
        if _grad(phys):
            return Pextremum.apply(phys, g, kind, unchecked), ()
        _record(kind, axes, shape, phys.dtype)
        return _all_reduce(phys, g, kind), ()

    # ------------------------------------------------------------------
    # pvary: invariant{A} -> varying{A}        transpose: psum
    # ------------------------------------------------------------------
    def pvary(self, phys, paxes, axes, body, shape):
        if not _grad(phys):
            return phys, ()
        return Pvary.apply(phys, self.group(axes)), ()

    # ------------------------------------------------------------------
    # all_gather: varying{A} -> varying{A}     transpose: psum_scatter
    # all_gather_invariant: varying{A} -> invariant{A}  transpose: own-block slice
    # ------------------------------------------------------------------
    def all_gather(self, phys, paxes, axes, body, shape, axis, tiled, invariant, unchecked):
        g = self.group(axes)
        inv = invariant and not unchecked
        if _grad(phys):
            return (AllGatherInvariant if inv else AllGather).apply(phys, g, axis, tiled), ()
        kind = "all_gather_invariant" if inv else "all_gather"
        _record(kind, axes, shape, phys.dtype)
        return _all_gather(phys, g, axis, tiled, kind), ()

    # ------------------------------------------------------------------
    # psum_scatter: varying{A} -> varying{A}   transpose: all_gather
    # ------------------------------------------------------------------
    def psum_scatter(self, phys, paxes, axes, body, shape, dim, tiled):
        g = self.group(axes)
        if _grad(phys):
            return PsumScatter.apply(phys, g, dim, tiled), ()
        _record("psum_scatter", axes, shape, phys.dtype)
        return _psum_scatter(phys, g, dim, tiled), ()

    # ------------------------------------------------------------------
    # ppermute: varying{A} -> varying{A}       transpose: ppermute(inverse)
    # ------------------------------------------------------------------
    def ppermute(self, phys, paxes, axes, body, shape, perm):
        g = self.group(axes)
        perm = tuple((int(s), int(d)) for s, d in perm)
        if _grad(phys):
            return Ppermute.apply(phys, g, perm), ()
        _record("ppermute", axes, shape, phys.dtype)
        return _ppermute(phys, g, perm), ()

    # ------------------------------------------------------------------
    # all_to_all: varying{A} -> varying{A}     transpose: all_to_all(concat, split)
    # ------------------------------------------------------------------
    def all_to_all(self, phys, paxes, axes, body, shape, split_axis, concat_axis, tiled):
        g = self.group(axes)
        if _grad(phys):
            return AllToAll.apply(phys, g, split_axis, concat_axis, tiled), ()
        _record("all_to_all", axes, shape, phys.dtype)
        return _all_to_all(phys, g, split_axis, concat_axis, tiled), ()

    # ------------------------------------------------------------------
    # axis_index: -> varying{A}, this rank's position (an integer scalar)
    # ------------------------------------------------------------------
    def axis_index(self, axes, body, device, unchecked):
        return torch.tensor(self.linear_index(axes), dtype=torch.int64, device=device), ()

    # ------------------------------------------------------------------
    # Running the program: an op runs once, on this rank's block
    # ------------------------------------------------------------------
    @staticmethod
    def run_op(func, leaves, treedef, batched, union, inplace, body):
        out = batching.run_batched(func, leaves, treedef, batched, (), body)  # no device dims: a plain call
        if union and per_device.value_shaped(func, leaves) and not traced.tracing():
            body.backend._same_shape_everywhere(func, out, union, body)
        return out, ()

    def _same_shape_everywhere(self, func, out, union, body):
        """Raise the simulated mesh's error if a value-shaped op's result (unique, nonzero, a boolean
        mask: `per_device.value_shaped`) has another shape on another device of the axes its operands vary
        along.  Each rank knows only its own, so the shapes are gathered: one small all_gather, after such
        ops on varying values only (not in comm_log: not a collective of the program).  Without it a
        differing shape went on unnoticed, into a collective or an output whose global shape then
        differed by rank (gloo aborts the process on a size mismatch)."""
        shapes = [tuple(t.shape) for t in optree.tree_leaves(out, none_is_leaf=True) if isinstance(t, torch.Tensor)]
        flat = [d for s in shapes for d in s]
        if not flat:
            return
        axes = body.order(union)
        g = self.group(axes)
        if g.n == 1:
            return
        rows = _gather_rows(torch.tensor(flat, dtype=torch.int64), g, "shape check", op_name(func)).tolist()
        if all(r == rows[0] for r in rows):
            return
        sizes = [body.sizes[a] for a in axes]
        devices = [per_device._where(axes, idx) for idx in itertools.product(*(range(n) for n in sizes))]
        start = 0
        for s in shapes:  # the first output whose shape differs, as the per-device runs report it
            column = [tuple(r[start:start + len(s)]) for r in rows]
            start += len(s)
            if any(c != column[0] for c in column):
                raise per_device.shapes_differ(func, column, devices, body)

    # ------------------------------------------------------------------
    # Nested shard_map: a parent body's value is whole along the axes it leaves
    # free (each rank of those axes computes it redundantly), so entering takes
    # this rank's block (a view; the transpose gathers the cotangent's blocks)
    # and leaving gathers the blocks along the named axes (transpose: the own
    # block).  That gather is boundary traffic, not a collective of the
    # program: comm_log does not list it, as for a plain input's gradient.
    # ------------------------------------------------------------------
    def enter_nested(self, phys, paxes, spec, body):
        if spec.unreduced:
            raise SpecError(
                f"shard_map: unreduced in_specs of a nested shard_map on a distributed mesh are not supported "
                f"(spec {spec}). Fix: pass the value reduced, or use a simulated mesh."
            )
        if spec.axes():
            phys = TakeBlock.apply(phys, self, spec, body) if _grad(phys) else _take_block(
                phys, self._block_starts(spec, phys.shape))
        return phys, ()

    def exit_nested(self, phys, paxes, spec, body, logical_shape, pending, tiled):
        if pending:
            raise SpecError(
                "shard_map: an unreduced output of a nested shard_map on a distributed mesh is not supported. "
                "Fix: psum it in the inner body."
            )
        if tiled:
            phys, _ = self.pvary(phys, (), tiled, body, logical_shape)
        if spec.axes():
            phys = AssembleBlocks.apply(phys, self, spec, body) if _grad(phys) else _assemble_blocks(
                phys, self, spec, body)
        return phys, ()
