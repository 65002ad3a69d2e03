"""Calling kernels from a shard_map body: a user's kernel in place of a collective.

`kernels.call(fn, x, axis_name='i')` runs `fn` over the devices of mesh axis
`'i'`: `fn` receives one list per operand with each device's block (as
`kernels.library` functions do, e.g. `library.all_reduce`) and returns a list
of per-device results.  On a mesh with other axes, `fn` runs once per group
of devices sharing their coordinates on those axes, as a collective would.

The result is typed varying along the axis, or invariant with
`out='invariant'` (for an all-reduce): then the per-device results are checked
to agree, so a kernel that leaves devices disagreeing is caught rather than
silently returning device 0's block.  Agree to within `atol` and `rtol`: by
default 1e-6 and 1e-5, or in a 16-bit float, n ulps (n the axis size) each: a
ring all-reduce adds the blocks in another order on each device, and
bfloat16 rounds every partial sum (its devices differed by 2 ulps).

Kernels are not differentiable by themselves; give `transpose=` (a kernel with the same calling convention that
maps the output cotangents to the input's, e.g. a reduce-scatter for an
all-gather kernel, or `None` for identity-like transposes written as
`kernels.IDENTITY`) to use the call under autograd.
"""
from __future__ import annotations

import math

import torch

from .. import comm, context
from ..errors import VmaError, as_tensor_arg
from ..recording import event
from ..tensor import ShTensor, expand_to, lift

#: A transpose that leaves the per-device cotangents as they are (e.g. of an all-reduce,
#: whose transpose is `pvary`).
IDENTITY = object()


def call(fn, *xs, axis_name: str, out: str = "varying", transpose=None, name: str | None = None,
         atol: float | None = None, rtol: float | None = None):
    """Run the per-device-list function `fn` over mesh axis `axis_name` inside a body."""
    api = f"kernels.call({name or getattr(fn, '__name__', 'fn')})"
    if not isinstance(axis_name, str):
        raise TypeError(f"{api}: axis_name must be one mesh axis name (str), got {axis_name!r}.")
    if out not in ("varying", "invariant"):
        raise ValueError(f"{api}: out must be 'varying' or 'invariant', got {out!r}.")
    body = context.body_for_axes(api, (axis_name,))
    if not body.backend.device_dims:
        raise NotImplementedError(
            f"{api}: kernels called from a body run on the simulated mesh (the verifying interpreter). "
            "On real processes run them with kernels.ShmGroup / run_shm, or use shmap's collectives."
        )
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        raise NotImplementedError(
            f"{api}: a kernel runs in the verifying interpreter on real values (a thread per device), which "
            "a capture on fake tensors (shmap.jit) cannot run. Fix: call the shard_mapped function without "
            "shmap.jit (torch.compile runs it outside its graph), or use shmap's collectives there."
        )
    vals = [x if isinstance(x, ShTensor) else ShTensor(as_tensor_arg(api, "an operand", x), (), frozenset(), body)
            for x in xs]
    for v in vals:
        if v._unreduced:
            raise VmaError(f"{api}: an operand is unreduced (a pending sum). Fix: psum it first.")
    target = frozenset().union(*(v._vma for v in vals)) | {axis_name}
    paxes = body.order(target)
    physs = [expand_to(lift(v, target, body), v._paxes, paxes, body.sizes) for v in vals]
    plan = _Plan(fn, paxes, axis_name, body, out, transpose, api, atol, rtol)
    needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in physs)
    if needs_grad:
        if transpose is None:
            raise RuntimeError(
                f"{api}: an operand requires grad but the kernel has no transpose. Fix: pass "
                "transpose=<kernel mapping output cotangents to input cotangents> (e.g. a reduce-scatter "
                "for an all-gather), transpose=kernels.IDENTITY for an all-reduce, or call it on detached values."
            )
        if len(physs) != 1:
            raise NotImplementedError(f"{api}: differentiable kernel calls take one operand.")
        result = _KernelFn.apply(physs[0], plan)
    else:
        with torch.no_grad():
            result = plan.forward(physs)
    out_paxes = paxes if out == "varying" else tuple(a for a in paxes if a != axis_name)
    vma_ = target if out == "varying" else target - {axis_name}
    comm.record(event("kernel", (axis_name,), vals[0].shape, vals[0].dtype))
    return ShTensor(result, out_paxes, frozenset(vma_), body)


class _Plan:
    """How to cut the physical layout into per-device lists along one axis, and back."""

    def __init__(self, fn, paxes, axis, body, out, transpose, api, atol, rtol):
        self.fn, self.paxes, self.axis, self.body = fn, paxes, axis, body
        self.out, self.transpose, self.api, self.atol, self.rtol = out, transpose, api, atol, rtol
        self.dim = paxes.index(axis)
        self.n = body.sizes[axis]
        self.others = [body.sizes[a] for a in paxes if a != axis]

    def _tolerance(self, dtype):
        """(atol, rtol) of the invariant check: the caller's, else the dtype's (see the module docstring)."""
        narrow = dtype in (torch.bfloat16, torch.float16)
        eps = self.n * torch.finfo(dtype).eps if narrow else None
        return (self.atol if self.atol is not None else eps if narrow else 1e-6,
                self.rtol if self.rtol is not None else eps if narrow else 1e-5)

    def _groups(self, phys):
        """[n, G, ...logical] view: device index along the axis, then the group index."""
        t = phys.movedim(self.dim, 0)
        return t.reshape(self.n, math.prod(self.others), *t.shape[1 + len(self.others):])

    def _run(self, fn, physs, label):
        grouped = [self._groups(p) for p in physs]
        outs = []
        for g in range(grouped[0].shape[1]):
            lists = [[t[d, g].contiguous() for d in range(self.n)] for t in grouped]
            res = fn(*lists)
            if len(res) != self.n:
                raise ValueError(f"{self.api}: {label} returned {len(res)} results for {self.n} devices.")
            outs.append(torch.stack([torch.as_tensor(r) for r in res]))
        stacked = torch.stack(outs, 1)  # [n, G, ...]
        stacked = stacked.reshape(self.n, *self.others, *stacked.shape[2:])
        return stacked.movedim(0, self.dim)

    def forward(self, physs):
        res = self._run(self.fn, physs, "the kernel")
        if self.out == "invariant":
            first = res.select(self.dim, 0)
            for d in range(1, self.n):
                other = res.select(self.dim, d)
                atol, rtol = self._tolerance(first.dtype)
                if not torch.allclose(first, other, atol=atol, rtol=rtol, equal_nan=True):
                    err = (first - other).abs().max().item()
                    raise VmaError(
                        f"{self.api}: out='invariant' but device {d} of axis {self.axis!r} disagrees with device 0 "
                        f"(max abs difference {err:.3g}); an invariant result must be the same on every device. "
                        "Fix: correct the kernel, or declare out='varying'."
                    )
            return first
        return res

    def backward(self, g):
        if self.out == "invariant":  # the transpose of "invariant result" is a pvary of the cotangent
            g = expand_to(g, tuple(a for a in self.paxes if a != self.axis), self.paxes, self.body.sizes)
        if self.transpose is IDENTITY:
            return g
        return self._run(self.transpose, [g], "the transpose kernel")


class _KernelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phys, plan):
        ctx.plan = plan
        return plan.forward([phys])

    @staticmethod
    def backward(ctx, g):
        with torch.no_grad():
            return ctx.plan.backward(g), None
