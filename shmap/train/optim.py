"""Adam as a map over the parameter pytree, the learning-rate schedule, and
gradient clipping that is right under sharding.

These are per-device functions: the loop runs them inside a `shard_map` whose
specs are the parameters' own, so each device updates only the blocks it
holds (FSDP keeps 1/N of the optimizer state) and the one cross-device
quantity, the global gradient norm, is a psum the types ask for.
"""
from __future__ import annotations

import math

import optree
import torch

import shmap

from .config import Config


def adam_init(params) -> dict:
    """Adam's moments, shaped (and sharded) like the parameters."""
    return {"mu": optree.tree_map(torch.zeros_like, params), "nu": optree.tree_map(torch.zeros_like, params)}


def adam_update(cfg: Config, param, grad, mu, nu, count: int, lr: float):
    """One standard Adam step (Kingma & Ba) -> (param, mu, nu), in `torch.optim.Adam`'s form.

    mu <- beta1 mu + (1 - beta1) g and nu <- beta2 nu + (1 - beta2) g^2 (the
    cookbook's version weights them the wrong way round), then
    param <- param - lr / (1 - beta1^t) * mu / (sqrt(nu) / sqrt(1 - beta2^t) + eps),
    written as torch.optim.Adam writes it (`lerp`, `addcmul`, `addcdiv`):
    the same roundings, so the two agree to the last bit.  The arguments are
    tensors, or lists of tensors (every parameter at once): then each op is
    one `torch._foreach_*` call over the lists, as torch.optim's foreach
    Adam does; in a body it is typed once per list position (shmap/foreach.py)
    rather than once per tensor and op.
    """
    return adam_apply(cfg, param, grad, mu, nu, *adam_scalars(cfg, count, lr))


def adam_scalars(cfg: Config, count: int, lr: float) -> tuple:
    """Step `count`'s two scalars, computed on the host in double precision as torch.optim.Adam does:
    (lr / (1 - beta1^t), sqrt(1 - beta2^t))."""
    return lr / (1 - cfg.beta1 ** count), math.sqrt(1 - cfg.beta2 ** count)


def adam_apply(cfg: Config, param, grad, mu, nu, step_size, bias2_sqrt):
    """`adam_update` given its scalars (`adam_scalars`): the part that runs on the devices.

    The scalars are Python floats, or 0-d float64 tensors (under torch.compile: a
    float would be specialised, a recompile per step; a tensor is a graph
    input).  Both give the same bits on the CPU: a tensor divisor is rounded
    to the parameters' dtype as a Python one is, and `addcdiv` computes
    `p + (s * mu) / denom`, which the tensor form spells as a multiply and
    an `addcdiv` of value 1.
    """
    if isinstance(param, torch.Tensor):
        p, m, v = adam_apply(cfg, [param], [grad], [mu], [nu], step_size, bias2_sqrt)
        return p[0], m[0], v[0]
    # Each result is a new list (the arguments are the caller's); the intermediates are this call's
    # own, updated in place as torch.optim does: 4 new lists of the parameters' size (eagerly) instead of 7.
    mu = torch._foreach_lerp(mu, grad, 1 - cfg.beta1)
    nu = torch._foreach_mul(nu, cfg.beta2)
    torch._foreach_addcmul_(nu, grad, grad, value=1 - cfg.beta2)
    denom = torch._foreach_sqrt(nu)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, cfg.eps)
    if isinstance(step_size, torch.Tensor):
        return torch._foreach_addcdiv(param, torch._foreach_mul(mu, -step_size), denom), mu, nu
    return torch._foreach_addcdiv(param, mu, denom, value=-step_size), mu, nu


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warmup to `cfg.lr` (reached at step `warmup - 1`), then cosine decay from step `warmup`, to
    `min_lr_ratio * lr` at step `steps` (the state after the last update; host math)."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    t = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def global_norm(grads, specs):
    """sqrt(sum of every gradient element squared), over the global (unsharded) gradients.

    Each device sums the squares of its blocks, grouped by the axes the blocks
    are sharded over (as a set: `P('tensor', 'fsdp')` and `P('fsdp', 'tensor')`
    shard over the same devices); each group is psum'd over exactly those axes
    (one psum per group, not per tensor), and a replicated group not at all:
    its sum is already the whole.  The result is invariant, which
    `out_specs=P()` checks.
    """
    leaves = optree.tree_leaves(grads)
    wide = any(g.dtype in (torch.bfloat16, torch.float16) for g in leaves)
    norms = torch._foreach_norm(leaves, 2, dtype=torch.float32) if wide else torch._foreach_norm(leaves, 2)
    groups = {}
    for n, spec in zip(norms, optree.tree_leaves(specs, is_leaf=_is_spec)):
        groups.setdefault(tuple(sorted(spec_axes(spec))), []).append(n)
    sums = {axes: torch.stack(ns).pow(2).sum() for axes, ns in groups.items()}
    total = sum(shmap.psum(sq, axes) if axes else sq for axes, sq in sums.items())
    return torch.sqrt(total)


def update(cfg: Config, specs, params, grads, opt, step_size, bias2_sqrt):
    """Clip by the global norm, then Adam on every block this device holds -> (params, opt, grad_norm).

    The step's scalars come from the host (`adam_scalars`; see `adam_apply`)."""
    norm = global_norm(grads, specs)
    treedef = optree.tree_structure(params)
    grad_list = treedef.flatten_up_to(grads)
    if cfg.clip > 0:
        scale = torch.clamp(cfg.clip / (norm + 1e-6), max=1.0)
        grad_list = torch._foreach_mul(grad_list, scale)
    new_p, mu, nu = adam_apply(cfg, treedef.flatten_up_to(params), grad_list, treedef.flatten_up_to(opt["mu"]),
                               treedef.flatten_up_to(opt["nu"]), step_size, bias2_sqrt)
    params = optree.tree_unflatten(treedef, new_p)
    opt = {"mu": optree.tree_unflatten(treedef, mu), "nu": optree.tree_unflatten(treedef, nu)}
    return params, opt, norm


def spec_axes(spec) -> tuple:
    """Every mesh axis a PartitionSpec shards over."""
    out = []
    for entry in spec:
        out.extend(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    return tuple(out)


def _is_spec(x):
    return isinstance(x, shmap.PartitionSpec)
