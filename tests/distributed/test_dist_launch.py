"""Programs under `torchrun`: the documented example runs; a failing rank ends the job, bounded."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# Multi-process tests share one xdist worker: they compete for ports and both cores.
pytestmark = pytest.mark.xdist_group("multiprocess")


def torchrun(script, nproc=4, timeout=150):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _alive(script) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(script) in line and "ps -eo" not in line]


def test_the_documented_example_runs_under_torchrun():
    p, _ = torchrun(ROOT / "examples" / "distributed_matmul.py")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK: the distributed mesh agrees" in p.stdout
    assert "(Shard(dim=0), Replicate())" in p.stdout
    assert "{'psum': 2}" in p.stdout  # one forward psum, one on w's gradient


def test_a_failing_rank_ends_the_torchrun_job_in_bounded_time():
    script = HERE / "torchrun_fail.py"
    p, elapsed = torchrun(script)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert elapsed < 90, f"{elapsed:.0f} s"
    assert "ValueError: torchrun boom on rank 2" in out
    assert "unreachable" not in out
    assert not _alive(script), _alive(script)


# -- shmap.spawn, the local launcher -------------------------------------------

sys.path.insert(0, str(HERE))
import dist_cases  # noqa: E402
import shmap  # noqa: E402


def test_spawn_returns_each_ranks_result_in_rank_order():
    assert shmap.spawn(dist_cases.rank, nprocs=3, timeout=30) == [0, 1, 2]
    assert shmap.spawn(dist_cases.world, nprocs=2, timeout=30) == [2, 2]


def test_spawn_reports_every_failed_rank():
    with pytest.raises(shmap.SpawnError) as info:
        shmap.spawn(dist_cases.fail_on_odd_ranks, nprocs=4, timeout=30)
    err = info.value
    assert sorted(err.errors) == [1, 3] and sorted(err.results) == [0, 2]
    assert "2 of 4 ranks failed" in str(err) and "rank 1: KeyError" in str(err)
    assert "fail_on_odd_ranks" in str(err)  # the root cause's traceback


def test_make_mesh_distributed_needs_an_initialised_world():
    with pytest.raises(RuntimeError, match="torchrun"):
        shmap.make_mesh((2,), ("i",), distributed=True)


def test_configure_distributed_validates_and_returns_the_previous_settings():
    prev = shmap.configure_distributed(timeout=12.5)
    try:
        assert shmap.configure_distributed()["timeout"] == 12.5
        with pytest.raises(ValueError, match="timeout"):
            shmap.configure_distributed(timeout=0)
    finally:
        from shmap.backends import watchdog
        watchdog._OPTIONS.update(prev)
