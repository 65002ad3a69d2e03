"""A pair einsum over device dims whose backward reads a broadcast cotangent in place.

On the simulated mesh a row-parallel projection `y = x @ w` is followed by `psum(y, tensor)`, and the
psum's transpose hands `y` a cotangent that is the same block on every device of `tensor`: a stride-0
`expand`. Autograd's derivative of torch.einsum reshapes that cotangent to its bmm's 3-d form, which
copies all of it (once per operand). `Contract` is the same einsum with the same derivative, GEMM
for GEMM, that reads the broadcast in place. `batching._einsum_direct` uses it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch


def autocast_on() -> bool:
    """Whether torch.autocast is on (for the CPU or a GPU): ops must then meet torch's own kernels."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


def applies(specs, out, operands):
    """Whether `Contract` computes this einsum: two real floating operands, each letter once per
    term and in two of the three terms, equal sizes for a shared letter, a GEMM with no dimension
    of 1 (torch.einsum's lowering is reproduced for the plain case only); and only where its
    backward is needed, with no torch.func transform running (those differentiate torch.einsum)."""
    a, b = operands
    if not (a.requires_grad or b.requires_grad) or not torch.is_grad_enabled():
        return False
    if torch._C._are_functorch_transforms_active() or not (a.dtype.is_floating_point and b.dtype == a.dtype):
        return False
    if autocast_on():  # (autocast's casts would be skipped)
        return False
    sa, sb = specs
    if len(set(sa)) != len(sa) or len(set(sb)) != len(sb) or len(set(out)) != len(out):
        return False
    if not set(out) <= set(sa) | set(sb) or not set(sa) <= set(sb) | set(out) or not set(sb) <= set(sa) | set(out):
        return False
    size = dict(zip(sa, a.shape))
    if not all(size.get(c, n) == n for c, n in zip(sb, b.shape)):
        return False
    if not all(type(n) is int for n in (*a.shape, *b.shape)):  # symbolic sizes (dynamic shapes)
        return False
    plan = _pair_plan(sa, sb, out, tuple(a.shape), tuple(b.shape))
    return min(plan.n_lo, plan.n_ro, plan.n_sum) > 1


class Contract(torch.autograd.Function):
    """`einsum(sa,sb->so)` on two operands, with autograd's own derivative minus its copies.

    torch.einsum lowers a pair to one bmm (ATen `sumproduct_pair`: dims grouped into batch `lro`,
    `lo`, `ro` and contracted, operands permuted and reshaped to 3-d), and its derivative is
    bmm's: dL = G @ R^T, dR = L^T @ G, with G, the cotangent, reshaped to the same 3-d form. On the
    simulated mesh G is often a broadcast: behind a row-parallel projection it is the transpose of
    the psum that follows, a stride-0 expand along the summed device dims, which no 3-d view can
    hold, so autograd copied all of it (once per operand). `forward` here runs that lowering
    itself and keeps its 3-d operands; `backward` runs the same GEMMs on them (`_bmm` loops over
    the device dims of G that do not merge), so values and gradients are torch's to the bit. G is
    read in place where its matrices sit as autograd's copy would hold them: row-major, at the same
    addresses modulo 64 bytes (MKL's kernels depend on alignment); elsewhere it is copied once.
    """

    # The classic form (ctx in forward, no setup_context): Function.apply binds a setup_context
    # Function's arguments with inspect.signature on every call. It is never run under a torch.func
    # transform (`applies`), the one use of setup_context.
    @staticmethod
    def forward(ctx, sa, sb, so, a, b):
        plan = _pair_plan(sa, sb, so, tuple(a.shape), tuple(b.shape))
        l3, r3 = _operands_3d(plan, a, b)
        ctx.plan, ctx.specs = plan, (sa, sb, so)
        ctx.save_for_backward(a, b, l3, r3)  # (a and b: for a differentiable backward, create_graph)
        ctx.save_for_forward(a, b)
        out = _from_3d(torch.bmm(l3, r3), plan.lro + plan.lo + plan.ro, plan.size, so)
        # bmm's layout has the device dims inside; later pointwise ops and their backward run
        # several times slower on such a permuted view than one copy costs here
        return out.contiguous()

    @staticmethod
    def backward(ctx, g):
        plan, so = ctx.plan, ctx.specs[2]
        a, b, l3, r3 = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the 3-d operands again, in the graph of a and b
            l3, r3 = _operands_3d(plan, a, b)
        need_a, need_b = ctx.needs_input_grad[3:5]
        need_l, need_r = (need_b, need_a) if plan.swap else (need_a, need_b)
        t = _aligned(g, so, plan.common, plan.lro + plan.lo + plan.ro)
        if not _has_storage(g):  # autograd.grad(is_grads_batched=True): a batched view, no strides to read
            g3, nb, mm = t.reshape(plan.n_lro, plan.n_lo, plan.n_ro), [plan.n_lro], lambda x, y, _: torch.bmm(x, y)
        else:
            g3, nb, mm = _grad_3d(t, plan), plan.nb, _bmm
        dl = dr = None
        if need_l:  # dL = G @ R^T
            r3 = r3.view(nb + [plan.n_sum, plan.n_ro]).transpose(-1, -2)
            dl = _from_3d(mm(g3, r3, len(nb)), plan.lro + plan.lo + plan.summed, plan.size, plan.sl)
        if need_r:  # dR = L^T @ G
            l3 = l3.view(nb + [plan.n_lo, plan.n_sum]).transpose(-1, -2)
            dr = _from_3d(mm(l3, g3, len(nb)), plan.lro + plan.summed + plan.ro, plan.size, plan.sr)
        da, db = (dr, dl) if plan.swap else (dl, dr)
        return None, None, None, da, db

    @staticmethod
    def jvp(ctx, _sa, _sb, _so, ta, tb):
        sa, sb, so = ctx.specs
        a, b = ctx.saved_tensors
        eq = f"{sa},{sb}->{so}"
        out = torch.einsum(eq, ta, b) if ta is not None else None
        if tb is not None:
            out = torch.einsum(eq, a, tb) if out is None else out + torch.einsum(eq, a, tb)
        return out.contiguous()


def _operands_3d(plan, a, b):
    """bmm's operands as `sumproduct_pair` lays them out: L (lro, lo, summed), R (lro, summed, ro)."""
    left, right = (b, a) if plan.swap else (a, b)
    l3 = _aligned(left, plan.sl, plan.common, plan.lro + plan.lo + plan.summed + plan.ro)
    r3 = _aligned(right, plan.sr, plan.common, plan.lro + plan.summed + plan.ro + plan.lo)
    return l3.reshape(plan.n_lro, plan.n_lo, plan.n_sum), r3.reshape(plan.n_lro, plan.n_sum, plan.n_ro)


class _Plan(NamedTuple):
    common: list   # torch's common dim order: output letters, then contracted ones A-Z, a-z
    lro: list      # the groups of `sumproduct_pair` (after its swap); a size-1 dim counts as absent
    lo: list
    ro: list
    summed: list
    swap: bool     # bmm(R, L): the operands swapped so that bmm writes the output's order
    sl: str        # the letters of bmm's left and right operands
    sr: str
    size: dict
    nb: list       # sizes of the batch dims
    n_lro: int
    n_lo: int
    n_ro: int
    n_sum: int


def _pair_plan(sa, sb, so, shape_a, shape_b) -> _Plan:
    """torch.einsum's lowering of a pair (ATen `einsum` and `sumproduct_pair`, torch 2.x)."""
    key = (sa, sb, so, shape_a, shape_b)
    got = _PAIR_PLANS.get(key)
    if got is not None:
        return got
    common = list(so) + sorted(set(sa + sb) - set(so), key=lambda c: (c.islower(), c))
    size_a, size_b = dict(zip(sa, shape_a)), dict(zip(sb, shape_b))
    lro, lo, ro, summed = [], [], [], []
    for c in common:
        in_l, in_r = size_a.get(c, 1) != 1, size_b.get(c, 1) != 1
        (summed if c not in so and in_l and in_r else lro if in_l and in_r else lo if in_l else ro).append(c)
    swap = bool(lo and ro) and common.index(ro[-1]) < common.index(lo[0])
    if swap:
        lo, ro, sa, sb = ro, lo, sb, sa
    size = size_a | size_b
    nb = [size[c] for c in lro]
    got = _Plan(common, lro, lo, ro, summed, swap, sa, sb, size, nb, math.prod(nb),
                *(math.prod(size.get(c, 1) for c in grp) for grp in (lo, ro, summed)))
    if len(_PAIR_PLANS) < 4096:
        _PAIR_PLANS[key] = got
    return got


_PAIR_PLANS: dict = {}


def _aligned(t, spec, common, order):
    """`t` as einsum aligns an operand (the letters of `order` it lacks as trailing size-1 dims,
    added with unsqueeze in the common order), then permuted to `order` (letters of `common`)."""
    key = (spec, tuple(common), tuple(order))
    got = _ALIGN.get(key)
    if got is None:
        have = list(spec) + [c for c in common if c not in spec and c in order]
        got = (len(have) - len(spec), [have.index(c) for c in order])
        if len(_ALIGN) < 4096:
            _ALIGN[key] = got
    for _ in range(got[0]):
        t = t.unsqueeze(t.dim())
    return t.permute(got[1])


_ALIGN: dict = {}


def _grad_3d(t, plan):
    """The cotangent (aligned and grouped as lro + lo + ro) as bmm's 3-d operand, with the `lro`
    dims kept apart. Where autograd's reshape copies only to merge batch dims (a broadcast
    cotangent), the matrices are read in place if they are laid out as that copy lays them out:
    row-major, at the same addresses modulo 64 bytes (MKL's kernels depend on alignment)."""
    per = t.reshape(plan.nb + [plan.n_lo, plan.n_ro])
    nb = len(plan.nb)
    if _batch_view(per, nb) is None and not (_row_major(per) and _aligned_like_a_copy(per, nb)):
        per = per.contiguous()
    return per


def _has_storage(t):
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _row_major(t):
    """Whether the trailing matrices of `t` are laid out as a contiguous copy would lay them out."""
    r, c = t.shape[-2:]
    sr, sc = t.stride()[-2:]
    return (c == 1 or sc == 1) and (r == 1 or sr == c)


def _aligned_like_a_copy(t, nb):
    """Whether each matrix of `t` starts, modulo 64 bytes, where it would in a fresh contiguous copy
    (64-byte aligned, as torch allocates): here, all of them on a 64-byte boundary."""
    if type(t) is not torch.Tensor:  # a tracing subclass (torch.compile's fake tensors): copy, as autograd
        return False
    size = t.element_size()
    if t.data_ptr() % 64 or t.shape[-2] * t.shape[-1] * size % 64:
        return False
    return all(n == 1 or st * size % 64 == 0 for n, st in zip(t.shape[:nb], t.stride()[:nb]))


def _from_3d(t, letters, size, spec):
    """bmm's result over `letters` (grouped) -> the operand's own dims `spec` (size-1 dims the
    plan left out are put back)."""
    key = (tuple(letters), spec, tuple(size.get(c, 1) for c in letters))
    got = _FROM_3D.get(key)
    if got is None:
        kept = [c for c in letters if c in spec]  # (the others are size-1 dims of the other operand)
        have = kept + [c for c in spec if c not in kept]
        got = ([size.get(c, 1) for c in kept] + [1] * (len(have) - len(kept)), [have.index(c) for c in spec])
        if len(_FROM_3D) < 4096:
            _FROM_3D[key] = got
    return t.reshape(got[0]).permute(got[1])


_FROM_3D: dict = {}


def _bmm(x, y, nb):
    """[*B, m, k] @ [*B, k, n] -> contiguous [*B, m, n] over `nb` batch dims of any strides: one
    bmm when both operands view their batch dims as one, else one per index of the outermost."""
    x3, y3 = _batch_view(x, nb), _batch_view(y, nb)
    shape = list(x.shape[:nb]) + [x.shape[-2], y.shape[-1]]
    if x3 is not None and y3 is not None:
        return torch.bmm(x3, y3).view(shape)
    if torch.is_grad_enabled():  # a differentiable backward (create_graph): no out=
        return torch.stack([_bmm(x[i], y[i], nb - 1) for i in range(shape[0])])
    out = x.new_empty(shape)
    for i in range(shape[0]):
        _bmm_into(out[i], x[i], y[i], nb - 1)
    return out


def _bmm_into(out, x, y, nb):
    x3, y3 = _batch_view(x, nb), _batch_view(y, nb)
    if x3 is not None and y3 is not None:
        torch.bmm(x3, y3, out=out.view(-1, *out.shape[-2:]))
    else:
        for i in range(x.shape[0]):
            _bmm_into(out[i], x[i], y[i], nb - 1)


def _batch_view(t, nb):
    """`t` ([*B, r, c], nb batch dims) as [prod(B), r, c] without a copy, or None where the batch
    dims' strides do not line up (e.g. one broadcast, stride 0, inside one that is not)."""
    if nb == 1:
        return t
    size, stride = t.shape, t.stride()
    n, step = 1, None
    for d in reversed(range(nb)):
        if size[d] == 1:
            continue
        if step is None:
            step = stride[d]
        elif stride[d] != step * n:
            return None
        n *= size[d]
    return t.as_strided((n,) + tuple(size[nb:]), (step or 0,) + tuple(stride[nb:]), t.storage_offset())
