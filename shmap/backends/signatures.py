"""Collective signatures: what a collective is (`describe`), and how it carries a signature of itself.

In the default mode each collective's payload carries its signature (`Seal`):
a trailer of 2 x `SEAL_BITS` elements that any reduction keeps readable, or
8 bytes appended to each block of moved data.  In strict mode the signature
travels in a separate exchange before the data (`_Pending`).
"""
from __future__ import annotations

import struct

import torch

from ..errors import fmt_axes


def describe(kind, axes, shape, dtype, extra="") -> str:
    dt = str(dtype).replace("torch.", "")
    s = f"{kind} over {fmt_axes(axes)} of {dt}{list(shape)}" if axes else f"{kind} ({dt}{list(shape)})"
    return s + (f" ({extra})" if extra else "")


#: bits of the signature a reducing collective carries (two trailer elements per bit)
SEAL_BITS = 16


class Seal:
    """Where a collective's payload carries its signature, and how to read it back.

    `reduce` (all_reduce, reduce_scatter; any reduction, any dtype): 2 x
    SEAL_BITS trailer elements, each bit b of a 16-bit hash as a pair (b, 1 - b).
    However many ranks add (or max, min, or) them, every pair keeps exactly one
    nonzero entry, on the side of the bit, iff every rank wrote the same bits.
    `bytes` (all_gather, all_to_all, ppermute: data moved, not combined): the
    payload travels as bytes with an 8-byte signature appended to each block;
    every block received must carry this rank's.  `send` is the trailer
    region of the input (rows broadcast), `recv` that of the output (None:
    nothing received); `expect` is set when the trailer is written (for a
    reduction, when its buffer is built: `reduce_trailer`).
    """

    __slots__ = ("mode", "send", "recv", "expect")

    def __init__(self, mode, send, recv, expect=None):
        self.mode, self.send, self.recv, self.expect = mode, send, recv, expect

    def write(self, c, n, epoch):
        if self.expect is not None:  # written with the buffer
            return
        if self.mode == "reduce":
            lo, hi, self.expect = reduce_trailer(signature16(c, n, epoch), self.send.dtype)
            self.send[..., :SEAL_BITS].copy_(lo)
            self.send[..., SEAL_BITS:].copy_(hi)
        else:
            self.expect = list(struct.pack("<IHH", c, n & 0xFFFF, epoch & 0xFFFF))
            self.send.copy_(torch.tensor(self.expect, dtype=torch.uint8))

    def ok(self) -> bool:
        if self.recv is None:
            return True
        got = self.recv.tolist()
        if self.mode == "reduce":
            return list(map(bool, got)) == self.expect
        rows = got if self.recv.dim() == 2 else [got]
        return all(row == self.expect for row in rows)


def signature16(c, n, epoch) -> int:
    """16 bits of (description crc, collective count, shard_map count)."""
    h = ((c * 0x9E3779B1) ^ (n * 0x85EBCA6B) ^ (epoch * 0xC2B2AE35)) & 0xFFFFFFFF
    return (h ^ (h >> 16)) & 0xFFFF


_TRAILERS: dict = {}  # dtype -> ([256 trailer halves], [256 expected nonzero patterns])


def reduce_trailer(h, dtype):
    """(low half, high half, expected nonzero pattern) of the trailer for 16-bit signature `h`: each
    half is byte b of h as 8 bits then their 8 complements, a cached tensor of `dtype`."""
    t = _TRAILERS.get(dtype)
    if t is None:
        rows, pats = [], []
        for v in range(256):
            bits = [(v >> i) & 1 for i in range(8)]
            rows.append(torch.tensor(bits + [1 - b for b in bits], dtype=dtype))
            pats.append([bool(b) for b in bits] + [not b for b in bits])
        t = _TRAILERS[dtype] = (rows, pats)
    lo, hi = h & 0xFF, h >> 8
    return t[0][lo], t[0][hi], t[1][lo] + t[1][hi]


def sealable(dtype, n) -> bool:
    """Whether a reducing collective over `n` ranks can carry a signature in `dtype` (an 8-bit integer
    sum of n ones wraps to 0 when n is a multiple of 256; float8 has no all_reduce on gloo)."""
    if dtype.itemsize == 1 and dtype not in (torch.int8, torch.uint8, torch.bool):
        return False
    return not (dtype.itemsize == 1 and n % 256 == 0)


class _Pending:
    """A signature exchange in flight."""

    __slots__ = ("n", "desc", "sig", "out", "work")

    def __init__(self, n, desc, sig, out, work):
        self.n, self.desc, self.sig, self.out, self.work = n, desc, sig, out, work

    def matches(self) -> bool:
        return bool((self.out.view(-1, 2) == self.sig).all())
