"""The ops a traced graph holds on the distributed mesh, and what each does when the graph runs.

`traced.py` emits them while a graph is captured (its docstring shows where
each goes); here is their run time, the guard's part: `coll_begin` counts a
collective and returns its signature trailer (strict: exchanges it first),
`coll_wait` waits for a functional collective (watched, on the guard's
helper thread) and checks what arrived, `gloo_all_reduce` / `gloo_all_gather`
launch, wait for (on the calling thread) and check theirs, `body_end`
counts the end of a body, and `coll_record` reports a `comm_log` event.
All are ordered effectful ops, with fake kernels for tracing.  One more,
pure, `token`, is a zero whose value Inductor cannot know (`traced._depend`
ties a payload to an empty tensor through it).  A spec (or an
event) is a string, so a graph means the same in any process that loads it
from a cache: `_spec` writes one, `_get` reads it back.
"""
from __future__ import annotations

import ast
import struct

import torch
from torch._higher_order_ops.effects import _EffectType

from .. import comm
from .groups import Group, _gather_into
from .signatures import SEAL_BITS, reduce_trailer, signature16

_C = None


def _c10d():
    global _C
    if _C is None:
        import torch.distributed._functional_collectives  # noqa: F401  (registers the fake kernels)

        _C = torch.ops._c10d_functional
    return _C


# --------------------------------------------------------------------------
# The effectful ops: the guard at run time
# --------------------------------------------------------------------------
_LIB = torch.library.Library("shmap", "FRAGMENT")
_LIB.define("coll_begin(Tensor like, Tensor after, str spec) -> Tensor")
_LIB.define("coll_wait(Tensor out, Tensor sent, str spec) -> Tensor")
_LIB.define("body_end(Tensor after, str spec) -> Tensor")
_LIB.define("coll_record(Tensor after, str event) -> Tensor")
_LIB.define("gloo_all_reduce(Tensor[] parts, str op, str group, str spec) -> Tensor")
_LIB.define("gloo_all_gather(Tensor[] parts, int n, str group, str spec) -> Tensor")
_LIB.define("token(Tensor after) -> Tensor")


_SPECS: dict = {}


class _Spec:
    """One collective as the graph names it: what it is, and where its payload carries its signature."""

    __slots__ = ("kind", "axes", "shape", "dtype", "extra", "ranks", "seal", "tdtype", "tlen", "row", "gloo")

    def __init__(self, kind, axes, shape, dtype, extra, ranks, seal, tdtype, row, gloo):
        self.kind, self.axes, self.shape, self.extra = kind, tuple(axes), tuple(shape), extra
        self.dtype, self.tdtype = getattr(torch, dtype), getattr(torch, tdtype)
        self.ranks, self.seal, self.row, self.gloo = list(ranks), seal, row, gloo
        self.tlen = 2 * SEAL_BITS if seal == "reduce" else 8 if seal == "bytes" else 0


def _spec(g: Group, kind, shape, dtype, extra, seal, tdtype, row=0) -> str:
    s = repr((kind, tuple(g.axes), tuple(int(d) for d in shape), str(dtype).replace("torch.", ""), extra,
              tuple(g.ranks), seal, str(tdtype).replace("torch.", ""), int(row), g.gloo))  # (int: sizes specialised)
    if s not in _SPECS:
        _SPECS[s] = _Spec(*ast.literal_eval(s))
    return s


def _get(spec: str) -> _Spec:
    got = _SPECS.get(spec)
    if got is None:  # a graph loaded from a cache
        got = _SPECS[spec] = _Spec(*ast.literal_eval(spec))
    return got


def _watch():
    from . import watchdog

    return watchdog.watch()


def _begin_impl(like, after, spec):
    """Count the collective; check its signature now (strict, or no room for it in the payload) or
    return the trailer its payload carries (what this rank sends; what `coll_wait` expects back)."""
    from .transports import UNREAD, settle_unread

    if UNREAD:  # an eager forward psum still on the wire: finished (and checked) first, as eagerly
        settle_unread()
    s = _get(spec)
    w = _watch()
    pending = w.begin(s.kind, s.axes, s.shape, s.dtype, s.extra, exchange=s.seal is None)
    if pending is not None:
        if w.overlapping():  # default mode: the exchange runs alongside the data, checked after it
            _ALONGSIDE[spec] = pending  # (replacing one a failed collective left behind)
        else:
            w.verify(pending)  # strict: before the data moves
    if s.seal is None:
        return torch.empty(0, dtype=s.tdtype, device=like.device)
    c, n = w._static(s.kind, s.axes, s.shape, s.dtype, s.extra), w.current[0]
    if s.seal == "reduce":
        lo, hi, _ = reduce_trailer(signature16(c, n, w.epoch), s.tdtype)
        t = torch.cat([lo, hi])
    else:
        t = torch.frombuffer(bytearray(struct.pack("<IHH", c, n & 0xFFFF, w.epoch & 0xFFFF)), dtype=torch.uint8)
    return t if like.is_cpu else t.to(like.device)


#: spec -> the signature exchange `coll_begin` launched alongside its collective's data (default mode,
#: a payload with no room for the signature), checked by the `coll_wait` or gloo op that follows
#: (`_checked`), as eagerly (`transports.InFlight.finish`); a traced collective completes before the next
#: begins
_ALONGSIDE: dict = {}


class _TensorWork:
    """A functional collective's output as the guard's watched wait sees a work."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    def wait(self, timeout=None):
        _c10d().wait_tensor(self.t)
        return True

    def is_completed(self):
        return True


def _wait_impl(out, sent, spec):
    """The watched wait for the functional collective's `out` (on a helper thread: `wait_tensor` takes no
    timeout, so a helper waits while this thread watches the store and the clock); then `_checked`."""
    s = _get(spec)
    _watch().wait(_TensorWork(out), None, s.ranks, gloo=s.gloo, blocking=True)
    _checked(out, sent, s, spec)
    return torch.empty(0, dtype=torch.uint8)


def _checked(out, sent, s, spec):
    """After the wait: the exchange alongside (if any) and the trailers received must match; `done`."""
    w = _watch()
    w.verify(_ALONGSIDE.pop(spec, None), moved=True)
    if s.seal is not None and out.numel():
        if s.seal == "reduce":  # each pair keeps exactly its nonzero side iff every rank wrote the same bits
            ok = [bool(v) for v in out.reshape(-1)[-s.tlen:].tolist()] == [bool(v) for v in sent.tolist()]
        else:
            ok = all(row == sent.tolist() for row in out.reshape(-1, s.row)[:, -8:].tolist())
        if not ok:
            w.poisoned = True
            w._mismatch_found(s.ranks, "its payload's signature")
    w.done()


def _body_end_impl(after, spec):
    s = _get(spec)
    w = _watch()
    if not w.body_done():
        w.check(s.kind, (), s.shape, s.dtype, s.extra)
    return torch.empty(0, dtype=torch.uint8)


_EVENTS: dict = {}


def _record_impl(after, event):
    got = _EVENTS.get(event)
    if got is None:
        got = _EVENTS[event] = comm.CommEvent(*ast.literal_eval(event))
    comm.record(got)
    return torch.empty(0, dtype=torch.uint8)


# --------------------------------------------------------------------------
# On gloo: all_reduce and all_gather as shmap's own ops, waited for on the calling thread (why: traced.py)
# --------------------------------------------------------------------------
def _pg(group):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group)


def _all_reduce_impl(parts, op, group, spec):
    """The concatenation of `parts` (the last: the trailer sent) all-reduced, waited for and checked."""
    from torch.distributed import ReduceOp

    from .transports import _pg_all_reduce

    s = _get(spec)
    buf = torch.cat(parts)
    _watch().wait(_pg_all_reduce(buf, getattr(ReduceOp, op.upper()), _pg(group)), None, s.ranks, gloo=True)
    _checked(buf, parts[-1], s, spec)
    return buf


def _all_gather_impl(parts, n, group, spec):
    """[n, total]: every rank's concatenation of `parts` (the last: the trailer sent), waited for and
    checked."""
    s = _get(spec)
    send = torch.cat(parts).view(1, -1)
    out = send.new_empty((n, send.shape[1]))
    _watch().wait(_gather_into(out, send, _pg(group)), None, s.ranks, gloo=True)
    _checked(out, parts[-1], s, spec)
    return out


_LIB.impl("gloo_all_reduce", _all_reduce_impl, "CompositeExplicitAutograd")
_LIB.impl("gloo_all_gather", _all_gather_impl, "CompositeExplicitAutograd")
torch.library.register_fake("shmap::gloo_all_reduce", lambda parts, op, group, spec: parts[0].new_empty(
    sum(p.numel() for p in parts)), lib=_LIB)
torch.library.register_fake("shmap::gloo_all_gather", lambda parts, n, group, spec: parts[0].new_empty(
    (n, sum(p.numel() for p in parts))), lib=_LIB)
_LIB.impl("coll_begin", _begin_impl, "CompositeExplicitAutograd")
_LIB.impl("coll_wait", _wait_impl, "CompositeExplicitAutograd")
_LIB.impl("body_end", _body_end_impl, "CompositeExplicitAutograd")
_LIB.impl("coll_record", _record_impl, "CompositeExplicitAutograd")
torch.library.register_fake("shmap::coll_begin", lambda like, after, spec: like.new_empty(
    _get(spec).tlen, dtype=_get(spec).tdtype), lib=_LIB)
torch.library.register_fake("shmap::coll_wait", lambda out, sent, spec: out.new_empty(0, dtype=torch.uint8),
                            lib=_LIB)
# `token`: a float32 zero that Inductor cannot see through, made after `after` (`traced._depend`)
_LIB.impl("token", lambda after: torch.zeros(1, device=after.device), "CompositeExplicitAutograd")
torch.library.register_fake("shmap::token", lambda after: after.new_empty(1, dtype=torch.float32), lib=_LIB)
for _op in ("body_end", "coll_record"):
    torch.library.register_fake(f"shmap::{_op}", lambda after, arg: after.new_empty(0, dtype=torch.uint8), lib=_LIB)
for _op in ("shmap::coll_begin", "shmap::coll_wait", "shmap::body_end", "shmap::coll_record", "shmap::gloo_all_reduce",
            "shmap::gloo_all_gather"):
    torch.library._register_effectful_op(_op, _EffectType.ORDERED)
