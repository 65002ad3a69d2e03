"""shmap/train/metrics.py: lagged metrics, and the checks that keep an earlier run's files in --out."""
import json

import pytest
import torch

from shmap.train import metrics
from shmap.train.config import ConfigError

from .tiny import tiny


def test_metrics_are_read_one_step_late():
    """The writer holds step k's device values until step k+1 is dispatched (no sync inside a step)."""
    w = metrics.RecordWriter(None)
    w({"step": 0, "train_loss": torch.tensor(2.0)})
    assert w.history == []
    w({"step": 1, "train_loss": torch.tensor(1.5)})
    assert w.history == [{"step": 0, "train_loss": 2.0}]
    w.flush()
    assert [r["step"] for r in w.history] == [0, 1]


def test_a_non_finite_value_stops_the_writer_naming_the_step():
    w = metrics.RecordWriter(None)
    w({"step": 3, "train_loss": torch.tensor(float("nan"))})
    with pytest.raises(metrics.NonFiniteLossError, match=r"step 3: the training loss is nan"):
        w.flush()


@pytest.mark.parametrize("name", ["metrics.jsonl", "loss.png", "sample.txt"])
def test_an_output_file_that_is_a_directory_is_refused_before_any_work(tmp_path, name):
    """It was a raw IsADirectoryError when the run first wrote there (the plot and the sample: at its end)."""
    (tmp_path / name).mkdir()
    with pytest.raises(ConfigError, match=rf"--out {tmp_path}: {tmp_path / name} is a directory \(or not a "
                                          rf"regular file\), and the run writes its {name} there\. Fix: "):
        metrics.check_output_dirs(tiny("none", out=str(tmp_path)))


def test_a_resumed_run_keeps_the_lines_before_its_start(tmp_path):
    """Training lines before the start step, validation lines up to it; a partial last line is dropped."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "train_loss": 3.0}, {"step": 1, "train_loss": 2.5}, {"step": 2, "val_loss": 2.4},
             {"step": 2, "train_loss": 2.2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "tr')
    metrics.keep_metrics_before(path, 2)
    assert metrics.read_history(path) == lines[:3]


def test_a_finished_run_resumed_drops_its_final_validation_line(tmp_path):
    """Resumed at its last step (start == end), a run evaluates that state again and writes the line anew."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "train_loss": 3.0}, {"step": 1, "train_loss": 2.5}, {"step": 2, "val_loss": 2.4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    metrics.keep_metrics_before(path, 2, end=2)
    assert metrics.read_history(path) == lines[:2]


def test_the_progress_bar_does_not_redraw_every_step():
    """set_postfix redrew the bar at every step: `make train > log` wrote a frame per step."""
    import io

    from tqdm import tqdm

    sink = io.StringIO()
    bar = tqdm(total=300, file=sink, mininterval=1e9)  # (redraws by the interval never: no timing in the test)
    w = metrics.RecordWriter(None, bar, print)
    for k in range(300):
        w({"step": k, "train_loss": torch.tensor(1.0), "grad_norm": torch.tensor(1.0), "lr": 0.1,
           "tokens_per_s": 1.0})
        bar.update(1)
    w.flush()
    bar.close()
    assert sink.getvalue().count("\r") < 10


def test_a_shorter_run_continued_drops_its_final_validation_line(tmp_path):
    """`--steps 4`, then `--steps 8 --resume`: the first run's final evaluation at step 4 (off the
    --eval-every grid) stayed, one line more than the uninterrupted 8-step run's metrics."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "train_loss": 3.0}, {"step": 3, "val_loss": 2.6}, {"step": 3, "train_loss": 2.5},
             {"step": 4, "val_loss": 2.4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    metrics.keep_metrics_before(path, 4, end=8)
    assert metrics.read_history(path) == lines[:3]
