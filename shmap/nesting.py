"""Nested bodies: a shard_map (or pmap) called inside another body.

An outer `shard_map(..., axis_names={'i'})` handles 'i' manually and leaves
the other mesh axes free: its values are whole along them.  A `shard_map`
inside its body binds some of those free axes.  The inner body binds its own
axes *and* its parent's (a collective over 'i' works inside it, on the same
devices), so its values are typed over both: a value entering from the outer
body keeps its variance along 'i' and gains the axes its in_spec splits.

This module types and checks; the backend moves the data (`enter_nested` /
`exit_nested` of `backends/protocol.py`).  On the simulated mesh that is a
change of layout only: an outer value is `[outer varying axes] + logical`; the
inner in_spec cuts logical dimensions into blocks whose device dims join the
leading ones in mesh order, and the out_spec puts them back.  Both are views
(reshape + permute), so autograd differentiates through the nesting as through
any op, with the collectives the body performs recorded as usual.  On the
distributed mesh entering takes this rank's block and leaving gathers them.

`pmap` nests the same way: an inner pmap *extends* its parent's mesh by one
axis (its own), which is scoped to the inner call.
"""
from __future__ import annotations

import optree

from . import context
from .cow import not_an_argument
from .errors import SpecError, VmaError, fmt_vma
from .mesh import Mesh
from .tensor import ShTensor


def same_mesh(a: Mesh, b: Mesh) -> bool:
    return (
        a.axis_names == b.axis_names and a.axis_sizes == b.axis_sizes
        and a.device_mesh is b.device_mesh and a.device == b.device
    )


def encloses(outer, inner) -> bool:
    """Whether body `outer` is a (running) ancestor of body `inner`: its values are valid there,
    typed the same (an inner body binds its parents' axes and lays them out alike)."""
    p = inner.parent
    while p is not None:
        if p is outer:
            return outer.active
        p = p.parent
    return False


def parent_for(mesh: Mesh, args) -> context.Body | None:
    """The running body a `shard_map` over `mesh` nests in, or None for an independent call.

    A call nests when a body over the same mesh is running and either leaves
    mesh axes free (`axis_names` a subset) or passes its own values in.
    """
    cur = context.current()
    if cur is None or not cur.active or not same_mesh(cur.mesh, mesh):
        return None
    if len(cur.axes) < len(mesh.axis_names):
        return cur
    leaves = optree.tree_leaves(args, none_is_leaf=True)
    if any(isinstance(v, ShTensor) and v._body is cur for v in leaves):
        return cur
    return None


def inner_manual(api: str, mesh: Mesh, manual: tuple, parent: context.Body, default_axes: bool) -> tuple:
    """The axes a nested call handles itself: its `axis_names`, which must be free in the parent."""
    if default_axes:
        manual = tuple(a for a in mesh.axis_names if a not in parent.axes)
    shadow = [a for a in manual if a in parent.axes]
    if shadow:
        free = tuple(a for a in mesh.axis_names if a not in parent.axes)
        raise SpecError(
            f"{api}: nested inside a body that already handles mesh axes {parent.axes} manually, but "
            f"its axis_names include {', '.join(repr(a) for a in shadow)} (mesh {mesh.describe()}). An inner "
            f"call can only bind axes its parent leaves free: {free if free else 'none are free'}. Fix: "
            + (f"pass axis_names={set(free)!r} (or leave axis_names out)" if free else
               "give the outer shard_map axis_names= a subset of the mesh axes, so that some stay free")
            + "."
        )
    if not manual:
        raise SpecError(
            f"{api}: nested inside a body over mesh {mesh.describe()} that handles every axis "
            f"{parent.axes} already; there is no free axis left to bind. Fix: give the outer shard_map "
            "axis_names= a subset of the mesh axes."
        )
    return manual


def inner_body(mesh: Mesh, manual: tuple, parent: context.Body, check_vma: bool, backend, api: str,
               kind: str = "shard_map"):
    if not (check_vma and parent.check_vma):
        raise SpecError(
            f"{api}: a nested shard_map needs check_vma=True on both levels (typed values tell the inner "
            "body which outer axes each value varies along). Fix: drop check_vma=False."
        )
    if parent.backend.name != backend.name:
        raise SpecError(
            f"{api}: the inner mesh {mesh.describe()} is {backend.name} but the enclosing body's is "
            f"{parent.backend.name}. Fix: build both meshes the same way."
        )
    axes = tuple(a for a in mesh.axis_names if a in parent.axes or a in manual)
    return context.Body(mesh=mesh, axes=axes, check_vma=True, backend=backend, parent=parent, own=tuple(manual),
                        kind=kind)


def enter(value: ShTensor, spec, body) -> ShTensor:
    """A parent body's value -> this body's: split the logical dims the spec names (a view)."""
    phys, paxes = body.backend.enter_nested(value._phys, value._paxes, spec, body)
    vma = value._vma | frozenset(spec.axes())
    unreduced = value._unreduced
    if spec.unreduced:
        phys, paxes = body.backend.unreduced_input(phys, paxes, body.order(spec.unreduced), body)
        vma = vma | spec.unreduced
        unreduced = unreduced | spec.unreduced
    return ShTensor(phys, paxes, vma, body, unreduced)


def exit(path, value, spec, body, mesh, fname):
    """This body's output -> the parent body's value, after the replication check over own axes."""
    from .shard_map import _axes_lit, _check_spec, _output_value, _unmentioned_axes

    parent = body.parent
    if isinstance(value, ShTensor) and value._body is parent:
        value = ShTensor(value._phys, value._paxes, value._vma, body, value._unreduced)
    x = _output_value(path, value, body, fname)
    own = frozenset(body.own)
    _check_spec(spec, path, x.shape, mesh, body.own, fname, what="the output", split=False)
    implicit = spec.unreduced - x._unreduced
    if implicit and body.check_vma and implicit <= x._vma:  # as at the top level (and JAX): an implicit pcast
        x = ShTensor(x._phys, x._paxes, x._vma, body, x._unreduced | implicit)
    own_unred = x._unreduced & own
    if own_unred != spec.unreduced:
        raise VmaError(
            f"shard_map({fname}) {path}: its spec {spec} says the output is unreduced along "
            f"{fmt_vma(spec.unreduced, body.axes) if spec.unreduced else 'no axes'} but the value is unreduced "
            f"along {fmt_vma(own_unred, body.axes) if own_unred else 'no axes'} of this call's axes "
            f"{body.own}. Fix: make them match, e.g. reduce it with "
            f"`shmap.psum(y, {_axes_lit(body.order(own_unred or spec.unreduced))})`."
        )
    varying = x._vma - x._unreduced
    named = set(spec.axes())
    extra = [a for a in body.own if a in varying and a not in named]
    if extra:
        raise _unmentioned_axes(fname, path, spec, x, varying, extra, mesh, body)
    # JAX's implicit pvary of an invariant value tiled into a mapped output (named axes are
    # never unreduced ones, so the pending sum does not change which)
    tiled = body.order(frozenset(a for a in named if a not in x._vma))
    phys, paxes = body.backend.exit_nested(not_an_argument(body, x._phys), x._paxes, spec, body, x.shape, own_unred,
                                           tiled)
    # every own axis it varied along is named (checked above) or was pending: whole along all of them now
    return ShTensor(phys, paxes, x._vma - own, parent, x._unreduced - own)
