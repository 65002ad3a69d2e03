"""The simulated mesh's programs run unchanged on 4 gloo processes, with the same results.

Every rank runs each program on a simulated mesh and on the distributed mesh
and compares outputs, gradients (second order for some hand-written cases),
the collectives `comm_log` records forward and backward, and the output
DTensors' placements.  Programs: the hand-written ones in dist_cases.HAND
(every collective, axis tuples in both orders, lifts, check_vma=False) and a
derandomized sample of tests/programs.py's generated ones on 4-device meshes.
One world of processes runs them all, to keep the suite fast.
"""
from __future__ import annotations

import math
import os
import sys

from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dist_cases  # noqa: E402
import programs as pg  # noqa: E402
import shmap  # noqa: E402
import pytest

# Multi-process tests share one xdist worker: they compete for ports and both cores.
pytestmark = pytest.mark.xdist_group("multiprocess")

WORLD = 4


def sample_programs(n, **kw):
    """`n` derandomized generated programs whose mesh has exactly WORLD devices."""
    found = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(program=pg.programs(jax_compatible=False, **kw).filter(lambda p: math.prod(p.mesh_shape) == WORLD),
           seed=st.integers(0, 2**16))
    def collect(program, seed):
        found.append((program, seed))

    collect()
    return found


def test_hand_written_programs_match_simulated():
    results = shmap.spawn(dist_cases.run_hand_cases, nprocs=WORLD, timeout=60)
    assert results[0] == [], "\n\n".join(results[0])
    assert all(r == results[0] for r in results)


def test_hand_written_programs_match_simulated_over_the_shared_memory_transport():
    """shmap.kernels' shared-memory runtime as the CPU transport of the distributed mesh."""
    results = shmap.spawn(dist_cases.run_hand_cases_over_shm, nprocs=WORLD, timeout=90)
    assert results[0] == [], "\n\n".join(results[0])
    assert all(r == results[0] for r in results)


def test_generated_programs_match_simulated():
    cases = []
    for op in pg.COLLECTIVES + ("add_index",):
        cases += sample_programs(3, focus=op, max_steps=4)
    cases += sample_programs(20, max_steps=6)
    assert len(cases) >= 45
    shapes = {p.mesh_shape for p, _ in cases}
    assert len(shapes) >= 2, f"only meshes {shapes}"
    results = shmap.spawn(dist_cases.run_programs, cases, nprocs=WORLD, timeout=60)
    assert results[0] == [], "\n\n".join(results[0][:5])
    assert all(r == results[0] for r in results)


def test_sharded_plain_input_gets_its_whole_gradient_on_every_rank():
    results = shmap.spawn(dist_cases.grad_of_global_input, nprocs=WORLD, timeout=60)
    for grad, n in results:
        assert grad == [2.0 * k for k in range(8)] and n == WORLD
