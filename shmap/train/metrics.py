"""The run's outputs in --out: lagged metrics (`metrics.jsonl`), the loss plot, and the checks that keep
an earlier run's files (refused, or kept up to the step a resumed run starts from)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .config import Config, ConfigError


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite (names the step and the last good checkpoint)."""


def _value(x) -> float:
    if hasattr(x, "to_local"):
        x = x.to_local()
    return float(x)


class RecordWriter:
    """Lagged metrics, as in the cookbook: step k's values are read while step k+1 runs.

    Reading a device value forces the host to wait for it; reading the previous
    step's values instead keeps the device busy.  Lines go to `metrics.jsonl`
    (rank 0 only) and to the progress bar.
    """

    def __init__(self, path: Path | None, progress=None, log=print):
        self.file = open(path, "a") if path is not None else None
        self.pending = None
        self.progress = progress
        self.log = log
        self.history = []

    def __call__(self, record: dict | None):
        record, self.pending = self.pending, record
        if record is None:
            return
        out = {k: (_value(v) if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        for key, what in (("train_loss", "the training loss"), ("grad_norm", "the gradient norm")):
            # (a non-finite gradient makes the update's parameters non-finite: never save those)
            if key in out and not math.isfinite(out[key]):
                raise NonFiniteLossError(f"step {out['step']}: {what} is {out[key]}")
        self.write(out)

    def write(self, out: dict):
        self.history.append(out)
        if self.file is not None:
            self.file.write(json.dumps(out) + "\n")
            self.file.flush()
        if self.progress is not None and "train_loss" in out:
            # (no redraw here: the bar's own update redraws, at most every mininterval; a redraw a step wrote
            # a frame per step to a log file)
            self.progress.set_postfix(loss=f"{out['train_loss']:.3f}", tok_s=f"{out['tokens_per_s']:.0f}",
                                      refresh=False)

    def flush(self):
        self(None)

    def close(self):
        if self.file is not None:
            self.file.close()


def plot(history: list, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["step"], r["train_loss"]) for r in history if "train_loss" in r]
    va = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if tr:
        ax.plot(*zip(*tr), lw=0.8, alpha=0.5, label="train")
        k = max(1, len(tr) // 50)
        if k > 1:
            sm = [sum(v for _, v in tr[max(0, i - k + 1): i + 1]) / len(tr[max(0, i - k + 1): i + 1])
                  for i in range(len(tr))]
            ax.plot([s for s, _ in tr], sm, lw=1.5, label=f"train (mean of {k})")
    if va:
        ax.plot(*zip(*va), "o-", lw=1.5, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_output_dirs(cfg: Config):
    """--out and --checkpoint-dir must be (or become) writable directories, checked before any work; a new
    run does not write over an earlier run's metrics (as it does not over its checkpoints)."""
    import tempfile

    if cfg.resume and cfg.checkpoint_dir and not Path(cfg.checkpoint_dir).exists():  # (not made, then refused)
        raise ConfigError(f"--resume: --checkpoint-dir {cfg.checkpoint_dir} does not exist, so there is no checkpoint "
                          "to continue from. Fix: the directory the run saved in, or drop --resume to start a new "
                          "run.")
    for flag, d in (("--out", cfg.out), ("--checkpoint-dir", cfg.checkpoint_dir)):
        if not d:
            continue
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=d):
                pass
        except OSError as e:
            what = "is a file, not a directory" if Path(d).is_file() else \
                f"cannot be made a writable directory ({e.strerror or e})"
            raise ConfigError(f"{flag} {d}: {what}. Fix: a writable directory path.") from None
    for name in ("metrics.jsonl", "loss.png", "sample.txt") if cfg.out else ():  # (what rank 0 writes there)
        path = Path(cfg.out) / name
        if path.exists() and not path.is_file():
            raise ConfigError(f"--out {cfg.out}: {path} is a directory (or not a regular file), and the run writes "
                              f"its {name} there. Fix: move it away, or another --out.")
    metrics = Path(cfg.out) / "metrics.jsonl" if cfg.out else None
    if metrics is not None and not cfg.resume and metrics.is_file() and metrics.stat().st_size:
        raise ConfigError(f"--out {cfg.out} holds an earlier run's metrics.jsonl, which a new run would replace "
                          "(each run writes its own --out; the default is runs/train). Fix: another --out, e.g. "
                          "--out runs/mine, or empty that one; or, to continue that run, --resume with the "
                          "--checkpoint-dir it saved its checkpoints in.")


def keep_metrics_before(path: Path, start: int, end: int | None = None, last_loss: float | None = None,
                        flag="--out"):
    """Keep the lines of an earlier run's metrics before the step this one starts from (none, fresh): its
    training lines before `start`, its validation lines before it, and (without `end`) at it.  A run that
    knows its last step (`end`) drops a validation line at `start` too: resumed where an evaluation is due,
    or at its end, it writes that line again; resumed elsewhere, the line is the
    final evaluation of an earlier, shorter run (`--steps 4`, then `--steps 8 --resume`), which the
    uninterrupted run does not have.  A partial last line (a crash mid-write) is dropped.

    `last_loss`: the checkpoint's record of step `start - 1`'s training loss.  Lines of another run (an
    --out that run did not write) are refused, not cut down and mixed with this one's."""
    start_val = start - 1 if end is not None else start
    if not path.exists():
        return
    records = []  # (line, its JSON), read once; a line that does not parse (a partial last one) is dropped
    for line in path.read_text().splitlines() if start else ():
        try:
            records.append((line, json.loads(line)))
        except ValueError:
            continue
    if last_loss is not None:
        theirs = [r["train_loss"] for _, r in records
                  if isinstance(r, dict) and r.get("step") == start - 1 and "train_loss" in r]
        if theirs and theirs[-1] != last_loss:
            raise ConfigError(
                f"{flag}: {path} holds another run's metrics (its step {start - 1} trained to loss {theirs[-1]}, the "
                f"resumed run's to {last_loss}); resuming would cut them down and mix the two runs. Fix: the "
                f"{flag} the resumed run wrote, or another (or an emptied) {flag}.")
    kept = []
    for line, rec in records:
        step = rec.get("step", start) if isinstance(rec, dict) else start
        if step < start or ("val_loss" in rec and step <= start_val):
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def read_history(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
