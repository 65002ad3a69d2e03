"""Mesh and PartitionSpec: metadata only."""
import pytest
import torch

import shmap
from shmap import P


def test_make_mesh_shape_names_and_devices():
    m = shmap.make_mesh((4, 2), ("i", "j"))
    assert m.shape == {"i": 4, "j": 2} and m.axis_names == ("i", "j") and m.size == 8
    assert m.devices.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert "i=4, j=2" in repr(m)
    assert shmap.make_mesh((2,), ("x",), device="cpu").device == torch.device("cpu")


@pytest.mark.parametrize("shape,names,match", [
    ((4, 2), ("i",), "one name per mesh axis"),
    ((0,), ("i",), ">= 1"),
])
def test_make_mesh_errors(shape, names, match):
    with pytest.raises(ValueError, match=match):
        shmap.make_mesh(shape, names)


@pytest.mark.parametrize("shape,err,match", [
    ((2.5,), TypeError, r"axis 0 of shape \(2.5,\) has size 2.5 \(float\); every axis size must be a positive int"),
    (("4",), TypeError, r"axis 0 of shape \('4',\) has size '4' \(str\).*Fix:.*int\('4'\)"),
    ((2, True), TypeError, r"axis 1 .* has size True \(bool\)"),
    ((2, -1), ValueError, r"axis 1 of shape \(2, -1\) has size -1; every axis size must be >= 1"),
    (4, TypeError, r"shape must be a sequence of axis sizes, got int 4. Fix: e.g. make_mesh\(\(4,\), \('i',\)\)"),
])
def test_make_mesh_sizes_must_be_positive_ints(shape, err, match):
    names = ("i", "j")[: len(shape)] if isinstance(shape, tuple) else ("i",)
    with pytest.raises(err, match=match):
        shmap.make_mesh(shape, names)


def test_make_mesh_accepts_integer_scalars():
    import numpy as np

    m = shmap.make_mesh((np.int64(2), torch.tensor(3)), ["a", "b"])
    assert m.axis_sizes == (2, 3) and all(type(s) is int for s in m.axis_sizes) and m.axis_names == ("a", "b")


@pytest.mark.parametrize("names,err,match", [
    (("i", "i"), ValueError, r"axis name 'i' appears twice in \('i', 'i'\).*Fix: rename one"),
    (("i", 3), TypeError, r"axis name 1 of \('i', 3\) is 3 \(int\); axis names must be non-empty strings"),
    (("i", ""), TypeError, r"axis name 1 .* is '' \(str\)"),
    ("ij", TypeError, r"got the string 'ij' \(which would be read as 2 one-letter names\).*\('i', 'j'\)"),
])
def test_make_mesh_names_must_be_unique_strings(names, err, match):
    with pytest.raises(err, match=match):
        shmap.make_mesh((2, 2), names)


def test_mesh_rejects_duplicate_names():
    with pytest.raises(ValueError, match="distinct"):
        shmap.Mesh(torch.arange(4).reshape(2, 2), ("i", "i"))


def test_partition_spec_normalisation_and_equality():
    assert P("i", None) == P("i") and hash(P("i", None)) == hash(P("i"))
    assert P(("i",)) == P("i") and P([]) == P(None) == P()
    s = P(("i", "j"), None, "k")
    assert s.dim_axes(0) == ("i", "j") and s.dim_axes(1) == () and s.dim_axes(5) == ()
    assert s.axes() == ("i", "j", "k") and len(s) == 3 and repr(s) == "P(('i', 'j'), None, 'k')"
    assert not isinstance(s, tuple)  # never confused with a tuple of specs


def test_a_fake_process_group_still_gets_a_simulated_mesh():
    """LocalTensor / DTensor test set-ups initialise a single-process "fake" world; auto-detection
    must not lay a distributed mesh over it (it has no peers)."""
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist, shmap\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', rank=0, world_size=8, store=FakeStore())\n"
        "m = shmap.make_mesh((8,), ('b',))\n"
        "assert not m.is_distributed\n"
        "f = shmap.shard_map(lambda x: x * 2, mesh=m, in_specs=shmap.P('b'), out_specs=shmap.P('b'))\n"
        "assert torch.equal(f(torch.arange(8.)), torch.arange(8.) * 2)\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]


def test_partition_spec_entries_and_unreduced_are_checked_when_built():
    """A set entry raised "unhashable type: 'set'"; unreduced=None "'NoneType' object is not iterable"."""
    with pytest.raises(TypeError, match=r"P: entry 0 is set .*\(a tuple: a set has no order\)"):
        P({"i", "j"})
    with pytest.raises(TypeError, match=r"P: entry 1 is int 3"):
        P("i", 3)
    with pytest.raises(TypeError, match=r"P: unreduced must be an axis name or a set of names, got None"):
        P("i", unreduced=None)
    assert P(("i", "j"), unreduced=["k"]).unreduced == {"k"}


def test_make_mesh_distributed_is_a_bool_and_a_simulated_mesh_has_a_bound():
    with pytest.raises(TypeError, match=r"distributed must be True, False or None"):
        shmap.make_mesh((2,), ("i",), distributed="no")  # (a truthy string meant True)
    with pytest.raises(ValueError, match=r"a mesh of 1000000000000 devices; a simulated mesh holds at most"):
        shmap.make_mesh((10 ** 6, 10 ** 6), ("i", "j"))  # (it allocated the 8 TB device table)


def test_make_mesh_checks_its_device():
    """A bad device string raised torch's parser error naming neither make_mesh nor `device`; an absent
    accelerator was accepted and failed inside torch at the first shard_map."""
    with pytest.raises(ValueError, match=r"make_mesh: device='bogus' is not a torch device.*Fix: e\.g\. device='cpu'"):
        shmap.make_mesh((2,), ("i",), device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda', but torch reports no cuda device.*Fix: device='cpu'"):
            shmap.make_mesh((2,), ("i",), device="cuda")
    assert shmap.make_mesh((2,), ("i",), device="cpu").device == torch.device("cpu")
