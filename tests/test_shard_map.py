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
    with pytest.raises(shmap.VmaError) as e:  # a scalar: not "e.g. P()", the spec it was given
        sm(lambda a: a.sum(), P("i", "j"), P())(torch.randn(8, 4))
    msg = str(e.value)
    assert "e.g. P()" not in msg and "return `y.reshape(1)` with out_spec P(('i', 'j'))" in msg


def test_error_unbound_axis_in_collective():
    with pytest.raises(shmap.UnboundAxisError) as e:
        sm(lambda a: shmap.psum(a, "k"), P("i"), P())(torch.randn(8))
    assert "'k'" in str(e.value) and "('i', 'j')" in str(e.value)
    with pytest.raises(shmap.UnboundAxisError, match="no shard_map or pmap body"):
        shmap.psum(torch.ones(2), "i")
    # an axis of the mesh that axis_names leaves free: the fix is to bind it, not "a mesh with an axis 'j'"
    with pytest.raises(shmap.UnboundAxisError, match=r"'j' is not bound: it is an axis of the enclosing "
                       r"shard_map's mesh \(i=4, j=2\), which that shard_map leaves free.*axis_names=\{'i', 'j'\}"):
        sm(lambda a: shmap.psum(a, "j"), P("i"), P(), axis_names={"i"})(torch.randn(8))


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


# --------------------------------------------------------------------------
# Issue 10: exact spec validation, read-only arguments, messages, unreduced out_specs
# --------------------------------------------------------------------------
def test_spec_validation_is_keyed_on_the_exact_spec():
    """P('i', None) == P('i'), but only the short one fits a rank-1 value (and P(None) no 0-d one),
    also after the short one was validated for that shape."""
    ident = lambda v: v  # noqa: E731
    sm(ident, P("i"), P("i"))(torch.randn(8))
    with pytest.raises(shmap.SpecError, match=r"in_specs\[0\]: P\('i', None\) has 2 entries but argument 0 "
                                              r"\('v'\) has rank 1 .*Fix: give at most 1 entries, e.g. P\('i'\)"):
        sm(ident, P("i", None), P("i"))(torch.randn(8))
    sm(ident, P(), P())(torch.tensor(3.0))
    with pytest.raises(shmap.SpecError, match=r"P\(None\) has 1 entries but argument 0 \('v'\) has rank 0"):
        sm(ident, P(None), P())(torch.tensor(3.0))
    with pytest.raises(shmap.SpecError, match=r"out_specs: P\(None\) has 1 entries but the output has rank 0"):
        sm(ident, P(), P(None))(torch.tensor(3.0))


def test_specs_made_per_call_do_not_fill_the_validation_table():
    """The table was keyed on the spec's identity: pmap (which makes its specs per call), and code that
    builds a shard_map per step, added an entry every call (65536 entries, ~50 MiB) and never hit one."""
    import importlib

    sm_mod = importlib.import_module("shmap.shard_map")

    f = shmap.pmap(lambda v: shmap.psum(v, "p"), "p")
    f(torch.ones(4, 3))
    before = len(sm_mod._VALIDATED)
    for _ in range(20):
        f(torch.ones(4, 3))
        sm(lambda v: v * 2, P("i", None), P("i"))(torch.ones(8, 2))
    assert len(sm_mod._VALIDATED) <= before + 2


def test_inplace_update_of_an_argument_raises_naming_it():
    x, w = torch.zeros(8), torch.ones(2)

    def bump(a, b):
        a.add_(b)
        return a

    for spec in (P("i"), P()):
        with pytest.raises(shmap.InPlaceInputError) as e:
            sm(bump, (spec, P()), spec)(x, w)
        msg = str(e.value)
        assert msg.startswith("Tensor.add_: in-place update of argument 0 ('a') of shard_map(bump) at in_specs[0]")
        assert "read-only" in msg and "immutable" in msg and "Fix:" in msg and "x = x.clone()" in msg
    assert torch.equal(x, torch.zeros(8))  # the caller's tensor is untouched

    def through_a_view(a):
        a[0].mul_(2)
        return a

    with pytest.raises(shmap.InPlaceInputError, match=r"mul_: in-place update of argument 0 \('a'\)"):
        sm(through_a_view, P("i"), P("i"))(x)

    def setitem(a, b):
        b[0] = 1.0
        return a

    with pytest.raises(shmap.InPlaceInputError, match=r"__setitem__: in-place update of argument 1 \('b'\) of "
                                                       r"shard_map\(setitem\) at in_specs\[1\]"):
        sm(setitem, (P("i"), P()), P("i"))(x, w)


def test_inplace_update_of_a_requires_grad_leaf_names_the_argument_not_torchs_leaf_rule():
    x = torch.zeros(8, requires_grad=True)

    def bump(a):
        a += 1
        return a

    with pytest.raises(shmap.InPlaceInputError, match=r"add_: in-place update of argument 0 \('a'\)") as e:
        sm(bump, P("i"), P("i"))(x)
    assert "leaf" not in str(e.value)


def test_an_argument_returned_as_it_is_is_a_new_tensor():
    """As JAX's outputs: updating the output leaves the caller's tensor alone (on a distributed mesh it
    would otherwise write only each rank's block of it: tests/distributed/dist_boundary.py)."""
    x, w = torch.arange(8.0), torch.ones(2)
    same, view, lifted = sm(lambda a, b: (a, a[::2], shmap.pvary(b, "i")), (P("i"), P()),
                            (P("i"), P("i"), P("i")))(x, w)
    for out in (same, view, lifted):
        out.add_(100)
    assert torch.equal(x, torch.arange(8.0)) and torch.equal(w, torch.ones(2))
    torch.testing.assert_close(same, torch.arange(8.0) + 100)


def test_inplace_updates_of_values_made_in_the_body_still_work():
    x, w = torch.randn(8), torch.randn(2)
    w0 = w.clone()

    def body(a, b, k):
        y = a * 1
        y.add_(b)
        y[0] = 7.0
        c = shmap.pvary(b, "i")  # a new value sharing b's storage: copied on its first in-place update
        c.mul_(k)
        k += 1  # a Python number argument is no caller tensor
        return y, c + k

    y, c = sm(body, (P("i"), P(), P()), (P("i"), P("i")))(x, w, 2.0)
    want = x + w.repeat(4)
    want[::2] = 7.0
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(c, (w * 2 + 3).repeat(4))
    assert torch.equal(w, w0)  # the pvary'd copy was updated, not the caller's tensor


def test_all_gather_into_an_unsplit_spec_suggests_all_gather_invariant():
    with pytest.raises(shmap.VmaError) as e:
        sm(lambda v: shmap.all_gather(v, "i", tiled=True), P("i"), P())(torch.randn(8))
    msg = str(e.value)
    assert "shmap.all_gather_invariant(y, 'i')" in msg and "`shmap.psum(y, 'i')`" in msg
    assert "(or `shmap.all_gather`)" not in msg


def test_varying_control_flow_message_names_the_mesh_it_runs_on():
    from shmap.errors import varying_control_flow

    sim = shmap.make_mesh((4,), ("i",))
    on_processes = shmap.Mesh(torch.arange(4), ("i",), device_mesh=object())  # as make_mesh builds under torchrun
    s = str(varying_control_flow("`.item()`", {"i"}, sim))
    d = str(varying_control_flow("`.item()`", {"i"}, on_processes))
    assert "the simulated mesh refuses" in s
    assert "simulated mesh refuses" not in d and "Each process would take its own branch" in d
    assert "varies across devices along {'i'} of mesh (i=4)" in d and "Fix:" in d


def test_unreduced_out_spec_on_a_varying_value_is_a_pending_sum_as_jax():
    """out_specs=P(..., unreduced={'j'}) on a value varying along 'j' (no pcast): its logical value is the
    sum over 'j' (JAX inserts the varying->unreduced cast); gradients flow to every term."""
    from differential import assert_close
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as JP

    x = torch.randn(8, 4, requires_grad=True)
    f = sm(lambda v: torch.sin(v) * 2, P("i", "j"), P("i", unreduced={"j"}))
    out = f(x)
    torch.testing.assert_close(out, sum((torch.sin(x) * 2).chunk(2, dim=1)))
    ct = torch.randn(8, 2)
    (g,) = torch.autograd.grad(out, x, ct)
    torch.testing.assert_close(g, 2 * torch.cos(x) * ct.repeat(1, 2))

    mesh = jax.make_mesh((4, 2), ("i", "j"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        xa = jax.device_put(x.detach().numpy(), NamedSharding(mesh, JP("i", "j")))
        jf = jax.shard_map(lambda v: jax.numpy.sin(v) * 2, mesh=mesh, in_specs=JP("i", "j"),
                           out_specs=JP("i", unreduced={"j"}))
        jout = jax.reshard(jf(xa), JP())
        jg = jax.grad(lambda v: (jax.reshard(jf(v), JP()) * ct.numpy()).sum())(xa)
    assert_close(out.detach().numpy(), np.asarray(jout), "output")
    assert_close(g.numpy(), np.asarray(jg), "gradient")


def test_unreduced_out_spec_on_an_invariant_value_raises_as_jax():
    with pytest.raises(shmap.VmaError, match=r"unreduced along 'j' .* but the value is invariant along 'j' .*"
                                             r"would be 2 times the value.*Fix: drop 'j' from unreduced"):
        sm(lambda v: v * 2, P("i"), P("i", unreduced={"j"}))(torch.randn(8))


def test_dict_specs_listing_keys_in_another_order_pair_by_key():
    """A spec dict may list its keys in another order than the value's: each entry gets its own spec,
    and each converted leaf goes back under its own key (inputs and outputs)."""
    mesh = shmap.make_mesh((2,), ("i",))
    x, y = torch.arange(4.0), torch.arange(4.0) + 100
    f = shmap.shard_map(lambda d: d["a"] - d["b"], mesh=mesh, in_specs=({"b": P(), "a": P()},), out_specs=P())
    torch.testing.assert_close(f({"a": x, "b": y}), x - y)
    g = shmap.shard_map(lambda d: {"a": d["a"] * 2, "b": d["b"]}, mesh=mesh,
                        in_specs=({"b": P(), "a": P("i")},), out_specs={"b": P(), "a": P("i")})
    out = g({"a": x, "b": y})
    assert list(out) == ["a", "b"]
    torch.testing.assert_close(out["a"], 2 * x)
    torch.testing.assert_close(out["b"], y)


def test_a_tuple_of_specs_fits_a_namedtuple_by_position():
    import collections

    NT = collections.namedtuple("NT", "x y")
    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(lambda t: NT(t.x * 2, t.y), mesh=mesh, in_specs=((P("i"), P()),), out_specs=(P("i"), P()))
    out = f(NT(torch.arange(4.0), torch.ones(3)))
    assert isinstance(out, NT)
    torch.testing.assert_close(out.x, 2 * torch.arange(4.0))
    torch.testing.assert_close(out.y, torch.ones(3))


def test_a_defaultdict_argument_and_output_keep_their_type_and_factory():
    """They crashed rebuilding the container (`defaultdict(dict)`: its first argument is the factory)."""
    import collections

    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(lambda d: collections.defaultdict(list, {"y": d["x"] * 2}), mesh=mesh,
                        in_specs=(P("i"),), out_specs=P("i"))
    for _ in range(2):  # (the second call takes the remembered match)
        out = f(collections.defaultdict(int, {"x": torch.arange(4.0)}))
        assert type(out) is collections.defaultdict and out.default_factory is list
        torch.testing.assert_close(out["y"], 2 * torch.arange(4.0))
    out = torch.compile(f, backend="eager")(collections.defaultdict(int, {"x": torch.arange(4.0)}))
    assert type(out) is collections.defaultdict and out.default_factory is list


def test_a_dict_of_specs_for_the_positional_arguments_is_a_clear_error():
    """The first call crashed in the rebuild; the second paired the dict's entries with the arguments by
    position, in the dict's order (`{'b': P('i'), 'a': P()}` gave `a` P('i'))."""
    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(lambda a, b: a + b, mesh=mesh, in_specs={"b": P("i"), "a": P()}, out_specs=P("i"))
    for _ in range(2):
        with pytest.raises(shmap.SpecError, match=r"in_specs: the top level is a dict of specs, .* Fix: "
                                                  r"in_specs=\(P\(\), P\('i'\)\) for \(a, b\)"):
            f(torch.ones(4), torch.ones(4))


@pytest.mark.parametrize("q", [(1, 2), "deque"])
def test_repeated_calls_reuse_the_spec_match_and_stay_right(q):
    """The second call of a structure takes the remembered match (spec_tree.cached_match): same
    results as the first, for nested dicts listing keys in another order, static arguments and
    a container optree knows but shard_map treats as one value (a deque, passed static)."""
    import collections

    mesh = shmap.make_mesh((2,), ("i",))
    specs = {"w": {"b": P(), "a": P("i")}, "n": None, "q": None}

    def body(d, k):
        return {"out": d["w"]["a"] * k + d["w"]["b"].sum() + len(d["q"]) + d["n"]}

    f = shmap.shard_map(body, mesh=mesh, in_specs=(specs, None), out_specs={"out": P("i")})
    specs["w"]["a"] = P()  # the caller's spec tree changing later changes nothing (read at definition)
    for step in range(3):
        a, b = torch.arange(4.0) + step, torch.full((3,), float(step))
        qv = collections.deque([1, 2]) if q == "deque" else q  # a deque: not remembered (optree opens it)
        got = f({"w": {"a": a, "b": b}, "n": step, "q": qv}, 2.0)
        torch.testing.assert_close(got["out"], a * 2.0 + b.sum() + 2 + step)


def test_containers_only_shard_map_opens_are_not_remembered_wrongly():
    """A list subclass is a container to shard_map but a leaf to optree (as Dynamo's immutable
    lists and dicts are): such a structure is matched afresh on every call, and stays right."""
    class Params(list):
        pass

    mesh = shmap.make_mesh((2,), ("i",))
    f = shmap.shard_map(lambda ps: ps[0] * ps[1], mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    for step in range(3):
        a, b = torch.arange(4.0) + step, torch.arange(4.0) * 2
        torch.testing.assert_close(f(Params([a, b])), a * b)


def test_bad_flags_sparse_arguments_and_a_returned_bodys_value_are_clear_errors():
    mesh = shmap.make_mesh((2,), ("i",))
    with pytest.raises(TypeError, match=r"axis_names must be a mesh axis name or a collection of names, got 1"):
        shmap.shard_map(lambda a: a, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=1)
    with pytest.raises(TypeError, match=r"check_vma must be True or False, got 'no'"):
        shmap.shard_map(lambda a: a, mesh=mesh, in_specs=P(), out_specs=P(), check_vma="no")
    f = shmap.shard_map(lambda a: a, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    with pytest.raises(TypeError, match=r"in_specs\[0\]: got a torch.sparse_coo tensor.* x.to_dense\(\)"):
        f(torch.ones(4, 2).to_sparse())
    kept = []
    shmap.shard_map(lambda a: (kept.append(a), a)[1], mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.ones(4))
    with pytest.raises(shmap.SpecError, match=r"a shard_map body that has already returned"):
        f(kept[0])  # (it said "over a different mesh", though the mesh is the same)
