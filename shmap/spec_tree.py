"""`in_specs` / `out_specs` as pytree prefixes of the arguments and outputs, with paths for messages.

`match` walks a spec tree against the values (a leaf spec applies to the whole subtree below it)
and lists each value leaf with its spec, its path (`in_specs[0]['w']`) and its argument index;
`rebuild` puts the converted leaves back into the values' containers (tuples, lists, dicts,
namedtuples).
"""
from __future__ import annotations

import collections

import optree

from .errors import SpecError
from .mesh import PartitionSpec


def _is_spec_leaf(s):
    return s is None or isinstance(s, PartitionSpec)


def _children(tree):
    """(kind, keys, children) for a container, or None for a leaf."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return "namedtuple", list(tree._fields), list(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree).__name__, list(range(len(tree))), list(tree)
    if isinstance(tree, dict):
        keys = list(tree.keys())
        return "dict", keys, [tree[k] for k in keys]
    return None


def _key_str(kind, k):
    return f".{k}" if kind == "namedtuple" else f"[{k!r}]"


def match(specs, values, path, out, params, *, top, fname, arg=None):
    """Walk `specs` (a prefix of `values`), appending (path, leaf value, spec, argument index)."""
    if _is_spec_leaf(specs):
        if top:
            # A single spec applies to every argument.
            for i, v in enumerate(values):
                _match_leafspec(specs, v, f"{path}[{i}]", out, i)
        else:
            _match_leafspec(specs, values, path, out, arg)
        return
    sc = _children(specs)
    if sc is None:
        raise SpecError(
            f"shard_map({fname}) {path}: expected a PartitionSpec (shmap.P(...)), None (static argument), "
            f"or a container of them; got {type(specs).__name__} {specs!r}. "
            f"Fix: write P({specs!r})" + (" if you meant that axis." if isinstance(specs, str) else ".")
        )
    if top and sc[0] == "dict":
        keys, order = sc[1], [p for p in params or () if p in sc[1]]
        named = len(order) == len(keys)  # keyed by the parameters' names: their order
        entries = [repr(specs[k]) for k in (order if named else keys)]
        raise SpecError(
            f"shard_map({fname}) {path}: the top level is a dict of specs, but {path} has one entry per "
            f"positional argument, in order: a tuple (a dict of specs is for an argument that is a dict). "
            f"Fix: {path}=({', '.join(entries)}{',' if len(entries) == 1 else ''})"
            + (f" for ({', '.join(order)})." if named else ", in the arguments' order.")
        )
    vc = _children(values) if not top else ("tuple", list(range(len(values))), list(values))
    what = "the positional arguments" if top else f"the value at {path}"
    if vc is None:
        raise SpecError(
            f"shard_map({fname}) {path}: the spec is a {sc[0]} of {len(sc[1])} entries, but {what} is a "
            f"{type(values).__name__}; specs must be a pytree prefix of "
            f"{'the arguments' if path.startswith('in') else 'the outputs'}. Fix: use a single P(...) here."
        )
    skind, skeys, schildren = sc
    vkind, vkeys, vchildren = vc
    if top:
        skind = "tuple"
    if (skind in ("dict",)) != (vkind in ("dict",)) or len(skeys) != len(vkeys) or (
        skind == "dict" and set(skeys) != set(vkeys)
    ):
        if top:
            names = ", ".join(params[: len(values)]) if params else ""
            desc = f"{len(values)} positional arguments" + (f" ({names})" if names else "")
        else:
            desc = f"a {vkind} with {'keys ' + repr(sorted(map(str, vkeys))) if vkind == 'dict' else str(len(vkeys)) + ' entries'}"
        sdesc = f"a {skind} with {'keys ' + repr(sorted(map(str, skeys))) if skind == 'dict' else str(len(skeys)) + ' entries'}"
        raise SpecError(
            f"shard_map({fname}) {path}: specs and values differ in structure here: the spec is {sdesc} "
            f"but {what} is {desc}. Fix: give one spec per entry (or one P(...) for the whole subtree)."
        )
    for k, s, v in _pairs(skeys, schildren, vkind, vkeys, vchildren):
        sub = f"{path}[{k}]" if top else path + _key_str(vkind, k)
        match(s, v, sub, out, params, top=False, fname=fname, arg=k if top else arg)


def _pairs(skeys, schildren, vkind, vkeys, vchildren):
    """(key, spec, value) for each child, in the values' order: the order `rebuild` puts the
    converted leaves back in.  A dict's spec may list its keys in another order; other containers
    pair by position (a tuple of specs fits a namedtuple)."""
    if vkind == "dict":
        lookup = dict(zip(skeys, schildren))
        return [(k, lookup[k], v) for k, v in zip(vkeys, vchildren)]
    return list(zip(vkeys, schildren, vchildren))


def _match_leafspec(spec, value, path, out, arg):
    """A leaf spec applies to every leaf of the value subtree."""
    vc = _children(value)
    if vc is None:
        out.append((path, value, spec, arg))
        return
    kind, keys, children = vc
    for k, c in zip(keys, children):
        _match_leafspec(spec, c, path + _key_str(kind, k), out, arg)


def rebuild(specs, values, it, *, top):
    if top:
        if _is_spec_leaf(specs):
            return tuple(_rebuild_leafspec(v, it) for v in values)
        return tuple(rebuild(s, v, it, top=False) for s, v in zip(specs, values))
    if _is_spec_leaf(specs):
        return _rebuild_leafspec(values, it)
    kind, keys, children = _children(values)
    skind, skeys, schildren = _children(specs)
    new = [rebuild(s, c, it, top=False) for _, s, c in _pairs(skeys, schildren, kind, keys, children)]
    return _rebuild_container(values, keys, new)


def _rebuild_leafspec(value, it):
    vc = _children(value)
    if vc is None:
        return next(it)
    kind, keys, children = vc
    return _rebuild_container(value, keys, [_rebuild_leafspec(c, it) for c in children])


def _rebuild_container(orig, keys, new):
    return _make(type(orig), keys, new, getattr(orig, "default_factory", None))


def _make(typ, keys, new, factory=None):
    if issubclass(typ, dict):
        if issubclass(typ, collections.defaultdict):
            return typ(factory, zip(keys, new))
        return typ(zip(keys, new)) if typ is dict else typ(dict(zip(keys, new)))
    if issubclass(typ, tuple) and hasattr(typ, "_fields"):
        return typ(*new)
    return typ(new)


# --------------------------------------------------------------------------
# Skeletons: an output tree as flat leaves plus Python constants (torch.compile)
# --------------------------------------------------------------------------
def skeleton(tree, types):
    """`tree`'s containers as nested constants: None for a leaf, else (type code, keys, children).

    Dynamo's graph node for a shard_mapped call may return tensors and tuples
    or lists of them (a dict output is a graph break), so the node returns
    `flat_leaves(out)` and the caller gets the containers back from
    `from_skeleton`, plain Python that Dynamo traces.  The skeleton reaches
    Dynamo as an unguarded constant, which may hold strings and numbers but
    no class objects: `types` (one dict per shard_mapped function, code ->
    container type) holds those, and Dynamo reads it with guards.
    """
    c = _children(tree)
    if c is None:
        return None
    _, keys, children = c
    typ = type(tree)
    if isinstance(tree, collections.defaultdict):  # (its factory is part of the container)
        typ = (typ, tree.default_factory)
    code = next((k for k, t in types.items() if t is typ or (type(typ) is tuple and t == typ)), None)
    if code is None:
        code = len(types)
        types[code] = typ
    return code, tuple(keys), tuple(skeleton(x, types) for x in children)


def flat_leaves(tree, out=None):
    """The leaves of `tree` in `skeleton`'s order, as a tuple."""
    out = [] if out is None else out
    c = _children(tree)
    if c is None:
        out.append(tree)
    else:
        for x in c[2]:
            flat_leaves(x, out)
    return tuple(out)


def from_skeleton(skel, leaves, types):
    """The inverse of (`skeleton`, `flat_leaves`)."""
    return _from_skeleton(skel, iter(leaves), types)


def _from_skeleton(skel, it, types):
    if skel is None:
        return next(it)
    code, keys, children = skel
    typ = types[code]
    new = [_from_skeleton(c, it, types) for c in children]
    return _make(typ[0], keys, new, typ[1]) if type(typ) is tuple else _make(typ, keys, new)


# --------------------------------------------------------------------------
# Remembered matches: a call over the same value structure skips the walk
# --------------------------------------------------------------------------
def freeze(specs):
    """A private copy of a spec tree's containers (specs are read when shard_map is called, as in
    JAX: mutating the caller's dict later changes nothing, and `cached_match` may remember it)."""
    if _is_spec_leaf(specs):
        return specs
    c = _children(specs)
    if c is None:
        return specs  # not a spec tree: `match` reports it
    kind, keys, children = c
    return _rebuild_container(specs, keys, [freeze(x) for x in children])


def cached_match(plans, specs, values, path, params, *, top, fname):
    """`match` and `rebuild` for one call -> (leaves, rebuild_from(converted leaves)).

    `plans` (a dict per shard_mapped function, or None) remembers, per value
    structure (an optree treedef), which flat leaf gets which spec and path,
    so a step over hundreds of parameters does not walk both trees in Python
    on every call.  A structure `match` and optree see differently (a
    container type only one of them knows) is not remembered.
    """
    if plans is None:
        out = []
        match(specs, values, path, out, params, top=top, fname=fname)
        return out, lambda converted: rebuild(specs, values, iter(converted), top=top)
    flat, treedef = optree.tree_flatten(values, none_is_leaf=True)
    plan = plans.get(treedef)
    if not plan:
        out = []
        match(specs, values, path, out, params, top=top, fname=fname)  # the checks and their messages
        if plan is None and len(plans) < 64:
            plans[treedef] = _plan(specs, treedef, flat, out, path, params, top, fname)
        return out, lambda converted: rebuild(specs, values, iter(converted), top=top)
    leaves = [(p, flat[i], sp, a) for i, p, sp, a in plan]

    def rebuild_from(converted):
        new = list(flat)
        for entry, c in zip(plan, converted):
            new[entry[0]] = c
        return treedef.unflatten(new)

    return leaves, rebuild_from


def _plan(specs, treedef, flat, matched, path, params, top, fname):
    """[(flat index, path, spec, argument)] in `match`'s order, from a stand-in tree whose leaves are
    their own flat indices; False unless `match` sees exactly optree's leaves (checked against this
    call's `matched` leaves: e.g. Dynamo's immutable lists are containers to `match`, leaves to optree)."""
    out = []
    try:
        match(specs, treedef.unflatten(list(range(len(flat)))), path, out, params, top=top, fname=fname)
    except SpecError:  # optree opens fewer containers here than `match` (Dynamo's immutable dicts)
        return False
    idx = [v for _, v, _, _ in out]
    if (not all(type(i) is int for i in idx) or sorted(idx) != list(range(len(flat)))
            or len(matched) != len(out) or any(flat[i] is not m[1] for i, m in zip(idx, matched))):
        return False
    return [(v, p, sp, a) for p, v, sp, a in out]
