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
