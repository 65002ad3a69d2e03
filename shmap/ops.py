"""shmap's PyTorch operators: what a captured graph sees of a collective.

On the simulated mesh a collective's data movement is ordinary tensor ops on
the leading (device) dimensions; what makes it a collective is the event it
reports to `comm_log`.  Eagerly that report is a Python call.  Under tracing
(`torch.compile`, `make_fx`, AOT autograd) a Python call would run once, at
trace time, so the report is the operator `shmap::record(event)` instead: an
*ordered effectful* op (like `aten::_print`), which compiled graphs keep, keep
in order, and run on every call.  A graph therefore names each collective
(`torch.ops.shmap.record(<id>)`, `describe(id)` says which) and `comm_log`
records the same events per call compiled as eager, forward and backward.

Events are interned: the op's argument is an integer id into `EVENTS`.
"""
from __future__ import annotations

import threading

import torch
from torch._higher_order_ops.effects import _EffectType

from . import comm

#: interned events; the id is the index
EVENTS: list = []
_IDS: dict = {}
_LOCK = threading.Lock()


def intern(event: comm.CommEvent) -> int:
    got = _IDS.get(event)
    if got is None:
        with _LOCK:
            got = _IDS.get(event)
            if got is None:
                got = len(EVENTS)
                EVENTS.append(event)
                _IDS[event] = got
    return got


def describe(event_id: int) -> comm.CommEvent:
    """The collective a `shmap.record(event_id)` node in a graph reports."""
    return EVENTS[event_id]


# Defined with the low-level Library API (not `custom_op`, whose Python autograd and
# dispatch wrappers cost tens of microseconds per call): the dispatcher calls `_record_impl`
# directly, for every dispatch key (CompositeExplicitAutograd), and the op has no gradient.
_LIB = torch.library.Library("shmap", "FRAGMENT")  # other modules may add shmap:: ops too
_LIB.define("record(Tensor x, int event) -> ()")


def _record_impl(x, event):
    comm.record(EVENTS[event])


_LIB.impl("record", _record_impl, "CompositeExplicitAutograd")
torch.library.register_fake("shmap::record", lambda x, event: None, lib=_LIB)
torch.library._register_effectful_op("shmap::record", _EffectType.ORDERED)


def _record_vmap(info, in_dims, x, event):
    """Under vmap (jacrev, hessian; traced by torch.compile) a collective is one collective of the batch,
    reported once, as eagerly."""
    torch.ops.shmap.record(x, event)
    return None, None


torch.library.register_vmap("shmap::record", _record_vmap, lib=_LIB)


def record(event: comm.CommEvent, like: torch.Tensor) -> None:
    """Report `event` to comm_log: directly when running eagerly, as an op when traced.

    `like` is the tensor the collective runs on; a subclass (fake, functional)
    or an active dispatch mode means a graph is being captured.
    """
    if type(like) is torch.Tensor and not torch._C._len_torch_dispatch_stack() and not _compiling():
        comm.record(event)
    else:
        torch.ops.shmap.record(like, intern(event))


def _compiling() -> bool:
    return torch.compiler.is_compiling()
