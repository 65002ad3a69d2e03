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

BOUND = 30  # seconds: every rank must have failed by then


def run_failing(fn, *args, grace=10.0, nprocs=4):
    t0 = time.monotonic()
    with pytest.raises(shmap.SpawnError) as info:
        shmap.spawn(fn, *args, nprocs=nprocs, timeout=30, grace=grace)
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


@pytest.mark.parametrize("fn, what", [(dist_faults.hang, "psum over 'i'"),
                                      (dist_faults.hang_in_psum_scatter, "psum_scatter over 'i'")])
def test_a_rank_that_never_arrives_times_out_the_others_naming_it(fn, what):
    err = run_failing(fn, 1, 3.0, grace=3.0)
    assert err.errors[1][0] == "Killed"
    for r in (0, 2, 3):
        name, msg, _ = err.errors[r]
        # Each waiting rank times out itself, or first hears of another that did.
        assert name in ("CollectiveTimeoutError", "RankFailedError"), (r, name, msg)
        assert "rank 1: not waiting in any collective" in msg, msg
        assert what in msg, msg


def test_without_signature_checks_a_rank_that_skipped_a_collective_is_named():
    err = run_failing(dist_faults.skip_unchecked, 3)
    assert 3 not in err.errors  # it thinks it finished fine
    for r in (0, 1, 2):
        name, msg, _ = err.errors[r]
        assert name == "RankFailedError", (r, name, msg)
        assert "rank 3" in msg and "finished its program" in msg, msg


# -- fault injection with the default checks: every rank ends non-zero, the culprit named -------------
def _others(err, culprit, nprocs=4, aborted=False):
    for r in range(nprocs):
        if r != culprit:
            name, msg, _ = err.errors[r]
            if aborted and name == "ProcessDied" and "-6" in msg:  # gloo aborted it (data bigger than expected)
                continue
            assert name in ("RankFailedError", "CollectiveMismatchError", "CollectiveTimeoutError"), (r, name, msg)
            yield r, msg


def test_every_collective_passes_the_default_checks_forward_and_backward():
    results = shmap.spawn(dist_faults.all_collectives_pass, nprocs=4, timeout=30)
    assert len({repr(r) for r in results}) == 1, results


def test_a_sigkilled_rank_is_named_by_every_other_rank():
    err = run_failing(dist_faults.sigkill_in_body, 2)
    assert err.errors[2][0] == "ProcessDied" and "-9" in err.errors[2][1]
    for r, msg in _others(err, 2):
        assert "rank 2 stopped answering" in msg, msg


@pytest.mark.parametrize("fn", [dist_faults.return_before_first, dist_faults.return_between])
def test_a_rank_that_returns_early_is_named_and_spawn_says_so(fn):
    err = run_failing(fn, 1, nprocs=3)
    assert err.results == {1: "returned early"}
    for r, msg in _others(err, 1, 3):
        assert "rank 1" in msg and "finished the program" in msg, msg
    assert "rank 1: returned early" in str(err), str(err)


def test_shutdown_distributed_after_the_program_destroys_the_process_group_on_every_rank():
    for left, value in shmap.spawn(dist_faults.shut_down_together, nprocs=3, timeout=60):
        assert left is False and value == [3.0, 3.0]


def test_a_rank_that_shuts_down_early_is_named_and_ends_non_zero():
    """`shutdown_distributed` runs the exit protocol first: the others hear the rank finished (not just
    that its connection closed), and it hears that they failed because of it, so it ends with status 1."""
    err = run_failing(dist_faults.shut_down_early, 1, nprocs=3)
    assert 1 not in err.results, err  # it never got to return its value
    assert err.errors[1][0] == "ProcessDied" and "1" in err.errors[1][1], err.errors[1]
    for r, msg in _others(err, 1, 3):
        assert "rank 1" in msg and "finished the program" in msg, msg


@pytest.mark.parametrize("fn, how", [(dist_faults.other_collective, "all_gather over 'i'"),
                                     (dist_faults.other_shape, "float32[1]"),
                                     (dist_faults.other_shape_bigger, "float32[4]"),
                                     (dist_faults.skipped_same_shape, "after 1 shard_map bodies")])
def test_a_rank_that_calls_another_collective_or_shape_is_named(fn, how):
    err = run_failing(fn, 2)
    assert set(err.errors) == {0, 1, 2, 3}
    mismatch = [m for _, (name, m, _) in err.errors.items() if name == "CollectiveMismatchError"]
    assert mismatch, err
    for m in mismatch:
        assert "ranks 0, 1, 3: collective #" in m and "rank 2: collective #" in m, m
        assert how in m, m
    for r, msg in _others(err, 2, aborted=fn is dist_faults.other_shape_bigger):
        assert "rank 2" in msg, msg


def test_a_late_receiver_does_not_hang_a_ppermute():
    """gloo abandons a send whose wait times out; the watched wait's slices must not do that (they
    did: a loaded machine hung a ppermute until the timeout)."""
    results = shmap.spawn(dist_faults.slow_receiver, nprocs=2, timeout=60)
    per = 200_000
    for firsts in results:  # block 0 comes from the last rank: its first element is (n - 1) * per + k
        assert firsts == [float(per + k) for k in range(3)], firsts


def test_a_rank_gloo_aborts_is_reported_with_the_likely_cause():
    """No rank can name this mismatch (the receiver dies in gloo, the sender has nothing to wait for):
    spawn says how the receiver ended and what gloo's abort usually means."""
    err = run_failing(dist_faults.ppermute_bigger_sender, nprocs=2)
    name, msg, _ = err.errors[0]
    assert name == "ProcessDied" and "SIGABRT" in msg and "different shapes" in msg, err


@pytest.mark.parametrize("checks", [True, False])
def test_a_peer_that_fails_is_reported_to_a_rank_waiting_in_the_shm_transport(checks):
    """The shared-memory transport's kernels wait under the guard too: rank 0 learns within a poll
    interval that rank 1 failed (it waited for the transport's 60 s before: `run_failing` bounds the run
    at 30), with checks on (the signature in the payload, no exchange before the kernel) and off."""
    err = run_failing(dist_faults.shm_peer_raises, checks, nprocs=2)
    name, msg, _ = err.errors[0]
    assert name == "RankFailedError" and "rank 1 failed" in msg and "on purpose" in msg, err


@pytest.mark.parametrize("checks", [True, False])
def test_a_sigkilled_peer_is_named_by_a_rank_waiting_in_the_shm_transport(checks):
    """No report and no connection to close: the guard sees the peer's process gone (same host) within a
    poll interval; before, rank 0 waited until spawn killed it, 10 s after the first failure."""
    err = run_failing(dist_faults.shm_peer_killed, checks, nprocs=2)
    assert err.errors[1][0] == "ProcessDied" and "-9" in err.errors[1][1], err
    name, msg, _ = err.errors[0]
    assert name == "RankFailedError" and "rank 1 stopped answering" in msg and "collective #" in msg, err


def test_the_shm_transport_waits_take_the_configured_timeout():
    err = run_failing(dist_faults.shm_peer_stalls, nprocs=2)
    name, msg, _ = err.errors[0]
    assert name == "CollectiveTimeoutError" and "rank 1" in msg, err


@pytest.mark.parametrize("kind, words", [("shape", ["float32[4]", "float32[8]"]),
                                         ("kind", ["psum over 'i'", "all_gather over 'i'"])])
def test_a_mismatch_on_the_shm_transport_is_named_on_every_rank(kind, words):
    """With checks on the shared-memory transport carries psum's and all_gather's signatures in the
    payload, as gloo does: a rank calling another shape or collective is named, not waited for.  (Another
    collective moves a payload of another size, so each rank finds it once its wait stalls, 1 to 7 s on an
    idle machine; on a loaded one the second rank took over the 10 s grace: 20 s, still within BOUND.)"""
    err = run_failing(dist_faults.shm_mismatch, kind, nprocs=2, grace=20.0)
    assert set(err.errors) == {0, 1}, err
    for name, msg, _ in err.errors.values():
        assert name == "CollectiveMismatchError" and all(w in msg for w in words), msg


@pytest.mark.parametrize("fn, words", [
    (dist_faults.different_meshes, ["rank 0: mesh (2,) ('i',) on cpu", "rank 1: mesh (1, 2) ('a', 'i') on cpu"]),
    (dist_faults.different_settings, ["'check_collectives': True", "'check_collectives': False"]),
])
def test_ranks_that_build_different_meshes_or_settings_are_told_at_make_mesh(fn, words):
    """They waited in DeviceMesh's group creation for the store's timeout (30 min under torchrun), or gloo
    aborted one; now every rank raises at make_mesh, naming each rank's mesh."""
    err = run_failing(fn, 1, nprocs=2)
    assert len(err.errors) == 2, err
    for name, msg, _ in err.errors.values():
        assert name == "ValueError" and "make_mesh: the ranks build different distributed meshes" in msg, msg
        assert all(w in msg for w in words), msg


def test_a_culprit_outside_shmaps_collectives_is_named_first():
    """A peer that raised or returned while the others waited in DTensor's own collective: the victims'
    gloo errors came first in spawn's summary (with their traceback), and a returned rank was not named."""
    err = run_failing(dist_faults.leave_before_full_tensor, 1, "raise", nprocs=2)  # (as a return: see below)
    first = str(err).splitlines()[1]
    assert first.startswith("  rank 1: ValueError: raised before full_tensor on purpose"), str(err)
    assert "traceback of rank 1:" in str(err)


def test_a_rank_that_returned_while_others_lost_their_connection_is_named():
    """(spawn's summary of such a run: the returned rank was not mentioned.  The run itself waits for the
    process group's timeout when the returned rank's process stays up: here its summary alone.)"""
    from shmap.launch import _summary

    gone = ("RuntimeError", "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242.", "tb0")
    text = _summary({0: gone}, 2, results={1: "left"})
    assert "rank 1: returned while others were in a collective with it (gloo: its connection closed)" in text
    assert "rank 1:" not in _summary({0: ("ValueError", "bad", "tb")}, 2, results={1: "left"})


def test_the_rank_that_runs_an_extra_collective_is_named_not_the_majority():
    err = run_failing(dist_faults.extra_shard_map, 1, nprocs=3)
    name, msg, _ = err.errors[1]
    assert name == "RankFailedError" and "Rank 1 is the odd one out: 2 of the 3 ranks of its group finished " \
        "together after collective #1, and this rank went on to #2" in msg, msg
    assert "rank 0: returned after its program's last collective, while rank 1 went on to another" in str(err)
    assert "returned early: the others" not in str(err)  # (spawn's label for a rank that skipped collectives)
