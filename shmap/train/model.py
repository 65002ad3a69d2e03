"""The model: parameters, where each lives on the mesh, and the per-device forward.

Parallelism is decided in one place, `Layout`, from the mesh alone:

| axis     | batch       | weights                                   | collectives that follow           |
|----------|-------------|-------------------------------------------|-----------------------------------|
| `data`   | split       | replicated                                | backward: psum of every gradient  |
| `fsdp`   | split       | sharded along one dim, gathered before use | fwd all_gather, bwd psum_scatter  |
| `tensor` | replicated  | heads and MLP hidden units split           | psum after each row-parallel proj |

The forward below is one per-device program for every mesh: it gathers what
the specs say is sharded over `fsdp`, computes on its heads and hidden units,
and sums the row-parallel projections over `tensor`.  Everything else — the
gradient all-reduce of DP, the reduce-scatter of FSDP, Megatron's backward
all-reduce before the column-parallel matmuls — is not written anywhere: it is
the transpose of what the types say, inserted by shmap's autodiff.  With no mesh
(`--mesh none`) the helpers are identities and the same code is plain PyTorch.
"""
from __future__ import annotations

import copy
import math

import optree
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import shmap
from shmap import P

from .config import Config


class Layout:
    """Which mesh axes split the batch, shard weights, or split heads — and the three
    operations that follow from it.  Axes of size 1 are left out of the mesh."""

    def __init__(self, mesh_sizes: dict | None):
        sizes = {a: s for a, s in (mesh_sizes or {}).items() if s > 1}
        self.sizes = sizes
        self.batch = tuple(a for a in ("data", "fsdp") if a in sizes)   # the batch is split over these
        self.fsdp = tuple(a for a in ("fsdp",) if a in sizes)           # weights are sharded over these
        self.tensor = tuple(a for a in ("tensor",) if a in sizes)       # heads / hidden units split over these

    def make_mesh(self, device=None):
        """The shmap mesh (simulated, or over the torch.distributed world when one is initialised); a
        simulated mesh keeps its values on `device` (None: where they come from, the CPU here)."""
        if not self.sizes:  # every axis of size 1: one device
            return shmap.make_mesh((1,), ("data",), device=device)
        return shmap.make_mesh(tuple(self.sizes.values()), tuple(self.sizes), device=device)

    def spec(self, *dims) -> P:
        """A PartitionSpec keeping only axes present in this mesh: spec('fsdp', 'tensor')."""
        def keep(d):
            if d is None:
                return None
            axes = tuple(a for a in ((d,) if isinstance(d, str) else d) if a in self.sizes)
            return None if not axes else axes[0] if len(axes) == 1 else axes
        entries = [keep(d) for d in dims]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    # --- the three operations a per-device program needs -----------------------------------------
    def gather(self, w, spec: P):
        """A weight's block -> the weight this device computes with: all-gather the dims the spec shards
        over weight-sharding axes.  Its transpose, psum_scatter, is FSDP's backward reduce-scatter."""
        for dim, entry in enumerate(spec):
            axes = tuple(a for a in _entry_axes(entry) if a in self.fsdp)
            if axes:
                w = shmap.all_gather(w, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True)
        return w

    def gather_all(self, params, specs, dtype):
        """Every weight as this device computes with it (cast to `dtype`, FSDP dims all-gathered), up
        front, and the layout to use with them (nothing left to gather).  Gathered together, the
        weights travel in a few collectives instead of one each (on processes, shmap buckets
        all_gathers issued back to back), as FSDP2 gathers a unit's parameters at once."""
        params = _map2(lambda t, s: self.gather(t.to(dtype), s), params, specs)
        whole = copy.copy(self)
        whole.fsdp = ()
        return params, whole

    def sum_partial(self, x):
        """Sum the partial results of a row-parallel projection over the head/hidden-splitting axes."""
        return shmap.psum(x, self.tensor) if self.tensor else x

    def mean_over_batch(self, x):
        """A per-device mean over this device's rows -> the mean over the global batch.

        Divided first, then summed (`pmean` sums, then divides): the psum is then the body's last op,
        and on processes the loss leaves the body still on the wire, read when the loop reads it."""
        if not self.batch:
            return x
        return shmap.psum(x / math.prod(self.sizes[a] for a in self.batch), self.batch)


def _map2(f, tree, specs):
    """f over the leaves of a nested dict and its spec tree (dicts only: under torch.compile they are
    Dynamo's immutable dicts, which pytree libraries take for leaves)."""
    if isinstance(tree, dict):
        return {k: _map2(f, v, specs[k]) for k, v in tree.items()}
    return f(tree, specs)


def _entry_axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def param_specs(cfg: Config, layout: Layout) -> dict:
    """Where every parameter lives: the FSDP and TP tables of the cookbook, one entry per parameter."""
    s = layout.spec
    layer = {
        "attention": {
            "qkv": s(None, "fsdp", "tensor", None),  # (3, d, heads, head_dim): column-parallel over heads
            "out": s("tensor", None, "fsdp"),        # (heads, head_dim, d): row-parallel over heads
        },
        "mlp": {
            "in_kernel": s("fsdp", "tensor"),        # (d, mlp): column-parallel over hidden units
            "out_kernel": s("tensor", "fsdp"),       # (mlp, d): row-parallel over hidden units
        },
    }
    if cfg.block == "prenorm":  # (d,): sharded over fsdp as well, as FSDP2 shards every parameter, so
        layer["norm1"] = s("fsdp")  # their gradients ride the weights' reduce-scatter instead of a psum of
        layer["norm2"] = s("fsdp")  # their own, one collective less a step
    specs = {
        "embedding": s(None, "fsdp"),     # (256, d)
        "pos_embed": s(None, "fsdp"),     # (seq, d)
        "layers": {str(i): _copy(layer) for i in range(cfg.layers)},
        "linear_out": {"kernel": s("fsdp", None)},  # (d, 256)
    }
    if cfg.block == "prenorm":
        specs["final_norm"] = s("fsdp")
    return specs


def batch_spec(layout: Layout) -> P:
    """Token rows are split over the batch axes and replicated over `tensor`."""
    return layout.spec(layout.batch or None)


def _copy(tree):
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def param_dtype(cfg: Config) -> torch.dtype:
    """Parameters and Adam state: float64 in float64 runs, float32 otherwise (bfloat16 computes only)."""
    return torch.float64 if cfg.dtype == "float64" else torch.float32


def compute_dtype(cfg: Config) -> torch.dtype:
    return getattr(torch, cfg.dtype)


def init_params(cfg: Config) -> dict:
    """Deterministic global parameters: the same on every mesh and every process.

    A fresh generator per parameter (seeded by `cfg.seed` and the parameter's
    position) keeps each tensor independent of the others' shapes.  Matmul
    kernels are normal with std 1/sqrt(fan_in); the projections back into the
    residual stream are scaled by 1/sqrt(2 * layers) (GPT-2), positions start at
    zero (as the cookbook).
    """
    dt = param_dtype(cfg)
    d, h, k, m = cfg.embed_dim, cfg.heads, cfg.head_dim, cfg.mlp_dim
    counter = iter(range(1 << 30))
    resid = 1 / math.sqrt(2 * cfg.layers)

    def normal(shape, std):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + next(counter))
        return (torch.randn(shape, generator=g, dtype=torch.float64) * std).to(dt)

    params = {
        "embedding": normal((cfg.vocab_size, d), 1.0),
        "pos_embed": torch.zeros(cfg.seq_len, d, dtype=dt),
        "layers": {},
        "linear_out": {"kernel": normal((d, cfg.vocab_size), d ** -0.5)},
    }
    for i in range(cfg.layers):
        layer = {
            "attention": {"qkv": normal((3, d, h, k), d ** -0.5), "out": normal((h, k, d), (h * k) ** -0.5 * resid)},
            "mlp": {"in_kernel": normal((d, m), d ** -0.5), "out_kernel": normal((m, d), m ** -0.5 * resid)},
        }
        if cfg.block == "prenorm":
            layer["norm1"] = torch.ones(d, dtype=dt)
            layer["norm2"] = torch.ones(d, dtype=dt)
        params["layers"][str(i)] = layer
    if cfg.block == "prenorm":
        params["final_norm"] = torch.ones(d, dtype=dt)
    return params


def _rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _cookbook_norm(x):
    return x * torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True) + 1e-6)


def block(cfg: Config, layout: Layout, sp: dict, p: dict, x):
    """One decoder layer on this device's rows: attention then MLP, each added to the residual stream.

    Under `--remat` with FSDP each weight is all-gathered just before use, and
    gathered again when the backward pass recomputes the layer (the cookbook's
    "parameters unsharded one by one, briefly"); otherwise `forward` gathered them.
    """
    cdt = compute_dtype(cfg)
    prenorm = cfg.block == "prenorm"

    def w(t, spec):  # cast first, so FSDP gathers compute-dtype bytes
        return layout.gather(t.to(cdt), spec)

    h = _rms_norm(x, w(p["norm1"], sp["norm1"])) if prenorm else x
    qkv = torch.einsum("bsd,tdhk->tbhsk", h, w(p["attention"]["qkv"], sp["attention"]["qkv"]))
    q, k, v = qkv.unbind(0)  # (its backward stacks; indexing would zero-fill qkv three times)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, k)
    att = torch.einsum("bhsk,hkd->bsd", att, w(p["attention"]["out"], sp["attention"]["out"]))
    x = x + layout.sum_partial(att)
    if not prenorm:
        x = _cookbook_norm(x)

    h = _rms_norm(x, w(p["norm2"], sp["norm2"])) if prenorm else x
    h = F.gelu(h @ w(p["mlp"]["in_kernel"], sp["mlp"]["in_kernel"]))
    h = h @ w(p["mlp"]["out_kernel"], sp["mlp"]["out_kernel"])
    x = x + layout.sum_partial(h)
    return _cookbook_norm(x) if not prenorm else x


def forward(cfg: Config, layout: Layout, specs: dict, params: dict, tokens):
    """Per-device logits for per-device token rows `tokens` (b, s): the body of every mesh.

    With FSDP (and no `--remat`) every weight is gathered at the top, together;
    under `--remat` each layer gathers its own, again when it is recomputed.
    """
    cdt = compute_dtype(cfg)
    if layout.fsdp and not cfg.remat:
        params, layout = layout.gather_all(params, specs, cdt)

    def w(t, spec):
        return layout.gather(t.to(cdt), spec)

    s = tokens.shape[-1]
    x = F.embedding(tokens, w(params["embedding"], specs["embedding"]))
    pos = w(params["pos_embed"], specs["pos_embed"])
    # Slice only a shorter sequence (sampling): a slice's backward reads its cotangent, and under DP
    # that cotangent is pos_embed's gradient psum, which would have to arrive mid-pass (one more
    # collective, waited for) instead of riding in the pass's last bucket.
    x = x + (pos if s == pos.shape[0] else pos[:s])
    for i in range(cfg.layers):
        p, sp = params["layers"][str(i)], specs["layers"][str(i)]
        if cfg.remat:  # keep only each layer's input; recompute the rest in the backward pass
            x = checkpoint(block, cfg, layout, sp, p, x, use_reentrant=False)
        else:
            x = block(cfg, layout, sp, p, x)
    if cfg.block == "prenorm":
        x = _rms_norm(x, w(params["final_norm"], specs["final_norm"]))
    return x @ w(params["linear_out"]["kernel"], specs["linear_out"]["kernel"])


def loss_fn(cfg: Config, layout: Layout, specs: dict, params: dict, tokens):
    """Mean next-byte cross-entropy (nats/byte) over the global batch; `tokens` is (b, seq+1)."""
    logits = forward(cfg, layout, specs, params, tokens[:, :-1])
    logits = logits.to(param_dtype(cfg))  # the loss in float32 (float64 runs: float64) even under bfloat16
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return layout.mean_over_batch(loss)


def count_params(params) -> int:
    return sum(t.numel() for t in optree.tree_leaves(params))
