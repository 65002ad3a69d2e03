"""The collectives' registered type rules predict the distributed mesh's results (4 gloo processes),
as test_collectives checks for the simulated mesh; see rule_cases.py."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dist_rules  # noqa: E402
import shmap  # noqa: E402

pytestmark = pytest.mark.xdist_group("multiprocess")


def test_rules_predict_the_distributed_results():
    results = shmap.spawn(dist_rules.run, nprocs=4, timeout=90)
    assert results[0] == [], "\n".join(results[0])
    assert all(r == results[0] for r in results)
