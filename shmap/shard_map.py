"""`shard_map`: run a per-device function over a mesh, with typed values.

The caller passes global values; each device's block is cut out according to
`in_specs`, the body runs once with every value typed by its device variance,
and the blocks it returns are assembled according to `out_specs` after a
static check that each output is invariant along every axis its spec leaves
out.  All of this is plain torch ops on the backend's physical values, so
`torch.autograd` differentiates through the call, from outside or inside.
Specs are matched to values as pytree prefixes by `spec_tree.py`; the backend
(`backends/protocol.py`) cuts and assembles the blocks.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
import numbers

import torch

from . import context, foreach, nesting, special  # noqa: F401  (special, foreach: fill tensor._SPECIAL before any body runs)
from .backends import for_mesh
from .compile import graph_call, python_state
from .cow import not_an_argument, storage_key
from .errors import SpecError, VmaError, fmt_vma, nested_in_pmap
from .mesh import Mesh, PartitionSpec
from .operands import plain_value
from .spec_tree import cached_match, freeze
from .tensor import ShTensor, logical_shape, vma


def shard_map(f=None, /, *, mesh, in_specs, out_specs, axis_names=None, check_vma=True):
    """Map `f` over the blocks of its arguments on `mesh` (JAX's `shard_map`).

    Usable as `shard_map(f, mesh=..., ...)`, as a decorator factory
    `@shard_map(mesh=..., ...)`, or with `functools.partial`.

    - `in_specs`: a pytree prefix of the positional arguments; each leaf a
      `P(...)` (how to split that argument) or `None` (a static argument,
      passed through untouched).
    - `out_specs`: a pytree prefix of the outputs; each leaf a `P(...)`.
    - `axis_names`: the mesh axes the body handles manually (default: all;
      inside a body over the same mesh, the axes that body leaves free: the
      call nests, and its body binds its parent's axes too).
    - `check_vma`: type values by device variance, insert `pvary`s, check
      `out_specs` statically and transpose collectives efficiently.  With
      False, every value counts as varying and autodiff uses JAX's defensive
      transpose.
    """
    if f is None:
        return functools.partial(
            shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names,
            check_vma=check_vma,
        )
    if not callable(f):
        raise TypeError(f"shard_map: f must be callable, got {type(f).__name__}.")
    if hasattr(f, "_torchdynamo_orig_callable") or isinstance(f, _compiled_module_type()):
        # Dynamo traced a body value's ops wrongly (a square applied twice, a sum dropped): refused.
        raise TypeError(
            "shard_map: f is a torch.compile'd function. Dynamo cannot trace the per-device body on its own "
            "(its values are shard_map's typed body values, not plain tensors). Fix: compile the "
            "shard_mapped function instead, torch.compile(shard_map(f, mesh=..., in_specs=..., "
            "out_specs=...)): the body is then traced once, with its collectives, into the graph."
        )
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"shard_map: mesh must be a shmap.Mesh, got {type(mesh).__name__}. "
            "Fix: mesh = shmap.make_mesh((4, 2), ('i', 'j'))."
        )
    if not isinstance(check_vma, bool):
        raise TypeError(f"shard_map: check_vma must be True or False, got {check_vma!r}.")
    manual = _manual_axes(mesh, axis_names)
    fname = getattr(f, "__name__", "f")
    params = _param_names(f)

    @functools.wraps(f)
    def mapped(*args, **kwargs):
        if kwargs:
            raise TypeError(
                f"shard_map({fname}): keyword arguments {sorted(kwargs)} are not supported; in_specs "
                "describe positional arguments only. Fix: pass them positionally, or bind static ones "
                "with functools.partial before shard_map."
            )
        if torch.compiler.is_compiling():  # Dynamo is tracing: one node of its graph (compile.py)
            return traced(*args, device_mesh=mesh.device_mesh if mesh.is_distributed else None,
                          _state=python_state(f))
        return run(*args)

    in_specs, out_specs = freeze(in_specs), freeze(out_specs)
    plans = ({}, {})  # the spec trees' matches, per argument / output structure (spec_tree.cached_match)

    def run(*args, device_mesh=None):  # (device_mesh: an input of the compiled node only)
        return _call(f, fname, params, mesh, manual, in_specs, out_specs, check_vma, args,
                     default_axes=axis_names is None, plans=plans)

    # torch.compile: Dynamo traces `mapped` (also when it is the compiled function itself) and puts
    # `run` in its graph as one node (`graph_call`), which AOT autograd traces through; on a distributed mesh the
    # DeviceMesh is an input of the node (compile.py).  Dynamo guards a closure by its code object:
    # each shard_map gets its own, so a graph compiled for one is never reused for another.
    n = next(_COUNTER)
    traced = graph_call(run, f"shard_map_{n}")
    mapped.__code__ = mapped.__code__.replace(co_name=f"mapped_{n}")
    return mapped


_COUNTER = itertools.count()


def _compiled_module_type():
    """`torch.compile(module)`'s type, where Dynamo is already imported (else nothing is compiled yet)."""
    import sys

    ev = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(ev, "OptimizedModule", ()) if ev is not None else ()


def _manual_axes(mesh, axis_names):
    if axis_names is None:
        return mesh.axis_names
    ok = isinstance(axis_names, str) or (isinstance(axis_names, (tuple, list, set, frozenset))
                                         and all(isinstance(a, str) for a in axis_names))
    if not ok:
        raise TypeError(f"shard_map: axis_names must be a mesh axis name or a collection of names, got "
                        f"{axis_names!r}. Fix: e.g. axis_names={{'i'}}, or leave it out (all of mesh "
                        f"{mesh.describe()}'s axes).")
    names = {axis_names} if isinstance(axis_names, str) else set(axis_names)
    unknown = [a for a in names if a not in mesh.shape]
    if unknown:
        raise SpecError(
            f"shard_map: axis_names names {unknown[0]!r}, which is not an axis of mesh {mesh.describe()}; "
            f"available axes: {mesh.axis_names}."
        )
    return tuple(a for a in mesh.axis_names if a in names)


def _param_names(f):
    try:
        return [
            p.name for p in inspect.signature(f).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        return []


def _call(f, fname, params, mesh, manual, in_specs, out_specs, check_vma, args, *, default_axes=False,
          parent=None, plans=None, kind="shard_map"):
    backend = for_mesh(mesh)  # simulated, or one process per device under torch.distributed
    if parent is None:
        parent = nesting.parent_for(mesh, args)
    if parent is not None:  # nested in a running body: bind axes it leaves free (see nesting.py)
        manual = nesting.inner_manual(f"shard_map({fname})", mesh, manual, parent, default_axes)
        body = nesting.inner_body(mesh, manual, parent, check_vma, backend, f"{kind}({fname})", kind)
    else:
        body = context.Body(mesh=mesh, axes=manual, check_vma=check_vma, backend=backend, kind=kind)
    plans_in, plans_out = plans or (None, None)
    leaves, rebuild_in = cached_match(plans_in, in_specs, args, "in_specs", params, top=True, fname=fname)
    values = []
    for path, value, spec, arg in leaves:
        if spec is None:
            values.append(value)
            continue
        values.append(_enter(path, value, spec, body, mesh, fname, _Argument(arg, params)))
    body_args = rebuild_in(values)

    stack = context.stack()
    stack.append(body)
    try:
        out = f(*body_args)
    finally:
        stack.pop()
        body.active = False
    out_leaves, rebuild_out = cached_match(plans_out, out_specs, out, "out_specs", None, top=False, fname=fname)
    results = [_exit(path, value, spec, body, mesh, fname) for path, value, spec, _ in out_leaves]
    return rebuild_out(results)


# --------------------------------------------------------------------------
# Spec validation
# --------------------------------------------------------------------------
_VALIDATED: dict = {}


def _check_spec(spec, path, shape, mesh, manual, fname, *, what, split=True):
    """Validate `spec` for a value of `shape`; a success is remembered (specs and meshes are immutable).

    Keyed on the spec's exact entries, not on equality: `P('x', None) == P('x')`,
    but only the short one fits a rank-1 value; the entry holds the spec, whose
    entries a hit compares (a hash is no proof).  Not on the spec's identity:
    pmap, and code that builds specs per call, make new ones every call, which
    would fill the table.  The boundary asks at every leaf of every call, so a
    hit is one dict lookup.
    """
    try:
        key = (spec._exact, shape, mesh.axis_names, mesh.axis_sizes, manual, split)
        got = _VALIDATED.get(key)
    except (AttributeError, TypeError):  # not a spec (refused below); symbolic sizes (dynamic shapes) do not hash
        got = None
    if got is not None and (got is spec or (got._entries == spec._entries and got.unreduced == spec.unreduced)):
        return
    _check_spec_uncached(spec, path, shape, mesh, manual, fname, what=what, split=split)
    if all(type(s) is int for s in shape) and len(_VALIDATED) < 65536:
        _VALIDATED[key] = spec


def _check_spec_uncached(spec, path, shape, mesh, manual, fname, *, what, split):
    if not isinstance(spec, PartitionSpec):
        raise SpecError(
            f"shard_map({fname}) {path}: expected a PartitionSpec (shmap.P(...)), got "
            f"{type(spec).__name__} {spec!r}. Fix: wrap it, e.g. P('i')."
        )
    seen = {}
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        for a in names:
            if not isinstance(a, str):
                raise SpecError(
                    f"shard_map({fname}) {path}: {spec} entry {d} contains {a!r} ({type(a).__name__}); "
                    "entries must be None, a mesh axis name, or a tuple of names."
                )
            if a not in mesh.shape:
                raise SpecError(
                    f"shard_map({fname}) {path}: {spec} names mesh axis {a!r}, which is not in mesh "
                    f"{mesh.describe()}; available axes: {mesh.axis_names}. Fix: use one of those names."
                )
            if a not in manual:
                raise SpecError(
                    f"shard_map({fname}) {path}: {spec} names mesh axis {a!r}, which is not manual in this "
                    f"shard_map (axis_names={manual}). Fix: add {a!r} to axis_names or drop it from the spec."
                )
            if a in seen:
                raise SpecError(
                    f"shard_map({fname}) {path}: {spec} mentions mesh axis {a!r} twice (dimensions {seen[a]} "
                    f"and {d}); a mesh axis may split at most one dimension. Fix: mention {a!r} once."
                )
            seen[a] = d
    for a in spec.unreduced:
        if a not in mesh.shape or a not in manual:
            raise SpecError(
                f"shard_map({fname}) {path}: {spec} is unreduced along {a!r}, which is not a manual axis of mesh "
                f"{mesh.describe()} (manual: {manual}). Fix: use one of those axes."
            )
        if a in seen:
            raise SpecError(
                f"shard_map({fname}) {path}: {spec} both splits dimension {seen[a]} over {a!r} and is unreduced "
                f"along it; a pending sum over {a!r} is the same block on every device of {a!r}. "
                f"Fix: drop {a!r} from one of them."
            )
    if len(spec) > len(shape):
        raise SpecError(
            f"shard_map({fname}) {path}: {spec} has {len(spec)} entries but {what} has rank {len(shape)} "
            f"(shape {tuple(shape)}). Fix: give at most {len(shape)} entries, e.g. "
            f"P({', '.join(repr(e) for e in list(spec)[:len(shape)])})."
        )
    for d in range(len(spec) if split else 0):
        axes = spec.dim_axes(d)
        n = math.prod(mesh.shape[a] for a in axes)
        if axes and shape[d] % n:
            sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise SpecError(
                f"shard_map({fname}) {path}: dimension {d} of {what} has size {_size(shape[d])}, which is not "
                f"divisible by {n}, the product of the sizes of mesh axes {axes} ({sizes}) that {spec} "
                f"splits it over (mesh {mesh.describe()}). Fix: make dimension {d} a multiple of {n}, or "
                "split it over fewer axes."
            )


def _size(n) -> str:
    """A dimension's size for a message: a symbolic one (torch.compile's dynamic shapes) with its value."""
    hint = getattr(getattr(n, "node", None), "hint", None) if isinstance(n, torch.SymInt) else None
    return f"{hint} (symbolic {n} under torch.compile)" if hint is not None else str(n)


def _enter(path, value, spec, body, mesh, fname, what):
    """Global argument -> body value."""
    if type(value) in body.block_types and body.parent is None:  # a DTensor laid out as `spec`, most often
        _check_spec(spec, path, value.shape, mesh, body.own, fname, what=what)
        got = body.backend.enter_block(value, spec, body)
        if got is not None:
            phys, vma_ = got
            _read_only(body, phys, _Argument(what.arg, what.params, fname, path, body.kind), vma_)
            return ShTensor(phys, (), vma_, body)
    if isinstance(value, ShTensor) and body.parent is not None and value._body is body.parent:
        _check_spec(spec, path, value.shape, mesh, body.own, fname, what=what)
        inner = nesting.enter(value, spec, body)
        # (read-only as any argument: the simulated mesh would write all of the parent's value, a process its block)
        _read_only(body, inner._phys, _Argument(what.arg, what.params, fname, path, body.kind), inner._vma)
        return inner
    if isinstance(value, ShTensor) and not value._body.active:
        raise SpecError(
            f"shard_map({fname}) {path}: got a value of a shard_map body that has already returned (kept in a "
            "list or a closure). Body values exist only while their body runs. Fix: return it from that body "
            "(with an out_spec) and pass the global result."
        )
    if isinstance(value, ShTensor) and value._body.kind == "pmap":
        raise SpecError(nested_in_pmap(f"shard_map({fname}) {path}: got a value of a running pmap body"))
    if isinstance(value, ShTensor):
        raise SpecError(
            f"shard_map({fname}) {path}: got a value of another shard_map body, over a different mesh than this "
            "call's. A shard_map nests only in a body over the same mesh that leaves axes free "
            "(axis_names=...). Fix: use the same mesh, or pass the outer body's value as a global array."
        )
    caller_tensor = isinstance(value, torch.Tensor)  # caller data: read-only in the body
    if caller_tensor and (value.layout is not torch.strided or value.is_nested):
        raise TypeError(
            f"shard_map({fname}) {path}: got a {'nested' if value.is_nested else str(value.layout)} tensor; a "
            "shard_map argument is a dense (strided) tensor, cut into blocks. Fix: pass x.to_dense() (or a padded "
            "dense tensor), or mark it static with a None spec."
        )
    if isinstance(value, (numbers.Number, bool)) and not isinstance(value, torch.Tensor):
        value = torch.tensor(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"shard_map({fname}) {path}: expected a torch.Tensor or Python number, got "
            f"{type(value).__name__}. Fix: convert it with torch.as_tensor, or mark it static with a None spec."
        )
    _check_spec(spec, path, value.shape, mesh, body.own, fname, what=what)
    if not mesh.is_distributed and _is_dtensor(value):
        raise TypeError(
            f"shard_map({fname}) {path}: got a DTensor, but mesh {mesh.describe()} is simulated (every device in "
            "this process). Fix: pass x.full_tensor(), or build the mesh over the torch.distributed world "
            "with shmap.make_mesh(shape, names) after init_process_group()."
        )
    if mesh.device is not None and value.device != mesh.device:
        value = value.to(mesh.device)
    phys, paxes = body.backend.split(value, spec, body)
    phys, paxes, vma_ = body.backend.input_value(phys, paxes, body)
    if caller_tensor:
        _read_only(body, phys, _Argument(what.arg, what.params, fname, path, body.kind), vma_)
    if spec.unreduced:
        if not body.check_vma:
            raise SpecError(f"shard_map({fname}) {path}: unreduced in_specs need check_vma=True.")
        axes = body.order(spec.unreduced)
        phys, paxes = body.backend.unreduced_input(phys, paxes, axes, body)
        if caller_tensor:  # (a fresh tensor on some devices, the caller's on others: read-only on all)
            _read_only(body, phys, _Argument(what.arg, what.params, fname, path, body.kind), vma_ | spec.unreduced)
        return ShTensor(phys, paxes, vma_ | spec.unreduced, body, spec.unreduced)
    return ShTensor(phys, paxes, vma_, body)


class _Argument:
    """An argument leaf as messages name it ("argument 0 ('x')", with `fname`: "argument 0 ('x') of
    shard_map(f) at in_specs[0]"), formatted only when a message is: the boundary makes one per
    leaf per call."""

    __slots__ = ("arg", "params", "fname", "path", "kind")

    def __init__(self, arg, params, fname=None, path=None, kind="shard_map"):
        self.arg, self.params, self.fname, self.path, self.kind = arg, params, fname, path, kind

    def __str__(self):
        arg, params = self.arg, self.params
        s = f"argument {arg}" + (f" ({params[arg]!r})" if arg is not None and arg < len(params) else "")
        return s if self.fname is None else f"{s} of {self.kind}({self.fname}) at {self.path}"

    def __format__(self, format_spec):
        return format(str(self), format_spec)


def _read_only(body, phys, who, vma_):
    """Mark the storage of an argument's body value: an in-place op on it (or a view of it) raises
    `InPlaceInputError` naming `who` (tensor.py), on both meshes alike.  JAX arrays are immutable; an
    in-place update of caller data would differ between one process and one process per device.
    (`vma_`: the argument's type; a `pvary` of it is a new value, copied on its first in-place update.)"""
    key = storage_key(phys)
    if key is not None:
        body.__dict__.setdefault("read_only", {}).setdefault(key, (who, vma_))


def _exit(path, value, spec, body, mesh, fname):
    """Body output -> global value, after the static replication check."""
    if body.parent is not None:  # nested: back to the parent body's layout
        return nesting.exit(path, value, spec, body, mesh, fname)
    x = _output_value(path, value, body, fname)
    shape = logical_shape(x)
    _check_spec(spec, path, shape, mesh, body.axes, fname, what="the output", split=False)
    if spec.unreduced or x._unreduced:
        implicit = spec.unreduced - x._unreduced
        if implicit and body.check_vma and implicit <= x._vma:
            # As JAX: a spec unreduced along axes the value varies on makes it a pending sum there (an
            # implicit pcast(y, axes, to='unreduced')); the output's logical value is the sum over them.
            x = ShTensor(x._phys, x._paxes, x._vma, body, x._unreduced | implicit)
        if x._unreduced != spec.unreduced:
            raise VmaError(_unreduced_mismatch(fname, path, spec, x, body))
    varying = vma(x)
    named = spec.axis_set()
    if body.check_vma and not varying <= named:
        extra = [a for a in body.axes if a in varying and a not in named]
        if extra:
            raise _unmentioned_axes(fname, path, spec, x, varying, extra, mesh, body)
    phys, paxes, vma_ = x._phys, x._paxes, x._vma
    if x._unreduced:
        # The caller gets the logical value: the simulated mesh sums the pending terms here;
        # a distributed backend may hand them over as a Partial DTensor instead.
        phys, paxes = body.backend.unreduced_output(phys, paxes, body.order(x._unreduced), body)
        vma_ = varying
    if body.check_vma and not named <= vma_:
        tiled = body.order(named - vma_)
        if tiled:
            # JAX's implicit pvary: an invariant value tiled into a mapped output has
            # per-device cotangents, which its transpose psums.
            phys, paxes = body.backend.pvary(phys, paxes, tiled, body, shape)
            vma_ = vma_ | frozenset(tiled)
    return body.backend.assemble(not_an_argument(body, phys), paxes, spec, body, shape)


def _output_value(path, value, body, fname) -> ShTensor:
    """What the body returned at `path` as a value of this body (a tensor or number: `plain_value`)."""
    if isinstance(value, ShTensor):
        if value._body is not body:
            raise VmaError(
                f"shard_map({fname}) {path}: the output belongs to another shard_map body. "
                "Fix: return values computed in this body."
            )
        return value
    if isinstance(value, torch.Tensor) or isinstance(value, numbers.Number):
        t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
        return plain_value(t, body)
    raise TypeError(
        f"shard_map({fname}) {path}: the body returned {type(value).__name__} here; outputs must be "
        "tensors or numbers. Fix: return tensors, or drop the entry from out_specs."
    )


def _unmentioned_axes(fname, path, spec, x, varying, extra, mesh, body) -> VmaError:
    """An output varying along axes its out_spec does not name: no single value is the output."""
    return VmaError(
        f"shard_map({fname}) {path}: the output varies along {fmt_vma(varying, body.axes)} but its spec "
        f"{spec} does not mention {', '.join(repr(a) for a in extra)}, so devices along "
        f"{'that axis' if len(extra) == 1 else 'those axes'} may hold different values and no single "
        f"one is the output (mesh {mesh.describe()}). Fix: reduce it in the body, e.g. "
        f"`shmap.psum(y, {_axes_lit(extra)})`, or gather it with "
        f"`shmap.all_gather_invariant(y, {_axes_lit(extra)})` (`shmap.all_gather`'s result is typed "
        + (f"varying), or name the axis in the spec, e.g. {_suggest_spec(spec, extra, x.dim())}." if x.dim() else
           f"varying), or give the scalar a dimension to name the axis in: return `y.reshape(1)` with out_spec "
           f"{_suggest_spec(spec, extra, 1)} (one entry per device).")
    )


def _unreduced_mismatch(fname, path, spec, x, body):
    invariant = [a for a in body.order(spec.unreduced) if a not in x._vma]
    if invariant and body.check_vma and x._unreduced <= spec.unreduced:
        a = invariant[0]
        return (
            f"shard_map({fname}) {path}: its spec {spec} says the output is unreduced along {a!r} (a pending sum "
            f"over the devices of {a!r}), but the value is invariant along {a!r} (it varies along "
            f"{fmt_vma(x._vma - x._unreduced, body.axes) if x._vma - x._unreduced else 'no axes'}; mesh "
            f"{body.describe()}): its sum would be {body.sizes[a]} times the value, which JAX refuses too. "
            f"Fix: drop {a!r} from unreduced, or `shmap.pvary(y, {a!r})` first if the multiple is intended."
        )
    if x._unreduced and not spec.unreduced:
        return (
            f"shard_map({fname}) {path}: the output is unreduced along {fmt_vma(x._unreduced, body.axes)} (a pending "
            f"sum) but its spec {spec} does not say so. Fix: reduce it in the body with "
            f"`shmap.psum(y, {_axes_lit(body.order(x._unreduced))})`, or return it pending with "
            f"P(..., unreduced={set(body.order(x._unreduced))})."
        )
    return (
        f"shard_map({fname}) {path}: its spec {spec} says the output is unreduced along "
        f"{fmt_vma(spec.unreduced, body.axes)} but the value is unreduced along "
        f"{fmt_vma(x._unreduced, body.axes) if x._unreduced else 'no axes'}. Fix: make the spec's unreduced set "
        "match, or use shmap.pcast(y, axes, to='unreduced') in the body."
    )


def _axes_lit(axes):
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def _suggest_spec(spec, extra, rank):
    entries = list(spec) + [None] * max(0, rank - len(spec))
    for d, e in enumerate(entries):
        if e is None:
            entries[d] = extra[0] if len(extra) == 1 else tuple(extra)
            return "P(" + ", ".join(repr(x) for x in entries) + ")"
    return "P(" + ", ".join(repr(x) for x in entries) + ")"


def _is_dtensor(x) -> bool:
    if type(x) is torch.Tensor:  # the common case, without the import
        return False
    from .dtensor import is_dtensor

    return is_dtensor(x)
