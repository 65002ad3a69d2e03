"""Simulated mesh: every device in one process, values laid out by their type.

Physical layout of a body value varying along axes `L` (mesh order):
`[size(a) for a in L] + logical shape`.  Each collective below is a tensor op
on those leading dimensions; its autograd derivative *is* the transpose
collective on this layout (sum <-> expand, gather-reshape <-> sum-slice,
index <-> inverse index), and `log_comm` records which collective each
direction performs.  The `# kind: in -> out` headers give the type rule that
`shmap.collectives` checks before calling in.
"""
from __future__ import annotations

import math

import torch

from .. import batching
from ..recording import event, log_comm
from ..tensor import expand_to
from .functions import _Function
from .protocol import Backend


class Simulated(Backend):
    """Physical collectives and the global<->per-device boundary, batched (`protocol.Backend`)."""

    name = "simulated"
    #: a value varying along axes L is one tensor with a leading dim per axis of L
    device_dims = True
    #: ordinary ops run once over all devices' blocks (`batching.run_op`: direct forms, else vmap)
    run_op = staticmethod(batching.run_op)

    def describe_device(self):
        return None  # every device's block is here

    # ------------------------------------------------------------------
    # Boundary
    # ------------------------------------------------------------------
    def split(self, x: torch.Tensor, spec, body):
        """Global value -> (phys, paxes): split named dims, mesh axes leading.

        A view (reshape + permute), so autograd's backward is the assembly.
        """
        if not spec.axes():
            return x, ()
        if not all(type(s) is int for s in x.shape):  # symbolic sizes (torch.compile dynamic shapes)
            shape, perm, paxes = self._split_plan(x, spec, body)
            return x.reshape(shape).permute(perm), paxes
        key = (spec, tuple(x.shape), body.axes, tuple(body.sizes.values()))
        got = _SPLITS.get(key)
        if got is None:
            if len(_SPLITS) >= 4096:  # (a bound, as the other plan caches have: shapes may change every call)
                _SPLITS.clear()
            got = _SPLITS[key] = self._split_plan(x, spec, body)
        shape, perm, paxes = got
        return x.reshape(shape).permute(perm), paxes

    def _split_plan(self, x, spec, body):
        shape = []
        lead_pos = {}
        for d in range(x.dim()):
            for a in spec.dim_axes(d):
                lead_pos[a] = len(shape)
                shape.append(body.sizes[a])
            n = math.prod(body.sizes[a] for a in spec.dim_axes(d))
            shape.append(x.shape[d] // n)
        paxes = body.order(tuple(lead_pos))
        lead = [lead_pos[a] for a in paxes]
        rest = [i for i in range(len(shape)) if i not in lead_pos.values()]
        return shape, lead + rest, paxes

    def assemble(self, phys, paxes, spec, body, logical_shape):
        """(phys, paxes) -> global value, concatenating blocks along named axes.

        Named axes the value is invariant along are tiled (expand); axes it
        carries but the spec does not name (only with check_vma=False) keep
        device 0's copy, with JAX's defensive transpose (cotangent / size).
        """
        if all(type(s) is int for s in logical_shape):  # (not symbolic sizes: torch.compile dynamic shapes)
            key = (paxes, spec, tuple(logical_shape), body.axes, tuple(body.sizes.values()))
            got = _ASSEMBLIES.get(key)
            if got is None:
                got = self._assembly_plan(paxes, spec, body, logical_shape)
                if len(_ASSEMBLIES) < 65536:
                    _ASSEMBLIES[key] = got
            if got is not None:  # (None: axes to drop, the general path below)
                target, perm, out_shape = got
                if not perm:
                    return phys
                return expand_to(phys, paxes, target, body.sizes).permute(perm).reshape(out_shape)
        named = spec.axes()
        if not named and not paxes:
            return phys
        drop = [a for a in paxes if a not in named]
        for a in reversed(drop):
            d = paxes.index(a)
            phys = TakeFirst.apply(phys, d, body.sizes[a])
            paxes = paxes[:d] + paxes[d + 1:]
        target = body.order((*paxes, *named))
        phys = expand_to(phys, paxes, target, body.sizes)
        perm, out_shape = _interleave(target, spec, body, logical_shape)
        return phys.permute(perm).reshape(out_shape)

    def _assembly_plan(self, paxes, spec, body, logical_shape):
        """`assemble`'s (target axes, permutation, global shape) when no axis is dropped, else None
        (a value without named axes and device dims: an empty permutation, returned as is)."""
        named = spec.axes()
        if not named and not paxes:
            return (), [], ()
        if any(a not in named for a in paxes):
            return None
        target = body.order((*paxes, *named))
        return (target, *_interleave(target, spec, body, logical_shape))

    def input_value(self, phys, paxes, body):
        """With check_vma=False every value is treated as varying on every axis."""
        if body.check_vma:
            return phys, paxes, frozenset(paxes)
        full = body.axes
        added = [a for a in full if a not in paxes]
        if added:
            # JAX's defensive transpose: psum the cotangent of unmapped inputs.
            shape = phys.shape[len(paxes):]
            phys = log_comm(phys, None, event("psum", added, shape, phys.dtype))
            phys = expand_to(phys, paxes, full, body.sizes)
        return phys, full, frozenset(full)

    def unreduced_input(self, phys, paxes, axes, body):
        """A global value as a pending sum along `axes`: device 0 holds it, the others zeros."""
        for a in axes:
            paxes = body.order((*paxes, a))
            d = paxes.index(a)
            zeros = phys.new_zeros(phys.shape[:d] + (body.sizes[a] - 1,) + phys.shape[d:])
            phys = torch.cat([phys.unsqueeze(d), zeros], d)
        return phys, paxes

    def unreduced_output(self, phys, paxes, axes, body):
        """The logical value of a pending sum: the sum of its terms (no collective is recorded:
        the caller, not the program, asked for it)."""
        dims = [paxes.index(a) for a in axes]
        return _device_sum(phys, dims), tuple(a for a in paxes if a not in axes)

    # ------------------------------------------------------------------
    # Nested shard_map: a change of layout (views), so autograd needs nothing special
    # ------------------------------------------------------------------
    def enter_nested(self, phys, paxes, spec, body):
        """Cut the logical dims `spec` names into new device dims, joining the leading ones in mesh order."""
        k = len(paxes)
        shape = list(phys.shape[:k])
        pos = {a: i for i, a in enumerate(paxes)}
        for d, size in enumerate(phys.shape[k:]):
            axes = spec.dim_axes(d)
            for a in axes:
                pos[a] = len(shape)
                shape.append(body.sizes[a])
            shape.append(size // math.prod(body.sizes[a] for a in axes))
        new = body.order(tuple(pos))
        lead = [pos[a] for a in new]
        rest = [i for i in range(len(shape)) if i not in lead]
        return phys.reshape(shape).permute(lead + rest), new

    def exit_nested(self, phys, paxes, spec, body, logical_shape, pending, tiled):
        """Sum the pending terms, pvary along `tiled`, then fold the named device dims back into
        the logical dims (the reverse of `enter_nested`)."""
        if pending:
            phys, paxes = self.unreduced_output(phys, paxes, body.order(pending), body)
        if tiled:
            phys, paxes = self.pvary(phys, paxes, tiled, body, logical_shape)
        sizes = body.sizes
        named = spec.axes()
        target = body.order((*paxes, *named))
        phys = expand_to(phys, paxes, target, sizes)
        keep = tuple(a for a in target if a not in named)
        k = len(target)
        perm = [target.index(a) for a in keep]
        out_shape = [sizes[a] for a in keep]
        for d, size in enumerate(logical_shape):
            axes = spec.dim_axes(d)
            perm.extend(target.index(a) for a in axes)
            perm.append(k + d)
            out_shape.append(size * math.prod(sizes[a] for a in axes))
        return phys.permute(perm).reshape(out_shape), keep

    # ------------------------------------------------------------------
    # Automatic pvary: a physical no-op (see tensor.py)
    # ------------------------------------------------------------------
    def lift(self, phys, logical_shape, added_axes, body):
        return log_comm(phys, None, event("psum", added_axes, logical_shape, phys.dtype))

    # ------------------------------------------------------------------
    # psum: varying{A} -> invariant{A}        transpose: pvary
    # ------------------------------------------------------------------
    def psum(self, phys, paxes, axes, body, shape, unchecked):
        out, out_paxes = _sum_over(phys, paxes, axes, body)
        ev = event("psum", axes, shape, phys.dtype)
        if unchecked:
            out = expand_to(out, out_paxes, paxes, body.sizes)
            return log_comm(out, ev, ev), paxes
        return log_comm(out, ev, None), out_paxes

    # ------------------------------------------------------------------
    # pmax / pmin: varying{A} -> invariant{A}  (subgradient: devices holding
    # the extremum, ties split evenly, as torch.amax)
    # ------------------------------------------------------------------
    def pextremum(self, kind, phys, paxes, axes, body, shape, unchecked):
        # recorded on the operand, before the reduction: a non-reentrant checkpoint's recomputation stops
        # once the region's last saved tensor is packed, which may be the reduction's (amax saves), so a
        # record after it was lost (the distributed mesh records first too)
        phys = log_comm(phys, event(kind, axes, shape, phys.dtype), None)
        dims = [paxes.index(a) for a in axes if a in paxes]
        if dims:  # (a view of the result, which amax saves: an in-place update copies it first, cow.py)
            out = phys.amax(dims) if kind == "pmax" else phys.amin(dims)
            out = out.view_as(out)
        else:
            out = phys
        out_paxes = tuple(a for a in paxes if a not in axes)
        if unchecked:
            return expand_to(out, out_paxes, paxes, body.sizes), paxes
        return out, out_paxes

    # ------------------------------------------------------------------
    # pvary: invariant{A} -> varying{A}        transpose: psum
    # ------------------------------------------------------------------
    def pvary(self, phys, paxes, axes, body, shape):
        target = body.order((*paxes, *axes))
        out = expand_to(phys, paxes, target, body.sizes)
        return log_comm(out, None, event("psum", axes, shape, phys.dtype)), target

    # ------------------------------------------------------------------
    # all_gather: varying{A} -> varying{A}     transpose: psum_scatter
    # all_gather_invariant: varying{A} -> invariant{A}  transpose: own-block slice
    # ------------------------------------------------------------------
    def all_gather(self, phys, paxes, axes, body, shape, axis, tiled, invariant, unchecked):
        phys, paxes = self._materialize(phys, paxes, axes, body)
        t, other = _gather_front(phys, paxes, axes, body)
        k = len(other)
        t = t.movedim(0, k + axis)
        if tiled:
            t = t.flatten(k + axis, k + axis + 1)
        out_shape = t.shape[k:]
        if invariant and not unchecked:
            ev = event("all_gather_invariant", axes, shape, phys.dtype)
            return log_comm(t, ev, None), other
        out = expand_to(t, other, paxes, body.sizes)
        ev = event("all_gather", axes, shape, phys.dtype)
        back = event("psum_scatter", axes, out_shape, phys.dtype)
        return log_comm(out, ev, back), paxes

    # ------------------------------------------------------------------
    # psum_scatter: varying{A} -> varying{A}   transpose: all_gather
    # ------------------------------------------------------------------
    def psum_scatter(self, phys, paxes, axes, body, shape, dim, tiled):
        n = math.prod(body.sizes[a] for a in axes)
        s, rest = _sum_over(phys, paxes, axes, body)
        k = len(rest)
        if tiled:
            s = s.unflatten(k + dim, (n, shape[dim] // n))
        t = s.movedim(k + dim, 0)
        out, out_paxes = _scatter_front(t, axes, rest, body)
        ev = event("psum_scatter", axes, shape, phys.dtype)
        back = event("all_gather", axes, out.shape[len(out_paxes):], phys.dtype)
        return log_comm(out, ev, back), out_paxes

    # ------------------------------------------------------------------
    # ppermute: varying{A} -> varying{A}       transpose: ppermute(inverse)
    # ------------------------------------------------------------------
    def ppermute(self, phys, paxes, axes, body, shape, perm):
        ev = event("ppermute", axes, shape, phys.dtype)
        phys = log_comm(phys, ev, ev)
        phys, paxes = self._materialize(phys, paxes, axes, body)
        t, other = _gather_front(phys, paxes, axes, body)
        src = dict((d, s) for s, d in perm)
        if not src:  # no device receives: zeros, still a function of the operand (its gradient is zeros)
            none = torch.zeros((), dtype=torch.bool, device=t.device)
            return _scatter_front(torch.where(none, t, torch.zeros((), dtype=t.dtype, device=t.device)), axes,
                                  other, body)
        # Each destination's row selected (a view) and stacked: ops that save no tensor for the backward
        # pass, as the distributed mesh's ppermute saves none, so a non-reentrant checkpoint's recomputation
        # stops at the same op on both meshes (an index_select saved its index, a where its mask: the
        # simulated mesh went on to recompute, and log, a ppermute the processes did not)
        zeros = None
        rows = []
        for d in range(t.shape[0]):
            if d in src:
                rows.append(t[src[d]])
            else:  # no source: zeros
                zeros = torch.zeros_like(t[0]) if zeros is None else zeros
                rows.append(zeros)
        return _scatter_front(torch.stack(rows), axes, other, body)

    # ------------------------------------------------------------------
    # all_to_all: varying{A} -> varying{A}     transpose: all_to_all(concat, split)
    # ------------------------------------------------------------------
    def all_to_all(self, phys, paxes, axes, body, shape, split_axis, concat_axis, tiled):
        phys, paxes = self._materialize(phys, paxes, axes, body)
        t, other = _gather_front(phys, paxes, axes, body)  # [src, other..., logical]
        n = t.shape[0]
        k = len(other)
        sd = 1 + k + split_axis
        if tiled:
            t = t.unflatten(sd, (n, shape[split_axis] // n))
        t = t.movedim(sd, 0)  # [dst, src, other..., logical (split dim removed if untiled)]
        # Put the source dim where the output's concat dim is (src major).
        cd = 1 + k + concat_axis
        t = t.movedim(1, cd)
        if tiled:
            t = t.flatten(cd, cd + 1)
        out, out_paxes = _scatter_front(t, axes, other, body)
        ev = event("all_to_all", axes, shape, phys.dtype)
        back = event("all_to_all", axes, out.shape[len(out_paxes):], phys.dtype)
        return log_comm(out, ev, back), out_paxes

    # ------------------------------------------------------------------
    # axis_index: -> varying{A}, an integer scalar per device
    # ------------------------------------------------------------------
    def axis_index(self, axes, body, device, unchecked):
        n = math.prod(body.sizes[a] for a in axes)
        t = torch.arange(n, device=device).reshape([body.sizes[a] for a in axes])
        target = body.order(axes)
        t = t.permute([axes.index(a) for a in target])
        if unchecked:
            return self._materialize(t, target, body.axes, body)
        return t, target

    # ------------------------------------------------------------------
    def _materialize(self, phys, paxes, axes, body):
        target = body.order((*paxes, *axes))
        return expand_to(phys, paxes, target, body.sizes), target


def _sum_over(phys, paxes, axes, body):
    """Sum over the devices of `axes`: their leading dims, and those the value is broadcast along
    (typed varying by a lift, stored once). Returns (sum, remaining paxes).

    In the distributed mesh's order, so that a small floating sum has its bits: one process per
    device adds the devices' blocks one after another in position order (the tuple's, major first:
    `transports.reduce_rows`), and a value broadcast along an axis is that many real copies (whose
    sum is not n * x in floating point).  Integers wrap alike either way: n * x for those."""
    missing = [a for a in axes if a not in paxes]
    floating = phys.dtype.is_floating_point or phys.dtype.is_complex
    if missing and floating:
        target = body.order((*paxes, *missing))
        phys, paxes, missing = expand_to(phys, paxes, target, body.sizes), target, []
    dims = [paxes.index(a) for a in axes if a in paxes]
    rest_axes = tuple(a for a in paxes if a not in axes)
    if len(dims) > 1 and floating:  # the devices as one dim in position order, summed row by row
        rest = [d for d in range(phys.dim()) if d not in dims]
        t = phys.permute(dims + rest).contiguous()
        out = _device_sum(t.flatten(0, len(dims) - 1), [0])
    else:
        out = _device_sum(phys, dims) if dims else phys
    if missing:
        out = out * math.prod(body.sizes[a] for a in missing)
    return out, rest_axes


def _device_sum(t, dims):
    """Sum over device dims in the operand's dtype: integers wrap, as on one process per device
    (torch.distributed) and in JAX, instead of torch's promotion to int64.  Floating sums keep
    torch's own (float32 accumulation for 16-bit floats, rounded once)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.sum(dims)
    return t.sum(dims, dtype=t.dtype)


def _gather_front(phys, paxes, axes, body):
    """Move the dims of `axes` (in that order, major first) to the front, merged into one."""
    g = [paxes.index(a) for a in axes]
    o = [d for d in range(len(paxes)) if d not in g]
    rest = list(range(len(paxes), phys.dim()))
    t = phys.permute(g + o + rest)
    t = t.flatten(0, len(g) - 1) if len(g) > 1 else t
    return t, tuple(paxes[d] for d in o)


def _scatter_front(t, axes, other, body):
    """Inverse of `_gather_front`: split dim 0 into `axes` dims, restore mesh order."""
    t = t.unflatten(0, [body.sizes[a] for a in axes]) if len(axes) > 1 else t
    cur = (*axes, *other)
    target = body.order(cur)
    perm = [cur.index(a) for a in target] + list(range(len(cur), t.dim()))
    return t.permute(perm), target


class TakeFirst(_Function):
    """Device 0's copy along one leading dim; cotangent spread as ct / size (JAX's defensive transpose).

    In `setup_context` form with a jvp rule and a generated vmap rule, so a
    torch.func transform of a check_vma=False shard_map works from outside.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(phys, dim, size):
        return phys.select(dim, 0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.dim, ctx.size = inputs

    @staticmethod
    def backward(ctx, g):
        shape = list(g.shape)
        shape.insert(ctx.dim, ctx.size)
        return (g / ctx.size).unsqueeze(ctx.dim).expand(shape), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return t.select(ctx.dim, 0)


_SPLITS: dict = {}
_ASSEMBLIES: dict = {}

SIMULATED = Simulated()


def _interleave(target, spec, body, logical_shape):
    """(permutation, global shape) that put each named device dim of a value laid out as
    `[*target devices, *logical_shape]` just before the dimension `spec` splits over it."""
    k = len(target)
    perm, out_shape = [], []
    for d, size in enumerate(logical_shape):
        axes = spec.dim_axes(d)
        perm.extend(target.index(a) for a in axes)
        perm.append(k + d)
        out_shape.append(size * math.prod(body.sizes[a] for a in axes))
    return perm, out_shape
