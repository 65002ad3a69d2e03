"""The stack of running shard_map bodies (which mesh axes are bound, and how).

Collectives look up their axis names here; values remember the body that made
them so that mixing values of different bodies is caught.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from .errors import unbound_axis
from .mesh import Mesh


@dataclass(eq=False)
class Body:
    """One running shard_map body.

    `axes` are the manual mesh axes (mesh order); `sizes` their sizes;
    `check_vma` whether values are typed.  `lift_cache` memoises the automatic
    `pvary` of plain (closed-over) tensors, so a parameter used twice gets one
    `psum` of its gradient, not two.
    """

    mesh: Mesh
    axes: tuple
    check_vma: bool
    backend: object
    sizes: dict = field(default_factory=dict)
    lift_cache: dict = field(default_factory=dict)
    active: bool = True
    #: the enclosing body of a nested shard_map / pmap (whose axes this body also binds), or None
    parent: object = None
    #: the axes this body's own specs split (default: all of `axes`; a nested body's exclude its parent's)
    own: tuple = None
    #: "shard_map" or "pmap" (whose mesh is its own: no shard_map nests in a pmap's body)
    kind: str = "shard_map"

    def __post_init__(self):
        self.sizes = {a: self.mesh.shape[a] for a in self.axes}
        if self.own is None:
            self.own = self.axes
        self._orders = {}
        #: the types of argument the backend takes by `enter_block` (DTensors), or ()
        self.block_types = self.backend.block_types

    def order(self, axes) -> tuple:
        """`axes` (any collection of this body's axis names) in mesh order: the one function for it.

        Physical device dims, process groups and messages all list axes this way.  Cached per
        hashable argument (the hot path passes a value's frozenset type).
        """
        try:
            got = self._orders.get(axes)
        except TypeError:  # a set or a dict: unhashable
            return tuple(a for a in self.axes if a in axes)
        if got is None:
            got = tuple(a for a in self.axes if a in axes)
            self._orders[axes] = got
        return got

    def describe(self) -> str:
        return "(" + ", ".join(f"{a}={self.sizes[a]}" for a in self.axes) + ")"


_local = threading.local()


def stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current() -> Body | None:
    s = stack()
    return s[-1] if s else None


def body_for_axes(api: str, axes: tuple, hint: Body | None = None) -> Body:
    """The innermost body binding every axis in `axes`, or a clear error.

    In a backward pass (a region recomputed by `torch.utils.checkpoint`, a hook)
    the body may have returned already; there the operand's body (`hint`) or the
    body last used in this backward pass binds the axes.
    """
    s = stack()
    for body in reversed(s):
        if all(a in body.sizes for a in axes):
            return body
    if in_backward():
        last = _local.backward_body if getattr(_local, "backward_task", None) == _task() else None
        for body in (hint, last):
            if body is not None and all(a in body.sizes for a in axes):
                used_in_backward(body)
                return body
    bound = s[-1].axes if s else ()
    missing = [a for a in axes if not (s and a in s[-1].sizes)]
    name = missing[0] if missing else axes[0]
    mesh = s[-1].mesh if s else None
    free = mesh is not None and name in getattr(mesh, "axis_names", ())
    raise unbound_axis(api, name, bound, s[-1].kind if s else "shard_map", mesh if free else None)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def used_in_backward(body: Body) -> None:
    """Remember `body` as the one this backward pass is recomputing (see `body_for_axes`), until the
    pass ends: a later pass (a plain hook calling a collective) must not find it, nor keep it (and the
    tensors its lift cache holds) alive."""
    task = _task()
    if getattr(_local, "backward_task", None) != task:
        _local.backward_task = task
        torch.autograd.Variable._execution_engine.queue_callback(_forget_backward_body)
    _local.backward_body = body


def _forget_backward_body():
    _local.backward_body = _local.backward_task = None


_task = torch._C._current_graph_task_id


@contextlib.contextmanager
def reentered(body: Body):
    """Run code of `body` again after it returned (a custom Function's backward)."""
    was = body.active
    stack().append(body)
    body.active = True
    try:
        yield body
    finally:
        body.active = was
        stack().pop()
