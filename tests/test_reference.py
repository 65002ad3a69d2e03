"""The numpy loop-over-mesh reference agrees with JAX on generated programs.

The reference (tests/reference.py) is the oracle for shmap's outputs, so it
must itself be right: here it is checked against ``jax.shard_map`` with
``check_vma=True`` on hypothesis-generated programs (random meshes of up to 8
devices with 1-3 axes, tuple spec entries, unmentioned axes, every collective).
Nothing here imports shmap, so this file is meaningful before shmap exists.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import Phase, given, settings, strategies as st

import programs as pg
from reference import RefMesh, entry_axes, reference_shard_map

SETTINGS = pg.HYPOTHESIS_SETTINGS


def check_reference_matches_jax(program, seed):
    args = pg.random_inputs(program, seed)
    ref = pg.reference_fn(program)(*args)
    # check_types: JAX's own vma for every value must match the generator's
    # typing rules, so the rules the generator relies on are JAX's.
    got = pg.jax_fn(program, check_types=True)(*args)
    assert len(ref) == len(got) == len(program.outputs)
    for k, (r, g, shape) in enumerate(zip(ref, got, program.output_shapes())):
        assert r.shape == tuple(shape), f"output {k}: reference shape {r.shape}, typed {shape}"
        assert g.shape == r.shape, f"output {k}: jax {g.shape} vs reference {r.shape}\n{program}"
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-10, atol=1e-12,
                                   err_msg=f"output {k}\n{program}")


@pytest.mark.parametrize("focus", pg.COLLECTIVES + ("add_index", "matmul"))
@settings(max_examples=15, **SETTINGS)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_reference_matches_jax_per_collective(focus, data, seed):
    """Every collective gets examples of its own (with random surrounding steps)."""
    program = data.draw(pg.programs(focus=focus), label="program")
    assert focus in program.ops
    check_reference_matches_jax(program, seed)


@settings(max_examples=100, **SETTINGS)
@given(program=pg.programs(max_steps=6), seed=st.integers(0, 2**16))
def test_reference_matches_jax_mixed(program, seed):
    check_reference_matches_jax(program, seed)


# -- the reference's own guarantees ------------------------------------------
def test_split_and_assemble_follow_spec_order():
    """P(('i','j')) linearises i-major; P(('j','i')) j-major; assembly inverts split."""
    mesh = RefMesh((2, 3), ("i", "j"))
    x = np.arange(12.0).reshape(6, 2)
    blocks_ij = mesh.split(x, (("i", "j"),))
    blocks_ji = mesh.split(x, (("j", "i"),))
    # Device (i=1, j=0) is device 3 in row-major order.
    np.testing.assert_array_equal(blocks_ij[3], x[3:4])  # 1*3 + 0
    np.testing.assert_array_equal(blocks_ji[3], x[1:2])  # 0*2 + 1
    np.testing.assert_array_equal(mesh.assemble(blocks_ji, (("j", "i"),)), x)
    # Unmentioned axis j: full copies along j, so the output may leave j unnamed.
    blocks = mesh.split(x, ("i",))
    assert all(b.shape == (3, 2) for b in blocks)
    np.testing.assert_array_equal(mesh.assemble(blocks, ("i",)), x)
    # Naming an axis the value is invariant along tiles it.
    np.testing.assert_array_equal(mesh.assemble(blocks, (("i", "j"),)),
                                  np.concatenate([x[:3]] * 3 + [x[3:]] * 3))


def test_reference_rejects_varying_output_left_unnamed():
    """The reference checks replication instead of silently picking device 0."""
    f = reference_shard_map(lambda mesh, x: (x,), (4,), ("i",), in_specs=(("i",),),
                            out_specs=((),))
    with pytest.raises(AssertionError, match="not invariant"):
        f(np.arange(4.0))


def test_generator_covers_the_interesting_cases():
    """Guard against a generator that silently stopped producing some case."""
    seen = set()

    @settings(settings(**SETTINGS), max_examples=300, phases=[Phase.generate])
    @given(program=pg.programs())
    def collect(program):
        seen.update(program.ops)
        types = program.types()
        for inp in program.inputs:
            named = [a for e in inp.spec for a in entry_axes(e)]
            if any(len(entry_axes(e)) > 1 for e in inp.spec):
                seen.add("tuple spec entry")
            if set(program.axis_names) - set(named):
                seen.add("unmentioned axis")
        for s in program.steps:
            if s.op in ("add", "mul", "matmul") and types[s.args[0]][1] != types[s.args[1]][1]:
                seen.add("mixed-variance operands")
        if 1 in program.mesh_shape:
            seen.add("size-1 axis")
        seen.add(f"{len(program.mesh_shape)}-axis mesh")
        if any(len(spec) < len(types[n][0]) for n, spec in program.outputs):
            seen.add("short out_spec")

    collect()
    wanted = set(pg.OPS) | {"tuple spec entry", "unmentioned axis", "mixed-variance operands",
                            "size-1 axis", "1-axis mesh", "2-axis mesh", "3-axis mesh",
                            "short out_spec"}
    assert wanted <= seen, f"never generated: {wanted - seen}"


def test_jax_ppermute_quirk_is_why_generator_orders_tuples():
    """JAX's ppermute linearises ('j','i') in mesh order; the reference does not.

    REFERENCE.md: tuple axes are linearised major-to-minor in the given order,
    as JAX's own axis_index does.  If this starts failing, JAX fixed the quirk
    and ``programs(jax_compatible=...)`` can stop restricting ppermute/pshuffle.
    """
    def program(axes):
        return pg.Program((2, 3), ("i", "j"), (pg.Input("x0", (6,), (("i", "j"),)),),
                          (pg.Step("v0", "ppermute", ("x0",), {"axes": axes, "perm": [(1, 0)]}),),
                          (("v0", (("i", "j"),)),))
    x = np.arange(6.0)
    jax_out = np.asarray(pg.jax_fn(program(("j", "i")))(x)[0])
    np.testing.assert_array_equal(jax_out, pg.reference_fn(program(("i", "j")))(x)[0])
    # Given order: device (0,0) (index 0 along ('j','i')) receives from index 1 = (i=1, j=0).
    np.testing.assert_array_equal(pg.reference_fn(program(("j", "i")))(x)[0], [3, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("split_axis,concat_axis", [(0, 1), (1, 0)])
def test_jax_untiled_all_to_all_workaround(split_axis, concat_axis):
    """programs._jax_all_to_all spells an untiled all_to_all with split != concat
    as (split == concat) + moveaxis, because JAX 0.10.2 cannot differentiate the
    direct form.  Pin both facts: same values as the direct op (and the
    reference), and the direct op's gradient failing.  If the latter starts
    passing, JAX was fixed and the workaround can go."""
    import jax
    from jax.sharding import PartitionSpec as JP
    from jax_helpers import jax_mesh

    def body(direct):
        def f(x):
            if direct:
                return jax.lax.all_to_all(x, "i", split_axis, concat_axis, tiled=False)
            return pg._jax_all_to_all(x, "i", split_axis, concat_axis, tiled=False)
        return jax.shard_map(f, mesh=jax_mesh((3,), ("i",)), in_specs=JP("i"), out_specs=JP("i"))

    x = np.random.default_rng(0).standard_normal((9, 3))
    ref = reference_shard_map(
        lambda mesh, v: (mesh.all_to_all(v, "i", split_axis, concat_axis),),
        (3,), ("i",), (("i",),), (("i",),))(x)[0]
    np.testing.assert_allclose(np.asarray(body(True)(x)), ref, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(body(False)(x)), ref, rtol=1e-12)
    jax.grad(lambda v: (body(False)(v) ** 2).sum())(x)  # the workaround differentiates
    with pytest.raises(ValueError, match="cotangent"):
        jax.grad(lambda v: (body(True)(v) ** 2).sum())(x)
