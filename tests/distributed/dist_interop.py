"""Interop cases for the distributed mesh (importable by spawned ranks).

Custom autograd Functions (a collective in backward), torch.utils.checkpoint
(non-reentrant, a collective in the recomputed region; the reentrant form
allows only `.backward()`, which check_case does not use) inside bodies: every rank runs each on a simulated and on the distributed
mesh and compares outputs, gradients and comm_log (dist_cases.check_case).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.utils.checkpoint as cp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_cases  # noqa: E402
import shmap  # noqa: E402
from shmap import P  # noqa: E402


class MulPsumBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, x):
        ctx.save_for_backward(w, x)
        return torch.sin(w * x)

    @staticmethod
    def backward(ctx, g):
        w, x = ctx.saved_tensors
        c = torch.cos(w * x) * g
        return shmap.psum((c * x).sum(0), "i"), c * w


def _fn_body(w, x):
    return shmap.psum(MulPsumBack.apply(w, x).sum(), "i")


def _region(u):
    return shmap.psum(torch.sin(u), "i") * u


def _ckpt(reentrant):
    def body(x):
        return cp.checkpoint(_region, x, use_reentrant=reentrant)
    return body


def _func_grad(w, x):
    return torch.func.grad(lambda w: (torch.tanh(x @ w)).sum())(w)


CASES = [
    dist_cases.Case("autograd.Function with psum in backward", (4,), ("i",), _fn_body,
                    (P(), P("i")), P(), ((3,), (8, 3))),
    dist_cases.Case("checkpoint non-reentrant", (4,), ("i",), _ckpt(False), P("i"), P("i"), ((8, 3),)),
    # torch.func inside a body needs the distributed backend's autograd Functions in
    # setup_context form (functorch requires it); not yet (see _func_grad).
]


def run_cases():
    bad = []
    for case in CASES:
        try:
            bad += dist_cases.check_case(case, 0)
        except Exception as e:  # noqa: BLE001
            import traceback
            bad.append(f"{case.name}: raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
    return bad
