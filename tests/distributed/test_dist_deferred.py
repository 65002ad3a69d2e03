"""Deferred, bucketed gradient reductions (shmap/backends/deferred.py) on 2 and 4 gloo processes:
the simulated mesh's gradients, fewer all_reduces than psums, overlap with the backward pass,
ordinary tensors handed back; see dist_deferred.py."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dist_deferred  # noqa: E402
import shmap  # noqa: E402

pytestmark = pytest.mark.xdist_group("multiprocess")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_deferred_bucketed_reductions(nprocs):
    results = shmap.spawn(dist_deferred.run_cases, nprocs=nprocs, timeout=90)
    assert results[0] == [], "\n".join(results[0])
    assert all(r == results[0] for r in results)


def test_a_dp_training_step_reduces_every_gradient_in_one_bucket():
    """The recipe's data=2 step on 2 processes: the loss's psum, then one all_reduce for every gradient
    (the tiny model fits the first bucket).  Nothing in the backward pass may read a gradient's psum
    before the pass ends: a read launches its bucket early, and the rest goes in another one."""
    results = shmap.spawn(dist_deferred.recipe_dp_step_collectives, "data=2", nprocs=2, timeout=90)
    assert results[0] == results[1]
    loss_psum, *buckets = results[0]
    assert loss_psum == 1 + 32  # one element, and the signature trailer
    assert len(buckets) == 1, f"gradient all_reduces of {buckets} elements: expected one bucket"
