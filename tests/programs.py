"""A tiny program DSL for generated shard_map cases, rendered to three backends.

A :class:`Program` is a mesh, some inputs (global shape + in_spec), a straight
line of SSA steps and some outputs (value + out_spec).  One program renders to

* **shmap**: a body calling ``shmap.*`` collectives and torch ops;
* **JAX**: the same body with ``jax.lax`` / ``jax.numpy`` under ``jax.shard_map``;
* **reference**: a lockstep body for :func:`reference.reference_shard_map`.

Each op is an :class:`OpDef` holding its three renderers *and* its typing rule
(``infer``: per-device shape and set of varying mesh axes, raising
:class:`Invalid` when a precondition fails).  The hypothesis strategy
:func:`programs` proposes candidate steps and keeps only those ``infer``
accepts, so the generator cannot drift from the rules it is checking.  The
typing rules follow JAX 0.10.2 with ``check_vma=True``, including where it is
stricter than REFERENCE.md (``psum``/``pmean``/``psum_scatter`` refuse an
operand that varies along only part of the named axes; ``pvary`` refuses axes
the value already varies along).

One JAX quirk is *not* followed: ``lax.ppermute``/``lax.pshuffle`` over a tuple
of axes linearise the devices in mesh order whatever the tuple's order (their
lowering sorts device ids), while ``axis_index``, ``all_gather``, ``psum_scatter``
and ``all_to_all`` honour the tuple's major-to-minor order.  REFERENCE.md says
tuples are linearised major-to-minor in the given order, so the reference does
that everywhere and JAX comparisons only draw mesh-ordered tuples for these two
(``jax_compatible=True``); test_reference pins the quirk down.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from hypothesis import HealthCheck, Phase, reject, strategies as st

from reference import axis_tuple, entry_axes, padded_spec, reference_shard_map

AXIS_POOL = ("i", "j", "k")

#: Shared by the generated-case tests: deterministic (derandomize, no example
#: database) so CI always sees the same cases.  Shrinking is off by default
#: because a shard_map case costs a JAX compile per attempt and shrinking can
#: take many minutes; set SHMAP_TEST_SHRINK=1 to get a minimal failing program.
HYPOTHESIS_SETTINGS = dict(
    deadline=None, derandomize=True, database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    + ([Phase.shrink] if os.environ.get("SHMAP_TEST_SHRINK") else []),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                           HealthCheck.data_too_large])
MAX_LOCAL_NUMEL = 96  # keeps every generated case fast (and shrinks well)


class Invalid(ValueError):
    """A step whose shape or variance precondition does not hold."""


# ----------------------------------------------------------------------------
# Program representation
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Input:
    name: str
    global_shape: tuple[int, ...]
    spec: tuple  # entries: None | str | tuple[str, ...]


@dataclass(frozen=True)
class Step:
    out: str
    op: str
    args: tuple[str, ...]
    params: dict = field(default_factory=dict)

    def __repr__(self):
        ps = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return f"{self.out} = {self.op}({', '.join(self.args)}{ps})"


@dataclass(frozen=True)
class Program:
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    inputs: tuple[Input, ...]
    steps: tuple[Step, ...]
    outputs: tuple[tuple[str, tuple], ...]  # (value name, out_spec)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.mesh_shape))

    @property
    def in_specs(self) -> tuple:
        return tuple(i.spec for i in self.inputs)

    @property
    def out_specs(self) -> tuple:
        return tuple(spec for _, spec in self.outputs)

    @property
    def ops(self) -> set[str]:
        return {s.op for s in self.steps}

    def types(self) -> dict[str, tuple[tuple[int, ...], frozenset]]:
        """Per-device (shape, varying axes) of every value; validates every step."""
        sizes = self.sizes
        env = {}
        for inp in self.inputs:
            entries = padded_spec(inp.spec, len(inp.global_shape))
            shape = tuple(g // _size(sizes, axes) for g, axes in zip(inp.global_shape, entries))
            env[inp.name] = (shape, frozenset(a for axes in entries for a in axes))
        for s in self.steps:
            env[s.out] = OPS[s.op].infer(sizes, *(env[a] for a in s.args), **s.params)
        for name, spec in self.outputs:
            shape, vma = env[name]
            named = {a for axes in padded_spec(spec, len(shape)) for a in axes}
            if not vma <= named:
                raise Invalid(f"output {name} varies along {set(vma - named)} not in {spec}")
        return env

    def output_shapes(self) -> list[tuple[int, ...]]:
        """Global shapes of the outputs."""
        env, sizes = self.types(), self.sizes
        return [tuple(b * _size(sizes, axes) for b, axes in
                      zip(env[n][0], padded_spec(spec, len(env[n][0]))))
                for n, spec in self.outputs]

    def __repr__(self):
        lines = [f"Program(mesh={dict(zip(self.axis_names, self.mesh_shape))}"]
        lines += [f"  {i.name}: global {i.global_shape} in_spec P{i.spec}" for i in self.inputs]
        lines += [f"  {s!r}" for s in self.steps]
        lines += [f"  return {n} out_spec P{spec}" for n, spec in self.outputs]
        return "\n".join(lines) + ")"


def _size(sizes, axes) -> int:
    return math.prod(sizes[a] for a in axis_tuple(axes)) if axes else 1


# ----------------------------------------------------------------------------
# Ops: typing rule + three renderers
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class OpDef:
    """One step kind.

    ``infer(sizes, *arg_types, **params) -> (shape, vma)``;
    ``jax``/``torch``: ``(*args, **params) -> value`` inside a body;
    ``ref``: ``(mesh, *per_device_lists, **params) -> per_device_list``.
    """
    name: str
    infer: Callable
    jax: Callable
    torch: Callable
    ref: Callable
    differentiable: bool = True


def _lax():
    import jax.lax
    return jax.lax


def _jnp():
    import jax.numpy
    return jax.numpy


def _torch():
    import torch
    return torch


def _shmap():
    import shmap
    return shmap


def _check_not_mixed(vma, axes, what):
    axes = set(axis_tuple(axes))
    if axes & vma and not axes <= vma:
        raise Invalid(f"{what} over {axes} of a value varying along only {vma & axes}")


def _infer_reduce(strict):
    def infer(sizes, x, axes):
        if strict:  # JAX: psum/pmean need all-varying or all-invariant axes
            _check_not_mixed(x[1], axes, "psum")
        return x[0], x[1] - set(axis_tuple(axes))
    return infer


def _infer_pvary(sizes, x, axes):
    if set(axis_tuple(axes)) & x[1]:
        raise Invalid("pvary over an axis the value already varies along")
    return x[0], x[1] | set(axis_tuple(axes))


def _gathered_shape(sizes, shape, axes, axis, tiled):
    n = _size(sizes, axes)
    if tiled:
        if not 0 <= axis < len(shape):
            raise Invalid("tiled all_gather axis out of range")
        return shape[:axis] + (shape[axis] * n,) + shape[axis + 1:]
    if not 0 <= axis <= len(shape):
        raise Invalid("all_gather axis out of range")
    return shape[:axis] + (n,) + shape[axis:]


def _infer_all_gather(sizes, x, axes, axis, tiled):
    return _gathered_shape(sizes, x[0], axes, axis, tiled), x[1] | set(axis_tuple(axes))


def _infer_all_gather_invariant(sizes, x, axes, axis, tiled):
    return _gathered_shape(sizes, x[0], axes, axis, tiled), x[1] - set(axis_tuple(axes))


def _infer_psum_scatter(sizes, x, axes, scatter_dimension, tiled):
    shape, n, d = x[0], _size(sizes, axes), scatter_dimension
    _check_not_mixed(x[1], axes, "psum_scatter")
    if not 0 <= d < len(shape):
        raise Invalid("scatter_dimension out of range")
    if tiled:
        if shape[d] % n:
            raise Invalid("tiled psum_scatter needs the dimension divisible by N")
        shape = shape[:d] + (shape[d] // n,) + shape[d + 1:]
    else:
        if shape[d] != n or len(shape) < 2:  # keep rank >= 1
            raise Invalid("untiled psum_scatter needs the dimension equal to N")
        shape = shape[:d] + shape[d + 1:]
    return shape, x[1] | set(axis_tuple(axes))


def _infer_ppermute(sizes, x, axes, perm):
    n = _size(sizes, axes)
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or \
            not all(0 <= v < n for v in srcs + dsts):
        raise Invalid("ppermute perm must be a partial permutation of range(N)")
    return x[0], x[1] | set(axis_tuple(axes))


def _infer_pshuffle(sizes, x, axes, perm):
    if sorted(perm) != list(range(_size(sizes, axes))):
        raise Invalid("pshuffle perm must be a permutation of range(N)")
    return x[0], x[1] | set(axis_tuple(axes))


def _infer_all_to_all(sizes, x, axes, split_axis, concat_axis, tiled):
    shape, n = list(x[0]), _size(sizes, axes)
    if not (0 <= split_axis < len(shape) and 0 <= concat_axis < len(shape)):
        raise Invalid("all_to_all axes out of range")
    if tiled:
        if shape[split_axis] % n:
            raise Invalid("tiled all_to_all needs the split dimension divisible by N")
        shape[split_axis] //= n
        shape[concat_axis] *= n
    else:
        if shape[split_axis] != n:
            raise Invalid("untiled all_to_all needs the split dimension equal to N")
        del shape[split_axis]
        shape.insert(concat_axis, n)
    return tuple(shape), x[1] | set(axis_tuple(axes))


def _infer_binary(sizes, x, y):
    if x[0] != y[0]:
        raise Invalid(f"elementwise operands differ in shape: {x[0]} vs {y[0]}")
    return x[0], x[1] | y[1]


def _infer_matmul(sizes, x, y):
    if len(x[0]) != 2 or len(y[0]) != 2 or x[0][1] != y[0][0]:
        raise Invalid(f"matmul shapes {x[0]} @ {y[0]}")
    return (x[0][0], y[0][1]), x[1] | y[1]


def _infer_sum(sizes, x, dim):
    if len(x[0]) < 2 or not 0 <= dim < len(x[0]):
        raise Invalid("sum needs rank >= 2 (results keep rank >= 1)")
    return x[0][:dim] + x[0][dim + 1:], x[1]


def _infer_add_index(sizes, x, axes):
    return x[0], x[1] | set(axis_tuple(axes))


def _jax_all_to_all(x, axes, split_axis, concat_axis, tiled):
    """JAX 0.10.2 cannot differentiate an untiled all_to_all whose split and
    concat axes differ (the transpose builds a cotangent of the wrong shape),
    so spell it as the equivalent split == concat all_to_all plus a moveaxis.
    test_reference pins both the equivalence and the JAX limitation."""
    if tiled or split_axis == concat_axis:
        return _lax().all_to_all(x, axes, split_axis, concat_axis, tiled=tiled)
    y = _lax().all_to_all(x, axes, split_axis, split_axis, tiled=False)
    return _jnp().moveaxis(y, split_axis, concat_axis)


def _per_device(fn):
    """Lift a per-device numpy function of k operands to lockstep lists."""
    return lambda mesh, *lists, **kw: [fn(*vals, **kw) for vals in zip(*lists)]


def _lax_call(name):
    return lambda x, axes, **kw: getattr(_lax(), name)(x, axes, **kw)


def _shmap_call(name):
    return lambda x, axes, **kw: getattr(_shmap(), name)(x, axes, **kw)


def _coll(name):
    """Reference renderer that calls RefMesh.<name>(vals, axes, **params)."""
    return lambda mesh, x, axes, **kw: getattr(mesh, name)(x, axes, **kw)


def _ref_add_index(mesh, x, axes):
    n, idx = mesh.size(axes), mesh.axis_index(axes)
    return [v * n + i for v, i in zip(x, idx)]


OPS: dict[str, OpDef] = {op.name: op for op in [
    # -- local ops ---------------------------------------------------------
    OpDef("sin", lambda sizes, x: x,
          lambda x: _jnp().sin(x), lambda x: _torch().sin(x),
          _per_device(np.sin)),
    OpDef("add", _infer_binary, lambda x, y: x + y, lambda x, y: x + y,
          _per_device(lambda a, b: a + b)),
    OpDef("mul", _infer_binary, lambda x, y: x * y, lambda x, y: x * y,
          _per_device(lambda a, b: a * b)),
    OpDef("matmul", _infer_matmul, lambda x, y: x @ y, lambda x, y: x @ y,
          _per_device(lambda a, b: a @ b)),
    OpDef("sum", _infer_sum,
          lambda x, dim: x.sum(axis=dim), lambda x, dim: x.sum(dim),
          _per_device(lambda a, dim: a.sum(axis=dim))),
    # x * axis_size(axes) + axis_index(axes): exercises both, makes x vary.
    OpDef("add_index", _infer_add_index,
          lambda x, axes: x * _lax().axis_size(axes) + _lax().axis_index(axes),
          lambda x, axes: x * _shmap().axis_size(axes) + _shmap().axis_index(axes),
          _ref_add_index),
    # -- collectives: same name and signature in jax.lax and shmap ----------
    *(OpDef(name, infer, _lax_call(name), _shmap_call(name), _coll(name),
            differentiable=name not in ("pmax", "pmin"))  # JAX: no derivative
      for name, infer in [("psum", _infer_reduce(strict=True)),
                          ("pmean", _infer_reduce(strict=True)),
                          ("pmax", _infer_reduce(strict=False)),
                          ("pmin", _infer_reduce(strict=False)),
                          ("all_gather", _infer_all_gather),
                          ("psum_scatter", _infer_psum_scatter),
                          ("ppermute", _infer_ppermute),
                          ("pshuffle", _infer_pshuffle)]),
    # -- collectives spelled differently in JAX 0.10.2 ----------------------
    OpDef("pvary", _infer_pvary,
          lambda x, axes: _lax().pcast(x, axes, to="varying"),
          _shmap_call("pvary"), lambda mesh, x, axes: [v.copy() for v in x]),
    OpDef("all_gather_invariant", _infer_all_gather_invariant,
          lambda x, axes, **kw: _lax().all_gather(x, axes, to="invarying", **kw),
          _shmap_call("all_gather_invariant"), _coll("all_gather_invariant")),
    OpDef("all_to_all", _infer_all_to_all, _jax_all_to_all, _shmap_call("all_to_all"),
          _coll("all_to_all")),
]}

COLLECTIVES = ("psum", "pmean", "pmax", "pmin", "pvary", "all_gather", "all_gather_invariant",
               "psum_scatter", "ppermute", "pshuffle", "all_to_all")
LOCAL_OPS = ("sin", "add", "mul", "matmul", "sum", "add_index")


# ----------------------------------------------------------------------------
# Renderers
# ----------------------------------------------------------------------------
def _run_steps(program: Program, impl: Callable, inputs, typeof=None):
    """Evaluate the steps; with ``typeof(value) -> (shape, vma)``, also check
    every value's per-device shape and varying axes against ``program.types()``."""
    env = dict(zip((i.name for i in program.inputs), inputs))
    expected = program.types() if typeof else {}

    def check(name):
        if typeof:
            got = typeof(env[name])
            want = (expected[name][0], set(expected[name][1]))
            assert (tuple(got[0]), set(got[1])) == want, \
                f"{name}: (shape, vma) is {got}, typing rule says {want}\n{program}"

    for inp in program.inputs:
        check(inp.name)
    for s in program.steps:
        env[s.out] = impl(s)(*(env[a] for a in s.args), **s.params)
        check(s.out)
    return tuple(env[name] for name, _ in program.outputs)


def jax_typeof(x):
    import jax
    return x.shape, jax.typeof(x).mat.varying


def shmap_typeof(x):
    return x.shape, _shmap().vma(x)


def render_jax_body(program: Program, check_types=False) -> Callable:
    return lambda *xs: _run_steps(program, lambda s: OPS[s.op].jax, xs,
                                  jax_typeof if check_types else None)


def render_torch_body(program: Program, check_types=False) -> Callable:
    return lambda *xs: _run_steps(program, lambda s: OPS[s.op].torch, xs,
                                  shmap_typeof if check_types else None)


def render_reference(program: Program) -> Callable:
    """A lockstep body: ``(mesh, *per_device_lists) -> tuple of lists``."""
    def body(mesh, *xs):
        return _run_steps(program, lambda s: (lambda *a, **kw: OPS[s.op].ref(mesh, *a, **kw)), xs)
    return body


def reference_fn(program: Program) -> Callable:
    return reference_shard_map(render_reference(program), program.mesh_shape,
                               program.axis_names, program.in_specs, program.out_specs)


def jax_fn(program: Program, jit: bool = True, check_types: bool = False) -> Callable:
    """``jax.shard_map`` of the program: ``(*arrays) -> tuple of arrays``."""
    import jax
    from jax_helpers import jax_mesh, jax_spec
    f = jax.shard_map(render_jax_body(program, check_types),
                      mesh=jax_mesh(program.mesh_shape, program.axis_names),
                      in_specs=tuple(jax_spec(s) for s in program.in_specs),
                      out_specs=tuple(jax_spec(s) for s in program.out_specs), check_vma=True)
    return jax.jit(f) if jit else f


def shmap_fn(program: Program, check_types: bool = False) -> Callable:
    """``shmap.shard_map`` of the program: ``(*tensors) -> tuple of tensors``."""
    shmap = _shmap()
    return shmap.shard_map(render_torch_body(program, check_types),
                           mesh=shmap.make_mesh(program.mesh_shape, program.axis_names),
                           in_specs=tuple(shmap.P(*s) for s in program.in_specs),
                           out_specs=tuple(shmap.P(*s) for s in program.out_specs),
                           check_vma=True)


def random_inputs(program: Program, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(i.global_shape) for i in program.inputs]


# ----------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------
@st.composite
def meshes(draw, max_devices=8):
    """1-3 named axes, product <= max_devices; size-1 axes included."""
    k = draw(st.integers(1, 3))
    shape = []
    for _ in range(k):
        room = max_devices // math.prod(shape or [1])
        shape.append(draw(st.sampled_from([s for s in (1, 2, 3, 4, 8) if s <= room])))
    return tuple(shape), AXIS_POOL[:k]


class _Builder:
    """Mutable state while drawing one program."""

    def __init__(self, draw, mesh_shape, names, ops, jax_compatible):
        self.draw, self.names, self.ops = draw, names, ops
        self.jax_compatible = jax_compatible
        self.sizes = dict(zip(names, mesh_shape))
        self.inputs: list[Input] = []
        self.steps: list[Step] = []
        self.types: dict[str, tuple] = {}

    # -- drawing helpers -----------------------------------------------------
    def axis_choices(self):
        """Every non-empty ordered subset of mesh axes (order = linearisation)."""
        return [p for r in range(1, len(self.names) + 1)
                for c in itertools.combinations(self.names, r)
                for p in itertools.permutations(c)]

    def as_arg(self, axes: tuple):
        """A single axis is passed as a bare name or a 1-tuple, both valid."""
        if len(axes) == 1 and self.draw(st.booleans()):
            return axes[0]
        return axes

    def local_shape(self, rank=None, min_rank=1, max_rank=3):
        rank = self.draw(st.integers(min_rank, max_rank)) if rank is None else rank
        return tuple(self.draw(st.integers(1, 3)) for _ in range(rank))

    def new_input(self, local_shape) -> str:
        """A fresh input with this per-device shape and a random spec."""
        rank = len(local_shape)
        dims: list[list[str]] = [[] for _ in range(rank)]
        for a in self.draw(st.permutations(self.names)):
            where = self.draw(st.integers(-1, rank - 1)) if rank else -1
            if where >= 0:  # -1: unmentioned axis, the input is a full copy along it
                dims[where].append(a)
        spec = [None if not d else (self.as_arg(tuple(d)) if len(d) == 1 else tuple(d))
                for d in dims]
        while spec and spec[-1] is None and self.draw(st.booleans()):
            spec.pop()  # missing trailing entries mean None
        name = f"x{len(self.inputs)}"
        gshape = tuple(s * _size(self.sizes, entry_axes(e)) for s, e in
                       zip(local_shape, spec + [None] * (rank - len(spec))))
        self.inputs.append(Input(name, gshape, tuple(spec)))
        self.types[name] = (tuple(local_shape), frozenset(a for d in dims for a in d))
        return name

    def pick_value(self) -> str:
        names = list(self.types)
        # Favour the most recent value so that steps chain into deep programs.
        if self.draw(st.booleans()):
            return names[-1]
        return self.draw(st.sampled_from(names))

    def emit(self, op, args, params) -> str:
        out = OPS[op].infer(self.sizes, *(self.types[a] for a in args), **params)
        name = f"v{len(self.steps)}"
        self.steps.append(Step(name, op, tuple(args), dict(params)))
        self.types[name] = out
        return name

    def try_candidates(self, op, args, candidates):
        """Emit ``op`` with one of the parameter sets that type-check, if any."""
        ok = []
        for params in candidates:
            try:
                shape, _ = OPS[op].infer(self.sizes, *(self.types[a] for a in args), **params)
            except Invalid:
                continue
            if math.prod(shape) <= MAX_LOCAL_NUMEL:
                ok.append(params)
        if not ok:
            return None
        params = dict(self.draw(st.sampled_from(ok)))
        if "axes" in params:
            params["axes"] = self.as_arg(params["axes"])
        return self.emit(op, args, params)

    # -- one step -------------------------------------------------------------
    def step(self, op=None) -> str | None:
        """Append one step (``op`` or a random one); None if it did not fit."""
        op = op or self.draw(st.sampled_from(self.ops))
        x = self.pick_value()
        shape, _ = self.types[x]
        r = len(shape)
        axes = self.axis_choices()
        if op in ("sin",):
            return self.emit(op, (x,), {})
        if op in ("add", "mul"):
            same = [v for v, t in self.types.items() if t[0] == shape]
            # A fresh input usually has a different variance: forces auto-pvary.
            fresh = self.draw(st.booleans())
            y = self.new_input(shape) if fresh else self.draw(st.sampled_from(same))
            return self.emit(op, (x, y), {})
        if op == "matmul":
            if r != 2:
                x = self.new_input(self.local_shape(rank=2))
                shape = self.types[x][0]
            fits = [v for v, t in self.types.items() if len(t[0]) == 2 and t[0][0] == shape[1]]
            if not fits or self.draw(st.booleans()):
                fits = [self.new_input((shape[1], self.draw(st.integers(1, 3))))]
            return self.emit(op, (x, self.draw(st.sampled_from(fits))), {})
        if op == "sum":
            return self.try_candidates(op, (x,), [{"dim": d} for d in range(r)])
        if op in ("add_index", "psum", "pmean", "pmax", "pmin", "pvary"):
            return self.try_candidates(op, (x,), [{"axes": a} for a in axes])
        if op in ("all_gather", "all_gather_invariant"):
            return self.try_candidates(op, (x,), [
                {"axes": a, "axis": d, "tiled": t} for a in axes for t in (False, True)
                for d in range(r + (0 if t else 1))])
        if op in ("ppermute", "pshuffle"):
            if self.jax_compatible:  # JAX linearises these in mesh order: see module doc
                axes = [a for a in axes if list(a) == sorted(a, key=self.names.index)]
            a = self.draw(st.sampled_from(axes))
            n = _size(self.sizes, a)
            dst = self.draw(st.permutations(range(n)))
            if op == "pshuffle":
                return self.try_candidates(op, (x,), [{"axes": a, "perm": list(dst)}])
            keep = self.draw(st.lists(st.booleans(), min_size=n, max_size=n))
            perm = [(s, d) for s, d, k in zip(range(n), dst, keep) if k]
            return self.try_candidates(op, (x,), [{"axes": a, "perm": perm}])
        if op in ("psum_scatter", "all_to_all"):
            if self.draw(st.booleans()):
                # Existing values rarely have a dimension equal to N: make one.
                n = _size(self.sizes, self.draw(st.sampled_from(axes)))
                local = list(self.local_shape(min_rank=2))
                local[self.draw(st.integers(0, len(local) - 1))] = n * self.draw(st.integers(1, 2))
                x, r = self.new_input(tuple(local)), len(local)
            if op == "psum_scatter":
                cands = [{"axes": a, "scatter_dimension": d, "tiled": t}
                         for a in axes for d in range(r) for t in (False, True)]
            else:
                cands = [{"axes": a, "split_axis": s, "concat_axis": c, "tiled": t}
                         for a in axes for s in range(r) for c in range(r) for t in (False, True)]
            return self.try_candidates(op, (x,), cands)
        raise AssertionError(f"no generator for op {op}")

    # -- outputs --------------------------------------------------------------
    def output(self, name) -> tuple[str, tuple]:
        """Psum over a random subset of the varying axes, name the rest."""
        shape, vma = self.types[name]
        ordered = [a for a in self.names if a in vma]
        if shape:
            reduce = [a for a in ordered if self.draw(st.booleans())]
        else:
            reduce = ordered  # a scalar cannot name axes: reduce them all
        if reduce:
            axes = tuple(self.draw(st.permutations(reduce)))
            name = self.emit("psum", (name,), {"axes": self.as_arg(axes)})
            shape, vma = self.types[name]
        named = list(vma)
        if shape:  # optionally tile along invariant axes too
            named += [a for a in self.names if a not in vma and self.draw(st.booleans())]
        dims: list[list[str]] = [[] for _ in shape]
        for a in self.draw(st.permutations(sorted(named))):
            dims[self.draw(st.integers(0, len(shape) - 1))].append(a)
        spec = [None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in dims]
        while spec and spec[-1] is None:
            spec.pop()
        return name, tuple(spec)


@st.composite
def programs(draw, *, differentiable=False, max_steps=5, ops=None, focus=None,
             jax_compatible=True):
    """Valid programs: every step type-checks and every output is legal.

    ``differentiable=True`` leaves out ops JAX cannot differentiate (pmax/pmin).
    ``jax_compatible=False`` also allows ppermute/pshuffle over axis tuples not
    in mesh order, where JAX 0.10.2 disagrees with REFERENCE.md (see top).
    ``focus``: an op that must appear (so every collective gets its share of
    the example budget when a test is parametrised over ops).
    """
    mesh_shape, names = draw(meshes())
    ops = [o for o in (ops or OPS) if OPS[o].differentiable or not differentiable]
    b = _Builder(draw, mesh_shape, names, sorted(ops), jax_compatible)
    for _ in range(draw(st.integers(1, 2))):
        b.new_input(b.local_shape())
    n_steps = draw(st.integers(1, max_steps))
    focus_at = draw(st.integers(0, n_steps - 1)) if focus else -1
    for k in range(n_steps):
        if k != focus_at:
            b.step()
        elif not any(b.step(focus) for _ in range(4)):
            reject()  # the focus op never fitted; hypothesis draws another case
    last = list(b.types)[-1]
    outs = [last] + ([b.pick_value()] if draw(st.booleans()) else [])
    outputs = tuple(b.output(o) for o in outs)
    prog = Program(tuple(mesh_shape), tuple(names), tuple(b.inputs), tuple(b.steps), outputs)
    prog.types()  # re-validate the finished program from scratch
    return prog
