"""Deferred, bucketed gradient reductions (shmap/backends/deferred.py) on 2 and 4 gloo processes:
the simulated mesh's gradients, fewer all_reduces than psums, overlap with the backward pass,
ordinary tensors handed back; see dist_deferred.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch

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


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_loss_psum_is_read_where_the_caller_reads_it(nprocs):
    results = shmap.spawn(dist_deferred.forward_psum_in_flight, nprocs=nprocs, timeout=90)
    assert results[0] == [], "\n".join(results[0])
    assert all(r == results[0] for r in results)


def test_a_dp_training_step_reduces_every_gradient_in_one_bucket():
    """The recipe's data=2 step on 2 processes: the loss's psum, then one all_reduce for every gradient
    (the tiny model fits the first bucket).  Nothing in the backward pass may read a gradient's psum
    before the pass ends: a read launches its bucket early, and the rest goes in another one."""
    results = shmap.spawn(dist_deferred.recipe_step_collectives, ["data=2"], nprocs=2, timeout=90)
    assert results[0] == results[1]
    loss_psum, *buckets = results[0]["data=2"]
    assert loss_psum == ("psum", "all_reduce", 1 + 32)  # one element, and the signature trailer
    assert [kind for kind, _, _ in buckets] == ["psum"], f"gradient reductions {buckets}: expected one bucket"


L = 2  # layers of the tiny model
#: reductions one recipe step puts on the wire on 4 processes (gloo all_reduces, or, small, all_gathers
#: reduced on each rank): the program's synchronous psums, plus one per bucket of gradient reductions
#: (one per group: the tiny model fits a first bucket)
STEP_REDUCTIONS = {
    "data=4": 1 + 1,                    # the loss's pmean; the gradients
    "tensor=4": 2 * L + 2 * L + 1,      # row-parallel psums, their backward partners; the norm's psum
    "data=2,tensor=2": 1 + 2 * L + 2 * L + 1 + 1,  # + the data gradients' bucket; the norm's psum
    "fsdp=2,tensor=2": 1 + 2 * L + 2 * L + 2,  # the norm's psums over {fsdp, tensor} and over fsdp (the
}                                              # norm scales' gradients ride the reduce-scatter)


def test_training_steps_put_each_meshs_collectives_on_the_wire_once():
    """What reaches gloo per step, per mesh: a bucketing or flushing change that splits a bucket, or
    a psum issued twice, shows here (comm_log, the program's view, would not change)."""
    results = shmap.spawn(dist_deferred.recipe_step_collectives, list(STEP_REDUCTIONS), nprocs=4, timeout=120)
    assert all(r == results[0] for r in results)
    for mesh, expect in STEP_REDUCTIONS.items():
        assert all(kind is not None for kind, _, _ in results[0][mesh]), f"{mesh}: {results[0][mesh]}"
        got = [(call, n) for kind, call, n in results[0][mesh] if kind in ("psum", "pmax", "pmin")]
        assert len(got) == expect, f"{mesh}: {len(got)} reductions {got}, expected {expect}"
    fsdp = [kind for kind, _, _ in results[0]["fsdp=2,tensor=2"] if kind not in ("psum", "pmax", "pmin")]
    assert fsdp == ["all_gather", "psum_scatter"], (
        f"fsdp=2,tensor=2: {fsdp}, expected one all_gather (the weights) and one reduce-scatter")


def test_a_closed_over_weights_gradient_reads_as_its_value():
    for reads, storage in shmap.spawn(dist_deferred.closed_over_gradient_reads, nprocs=4, timeout=90):
        assert reads == ([28.0], [28.0], [28.0], 28.0)
        assert storage == ("Deferred", True, [28.0])


def test_a_checkpoint_around_a_call_recomputes_what_the_simulated_mesh_does():
    for got in shmap.spawn(dist_deferred.checkpoint_around_a_call, nprocs=2, timeout=90):
        assert got["distributed"][0] == got["simulated"][0] == ["psum"], got
        assert torch.allclose(torch.tensor(got["distributed"][1]), torch.tensor(got["simulated"][1]), rtol=1e-12)
