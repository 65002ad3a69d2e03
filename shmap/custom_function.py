"""Custom autograd Functions on body values: the user's Function inside one physical Function.

A body value (`ShTensor`) keeps its autograd graph on its physical tensor
(`_phys`), not on the wrapper, so a Function applied to the wrapper would
build its node where no gradient flows.  `torch.autograd.Function.apply` on
body values runs the user's Function inside `_Bridge` instead: the user's
`forward`, `backward` and `jvp` see body values typed as usual (collectives
work in all three; `backward` and `jvp` run with the body re-entered), the
saved tensors are the physical ones, and the cotangents the user's `backward`
returns are checked against the inputs' types, as JAX checks a `custom_vjp`
rule (a cotangent varying along an axis its input is invariant along is an
error naming the `psum` that fixes it).  `torch.utils.checkpoint(use_reentrant=True)`
is such a Function.  The hook is installed on import and does nothing for
arguments that are not body values (one type check per argument).
"""
from __future__ import annotations

import contextlib

import optree
import torch

from . import context
from .backends.functions import _Function
from .cow import shared_root
from .errors import VmaError, fmt_vma
from .tensor import ShTensor, expand_to


def _has_body_value(args, kwargs=None) -> bool:
    for a in args:
        if isinstance(a, ShTensor):
            return True
        if isinstance(a, (list, tuple, dict)):
            if any(isinstance(x, ShTensor) for x in optree.tree_leaves(a, none_is_leaf=True)):
                return True
    if kwargs:
        return _has_body_value(tuple(kwargs.values()))
    return False


def _first_body(leaves):
    for x in leaves:
        if isinstance(x, ShTensor):
            return x._body
    return context.current()


def _in_body(args, kwargs=None) -> bool:
    """Whether a transform must run on physical values: body values in its arguments, or
    a running body (its function may close over body values)."""
    cur = context.current()
    return (cur is not None and cur.active) or _has_body_value(args, kwargs)


class _Type:
    """A body value's type and layout, to rebuild it around another physical tensor."""

    __slots__ = ("paxes", "vma", "unreduced", "root")

    def __init__(self, paxes, vma, unreduced=frozenset(), root=None):
        self.paxes, self.vma, self.unreduced = paxes, vma, unreduced
        #: the pvary / collective result whose memory the value shares (cow.py), if any
        self.root = root

    @staticmethod
    def of(x):
        if isinstance(x, ShTensor):
            return _Type(x._paxes, x._vma, x._unreduced, shared_root(x))
        return _Type((), frozenset())

    def wrap(self, phys, body):
        t = ShTensor(phys, self.paxes, self.vma, body, self.unreduced)
        if self.root is not None and self.root._shared is not None:  # rebuilt around shared memory: a write
            t._root = self.root  # through it is one through a view (refused), as it would lose or leak
        return t


# --------------------------------------------------------------------------
# Custom autograd Functions
# --------------------------------------------------------------------------
class _Call:
    """One application of a user's Function to body values: what the bridge needs."""

    def __init__(self, cls, body, args, kwargs):
        self.cls, self.body, self.kwargs = cls, body, kwargs
        self.template = []  # per positional argument: ('t', index into tensors, _Type) or ('c', value)
        self.in_types = []
        self.in_shapes = []  # per-device (logical) shapes: what a gradient must have
        for a in args:
            if isinstance(a, torch.Tensor):
                self.template.append(("t", len(self.in_types)))
                self.in_types.append(_Type.of(a))
                self.in_shapes.append(tuple(a.shape))
            else:
                self.template.append(("c", a))
        self.out_types = None
        self.out_template = None
        self.saved = None  # (_Type or None per saved tensor)
        self.saved_fwd = None  # (the same, for save_for_forward)

    def args(self, phys):
        return [
            self.in_types[v].wrap(phys[v], self.body) if k == "t" else v
            for k, v in self.template
        ]


class _Ctx:
    """The `ctx` a user's Function sees: the real one, with body values translated."""

    def __init__(self, real, call, phys_in, forward_mode=False):
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_call", call)
        object.__setattr__(self, "_phys_in", phys_in)
        object.__setattr__(self, "_forward_mode", forward_mode)  # (in `jvp`: saved_tensors are save_for_forward's)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __setattr__(self, name, value):
        setattr(self._real, name, value)

    @property
    def needs_input_grad(self):
        flags = self._real.needs_input_grad[1:]
        return tuple(flags[v] if k == "t" else False for k, v in self._call.template)

    def save_for_backward(self, *tensors):
        call = self._call
        call.saved = [_Type.of(t) if isinstance(t, torch.Tensor) else None for t in tensors]
        self._real.save_for_backward(*[_phys(t) for t in tensors])

    def save_for_forward(self, *tensors):
        call = self._call
        call.saved_fwd = [_Type.of(t) if isinstance(t, torch.Tensor) else None for t in tensors]
        self._real.save_for_forward(*[_phys(t) for t in tensors])

    @property
    def saved_tensors(self):
        call = self._call
        types = call.saved_fwd if self._forward_mode else call.saved
        return tuple(
            None if t is None else (ty.wrap(t, call.body) if ty is not None else t)
            for t, ty in zip(self._real.saved_tensors, types or ())
        )

    def mark_non_differentiable(self, *tensors):
        self._real.mark_non_differentiable(*[_phys(t) for t in tensors])

    def mark_dirty(self, *tensors):
        self._real.mark_dirty(*[_phys(t) for t in tensors])

    def set_materialize_grads(self, value):
        self._real.set_materialize_grads(value)


def _phys(t):
    return t._phys if isinstance(t, ShTensor) else t


class _Staging:
    """What a user's forward does to its ctx, replayed on the real one in `setup_context`
    (the form torch.func transforms require of a Function)."""

    def __init__(self, phys):
        object.__setattr__(self, "_ops", [])
        object.__setattr__(self, "needs_input_grad",
                           (False,) + tuple(bool(getattr(p, "requires_grad", False)) for p in phys))

    def __setattr__(self, name, value):
        self._ops.append(("setattr", name, value))

    def __getattr__(self, name):
        for op in reversed(self._ops):
            if op[0] == "setattr" and op[1] == name:
                return op[2]
        raise AttributeError(name)

    def save_for_backward(self, *tensors):
        self._ops.append(("save_for_backward", tensors))

    def save_for_forward(self, *tensors):
        self._ops.append(("save_for_forward", tensors))

    def mark_non_differentiable(self, *tensors):
        self._ops.append(("mark_non_differentiable", tensors))

    def mark_dirty(self, *tensors):
        self._ops.append(("mark_dirty", tensors))

    def set_materialize_grads(self, value):
        self._ops.append(("set_materialize_grads", value))

    def done(self, inputs, outputs):
        """The forward's physical inputs and outputs (attributes of the staging itself, not ctx ops)."""
        object.__setattr__(self, "fwd_in", tuple(inputs))
        object.__setattr__(self, "fwd_out", tuple(outputs))

    def replay(self, ctx, inputs, outputs):
        """The ops on `ctx`, the forward's inputs and outputs among their tensors replaced by
        `setup_context`'s: under a torch.func transform those are the transform's own (wrapped)
        tensors, while forward ran one level below on unwrapped ones.  A tensor saved at that level
        would be a constant to the transform, and its higher derivatives lost (`mark_dirty` of one
        refused).  (Other tensors a forward saves, its intermediates, stay as they are: torch.func
        admits only inputs and outputs, so a transform sees them as constants there too.)"""
        swap = {id(a): b for a, b in zip(self.fwd_in + self.fwd_out, tuple(inputs) + tuple(outputs))}
        for op in self._ops:
            if op[0] == "setattr":
                setattr(ctx, op[1], op[2])
            elif op[0] == "set_materialize_grads":
                ctx.set_materialize_grads(op[1])
            else:
                getattr(ctx, op[0])(*[swap.get(id(t), t) for t in op[1]])


class _Bridge(_Function):
    """The physical Function that runs a user's Function on body values."""

    generate_vmap_rule = True  # vmap over it: the user's forward and backward batched as they are

    @staticmethod
    def forward(call, *phys):
        staging = _Staging(phys)
        call.staging = staging
        proxy = _Ctx(staging, call, phys)
        args = call.args(phys)
        cls = call.cls
        if _uses_setup_context(cls):
            out = cls.forward(*args, **call.kwargs)
            cls.setup_context(proxy, tuple(args), out)
        else:
            out = cls.forward(proxy, *args, **call.kwargs)
        single = not isinstance(out, tuple)
        outs = (out,) if single else out
        call.out_template = single
        call.out_types = [_Type.of(o) if isinstance(o, torch.Tensor) else None for o in outs]
        res = tuple(_phys(o) for o in outs)
        staging.done(phys, res)
        return res[0] if single else res

    @staticmethod
    def setup_context(ctx, inputs, output):
        call = inputs[0]
        ctx.call = call
        outputs = output if isinstance(output, tuple) else (output,)
        call.staging.replay(ctx, inputs[1:], outputs)  # (torch.func may set up several ctxs for one forward)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        body = call.body
        sh = [
            None if g is None or ty is None else ty.wrap(g, body)
            for g, ty in zip(grads, call.out_types)
        ]
        proxy = _Ctx(ctx, call, None)
        backward = call.cls.backward
        once = getattr(backward, "__code__", None) is _ONCE_DIFFERENTIABLE and hasattr(backward, "__wrapped__")
        if once:  # (torch's wrapper would alias the body values it returns below autograd: done here instead)
            backward = backward.__wrapped__
        with context.reentered(body), torch.no_grad() if once else contextlib.nullcontext():
            res = backward(proxy, *sh)
        if not isinstance(res, tuple):
            res = (res,)
        n = len(call.template)
        if len(res) < n or any(g is not None for g in res[n:]):  # torch allows extra trailing Nones only
            raise RuntimeError(
                f"{call.cls.__name__}.backward returned {len(res)} gradients but forward took {n} arguments "
                f"(torch: an incorrect number of gradients, expected {n}). Fix: return one gradient per "
                "forward argument (None for a non-tensor or non-differentiable one)."
            )
        out = []
        for (kind, v), g in zip(call.template, res):
            if kind != "t":
                continue
            out.append(None if g is None else _grad_layout(call, v, g))
        if once and torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
            out = _once_differentiable(out)
        return (None, *out)


    @staticmethod
    def jvp(ctx, _call_tangent, *tangents):
        """Forward mode (torch.func.jvp, jacfwd): the user's `jvp` on body values, as `backward` is."""
        call = ctx.call
        body = call.body
        sh = [None if t is None else call.in_types[i].wrap(t, body) for i, t in enumerate(tangents)]
        proxy = _Ctx(ctx, call, None, forward_mode=True)
        with context.reentered(body):
            res = call.cls.jvp(proxy, *sh)
        res = res if isinstance(res, tuple) else (res,)
        out = []
        for r, ty in zip(res, call.out_types):
            if isinstance(r, ShTensor):
                r = expand_to(r._phys, r._paxes, ty.paxes, body.sizes)
            out.append(r)
        return out[0] if call.out_template else tuple(out)


_ONCE_DIFFERENTIABLE = torch.autograd.function.once_differentiable(lambda ctx: None).__code__


def _once_differentiable(grads):
    """`@once_differentiable`'s graph on the physical gradients (a double backward through them raises
    torch's own error), as its wrapper builds it on a plain Function's."""
    kept = [k for k, g in enumerate(grads) if g is not None]
    if not kept:
        return grads
    err = torch._C._functions.DelayedError(
        b"trying to differentiate twice a function that was marked with @once_differentiable", len(kept))
    fake = []
    for k in kept:
        g = grads[k].detach()
        g.requires_grad = True
        fake.append(g)
    outs = err(*fake)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = list(grads)
    for k, g in zip(kept, outs):
        grads[k] = g
    return grads


def _uses_setup_context(cls):
    return cls.setup_context is not torch.autograd.function._SingleLevelFunction.setup_context


def _grad_layout(call, i, g):
    """The physical cotangent of input `i` from what the user's backward returned."""
    body, ty, shape = call.body, call.in_types[i], call.in_shapes[i]
    if isinstance(g, torch.Tensor) and tuple(g.shape) != shape:
        if not _expandable(shape, tuple(g.shape)):
            raise RuntimeError(
                f"{call.cls.__name__}.backward: the gradient of argument {i} has per-device shape "
                f"{tuple(g.shape)}, but the argument has {shape} (mesh {body.describe()}). Fix: return a "
                "gradient shaped like its argument's block."
            )
        g = g.sum_to_size(shape)  # (as autograd reduces a gradient its input broadcasts to)
    if isinstance(g, ShTensor):
        extra = g._vma - ty.vma
        if extra:
            what = "invariant" if not ty.vma else f"varying only along {fmt_vma(ty.vma, body.axes)}"
            raise VmaError(
                f"{call.cls.__name__}.backward: the gradient of argument {i} varies along "
                f"{fmt_vma(g._vma, body.axes)}, but the argument is {what} (mesh {body.describe()}); "
                "a cotangent has its input's type (JAX checks custom_vjp rules the same way). "
                f"Fix: reduce it in backward, e.g. `shmap.psum(grad, {tuple(body.order(extra))!r})`."
            )
        return expand_to(g._phys, g._paxes, ty.paxes, body.sizes)
    g = torch.as_tensor(g)
    return expand_to(g, (), ty.paxes, body.sizes)


def _expandable(shape, to) -> bool:
    """Whether a tensor of `shape` broadcasts to `to` (autograd then sums a gradient of `to` back)."""
    if len(shape) > len(to):
        return False
    return all(a == b or a == 1 for a, b in zip(reversed(shape), reversed(to)))


_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"].__func__


def _apply(cls, *args, **kwargs):
    if not _has_body_value(args, kwargs) or cls is _Bridge:
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    return _apply_in_body(cls, args, kwargs)


def _apply_in_body(cls, args, kwargs):
    if _uses_setup_context(cls):  # forward's signature has no ctx: bind defaults as torch does
        import inspect

        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        args, kwargs = bound.args, bound.kwargs
    body = _first_body(args) or _first_body(kwargs.values())
    call = _Call(cls, body, args, kwargs)
    phys = [_phys(a) for a in args if isinstance(a, torch.Tensor)]
    out = _ORIGINAL_APPLY(_Bridge, call, *phys)
    outs = (out,) if call.out_template else out
    res = tuple(
        ty.wrap(o, body) if ty is not None and isinstance(o, torch.Tensor) else o
        for o, ty in zip(outs, call.out_types)
    )
    return res[0] if call.out_template else res


torch.autograd.Function.apply = classmethod(_apply)
