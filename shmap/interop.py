"""Body values in `torch.func`: transforms of a body's program run on its physical values.

A body value (`ShTensor`) keeps its autograd graph on its physical tensor
(`_phys`), not on the wrapper, so a transform that builds its graph on the
wrapper would silently lose gradients.  `torch.func` transforms (`grad`,
`grad_and_value`, `vjp`, `jvp`, `vmap`, and those built on them: `jacrev`,
`jacfwd`, `hessian`) applied to body values transform the *physical* program:
body values in, body values out, each device's computation independent, and
the automatic `pvary`s in the graph (so `grad` with respect to an invariant
value is the `psum` JAX gives).  Custom autograd Functions on body values:
`custom_function.py`.

The hooks are installed once, on import, and do nothing for arguments that
are not body values (one type check per argument).
"""
from __future__ import annotations


import optree
import torch
import torch._functorch.apis as _fapis
import torch._functorch.eager_transforms as _ftrans

from . import custom_function  # noqa: F401  (Function.apply on body values)
from .custom_function import _Type, _first_body, _in_body, _phys
from .errors import VmaError, fmt_vma
from .tensor import ShTensor, expand_to


# --------------------------------------------------------------------------
# torch.func transforms of body code
# --------------------------------------------------------------------------
def _to_phys(tree):
    """(physical leaves tree, per-leaf types) for a pytree possibly holding body values."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    types = [_Type.of(x) if isinstance(x, ShTensor) else None for x in leaves]
    return optree.tree_unflatten(spec, [_phys(x) for x in leaves]), types


def _from_phys(tree, types, body):
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    return optree.tree_unflatten(
        spec, [ty.wrap(x, body) if ty is not None and isinstance(x, torch.Tensor) else x
               for x, ty in zip(leaves, types)],
    )


class _Out:
    """Types of a function's outputs (and aux), recorded while the transform runs it."""

    types = None
    aux_types = None


def _grad_and_value_impl(func, argnums, has_aux, args, kwargs):
    if not _in_body(args, kwargs):
        return _ORIG_GRAD_AND_VALUE(func, argnums, has_aux, args, kwargs)
    leaves = optree.tree_leaves((args, kwargs), none_is_leaf=True)
    body = _first_body(leaves)
    pargs, types = _to_phys(args)
    arg_types = types
    out = _Out()

    def run(*phys_args):
        res = func(*_from_phys(phys_args, arg_types, body), **kwargs)
        val, aux = res if has_aux else (res, None)
        if not isinstance(val, torch.Tensor) or val.dim() != 0:
            raise RuntimeError(
                "grad_and_value(f)(*args): Expected f(*args) to return a scalar Tensor (per device), got "
                f"{type(val).__name__} {tuple(getattr(val, 'shape', ()))}."
            )
        p, out.types = _to_phys((val, aux) if has_aux else (val,))
        # Every device differentiates its own scalar: the sum over the device dims.
        return p[0].sum(), p

    g, (_, p) = _ORIG_GRAD_AND_VALUE(run, argnums, True, tuple(pargs), {})
    val, aux = _from_phys(p, out.types, body) if has_aux else (_from_phys(p, out.types, body)[0], None)
    g = _grads_typed(g, argnums, args, body)
    return (g, (val, aux)) if has_aux else (g, val)


def _grads_typed(g, argnums, args, body):
    """Gradients (physical) typed like the arguments they belong to."""
    return _from_phys(g, _to_phys(_ftrans._slice_argnums(args, argnums, as_tuple=False))[1], body)


def _physical(func, types, body, has_aux, out):
    """`func` on typed body values as a function of physical tensors; the outputs' types land in `out`."""
    def run(*phys_args):
        res = func(*_from_phys(phys_args, types, body))
        val, aux = res if has_aux else (res, None)
        p, out.types = _to_phys(val)
        if has_aux:
            pa, out.aux_types = _to_phys(aux)
            return p, pa
        return p
    return run


def _vjp_with_argnums(func, *primals, argnums=None, has_aux=False):
    if not _in_body(primals):
        return _ORIG_VJP(func, *primals, argnums=argnums, has_aux=has_aux)
    body = _first_body(optree.tree_leaves(primals, none_is_leaf=True))
    pprim, types = _to_phys(primals)
    out = _Out()
    run = _physical(func, types, body, has_aux, out)

    got = _ORIG_VJP(run, *pprim, argnums=argnums, has_aux=has_aux)
    pout, pfn = got[0], got[1]
    val = _from_phys(pout, out.types, body)
    out_leaf_types = out.types
    sliced = primals if argnums is None else _ftrans._slice_argnums(primals, argnums, as_tuple=False)
    in_types = _to_phys(sliced)[1]

    out_shapes = [getattr(v, "shape", None) for v in optree.tree_leaves(val, none_is_leaf=True)]

    def vjp_fn(cotangents, **kw):
        leaves, spec = optree.tree_flatten(cotangents, none_is_leaf=True)
        phys = [_cotangent_layout(c, ty, body, shape) for c, ty, shape in zip(leaves, out_leaf_types, out_shapes)]
        return _from_phys(pfn(optree.tree_unflatten(spec, phys), **kw), in_types, body)

    if has_aux:
        return val, vjp_fn, _from_phys(got[2], out.aux_types, body)
    return val, vjp_fn


def _cotangent_layout(c, ty, body, shape=None, forward=False):
    """The physical (co)tangent of a body value of type `ty` and per-device `shape` (vjp's cotangent
    of an output; `forward`: jvp's tangent of a primal), checked in the body's terms."""
    if ty is None or not isinstance(c, torch.Tensor):
        return c
    api, name, of = ("jvp", "tangent", "primal") if forward else ("vjp", "cotangent", "output")
    if shape is not None and tuple(c.shape) != tuple(shape):  # (torch would compare the stacked shapes)
        raise RuntimeError(
            f"{api}: a {name} has per-device shape {tuple(c.shape)} but its {of} has {tuple(shape)} (mesh "
            f"{body.describe()}). Fix: give each {name} its {of}'s per-device shape."
        )
    if isinstance(c, ShTensor):
        if not c._vma <= ty.vma:
            raise VmaError(
                f"{api}: a {name} varies along {fmt_vma(c._vma, body.axes)} but its {of} is "
                f"{'invariant' if not ty.vma else 'varying only along ' + fmt_vma(ty.vma, body.axes)} "
                f"(mesh {body.describe()}). Fix: "
                + ("reduce the cotangent first, e.g. with shmap.psum." if not forward else
                   f"make the {of} vary along those axes too (shmap.pvary), or pass an invariant {name}.")
            )
        return expand_to(c._phys, c._paxes, ty.paxes, body.sizes)
    return expand_to(c, (), ty.paxes, body.sizes)


def _jvp_with_argnums(func, primals, tangents, argnums=None, *, strict=False, has_aux):
    if not _in_body((primals, tangents)):
        return _ORIG_JVP(func, primals, tangents, argnums, strict=strict, has_aux=has_aux)
    body = _first_body(optree.tree_leaves((primals, tangents), none_is_leaf=True))
    pprim, types = _to_phys(tuple(primals))
    ptan = tuple(
        _cotangent_layout(t, ty[0] if ty else None, body, getattr(p, "shape", None), forward=True)
        if isinstance(t, torch.Tensor) else t
        for t, p, ty in zip(tangents, primals, [_to_phys(p)[1] for p in primals])
    )
    # A stride-0 layout (an unmapped input under check_vma=False is expanded over the devices) cannot
    # become a dual tensor ("more than one element ... refers to a single memory location"): own copies.
    pprim, ptan = optree.tree_map(_dense, pprim, none_is_leaf=True), optree.tree_map(_dense, ptan, none_is_leaf=True)
    out = _Out()
    run = _physical(func, types, body, has_aux, out)

    got = _ORIG_JVP(run, pprim, ptan, argnums, strict=strict, has_aux=has_aux)
    val = _from_phys(got[0], out.types, body)
    tan = _from_phys(got[1], out.types, body)
    if has_aux:
        return val, tan, _from_phys(got[2], out.aux_types, body)
    return val, tan


def _dense(t):
    return t.contiguous() if isinstance(t, torch.Tensor) and 0 in t.stride() else t


def _in_range(func, d, rank, what="in_dim"):
    """`d` as a dim of a rank-`rank` body value (negative counts from the end), or torch.vmap's error:
    the device dims in front of the block must not turn an out-of-range dim into another one."""
    if not isinstance(d, int) or not -rank <= d < rank:
        name = getattr(func, "__name__", "func")
        raise (ValueError if what == "in_dim" else IndexError)(  # (torch.vmap's types)
            f"vmap({name}, ...): got {what}={d!r} for a body value of {rank} dimensions (its per-device "
            f"block{', with the batch dimension' if what == 'out_dim' else ''}), so expected {what} to "
            f"satisfy {-rank} <= {what} < {rank}. Fix: pass a dimension of the block, as for a plain tensor."
        )
    return d % rank


def _vmap_impl(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs):
    if not _in_body(args, kwargs):
        return _ORIG_VMAP(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs)
    body = _first_body(optree.tree_leaves((args, kwargs), none_is_leaf=True))
    # in_dims as a full pytree matching args, shifted past each value's device dims
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
    pargs, flat_dims = [], []
    arg_types = []
    for a, d in zip(args, dims):
        leaves, spec = optree.tree_flatten(a, none_is_leaf=True)
        dl = [d] * len(leaves) if not isinstance(d, (tuple, list, dict)) else optree.tree_leaves(
            d, none_is_leaf=True)
        ty = [_Type.of(x) if isinstance(x, ShTensor) else None for x in leaves]
        pd = [None if dd is None else (_in_range(func, dd, x.dim()) if isinstance(x, ShTensor) else dd) + (
            len(t.paxes) if t is not None else 0) for x, dd, t in zip(leaves, dl, ty)]
        pargs.append(optree.tree_unflatten(spec, [_phys(x) for x in leaves]))
        flat_dims.append(optree.tree_unflatten(spec, pd))
        arg_types.append(ty)
    out = _Out()

    def run(*phys_args):
        wrapped = [
            _from_phys(p, ty, body) for p, ty in zip(phys_args, arg_types)
        ]
        res = func(*wrapped, **kwargs)
        p, out.types = _to_phys(res)
        return p

    res = _ORIG_VMAP(run, tuple(flat_dims), 0, randomness, chunk_size, *pargs)
    leaves, spec = optree.tree_flatten(res, none_is_leaf=True)
    od = optree.tree_leaves(out_dims, none_is_leaf=True) if isinstance(out_dims, (tuple, list)) else None
    final = []
    for k, (x, ty) in enumerate(zip(leaves, out.types)):
        if not isinstance(x, torch.Tensor):
            final.append(x)
            continue
        d = out_dims if od is None else od[k]
        if d is None:  # an unbatched output (vmap checked it does not depend on the batch)
            x = x.select(0, 0)
            final.append(ty.wrap(x, body) if ty is not None else x)
            continue
        n = len(ty.paxes) if ty is not None else 0
        logical_rank = x.dim() - n  # includes the new batch dim (now at physical dim 0)
        x = x.movedim(0, n + _in_range(func, d, logical_rank, "out_dim"))
        final.append(ty.wrap(x, body) if ty is not None else x)
    return optree.tree_unflatten(spec, final)


_ORIG_GRAD_AND_VALUE = _ftrans.grad_and_value_impl
_ORIG_VJP = _ftrans._vjp_with_argnums
_ORIG_JVP = _ftrans._jvp_with_argnums
_ORIG_VMAP = _fapis.vmap_impl


def _install():
    _ftrans.grad_and_value_impl = _grad_and_value_impl
    _ftrans._vjp_with_argnums = _vjp_with_argnums
    _ftrans._jvp_with_argnums = _jvp_with_argnums
    _fapis.vmap_impl = _vmap_impl
    # vjp and jvp call the argnums forms through their module globals; grad_impl calls
    # grad_and_value_impl the same way, so these four names are every entry point.


_install()
