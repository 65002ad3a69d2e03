"""How an ordinary op runs over the device dims of the simulated mesh, once for all devices.

In order of preference: a hand-written direct form (`DIRECT`: matmul and einsum
with varying weights, attention, reductions), the op itself where numpy-style
broadcasting already lines the device dims up (`direct_ok`), else one functorch
vmap level per device axis (`run_batched`). Under vmap, ops functorch has no
batching rule for (it would fall back to a per-device Python loop, and warn) run
as batchable decompositions (`OVERRIDES`: cross_entropy, nll_loss); anything
outside their supported argument range runs the original function.
"""
from __future__ import annotations

import math

import optree
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch._C._functorch import (
    _add_batch_dim,
    _remove_batch_dim,
    _vmap_decrement_nesting,
    _vmap_increment_nesting,
)

from . import contract, per_device


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
    device dims and the per-device batch dims are flattened into one. Where that
    needs a copy (q, k, v sliced from one projection: its q/k/v dim sits between
    the device dims and the batch), the batch dims may fold into the heads instead,
    as views: attention is the same per (batch, head) pair, and so are the kernel's
    bits (it computes each pair on its own).
    """
    qkv = (query, key, value)
    if query.dim() > 4:
        qkv = _sdpa_4d(qkv)
    out = F.scaled_dot_product_attention(*qkv, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.reshape(tuple(query.shape[:-1]) + (out.shape[-1],))


def _sdpa_4d(qkv):
    """q, k, v as [batch, heads, L, E]: views when some split of their leading dims allows it (the
    heads dim alone first), else copies (reshape)."""
    lead = tuple(qkv[0].shape[:-2])
    if all(tuple(t.shape[:-2]) == lead for t in qkv):
        for j in range(len(lead) - 1, -1, -1):
            if all(_merges(t, 0, j) and _merges(t, j, len(lead)) for t in qkv):
                shape = (math.prod(lead[:j]), math.prod(lead[j:]))
                return [t.view(shape + tuple(t.shape[-2:])) for t in qkv]
    return [t.reshape((-1,) + tuple(t.shape[-3:])) for t in qkv]


def _merges(t, lo, hi):
    """Whether dims lo..hi-1 of `t` merge into one as a view (size-1 dims aside)."""
    size, stride = t.shape, t.stride()
    last = None
    for d in range(hi - 1, lo - 1, -1):
        if size[d] == 1:
            continue
        if last is not None and stride[d] != stride[last] * size[last]:
            return False
        last = d
    return True


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
    out = "".join(free) + out
    if len(operands) == 2 and contract.applies(specs, out, operands):
        return contract.Contract.apply(specs[0], specs[1], out, *operands)
    # einsum returns its GEMM's layout (device dims inside); later pointwise ops and their backward
    # run several times slower on such a permuted view than one copy costs here
    return torch.einsum(",".join(specs) + "->" + out, *operands).contiguous()


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


def _reduce_dims(args, kwargs, batched, out_paxes):
    """The physical dims of `x.sum(dim)` / `x.mean(dim)` (dim: None, an int or a sequence, within the
    per-device rank >= 1), or None where the call is anything else (it then runs batched)."""
    if len(batched) != 1 or batched[0] != (0, out_paxes) or not args or len(args) > 3:
        return None
    x, k = args[0], len(out_paxes)
    rank = x.dim() - k
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if rank < 1 or set(kwargs) - {"dim", "keepdim", "dtype"} or (len(args) > 1 and "dim" in kwargs):
        return None
    if dim is None or (isinstance(dim, (tuple, list)) and not dim):
        return tuple(range(k, k + rank))
    dims = (dim,) if isinstance(dim, int) else dim
    if not isinstance(dims, (tuple, list)) or not all(type(d) is int and -rank <= d < rank for d in dims):
        return None
    return tuple(d + k if d >= 0 else d for d in dims)


def _reduce_ok(args, kwargs, batched, out_paxes):
    return _reduce_dims(args, kwargs, batched, out_paxes) is not None


def _reduction(op):
    def run(batched, out_paxes, x, *args, **kwargs):
        """The reduction on the physical tensor over the per-device dims (the device dims stay)."""
        dims = _reduce_dims((x,) + args, kwargs, batched, out_paxes)
        keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
        extra = {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}
        return op(x, dims, keepdim, **extra)
    return run


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
DIRECT.update({f: (_reduce_ok, _reduction(op)) for op, fs in (
    (torch.sum, (torch.sum, torch._C.TensorBase.sum)), (torch.mean, (torch.mean, torch._C.TensorBase.mean)))
    for f in fs})


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
    if name == "mm":  # (2-d operands only: a block with device dims is 3-d or more)
        return False
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
            return other.dim() in (1, 2)
        # [..., m, k] @ [dev..., ..., k, n]: the left operand's batch dims must not reach the device dims
        return args[1].dim() - k >= 2 and 1 <= other.dim() <= args[1].dim() - k
    if name in LINEAR and batched and batched[0][0] == 0 and len(batched) == 1 and batched[0][1] == out_paxes:
        return True
    if name == "to":  # a dtype or device conversion, element by element (not a layout or another's dtype)
        return len(batched) == 1 and batched[0] == (0, out_paxes) and not any(
            isinstance(a, (torch.Tensor, torch.memory_format)) for a in args[1:])
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


# --------------------------------------------------------------------------
# A call's tree of arguments, and the vmap levels of an op no direct form covers
# --------------------------------------------------------------------------
_CONTAINERS = (list, tuple, dict)


def _opaque(a) -> bool:
    """Whether `a` is a leaf for dispatch: not a container, or a tuple or list of plain values (a
    shape, some dims) that holds no tensor and no container."""
    if not isinstance(a, _CONTAINERS):
        return True
    return not isinstance(a, dict) and not any(isinstance(e, (torch.Tensor, list, tuple, dict)) for e in a)


def flatten(args, kwargs):
    """Leaves of (args, kwargs) and how to rebuild them. A call whose arguments are all leaves (see
    `_opaque`) skips the pytree machinery: its tree is None, or (number of positional arguments,
    keyword names)."""
    for a in args:
        if not _opaque(a):
            return optree.tree_flatten((args, kwargs), none_is_leaf=True)
    if not kwargs:
        return list(args), None
    for a in kwargs.values():
        if not _opaque(a):
            return optree.tree_flatten((args, kwargs), none_is_leaf=True)
    return [*args, *kwargs.values()], (len(args), tuple(kwargs))


def unflatten(treedef, leaves):
    """(args, kwargs) from `flatten`'s leaves and tree."""
    if treedef is None:
        return leaves, {}
    if type(treedef) is tuple:
        n, keys = treedef
        return leaves[:n], dict(zip(keys, leaves[n:]))
    return optree.tree_unflatten(treedef, leaves)


def level_plan(out_paxes, batched):
    """Nesting order of the vmap levels and, per level, where each batch dim sits.

    Functorch applies the innermost level's batching rule first.  An axis along
    which some operand is invariant must be innermost, so its rule sees an
    unbatched operand and folds the batch into one big op (`[n*m, k] @ [k, n]`)
    instead of broadcasting that operand to every device before a `bmm`.
    Returns (levels, adds, removes): `levels` outer-to-inner axis order;
    `adds[l]` the (operand, batch dim) pairs to add at level l; `removes[l]` the
    output dim to restore level l's axis at (inner levels first), so outputs
    come back in mesh order.
    """
    key = (out_paxes, tuple(p for _, p in batched))
    got = _PLANS.get(key)
    if got is not None:
        return got
    count = {a: sum(a in p for _, p in batched) for a in out_paxes}
    levels = sorted(out_paxes, key=lambda a: (-count[a], out_paxes.index(a)))
    adds = []
    for li, a in enumerate(levels):
        done = set(levels[:li])
        adds.append([
            (j, sum(1 for b in p if b not in done and p.index(b) < p.index(a)))
            for j, (_, p) in enumerate(batched) if a in p
        ])
    removes = []
    for li in reversed(range(len(levels))):
        a = levels[li]
        inner = set(levels[li + 1:])
        removes.append(sum(1 for b in out_paxes if b in inner and out_paxes.index(b) < out_paxes.index(a)))
    got = (tuple(levels), adds, removes)
    if len(_PLANS) < 4096:
        _PLANS[key] = got
    return got


_PLANS: dict = {}


def run_op(func, leaves, treedef, batched, union, inplace, body):
    """The simulated backend's `run_op`: `func` on the physical leaves, once for all devices.

    `batched` lists (leaf index, its device axes); the result has a leading dim per axis of
    `union` (the op's type), in mesh order.  A hand-written direct form (`DIRECT`), else the op
    itself where broadcasting lines the device dims up (`direct_ok`), else `run_batched`; an
    in-place op always runs batched.  Returns (result, its device axes).
    """
    out_paxes = body.order(union)
    if not batched or inplace:
        return run_batched(func, leaves, treedef, batched, out_paxes, body), out_paxes
    direct = DIRECT.get(func)
    if direct is not None:
        args, kwargs = unflatten(treedef, leaves)
        if direct[0](args, kwargs, batched, out_paxes):
            return direct[1](batched, out_paxes, *args, **kwargs), out_paxes  # a hand-written form
        if direct_ok(func, leaves, batched, out_paxes):
            return func(*args, **kwargs), out_paxes
    elif direct_ok(func, leaves, batched, out_paxes):
        args, kwargs = unflatten(treedef, leaves)
        return func(*args, **kwargs), out_paxes  # device dims broadcast like leading dims: no vmap
    return run_batched(func, leaves, treedef, batched, out_paxes, body), out_paxes


def _call(func, args, kwargs):
    return func(*args, **kwargs)


#: pointwise ops whose vmap rules promote a batched 0-d operand as if it had dims (under torch.vmap,
#: `torch.where(c, f16, f64 0-d)` is float64; plainly float16): their operands are cast to the plain
#: call's result dtype first, as TensorIterator casts them
_MISPROMOTED = frozenset({"where", "clamp", "clip", "addcmul", "addcdiv"})


def _plain_promotion(func, leaves, treedef, batched):
    """`leaves` with every non-bool tensor cast to the dtype `func` gives on one device's blocks (found
    on meta tensors)."""
    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t
            for t in leaves]
    for i, p in batched:
        meta[i] = torch.empty(leaves[i].shape[len(p):], dtype=leaves[i].dtype, device="meta")
    args, kwargs = unflatten(treedef, meta)
    want = func(*args, **kwargs).dtype
    return [t.to(want) if isinstance(t, torch.Tensor) and t.dtype not in (want, torch.bool) else t for t in leaves]


#: exceptions that are torch's control flow, not an op's failure: passed on, not retried device by device
#: (a non-reentrant checkpoint's recomputation stops with one once it has what the backward needs; run
#: again device by device, the op met a finished recomputation: "target_frame.early_stop is set")
_SIGNALS = tuple(e for e in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if e is not None)


def run_batched(func, leaves, treedef, batched, out_paxes, body):
    """`func` on the physical leaves under one functorch vmap level per device axis (`level_plan`),
    its decomposition where torch has no batching rule (`run`); the device dims come back leading,
    in mesh order. With no device dims (an invariant result), a plain call."""
    if not out_paxes:
        args, kwargs = unflatten(treedef, leaves)
        return func(*args, **kwargs)
    if contract.autocast_on():  # vmap drops autocast's casts (torch.vmap too): device by device, as processes run it
        return per_device.retry(func, list(leaves), treedef, batched, out_paxes, body, _call, unflatten, None)
    if getattr(func, "__name__", "") in _MISPROMOTED and any(leaves[i].dim() == len(p) for i, p in batched):
        leaves = _plain_promotion(func, leaves, treedef, batched)
    sizes = body.sizes
    order, adds, removes = level_plan(out_paxes, batched)
    levels = []
    blocks = list(leaves)  # (unbatched, for `per_device.retry`)
    try:
        for ax, add in zip(order, adds):
            n = sizes[ax]
            lvl = _vmap_increment_nesting(n, "different")
            levels.append((lvl, n))
            for j, bdim in add:
                k = batched[j][0]
                leaves[k] = _add_batch_dim(leaves[k], bdim, lvl)
        args, kwargs = unflatten(treedef, leaves)
        try:
            out = run(func, args, kwargs)
        except _SIGNALS:
            raise
        except Exception as e:  # noqa: BLE001 - vmap cannot batch it (or it fails): device by device, below
            failed = e
        else:
            failed = None
        if failed is not None:
            for _ in levels:
                _vmap_decrement_nesting()
            levels = []
            return per_device.retry(func, blocks, treedef, batched, out_paxes, body, run, unflatten, failed)
        single = isinstance(out, torch.Tensor)
        out_leaves, out_def = ([out], None) if single else optree.tree_flatten(out, none_is_leaf=True)
        for out_dim in removes:
            lvl, n = levels.pop()
            out_leaves = [
                _remove_batch_dim(o, lvl, n, out_dim) if isinstance(o, torch.Tensor) else o for o in out_leaves
            ]
            _vmap_decrement_nesting()
        return out_leaves[0] if single else optree.tree_unflatten(out_def, out_leaves)
    finally:
        for _ in levels:
            _vmap_decrement_nesting()
