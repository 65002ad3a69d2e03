"""Nested shard_map: `axis_names` leaves mesh axes free, an inner shard_map binds them.

Each program is written once against an ops namespace and run three ways:

* `jax.shard_map` nested (the inner call without a mesh: JAX takes the context
  mesh): outputs, and the collectives of the backward pass, read from the
  jaxpr of the VJP (JAX 0.10.2 traces it but cannot lower it: "operates on
  axis 'i' which is already bound by a parent sdy.manual_computation", so
  its gradients cannot be run);
* the same program with each shard_map emulated by `jax.vmap` over the blocks
  with named axes (shard_map's meaning without the typing): outputs and first-
  and second-order gradients;
* `shmap.shard_map`, which must match both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as JP

import shmap
from differential import as_tuple, assert_close, jax_gradients, shmap_gradients, tensors
from jax_helpers import count_collectives, jax_mesh
from shmap import P


# ----------------------------------------------------------------------------
# Three spellings of shard_map
# ----------------------------------------------------------------------------
class JaxOps:
    psum, pmean = staticmethod(jax.lax.psum), staticmethod(jax.lax.pmean)
    all_gather, ppermute = staticmethod(jax.lax.all_gather), staticmethod(jax.lax.ppermute)
    axis_index = staticmethod(jax.lax.axis_index)
    sin, tanh = staticmethod(jnp.sin), staticmethod(jnp.tanh)
    P = staticmethod(JP)

    def __init__(self, shape, names):
        self.mesh = jax_mesh(shape, names)
        self.depth = 0

    def shard_map(self, f, in_specs, out_specs, axis_names):
        mesh = self.mesh if self.depth == 0 else None  # an inner call takes the context mesh

        def body(*a):
            self.depth += 1
            try:
                return f(*a)
            finally:
                self.depth -= 1

        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(axis_names))


class VmapOps(JaxOps):
    """shard_map as vmap over blocks with named axes (single-axis spec entries only)."""

    def __init__(self, shape, names):
        self.sizes = dict(zip(names, shape))

    def shard_map(self, f, in_specs, out_specs, axis_names):
        axes = [a for a in self.sizes if a in axis_names]
        single = not isinstance(out_specs, tuple)
        outs = (out_specs,) if single else out_specs

        def mapped(rest, *args):
            if not rest:
                return f(*args)
            a, n = rest[0], self.sizes[rest[0]]
            split, in_axes = [], []
            for x, s in zip(args, in_specs):
                d = _dim_of(s, a)
                if d is None:
                    split.append(x)
                    in_axes.append(None)
                else:
                    x = x.reshape(x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1:])
                    split.append(jnp.moveaxis(x, d, 0))
                    in_axes.append(0)
            res = jax.vmap(lambda *xs: as_tuple(mapped(rest[1:], *xs)), in_axes=tuple(in_axes),
                           axis_name=a, axis_size=n)(*split)
            merged = []
            for y, s in zip(res, outs):
                d = _dim_of(s, a)
                if d is None:
                    merged.append(y[0])  # invariant along a (the typed program checks it)
                else:
                    y = jnp.moveaxis(y, 0, d)
                    merged.append(y.reshape(y.shape[:d] + (n * y.shape[d + 1],) + y.shape[d + 2:]))
            return tuple(merged)

        def call(*args):
            r = mapped(axes, *args)
            return r[0] if single else r

        return call


def _dim_of(spec, a):
    """The dimension `spec` splits over axis `a` (tuple entries must list axes in mesh order, which is
    the order the emulation splits in: major first)."""
    for k, e in enumerate(spec):
        if e == a or (isinstance(e, tuple) and a in e):
            return k
    return None


class ShmapOps:
    psum, pmean = staticmethod(shmap.psum), staticmethod(shmap.pmean)
    all_gather, ppermute = staticmethod(shmap.all_gather), staticmethod(shmap.ppermute)
    axis_index = staticmethod(shmap.axis_index)
    sin, tanh = staticmethod(torch.sin), staticmethod(torch.tanh)
    P = staticmethod(P)

    def __init__(self, shape, names):
        self.mesh = shmap.make_mesh(shape, names)

    def shard_map(self, f, in_specs, out_specs, axis_names):
        return shmap.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                               axis_names=set(axis_names))


# ----------------------------------------------------------------------------
# Programs: program(o) returns the global function
# ----------------------------------------------------------------------------
def outer_i_inner_j(o):
    """The inner body uses both its own axis and the outer one; w is invariant throughout."""
    def inner(x, w):
        return o.psum(o.sin(x) * w, "j") + o.psum(x, "i")

    def outer(x, w):
        y = o.shard_map(inner, (o.P("j"), o.P()), o.P("j"), {"j"})(x, w)
        return y * 2 + x

    return o.shard_map(outer, (o.P("i"), o.P()), o.P("i"), {"i"})


def outer_j_inner_i(o):
    """The outer axis is the minor mesh axis: inner values put 'i' in front of 'j'."""
    def inner(x):
        g = o.all_gather(o.tanh(x), "j", axis=1, tiled=True)
        return g * (o.axis_index("i") + 1.0)

    def outer(x):
        y = o.shard_map(inner, (o.P("i"),), o.P("i"), {"i"})(x)
        return o.psum(y, "j")

    return o.shard_map(outer, (o.P(None, "j"),), o.P(), {"j"})


def tiled_invariant_output(o):
    """The inner output is invariant along 'j' but its spec tiles it (a pvary, psum'd backward);
    the outer body closes nothing over and reduces over 'i'."""
    def inner(x, w):
        return o.psum(x * w, "j")

    def outer(x, w):
        y = o.shard_map(inner, (o.P(None, "j"), o.P("j")), o.P("j"), {"j"})(x, w)
        return o.pmean(y * y, "i")

    return o.shard_map(outer, (o.P("i"), o.P()), o.P(), {"i"})


def three_axes(o):
    """Mesh (i, j, k): the outer call binds i and k, two inner calls bind j in turn."""
    def inner1(x):
        n = 2
        return o.ppermute(o.sin(x), "k", [(a, (a + 1) % n) for a in range(n)]) + o.psum(x, ("i", "j"))

    def inner2(x, y):
        return o.psum(x * y, "j")

    def outer(x):
        y = o.shard_map(inner1, (o.P("j"),), o.P("j"), {"j"})(x)
        z = o.shard_map(inner2, (o.P("j"), o.P("j")), o.P(), {"j"})(y, x)
        return z + o.psum(y, "k")[: z.shape[0]]

    return o.shard_map(outer, (o.P(("i", "k")),), o.P(("i", "k")), {"i", "k"})


def replicated_into_inner(o):
    """An outer value varying along 'i' enters the inner call with P(): it keeps varying along 'i'."""
    def inner(a, b):
        return o.psum(a @ b, "j")

    def outer(a, b):
        h = o.tanh(a)
        return o.shard_map(inner, (o.P(None, "j"), o.P("j")), o.P(), {"j"})(h, b)

    return o.shard_map(outer, (o.P("i"), o.P()), o.P("i"), {"i"})


CASES = [
    ("outer_i_inner_j", outer_i_inner_j, ((2, 4), ("i", "j")), [(16,), ()]),
    ("outer_j_inner_i", outer_j_inner_i, ((2, 4), ("i", "j")), [(4, 8)]),
    ("tiled_invariant_output", tiled_invariant_output, ((2, 2), ("i", "j")), [(4, 4), (4,)]),
    ("three_axes", three_axes, ((2, 2, 2), ("i", "j", "k")), [(16,)]),
    ("replicated_into_inner", replicated_into_inner, ((2, 4), ("i", "j")), [(4, 8), (8, 3)]),
]


def jax_backward_collectives(f, args, cots):
    """Collectives of the backward pass: those of the VJP's jaxpr (forward and transpose) minus the
    forward's.  JAX cannot lower a nested shard_map's VJP, but it traces it."""
    total = count_collectives(jax.make_jaxpr(lambda xs, ct: jax.vjp(f, *xs)[1](ct))(
        tuple(args), tuple(cots) if isinstance(jax.eval_shape(f, *args), tuple) else cots[0]))
    total.subtract(count_collectives(jax.make_jaxpr(f)(*args)))
    return +total


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_nested_shard_map_matches_jax(case):
    name, program, (shape, names), shapes = case
    rng = np.random.default_rng(len(name))
    args = [rng.standard_normal(s) for s in shapes]
    f_jax = program(JaxOps(shape, names))
    f_vmap = program(VmapOps(shape, names))
    f_sh = program(ShmapOps(shape, names))

    want = [np.asarray(w) for w in as_tuple(jax.jit(f_jax)(*args))]
    emulated = as_tuple(jax.jit(f_vmap)(*args))
    got = as_tuple(f_sh(*tensors(args)))
    for k, (g, w, e) in enumerate(zip(got, want, emulated)):
        assert_close(e, w, f"{name}: output {k}, vmap emulation vs jax.shard_map")
        assert_close(g, w, f"{name}: output {k} vs jax.shard_map")

    cots = [rng.standard_normal(w.shape) for w in want]
    jg1, jg2 = jax_gradients(f_vmap, args, cots, True)
    sg1, sg2, backward = shmap_gradients(f_sh, args, cots, True)
    for k, (g, w) in enumerate(zip(sg1, jg1)):
        assert_close(g, w, f"{name}: d/d input {k}")
    for k, (g, w) in enumerate(zip(sg2, jg2)):
        assert_close(g, w, f"{name}: second order d/d input {k}")
    assert backward == jax_backward_collectives(f_jax, args, cots), name


def test_backward_collectives_of_the_first_case():
    """Worked by hand: w's pvary over (i, j) and the pvarys that line up psum('j') (varying along i)
    with psum('i') (varying along j) for the sum: three psums, none of the forward psums' transposes."""
    f = outer_i_inner_j(ShmapOps((2, 4), ("i", "j")))
    x, w = tensors([np.ones(16), np.ones(())], requires_grad=True)
    y = f(x, w)
    with shmap.comm_log() as log:
        y.sum().backward()
    assert sorted(e.axes for e in log.events) == [("i",), ("i", "j"), ("j",)]


# ----------------------------------------------------------------------------
# Semantics and errors
# ----------------------------------------------------------------------------
def test_outer_values_close_over_into_inner():
    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    x = torch.arange(8.)

    def outer(x):
        s = shmap.psum(x, "i")                       # invariant along i, whole along j
        scale = x * 0 + shmap.axis_index("i")        # varying along i, closed over by the inner body

        def inner(xj):
            total = shmap.psum(scale, "i")           # a collective on a closed-over outer value
            return xj * scale[: xj.shape[0]] + s[: xj.shape[0]] + total[: xj.shape[0]]

        return shmap.shard_map(inner, mesh=mesh, in_specs=P("j"), out_specs=P("j"), axis_names={"j"})(x)

    got = shmap.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})(x)
    blocks = x.reshape(2, 4)
    s = blocks.sum(0)
    want = torch.cat([(blocks[i].reshape(2, 2) * i + s[:2] + 1.0).reshape(4) for i in range(2)])
    assert torch.equal(got, want)


def test_default_axis_names_bind_the_free_axes():
    mesh = shmap.make_mesh((2, 3), ("i", "j"))

    def outer(x):
        return shmap.shard_map(lambda v: shmap.psum(v, ("i", "j")), mesh=mesh, in_specs=P("j"),
                               out_specs=P())(x)

    got = shmap.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P(), axis_names={"i"})(torch.ones(12))
    assert torch.equal(got, torch.full((2,), 6.0))  # blocks of 12 / (2 * 3), summed over 6 devices


def test_error_inner_axis_shadows_outer():
    mesh = shmap.make_mesh((2, 2), ("i", "j"))

    def outer(x):
        return shmap.shard_map(lambda v: v, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})(x)

    with pytest.raises(shmap.SpecError, match=r"already handles mesh axes \('i',\).*Fix: pass axis_names=\{'j'\}"):
        shmap.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})(torch.ones(4))


def test_error_no_free_axis():
    mesh = shmap.make_mesh((2,), ("i",))

    def outer(x):
        return shmap.shard_map(lambda v: v, mesh=mesh, in_specs=P(), out_specs=P())(x)

    with pytest.raises(shmap.SpecError, match="no free axis"):
        shmap.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.ones(4))


def test_error_inner_spec_names_outer_axis():
    mesh = shmap.make_mesh((2, 2), ("i", "j"))

    def outer(x):
        return shmap.shard_map(lambda v: v, mesh=mesh, in_specs=P("i"), out_specs=P("j"), axis_names={"j"})(x)

    with pytest.raises(shmap.SpecError, match=r"names mesh axis 'i', which is not manual"):
        shmap.shard_map(outer, mesh=mesh, in_specs=P(None), out_specs=P(), axis_names={"i"})(torch.ones(4))


def test_error_inner_output_varies_along_own_axis():
    mesh = shmap.make_mesh((2, 2), ("i", "j"))

    def outer(x):
        return shmap.shard_map(lambda v: v, mesh=mesh, in_specs=P("j"), out_specs=P(), axis_names={"j"})(x)

    with pytest.raises(shmap.VmaError, match=r"does not mention 'j'"):
        shmap.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})(torch.ones(8))
