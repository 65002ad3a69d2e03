"""shmap.jit on 2 (and 4) gloo processes (dist_jit.py): a captured call equals the eager one.

Values and gradients (bit for bit with the eager backend), DTensor arguments
and their gradients' layouts, the `comm_log` events of the capture and of
every replay, a training step in the recipe's shape (dicts of DTensor
parameters, gradients taken outside the call, an update with tensor scalars),
and a pmap over the world.  A call jit could not capture (run eagerly, with a
warning) fails.  The guard runs inside every replay: its all_reduce and
all_gather waits on the calling thread (as eagerly), a rank that never
arrives at a replayed collective is named by the others, and programs that
differ by rank are reported.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dist_compile  # noqa: E402
import dist_jit  # noqa: E402
import shmap  # noqa: E402

pytestmark = pytest.mark.xdist_group("multiprocess")


def test_jitted_collectives_dtensor_gradients_and_a_training_step_equal_eager():
    results = shmap.spawn(dist_jit.run_cases, nprocs=2, timeout=300)
    assert results[0] == [], "\n\n".join(results[0])
    assert results[1] == [], "\n\n".join(results[1])


def test_a_rank_running_eagerly_beside_replays_on_four_processes():
    """`dist_jit.one_rank_eager` on 4 processes (run_cases runs it on 2): the small psums are gathered
    reductions there, eager and in the graph alike."""
    results = shmap.spawn(_warned(dist_jit.one_rank_eager), nprocs=4, timeout=300)
    for r, bad in enumerate(results):
        assert bad == [], f"rank {r}:\n" + "\n\n".join(bad)


def _warned(case):
    """`case` with jit's 'could not capture' warnings as failures (an eager call must not pass as a replay)."""
    import functools

    return functools.partial(_run_warned, case)


def _run_warned(case):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = case()
    return bad + [str(w.message) for w in caught if "could not capture" in str(w.message)]


def test_a_capture_that_failed_after_communicating_raises_instead_of_running_eagerly():
    with pytest.raises(shmap.SpawnError) as e:
        shmap.spawn(dist_jit.peer_fails_during_capture, nprocs=2, timeout=60, grace=120)  # (rank 0 reports)
    assert "rank 1 fails before the call" in str(e.value)
    error, warned, runs = e.value.results[0]
    assert error == "RankFailedError" and not warned and runs == 0, (error, warned, runs)


def test_a_rank_that_never_arrives_at_a_replayed_collective_is_named():
    dist_compile.expect_stalled_rank_named(dist_jit.hang)


def test_jitted_programs_that_differ_by_rank_are_reported_on_every_rank():
    msgs = shmap.spawn(dist_jit.mismatch, nprocs=2, timeout=120)
    for msg in msgs:
        assert "psum over 'i'" in msg and "pmax over 'i'" in msg, msg
