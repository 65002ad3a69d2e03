"""Custom autograd Functions, checkpointing and torch.func transforms in bodies on 4 gloo processes,
equal to the simulated mesh (values, gradients, comm_log); transforms from outside too (plain tensors in and out);
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


def test_torch_func_of_a_shard_mapped_function_from_outside_matches_simulated():
    """grad, vjp, jvp, vmap, jacrev, jacfwd, hessian, vmap of grad and a closure's grad of a
    shard_mapped function: plain-tensor results equal to the simulated mesh's, same comm_log."""
    results = shmap.spawn(dist_interop.outside_transforms, nprocs=4, timeout=120)
    assert results[0] == [], "\n".join(results[0])
    assert all(r == [] for r in results)


def test_dtensor_argument_under_a_transform_from_outside_raises_with_the_fix():
    msg = shmap.spawn(dist_interop.dtensor_under_outside_transform, nprocs=4, timeout=90)[0]
    assert msg.startswith("TransformError: shard_map: a DTensor argument (in_spec P('i'))"), msg
    assert "Fix: pass the global value as a plain tensor" in msg, msg


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


def test_writing_shared_state_from_varying_values_is_refused_on_both_meshes():
    """Training-mode BatchNorm, InstanceNorm with running statistics, Embedding(max_norm): each process
    wrote its own copy of the module's state (the simulated mesh refused); both now refuse, naming the
    op, the tensor's shape and the fix, before writing anything."""
    results = shmap.spawn(dist_interop.shared_state_writes, nprocs=2, timeout=90)
    assert results[0] == results[1]
    for name, (dist, sim, unchanged) in results[0].items():
        assert dist == sim, (name, dist, sim)
        assert "that is the same on every device" in dist and "Fix: " in dist, (name, dist)
        assert unchanged, name
    # The fix it names: statistics of each device's own, a copy made in the body, returned.
    assert shmap.spawn(dist_interop.own_running_statistics, nprocs=2, timeout=90) == [(True, True)] * 2


def test_a_closure_without_checks_gets_its_psummed_gradient_on_processes():
    """check_vma=False: a closed-over tensor is an unmapped argument (as JAX passes it), so its cotangent is
    psum'd on every rank; each rank kept only its own share (4x too small on 4 processes)."""
    for rank in shmap.spawn(dist_interop.closure_without_checks, nprocs=4, timeout=90):
        for name, equal, dist_log, sim_log in rank:
            assert equal, name
            assert dist_log == sim_log and dist_log.get("psum", 0) >= 1, (name, dist_log, sim_log)


def test_manual_sgd_in_a_body_trains_on_the_updated_weight_on_both_meshes():
    import torch
    torch.manual_seed(0)
    s, x = torch.ones(3, dtype=torch.float32), torch.randn(8, 3, dtype=torch.float64)
    p, want = s.clone().requires_grad_(), []
    for _ in range(3):
        p.grad = None
        loss = ((x * p) ** 2).sum(1).mean()
        loss.backward()
        p.data.add_(p.grad, alpha=-0.1)
        want.append(loss.item())
    for dist_losses, sim_losses in shmap.spawn(dist_interop.manual_sgd_in_a_body, nprocs=2, timeout=90):
        # (float32 weight: its gradient is rounded once on shmap's meshes, per op in plain torch)
        assert dist_losses == pytest.approx(want, rel=1e-6) and sim_losses == pytest.approx(want, rel=1e-6)


def test_in_place_updates_of_shared_values_match_simulated():
    """A pvary result written in place wrote its input on processes (the simulated mesh copied it), a
    write through a view of one was lost on the simulated mesh (applied on processes): both meshes now
    copy on the first write and refuse what a view cannot follow (cow_cases.py, test_cow.py)."""
    import cow_cases

    results = shmap.spawn(cow_cases.on_processes, nprocs=2, timeout=90)
    sim = cow_cases.run(shmap.make_mesh((2,), ("i",)))
    for r, got in enumerate(results):
        assert got == sim, f"rank {r}: " + str({k: (got[k], sim[k]) for k in sim if got.get(k) != sim[k]})
