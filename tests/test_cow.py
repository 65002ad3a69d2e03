"""Copy-on-write of pvary and collective results (shmap/cow.py), on the simulated mesh: an in-place
update gives the value memory of its own (its input and the other devices keep theirs), a view taken
before cannot follow it and is refused, and results updated in place under autograd give the
out-of-place gradients.  (tests/distributed/test_dist_interop.py: 2 processes give the same.)"""
from __future__ import annotations

import cow_cases
import shmap


def test_in_place_updates_of_shared_values():
    got = cow_cases.run(shmap.make_mesh((2,), ("i",)))
    assert got["pvary_then_write"] == [[0.0, 1.0, 2.0, 3.0], [0.0, 10.0, 20.0, 30.0] * 2]  # z unchanged
    assert got["write_through_view"][0] == "VmaError"  # (was silently lost on the simulated mesh)
    assert got["write_through_view"][1].startswith("Tensor.mul_: in-place update through a view")
    assert got["write_after_view"][0] == "VmaError"  # (the view kept the old values)
    assert got["write_through_data"][0] == "VmaError"
    assert got["write_then_view"] == [0.0, 10.0, 20.0, 30.0, 0.0, 10.0, 21.0, 31.0]
    assert got["clone_then_view"] == [0.0, 10.0, 2.0, 3.0] * 2
    assert got["gather_argument"] == [0.0, 3.0, 6.0, 9.0] * 2  # (was "in-place update of argument 0")
    # the input written after the collective: the result keeps what the collective saw (JAX's values)
    assert got["input_written_after: all_gather"] == [0.0, 1.0, 2.0, 3.0] * 4
    assert got["input_written_after: all_to_all"] == [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]
    assert got["input_written_after: pvary"] == [0.0, 1.0, 2.0, 3.0] * 2
    assert got["input_written_after: pmax"] == [0.0, 1.0, 2.0, 3.0]
    assert got["same_dtype_cast"][0] == "VmaError"  # (`y.float()` of a float32 `y`: the write was lost)
    assert got["aten_overload"][0] == "InPlaceInputError"  # (aten::mul_.Tensor was not seen as in place)
    assert got["data_assignment"][0] == "InPlaceInputError"  # (`.data =` wrote the caller's tensor)
    assert got["function_write"][0] == got["vmap_write"][0] == "VmaError"  # (lost, or wrote pvary's input)
    assert got["function_write_after_clone"] == [1.0, 2.0, 3.0, 4.0] * 2
    for name in ("pvary_then_write", "write_through_view", "write_after_view", "write_through_data", "write_then_view",
                 "clone_then_view", "gather_argument"):
        assert got[name + " (argument after)"] == [0.0, 1.0, 2.0, 3.0], name  # the caller's tensor untouched


def test_a_nested_shard_maps_arguments_are_read_only_and_returned_as_new_values():
    """A parent body's value passed to a nested shard_map was writable there (all of it on the simulated
    mesh, each process its block), and an inner argument returned as it is aliased the parent's value."""
    import pytest
    import torch
    from shmap import P

    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    inner_write = shmap.shard_map(lambda a: a.add_(1.0), mesh=mesh, in_specs=P("j"), out_specs=P("j"))
    with pytest.raises(shmap.InPlaceInputError, match=r"argument 0 \('a'\)"):
        shmap.shard_map(lambda y: inner_write(y * 1), mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                        axis_names={"i"})(torch.arange(8.0))
    ident = shmap.shard_map(lambda a: a, mesh=mesh, in_specs=P("j"), out_specs=P("j"))

    def outer(y):
        y = y * 1
        ident(y).add_(100.0)
        return y

    got = shmap.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})(torch.arange(8.0))
    assert got.tolist() == list(range(8))


def test_collective_results_updated_in_place_under_autograd():
    """torch refused these ("Output 0 of LogComm is a view and is being modified inplace"), and a pvary
    over a size-1 axis too; the in-place form now gives the out-of-place values and gradients."""
    for shape in ((2,), (1,)):
        mesh = shmap.make_mesh(shape, ("i",))
        got, want = cow_cases.run(mesh), cow_cases.out_of_place(mesh)
        for name, value in want.items():
            assert got[name] == value, (shape, name)
