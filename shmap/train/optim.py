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
    """One standard Adam step (Kingma & Ba) for one tensor -> (param, mu, nu), in `torch.optim.Adam`'s form.

    mu <- beta1 mu + (1 - beta1) g and nu <- beta2 nu + (1 - beta2) g^2 (the
    cookbook's version weights them the wrong way round), then
    param <- param - lr / (1 - beta1^t) * mu / (sqrt(nu) / sqrt(1 - beta2^t) + eps),
    written as torch.optim.Adam writes it (`lerp`, `addcmul`, `addcdiv`):
    seven ops per tensor, and the same roundings, so the two agree to the last bit.
    """
    mu = torch.lerp(mu, grad, 1 - cfg.beta1)
    nu = torch.addcmul(nu * cfg.beta2, grad, grad, value=1 - cfg.beta2)
    step_size = lr / (1 - cfg.beta1 ** count)
    denom = torch.sqrt(nu) / math.sqrt(1 - cfg.beta2 ** count) + cfg.eps
    return torch.addcdiv(param, mu, denom, value=-step_size), mu, nu


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warmup to `cfg.lr`, then cosine decay to `min_lr_ratio * lr` at the last step (host math)."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    t = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def global_norm(grads, specs):
    """sqrt(sum of every gradient element squared), over the global (unsharded) gradients.

    Each device sums the squares of its blocks, grouped by the axes the blocks
    are sharded over; each group is psum'd over exactly those axes (one psum per
    group, not per tensor), and a replicated group not at all: its sum is
    already the whole.  The result is invariant, which `out_specs=P()` checks.
    """
    groups = {}
    for g, spec in zip(optree.tree_leaves(grads), optree.tree_leaves(specs, is_leaf=_is_spec)):
        sq = g.float().pow(2).sum() if g.dtype in (torch.bfloat16, torch.float16) else g.pow(2).sum()
        axes = spec_axes(spec)
        groups[axes] = groups.get(axes, 0) + sq
    total = sum(shmap.psum(sq, axes) if axes else sq for axes, sq in groups.items())
    return torch.sqrt(total)


def update(cfg: Config, specs, params, grads, opt, count: int, lr: float):
    """Clip by the global norm, then Adam on every block this device holds -> (params, opt, grad_norm)."""
    norm = global_norm(grads, specs)
    if cfg.clip > 0:
        scale = torch.clamp(cfg.clip / (norm + 1e-6), max=1.0)
        scales = {scale.dtype: scale}  # the factor in each gradient dtype, cast once

        def clip(g):
            if g.dtype not in scales:
                scales[g.dtype] = scale.to(g.dtype)
            return g * scales[g.dtype]

        grads = optree.tree_map(clip, grads)
    leaves = zip(*(optree.tree_leaves(t) for t in (params, grads, opt["mu"], opt["nu"])))
    new = [adam_update(cfg, p, g, m, v, count, lr) for p, g, m, v in leaves]
    treedef = optree.tree_structure(params)
    params = optree.tree_unflatten(treedef, [n[0] for n in new])
    opt = {"mu": optree.tree_unflatten(treedef, [n[1] for n in new]),
           "nu": optree.tree_unflatten(treedef, [n[2] for n in new])}
    return params, opt, norm


def spec_axes(spec) -> tuple:
    """Every mesh axis a PartitionSpec shards over."""
    out = []
    for entry in spec:
        out.extend(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    return tuple(out)


def _is_spec(x):
    return isinstance(x, shmap.PartitionSpec)
