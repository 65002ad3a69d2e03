"""Values inside a shard_map body on the simulated mesh: "the type is the layout".

A body value is a `ShTensor`: a wrapper whose shape is the *logical*
(per-device) shape, holding

- `_vma`: the mesh axes along which the value may vary (its type), and
- `_phys`: one plain torch tensor of shape `[size of each varying axis, in
  mesh order] + logical shape` (its layout).

So an invariant value is stored once, `pvary` is a stride-0 `expand`, and a
collective is a tensor op on leading dimensions.  Ordinary torch ops are
intercepted in `__torch_function__` (above autograd, so automatic `pvary`s
enter the autograd graph) and executed once over all devices with functorch's
batching rules (below autograd), so simulating N devices costs about what the
same global computation costs on one.

Invariant maintained for every value a user can hold: its physical leading
axes equal its type (`_paxes == vma`).  The one exception is internal: when an
op mixes an invariant operand with varying ones, the invariant operand is
lifted by a *physical no-op* that only changes its type (the batched op then
broadcasts it, e.g. one GEMM for `x_blocks @ w`).  The backward of that no-op
receives the cotangent already summed over devices by the batched op's own
backward; it is recorded as the `psum` a real device would perform.

On the distributed mesh `_phys` is this device's block (`_paxes == ()`) and the
type is metadata checked by the same rules.  Where the two differ, `_dispatch`
asks the body's backend (`backends/protocol.py`): `lift` for the automatic
`pvary`, `run_op` to execute an op on the physical values.

Beside this module: `recording.py` (`LogComm`: the autograd node that records
a collective and its transpose), `special.py` (the functions that need a
value's meaning rather than batching: metadata, `.grad`, `backward`, `repr`,
`bool()`; the `_SPECIAL` table).
"""
from __future__ import annotations

import optree
import torch

from . import batching, context, cow, unreduced
from .cow import PLAIN as _PLAIN
from .errors import VmaError, fmt_vma, inplace_input, nested_in_pmap, no_torch_function, op_name, storage_layout


# --------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------
def expand_to(phys: torch.Tensor, paxes: tuple, target: tuple, sizes: dict) -> torch.Tensor:
    """Insert (stride-0) leading dims so that `phys` has axes `target` (mesh order)."""
    if paxes == target:
        return phys
    t = phys
    for pos, ax in enumerate(target):
        if ax not in paxes:
            t = t.unsqueeze(pos)
    lead = [sizes[a] for a in target]
    return t.expand(*lead, *t.shape[len(target):])


# --------------------------------------------------------------------------
# The body value
# --------------------------------------------------------------------------
#: func -> handler(func, args, kwargs) for functions that need a body value's meaning, not
#: batching (`.shape`, `.grad`, `backward`, `repr`, `bool()`); filled by special.py
_SPECIAL: dict = {}


class ShTensor(torch.Tensor):
    """A per-device value inside a shard_map body (simulated mesh)."""

    # Defaults read from the class until set: a body makes a value per op, and a step makes hundreds.
    _lifts = None  # {(target vma, grad mode): (version, lifted physical tensor)} (`lift`)
    _source = None  # the value whose `.data` this is (`special._data_get`): its lifts go stale with this
    _unreduced = frozenset()  # the subset of _vma along which the value is a pending sum
    _shared = None  # a pvary / collective result not yet written in place: "always" or "view" (cow.py)
    _root = None  # the shared value whose memory this one views (cow.note_views)
    _viewed = False  # (a shared value) a view of it exists

    @staticmethod
    def __new__(cls, phys, paxes, vma, body, unreduced=None):
        r = torch.Tensor._make_wrapper_subclass(  # (requires_grad False: autograd sees the physical tensors)
            cls, phys.shape[len(paxes):] if paxes else phys.shape, dtype=phys.dtype, device=phys.device)
        r._phys = phys
        r._paxes = paxes
        r._vma = vma  # every axis the per-device data may differ along (unreduced ones included)
        r._body = body
        if unreduced:
            r._unreduced = unreduced
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.set_:  # (Tensor.set_ skips __torch_function__)
            raise storage_layout("`set_`")
        if not torch._C._is_torch_function_enabled():  # e.g. Dynamo's guards on a compiled helper's input
            raise TypeError(no_torch_function(func))
        raise RuntimeError(
            f"shmap internal error: {func} reached a body value below autograd; "
            "please report this with the code that triggered it."
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs)
        return typed_call(func, args, kwargs)


def typed_call(func, args, kwargs):
    """`func` on body values by its type rule: the elementwise fast path, or the general dispatch."""
    fast = _FAST.get(func)
    if fast is None:
        fast = _fast(func)
    if fast:
        out = _same_type_elementwise(func, args, kwargs)
        if out is not None:
            return out
    return _dispatch(func, args, kwargs)


def logical_shape(x: "ShTensor") -> torch.Size:
    """A body value's per-device shape, read from its physical tensor (`x.shape` is the same, through
    `__torch_function__`: the boundary and the collectives ask on every call)."""
    return x._phys.shape[len(x._paxes):]


def vma(x) -> frozenset:
    """The set of mesh axes along which `x` may vary (empty for invariant values).

    Axes along which `x` is unreduced (see `unreduced_axes`) are not included,
    as in JAX's types.
    """
    if isinstance(x, ShTensor):
        return x._vma - x._unreduced if x._unreduced else x._vma
    return frozenset()


def unreduced_axes(x) -> frozenset:
    """The mesh axes along which `x` is unreduced: a pending sum over their devices."""
    return x._unreduced if isinstance(x, ShTensor) else frozenset()


# --------------------------------------------------------------------------
# Automatic pvary
# --------------------------------------------------------------------------
def lift(x, target: frozenset, body, dtype=None):
    """Physical tensor of `x` typed as varying along `target` (a no-op copy-wise).

    Memoised per value (and grad mode) so that one value used in several ops
    gets one node, hence one `psum` in the backward pass.  With `dtype` (an
    elementwise op that promotes `x`, e.g. a bfloat16 weight times float32
    data) the promoted copy is lifted, as JAX inserts its `pvary` after the
    op's conversion: the cotangent is then summed over devices in the
    promoted dtype and rounded once, on both meshes.
    """
    grad = torch.is_grad_enabled()
    if isinstance(x, ShTensor):
        added = target - x._vma
        if not added:
            return x._phys
        if x._lifts is None:
            x._lifts = {}
        key = (target, grad) if dtype is None else (target, grad, dtype)
        got = x._lifts.get(key)
        version = x._phys._version  # (an update through a view or detach() shares it: the lift is stale)
        if got is None or got[0] != version:
            phys = x._phys if dtype is None else x._phys.to(dtype)
            got = x._lifts[key] = (version, _lift_phys(phys, x.shape, added, body))
        return got[1]
    key = (id(x), target, grad) if dtype is None else (id(x), target, grad, dtype)
    got = body.lift_cache.get(key)
    if got is None or got[0] is not x or got[1] != x._version:
        got = (x, x._version, _lift_phys(x if dtype is None else x.to(dtype), x.shape, target, body))
        body.lift_cache[key] = got
    return got[2]


def _logical_dtype(func, args, kwargs, tensor_idx, numbers=False):
    """The dtype torch promotes an elementwise op's logical operands to (its default rule; with `numbers`
    the Python numbers among the arguments count too), or None: not an elementwise op, or dtypes torch's
    rules do not combine (the op itself will say so).  It reads the logical operands, since a 0-d one
    promotes differently, so it flattens `args` again: asked only for operands of mixed dtypes (rare)."""
    if getattr(func, "__name__", "") not in batching.POINTWISE:
        return None
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    operands = batching.flatten(args, kwargs)[0]
    extra = [v for v in operands if isinstance(v, (int, float, complex)) and not isinstance(v, bool)] \
        if numbers else []
    try:
        _, out = elementwise_dtypes(*[operands[k] for k in tensor_idx], *extra,
                                    type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    except Exception:  # noqa: BLE001 - dtypes torch's rules do not combine: the op itself will say so
        return None
    return out


def _promoted(func, args, kwargs, tensor_idx):
    """The floating (or complex) dtype an elementwise op of mixed-dtype operands promotes them to, else None
    (what a lifted narrower operand is cast to first: `_lift_dtype`)."""
    out = _logical_dtype(func, args, kwargs, tensor_idx)
    return out if out is not None and (out.is_floating_point or out.is_complex) else None


def _common_dtype(func, args, kwargs, leaves, tensor_idx):
    """The physical operands (`leaves`) of an elementwise op of mixed-dtype operands, cast in place to the
    dtype torch promotes the logical operands to.

    Promotion reads ranks: a 0-d tensor does not set the dtype beside a dimensioned one of its category.
    On the simulated mesh a varying 0-d value is physically 1-d (its device dim) while an invariant one
    stays 0-d, so invariant float64 + varying float32 came out float32, where torch on the per-device
    values, the distributed mesh and JAX give float64.  Casting to the logical common dtype first is
    what torch does inside the op anyway."""
    common = _logical_dtype(func, args, kwargs, tensor_idx, numbers=True)
    if common is None:
        return
    for k in tensor_idx:
        if leaves[k].dtype != common and leaves[k].dtype != torch.bool:
            leaves[k] = leaves[k].to(common)


def _lift_dtype(leaf, promoted):
    """`promoted` where it widens `leaf`'s floating dtype (the lift of a narrower operand), else None."""
    if promoted is None or leaf.dtype == promoted or not (leaf.dtype.is_floating_point or leaf.dtype.is_complex):
        return None
    return promoted if torch.promote_types(leaf.dtype, promoted) == promoted else None


def _lift_phys(phys, logical_shape, added, body):
    return body.backend.lift(phys, logical_shape, body.order(added), body)


# --------------------------------------------------------------------------
# Dispatch: typing, automatic pvary, execution (batching.py), wrapping
# --------------------------------------------------------------------------
_INPLACE_DUNDERS = frozenset(
    "__iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ __iand__ __ior__ "
    "__ixor__ __ilshift__ __irshift__ __imatmul__ __setitem__".split()
)


_INPLACE_CACHE: dict = {}


def _is_inplace(func) -> bool:
    got = _INPLACE_CACHE.get(func)
    if got is None:
        name = getattr(func, "__name__", "")
        if isinstance(func, torch._ops.OpOverload):  # torch.ops.aten.mul_.Tensor: "mul_.Tensor"
            name = func.overloadpacket.__name__
        got = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
        try:
            _INPLACE_CACHE[func] = got
        except TypeError:  # unhashable callable
            pass
    return got


_EMPTY = frozenset()


def _dispatch(func, args, kwargs):
    leaves, treedef = batching.flatten(args, kwargs)
    body = None
    union = _EMPTY
    tensor_idx = []
    pending = False
    dtype0, mixed = None, False  # (operands of several dtypes: promotion reads the logical operands)
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if dtype0 is None:
                dtype0 = leaf.dtype
            elif leaf.dtype is not dtype0:
                mixed = True
        if isinstance(leaf, ShTensor):
            b = leaf._body
            if b is not body:
                if body is None and b.active:
                    body = b
                elif body is None and context.in_backward():
                    body = b  # a backward pass recomputing body code (checkpoint) or running a hook
                    context.used_in_backward(b)
                else:
                    body = _join_bodies(func, body, b)
            v = leaf._vma
            if v is not union and v:
                union = union | v if union else v
            tensor_idx.append(k)
            if leaf._unreduced:
                pending = True
        elif isinstance(leaf, torch.Tensor):
            tensor_idx.append(k)
            if type(leaf) is not torch.Tensor:
                _check_not_dtensor(func, leaf)
            if torch._C._len_torch_dispatch_stack() and type(leaf) in _PLAIN:
                _check_traced_closure(func, leaf)

    if kwargs and kwargs.get("out") is not None:
        raise TypeError(
            f"{op_name(func)}: `out=` is not supported inside a shard_map body. "
            "Fix: assign the result instead, e.g. `y = torch.add(a, b)`; from library code (torch.optim's "
            "single-tensor Adam with amsgrad, Adamax), use its foreach=True form."
        )

    inplace = _INPLACE_CACHE.get(func)
    if inplace is None:
        inplace = _is_inplace(func)
    self_val = args[0] if inplace and args else None
    if inplace:
        _check_inplace(func, self_val, union, body)
        if isinstance(self_val, ShTensor):
            cow.before_write(func, self_val)

    if body is None:  # body values hidden in a container torch cannot see into
        raise TypeError(
            f"{op_name(func)}: got shard_map body values inside an argument structure shmap cannot "
            "traverse. Fix: pass tensors directly or in lists, tuples or dicts."
        )
    out_unreduced = _EMPTY
    if pending:
        # Adding 0 keeps a sum pending (so `sum(...)` and `total = 0` work); other numbers do not.
        has_number = any(isinstance(v, (int, float, complex)) and not isinstance(v, bool) and v != 0
                         for v in args[1:])
        out_unreduced = unreduced.check(func, [leaves[k] for k in tensor_idx], body, has_number, args, kwargs)
    batched = []
    promoted = False  # (found on the first lift: `_promoted`)
    shared = None  # operands that share memory (cow.py): a view of one is noted
    for k in tensor_idx:
        leaf = leaves[k]
        if isinstance(leaf, ShTensor):
            if leaf._shared is not None or leaf._root is not None:
                shared = (shared or []) + [leaf]
            v = leaf._vma
            if v is union or v == union or (inplace and leaf is self_val):
                leaves[k] = leaf._phys
            else:
                if promoted is False:
                    promoted = _promoted(func, args, kwargs, tensor_idx) if mixed else None
                leaves[k] = lift(leaf, union, body, _lift_dtype(leaf, promoted))
            if leaf._paxes:
                batched.append((k, leaf._paxes))
        elif union and not (inplace and leaf is self_val):
            if promoted is False:
                promoted = _promoted(func, args, kwargs, tensor_idx) if mixed else None
            leaves[k] = lift(leaf, union, body, _lift_dtype(leaf, promoted))

    if mixed and not inplace:
        _common_dtype(func, args, kwargs, leaves, tensor_idx)
    out, out_paxes = body.backend.run_op(func, leaves, treedef, batched, union, inplace, body)

    if inplace:
        if isinstance(self_val, ShTensor):
            self_val._lifts = None
            if self_val._source is not None:  # (`x.data.add_(...)`: .data has a version counter of its own)
                self_val._source._lifts = None
        return self_val
    res = (ShTensor(out, out_paxes, union, body, out_unreduced) if type(out) is torch.Tensor
           else _wrap_out(out, out_paxes, union, body, out_unreduced))
    if shared:
        cow.note_views(res, shared)
    return res


_FAST: dict = {}


def _fast(func) -> bool:
    """Whether `func` may take `_same_type_elementwise`: an elementwise op, not in place."""
    ok = getattr(func, "__name__", "") in batching.POINTWISE and not _is_inplace(func)
    try:
        _FAST[func] = ok
    except TypeError:  # unhashable callable
        pass
    return ok
_NUMBER = (int, float, complex)


def _same_type_elementwise(func, args, kwargs):
    """The common case of `_dispatch`, or None: an elementwise op whose tensor operands are values
    of one running body with one type (vma) and one rank, beside plain numbers. `_dispatch` would
    lift nothing and find the op direct (`batching.direct_ok`: same device dims, same rank), so
    it runs on the physical tensors as they are; this skips the general bookkeeping."""
    first = None
    for a in args:
        if type(a) is ShTensor:
            if first is None:
                first = a
            elif a._body is not first._body or a._vma != first._vma or a._phys.dim() != first._phys.dim():
                return None
            if a._unreduced or a._shared is not None or a._root is not None:  # (cow.py: `_dispatch` notes
                return None  # views, and `y.float()` of a float32 `y` is `y`)
        elif not isinstance(a, _NUMBER):
            return None
    if first is None or not first._body.active:
        return None
    for v in kwargs.values():
        if not isinstance(v, _NUMBER):
            return None
    out = func(*[a._phys if type(a) is ShTensor else a for a in args], **kwargs)
    if type(out) is not torch.Tensor:
        return _wrap_out(out, first._paxes, first._vma, first._body)
    return ShTensor(out, first._paxes, first._vma, first._body)


def _join_bodies(func, body, b):
    """The inner of two bodies when one nests in the other (an outer value closed over
    inside a nested shard_map: its layout is valid in the inner body too); else an error."""
    if body is not None and b.active:
        p = body.parent
        while p is not None:
            if p is b:
                return body
            p = p.parent
        p = b.parent
        while p is not None:
            if p is body:
                return b
            p = p.parent
    _bad_body(func, body, b)


def _check_traced_closure(func, t):
    """Traced (torch.compile, shmap.jit), a tensor closed over by a body is invisible to the capture
    (see compile.py)."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        raise VmaError(
            f"{op_name(func)}: a shard_map body traced by torch.compile or shmap.jit uses a tensor of shape "
            f"{tuple(t.shape)} it closes over. A capture puts a shard_mapped call in its graph as one "
            "node and sees only its arguments. Fix: pass the tensor as an argument with in_spec P() "
            "(replicated), e.g. shard_map(f, in_specs=(..., P()))(..., w)."
        )


def _check_not_dtensor(func, t):
    """A DTensor closed over by a body (not an argument) holds only this rank's block, and the body
    computes per device, so DTensor would mix the two (its own error names neither): refused."""
    from .dtensor import is_dtensor  # (dtensor imports the backends, which import this module)

    if not is_dtensor(t):
        return
    raise VmaError(
        f"{op_name(func)}: a shard_map body uses a DTensor (shape {tuple(t.shape)}, placements "
        f"{tuple(t.placements)}) it closes over. On the distributed mesh a global value enters a body through "
        "an argument and its in_spec, which say which block each device sees. Fix: pass it as an argument, "
        "e.g. shard_map(f, in_specs=(..., P()))(..., w), or close over `w.full_tensor()` (the global value, "
        "every rank holding it)."
    )


def _bad_body(func, body, b):
    if not b.active:
        raise VmaError(
            f"{op_name(func)}: a value from a shard_map body that has already returned was used. "
            "Body values only exist while their body runs. Fix: return it from the body "
            "(with an out_spec) and use the global result instead."
        )
    if b.kind == "pmap" and body.kind != "pmap":
        raise VmaError(nested_in_pmap(f"{op_name(func)}: a shard_map body uses a value of a running pmap body"))
    raise VmaError(
        f"{op_name(func)}: operands come from two different shard_map bodies "
        f"(meshes {body.describe()} and {b.describe()}). Fix: pass values into the inner "
        "shard_map as arguments instead of closing over the outer body's values."
    )


def _wrap_out(out, paxes, vma_, body, unreduced_=frozenset()):
    if isinstance(out, torch.Tensor):
        return ShTensor(out, paxes, vma_, body, unreduced_)
    if body is None:
        return out
    leaves, treedef = optree.tree_flatten(out, none_is_leaf=True)
    if not any(isinstance(o, torch.Tensor) for o in leaves):
        return out
    leaves = [ShTensor(o, paxes, vma_, body, unreduced_) if isinstance(o, torch.Tensor) else o for o in leaves]
    return optree.tree_unflatten(treedef, leaves)


def _check_inplace(func, self_val, union, body):
    if isinstance(self_val, ShTensor):
        cow.check_not_argument(func, self_val)
    self_vma = self_val._vma if isinstance(self_val, ShTensor) else frozenset()
    if not union <= self_vma:
        what = ("a plain tensor (invariant: made outside the body, or by a factory such as torch.zeros in it)"
                if not isinstance(self_val, ShTensor) else f"a value varying along {fmt_vma(self_vma, body.axes)}")
        raise VmaError(
            f"{op_name(func)}: in-place update of {what} with operands varying along "
            f"{fmt_vma(union, body.axes)} (mesh {body.describe()}). An in-place op cannot change a value's "
            "device variance: the result would differ across devices but the target may not. "
            + ("Fix: use the optimizer's foreach=True form (a fused step also updates its step counts, the "
               "same on every device, in the same call)." if getattr(func, "__name__", "").startswith("_fused_")
               else "Fix: compute out of place, e.g. `x = x + y`, or `x = shmap.pvary(x, axes)` first.")
        )
