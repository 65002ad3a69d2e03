"""The commonest collectives' short way: an eager psum or all_gather of a block over one axis.

A collective of a few KiB is mostly the call's own Python.  On 2 gloo
processes (4 KiB, medians of interleaved calls, each after a barrier) the
general path took about 1.35x the raw `dist.all_reduce` of a fresh copy for
a psum, and 2.3x the raw `all_gather_into_tensor` for an all_gather: the
front end's operand and argument handling, the backend's choice of Function,
the transport's dtype, transport and bucket decisions, the launch's generic
bookkeeping, the result's copy-on-write notes.  The guard's own work (the
signature in the payload, the watched wait, the signature check) costs
little: a psum's steps alone, written out, ran at 1.0x.

`quick_psum` and `quick_all_gather` take the direct path where it gives what
the general path (`collectives.psum`, `collectives._all_gather`) gives, and
return None everywhere else: a value of the running innermost body, typed
(check_vma), not a pending sum, with nothing to differentiate (no autograd,
no torch.func transform), of a dtype gloo moves and sums as it is
(float32/64, int32/64), over one axis of more than one process, on the
process group itself (no shared-memory transport, no all_gather-then-reduce
of a small psum on 3+ processes), in the default mode with the signature in
the payload (an all_gather of more than `_SEAL_BYTES_LIMIT` exchanges its
signature beside it: the general path) or with checks off, not traced, with
no forward psum still unread, and arguments the general path would accept
(anything else goes there to be refused).  Each does what the general path
does: the payload's signature, the collective count and black box
(`watch.begin`), `comm_log`'s event, the watched wait, the signature check
(`watch.unseal`), the result typed as the collective's rule says and
copy-on-write like any collective's (`cow.mark_shared`).  Only the order
differs: what needs none of the data (the count, the event, the result's
views and type) runs while the data is on the wire, after the launch, where
the general path runs it before the launch or after the wait, in series
with the collective.  `tests/distributed/dist_dtypes.py` runs each case both
ways and compares them.
"""
from __future__ import annotations

import torch

from .. import context, cow
from ..tensor import ShTensor
from . import transports
from .config import _OPTIONS
from .functions import _record, _wrapped
from .groups import _gather_into
from .sealed import _sealed_bytes, _sealing, _unsealed_rows, reduce_buffer, reduce_views
from .signatures import Seal
from .traced import tracing

#: dtypes gloo sums as they are (no wire dtype, no real view), each able to carry a signature
_DIRECT = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})


def _group(backend, x: ShTensor, axis_name: str):
    """The group a direct collective of `x` over `axis_name` runs on, or None where the general path
    must run it (see the module docstring)."""
    phys, body = x._phys, x._body
    if (x._unreduced or not body.check_vma or phys.dtype not in _DIRECT or type(phys) is not torch.Tensor
            or (phys.requires_grad and torch.is_grad_enabled()) or _wrapped(phys)):
        return None
    st = context.stack()
    if not st or st[-1] is not body or axis_name not in body.sizes or transports.UNREAD or tracing():
        return None
    g = backend.group((axis_name,))
    if g.n == 1 or not g.gloo or g.g2t is not None or g.shm(phys) is not None:
        return None
    return g


def quick_psum(backend, x: ShTensor, axis_name: str):
    """`psum(x, axis_name)` on the distributed mesh by the direct path, or None where it does not apply
    (see the module docstring; the caller then takes the general path)."""
    g = _group(backend, x, axis_name)
    phys, body = x._phys, x._body
    if g is None or transports.gathered_reduce(g, phys.numel() * phys.element_size()):
        return None
    if not _sealing(g) and _OPTIONS["check_collectives"] is not False:  # strict: a signature exchange first
        return None
    axes, shape, dtype, w = (axis_name,), phys.shape, phys.dtype, g._backend.watch
    buf, _, expect = reduce_buffer(phys, dtype, g, "psum")  # the copy, the signature appended (default mode)
    work = transports._pg_all_reduce(buf, transports._dist().ReduceOp.SUM, g.pg())
    # While the data is on the wire, what needs none of it: the count and black box (read by the
    # wait's messages and by the other ranks only while this one waits), the event, the result's
    # views and type.  After the wait it would run in series with it.
    w.begin("psum", axes, shape, dtype)
    _record("psum", axes, shape, dtype)
    data, seal = reduce_views(buf, shape, expect)
    out = cow.mark_shared(ShTensor(data, (), x._vma - {axis_name}, body), False)
    _wait(w, work, g, seal)
    return out


def quick_all_gather(backend, x: ShTensor, axis_name: str, axis, tiled, invariant: bool):
    """`all_gather(x, axis_name, axis=axis, tiled=tiled)` (`all_gather_invariant` if `invariant`) by the
    direct path, or None where it does not apply, an argument the general path must check included."""
    if type(tiled) is not bool or type(axis) is not int:
        return None
    g = _group(backend, x, axis_name)
    phys, body = x._phys, x._body
    rank = phys.dim()
    hi = rank if tiled else rank + 1
    if g is None or not -hi <= axis < hi or phys.numel() == 0:  # (tiled on a scalar: hi == 0)
        return None
    axis %= hi
    kind = "all_gather_invariant" if invariant else "all_gather"
    axes, shape, dtype, n, w = (axis_name,), phys.shape, phys.dtype, g.n, g._backend.watch
    extra = f"axis={axis}, tiled={tiled}"
    flat = phys.reshape(1, -1)
    send, nb, expect = _sealed_bytes(flat, g, kind, shape, dtype, extra)  # each row: its bytes, then the signature
    if send is None:  # no signature in the payload
        if _OPTIONS["check_collectives"] is not False:  # strict, or too big to seal: an exchange beside it
            return None
        send = flat.contiguous()
    got = send.new_empty((n, send.shape[1]))
    work = _gather_into(got, send, g.pg())
    w.begin(kind, axes, shape, dtype, extra)  # (while the data is on the wire, as quick_psum)
    _record(kind, axes, shape, dtype)
    seal = None if expect is None else Seal("bytes", None, got[:, nb:], expect)
    rows = got if expect is None else _unsealed_rows(got, nb, dtype, n)
    rows = rows.view(n, *shape).movedim(0, axis)
    vma = x._vma - {axis_name} if invariant else x._vma | {axis_name}
    _wait(w, work, g, seal)
    out = rows.flatten(axis, axis + 1) if tiled else rows  # (after the wait: where rows have gaps it copies)
    return cow.mark_shared(ShTensor(out, (), frozenset(vma), body), False)


def _wait(w, work, g, seal):
    """The watched wait for `work`, then the signature check (`seal`, None with checks off): as
    `transports.InFlight.finish` does for the general path."""
    w.wait(work, None, g.ranks, gloo=True)
    if seal is not None:
        w.unseal(seal, g.ranks)
    w.done()
