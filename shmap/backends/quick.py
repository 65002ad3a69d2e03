"""The commonest collective's short way: an eager psum of a block over one axis.

A psum of a few KiB is mostly the call's own Python.  On 2 gloo processes
(4 KiB, medians of interleaved calls, each after a barrier) the general path
took about 1.35x the raw `dist.all_reduce` of a fresh copy: the front end's
operand and type handling, the backend's choice of Function, the
transport's dtype, transport and bucket decisions, the launch's generic
bookkeeping, the result's copy-on-write notes.  The guard's own work (the
signature in the payload, the watched wait, the trailer check) costs
nothing measurable: those steps alone, written out, ran at 1.0x.

`quick_psum` takes the direct path where it gives what the general path
(`collectives.psum`) gives, and returns None everywhere else: a value of the
running innermost body, typed (check_vma), not a pending sum, with nothing
to differentiate (no autograd, no torch.func transform), of a dtype gloo
sums as it is (float32/64, int32/64), over one axis of more than one
process, on the process group itself (no shared-memory transport, no
all_gather-then-reduce of a small payload on 3+ processes), in the default
mode (the signature rides in the payload) or with checks off (strict mode
exchanges signatures first), not traced, and with no forward psum still
unread.  It does what the general path does: the payload's signature, the
collective count and black box (`watch.begin`), `comm_log`'s event, the
watched wait, the trailer check (`watch.unseal`), and the result typed
invariant along the axis and copy-on-write like any collective's
(`cow.mark_shared`).  Only the order differs: what needs none of the data
(the count, the event, the result's views and type) runs while the data is
on the wire, after the launch, where the general path runs it before the
launch or after the wait, in series with the collective.
`tests/distributed/dist_dtypes.py` runs each case both ways and compares
them.
"""
from __future__ import annotations

import torch

from .. import context, cow
from ..tensor import ShTensor
from . import transports
from .config import _OPTIONS
from .functions import _record, _wrapped
from .sealed import _contiguous_strides, _sealing
from .signatures import SEAL_BITS, Seal, reduce_trailer
from .traced import tracing

#: dtypes gloo sums as they are (no wire dtype, no real view), each able to carry a signature
_DIRECT = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
_SUM = []  # [ReduceOp.SUM], looked up on first use (torch.distributed is imported lazily)


def quick_psum(backend, x: ShTensor, axis_name: str):
    """`psum(x, axis_name)` on the distributed mesh by the direct path, or None where it does not apply
    (see the module docstring; the caller then takes the general path)."""
    phys, body = x._phys, x._body
    if (x._unreduced or not body.check_vma or phys.dtype not in _DIRECT or type(phys) is not torch.Tensor
            or (phys.requires_grad and torch.is_grad_enabled()) or _wrapped(phys)):
        return None
    st = context.stack()
    if not st or st[-1] is not body or axis_name not in body.sizes or transports.UNREAD or tracing():
        return None
    axes = (axis_name,)
    g = backend.group(axes)
    if g.n == 1 or not g.gloo or g.shm(phys) is not None or transports.gathered_reduce(
            g, phys.numel() * phys.element_size()):
        return None
    sealed = _sealing(g)
    if not sealed and _OPTIONS["check_collectives"] is not False:  # strict: a signature exchange first
        return None
    shape, dtype = phys.shape, phys.dtype
    w = g._backend.watch
    if sealed:  # the one copy a functional psum makes, with the signature appended
        lo, hi, expect = reduce_trailer(w.next_signature16("psum", axes, shape, dtype), dtype)
        buf = torch.cat([phys if phys.dim() == 1 else phys.reshape(-1), lo, hi])
    else:  # checks off: counted and watched all the same
        buf = phys.clone(memory_format=torch.contiguous_format).view(-1)
    if not _SUM:
        _SUM.append(transports._dist().ReduceOp.SUM)
    work = transports._pg_all_reduce(buf, _SUM[0], g.pg())
    # While the data is on the wire, what needs none of it: the count and black box (read by the
    # wait's messages and by the other ranks only while this one waits), the event, the result's
    # views and type.  After the wait it would run in series with it.
    w.begin("psum", axes, shape, dtype)
    _record("psum", axes, shape, dtype)
    m = buf.numel() - 2 * SEAL_BITS if sealed else buf.numel()
    seal = Seal("reduce", None, buf.as_strided((2 * SEAL_BITS,), (1,), m), expect) if sealed else None
    out = buf.as_strided(shape, _contiguous_strides(shape))  # (as_strided: the cheapest view)
    out = cow.mark_shared(ShTensor(out, (), x._vma - {axis_name}, body), False)
    w.wait(work, None, g.ranks, gloo=True)
    if sealed:
        w.unseal(seal, g.ranks)
    w.done()
    return out
