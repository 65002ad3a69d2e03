"""Global values at the shard_map boundary: DTensors in and out, device_put, visualize_sharding."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_boundary  # noqa: E402
import shmap  # noqa: E402
from shmap import P  # noqa: E402

# Multi-process tests share one xdist worker: they compete for ports and both cores.
pytestmark = pytest.mark.xdist_group("multiprocess")


def test_dtensor_boundary_on_four_ranks():
    results = shmap.spawn(dist_boundary.dtensor_boundary, nprocs=4, timeout=60)
    for r, bad in enumerate(results):
        assert bad == [], f"rank {r}:\n" + "\n".join(bad)


def test_three_axis_tuples_in_every_order_on_eight_ranks():
    results = shmap.spawn(dist_boundary.strided_three_axes, nprocs=8, timeout=60)
    for r, bad in enumerate(results):
        assert bad == [], f"rank {r}:\n" + "\n".join(bad)


# -- simulated mesh: no processes needed ---------------------------------------
def test_placements_follow_the_spec_order():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = shmap.make_mesh((2, 3, 2), ("i", "j", "k"))
    pl = shmap.dtensor.placements
    assert pl(mesh, P(("i", "j"))) == (Shard(0), Shard(0), Replicate())
    assert pl(mesh, P(("j", "i"), "k")) == (_StridedShard(0, split_factor=3), Shard(0), Shard(1))
    assert pl(mesh, P(("k", "i", "j"))) == (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2),
                                            Shard(0))
    assert pl(mesh, P("i", unreduced={"k"}))[2] == Partial()
    for spec in [P(("k", "j", "i")), P("j", ("k", "i")), P(None, ("i", "k")), P(), P("j", unreduced={"i", "k"})]:
        assert shmap.dtensor.spec_from_placements(mesh, pl(mesh, spec), 2) == spec


def test_device_put_on_a_simulated_mesh_returns_the_global_tensor():
    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    x = torch.arange(8.0).reshape(4, 2)
    assert shmap.device_put(x, mesh, P("i", "j")) is x
    with pytest.raises(shmap.SpecError, match="divisible"):
        shmap.device_put(torch.ones(3), mesh, P("i"))
    with pytest.raises(shmap.SpecError, match="not in mesh"):
        shmap.device_put(x, mesh, P("k"))
    with pytest.raises(shmap.SpecError, match=r"expected a PartitionSpec .*got NoneType"):
        shmap.device_put(x, mesh, None)  # (it was returned as it is here, an AttributeError on processes)


def test_visualize_sharding_draws_which_device_holds_which_block():
    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    pic = shmap.visualize_sharding((8, 4), mesh, P("i", "j"))
    assert pic.splitlines() == [
        "global shape (8, 4) as P('i', 'j') on mesh (i=2, j=2) (simulated)",
        "      0:2   2:4  ",
        "    ┌─────┬─────┐",
        "0:4 │  0  │  1  │",
        "    ├─────┼─────┤",
        "4:8 │  2  │  3  │",
        "    └─────┴─────┘",
        "device = (i, j): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)",
    ]
    # Replicated along j: both devices of a row hold the same block.
    assert "0, 1" in shmap.visualize_sharding(torch.ones(8, 4), mesh, P("i"))
    # Tuple order: P(('j', 'i')) puts device 2 = (i=1, j=0) second.
    line = shmap.visualize_sharding((8,), mesh, P(("j", "i"))).splitlines()[3]
    assert [c.strip() for c in line.strip("│ ").split("│")] == ["0", "2", "1", "3"]
    assert "[0:2, 0:2, 0:2] on device 0, 1" in shmap.visualize_sharding((4, 2, 2), mesh, P("i"))
    assert "every device: 0, 1, 2, 3" in shmap.visualize_sharding((), mesh, P())
    # A shape is non-negative ints: a float or a negative size was drawn as another shape.
    with pytest.raises(TypeError, match=r"visualize_sharding: mesh must be a shmap.Mesh, got str"):
        shmap.visualize_sharding((8, 4), "mesh", P("i"))
    for bad in [(2.5, 4), (-4, 2), [4, "2"], "ab", 5]:
        with pytest.raises(TypeError, match=r"visualize_sharding: x must be a tensor, a DTensor or a shape"):
            shmap.visualize_sharding(bad, mesh, P("i"))


def test_malformed_or_foreign_dtensor_arguments_are_refused_saying_why():
    for shape_msg, mesh_msg, good in shmap.spawn(dist_boundary.malformed_dtensors, nprocs=4, timeout=90):
        assert ("a DTensor argument of global shape (4, 4) laid out as P('i', 'j') holds a local tensor of "
                "shape") in shape_msg
        assert "but that layout's blocks are (2, 2)" in shape_msg, shape_msg
        assert "lives on another DeviceMesh than mesh (i=2, j=2)'s: ranks [[0, 2], [1, 3]]" in mesh_msg, mesh_msg
        assert "Fix: move it there first, `x = shmap.device_put(x, mesh, P('i', 'j'))`" in mesh_msg
        assert good is True


def test_a_result_shaped_by_the_values_is_checked_across_ranks_as_the_simulated_mesh_checks_it():
    results = shmap.spawn(dist_boundary.value_shaped_results, nprocs=4, timeout=90)
    assert all(r == results[0] for r in results[1:]), "the ranks disagree"
    outcomes = {name: (sim, sim_log, dist, dist_log) for name, sim, sim_log, dist, dist_log in results[0]}
    for name, (sim, sim_log, dist, dist_log) in outcomes.items():
        assert dist == sim, f"{name}: simulated {sim}, distributed {dist}"
        assert dist_log == sim_log, f"{name}: comm_log {dist_log} (simulated {sim_log}): the shape check is not logged"
    for name in ("unique, varying over (i, j)", "a boolean mask, varying over i", "nonzero, varying over j",
                 "unique with counts, the counts differing"):
        assert outcomes[name][0][0] == "VmaError", name
    sim = outcomes["unique, varying over (i, j)"][0][1]
    assert sim.startswith("torch.unique: its result has a different shape on different devices (device (i=0, j=0): "
                          "(2,); device (i=0, j=1): (3,); "), sim
    assert outcomes["nonzero, varying over j"][0][1].startswith(
        "torch.nonzero: its result has a different shape on different devices (device (j=0): (2, 2); device (j=1): "
        "(6, 2); mesh (i=2, j=2))")
    for name in ("nonzero, the same shape everywhere", "a mask, then a psum", "nonzero of an invariant value"):
        assert outcomes[name][0][0] == "ok", name
