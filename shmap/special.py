"""What a body value means outside batching: metadata, autograd, printing, Python control flow.

`ShTensor.__torch_function__` (tensor.py) looks every function up in `tensor._SPECIAL` first; this
module fills that table.  Metadata (`.shape`, `.dim()`) is the per-device one; `.grad`, `.data`,
`backward`, `torch.autograd.grad` and hooks work on the physical tensor and give back body values;
`repr` prints each device's block; `bool()`, `.item()` and friends raise on a varying value
(`VaryingControlFlowError`), since devices could take different branches.

The package imports this module (shard_map.py does), so the table is complete before any body runs.
"""
from __future__ import annotations

import itertools

import torch

from .errors import VmaError, fmt_vma, op_name, shared_write, storage_layout, varying_control_flow
from .cow import argument_of, before_write, check_not_argument, note_view, shared_root
from .tensor import _SPECIAL, ShTensor, expand_to, typed_call, vma


def _metadata(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _phys_attr(name):
    def get(func, args, kwargs):
        return getattr(args[0]._phys, name)

    return get


def _to(func, args, kwargs):
    """`x.to(dtype)` to the dtype `x` already has is `x` itself, as in torch (no op, no autograd
    node): a body that casts its weights to a compute dtype they already have pays nothing."""
    x = args[0]
    if type(x) is ShTensor and len(args) + len(kwargs) == 2:  # x.to(dtype) or x.to(dtype=dtype)
        dtype = args[1] if len(args) == 2 else kwargs.get("dtype")
        if isinstance(dtype, torch.dtype) and dtype == x._phys.dtype:
            return x
    return typed_call(func, args, kwargs)


def _grad_get(func, args, kwargs):
    x = args[0]
    g = x._phys.grad
    return None if g is None else ShTensor(g, x._paxes, x._vma, x._body)


def _grad_set(func, args, kwargs):
    """`x.grad = g` (`opt.zero_grad()` sets None): the physical tensor's gradient; it was ignored (set on
    the wrapper), so the next backward accumulated onto the old gradient."""
    x, g = args[0], args[1]
    if g is not None:
        g = to_layout(g, x)
        if 0 in g.stride():  # (an invariant gradient of a varying value: each device's own copy to accumulate into)
            g = g.contiguous()
    x._phys.grad = g


def _data_get(func, args, kwargs):
    x = args[0]
    r = ShTensor(x._phys.data, x._paxes, x._vma, x._body)
    r._source = x  # (an in-place update through it makes x's memoised lifts stale: tensor._dispatch)
    if shared_root(x) is not None:  # a view of shared memory (cow.py)
        note_view(r, x)
    return r


def _data_set(func, args, kwargs):
    """`x.data = t`: the physical tensor's data (it was set on the wrapper, and ignored).  An argument's is
    read-only; a pvary or collective result first gets memory of its own (cow.py), as for an in-place op."""
    x = args[0]
    check_not_argument(func, x)
    before_write(func, x)
    x._phys.data = to_layout(args[1], x)
    x._lifts = None


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


def _view(func, args, kwargs):
    """`x.view(shape)` / `x.view_as(y)`: as on each device, also where the simulated mesh's layout differs.

    On the simulated mesh a value's blocks are rows of one tensor, and an elementwise op keeps its
    operand's layout: the result of `a * 2` for an argument `a` split along a later dim (`P(None, 'i')`)
    has its devices' rows interleaved, so no per-device `view` of it exists, while a process holds
    that result as a fresh contiguous block (its operand, a slice with gaps, is not dense) and views it
    freely.  A value whose blocks are rows in order (a device holds them contiguous: `stride()` says
    so) is then given device-major memory of its own (a copy, done once: the value and its later views
    share it), and viewed.  A value whose per-device dims are permuted (`x.t()`), an argument, a view
    or a leaf raise torch's error as a process does.  (A view of the value taken before the copy keeps
    the old memory: a write through it afterwards would not reach the value.  Rare: such a view, then a
    `view` that needs the copy, then that write.)"""
    try:
        return typed_call(func, args, kwargs)
    except RuntimeError as e:
        x = args[0]
        if "view size is not compatible" not in str(e) or not _relayable(x):
            raise
        x._phys = x._phys.contiguous()
        x._lifts = None
        return typed_call(func, args, kwargs)


def _relayable(x) -> bool:
    """Whether a failed per-device view of `x` is a layout of the simulated mesh's own (see `_view`)."""
    if type(x) is not ShTensor or not x._paxes or x._shared is not None or x._root is not None:
        return False
    p = x._phys
    if x._source is not None or p._base is not None or (p.is_leaf and p.requires_grad):
        return False
    if argument_of(x._body, p) is not None:
        return False
    strides = [s for s, n in zip(p.stride()[len(x._paxes):], p.shape[len(x._paxes):]) if n > 1]
    return all(a >= b for a, b in zip(strides, strides[1:]))


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
        who = body.backend.describe_device() if x._vma else None  # None: every device's block is here
        if who is not None:  # one process per device: only this device's block is here
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
    """`format(x, spec)`, e.g. `f"{loss:.4f}"`: with a spec, the value as torch formats it (a 0-d tensor's
    number) where every device holds the same one; a varying value has no one number to show."""
    x, spec = args[0], args[1] if len(args) > 1 else ""
    if not spec:
        return _format(x)
    if x._vma:
        raise varying_control_flow(f"`format(x, {spec!r})` (an f-string's `{{x:{spec}}}`)", x._vma, x._body.mesh)
    with torch._C.DisableTorchFunctionSubclass():
        return format(x._phys.detach(), spec)


_T = torch.Tensor
for _name in ("shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_sparse", "is_quantized", "is_meta",
              "is_mps", "is_cpu", "itemsize", "nbytes"):
    if hasattr(_T, _name):
        _SPECIAL[getattr(_T, _name).__get__] = _metadata
for _m in (_T.size, _T.dim, _T.numel, _T.__len__, _T.is_floating_point, _T.is_complex, _T.element_size,
           _T.nelement, _T.ndimension, _T.get_device, _T.is_contiguous, _T.stride):
    _SPECIAL[_m] = _metadata
for _name in ("requires_grad", "grad_fn", "is_leaf"):
    _SPECIAL[getattr(_T, _name).__get__] = _phys_attr(_name)
_SPECIAL[_T.to] = _to
_SPECIAL[_T.grad.__get__] = _grad_get
_SPECIAL[_T.data.__get__] = _data_get
_SPECIAL[_T.grad.__set__] = _grad_set
_SPECIAL[_T.data.__set__] = _data_set
_SPECIAL[_T.requires_grad_] = _requires_grad_
_SPECIAL[_T.retain_grad] = _retain_grad
_SPECIAL[_T.requires_grad.__set__] = _requires_grad_set
_SPECIAL[torch.autograd.backward] = _autograd_backward
_SPECIAL[_T.register_hook] = _register_hook
_SPECIAL[_T.__hash__] = _hash
_SPECIAL[_T.__iter__] = _iter
_SPECIAL[_T.view] = _view
_SPECIAL[_T.view_as] = _view
_SPECIAL[_T.__repr__] = _repr
_SPECIAL[_T.__str__] = _repr
_SPECIAL[_T.__format__] = _format_spec
_SPECIAL[_T.backward] = _backward
_SPECIAL[torch.autograd.grad] = _autograd_grad
def _storage_op(what):
    """Ops that read or rewrite a value's storage layout: a body value's storage is the mesh's (all devices'
    rows in one tensor on the simulated mesh, a view into the global tensor on a process), so they would
    mean different things on the two meshes; resized in place, a value would also change its per-device
    shape under its type.  Refused on both meshes."""
    def refuse(func, args, kwargs):
        if func in (_T.as_strided, torch.as_strided) and len(args) < 4 and kwargs.get("storage_offset") is None:
            return typed_call(func, args, kwargs)  # (relative to the value itself: the same on both meshes)
        raise storage_layout(what)
    return refuse


for _m, _what in ((_T.resize_, "`resize_`"), (_T.resize_as_, "`resize_as_`"), (_T.as_strided_, "`as_strided_`"),
                  (_T.storage_offset, "`storage_offset()`"),
                  (_T.as_strided, "`as_strided` with a storage_offset"), (torch.as_strided, "`as_strided` with a storage_offset")):
    _SPECIAL[_m] = _storage_op(_what)
for _m, _what in ((_T.__bool__, "Python control flow (`if`/`while`/`bool()`) on a tensor"),
                  (_T.item, "`.item()`"), (_T.tolist, "`.tolist()`"), (_T.numpy, "`.numpy()`"),
                  (_T.__int__, "`int()`"), (_T.__float__, "`float()`"), (_T.__index__, "use as an index"),
                  (_T.__complex__, "`complex()`"), (_T.__array__, "conversion to a NumPy array")):
    _SPECIAL[_m] = _concrete(_what)


def _writes_shared(written, flag, default, what, fix=""):
    """Functions that write some of their tensor arguments as a side effect (`written`: their positions
    and names), when `flag` (position, name) is set: BatchNorm's running statistics in training mode, an
    embedding's rows renormalised by `max_norm`.  Written from values that vary across the devices, a
    tensor every device shares (closed over, or invariant) would be written by each device differently:
    one copy for all on the simulated mesh, one per process on a distributed one.  Refused on both
    meshes, before the op writes anything.  (A varying target made in the body is each device's own; an
    argument is read-only, as for any in-place op.)"""
    def check(func, args, kwargs):
        on = args[flag[0]] if len(args) > flag[0] else kwargs.get(flag[1], default)
        if on is not None and on is not False:
            targets = [args[i] if len(args) > i else kwargs.get(n) for i, n in written]
            union, body = frozenset(), None
            for a in itertools.chain(args, kwargs.values()):
                if isinstance(a, ShTensor) and not any(a is t for t in targets):
                    union, body = union | vma(a), body or a._body
            for t in targets:
                if isinstance(t, torch.Tensor) and union and not (isinstance(t, ShTensor) and union <= vma(t)):
                    raise shared_write(op_name(func), t.shape, body.describe(), what, fix)
                if isinstance(t, ShTensor):  # (an argument is read-only, as for any in-place op)
                    check_not_argument(func, t)
        return typed_call(func, args, kwargs)
    return check


_F = torch.nn.functional
for _m, _written, _flag, _default, _what, *_fix in (
        (_F.batch_norm, ((1, "running_mean"), (2, "running_var")), (5, "training"), False, ""),
        (torch.batch_norm, ((3, "running_mean"), (4, "running_var")), (5, "training"), False, ""),
        (torch.native_batch_norm, ((3, "running_mean"), (4, "running_var")), (5, "training"), False, ""),
        (_F.instance_norm, ((1, "running_mean"), (2, "running_var")), (5, "use_input_stats"), True,
         "InstanceNorm's running statistics with track_running_stats"),
        (torch.instance_norm, ((3, "running_mean"), (4, "running_var")), (5, "use_input_stats"), True,
         "InstanceNorm's running statistics with track_running_stats"),
        (_F.embedding, ((1, "weight"),), (3, "max_norm"), None,
         "an nn.Embedding's weight, whose rows max_norm renormalises in place",
         "renormalise the weight before the shard_map (torch.embedding_renorm_ with the indices of every "
         "device) and drop max_norm, or renormalise a weight of each device's own (varying, made in the body).")):
    _SPECIAL[_m] = _writes_shared(_written, _flag, _default, _what, *_fix)
