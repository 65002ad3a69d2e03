"""Faults on a distributed mesh end every rank with an error that names the culprit, never a hang.

Each test runs a 4-process world whose program goes wrong on one rank and
checks what every rank reports and that the whole run ends in bounded time
(`shmap.spawn` also guarantees no process outlives it).
"""
from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_faults  # noqa: E402
import shmap  # noqa: E402

# Multi-process tests share one xdist worker: they compete for ports and both cores.
pytestmark = pytest.mark.xdist_group("multiprocess")

BOUND = 60  # seconds: every rank must have failed by then


def run_failing(fn, *args, grace=10.0):
    t0 = time.monotonic()
    with pytest.raises(shmap.SpawnError) as info:
        shmap.spawn(fn, *args, nprocs=4, timeout=30, grace=grace)
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND, f"took {elapsed:.1f} s"
    return info.value


@pytest.mark.parametrize("fn", [dist_faults.raise_in_body, dist_faults.raise_in_backward])
def test_an_exception_on_one_rank_fails_every_rank_naming_it(fn):
    err = run_failing(fn, 2)
    assert set(err.errors) == {0, 1, 2, 3}, err
    name, msg, _ = err.errors[2]
    assert name in ("ValueError", "RuntimeError") and "on purpose" in msg
    for r in (0, 1, 3):
        name, msg, _ = err.errors[r]
        assert name == "RankFailedError", (r, name, msg)
        assert "rank 2 failed" in msg and "on purpose" in msg, msg
    # The summary puts the root cause first.
    assert str(err).splitlines()[1].startswith("  rank 2:")


def test_mismatched_programs_are_reported_on_every_rank_and_the_world_survives():
    results = shmap.spawn(dist_faults.mismatches, nprocs=4, timeout=30)
    for rank, seen in enumerate(results):
        msgs = dict(seen)
        assert "NOT RAISED" not in msgs.values(), (rank, seen)
        m = msgs["different collectives"]
        assert "rank 1: collective" in m and "all_gather over 'i'" in m, m
        assert "ranks 0, 2, 3: collective" in m and "psum over 'i'" in m, m
        assert "dist_faults.py:" in m  # where each rank called it
        m = msgs["collective skipped on one rank"]
        assert "rank 3: collective" in m and "end of shard_map body" in m and "psum over 'i'" in m, m
        m = msgs["different shapes"]
        assert "float32[1]" in m and "float32[2]" in m, m
        m = msgs["different permutations"]
        assert "rank 2: collective" in m and "perm=[(0, 1), (1, 0)]" in m, m


def test_a_rank_that_never_arrives_times_out_the_others_naming_it():
    err = run_failing(dist_faults.hang, 1, 3.0, grace=3.0)
    assert err.errors[1][0] == "Killed"
    for r in (0, 2, 3):
        name, msg, _ = err.errors[r]
        # Each waiting rank times out itself, or first hears of another that did.
        assert name in ("CollectiveTimeoutError", "RankFailedError"), (r, name, msg)
        assert "rank 1: not waiting in any collective" in msg, msg
        assert "psum over 'i'" in msg


def test_without_signature_checks_a_rank_that_skipped_a_collective_is_named():
    err = run_failing(dist_faults.skip_unchecked, 3)
    assert 3 not in err.errors  # it thinks it finished fine
    for r in (0, 1, 2):
        name, msg, _ = err.errors[r]
        assert name == "RankFailedError", (r, name, msg)
        assert "rank 3" in msg and "finished its program" in msg, msg
