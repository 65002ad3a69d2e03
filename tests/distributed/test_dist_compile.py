"""torch.compile of shard_mapped functions and training steps on 2 gloo processes (dist_compile.py).

Compiled equals eager: values and gradients bit for bit, and the comm_log
events of every call; the graphs contain torch's functional collectives and
shmap's guard ops.  A rank that never arrives at a compiled collective is
named by the others (the watched wait runs inside the graph), and the
training recipe's `--compile` gives the eager losses on the distributed mesh.
The recipe case compiles with AOT autograd and eager kernels (Inductor on
the same recipe takes minutes on two cores; the `inductor` case covers the
Inductor lowering of the collectives and the guard ops).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dist_compile  # noqa: E402
import shmap  # noqa: E402

pytestmark = pytest.mark.xdist_group("multiprocess")


def test_compiled_collectives_training_steps_and_the_recipe_equal_eager():
    results = shmap.spawn(dist_compile.run_cases, nprocs=2, timeout=120)
    assert results[0] == [], "\n\n".join(results[0])
    assert results[1] == [], "\n\n".join(results[1])


def test_a_rank_that_never_arrives_at_a_compiled_collective_is_named():
    dist_compile.expect_stalled_rank_named(dist_compile.hang)


def test_a_compiled_gather_checked_alongside_its_data_reports_a_mismatch():
    """A payload with no room for its signature is checked by an exchange running alongside the data,
    compiled as eagerly (no round trip before the data moves); a mismatch is still named on every rank."""
    msgs = shmap.spawn(dist_compile.alongside_mismatch, nprocs=2, timeout=120)
    for msg in msgs:
        assert "signature exchange alongside it" in msg, msg
        assert "axis=0" in msg and "axis=1" in msg and "all_gather over 'i'" in msg, msg
