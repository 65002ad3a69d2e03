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
from .sealed import _SEAL_BYTES_LIMIT, _contiguous_strides, _sealing
from .signatures import SEAL_BITS, Seal, reduce_trailer
from .traced import tracing

#: dtypes gloo sums as they are (no wire dtype, no real view), each able to carry a signature
_DIRECT = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
_SUM = []  # [ReduceOp.SUM], looked up on first use (torch.distributed is imported lazily)


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
    sealed = _sealing(g)
    if not sealed and _OPTIONS["check_collectives"] is not False:  # strict: a signature exchange first
        return None
    axes = (axis_name,)
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
    nbytes = phys.numel() * phys.element_size()
    sealed = _sealing(g) and nbytes * g.n <= _SEAL_BYTES_LIMIT
    if not sealed and _OPTIONS["check_collectives"] is not False:  # strict, or a payload that exchanges
        return None
    kind = "all_gather_invariant" if invariant else "all_gather"
    axes, shape, dtype, n = (axis_name,), phys.shape, phys.dtype, g.n
    extra = f"axis={axis}, tiled={tiled}"
    w = g._backend.watch
    flat = phys.reshape(-1) if phys.is_contiguous() else phys.contiguous().view(-1)
    if sealed:  # each row: the block's bytes, then the 8-byte signature (sealed._sealed_bytes' layout)
        sig = w.next_signature_bytes(kind, axes, shape, dtype, extra)
        send = torch.cat([flat.view(torch.uint8), torch.frombuffer(bytearray(sig), dtype=torch.uint8)])
        got = send.new_empty((n, nbytes + 8))
    else:
        send, got = flat, flat.new_empty((n, flat.numel()))
    work = transports._dist().all_gather_into_tensor(got.view(-1), send, group=g.pg(), async_op=True)
    w.begin(kind, axes, shape, dtype, extra)  # (while the data is on the wire, as quick_psum)
    _record(kind, axes, shape, dtype)
    if sealed:
        seal = Seal("bytes", None, got.as_strided((n, 8), (nbytes + 8, 1), nbytes), list(sig))
        rows = got.as_strided((n, nbytes), (nbytes + 8, 1)).view(dtype)  # (a whole number of elements apart)
    else:
        rows = got
    rows = rows.view(n, *shape).movedim(0, axis)
    vma = x._vma - {axis_name} if invariant else x._vma | {axis_name}
    w.wait(work, None, g.ranks, gloo=True)
    if sealed:
        w.unseal(seal, g.ranks)
    w.done()
    out = rows.flatten(axis, axis + 1) if tiled else rows  # (after the wait: where rows have gaps it copies)
    return cow.mark_shared(ShTensor(out, (), frozenset(vma), body), False)
