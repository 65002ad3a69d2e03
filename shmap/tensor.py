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
"""
from __future__ import annotations

import itertools

import optree
import torch

from . import batching, comm, context, ops, unreduced
from .batching import fname as _fname
from .errors import VmaError, fmt_vma, inplace_input, varying_control_flow


# --------------------------------------------------------------------------
# Recording identity: the autograd node that logs a collective and its
# transpose.  Physical data movement is done by plain torch ops around it.
# --------------------------------------------------------------------------
class LogComm(torch.autograd.Function):
    """Identity that records `fwd` when run and `bwd` when transposed.

    Its backward is itself with the events swapped, so transposing any number
    of times records the right collective each time (second order included).
    """

    generate_vmap_rule = True  # torch.func transforms of a shard_mapped function (from outside)

    @classmethod
    def apply(cls, *args):
        # Function.apply binds the arguments of a Function with setup_context to forward's
        # signature (inspect.signature, ~70 us) on every call, to fill in defaults; there are none
        # here and every call passes all three. Under a torch.func transform the full path runs.
        if torch._C._are_functorch_transforms_active():
            return _FUNCTION_APPLY(cls, *args)
        return _C_APPLY.__get__(None, cls)(*args)

    @staticmethod
    def forward(x, fwd, bwd):
        if fwd is not None:
            ops.record(fwd, x)
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.events = (inputs[1], inputs[2])

    @staticmethod
    def jvp(ctx, t, _fwd, _bwd):
        # Forward mode: the tangent goes through the same collective as the primal.
        fwd = ctx.events[0]
        if fwd is not None:
            ops.record(fwd, t)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        fwd, bwd = ctx.events
        # Without create_graph this only records (no node is built).
        return log_comm(g, bwd, fwd), None, None


_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"].__func__
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]


def log_comm(phys, fwd, bwd):
    """Attach the (forward, transpose) communication events to `phys`."""
    if fwd is None and bwd is None:
        return phys
    if not (torch.is_grad_enabled() and phys.requires_grad):
        if fwd is not None:
            ops.record(fwd, phys)
        return phys
    return LogComm.apply(phys, fwd, bwd)


def event(kind, axes, logical_shape, dtype):
    # int(): under torch.compile with dynamic shapes a size may be symbolic; an event reports
    # concrete bytes, so its sizes are specialised (guarded) in the compiled graph.
    shape = tuple(int(s) for s in logical_shape)
    numel = 1
    for s in shape:
        numel *= s
    return comm.CommEvent(kind, tuple(axes), numel * dtype.itemsize, shape, str(dtype))


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


def mesh_order(axes, body) -> tuple:
    return tuple(a for a in body.axes if a in axes)


# --------------------------------------------------------------------------
# The body value
# --------------------------------------------------------------------------
class ShTensor(torch.Tensor):
    """A per-device value inside a shard_map body (simulated mesh)."""

    @staticmethod
    def __new__(cls, phys, paxes, vma, body, unreduced=frozenset()):
        r = torch.Tensor._make_wrapper_subclass(
            cls, phys.shape[len(paxes):], dtype=phys.dtype, device=phys.device, requires_grad=False
        )
        r._phys = phys
        r._paxes = paxes
        r._vma = vma  # every axis the per-device data may differ along (unreduced ones included)
        r._body = body
        r._lifts = None
        r._unreduced = unreduced  # the subset of _vma along which the value is a pending sum
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
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
        fast = _FAST.get(func)
        if fast is None:
            fast = _fast(func)
        if fast:
            out = _same_type_elementwise(func, args, kwargs)
            if out is not None:
                return out
        return _dispatch(func, args, kwargs)



def wrap(phys, paxes, vma, body) -> ShTensor:
    return ShTensor(phys, paxes, vma, body)


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
def lift(x, target: frozenset, body):
    """Physical tensor of `x` typed as varying along `target` (a no-op copy-wise).

    Memoised per value (and grad mode) so that one value used in several ops
    gets one node, hence one `psum` in the backward pass.
    """
    grad = torch.is_grad_enabled()
    if isinstance(x, ShTensor):
        added = target - x._vma
        if not added:
            return x._phys
        if x._lifts is None:
            x._lifts = {}
        got = x._lifts.get((target, grad))
        if got is None:
            got = _lift_phys(x._phys, x.shape, added, body)
            x._lifts[(target, grad)] = got
        return got
    key = (id(x), target, grad)
    got = body.lift_cache.get(key)
    if got is None or got[0] is not x:
        got = (x, _lift_phys(x, x.shape, target, body))
        body.lift_cache[key] = got
    return got[1]


def _lift_phys(phys, logical_shape, added, body):
    return body.backend.lift(phys, logical_shape, mesh_order(added, body), body)


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
    for k, leaf in enumerate(leaves):
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
            if torch._C._len_torch_dispatch_stack() and type(leaf) is torch.Tensor:
                _check_traced_closure(func, leaf)

    if kwargs and kwargs.get("out") is not None:
        raise TypeError(
            f"{_fname(func)}: `out=` is not supported inside a shard_map body. "
            "Fix: assign the result instead, e.g. `y = torch.add(a, b)`."
        )

    inplace = _is_inplace(func)
    self_val = args[0] if inplace and args else None
    if inplace:
        _check_inplace(func, self_val, union, body)
        if isinstance(self_val, ShTensor):
            _make_writable(self_val)

    if body is None:  # body values hidden in a container torch cannot see into
        raise TypeError(
            f"{_fname(func)}: got shard_map body values inside an argument structure shmap cannot "
            "traverse. Fix: pass tensors directly or in lists, tuples or dicts."
        )
    out_unreduced = _EMPTY
    if pending:
        # Adding 0 keeps a sum pending (so `sum(...)` and `total = 0` work); other numbers do not.
        has_number = any(isinstance(v, (int, float, complex)) and not isinstance(v, bool) and v != 0
                         for v in args[1:])
        out_unreduced = unreduced.check(func, [leaves[k] for k in tensor_idx], body, has_number)
    out_paxes = body.order(union) if body.backend.batched else ()
    batched = []
    for k in tensor_idx:
        leaf = leaves[k]
        if isinstance(leaf, ShTensor):
            v = leaf._vma
            leaves[k] = leaf._phys if v is union or v == union or (inplace and leaf is self_val) else lift(
                leaf, union, body)
            if leaf._paxes:
                batched.append((k, leaf._paxes))
        elif union and not (inplace and leaf is self_val):
            leaves[k] = lift(leaf, union, body)

    if not batched or inplace:
        out = batching.run_batched(func, leaves, treedef, batched, out_paxes, body)
    else:
        direct = batching.DIRECT.get(func)
        if direct is not None and direct[0](*batching.unflatten(treedef, leaves), batched, out_paxes):
            args, kwargs = batching.unflatten(treedef, leaves)
            out = direct[1](batched, out_paxes, *args, **kwargs)  # a hand-written form over the device dims
        elif batching.direct_ok(func, leaves, batched, out_paxes):
            args, kwargs = batching.unflatten(treedef, leaves)
            out = func(*args, **kwargs)  # device dims broadcast like ordinary leading dims: no vmap needed
        else:
            out = batching.run_batched(func, leaves, treedef, batched, out_paxes, body)

    if inplace:
        if isinstance(self_val, ShTensor):
            self_val._lifts = None
        return self_val
    if type(out) is torch.Tensor:
        return ShTensor(out, out_paxes, union, body, out_unreduced)
    return _wrap_out(out, out_paxes, union, body, out_unreduced)


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
            if a._unreduced:
                return None
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
    """Under torch.compile a tensor closed over by a body is invisible to Dynamo (see compile.py)."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        raise VmaError(
            f"{_fname(func)}: a shard_map body compiled with torch.compile uses a tensor of shape "
            f"{tuple(t.shape)} it closes over. torch.compile puts a shard_mapped call in its graph as one "
            "node and sees only its arguments. Fix: pass the tensor as an argument with in_spec P() "
            "(replicated), e.g. shard_map(f, in_specs=(..., P()))(..., w)."
        )


def _bad_body(func, body, b):
    if not b.active:
        raise VmaError(
            f"{_fname(func)}: a value from a shard_map body that has already returned was used. "
            "Body values only exist while their body runs. Fix: return it from the body "
            "(with an out_spec) and use the global result instead."
        )
    raise VmaError(
        f"{_fname(func)}: operands come from two different shard_map bodies "
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
        _check_not_argument(func, self_val)
    self_vma = self_val._vma if isinstance(self_val, ShTensor) else frozenset()
    if not union <= self_vma:
        what = "a value created outside the body (invariant)" if not isinstance(self_val, ShTensor) else (
            f"a value varying along {fmt_vma(self_vma, body.axes)}"
        )
        raise VmaError(
            f"{_fname(func)}: in-place update of {what} with operands varying along "
            f"{fmt_vma(union, body.axes)} (mesh {body.describe()}). An in-place op cannot change a value's "
            "device variance: the result would differ across devices but the target may not. "
            "Fix: compute out of place, e.g. `x = x + y`, or `x = shmap.pvary(x, axes)` first."
        )


def storage_key(t):
    """Identity of `t`'s storage (views share it), or None where there is none to read (fake tensors)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - functorch wrappers, FakeTensor under torch.compile
        return None
    return ptr or None  # empty tensors all sit at 0


def _check_not_argument(func, x):
    """Arguments are read-only in the body (shard_map marks their storage; see shard_map._read_only).

    An argument or a view of it (same type) raises; a `pvary` of one (a new value in JAX, sharing the
    storage) gets its own copy first, on both meshes (the simulated one would copy its stride-0
    layout anyway; a distributed block would otherwise write into the caller's tensor).
    """
    marked = x._body.__dict__.get("read_only")
    if marked:
        got = marked.get(storage_key(x._phys))
        if got is not None:
            who, arg_vma = got
            if x._vma <= arg_vma:
                raise inplace_input(_fname(func), who, x._body)
            x._phys = x._phys.clone()


def _make_writable(x: ShTensor):
    """Give `x` its own storage if its layout is a stride-0 broadcast (from pvary)."""
    k = len(x._paxes)
    st = x._phys.stride()
    if any(st[d] == 0 and x._phys.shape[d] > 1 for d in range(k)):
        x._phys = x._phys.clone()


# --------------------------------------------------------------------------
# Functions that need a body value's meaning, not batching
# --------------------------------------------------------------------------
def _metadata(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _phys_attr(name):
    def get(func, args, kwargs):
        return getattr(args[0]._phys, name)

    return get


def _grad_get(func, args, kwargs):
    x = args[0]
    g = x._phys.grad
    return None if g is None else ShTensor(g, x._paxes, x._vma, x._body)


def _data_get(func, args, kwargs):
    x = args[0]
    return ShTensor(x._phys.data, x._paxes, x._vma, x._body)


def _requires_grad_(func, args, kwargs):
    x = args[0]
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    x._phys.requires_grad_(flag)
    x._lifts = None
    return x


def _requires_grad_set(func, args, kwargs):
    x = args[0]
    x._phys.requires_grad = args[1]
    x._lifts = None


def _autograd_backward(func, args, kwargs):
    tensors = args[0] if args else kwargs.pop("tensors")
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    grads = kwargs.pop("grad_tensors", None) if len(args) < 2 else args[1]
    if grads is None or isinstance(grads, torch.Tensor):
        grads = [grads] * len(tensors) if grads is None else [grads]
    inputs = kwargs.pop("inputs", None)
    if inputs is not None:
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        inputs = [i._phys if isinstance(i, ShTensor) else i for i in inputs]
    phys = [t._phys if isinstance(t, ShTensor) else t for t in tensors]
    seeds = [_seed_grad(t, g) for t, g in zip(tensors, grads)]
    with torch._C.DisableTorchFunctionSubclass():
        torch.autograd.backward(phys, seeds, inputs=inputs, **kwargs)


def _retain_grad(func, args, kwargs):
    args[0]._phys.retain_grad()


def _hash(func, args, kwargs):
    return id(args[0])


def _iter(func, args, kwargs):
    x = args[0]
    if x.dim() == 0:
        raise TypeError("iteration over a 0-d tensor")
    return iter(x.unbind(0))


def _concrete(what):
    def get(func, args, kwargs):
        x = args[0]
        if x._vma:
            raise varying_control_flow(what, x._vma, x._body.mesh)
        with torch._C.DisableTorchFunctionSubclass():
            return func(x._phys, *args[1:], **kwargs)

    return get


def _register_hook(func, args, kwargs):
    x, hook = args[0], args[1]

    def phys_hook(g):
        r = hook(ShTensor(g, x._paxes, x._vma, x._body))
        return None if r is None else to_layout(r, x)

    return x._phys.register_hook(phys_hook)


def to_layout(v, like: ShTensor) -> torch.Tensor:
    """Physical tensor of `v` laid out like `like` (v may vary along a subset)."""
    body = like._body
    if isinstance(v, ShTensor):
        if not v._vma <= like._vma:
            raise VmaError(
                f"a value varying along {fmt_vma(v._vma, body.axes)} was given where one varying along "
                f"{fmt_vma(like._vma, body.axes)} is expected (mesh {body.describe()}). "
                "Fix: reduce it first, e.g. with shmap.psum."
            )
        return expand_to(v._phys, v._paxes, like._paxes, body.sizes)
    v = torch.as_tensor(v, dtype=like.dtype, device=like.device)
    return expand_to(v, (), like._paxes, body.sizes)


def _seed_grad(out, grad):
    if grad is None:
        if isinstance(out, ShTensor) and out.numel() == 1:
            return torch.ones_like(out._phys)
        return None
    if isinstance(out, ShTensor):
        return to_layout(grad, out)
    return grad._phys if isinstance(grad, ShTensor) else grad


def _backward(func, args, kwargs):
    x = args[0]
    gradient = args[1] if len(args) > 1 else kwargs.pop("gradient", None)
    rest = dict(kwargs)
    rest.pop("gradient", None)
    if "inputs" in rest and rest["inputs"] is not None:
        inp = rest["inputs"]
        inp = [inp] if isinstance(inp, torch.Tensor) else list(inp)
        rest["inputs"] = [i._phys if isinstance(i, ShTensor) else i for i in inp]
    x._phys.backward(_seed_grad(x, gradient), *args[2:], **rest)


def _autograd_grad(func, args, kwargs):
    import inspect

    bound = inspect.signature(torch.autograd.grad).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    outputs, inputs, grad_outputs = a["outputs"], a["inputs"], a["grad_outputs"]
    single_in = isinstance(inputs, torch.Tensor)
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    inputs = [inputs] if single_in else list(inputs)
    if grad_outputs is None:
        grad_outputs = [None] * len(outputs)
    elif isinstance(grad_outputs, torch.Tensor):
        grad_outputs = [grad_outputs]
    phys_go = [_seed_grad(o, g) for o, g in zip(outputs, grad_outputs)]
    phys_out = [o._phys if isinstance(o, ShTensor) else o for o in outputs]
    phys_in = [i._phys if isinstance(i, ShTensor) else i for i in inputs]
    rest = {k: v for k, v in a.items() if k not in ("outputs", "inputs", "grad_outputs")}
    with torch._C.DisableTorchFunctionSubclass():
        grads = torch.autograd.grad(phys_out, phys_in, phys_go, **rest)
    res = tuple(
        ShTensor(g, i._paxes, i._vma, i._body) if (g is not None and isinstance(i, ShTensor)) else g
        for g, i in zip(grads, inputs)
    )
    return res


def _format(x: ShTensor) -> str:
    body = x._body
    kind = "invariant" if not x._vma else f"varying along {fmt_vma(x._vma, body.axes)}"
    head = (
        f"ShTensor(per-device shape {tuple(x.shape)}, {str(x.dtype).replace('torch.', '')}, {kind}, "
        f"mesh {body.describe()}"
    )
    phys = x._phys.detach()
    if phys.grad_fn is None and x._phys.grad_fn is not None:
        head += f", grad_fn={type(x._phys.grad_fn).__name__}"
    head += ")"
    if not x._paxes:
        if x._vma and not body.backend.batched:  # distributed: only this rank's block is here
            who = body.backend.describe_device()
            return head + f"\n  {who}: " + _indent(repr(phys), len(who) + 4)
        return head + "\n  every device: " + _indent(repr(phys), 16)
    lines = [head]
    for idx in itertools.product(*(range(body.sizes[a]) for a in x._paxes)):
        label = ", ".join(f"{a}={i}" for a, i in zip(x._paxes, idx))
        lines.append(f"  device ({label}): " + _indent(repr(phys[idx]), 12 + len(label)))
    return "\n".join(lines)


def _indent(s, n):
    return s.replace("\n", "\n" + " " * n)


def _repr(func, args, kwargs):
    return _format(args[0])


def _format_spec(func, args, kwargs):
    return _format(args[0])


_T = torch.Tensor
_SPECIAL = {}
for _name in ("shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_sparse", "is_quantized", "is_meta",
              "is_mps", "is_cpu", "itemsize", "nbytes"):
    if hasattr(_T, _name):
        _SPECIAL[getattr(_T, _name).__get__] = _metadata
for _m in (_T.size, _T.dim, _T.numel, _T.__len__, _T.is_floating_point, _T.is_complex, _T.element_size,
           _T.nelement, _T.ndimension, _T.get_device, _T.is_contiguous, _T.stride):
    _SPECIAL[_m] = _metadata
for _name in ("requires_grad", "grad_fn", "is_leaf"):
    _SPECIAL[getattr(_T, _name).__get__] = _phys_attr(_name)
_SPECIAL[_T.grad.__get__] = _grad_get
_SPECIAL[_T.data.__get__] = _data_get
_SPECIAL[_T.requires_grad_] = _requires_grad_
_SPECIAL[_T.retain_grad] = _retain_grad
_SPECIAL[_T.requires_grad.__set__] = _requires_grad_set
_SPECIAL[torch.autograd.backward] = _autograd_backward
_SPECIAL[_T.register_hook] = _register_hook
_SPECIAL[_T.__hash__] = _hash
_SPECIAL[_T.__iter__] = _iter
_SPECIAL[_T.__repr__] = _repr
_SPECIAL[_T.__str__] = _repr
_SPECIAL[_T.__format__] = _format_spec
_SPECIAL[_T.backward] = _backward
_SPECIAL[torch.autograd.grad] = _autograd_grad
for _m, _what in ((_T.__bool__, "Python control flow (`if`/`while`/`bool()`) on a tensor"),
                  (_T.item, "`.item()`"), (_T.tolist, "`.tolist()`"), (_T.numpy, "`.numpy()`"),
                  (_T.__int__, "`int()`"), (_T.__float__, "`float()`"), (_T.__index__, "use as an index"),
                  (_T.__complex__, "`complex()`"), (_T.__array__, "conversion to a NumPy array")):
    _SPECIAL[_m] = _concrete(_what)
