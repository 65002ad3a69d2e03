"""Batch-friendly decompositions for ops functorch has no batching rule for.

Without a rule functorch falls back to a per-device Python loop (and warns);
these rewrite the op with batchable primitives.  Used only when an op runs
batched over devices; anything outside the supported argument range falls
back to the original function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    if (weight is not None or size_average is not None or reduce is not None or label_smoothing
            or target.is_floating_point()):
        return None
    class_dim = 1 if input.dim() > 1 else 0
    logp = F.log_softmax(input, dim=class_dim)
    return _nll(logp, target, class_dim, ignore_index, reduction)


def _nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    if weight is not None or size_average is not None or reduce is not None:
        return None
    return _nll(input, target, 1 if input.dim() > 1 else 0, ignore_index, reduction)


def _nll(logp, target, class_dim, ignore_index, reduction):
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    picked = logp.gather(class_dim, safe.unsqueeze(class_dim)).squeeze(class_dim)
    loss = torch.where(valid, -picked, torch.zeros_like(picked))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().to(loss.dtype)


def _names(text):
    return frozenset(text.split())


#: Elementwise ops: with operands right-aligned, a leading device dim broadcasts like any other.
POINTWISE = _names("""
    add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow neg negative abs
    exp exp2 expm1 log log2 log10 log1p sqrt rsqrt square sin cos tan sinh cosh tanh asin acos atan atan2
    sigmoid relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus
    logsigmoid erf erfc erfinv reciprocal sign clamp clip clamp_min clamp_max minimum maximum where lerp
    addcmul addcdiv floor ceil round trunc frac logical_not logical_and logical_or logical_xor eq ne lt le
    gt ge isnan isinf isfinite nan_to_num float double half bfloat16 bitwise_and bitwise_or bitwise_not
    __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __pow__ __rpow__ __neg__
    __abs__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __and__ __or__ __xor__ __invert__ __floordiv__
    __rfloordiv__ __mod__ __rmod__ __pos__
""")
#: Ops on the last dims whose leading (device) dims batch natively.
MATMUL = _names("matmul __matmul__ mm")
LINEAR = _names("linear")


def _sdpa_direct(batched, out_paxes, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False):
    """Attention over `[dev..., *batch, L, E]` blocks: the device dims fold into the batch.

    SDPA treats leading dims as batch dims, but its fused CPU/GPU kernels want
    4-d inputs (with more dims it falls back to the slow math path), so the
    device dims and the per-device batch dims are flattened into one.
    """
    qkv = (query, key, value)
    if query.dim() > 4:
        qkv = [t.reshape((-1,) + tuple(t.shape[-3:])) for t in qkv]
    out = F.scaled_dot_product_attention(*qkv, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.reshape(tuple(query.shape[:-1]) + (out.shape[-1],))


def _sdpa_ok(args, kwargs, batched, out_paxes):
    """Direct attention: q, k, v all carry every device dim, same rank, no mask tensor."""
    if len(args) < 3 or len(batched) != 3 or any(i > 2 or p != out_paxes for i, p in batched):
        return False
    if kwargs.get("attn_mask") is not None or len(args) > 3:
        return False
    return len({a.dim() for a in args[:3]}) == 1


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _einsum_ok(args, kwargs, batched, out_paxes):
    """`torch.einsum(eq, *operands)` with an explicit output and no ellipsis."""
    if kwargs or len(args) < 2 or not isinstance(args[0], str):
        return False
    eq = args[0]
    return ("->" in eq and "..." not in eq and eq.count(",") == len(args) - 2
            and all(isinstance(a, torch.Tensor) for a in args[1:]) and all(i >= 1 for i, _ in batched))


def _einsum_direct(batched, out_paxes, eq, *operands):
    """einsum over the physical blocks: each device dim becomes one more einsum letter.

    An operand that does not vary along a device axis simply lacks that letter,
    so einsum folds the axis into the other operand's free dims (one big GEMM:
    `[rows, d] @ [d, devices * n]`) instead of broadcasting the operand to every
    device first, which is what vmap's matmul rule does.
    """
    lhs, out = eq.replace(" ", "").split("->")
    specs = lhs.split(",")
    free = [c for c in _LETTERS if c not in eq][: len(out_paxes)]
    letter = dict(zip(out_paxes, free))
    paxes = dict(batched)
    specs = ["".join(letter[a] for a in paxes.get(i + 1, ())) + sp for i, sp in enumerate(specs)]
    # einsum returns its GEMM's layout (device dims inside); later pointwise ops and their backward
    # run several times slower on such a permuted view than one copy costs here
    return torch.einsum(",".join(specs) + "->" + "".join(free) + out, *operands).contiguous()


def _matmul_ok(args, kwargs, batched, out_paxes):
    """`x @ w` where `w` is a varying matrix: along axes `x` does not vary along (the tensor-parallel
    column projection), or along the same axes with `x` of higher rank (the row projection), where
    matmul's own broadcasting would misalign the device dims.  When only `x` varies, or both have
    the same rank, `direct_ok`'s plain matmul is already right and one GEMM."""
    if kwargs or len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    paxes = dict(batched)
    rank = [a.dim() - len(paxes.get(i, ())) for i, a in enumerate(args)]
    return (2 <= rank[0] <= 12 and rank[1] == 2 and bool(paxes.get(1))  # (letters a.. stay clear of m, k, n)
            and not direct_ok(torch.matmul, list(args), batched, out_paxes))


def _matmul_direct(batched, out_paxes, x, w):
    paxes = dict(batched)
    xr = x.dim() - len(paxes.get(0, ()))
    xs = _LETTERS[:xr - 2] + "mk"
    return _einsum_direct([(i + 1, p) for i, p in batched], out_paxes, f"{xs},kn->{xs[:-1]}n", x, w)


#: ops with a hand-written direct form: func -> (applies(args, kwargs, batched, out_paxes),
#: run(batched, out_paxes, *physical args, **kwargs)); `batched` lists (argument index, device axes).
DIRECT = {
    F.scaled_dot_product_attention: (_sdpa_ok, _sdpa_direct),
    torch.einsum: (_einsum_ok, _einsum_direct),
}
# `x @ w` reaches __torch_function__ as the TensorBase method (`Tensor.__matmul__` forwards to it)
DIRECT.update({f: (_matmul_ok, _matmul_direct) for f in (
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch._C.TensorBase.matmul,
    torch._C.TensorBase.__matmul__)})


def direct_ok(func, args, batched, out_paxes) -> bool:
    """Whether `func` on the physical tensors (device dims leading) equals the batched op.

    `args` are the physical leaves of the call (positional arguments first);
    `batched` lists (index, paxes)
    of the operands carrying device dims.  True only when every batched operand
    carries all of `out_paxes` with the same per-device rank, so numpy-style
    right-aligned broadcasting lines the device dims up with each other and
    keeps them clear of the unbatched operands' dims.
    """
    name = getattr(func, "__name__", "")
    k = len(out_paxes)
    if name in POINTWISE:
        rank = None
        for i, p in batched:
            if p != out_paxes:
                return False
            r = args[i].dim() - k
            if rank is None:
                rank = r
            elif r != rank:
                return False
        bset = {i for i, _ in batched}
        for i, a in enumerate(args):
            if i not in bset and isinstance(a, torch.Tensor) and a.dim() > rank:
                return False
        return True
    if name in MATMUL and len(args) == 2 and len(batched) == 2:  # both vary: matmul's own batch dims
        # right-aligned batch dims line the device dims up only when both operands have the same rank
        return args[0].dim() == args[1].dim() and all(p == out_paxes and args[i].dim() - k >= 2
                                                      for i, p in batched)
    if name in MATMUL and len(args) == 2 and len(batched) == 1:
        (i, p), = batched
        if p != out_paxes or not isinstance(args[1 - i], torch.Tensor):
            return False
        other = args[1 - i]
        if i == 0:  # [dev..., (m,) k] @ [k(, n)]: device dims are batch dims of matmul
            return other.dim() in (1, 2) and (name != "mm" or other.dim() == 2)
        # [..., m, k] @ [dev..., ..., k, n]: the left operand's batch dims must not reach the device dims
        return args[1].dim() - k >= 2 and 1 <= other.dim() <= args[1].dim() - k and name != "mm"
    if name in LINEAR and batched and batched[0][0] == 0 and len(batched) == 1 and batched[0][1] == out_paxes:
        return True
    return False


#: original function -> decomposition returning None when it does not apply
OVERRIDES = {F.cross_entropy: _cross_entropy, F.nll_loss: _nll_loss}


def run(func, args, kwargs):
    """Call the decomposition of `func` if it applies, else `func` itself."""
    alt = OVERRIDES.get(func)
    if alt is not None:
        out = alt(*args, **kwargs)
        if out is not None:
            return out
    return func(*args, **kwargs)
