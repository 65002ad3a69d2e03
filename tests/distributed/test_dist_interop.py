"""Custom autograd Functions, checkpointing and torch.func transforms in bodies on 4 gloo processes,
equal to the simulated mesh (values, gradients, comm_log); transforms from outside raise with the fix;
see dist_interop.py."""
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


def test_torch_func_of_a_shard_mapped_function_from_outside_raises_with_the_fix():
    errors = shmap.spawn(dist_interop.outside_transforms, nprocs=4, timeout=90)[0]
    for name, what in (("grad", "torch.func.grad"), ("vmap", "torch.vmap"), ("jvp", "torch.func.jvp"),
                       ("grad (closure)", "torch.func.grad")):
        msg = errors[name]
        assert msg.startswith("TransformError: " + what), msg
        assert "outputs are DTensors" in msg and "Fix: apply the transform inside the body" in msg, msg


def test_vmap_of_a_collective_is_one_collective_reported_once_per_example_shape():
    calls, log = shmap.spawn(dist_interop.vmap_collective_count, nprocs=4, timeout=90)[0]
    assert calls == [(2, 6)]  # the whole batch (6 examples of [2]) in one all_reduce
    assert log == [("psum", (2,))]  # as the simulated mesh reports it


def test_reentrant_checkpoint_matches_simulated():
    """The reentrant form recomputes its region (psum included) in `.backward()`: same gradients and
    comm_log (forward psum, recomputed psum, transpose) on both meshes."""
    for same, dist_log, sim_log in shmap.spawn(dist_interop.reentrant_checkpoint, nprocs=2, timeout=90):
        assert same
        assert dist_log == sim_log and [k for k, _ in dist_log] == ["psum", "psum", "psum"], dist_log
