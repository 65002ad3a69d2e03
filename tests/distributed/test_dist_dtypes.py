"""The meshes agree for every dtype: each collective x {int8, int16, int32, int64, bool, bfloat16,
float16, complex64} gives the same dtype, the same bits and the same comm_log on 4 gloo processes
(and over the shared-memory transport) as on the simulated mesh, which tests/test_dtypes.py ties
to JAX.  Errors (complex pmax, in-place updates of inputs) read the same on both meshes, and an
output spec unreduced along an axis the value varies on returns a Partial DTensor, as JAX.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_dtypes  # noqa: E402
import shmap  # noqa: E402

# Multi-process tests share one xdist worker: they compete for ports and both cores.
pytestmark = pytest.mark.xdist_group("multiprocess")


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_every_collective_and_dtype_matches_the_simulated_mesh(transport):
    results = shmap.spawn(dist_dtypes.every_collective_every_dtype, transport, nprocs=4, timeout=60)
    assert results[0] == [], "\n".join(results[0])
    assert all(r == results[0] for r in results)


def test_small_floating_sums_equal_the_simulated_meshs_bits_on_4_ranks():
    """Also the gradient of a replicated weight used with data of a wider dtype (`_mixed_dtype_gradients`)."""
    results = shmap.spawn(dist_dtypes.rounding_sums, nprocs=4, timeout=60)
    assert results[0] == [], "\n".join(results[0])


def test_errors_and_implicit_unreduced_output_match():
    results = shmap.spawn(dist_dtypes.errors_and_unreduced, nprocs=4, timeout=60)
    for r, bad in enumerate(results):
        assert bad == [], f"rank {r}:\n" + "\n".join(bad)


def test_the_short_ways_of_psum_and_all_gather_give_what_the_general_path_gives():
    """`backends/quick.py`: values, dtypes, comm_log and the collective count, call by call."""
    results = shmap.spawn(dist_dtypes.quick_and_general_collectives, nprocs=4, timeout=120)
    for r, bad in enumerate(results):
        assert bad == [], f"rank {r}:\n" + "\n".join(bad)
