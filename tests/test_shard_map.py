"""shard_map: call forms, specs, static args, check_vma=False, and one test per error row of REFERENCE.md."""
import functools

import pytest
import torch

import shmap
from shmap import P

torch.set_default_dtype(torch.float64)
MESH = shmap.make_mesh((4, 2), ("i", "j"))


def sm(f, i, o, **kw):
    return shmap.shard_map(f, mesh=MESH, in_specs=i, out_specs=o, **kw)


# --------------------------------------------------------------------------
# Call forms and boundary semantics
# --------------------------------------------------------------------------
def test_call_decorator_and_partial_forms_agree():
    x = torch.randn(8, 4)

    def body(v):
        return shmap.psum(v, "j")

    a = shmap.shard_map(body, mesh=MESH, in_specs=P("i", "j"), out_specs=P("i"))(x)

    @shmap.shard_map(mesh=MESH, in_specs=P("i", "j"), out_specs=P("i"))
    def b_(v):
        return shmap.psum(v, "j")

    c_ = functools.partial(shmap.shard_map, mesh=MESH, in_specs=P("i", "j"), out_specs=P("i"))(body)
    expect = x[:, :2] + x[:, 2:]
    for out in (a, b_(x), c_(x)):
        torch.testing.assert_close(out, expect)


def test_rank_preserving_blocks_and_unmentioned_axes_tile():
    shapes = []

    def body(v):
        shapes.append(tuple(v.shape))
        return v

    x = torch.arange(144.0).reshape(12, 12)
    y = sm(body, P("i", None), P("i", "j"))(x)  # 'j' unmentioned on input: each device gets the full row block
    assert shapes == [(3, 12)]
    torch.testing.assert_close(y, torch.cat([x, x], 1))


def test_output_block_transpose_order():
    x = torch.arange(8.0)
    y1 = sm(lambda v: v, P(("i", "j")), P(("i", "j")))(x)
    y2 = sm(lambda v: v, P(("i", "j")), P(("j", "i")))(x)
    torch.testing.assert_close(y1, x)
    # Device (i, j) holds x[2i + j]; assembled j-major it sits at 4j + i.
    expect = torch.tensor([2 * i + j for j in range(2) for i in range(4)], dtype=x.dtype)
    torch.testing.assert_close(y2, expect)


def test_static_args_pytrees_scalars_and_closures():
    w = torch.randn(3)

    def body(cfg, xs, s):
        assert cfg == {"scale": 2}
        return {"y": shmap.psum(xs["a"] * cfg["scale"] * s + w.sum(), "i"), "z": xs["b"]}

    x = {"a": torch.randn(8, 3), "b": torch.randn(4)}
    out = sm(body, (None, {"a": P("i"), "b": P()}, P()), {"y": P(), "z": P()})({"scale": 2}, x, 0.5)
    expect = sum(x["a"].chunk(4)) + 4 * w.sum()  # scale 2 * s 0.5 == 1
    torch.testing.assert_close(out["y"], expect)
    torch.testing.assert_close(out["z"], x["b"])


def test_axis_names_subset_leaves_other_axes_unsplit():
    x = torch.randn(8, 4)
    f = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=MESH, in_specs=P("i"), out_specs=P(),
                        axis_names={"i"})
    torch.testing.assert_close(f(x), sum(x.chunk(4)))


def test_check_vma_false_defensive_transpose_matches_numbers_and_counts():
    x = torch.randn(8, requires_grad=True)
    mesh = shmap.make_mesh((8,), ("i",))
    for check in (True, False):
        f = shmap.shard_map(lambda v: shmap.psum(torch.sin(v).sum(), "i"), mesh=mesh, in_specs=P("i"),
                            out_specs=P(), check_vma=check)
        out = f(x)
        with shmap.comm_log() as log:
            (g,) = torch.autograd.grad(out, x)
        torch.testing.assert_close(g, torch.cos(x))
        assert log.count("psum") == (0 if check else 1)
    # Cursed identity: with check_vma=False JAX's transpose psums (cotangent / 8): still the identity.
    z = torch.randn(3, requires_grad=True)
    f = shmap.shard_map(lambda v: v, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    ct = torch.randn(3)
    with shmap.comm_log() as log:
        (g,) = torch.autograd.grad(f(z), z, ct)
    torch.testing.assert_close(g, ct)
    assert log.count("psum") == 1


def test_check_vma_false_skips_output_check():
    x = torch.randn(8)
    mesh = shmap.make_mesh((8,), ("i",))
    out = shmap.shard_map(lambda v: v, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False)(x)
    torch.testing.assert_close(out, x[:1])  # device 0's copy, as in JAX


# --------------------------------------------------------------------------
# One test per error row of REFERENCE.md
# --------------------------------------------------------------------------
def test_error_spec_leaf_is_not_a_P():
    with pytest.raises(shmap.SpecError) as e:
        sm(lambda a, b: a, (P("i"), "j"), P("i"))(torch.randn(8), torch.randn(8))
    msg = str(e.value)
    assert "in_specs[1]" in msg and "str" in msg and "P('j')" in msg


def test_error_unknown_axis():
    with pytest.raises(shmap.SpecError) as e:
        sm(lambda a: a, P("k"), P("k"))(torch.randn(8))
    msg = str(e.value)
    assert "'k'" in msg and "('i', 'j')" in msg and "in_specs[0]" in msg


def test_error_axis_not_manual():
    f = shmap.shard_map(lambda a: a, mesh=MESH, in_specs=P("j"), out_specs=P("j"), axis_names={"i"})
    with pytest.raises(shmap.SpecError, match="not manual"):
        f(torch.randn(8))


def test_error_spec_tree_mismatch_names_path():
    with pytest.raises(shmap.SpecError) as e:
        sm(lambda a, b, c: a, (P("i"), P()), P("i"))(torch.randn(8), torch.randn(8), torch.randn(8))
    msg = str(e.value)
    assert "in_specs" in msg and "3 positional arguments (a, b, c)" in msg and "2 entries" in msg
    with pytest.raises(shmap.SpecError) as e:
        sm(lambda d: d["w"], ({"w": P(), "b": P()},), P())({"w": torch.randn(2), "c": torch.randn(2)})
    assert "in_specs[0]" in str(e.value) and "keys" in str(e.value)
    with pytest.raises(shmap.SpecError) as e:
        sm(lambda a: (a, a), P("i"), (P("i"), {"x": P()}))(torch.randn(8))
    assert "out_specs[1]" in str(e.value)


def test_error_spec_longer_than_rank_names_argument():
    with pytest.raises(shmap.SpecError) as e:
        sm(lambda a, b: a, (P("i"), P("j", None, "i")), P("i"))(torch.randn(8), torch.randn(16, 32))
    msg = str(e.value)
    assert "P('j', None, 'i')" in msg and "(16, 32)" in msg and "argument 1 ('b')" in msg and "rank 2" in msg


def test_error_not_divisible():
    with pytest.raises(shmap.SpecError) as e:
        sm(lambda a: a, P(None, ("i", "j")), P(None, ("i", "j")))(torch.randn(2, 12))
    msg = str(e.value)
    assert "dimension 1" in msg and "12" in msg and "('i', 'j')" in msg and "i=4, j=2" in msg
    assert "multiple of 8" in msg


def test_error_same_axis_twice():
    with pytest.raises(shmap.SpecError) as e:
        sm(lambda a: a, P("i", "i"), P("i"))(torch.randn(8, 8))
    msg = str(e.value)
    assert "P('i', 'i')" in msg and "'i' twice" in msg


def test_error_output_unmapped_but_varying():
    with pytest.raises(shmap.VmaError) as e:
        sm(lambda a: a * 2, P("i", "j"), P("i"))(torch.randn(8, 4))
    msg = str(e.value)
    assert "out_specs" in msg and "P('i')" in msg and "{'i', 'j'}" in msg
    assert "shmap.psum(y, 'j')" in msg and "all_gather" in msg and "P('i', 'j')" in msg


def test_error_unbound_axis_in_collective():
    with pytest.raises(shmap.UnboundAxisError) as e:
        sm(lambda a: shmap.psum(a, "k"), P("i"), P())(torch.randn(8))
    assert "'k'" in str(e.value) and "('i', 'j')" in str(e.value)
    with pytest.raises(shmap.UnboundAxisError, match="no shard_map body"):
        shmap.psum(torch.ones(2), "i")


def test_error_collective_shape_precondition():
    with pytest.raises(shmap.CollectiveShapeError) as e:
        sm(lambda a: shmap.psum_scatter(a, "i"), P("i"), P("i"))(torch.randn(8, 3))
    msg = str(e.value)
    assert "psum_scatter" in msg and "axis size 4" in msg and "(2, 3)" in msg
    with pytest.raises(shmap.CollectiveShapeError, match="all_to_all"):
        sm(lambda a: shmap.all_to_all(a, "i", 0, 0, tiled=True), P("i"), P("i"))(torch.randn(12, 3))


def test_error_bad_permutations():
    with pytest.raises(shmap.CollectiveArgumentError, match="destination 1 appears twice"):
        sm(lambda a: shmap.ppermute(a, "i", [(0, 1), (2, 1)]), P("i"), P("i"))(torch.randn(8))
    with pytest.raises(shmap.CollectiveArgumentError, match="permutation of range"):
        sm(lambda a: shmap.pshuffle(a, "i", [0, 0, 1, 2]), P("i"), P("i"))(torch.randn(8))


def test_error_keyword_arguments():
    with pytest.raises(TypeError, match="keyword arguments"):
        sm(lambda a: a, P("i"), P("i"))(a=torch.randn(8))


def test_error_python_if_on_varying_value():
    def body(a):
        if a.sum() > 0:  # varies per device
            return a
        return -a

    with pytest.raises(shmap.VaryingControlFlowError) as e:
        sm(body, P("i"), P("i"))(torch.randn(8))
    msg = str(e.value)
    assert "varies across devices" in msg and "torch.where" in msg and "{'i'}" in msg

    def ok(a):
        total = shmap.psum(a.sum(), "i")  # invariant: control flow is fine
        return a if total > -1e9 else -a

    sm(ok, P("i"), P("i"))(torch.randn(8))


def test_invariant_output_tiled_into_a_mapped_spec_transposes_to_a_psum():
    """out_specs naming an axis the value is invariant along tiles it (an implicit pvary, as in JAX):
    the per-device cotangent blocks differ, so the transpose sums them."""
    mesh = shmap.make_mesh((4,), ("i",))
    x = torch.randn(8, requires_grad=True)
    f = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    out = f(x)
    torch.testing.assert_close(out, sum(x.chunk(4)).repeat(4))
    ct = torch.randn(8)
    with shmap.comm_log() as log:
        (g,) = torch.autograd.grad(out, x, ct)
    assert log.summary() == {"psum": 1}
    torch.testing.assert_close(g, sum(ct.chunk(4)).repeat(4))
