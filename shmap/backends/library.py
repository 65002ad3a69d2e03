"""The distributed mesh's collectives as named PyTorch ops: `torch.ops.shmap.psum`, `all_gather`, ...

Each op is one raw transport (`transports.py`: the guard, the signature, the
watched wait) behind the dispatcher, with a fake implementation that gives
the output's shape and dtype without communicating.  So the profiler, fake
tensors (`FakeTensorMode`, meta shape propagation) and anything else that
walks the dispatcher see `shmap::psum` where a body reduces, not an opaque
Python call.  The ops have no autograd kernel and no batching rule of their
own: the collectives' autograd Functions (`functions.py`) call them in their
forward and give them their derivative (the transpose collective) and their
vmap rule (one collective on the whole batch).

A process group is not an op argument type, so an op takes an integer that
names a `Group` (`group_id`), registered once per group.

Defined with the low-level `Library` API, as `shmap::record` is (`ops.py`):
`torch.library.custom_op` wraps every call in Python dispatch and autograd
layers costing tens of microseconds; here the dispatcher calls the kernel
directly (a few microseconds per call).

While a graph is captured (`traced.tracing()`), the Functions do not call
these ops: the transports hand over to `traced.py`, whose functional
collectives and guard ops are what a compiled graph runs (see `collective`).
"""
from __future__ import annotations

import torch

from . import deferred
from .traced import tracing
from .transports import _all_gather, _all_reduce, _all_to_all, _ppermute, _psum_scatter, result_shape

_LIB = torch.library.Library("shmap", "FRAGMENT")  # ops.py and traced.py add shmap:: ops too

#: group id -> Group, and id(Group) -> group id (groups live as long as their mesh's backend)
_GROUPS: list = []
_IDS: dict = {}


def group_id(g) -> int:
    """The integer that names group `g` in an op call (registered on first use)."""
    i = _IDS.get(id(g))
    if i is None or _GROUPS[i] is not g:
        i = _IDS[id(g)] = len(_GROUPS)
        _GROUPS.append(g)
    return i


def group(i: int):
    """The `Group` an op's integer names."""
    return _GROUPS[i]


# --------------------------------------------------------------------------
# Schemas, kernels (the transports) and fake implementations (shapes only)
# --------------------------------------------------------------------------
_LIB.define("psum(Tensor x, int group, str kind) -> Tensor")
_LIB.define("all_gather(Tensor x, int group, int axis, bool tiled, str kind) -> Tensor")
_LIB.define("psum_scatter(Tensor x, int group, int dim, bool tiled) -> Tensor")
_LIB.define("ppermute(Tensor x, int group, int[] perm) -> Tensor")
_LIB.define("all_to_all(Tensor x, int group, int split_axis, int concat_axis, bool tiled) -> Tensor")


def _pairs(perm):
    """[s0, d0, s1, d1, ...] (the op's int[]) -> ((s0, d0), (s1, d1), ...)."""
    return tuple(zip(perm[::2], perm[1::2]))


def _psum_kernel(x, group, kind):
    return _all_reduce(x, _GROUPS[group], kind)


def _gather(x, g, axis, tiled, kind):
    if kind == "all_gather":  # gathers issued back to back share buckets (FSDP's forward; see deferred.py)
        return deferred.all_gather(x, g, axis, tiled)
    return _all_gather(x, g, axis, tiled, kind)


def _all_gather_kernel(x, group, axis, tiled, kind):
    return _gather(x, _GROUPS[group], axis, tiled, kind)


def _psum_scatter_kernel(x, group, dim, tiled):
    return _psum_scatter(x, _GROUPS[group], dim, tiled)


def _ppermute_kernel(x, group, perm):
    return _ppermute(x, _GROUPS[group], _pairs(perm))


def _all_to_all_kernel(x, group, split_axis, concat_axis, tiled):
    return _all_to_all(x, _GROUPS[group], split_axis, concat_axis, tiled)


def _fake_psum(x, group, kind):
    return torch.empty_like(x)


def _fake_all_gather(x, group, axis, tiled, kind):  # (all_gather_invariant: the same shape)
    return x.new_empty(result_shape("all_gather", x.shape, _GROUPS[group], axis=axis, tiled=tiled))


def _fake_psum_scatter(x, group, dim, tiled):
    return x.new_empty(result_shape("psum_scatter", x.shape, _GROUPS[group], scatter_dimension=dim, tiled=tiled))


def _fake_ppermute(x, group, perm):
    return torch.empty_like(x)


def _fake_all_to_all(x, group, split_axis, concat_axis, tiled):
    return x.new_empty(result_shape("all_to_all", x.shape, _GROUPS[group], split_axis=split_axis,
                                    concat_axis=concat_axis, tiled=tiled))


for _name, _kernel, _fake in (
    ("psum", _psum_kernel, _fake_psum),
    ("all_gather", _all_gather_kernel, _fake_all_gather),
    ("psum_scatter", _psum_scatter_kernel, _fake_psum_scatter),
    ("ppermute", _ppermute_kernel, _fake_ppermute),
    ("all_to_all", _all_to_all_kernel, _fake_all_to_all),
):
    _LIB.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"shmap::{_name}", _fake, lib=_LIB)

_OPS = torch.ops.shmap


# --------------------------------------------------------------------------
# What the Functions call: the op eagerly, the transport while a graph is captured
# --------------------------------------------------------------------------
def psum(x, g, kind="psum"):
    """psum / pmax / pmin of `x` over group `g` (`shmap::psum`)."""
    if tracing():  # the transport hands over to traced.py's functional collectives
        return _all_reduce(x, g, kind)
    return _OPS.psum.default(x, group_id(g), kind)


def all_gather(x, g, axis, tiled, kind="all_gather"):
    """all_gather (or all_gather_invariant, `kind`) of `x` over group `g` (`shmap::all_gather`)."""
    if tracing():  # (gathers back to back share buckets in a graph too)
        return _gather(x, g, axis, tiled, kind)
    return _OPS.all_gather.default(x, group_id(g), axis, tiled, kind)


def psum_scatter(x, g, dim, tiled):
    """psum_scatter of `x` over group `g` (`shmap::psum_scatter`)."""
    if tracing():
        return _psum_scatter(x, g, dim, tiled)
    return _OPS.psum_scatter.default(x, group_id(g), dim, tiled)


def ppermute(x, g, perm):
    """ppermute of `x` over group `g`; `perm` as (source, destination) pairs (`shmap::ppermute`)."""
    if tracing():
        return _ppermute(x, g, perm)
    return _OPS.ppermute.default(x, group_id(g), [i for pair in perm for i in pair])


def all_to_all(x, g, split_axis, concat_axis, tiled):
    """all_to_all of `x` over group `g` (`shmap::all_to_all`)."""
    if tracing():
        return _all_to_all(x, g, split_axis, concat_axis, tiled)
    return _OPS.all_to_all.default(x, group_id(g), split_axis, concat_axis, tiled)
