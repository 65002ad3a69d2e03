"""Collectives: values against a per-device loop, types, and transpose pairs side by side.

The loop reference cuts the global input into per-device blocks with plain
indexing and computes each collective from the list of blocks by hand.
Transpose pairs are checked with the dot-product identity
<f(x), y> == <x, f_T(y)>, where f_T is the *named* transpose collective run in
its own shard_map, and against autograd's vjp of f.
"""
import pytest
import torch

import shmap
from shmap import P
from shmap.collectives import TRANSPOSES

torch.set_default_dtype(torch.float64)


def sm(f, mesh, i, o, **kw):
    return shmap.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, **kw)


def blocks_1d(x, n):
    """Per-device blocks of x split on dim 0 over n devices."""
    return list(x.chunk(n, 0))


MESH8 = shmap.make_mesh((8,), ("i",))
MESH42 = shmap.make_mesh((4, 2), ("i", "j"))


# --------------------------------------------------------------------------
# Values against the per-device loop
# --------------------------------------------------------------------------
def test_psum_pmean_pmax_pmin_values():
    x = torch.randn(16, 3)
    b = blocks_1d(x, 8)
    ref = sum(b)
    for fn, expect in (
        (shmap.psum, ref),
        (shmap.pmean, ref / 8),
        (shmap.pmax, torch.stack(b).amax(0)),
        (shmap.pmin, torch.stack(b).amin(0)),
    ):
        out = sm(lambda v: fn(v, "i"), MESH8, P("i"), P())(x)
        torch.testing.assert_close(out, expect)


def test_psum_of_invariant_is_n_times():
    x = torch.randn(5)
    out = sm(lambda v: shmap.psum(v, "i"), MESH8, P(), P())(x)
    torch.testing.assert_close(out, 8 * x)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_values(tiled, axis):
    x = torch.randn(16, 3)
    b = blocks_1d(x, 8)
    expect = torch.cat(b, axis) if tiled else torch.stack(b, axis)
    out = sm(lambda v: shmap.all_gather(v, "i", axis=axis, tiled=tiled), MESH8, P("i"), P("i"))(x)
    torch.testing.assert_close(out, torch.cat([expect] * 8, 0))
    inv = sm(lambda v: shmap.all_gather_invariant(v, "i", axis=axis, tiled=tiled), MESH8, P("i"), P())(x)
    torch.testing.assert_close(inv, expect)


@pytest.mark.parametrize("tiled", [False, True])
def test_psum_scatter_values(tiled):
    x = torch.randn(8 * 8, 3) if not tiled else torch.randn(8 * 16, 3)
    b = blocks_1d(x, 8)
    total = sum(b)
    parts = total.chunk(8, 0)
    out = sm(lambda v: shmap.psum_scatter(v, "i", tiled=tiled), MESH8, P("i"), P("i"))(x)
    expect = torch.cat(parts, 0) if tiled else torch.cat([p.reshape(3) for p in parts])  # untiled: dim removed
    torch.testing.assert_close(out, expect)


def test_ppermute_and_pshuffle_values():
    x = torch.randn(8, 2)
    b = blocks_1d(x, 8)
    perm = [(i, (i + 3) % 8) for i in range(8)]
    out = sm(lambda v: shmap.ppermute(v, "i", perm), MESH8, P("i"), P("i"))(x)
    expect = [None] * 8
    for s, d in perm:
        expect[d] = b[s]
    torch.testing.assert_close(out, torch.cat(expect))
    partial_perm = [(0, 1), (1, 2)]
    out = sm(lambda v: shmap.ppermute(v, "i", partial_perm), MESH8, P("i"), P("i"))(x)
    expect = [torch.zeros(1, 2)] * 8
    expect[1], expect[2] = b[0], b[1]
    torch.testing.assert_close(out, torch.cat(expect))
    shuffle = [3, 1, 0, 2, 7, 6, 5, 4]
    out = sm(lambda v: shmap.pshuffle(v, "i", shuffle), MESH8, P("i"), P("i"))(x)
    torch.testing.assert_close(out, torch.cat([b[s] for s in shuffle]))


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("split,concat", [(0, 1), (1, 0), (0, 0)])
def test_all_to_all_values(tiled, split, concat):
    n = 4
    mesh = shmap.make_mesh((n,), ("i",))
    shape = [n * 4, 3 * n] if tiled else [n * n, n]
    if not tiled:
        shape[split] = n * n if split == 0 else n
    x = torch.randn(*shape)
    b = blocks_1d(x, n)
    out = sm(lambda v: shmap.all_to_all(v, "i", split, concat, tiled=tiled), mesh, P("i"), P("i"))(x)
    per_dev = []
    for d in range(n):
        chunks = []
        for s in range(n):
            c = b[s].chunk(n, split)[d]
            chunks.append(c if tiled else c.squeeze(split))
        per_dev.append(torch.cat(chunks, concat) if tiled else torch.stack(chunks, concat))
    torch.testing.assert_close(out, torch.cat(per_dev, 0))


def test_axis_index_and_size_tuple_major_to_minor():
    out = sm(lambda: shmap.axis_index(("j", "i"))[None], MESH42, (), P(("i", "j")))()
    expect = [j * 4 + i for i in range(4) for j in range(2)]
    assert out.tolist() == expect
    sizes = []
    sm(lambda: sizes.append((shmap.axis_size("i"), shmap.axis_size(("i", "j")))) or torch.zeros(()),
       MESH42, (), P())()
    assert sizes == [(4, 8)]


def test_tuple_axis_collectives_linearise_in_given_order():
    x = torch.arange(8.0)
    # all_gather over ('j','i') orders blocks j-major.
    out = sm(lambda v: shmap.all_gather_invariant(v, ("j", "i"), tiled=True), MESH42, P(("i", "j")), P())(x)
    idx = [i * 2 + j for j in range(2) for i in range(4)]
    assert out.tolist() == [float(k) for k in idx]


# --------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------
def test_vma_rules():
    seen = {}

    def body(x, w):
        seen["x"] = shmap.vma(x)
        seen["w"] = shmap.vma(w)
        seen["xw"] = shmap.vma(x * w)
        seen["psum_j"] = shmap.vma(shmap.psum(x, "j"))
        seen["psum_ij"] = shmap.vma(shmap.psum(x, ("i", "j")))
        seen["pvary"] = shmap.vma(shmap.pvary(w, "j"))
        seen["ag"] = shmap.vma(shmap.all_gather(w, "i"))
        seen["agi"] = shmap.vma(shmap.all_gather_invariant(x, "j"))
        seen["idx"] = shmap.vma(shmap.axis_index("j"))
        return shmap.psum(x, ("i", "j"))

    sm(body, MESH42, (P("i", "j"), P()), P())(torch.randn(8, 4), torch.randn(2))
    assert seen == {
        "x": {"i", "j"}, "w": frozenset(), "xw": {"i", "j"}, "psum_j": {"i"}, "psum_ij": frozenset(),
        "pvary": {"j"}, "ag": {"i"}, "agi": {"i"}, "idx": {"j"},
    }


def test_every_collective_has_a_rule_an_implementation_and_a_transpose():
    from shmap.backends.simulated import Simulated

    names = ["psum", "pmean", "pmax", "pmin", "pvary", "all_gather", "all_gather_invariant", "psum_scatter",
             "ppermute", "pshuffle", "all_to_all", "axis_index"]
    for n in names:
        assert n in TRANSPOSES, n
        assert callable(getattr(shmap, n))
    backend_ops = {"psum", "pvary", "all_gather", "psum_scatter", "ppermute", "all_to_all", "axis_index",
                   "pextremum", "lift", "split", "assemble"}
    for op in backend_ops:
        assert callable(getattr(Simulated, op)), op


# --------------------------------------------------------------------------
# Transpose pairs, side by side: <f(x), y> == <x, f_T(y)> and == autograd's vjp
# --------------------------------------------------------------------------
def _vjp(f, x, y):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x, y)
    return g


PAIRS = [
    # name, f (P_in -> P_out), f_T (P_out -> P_in), input shape, mesh
    ("psum/pvary",
     sm(lambda v: shmap.psum(v, "i"), MESH8, P("i"), P()),
     sm(lambda v: shmap.pvary(v, "i"), MESH8, P(), P("i")), (16, 3), MESH8),
    ("pvary/psum",
     sm(lambda v: shmap.pvary(v, "i"), MESH8, P(), P("i")),
     sm(lambda v: shmap.psum(v, "i"), MESH8, P("i"), P()), (2, 3), MESH8),
    ("all_gather/psum_scatter",
     sm(lambda v: shmap.all_gather(v, "i", tiled=True), MESH8, P("i"), P("i")),
     sm(lambda v: shmap.psum_scatter(v, "i", tiled=True), MESH8, P("i"), P("i")), (16, 3), MESH8),
    ("psum_scatter/all_gather",
     sm(lambda v: shmap.psum_scatter(v, "i", tiled=True), MESH8, P("i"), P("i")),
     sm(lambda v: shmap.all_gather(v, "i", tiled=True), MESH8, P("i"), P("i")), (128, 3), MESH8),
    ("all_gather_invariant/slice",
     sm(lambda v: shmap.all_gather_invariant(v, "i", tiled=True), MESH8, P("i"), P()),
     sm(lambda v: v, MESH8, P("i"), P("i")), (16, 3), MESH8),
    ("ppermute/inverse",
     sm(lambda v: shmap.ppermute(v, "i", [(k, (k + 1) % 8) for k in range(8)]), MESH8, P("i"), P("i")),
     sm(lambda v: shmap.ppermute(v, "i", [((k + 1) % 8, k) for k in range(8)]), MESH8, P("i"), P("i")),
     (16, 3), MESH8),
    ("all_to_all/swapped",
     sm(lambda v: shmap.all_to_all(v, "i", 0, 1, tiled=True), MESH8, P("i"), P("i")),
     sm(lambda v: shmap.all_to_all(v, "i", 1, 0, tiled=True), MESH8, P("i"), P("i")), (64, 8), MESH8),
    ("psum over tuple/pvary",
     sm(lambda v: shmap.psum(v, ("i", "j")), MESH42, P(("i", "j")), P()),
     sm(lambda v: shmap.pvary(v, ("i", "j")), MESH42, P(), P(("i", "j"))), (16, 2), MESH42),
]


@pytest.mark.parametrize("name,f,ft,shape,mesh", PAIRS, ids=[p[0] for p in PAIRS])
def test_transpose_pair(name, f, ft, shape, mesh):
    x = torch.randn(*shape)
    fx = f(x)
    y = torch.randn_like(fx)
    fty = ft(y)
    lhs = (fx * y).sum()
    rhs = (x * fty).sum()
    torch.testing.assert_close(lhs, rhs)
    torch.testing.assert_close(_vjp(f, x, y), fty)


def test_transpose_communication_matches_table():
    """Backward of each collective records exactly the collective TRANSPOSES names."""
    x = torch.randn(16, 3, requires_grad=True)
    cases = {
        "psum": sm(lambda v: shmap.psum(v, "i"), MESH8, P("i"), P()),
        "all_gather": sm(lambda v: shmap.all_gather(v, "i", tiled=True), MESH8, P("i"), P("i")),
        "psum_scatter": sm(lambda v: shmap.psum_scatter(v, "i", tiled=True), MESH8, P("i"), P("i")),
        "all_gather_invariant": sm(lambda v: shmap.all_gather_invariant(v, "i", tiled=True), MESH8, P("i"), P()),
        "ppermute": sm(lambda v: shmap.ppermute(v, "i", [(0, 1)]), MESH8, P("i"), P("i")),
        "all_to_all": sm(lambda v: shmap.all_to_all(v, "i", 1, 0, tiled=False), MESH8, P("i"), P("i")),
        "pvary": sm(lambda v: shmap.pvary(v, "i"), MESH8, P(), P("i")),
    }
    for kind, f in cases.items():
        inp = x if kind not in ("psum_scatter", "all_to_all", "pvary") else (
            torch.randn(128, 3, requires_grad=True) if kind == "psum_scatter"
            else torch.randn(8, 8, requires_grad=True) if kind == "all_to_all"
            else torch.randn(2, 3, requires_grad=True))
        with shmap.comm_log() as fwd:
            out = f(inp)
        with shmap.comm_log() as bwd:
            torch.autograd.grad(out, inp, torch.ones_like(out))
        expect_fwd = [] if kind == "pvary" else [kind]
        assert [e.kind for e in fwd.events] == expect_fwd, kind
        t = TRANSPOSES[kind]
        comm_kinds = [e.kind for e in bwd.events if e.kind in shmap.comm.COMMUNICATING]
        assert comm_kinds == ([] if t in (None, "pvary") else [t]), (kind, comm_kinds)


def test_pmax_subgradient_goes_to_the_max_device():
    x = torch.tensor([1.0, 5.0, 3.0, 2.0, 0.0, 4.0, -1.0, 2.5], requires_grad=True)
    out = sm(lambda v: shmap.pmax(v, "i"), MESH8, P("i"), P())(x)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert g.tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    out = sm(lambda v: shmap.pmax(v, "i"), MESH8, P("i"), P())(x)
    with shmap.comm_log() as log:
        torch.autograd.grad(out.sum(), x)
    assert log.count() == 0  # the backward communicates nothing


def test_collectives_on_mixed_meshes_are_batched_over_other_axes():
    """A collective over 'j' on a (4, 2) mesh acts independently in each 'i' row."""
    x = torch.randn(8, 6)
    out = sm(lambda v: shmap.psum(v, "j"), MESH42, P("i", "j"), P("i"))(x)
    expect = torch.cat([x[2 * r:2 * r + 2, :3] + x[2 * r:2 * r + 2, 3:] for r in range(4)])
    torch.testing.assert_close(out, expect)


# --------------------------------------------------------------------------
# One record per collective: rules callable without running, derived tables
# --------------------------------------------------------------------------
def test_every_rule_predicts_the_simulated_result():
    from rule_cases import CASES, rule_mismatches

    from shmap.collectives import COLLECTIVES

    assert {c[0] for c in CASES} == set(COLLECTIVES), "a collective without a rule case"
    assert rule_mismatches(shmap.make_mesh((2, 2), ("i", "j"))) == []


def test_tables_and_banners_derive_from_the_records():
    import inspect

    from shmap import collectives, comm

    recs = collectives.COLLECTIVES
    assert TRANSPOSES == {n: c.transpose for n, c in recs.items()}
    assert {n for n, c in recs.items() if c.logged} <= comm.COMMUNICATING
    assert "pvary" not in comm.COMMUNICATING and "pmean" not in comm.COMMUNICATING
    src = inspect.getsource(collectives)
    for name, c in recs.items():  # each section's banner states the record's signature
        assert f"# {name}: {c.signature}" in src or any(
            f"# {name} / " in line or f" / {name}: {c.signature}" in line for line in src.splitlines()
        ), f"no banner '# {name}: {c.signature}' in collectives.py"
    # a rule runs on types alone: no body, no tensors
    assert recs["psum_scatter"].rule(frozenset({"i"}), (8, 3), ("j",), 4, scatter_dimension=0, tiled=True) == (
        frozenset({"i", "j"}), (2, 3))


_TREE_CALLS = {
    "psum": lambda t: shmap.psum(t, "i"), "pmean": lambda t: shmap.pmean(t, "i"),
    "pmax": lambda t: shmap.pmax(t, "i"), "pmin": lambda t: shmap.pmin(t, "i"),
    "all_gather": lambda t: shmap.all_gather(t, "i", tiled=True),
    "all_gather_invariant": lambda t: shmap.all_gather_invariant(t, "i", tiled=True),
    "psum_scatter": lambda t: shmap.psum_scatter(t, "i", tiled=True),
    "ppermute": lambda t: shmap.ppermute(t, "i", [(k, (k + 1) % 8) for k in range(8)]),
    "pshuffle": lambda t: shmap.pshuffle(t, "i", [(k + 3) % 8 for k in range(8)]),
    "all_to_all": lambda t: shmap.all_to_all(t, "i", 0, 0, tiled=True),
    "pvary": lambda t: shmap.pvary(shmap.psum(t, "i"), "i"),
    "pcast": lambda t: shmap.pcast(t, "i", to="unreduced"),
}


@pytest.mark.parametrize("name", sorted(_TREE_CALLS))
def test_a_collective_of_a_pytree_is_the_collective_of_each_leaf(name):
    """As JAX's collectives: a list, tuple, dict or namedtuple operand gives the same tree, each leaf's
    result the collective of that leaf (one comm_log event each). A list once reached torch.as_tensor,
    whose float() of a varying value made the message a pasted VaryingControlFlowError."""
    from collections import namedtuple

    Pair = namedtuple("Pair", "u v")
    call = _TREE_CALLS[name]
    a, b, c = torch.randn(64, 2), torch.randn(64), torch.randn(64, 3)
    specs = P(unreduced={"i"}) if name == "pcast" else P("i")

    def per_leaf(a, b, c):
        return {"a": call(a), "bc": [call(b), Pair(call(c), call(a * 2))]}

    def tree(a, b, c):
        return call({"a": a, "bc": [b, Pair(c, a * 2)]})

    out_specs = {"a": specs, "bc": [specs, Pair(specs, specs)]}
    with shmap.comm_log() as want_log:
        want = sm(per_leaf, MESH8, P("i"), out_specs)(a, b, c)
    with shmap.comm_log() as got_log:
        got = sm(tree, MESH8, P("i"), out_specs)(a, b, c)
    assert isinstance(got["bc"][1], Pair)
    for w, g in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
        assert torch.equal(w, g)
    assert got_log.summary() == want_log.summary()


def test_psum_of_a_tuple_matches_jax():
    from jax_helpers import jax_mesh

    import jax
    import numpy as np

    x, y = np.arange(16.0).reshape(8, 2), np.arange(8.0)
    m = jax_mesh((8,), ("i",))
    jp = jax.sharding.PartitionSpec
    want = jax.shard_map(lambda a, b: jax.lax.psum((a, b), "i"), mesh=m, in_specs=(jp("i"), jp("i")),
                         out_specs=(jp(), jp()))(x, y)
    got = sm(lambda a, b: shmap.psum((a, b), "i"), MESH8, (P("i"), P("i")), (P(), P()))(
        torch.tensor(x), torch.tensor(y))
    assert isinstance(got, tuple) and len(got) == 2
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(w), g.numpy())


def test_collectives_over_no_axes_are_the_identity_as_jax_s():
    """`psum(x, ())` and the others move nothing in JAX (code reducing over a computed tuple of axes may find it
    empty); axis_index(()) is 0 and axis_size(()) 1; pmax and pmin refuse, as JAX's.  shmap raised for all."""
    from jax_helpers import jax_mesh

    import jax
    import numpy as np

    jl = jax.lax
    calls = {  # name: (jax, shmap)
        "psum": (lambda v: jl.psum(v, ()), lambda v: shmap.psum(v, ())),
        "pmean": (lambda v: jl.pmean(v, ()), lambda v: shmap.pmean(v, ())),
        "all_gather": (lambda v: jl.all_gather(v, ()), lambda v: shmap.all_gather(v, ())),
        "all_gather tiled": (lambda v: jl.all_gather(v, (), tiled=True), lambda v: shmap.all_gather(v, (), tiled=True)),
        "psum_scatter": (lambda v: jl.psum_scatter(v, (), tiled=True),
                         lambda v: shmap.psum_scatter(v, (), tiled=True)),
        "ppermute": (lambda v: jl.ppermute(v, (), [(0, 0)]), lambda v: shmap.ppermute(v, (), [(0, 0)])),
        "all_to_all": (lambda v: jl.all_to_all(v, (), 0, 0, tiled=True),
                       lambda v: shmap.all_to_all(v, (), 0, 0, tiled=True)),
        "axis_index": (lambda v: v + jl.axis_index(()), lambda v: v + shmap.axis_index(())),
        "axis_size": (lambda v: v * jl.axis_size(()), lambda v: v * shmap.axis_size(())),
    }
    x = np.arange(8.0).reshape(4, 2)
    m = jax_mesh((2,), ("i",))
    jp = jax.sharding.PartitionSpec
    for name, (jf, sf) in calls.items():
        want = np.asarray(jax.shard_map(jf, mesh=m, in_specs=jp("i"), out_specs=jp("i"))(x))
        got = shmap.shard_map(sf, mesh=shmap.make_mesh((2,), ("i",)), in_specs=P("i"), out_specs=P("i"))(
            torch.tensor(x))
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)
    with pytest.raises(ValueError):
        jax.shard_map(lambda v: jl.pmax(v, ()), mesh=m, in_specs=jp("i"), out_specs=jp("i"))(x)
    with pytest.raises(TypeError, match=r"got \(\) \(JAX's pmax and pmin refuse no axes too"):
        sm(lambda v: shmap.pmax(v, ()), shmap.make_mesh((2,), ("i",)), P("i"), P("i"))(torch.tensor(x))
