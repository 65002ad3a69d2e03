"""Custom autograd Functions shared by the interop, compile and distributed-interop tests."""
from __future__ import annotations

import torch

import shmap


class Cube(torch.autograd.Function):
    """x**3 with a saved input and a differentiable backward (second order works)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * g


class MulPsumBack(torch.autograd.Function):
    """w (invariant) * x (varying); backward reduces w's cotangent itself (a custom_vjp)."""

    @staticmethod
    def forward(ctx, w, x):
        ctx.save_for_backward(w, x)
        return torch.sin(w * x)

    @staticmethod
    def backward(ctx, g):
        w, x = ctx.saved_tensors
        c = torch.cos(w * x) * g
        return shmap.psum((c * x).sum(0), "i"), c * w
