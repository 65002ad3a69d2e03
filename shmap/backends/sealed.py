"""Signatures in the payload: the default mismatch check, which sends no message of its own.

Each collective of the distributed mesh carries the signature of the call
each rank made (kind, shape, dtype, count; `signatures.Seal`) inside the
data it moves: a reduction as a trailer of 0/1 pairs that any reduction
keeps readable, moved data as 8 bytes appended to each row.  These build the
sealed buffers the transports (`transports.py`) launch and read back.
"""
from __future__ import annotations

import torch

from .groups import Group
from .signatures import SEAL_BITS, Seal, reduce_trailer, sealable


def _sealing(g: Group) -> bool:
    """Whether this group's collectives carry their signature in their payload (default mode, gloo)."""
    return g._backend.watch.sealing() and g.pg() is not None and g.gloo


def _sealed_reduce(src, dtype, g: Group, kind):
    """(buffer, data view, seal) for a reduction of `src` in `dtype`: the buffer is the data (a fresh
    copy of `src`) followed by the signature trailer, built by one `cat`; reduce the buffer, read the
    view.  `src` may be a list of 1-D tensors (a bucket): their concatenation, copied once.
    (`reduce_buffer` then `reduce_views`: a caller may launch between the two, `quick.py`.)"""
    buf, shape, expect = reduce_buffer(src, dtype, g, kind)
    return (buf, *reduce_views(buf, shape, expect))


def reduce_buffer(src, dtype, g: Group, kind):
    """(buffer, data shape, expected trailer pattern or None) for `_sealed_reduce`: what is launched."""
    parts = src if isinstance(src, list) else None
    if parts is not None:
        src = parts[0]
        shape = (sum(p.numel() for p in parts),)
    else:
        shape = src.shape
    if not (_sealing(g) and sealable(dtype, g.n)):
        if parts is not None:
            out = torch.cat([p.to(dtype) for p in parts])
        else:
            out = src.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        return out, shape, None
    h = g._backend.watch.next_signature16(kind, g.axes, shape, src.dtype)
    lo, hi, expect = reduce_trailer(h, dtype)
    if not src.is_cpu:
        lo, hi = lo.to(src.device), hi.to(src.device)
    if parts is None:
        parts = [src if src.dim() == 1 else src.reshape(-1)]
    return torch.cat([p if p.dtype == dtype else p.to(dtype) for p in parts] + [lo, hi]), shape, expect


def reduce_views(buf, shape, expect):
    """(data view, seal) of a `reduce_buffer` buffer: the buffer itself and None when it carries no
    trailer.  (as_strided: the cheapest way to the two views; this runs on every collective.)"""
    if expect is None:
        return buf, None
    m = buf.numel() - 2 * SEAL_BITS
    out = buf.as_strided(shape, _contiguous_strides(shape))
    return out, Seal("reduce", None, buf.as_strided((2 * SEAL_BITS,), (1,), m), expect)


_STRIDES: dict = {}


def _contiguous_strides(shape) -> tuple:
    st = _STRIDES.get(shape)
    if st is None:
        acc, st = 1, []
        for d in reversed(shape):
            st.append(acc)
            acc *= max(d, 1)
        st = tuple(reversed(st))
        if len(_STRIDES) < 1024:
            _STRIDES[shape] = st
    return st


def _sealed_reduce_rows(inp, n, g: Group):
    """As `_sealed_reduce` for a reduce-scatter of the flat `inp` ([n] rows): (input, output, output's
    data view, seal), each row carrying the trailer.

    `inp` may also be a list of [n, m_i] tensors (a bucket's parts, side by side): they are
    concatenated anyway, so the trailer rides along at any size (one `cat`, as unsealed)."""
    parts = inp if isinstance(inp, list) else None
    first = inp if parts is None else parts[0]
    m = first.numel() // n if parts is None else sum(p.shape[1] for p in parts)
    big = parts is None and inp.numel() * inp.element_size() > _SEAL_BYTES_LIMIT
    if big or not (_sealing(g) and sealable(first.dtype, g.n)):
        inp = inp.contiguous() if parts is None else torch.cat(parts, dim=1).view(-1)
        out = inp.new_empty(m)
        return inp, out, out, None
    k = 2 * SEAL_BITS
    if parts is None:
        rows = inp.new_empty((n, m + k))
        rows[:, :m].copy_(inp.view(n, m))
    else:  # (the trailer's columns are written when the collective is sealed)
        rows = torch.cat(parts + [first.new_empty((n, k))], dim=1)
    out = first.new_empty(m + k)
    return rows.view(-1), out, out[:m], Seal("reduce", rows[:, m:], out[m:])


#: above this many bytes over all ranks (an all_gather's output), a collective that moves data or
#: reduce-scatters checks its signature with a separate exchange running alongside it instead of copying
#: its blocks in and out of a sealed layout.  The copies cost memory bandwidth, the exchange one more
#: message on the control group beside the data.  Sealing up to 16 MiB instead: the recipe's fsdp step
#: (3.5 MB of weights gathered) 1.7% slower on 2 gloo processes and 1.8% faster on 4 (interleaved A/B,
#: 20 steps each), and a 1 MiB all_gather 1.65x raw instead of about 1.1x (bench/bench_distributed.py).
_SEAL_BYTES_LIMIT = 256 << 10


def _sealed_bytes(rows, g: Group, kind, shape, dtype, extra):
    """Rows moved as they are (all_gather, all_to_all, ppermute): (`rows` ([r, ...]) as bytes with the
    8-byte signature of the collective about to run (kind, shape, dtype, extra as `_run` gets them)
    appended to each row, the data bytes per row, the signature as a list); (None, 0, None) when the
    payload carries no signature.  The caller makes the output of the same layout, the `Seal` over
    both, and reads the data back with `_unseal_bytes`.

    `rows` may also be a list of contiguous 1-D tensors, a bucket's parts, sent as one row: they are
    concatenated anyway, so the signature rides along at any size (one copy, as unsealed)."""
    bucket = isinstance(rows, list)
    if not _sealing(g) or (not bucket and rows.numel() * rows.element_size() * g.n > _SEAL_BYTES_LIMIT):
        return None, 0, None
    sig = g._backend.watch.next_signature_bytes(kind, g.axes, shape, dtype, extra)
    st = torch.frombuffer(bytearray(sig), dtype=torch.uint8)
    if bucket:
        if not rows[0].is_cpu:
            st = st.to(rows[0].device)
        send = torch.cat([_unit_stride(p).view(torch.uint8) for p in rows] + [st]).view(1, -1)  # one op: the copy and the signature
        return send, send.shape[1] - 8, list(sig)
    r = rows.shape[0]
    b = _unit_stride(rows.contiguous().view(-1))  # 1-D with stride 1 (a size-1 dimension may carry any stride)
    b = (b.view(torch.uint8) if b.dtype != torch.uint8 else b).view(r, -1)
    if not b.is_cpu:
        st = st.to(b.device)
    send = torch.cat([b, st.expand(r, 8)], dim=1)  # one op: the copy and the signature
    return send, b.shape[1], list(sig)


def _unit_stride(p):
    """A 1-D tensor `p` with stride 1, as a dtype view needs: a contiguous one of one element may have any stride
    (a stride-0 broadcast of a scalar: the gradient of a sum), which torch's `view(torch.uint8)` refuses."""
    return p if p.stride(0) == 1 else p.clone(memory_format=torch.contiguous_format)


def _unsealed_rows(out, nb, dtype, n):
    """The data of a sealed output buffer ([n, nb + 8] bytes) as [n, nb / itemsize] of `dtype`: a view
    of the buffer (no copy of n blocks) where the strides allow it (the rows stay nb + 8 bytes apart),
    else a contiguous copy."""
    data = out[:, :nb]
    try:
        return data.view(dtype)
    except RuntimeError:  # a row stride that is not a whole number of elements (e.g. complex128)
        return data.contiguous().view(dtype).view(n, -1)


def _unseal_bytes(out, nb, dtype, shape):
    """The data of a sealed output buffer ([r, nb + 8] bytes) as a contiguous tensor of `dtype`, `shape`."""
    return out[..., :nb].contiguous().view(dtype).view(shape)
