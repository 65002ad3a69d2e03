"""`pmap`: JAX's pmap, as a shard_map over a one-axis mesh with untiled specs.

`pmap(f, 'i')(x)` is `shard_map` over a mesh `(i=n,)` where `n` is the size
of the mapped dimension: the in_spec splits that dimension into blocks of
one, which the body squeezes away; each output gets the dimension back
(unsqueezed) and is assembled along it.  So typing, automatic `pvary`, the
out_specs check (`out_axes=None` is `out_specs=P()`) and the efficient
transposes are shard_map's; there is no second engine.

Nested pmap: a pmap called inside a pmap (or shard_map) body maps over the
next mapped dimension of the body's values.  It runs as a nested shard_map
whose mesh is the parent's extended by one axis, the inner `axis_name`: that
axis exists only during the inner call (a `psum` over it sums within the
current outer instance), while the outer axes stay bound inside.  A nested
pmap therefore computes exactly what one shard_map over the product mesh
computes with the same collectives.
"""
from __future__ import annotations

import functools
import itertools
import math
import numbers
import operator

import optree
import torch

from . import context
from .compile import graph_call, python_state
from .errors import ANONYMOUS_AXIS, SpecError, VmaError
from .mesh import Mesh, P, make_mesh
from .tensor import vma

_fresh = itertools.count()


def pmap(fun=None, axis_name=None, *, in_axes=0, out_axes=0, static_broadcasted_argnums=(),
         axis_size=None, devices=None):
    """Map `fun` over a leading (or `in_axes`) dimension, one simulated device per index.

    - `axis_name`: the name collectives use for the mapped axis (None: an
      anonymous axis no collective can name).
    - `in_axes`: an int, None (broadcast: every device gets the whole value),
      or a tuple with one entry per positional argument, each a pytree prefix
      of that argument.  Keyword arguments are mapped along dimension 0.
    - `out_axes`: an int, or None (the output must be invariant along the
      axis, checked statically as `out_specs=P()` is), or a pytree prefix of
      the outputs.
    - `static_broadcasted_argnums`: positional arguments passed through as
      they are (hashable Python values, as in JAX).
    - `axis_size`: the mapped size, needed when no argument is mapped.
    - `devices`: a sequence of `axis_size` devices (ranks on a distributed
      world; on the simulated mesh one torch device repeated, or device ids),
      or a single torch device for the simulated mesh to compute on.

    Usable as `pmap(f, 'i')`, as `@pmap` and as `@pmap(axis_name='i')`.
    Called inside a pmap or shard_map body it nests (see the module docstring).
    """
    statics = _static_argnums(static_broadcasted_argnums)
    if fun is None:
        return functools.partial(
            pmap, axis_name=axis_name, in_axes=in_axes, out_axes=out_axes,
            static_broadcasted_argnums=static_broadcasted_argnums, axis_size=axis_size, devices=devices,
        )
    if isinstance(fun, str) and axis_name is None:
        raise TypeError(
            f"pmap: the first argument is the function, got the string {fun!r}. "
            f"Fix: @pmap(axis_name={fun!r}) or pmap(f, {fun!r})."
        )
    if not callable(fun):
        raise TypeError(f"pmap: fun must be callable, got {type(fun).__name__}.")
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"pmap: axis_name must be a string or None, got {axis_name!r}.")
    if axis_size is not None and (not isinstance(axis_size, int) or axis_size < 1):
        raise ValueError(f"pmap: axis_size must be a positive int, got {axis_size!r}.")
    name = axis_name if axis_name is not None else f"{ANONYMOUS_AXIS}{next(_fresh)}"
    fname = getattr(fun, "__name__", "fun")
    cfg = dict(fun=fun, fname=fname, name=name, in_axes=in_axes, out_axes=out_axes, statics=statics,
               axis_size=axis_size, devices=devices)

    @functools.wraps(fun)
    def mapped(*args, **kwargs):
        if torch.compiler.is_compiling():  # Dynamo is tracing: one node of its graph (compile.py)
            _make_world_device_mesh(name)  # (run by Dynamo, not traced: it may create the mesh)
            return traced(*args, device_mesh=_WORLD_DEVICE_MESHES.get(name), _state=python_state(fun), **kwargs)
        return _pmap_call(cfg, args, kwargs)

    n = next(_fresh_node)
    traced = graph_call(lambda *a, device_mesh=None, **k: _pmap_call(cfg, a, k, device_mesh), f"pmap_{n}")
    mapped.__code__ = mapped.__code__.replace(co_name=f"pmapped_{n}")
    return mapped


_fresh_node = itertools.count()


def _make_world_device_mesh(name) -> bool:
    """Under torch.compile: file the DeviceMesh of a pmap over the whole torch.distributed world in
    `_WORLD_DEVICE_MESHES`, from where it is an input of the compiled node (a DTensor output's mesh
    must be one; see compile.py).  Dynamo runs this function rather than tracing it (it may create the
    mesh); the mesh itself it must read from a place it can guard, not take as a constant."""
    from .mesh import _real_world

    if _real_world():  # (make_mesh caches it: the same object while the world lasts)
        import torch.distributed as dist

        _WORLD_DEVICE_MESHES[name] = make_mesh((dist.get_world_size(),), (name,)).device_mesh
    return True


_make_world_device_mesh._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result, unimported
_WORLD_DEVICE_MESHES: dict = {}


def _static_argnums(s):
    if isinstance(s, int):
        return (s,)
    try:
        return tuple(operator.index(i) for i in s)
    except TypeError:
        raise TypeError(
            f"pmap: static_broadcasted_argnums must be an int or a tuple of ints, got {s!r}."
        ) from None


# --------------------------------------------------------------------------
# The call
# --------------------------------------------------------------------------
def _pmap_call(cfg, args, kwargs, device_mesh=None):
    fname, name = cfg["fname"], cfg["name"]
    api = f"pmap({fname})"
    nargs = len(args)
    statics = set()
    for i in cfg["statics"]:
        j = i + nargs if i < 0 else i
        if not 0 <= j < nargs:
            raise ValueError(
                f"{api}: static_broadcasted_argnums names argument {i}, but the call passes {nargs} "
                "positional arguments."
            )
        statics.add(j)
        try:
            hash(args[j])
        except TypeError:
            raise ValueError(
                f"{api}: static argument {j} is a {type(args[j]).__name__}, which is not hashable; static "
                "arguments must be hashable (as in jax.pmap). Fix: pass a tuple instead of a list, or make "
                "the argument a mapped (tensor) one."
            ) from None

    in_axes = cfg["in_axes"]
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if isinstance(in_axes, tuple):
        if len(in_axes) != nargs:
            raise ValueError(
                f"{api}: in_axes is a tuple of {len(in_axes)} entries but the call passes {nargs} positional "
                "arguments; give one entry per positional argument (an int, None, or a pytree prefix)."
            )
        per_arg = list(in_axes)
    elif in_axes is None or _is_int(in_axes):
        per_arg = [in_axes] * nargs
    else:
        raise TypeError(
            f"{api}: in_axes must be an int, None, or a tuple with one entry per positional argument, "
            f"got {type(in_axes).__name__} {in_axes!r}."
        )

    # Flatten the dynamic arguments into (path, leaf, axis).
    leaves = []  # [path, value, axis]
    treedefs = []
    for i, a in enumerate(args):
        if i in statics:
            treedefs.append(None)
            continue
        treedefs.append(_flatten_with_axes(api, f"args[{i}]", a, per_arg[i], leaves))
    kw_def = _flatten_with_axes(api, "kwargs", kwargs, 0, leaves) if kwargs else None

    # The mapped size, agreed by every mapped argument.
    sizes = []
    for leaf in leaves:
        path, v, ax = leaf
        if ax is None or v is None:  # broadcast, or an empty subtree (passed through, as in JAX)
            continue
        if not isinstance(v, torch.Tensor):
            raise ValueError(
                f"{api}: {path} is mapped along axis {ax} but is a {type(v).__name__}"
                + (", not a torch.Tensor (convert it: torch.as_tensor(x)). " if hasattr(v, "shape") else
                   ", which has no axes. ") +
                "Fix: pass a tensor, or give it in_axes None to broadcast it."
            )
        r = v.dim()
        if not -r <= ax < r:
            raise ValueError(
                f"{api}: {path} is mapped along axis {ax}, but it has rank {r} (shape {tuple(v.shape)}). "
                f"Fix: use in_axes in [{-r}, {r}) for it, or None to broadcast it."
                if r else
                f"{api}: {path} is mapped along axis {ax}, but it is a scalar (rank 0). Fix: give it in_axes "
                "None to broadcast it, or add a leading dimension."
            )
        leaf[2] = ax % r
        sizes.append((path, int(v.shape[leaf[2]]), leaf[2]))
    n = cfg["axis_size"]
    if sizes:
        distinct = sorted({s for _, s, _ in sizes})
        if len(distinct) > 1 or (n is not None and distinct[0] != n):
            lines = "\n".join(f"  {p}: axis {ax} has size {s}" for p, s, ax in sizes)
            want = f" and axis_size={n}" if n is not None else ""
            raise ValueError(
                f"{api}: the mapped axes have different sizes{' from axis_size' if len(distinct) == 1 else ''}; "
                f"every mapped argument must have the same size along its in_axes{want}:\n{lines}\n"
                "Fix: make them agree, or broadcast an argument with in_axes None."
            )
        n = distinct[0]
        if n == 0:
            p, _, ax = sizes[0]
            raise ValueError(
                f"{api}: {p} is mapped along axis {ax}, which has size 0: a pmap runs one device per index, and "
                "a mesh has at least one device. Fix: map an axis of size >= 1, or skip the call for empty input."
            )
    elif n is None:
        raise ValueError(
            f"{api}: no argument is mapped (in_axes are all None and there are no keyword arguments), so the "
            "axis size is unknown. Fix: pass axis_size=N, or map an argument."
        )

    parent = context.current()
    if parent is not None and not parent.active:
        parent = None
    mesh = _mesh_for(api, name, n, cfg["devices"], parent, leaves)
    if device_mesh is not None and mesh.axis_names != (name,) and torch.is_grad_enabled() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for _, v, _ in leaves):  # (not the world's mesh)
        raise NotImplementedError(
            f"{api}: under torch.compile on the torch.distributed world, a pmap with autograd must map an "
            f"axis of the world's size ({mesh.size} processes; this one maps {n}): its outputs' DeviceMesh "
            "has to be an input of the compiled graph, and only the whole world's is known before the call. "
            "Fix: map an axis of the world's size, use shard_map over shmap.make_mesh(...) (which compiles "
            "with autograd on any mesh), or call this pmap outside torch.compile."
        )

    in_specs = []
    for path, v, ax in leaves:
        if v is None:
            in_specs.append(None)  # passed through untouched
        elif ax is None:
            in_specs.append(P())
        else:
            in_specs.append(P(*([None] * ax), name))
    out_specs = []  # filled by the body: one spec per output leaf (shard_map reads it after the body runs)
    out_holder = {"specs": out_specs}

    def body(*vals):
        vals = [v.squeeze(ax) if ax is not None and v is not None else v for v, (_, _, ax) in zip(vals, leaves)]
        it = iter(vals)
        call_args = []
        for i, a in enumerate(args):
            if treedefs[i] is None:
                call_args.append(a)
            else:
                call_args.append(_unflatten(treedefs[i], it))
        call_kwargs = _unflatten(kw_def, it) if kw_def is not None else {}
        out = cfg["fun"](*call_args, **call_kwargs)
        return _outputs(api, name, out, cfg["out_axes"], out_holder)

    from .dtensor import device_put, is_dtensor
    from .shard_map import _call

    # A DTensor laid out otherwise is resharded to the pmap's layout (pmap has no mesh of the user's
    # to match; a DTensor already laid out as the in_spec on the pmap's mesh is used in place).
    vals = tuple(device_put(v, mesh, spec) if spec is not None and is_dtensor(v) else v
                 for (_, v, _), spec in zip(leaves, in_specs))
    params = [p for p, _, _ in leaves]
    res = _call(body, fname, params, mesh, (name,), tuple(in_specs), out_specs, True, vals, parent=parent,
                kind="pmap")
    return _rebuild_outputs(out_holder, res)


def _is_int(ax) -> bool:
    """An axis given as an int (True is not axis 1)."""
    return isinstance(ax, int) and not isinstance(ax, bool)


def _structure(value) -> str:
    """A pytree's structure without its data (`*` a leaf): messages must not print every device's values."""
    text = str(optree.tree_structure(value, none_is_leaf=True))
    return text.removeprefix("PyTreeSpec(").removesuffix(")").removesuffix(", NoneIsLeaf")


def _reason(e) -> str:
    """optree's reason for a prefix mismatch, without the subtree it prints (the data)."""
    import re

    return re.split(r"; (?:tuple|list|dict|namedtuple|OrderedDict|defaultdict|deque|structseq): ", str(e),
                    maxsplit=1)[0]


def _flatten_with_axes(api, path, value, axes_prefix, leaves):
    """Flatten `value`; each leaf gets its axis from the prefix tree `axes_prefix`."""
    vleaves, treedef = optree.tree_flatten(value, none_is_leaf=True)
    if axes_prefix is None or _is_int(axes_prefix):
        axes = [axes_prefix] * len(vleaves)
    else:
        try:
            axes = optree.tree_broadcast_prefix(axes_prefix, value, none_is_leaf=True)
            axes = optree.tree_leaves(axes, none_is_leaf=True)
        except ValueError as e:
            raise ValueError(
                f"{api}: in_axes for {path} must be a pytree prefix of the argument (an int, None, or a "
                f"container shaped like it), got {axes_prefix!r}, but the argument is {_structure(value)}: "
                f"{_reason(e)}. Fix: in_axes shaped like the argument, or one int for all of it."
            ) from None
    paths = optree.tree_paths(value, none_is_leaf=True)
    for p, v, ax in zip(paths, vleaves, axes):
        if ax is not None and not _is_int(ax):
            raise TypeError(f"{api}: in_axes entries must be ints or None, got {ax!r} for {path}.")
        if isinstance(v, numbers.Number) and not isinstance(v, torch.Tensor) and ax is None:
            v = torch.tensor(v)
        leaves.append([path + "".join(f"[{k!r}]" for k in p), v, ax])
    return treedef


def _unflatten(treedef, it):
    return optree.tree_unflatten(treedef, [next(it) for _ in range(treedef.num_leaves)])


def _outputs(api, name, out, out_axes, holder):
    """Per output leaf: unsqueeze the mapped dim back and give its spec (the holder is the out_specs)."""
    oleaves, odef = optree.tree_flatten(out, none_is_leaf=True)
    if out_axes is None or isinstance(out_axes, int):
        axes = [out_axes] * len(oleaves)
    else:
        try:
            axes = optree.tree_leaves(optree.tree_broadcast_prefix(out_axes, out, none_is_leaf=True),
                                      none_is_leaf=True)
        except ValueError as e:
            raise ValueError(
                f"{api}: out_axes must be an int, None, or a pytree prefix of the outputs, got {out_axes!r}, but "
                f"the function returned {_structure(out)}: {_reason(e)}. Fix: out_axes shaped like the outputs "
                "(one entry per returned value), or one int for all of them."
            ) from None
    vals, specs, kept = [], [], []
    for k, (v, ax) in enumerate(zip(oleaves, axes)):
        if v is None:
            kept.append(None)
            continue
        if ax is not None and (type(ax) is not int):
            raise TypeError(f"{api}: out_axes entries must be ints or None, got {ax!r} ({type(ax).__name__}) for "
                            f"output leaf {k}. Fix: e.g. out_axes=0.")
        if not isinstance(v, torch.Tensor):
            if not isinstance(v, (bool, int, float, complex)):
                raise TypeError(f"{api}: output leaf {k} is a {type(v).__name__}; pmap outputs are tensors or "
                                "numbers (or None). Fix: return tensors, or compute the value outside pmap.")
            v = torch.as_tensor(v)
        if ax is None:
            if name in vma(v):
                where = "the output" if odef.num_leaves == 1 else f"output leaf {k}"
                raise VmaError(
                    f"{api}: {where} has out_axes=None, which returns one value for every device, but it "
                    f"varies along the mapped axis {name!r} (per-device shape {tuple(v.shape)}), so no single "
                    f"value is the output. Fix: reduce it in the body, e.g. `shmap.psum(y, {name!r})` or "
                    f"`shmap.pmean(y, {name!r})`, or return it stacked with out_axes=0."
                )
            specs.append(P())
        else:
            r = v.dim() + 1
            if not -r <= ax < r:
                raise ValueError(
                    f"{api}: out_axes {ax} is out of range for output {k}, whose per-device rank is "
                    f"{r - 1} (mapped rank {r}). Fix: use out_axes in [{-r}, {r})."
                )
            ax = ax % r
            v = v.unsqueeze(ax)
            specs.append(P(*([None] * ax), name))
        kept.append(len(vals))
        vals.append(v)
    holder["specs"][:] = specs
    holder["treedef"] = odef
    holder["kept"] = kept
    return vals


def _rebuild_outputs(holder, res):
    vals = list(res)
    out = [None if k is None else vals[k] for k in holder["kept"]]
    return optree.tree_unflatten(holder["treedef"], out)


# --------------------------------------------------------------------------
# Meshes
# --------------------------------------------------------------------------
_MESHES: dict = {}


def _mesh_for(api, name, n, devices, parent, leaves):
    device = _device_arg(api, n, devices, parent)
    if parent is not None:
        pm = parent.mesh
        if name in pm.shape:
            raise SpecError(
                f"{api}: axis_name {name!r} is already bound by the enclosing "
                f"{'pmap' if len(parent.axes) == 1 else 'shard_map'} body (mesh {pm.describe()}); an inner "
                "pmap's axis is scoped to the inner call and must have a new name. Fix: rename one of them, "
                f"e.g. axis_name={name + '_inner'!r}."
            )
        if pm.is_distributed:
            return _nested_world_mesh(api, name, n, parent)
        key = ("nested", pm.axis_names, pm.axis_sizes, pm.device, name, n)
        got = _MESHES.get(key)
        if got is None:
            shape = pm.axis_sizes + (n,)
            got = Mesh(torch.arange(math.prod(shape)).reshape(shape), pm.axis_names + (name,), device=pm.device)
            _MESHES[key] = got
        return got
    from .mesh import _real_world

    if _real_world():
        import torch.distributed as dist

        world = dist.get_world_size()
        if n > world or world % n:
            raise ValueError(
                f"{api}: the mapped axis has size {n}, but a pmap on the torch.distributed world runs one "
                f"device per process and the world has {world} processes"
                f"{' (a pmap larger than the world)' if n > world else f', which {n} does not divide'}. "
                f"Fix: map an axis of size {world} (or a divisor of it, for a pmap with nested pmaps), launch "
                f"with `torchrun --nproc-per-node {n}`, or run it on a simulated mesh."
            )
        if n == world:
            return make_mesh((n,), (name,), device=device)
        # Fewer instances than processes: the rest of the world is a free axis, along which each
        # instance runs on world/n processes, for nested pmaps to bind.
        return make_mesh((n, world // n), (name, _rest(name)), device=device)
    key = ("sim", name, n, device)
    got = _MESHES.get(key)
    if got is None:
        got = _MESHES[key] = make_mesh((n,), (name,), device=device, distributed=False)
    return got


def _rest(name):
    return f"{name}/rest"


def _nested_world_mesh(api, name, n, parent):
    """The world mesh for a pmap nested in a body on the distributed mesh: the parent's axes, then
    this pmap's axis over the processes the parent leaves free (then, if some remain, a free rest)."""
    pm = parent.mesh
    k = len(parent.axes)
    free = pm.axis_sizes[k:]
    if pm.axis_names[:k] != parent.axes:
        raise SpecError(
            f"{api}: a pmap nested in a shard_map body on a distributed mesh needs the body's axes to be the "
            f"mesh's leading ones; mesh {pm.describe()} has manual axes {parent.axes}. Fix: use a nested "
            "shard_map, or order the mesh axes outer-first."
        )
    room = math.prod(free)
    if room % n:  # (an inner pmap of size 1 fits any room, none to spare included)
        outer = ", ".join(f"{a}={pm.shape[a]}" for a in parent.axes)
        raise ValueError(
            f"{api}: a nested pmap of size {n} does not fit the torch.distributed world of {pm.size} processes: "
            f"the enclosing maps ({outer}) leave {room} process{'es' if room != 1 else ''} per instance"
            + (f", which {n} does not divide" if free else ", none to spare")
            + f". Fix: map an axis of size {room} in the inner pmap, or launch "
            f"{math.prod(pm.axis_sizes[:k]) * n} processes (torchrun --nproc-per-node)."
        )
    shape = pm.axis_sizes[:k] + (n,) + ((room // n,) if room > n else ())
    names = parent.axes + (name,) + ((_rest(name),) if room > n else ())
    return make_mesh(shape, names, device=pm.device)


def _device_arg(api, n, devices, parent):
    if devices is None:
        return None
    if parent is not None:
        raise ValueError(f"{api}: devices= can only be given to the outermost pmap (as in jax.pmap).")
    if isinstance(devices, (str, torch.device)):
        return torch.device(devices)
    try:
        devs = list(devices)
    except TypeError:
        raise TypeError(f"{api}: devices must be a sequence of {n} devices (or one torch device), got "
                        f"{devices!r}. Fix: e.g. devices=['cpu'] * {n}, or leave it out.") from None
    if len(devs) != n:
        raise ValueError(
            f"{api}: devices lists {len(devs)} devices but the mapped axis has size {n}. Fix: pass {n} devices "
            "(or leave devices out)."
        )
    kinds = {torch.device(d) for d in devs if isinstance(d, (str, torch.device))}
    if len(kinds) > 1:
        raise ValueError(
            f"{api}: devices lists several torch devices {sorted(map(str, kinds))}; the simulated mesh computes "
            "every device on one torch device. Fix: pass one device, e.g. devices='cuda'."
        )
    return next(iter(kinds)) if kinds else None
