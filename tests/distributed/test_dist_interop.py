"""Custom autograd Functions and checkpointing in bodies on 4 gloo processes, equal to the
simulated mesh (values, gradients, comm_log); see dist_interop.py."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dist_interop  # noqa: E402
import shmap  # noqa: E402

pytestmark = pytest.mark.xdist_group("multiprocess")


def test_interop_cases_match_simulated():
    results = shmap.spawn(dist_interop.run_cases, nprocs=4, timeout=90)
    assert results[0] == [], "\n\n".join(results[0])
    assert all(r == results[0] for r in results)
