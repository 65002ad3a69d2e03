"""Programs under `torchrun`: the documented example runs; a failing rank ends the job, bounded."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# Multi-process tests share one xdist worker: they compete for ports and both cores.
pytestmark = pytest.mark.xdist_group("multiprocess")


def torchrun(script, *args, nproc=4, timeout=150):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
           *map(str, args)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _alive(script, *args) -> list[str]:
    """Processes still running `script` with these arguments (full command lines: `ps -ww`, which does not
    cut them at 80 columns, so another case's processes are not mistaken for this one's)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    want = " ".join([str(script), *map(str, args)])
    return [line for line in out.splitlines() if want in line and "ps -ww" not in line]


def test_the_documented_example_runs_under_torchrun():
    p, _ = torchrun(ROOT / "examples" / "distributed_matmul.py")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK: the distributed mesh agrees" in p.stdout
    assert "(Shard(dim=0), Replicate())" in p.stdout
    assert "{'psum': 2}" in p.stdout  # one forward psum, one on w's gradient


def _root_cause(out) -> str:
    """The rank torchrun's failure summary names as the root cause."""
    m = re.search(r"Root Cause \(first observed failure\):\n\[\d+\]:\n(?:.*\n)*?\s*rank\s*: (\d+)", out)
    return m and m.group(1)


def test_a_failing_rank_ends_the_torchrun_job_in_bounded_time():
    script = HERE / "torchrun_fail.py"
    p, elapsed = torchrun(script)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert elapsed < 90, f"{elapsed:.0f} s"
    assert "ValueError: torchrun boom on rank 2" in out
    assert "unreachable" not in out
    assert not _alive(script), _alive(script)
    # The failing rank leaves first (its error file written), so torchrun names it, not a rank that
    # merely stopped waiting for it.
    assert _root_cause(out) == "2", out[-3000:]
    assert "error_file: <N/A>" not in out.split("Root Cause")[1]


@pytest.mark.parametrize("case, named", [
    ("return_before_first", "rank 1 of its group finished the program"),
    # torchrun stops the others as soon as it sees rank 1 die: its summary names the signal
    ("sigkill_in_body", "Signal 9 (SIGKILL) received by PID"),
    ("other_shape", "Received data size doesn't match expected size"),  # gloo aborts rank 1
])
def test_faults_under_torchrun_end_every_rank_naming_the_culprit(case, named):
    """3 processes, rank 1 at fault: the job fails, torchrun's root cause is rank 1 (the others wait for
    it to be gone before they leave), the others' errors name it, and no process is left."""
    script = HERE / "torchrun_faults.py"
    p, elapsed = torchrun(script, case, 1, nproc=3)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert not re.search(r"rank [02] returned", out), out[-3000:]
    assert named in out, out[-3000:]
    assert _root_cause(out) == "1", out[-3000:]
    if case == "return_before_first":  # rank 1 heard that the others failed waiting for it
        assert "shmap: rank 1 finished its program" in out and "because this rank ended early" in out
    assert not _alive(script, case), _alive(script, case)
    # What bounds the job is shmap's detection (the rest is starting 3 Pythons with torch on 2 cores).
    assert elapsed < 60, f"{elapsed:.0f} s"


# -- shmap.spawn, the local launcher -------------------------------------------

sys.path.insert(0, str(HERE))
import dist_cases  # noqa: E402
import shmap  # noqa: E402


def test_spawn_returns_each_ranks_result_in_rank_order():
    assert shmap.spawn(dist_cases.rank, nprocs=3, timeout=30) == [0, 1, 2]
    assert shmap.spawn(dist_cases.world, nprocs=2, timeout=30) == [2, 2]


def test_spawn_env_and_the_callers_shmap_variables_reach_the_guard(monkeypatch):
    """The ranks are forked from a server that imported shmap (and read SHMAP_* options) at its start:
    `env`, and this process's SHMAP_* variables as they are at the call, must still set the options."""
    got = shmap.spawn(dist_cases.guard_settings, nprocs=2, timeout=30,
                      env={"SHMAP_CHECK_COLLECTIVES": "strict", "SHMAP_BUCKET_BYTES": "1024"})
    assert [(s["check_collectives"], s["bucket_bytes"]) for s in got] == [("strict", 1024)] * 2
    monkeypatch.setenv("SHMAP_COLLECTIVE_TIMEOUT", "7.5")  # set after the server started (the call above)
    got = shmap.spawn(dist_cases.guard_settings, nprocs=2, timeout=30, env={"SHMAP_CHECK_COLLECTIVES": "0"})
    assert [(s["check_collectives"], s["timeout"], s["bucket_bytes"]) for s in got] == [(False, 7.5, 25 << 20)] * 2


def test_spawn_reports_every_failed_rank():
    with pytest.raises(shmap.SpawnError) as info:
        shmap.spawn(dist_cases.fail_on_odd_ranks, nprocs=4, timeout=30)
    err = info.value
    assert sorted(err.errors) == [1, 3] and sorted(err.results) == [0, 2]
    assert "2 of 4 ranks failed" in str(err) and "rank 1: KeyError" in str(err)
    assert "fail_on_odd_ranks" in str(err)  # the root cause's traceback


@pytest.mark.parametrize("kw, match", [
    ({"nprocs": 0}, "nprocs must be a positive int"), ({"nprocs": -1}, "nprocs must be a positive int"),
    ({"nprocs": "2"}, "nprocs must be a positive int"), ({"timeout": 0}, "timeout must be a finite number"),
    ({"timeout": float("nan")}, "timeout must be"), ({"grace": -1}, "grace must be a finite number of seconds >= 0"),
    ({"env": ["A"]}, "env must be a dict"), ({"backend": 3}, "backend must be a torch.distributed backend name"),
])
def test_spawn_checks_its_arguments_before_starting_anything(kw, match):
    """nprocs=-1 returned [] and 0 raised TCPStore's error; the others failed in the ranks or in torch."""
    with pytest.raises(ValueError, match=match):
        shmap.spawn(dist_cases.rank, **{"nprocs": 2, **kw})


def test_spawn_names_a_set_up_failure_and_an_unpicklable_function():
    """A rank that fails setting up the world (an unknown backend) was 'exited with code 1 without a result'."""
    with pytest.raises(shmap.SpawnError, match=r"rank 0: AssertionError: setting up the process group "
                                               r"\(backend='nope'\): Unknown backend type nope"):
        shmap.spawn(dist_cases.rank, nprocs=2, backend="nope", timeout=30)
    with pytest.raises(TypeError, match=r"fn and args must be picklable .* module level"):
        shmap.spawn(lambda: 0, nprocs=2)


def test_make_mesh_distributed_needs_an_initialised_world():
    with pytest.raises(RuntimeError, match="torchrun"):
        shmap.make_mesh((2,), ("i",), distributed=True)


def test_configure_distributed_validates_and_returns_the_previous_settings():
    prev = shmap.configure_distributed(timeout=12.5)
    try:
        assert shmap.configure_distributed()["timeout"] == 12.5
        for bad in (0, float("nan"), "5", True):
            with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
                shmap.configure_distributed(timeout=bad)
        with pytest.raises(ValueError, match="transport"):  # checked before anything is set
            shmap.configure_distributed(transport="bogus", bucket_bytes=7)
        assert shmap.configure_distributed()["bucket_bytes"] != 7
        assert shmap.configure_distributed(check_collectives="strict")["check_collectives"] is True  # default
        assert shmap.configure_distributed(check_collectives=False)["check_collectives"] == "strict"
        with pytest.raises(ValueError, match="check_collectives"):
            shmap.configure_distributed(check_collectives="sometimes")
        # Defaults: 25 MiB buckets (DDP's); a backward pass's first one by transport ('auto': DDP's
        # 1 MiB on NCCL, on gloo no smaller than the rest)
        got = shmap.configure_distributed(bucket_bytes=4096, first_bucket_bytes=1024)
        assert (got["bucket_bytes"], got["first_bucket_bytes"]) == (25 << 20, "auto")
        assert shmap.configure_distributed(first_bucket_bytes="auto")["first_bucket_bytes"] == 1024
        from types import SimpleNamespace

        from shmap.backends.deferred import first_bucket_bytes
        assert first_bucket_bytes(SimpleNamespace(gloo=True)) is None
        assert first_bucket_bytes(SimpleNamespace(gloo=False)) == 1 << 20
        shmap.configure_distributed(first_bucket_bytes=4096)  # a setting holds on every transport
        assert first_bucket_bytes(SimpleNamespace(gloo=True)) == first_bucket_bytes(SimpleNamespace(gloo=False)) == 4096
        for bad in (0, -1, 1.5, True, "1MiB"):
            with pytest.raises(ValueError, match=r"first_bucket_bytes must be a positive int.*Fix"):
                shmap.configure_distributed(first_bucket_bytes=bad)
    finally:
        from shmap.backends import watchdog
        watchdog._OPTIONS.update(prev)


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """Each rank imports the calling script first (multiprocessing's start), whose top level then calls
    spawn again: every rank was 'exited with code 1 without a result', the cause only in stderr."""
    script = tmp_path / "no_guard.py"
    script.write_text("import os\nimport shmap\n\ndef f():\n    return os.getpid()\n\n"
                      "shmap.spawn(f, nprocs=2, timeout=30)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "the calling script may lack an `if __name__ == '__main__':` guard" in p.stderr, p.stderr[-3000:]
