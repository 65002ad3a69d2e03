"""Tiny matrix products as a product and a sum: the decompositions `shmap.jit` hands Inductor.

A BLAS call costs more than a product of a few thousand multiply-adds; as an
elementwise product and a sum, Inductor fuses it with the ops around it (a
psum's sum over device dims) into one C++ loop.  Values then differ from a
GEMM's in the last bits, as Inductor's do.
"""
from __future__ import annotations

import torch

#: Matrix products of at most this many multiply-adds are decomposed; float32 / float64 only (half
#: types would round each product).
LIMIT = 16384


def _small_mm(x, y):
    if x.dtype not in (torch.float32, torch.float64) or x.shape[0] * x.shape[1] * y.shape[1] > LIMIT:
        return NotImplemented
    return (x.unsqueeze(-1) * y.unsqueeze(0)).sum(-2)


def _small_bmm(x, y):
    if x.dtype not in (torch.float32, torch.float64) or x.shape[0] * x.shape[1] * x.shape[2] * y.shape[2] > LIMIT:
        return NotImplemented
    return (x.unsqueeze(-1) * y.unsqueeze(1)).sum(-2)


#: aten op -> its decomposition (a product of more than LIMIT multiply-adds keeps its GEMM)
DECOMPOSITIONS = {torch.ops.aten.mm.default: _small_mm, torch.ops.aten.bmm.default: _small_bmm}
