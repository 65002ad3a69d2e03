"""The training recipe under torchrun: 4 gloo processes give the simulated mesh's losses, save
checkpoints that resume on another mesh (both ways), and refuse a world of the wrong size."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.train.tiny import TINY_FLAGS, tiny  # noqa: E402

from shmap.train import loop  # noqa: E402

pytestmark = pytest.mark.xdist_group("multiprocess")


def _torchrun(nproc, *args, timeout=240, program=("-m", "shmap.train")):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *program, *TINY_FLAGS, "--sample-len", "0", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _train_losses(path):
    rows = [json.loads(x) for x in Path(path).read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}


@pytest.fixture(scope="module")
def torchrun_fsdp_tensor(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_train")
    p = _torchrun(4, "--mesh", "fsdp=2,tensor=2", "--steps", "4", "--out", str(d / "out"),
                  "--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return d, p


def test_four_processes_give_the_losses_of_the_simulated_mesh(torchrun_fsdp_tensor):
    d, p = torchrun_fsdp_tensor
    simulated = loop.train(tiny("fsdp=2,tensor=2"), log=lambda *a: None)
    expect = {r["step"]: r["train_loss"] for r in simulated["history"] if "train_loss" in r}
    got = _train_losses(d / "out" / "metrics.jsonl")
    assert sorted(got) == [0, 1, 2, 3]
    assert [got[s] for s in range(4)] == pytest.approx([expect[s] for s in range(4)], rel=1e-12)
    assert p.stdout.count("final validation loss") == 1  # rank 0 alone prints


def test_a_torchrun_checkpoint_resumes_on_another_mesh_simulated_and_distributed(torchrun_fsdp_tensor, tmp_path):
    d, _ = torchrun_fsdp_tensor
    full = _train_losses(d / "out" / "metrics.jsonl")
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck" / "step_00000002", ck / "step_00000002")
    sim = loop.train(tiny("data=4", steps=4, checkpoint_dir=str(ck), resume=True), log=lambda *a: None)
    sim_losses = {r["step"]: r["train_loss"] for r in sim["history"] if "train_loss" in r}
    assert [sim_losses[s] for s in (2, 3)] == pytest.approx([full[2], full[3]], rel=1e-7)

    ck2 = tmp_path / "ck2"
    shutil.copytree(d / "ck" / "step_00000002", ck2 / "step_00000002")
    p = _torchrun(4, "--mesh", "data=2,tensor=2", "--steps", "4", "--out", str(tmp_path / "out"),
                  "--checkpoint-dir", str(ck2), "--resume")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "saved on mesh fsdp=2,tensor=2" in p.stdout
    got = _train_losses(tmp_path / "out" / "metrics.jsonl")
    assert [got[s] for s in (2, 3)] == pytest.approx([full[2], full[3]], rel=1e-7)


def test_a_world_of_the_wrong_size_is_refused_naming_the_flag():
    p = _torchrun(2, "--mesh", "data=4", "--steps", "1", "--out", "")
    assert p.returncode != 0
    assert p.stderr.count("--mesh data=4 has 4 devices but torchrun started 2 processes") == 1  # (rank 0 says it)


def test_a_failure_on_one_rank_is_torchruns_root_cause(tmp_path):
    """Rank 0 alone writes --out's metrics; here that write fails mid-run on rank 0 only (an OSError, as a
    full disk gives).  That rank must leave first, with its own status (it was SIGTERMed by torchrun after
    the other rank when `main` destroyed the process groups on the way out, skipping the exit protocol),
    so that torchrun's root cause is its error.  (torchrun then stops the other rank, which, when it gets
    to say anything first, names rank 0's error.)"""
    p = _torchrun(2, "--mesh", "data=2", "--steps", "3", "--out", str(tmp_path / "out"),
                  program=[str(Path(__file__).with_name("train_fail_rank0.py"))])
    assert p.returncode != 0
    root = p.stderr[p.stderr.index("Root Cause"):]
    assert "rank      : 0 " in root and "exitcode  : 1 " in root and "No space left on device" in root, root
    if "RankFailedError" in p.stderr:
        assert "rank 0: OSError" in p.stderr, p.stderr[-3000:]


def test_output_files_that_are_directories_are_refused_before_training(tmp_path):
    """metrics.jsonl, loss.png or sample.txt made directories: a ConfigError naming it, from rank 0 only
    (every rank meets it; the others stay quiet), before any step (it was a raw IsADirectoryError)."""
    (tmp_path / "out" / "loss.png").mkdir(parents=True)
    p = _torchrun(2, "--mesh", "data=2", "--steps", "2", "--out", str(tmp_path / "out"))
    assert p.returncode != 0
    assert p.stderr.count("shmap-train: error: --out") == 1, p.stderr[-3000:]
    assert "loss.png is a directory (or not a regular file)" in p.stderr
    assert "(rank 1)" not in p.stderr and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_an_out_path_that_is_a_file_is_refused_on_every_rank(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("")
    p = _torchrun(2, "--mesh", "data=2", "--steps", "2", "--out", str(f))
    assert p.returncode != 0 and f"--out {f}: is a file, not a directory" in p.stderr
    assert f.read_text() == ""  # nothing written over the user's file


def test_ctrl_c_under_torchrun_saves_one_step_every_rank_agreed_on(tmp_path):
    """torchrun passes Ctrl-C to every worker, each somewhere else (a step's collective, a save's barrier):
    the ranks hung in the save until torchrun killed them, with nothing saved.  Now they stop after one
    agreed step (train/stop.py), save it, and a resumed run continues with the uninterrupted run's losses."""
    import signal
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1")
    ck, out = tmp_path / "ck", tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "shmap.train",
           *TINY_FLAGS, "--sample-len", "0", "--mesh", "fsdp=2", "--steps", "100000", "--warmup", "100000",
           "--out", str(out), "--checkpoint-dir", str(ck), "--checkpoint-every", "7"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(_train_losses_if_any(out / "metrics.jsonl")) < 12:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C does: torchrun passes it on to its workers
    try:
        log, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("torchrun did not end within 60 s of Ctrl-C")
    from shmap.train import checkpoint

    last = checkpoint.latest(ck)
    n = checkpoint.read_meta(last)["step"] if last else 0
    # (saved now, or just before by the periodic save when the agreed step is a multiple of 7)
    assert n >= 12 and "interrupted: " in log and f"after {n} steps" in log, log[-3000:]
    q = _torchrun(2, "--mesh", "fsdp=2", "--steps", str(n + 2), "--warmup", "100000", "--out", str(out),
                  "--checkpoint-dir", str(ck), "--resume")
    assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
    full = loop.train(tiny("fsdp=2", steps=n + 2, warmup=100000), log=lambda *a, **k: None)
    want = {r["step"]: r["train_loss"] for r in full["history"] if "train_loss" in r}
    got = _train_losses(out / "metrics.jsonl")
    assert [got[k] for k in range(n, n + 2)] == pytest.approx([want[k] for k in range(n, n + 2)], rel=1e-12)


def _train_losses_if_any(path):
    try:
        return _train_losses(path)
    except (OSError, ValueError):
        return {}
