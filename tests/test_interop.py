"""Body values in PyTorch's extension points (shmap/interop.py, context re-entry).

Custom `torch.autograd.Function`s, `torch.utils.checkpoint` (reentrant and
not) and `torch.func` transforms inside bodies, and `torch.func` transforms of
shard_mapped functions from outside: values, first and second order
gradients and `comm_log`, against plain PyTorch on one device and, for
`custom_vjp` / `remat` programs, against JAX.
"""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils.checkpoint as cp
from jax.sharding import PartitionSpec as JP

import shmap
from custom_functions import Cube, MulPsumBack
from differential import assert_matches_jax
from jax_helpers import jax_mesh
from shmap import P

MESH = shmap.make_mesh((4,), ("i",))


class Foo(torch.autograd.Function):
    """The issue's example: forward 2x, backward 3g (deliberately not the derivative)."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 3 * g


class ScaleSetup(torch.autograd.Function):
    """setup_context style, a non-tensor argument and a non-differentiable output."""

    @staticmethod
    def forward(x, k):
        return x * k, (x > 0).to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g, _):
        return g * ctx.k, None


class MulNoPsum(MulPsumBack):
    @staticmethod
    def backward(ctx, g):
        w, x = ctx.saved_tensors
        c = torch.cos(w * x) * g
        return (c * x).sum(0), c * w


def sm(f, in_specs, out_specs, mesh=MESH):
    return shmap.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


# ----------------------------------------------------------------------------
# torch.autograd.Function
# ----------------------------------------------------------------------------
def test_autograd_function_gradient_is_not_dropped():
    x = torch.ones(4, requires_grad=True)
    sm(lambda v: Foo.apply(v) + v, P("i"), P("i"))(x).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 4.0))  # plain PyTorch: 3 + 1


def test_autograd_function_second_order_matches_plain_torch():
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(8, 3, dtype=torch.float64)

    def run(f):
        (g,) = torch.autograd.grad((f(x) * y).sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad((g ** 2).sum(), x)
        return f(x), g, g2

    got = run(sm(lambda v: Cube.apply(v) * torch.sin(v), P("i"), P("i")))
    want = run(lambda v: Cube.apply(v) * torch.sin(v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_autograd_function_setup_context_and_non_tensor_arguments():
    x = torch.randn(8, requires_grad=True)
    out, mask = sm(lambda v: ScaleSetup.apply(v, 3.0), P("i"), (P("i"), P("i")))(x)
    torch.testing.assert_close(mask, (x > 0).to(x.dtype))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((8,), 3.0, dtype=x.dtype))
    assert not mask.requires_grad


def test_autograd_function_backward_collective_and_types():
    """backward runs in its body (collectives work) and is typed: w's cotangent is invariant."""
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(8, 3, requires_grad=True)
    f = sm(lambda w, x: shmap.psum(MulPsumBack.apply(w, x).sum(), "i"), (P(), P("i")), P())
    with shmap.comm_log() as log:
        f(w, x).backward()
    assert log.summary() == {"psum": 2}  # the forward psum, the one in MulPsumBack.backward
    w2 = w.detach().requires_grad_()
    x2 = x.detach().requires_grad_()
    torch.sin(w2 * x2).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(x.grad, x2.grad)


def test_autograd_function_backward_with_wrongly_typed_cotangent_is_an_error():
    w = torch.randn(3, requires_grad=True)
    f = sm(lambda w, x: shmap.psum(MulNoPsum.apply(w, x).sum(), "i"), (P(), P("i")), P())
    out = f(w, torch.randn(8, 3))
    with pytest.raises(shmap.VmaError, match=r"argument 0 varies along.*psum\(grad, \('i',\)\)"):
        out.backward()


def test_custom_vjp_matches_jax():
    """The same custom-gradient program as a jax.custom_vjp: values, grads to second order,
    and the backward collectives."""
    @jax.custom_vjp
    def jf(w, x):
        return jnp.sin(w * x)

    def jf_fwd(w, x):
        return jf(w, x), (w, x)

    def jf_bwd(res, g):
        w, x = res
        c = jnp.cos(w * x) * g
        return jax.lax.psum((c * x).sum(0), "i"), c * w

    jf.defvjp(jf_fwd, jf_bwd)
    jmesh = jax_mesh((4,), ("i",))
    f_jax = jax.shard_map(lambda w, x: jax.lax.psum(jf(w, x).sum(), "i"), mesh=jmesh,
                          in_specs=(JP(), JP("i")), out_specs=JP())
    f_shmap = sm(lambda w, x: shmap.psum(MulPsumBack.apply(w, x).sum(), "i"), (P(), P("i")), P())
    rng = np.random.default_rng(0)
    got = assert_matches_jax(f_jax, f_shmap, [rng.standard_normal(3), rng.standard_normal((8, 3))],
                             context="custom_vjp", second_order=False)
    assert got == Counter({"psum": 1})


# ----------------------------------------------------------------------------
# torch.utils.checkpoint
# ----------------------------------------------------------------------------
def _remat_region(u):
    return shmap.psum(torch.sin(u), "i") * u


def _jax_remat():
    return jax.shard_map(
        lambda x: jax.checkpoint(lambda u: jax.lax.psum(jnp.sin(u), "i") * u)(x),
        mesh=jax_mesh((4,), ("i",)), in_specs=JP("i"), out_specs=JP("i"))


def test_checkpoint_recomputes_collectives_and_matches_jax_remat():
    f_shmap = sm(lambda x: cp.checkpoint(_remat_region, x, use_reentrant=False), P("i"), P("i"))
    x = np.random.default_rng(1).standard_normal((8, 3))
    # backward: the recomputed psum and the psum transposing the lift of its result
    got = assert_matches_jax(_jax_remat(), f_shmap, [x], context="remat")
    assert got == Counter({"psum": 2})


def test_reentrant_checkpoint_matches_jax_remat():
    """use_reentrant=True is an autograd.Function (torch allows only .backward() through it)."""
    x = np.random.default_rng(1).standard_normal((8, 3))
    cot = np.random.default_rng(2).standard_normal((8, 3))
    want_y, vjp = jax.vjp(_jax_remat(), x)
    (want_g,) = vjp(cot)
    xt = torch.tensor(x, requires_grad=True)
    f = sm(lambda x: cp.checkpoint(_remat_region, x, use_reentrant=True), P("i"), P("i"))
    y = f(xt)
    with shmap.comm_log() as log:
        y.backward(torch.tensor(cot))
    np.testing.assert_allclose(y.detach().numpy(), np.asarray(want_y), rtol=1e-10)
    np.testing.assert_allclose(xt.grad.numpy(), np.asarray(want_g), rtol=1e-10)
    assert log.summary() == {"psum": 2}


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_matches_plain_torch_with_invariant_parameter(reentrant):
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)

    def block(w, x):
        return torch.tanh(x @ w) @ w

    f = sm(lambda w, x: shmap.psum(cp.checkpoint(block, w, x, use_reentrant=reentrant).sum(), "i"),
           (P(), P("i")), P())
    with shmap.comm_log() as log:
        f(w, x).backward()
    gw, gx = w.grad, x.grad
    w.grad = x.grad = None
    block(w, x).sum().backward()
    torch.testing.assert_close(gw, w.grad)
    torch.testing.assert_close(gx, x.grad)
    assert log.summary() == {"psum": 2}  # the forward psum, then w's gradient once


def test_a_checkpointed_backward_leaves_no_body_behind():
    """The body a checkpoint recomputes was remembered past its backward pass: it kept what it closed
    over alive, and a collective in a later pass's plain hook (outside any body) ran on it and failed
    with "shmap internal error" instead of UnboundAxisError."""
    import gc
    import weakref

    w = torch.randn(4, 4, requires_grad=True)
    big = torch.randn(8, 4) @ torch.randn(4, 4, requires_grad=True)  # closed over, with a graph
    f = sm(lambda w, x: shmap.psum(cp.checkpoint(lambda x: torch.tanh(x @ w + big[:x.shape[0]]), x,
                                                 use_reentrant=False).sum(), "i"), (P(), P("i")), P())
    f(w, torch.randn(8, 4)).backward()
    ref, f = weakref.ref(big), None
    del big
    gc.collect()
    assert ref() is None
    t = torch.ones(3, requires_grad=True)
    y = t * 1.0
    y.register_hook(lambda g: shmap.psum(g, "i"))
    with pytest.raises(shmap.UnboundAxisError, match="no shard_map or pmap body is running"):
        y.sum().backward()


def _through(kind, v, x):
    """tanh(x @ v) summed, through a hook, an autograd.Function or a non-reentrant checkpoint."""
    if kind == "hook":
        v.register_hook(lambda g: g * 3)
        return torch.tanh(x @ v).sum()
    if kind == "function":
        return Foo.apply(torch.tanh(x @ v)).sum()  # (its backward computes on the cotangent)
    return cp.checkpoint(lambda a, b: torch.tanh(a @ b).sum(), x, v, use_reentrant=False)


@pytest.mark.parametrize("kind", ["hook", "function", "checkpoint"])
def test_autograd_grad_in_a_body_runs_python_in_the_backward_on_body_values(kind):
    """`torch.autograd.grad` called in a body: the pass runs a hook, a Function's backward or a
    checkpoint's recomputation on body values (they once met torch-function dispatch switched off)."""
    w = torch.randn(3, 2, dtype=torch.float64)
    x = torch.randn(8, 3, dtype=torch.float64)

    def body(w, x):
        with torch.enable_grad():
            v = w.detach().requires_grad_()
            (g,) = torch.autograd.grad(shmap.psum(_through(kind, v, x), "i"), v)
        return g

    v = w.clone().requires_grad_()
    (want,) = torch.autograd.grad(_through(kind, v, x), v)  # one device: the whole batch
    torch.testing.assert_close(sm(body, (P(), P("i")), P())(w, x), want)


# ----------------------------------------------------------------------------
# torch.func inside a body
# ----------------------------------------------------------------------------
def _per_device(f, *blocks):
    return torch.cat([f(*b) for b in zip(*[x.chunk(4) for x in blocks])])


@pytest.mark.parametrize("name", ["grad", "vjp", "vmap", "jacrev", "jacfwd", "jvp", "hessian"])
def test_torch_func_inside_a_body_is_per_device(name):
    transforms = {
        "grad": lambda v: torch.func.grad(lambda y: (torch.sin(y) * y).sum())(v),
        "vjp": lambda v: torch.func.vjp(torch.sin, v)[1](torch.cos(v))[0],
        "vmap": lambda v: torch.vmap(lambda r: r * r.sum())(v),
        "jacrev": lambda v: torch.func.jacrev(lambda r: torch.sin(r) * r.sum())(v[0]).unsqueeze(0),
        "jacfwd": lambda v: torch.func.jacfwd(lambda r: torch.sin(r) * r.sum())(v[0]).unsqueeze(0),
        "jvp": lambda v: torch.func.jvp(torch.sin, (v,), (v * 2,))[1],
        "hessian": lambda v: torch.func.hessian(lambda r: (r ** 3).sum())(v[0]).unsqueeze(0),
    }
    fn = transforms[name]
    x = torch.randn(8, 3, dtype=torch.float64)
    got = sm(fn, P("i"), P("i"))(x)
    torch.testing.assert_close(got, _per_device(fn, x))


def test_torch_func_grad_of_invariant_input_is_psummed_as_in_jax():
    w = torch.randn(3, dtype=torch.float64)
    x = torch.randn(8, 3, dtype=torch.float64)
    f = sm(lambda w, x: torch.func.grad(lambda w: (x @ w).sum())(w), (P(), P("i")), P())
    with shmap.comm_log() as log:
        g = f(w, x)
    torch.testing.assert_close(g, x.sum(0))  # JAX: the transpose of the implicit pvary is a psum
    assert log.summary() == {"psum": 1}


def test_torch_func_vmap_with_collective_inside_body():
    x = torch.randn(8, 5, dtype=torch.float64)
    got = sm(lambda v: torch.vmap(lambda c: shmap.psum(c, "i"), in_dims=1, out_dims=1)(v),
             P("i"), P())(x)
    torch.testing.assert_close(got, sum(x.chunk(4)))


# ----------------------------------------------------------------------------
# torch.func of a shard_mapped function, from outside
# ----------------------------------------------------------------------------
@shmap.shard_map(mesh=MESH, in_specs=(P(), P("i")), out_specs=P())
def _dp_loss(w, x):
    return shmap.pmean((torch.tanh(x @ w) ** 2).sum(), "i")


def _dp_ref(w, x):
    return sum((torch.tanh(b @ w) ** 2).sum() for b in x.chunk(4)) / 4


@pytest.mark.parametrize("name", ["grad", "jacrev", "jacfwd", "hessian", "vmap"])
def test_torch_func_of_a_shard_mapped_function(name):
    w = torch.randn(3, 2, dtype=torch.float64)
    x = torch.randn(8, 3, dtype=torch.float64)
    if name == "vmap":
        ws = torch.randn(5, 3, 2, dtype=torch.float64)
        got = torch.vmap(_dp_loss, in_dims=(0, None))(ws, x)
        want = torch.vmap(_dp_ref, in_dims=(0, None))(ws, x)
    else:
        t = getattr(torch.func, name)
        got, want = t(_dp_loss)(w, x), t(_dp_ref)(w, x)
    torch.testing.assert_close(got, want)


def test_torch_func_grad_of_a_shard_mapped_function_communicates_like_backward():
    w = torch.randn(3, 2)
    with shmap.comm_log() as log:
        torch.func.grad(_dp_loss)(w, torch.randn(8, 3))
    assert log.summary() == {"psum": 2}  # pmean's psum; w's gradient (transpose of its pvary)


def test_autograd_function_under_torch_func_inside_and_outside_a_body():
    x = torch.randn(8, dtype=torch.float64)
    inside = sm(lambda v: torch.func.grad(lambda y: Cube.apply(y).sum())(v), P("i"), P("i"))
    torch.testing.assert_close(inside(x), 3 * x ** 2)
    f = sm(lambda v: shmap.psum(Cube.apply(v).sum(), "i"), P("i"), P())
    torch.testing.assert_close(torch.func.grad(f)(x), 3 * x ** 2)
    xs = torch.stack([x, 2 * x])
    torch.testing.assert_close(torch.vmap(f)(xs), (xs ** 3).sum(1))


class ExpJvp(torch.autograd.Function):
    """A Function with a forward-mode rule that saves for it (save_for_forward)."""

    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]

    @staticmethod
    def jvp(ctx, t):
        return t * ctx.saved_tensors[0]


def test_autograd_function_jvp_rule_in_and_around_a_body():
    """Forward mode raised 'You must implement the jvp function' (and save_for_forward an AttributeError)."""
    x = torch.randn(8, 3, dtype=torch.float64)
    ones = torch.ones_like(x)
    inside = sm(lambda v: torch.func.jvp(ExpJvp.apply, (v,), (torch.ones_like(v),))[1], P("i"), P("i"))
    torch.testing.assert_close(inside(x), x.exp())
    outside = torch.func.jvp(sm(ExpJvp.apply, P("i"), P("i")), (x,), (ones,))[1]
    torch.testing.assert_close(outside, x.exp())
    jac = sm(lambda v: torch.func.jacfwd(lambda y: ExpJvp.apply(y).sum())(v), P("i"), P("i"))
    torch.testing.assert_close(jac(x), x.exp())


def test_torch_func_of_a_check_vma_false_shard_map_from_outside():
    """An unmapped output with check_vma=False keeps device 0's copy (`TakeFirst`, cotangent / size):
    grad, jvp and vmap of it from outside equal plain PyTorch's of the same math."""
    w, x = torch.randn(3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    f = shmap.shard_map(lambda w, x: shmap.psum((torch.cos(x) * w).sum(), "i"), mesh=MESH,
                        in_specs=(P(), P("i")), out_specs=P(), check_vma=False)

    def ref(w):
        return (torch.cos(x) * w).sum()

    torch.testing.assert_close(torch.func.grad(lambda w: f(w, x))(w), torch.func.grad(ref)(w))
    torch.testing.assert_close(torch.func.jvp(lambda w: f(w, x), (w,), (x[0],)), torch.func.jvp(ref, (w,), (x[0],)))
    ws = torch.stack([w, 2 * w])
    torch.testing.assert_close(torch.vmap(lambda w: f(w, x))(ws), torch.vmap(ref)(ws))
    torch.testing.assert_close(torch.func.hessian(lambda w: f(w, x) ** 2)(w), torch.func.hessian(lambda w: ref(w) ** 2)(w))


# ----------------------------------------------------------------------------
# The distributed collectives as torch.library ops (shmap/backends/library.py)
# ----------------------------------------------------------------------------
class _FourDevices:
    """A stand-in for a distributed `Group` of 4 (the fake implementations read only its size)."""

    n = 4
    axes = ("i",)


@pytest.mark.parametrize("device", ["fake", "meta"])
def test_collective_ops_exist_and_their_fake_implementations_give_the_shapes(device):
    from torch._subclasses import FakeTensorMode

    from shmap.backends import library

    g = library.group_id(_FourDevices)
    ops = torch.ops.shmap
    calls = [  # (op, arguments after the tensor, input shape, output shape)
        (ops.psum, (g, "psum"), (8, 6), (8, 6)),
        (ops.psum, (g, "pmax"), (3,), (3,)),
        (ops.all_gather, (g, 1, True, "all_gather"), (8, 6), (8, 24)),
        (ops.all_gather, (g, 0, False, "all_gather_invariant"), (8, 6), (4, 8, 6)),
        (ops.psum_scatter, (g, 0, True), (8, 6), (2, 6)),
        (ops.psum_scatter, (g, 1, False), (3, 4), (3,)),
        (ops.ppermute, (g, [0, 1, 1, 0]), (8, 6), (8, 6)),
        (ops.all_to_all, (g, 0, 1, True), (8, 6), (2, 24)),
        (ops.all_to_all, (g, 1, 0, False), (3, 4, 5), (4, 3, 5)),
    ]
    with FakeTensorMode() if device == "fake" else torch.device("meta"):
        for op, args, shape, want in calls:
            out = op(torch.empty(shape, dtype=torch.float16), *args)
            assert tuple(out.shape) == want, (op, args)
            assert out.dtype == torch.float16


def test_vmap_in_a_body_reports_its_transposes_and_forward_mode_reports_a_collective_once():
    """A vmap's batched values do not show requires_grad, yet their backward transposes (and reports)
    each collective; a tangent moves in its primal's collective (one psum, as JAX's takes both)."""
    mesh = shmap.make_mesh((4,), ("i",))
    f = shmap.shard_map(lambda x: torch.vmap(lambda c: shmap.all_gather(c, "i", tiled=True), in_dims=1,
                                             out_dims=1)(x), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    x = torch.randn(8, 3, requires_grad=True)
    with shmap.comm_log() as log:
        f(x).sum().backward()
    assert [(e.kind, e.shape) for e in log.events] == [("all_gather", (2,)), ("psum_scatter", (8,))]
    torch.testing.assert_close(x.grad, torch.full((8, 3), 4.0))
    g = shmap.shard_map(lambda x: torch.func.jvp(lambda r: shmap.psum(r, "i"), (x,), (x,))[1], mesh=mesh,
                        in_specs=P("i"), out_specs=P())
    with shmap.comm_log() as log:
        g(torch.randn(8, 3))
    assert log.count("psum") == 1


def test_forward_mode_inside_an_unchecked_body_on_an_unmapped_input():
    """check_vma=False expands an unmapped (P()) input over the devices with stride 0, which torch cannot
    make a dual tensor of: jvp, jacfwd and hessian in the body raised "more than one element of the
    written-to tensor refers to a single memory location"."""
    mesh = shmap.make_mesh((4,), ("i",))
    w = torch.randn(3, dtype=torch.float64)
    bodies = {
        "jvp": (lambda u: torch.func.jvp(torch.sin, (u,), (torch.ones_like(u),))[1], torch.cos(w)),
        "jacfwd": (lambda u: torch.func.jacfwd(torch.sin)(u).sum(0), torch.cos(w)),
        "hessian": (lambda u: torch.func.hessian(lambda v: torch.sin(v).sum())(u).sum(0), -torch.sin(w)),
    }
    for name, (body, want) in bodies.items():
        got = shmap.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(w)
        torch.testing.assert_close(got, want, msg=name)


# --- torch.func through custom Functions: the transform's own tensors are saved --------------------
class _CubeSC(torch.autograd.Function):
    """x**3 in setup_context form, saving its input (torch.func's form)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class _Triple(torch.autograd.Function):
    """An in-place forward (`mark_dirty`)."""

    @staticmethod
    def forward(x):
        return x.mul_(3)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return 3 * g


@pytest.mark.parametrize("fn, ref", [(_CubeSC, lambda x: x ** 3), (ExpJvp, torch.exp)], ids=["input", "output"])
def test_second_order_torch_func_through_a_custom_function_saves_the_transforms_tensors(fn, ref):
    """grad(grad(.)) and jacrev(jacrev(.)) through a Function that saves its input or output: the saved
    tensor must be the transform's own (setup_context's), or its dependence on x is lost (the second
    derivative silently missed the term through it). Against the same math without the Function."""
    x = torch.randn(8, dtype=torch.float64) / 2

    def plain(f):
        return lambda x: torch.sin(f(x)).sum()

    def sharded(f):
        return shmap.shard_map(lambda x: shmap.psum(plain(f)(x), "i"), mesh=MESH, in_specs=P("i"), out_specs=P())

    def inner(f):  # the transforms inside the body, on the block
        return shmap.shard_map(lambda x: torch.func.grad(lambda y: torch.func.grad(plain(f))(y).sum())(x),
                               mesh=MESH, in_specs=P("i"), out_specs=P("i"))

    gg = lambda F: torch.func.grad(lambda y: torch.func.grad(F)(y).sum())(x)  # noqa: E731
    want = gg(plain(ref))
    torch.testing.assert_close(gg(plain(fn.apply)), want)  # (torch itself, as the reference's check)
    torch.testing.assert_close(gg(sharded(fn.apply)), want)
    torch.testing.assert_close(inner(fn.apply)(x), want)
    hess = torch.func.jacrev(torch.func.jacrev(sharded(fn.apply)))(x)
    torch.testing.assert_close(hess, torch.func.jacrev(torch.func.jacrev(plain(ref)))(x))


def test_a_mark_dirty_function_under_torch_func():
    """An in-place Function under grad, around the call and in the body: torch.func requires mark_dirty of
    setup_context's (wrapped) input, which shmap's replay passed unwrapped ("marked as dirty ... not
    returned as output")."""
    x = torch.randn(8, dtype=torch.float64)
    f = shmap.shard_map(lambda x: shmap.psum(_Triple.apply(x * 1).sum(), "i"), mesh=MESH, in_specs=P("i"),
                        out_specs=P())
    torch.testing.assert_close(torch.func.grad(f)(x), torch.full((8,), 3.0, dtype=torch.float64))
    g = shmap.shard_map(lambda x: torch.func.grad(lambda r: _Triple.apply(r * 1).sum())(x), mesh=MESH,
                        in_specs=P("i"), out_specs=P("i"))
    torch.testing.assert_close(g(x), torch.full((8,), 3.0, dtype=torch.float64))


class _OnceExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]


def test_once_differentiable_backward_under_create_graph_is_torchs():
    """create_graph=True through an `@once_differentiable` backward: the first-order gradient, and a
    second backward raises torch's own error (its wrapper aliased body values below autograd: an
    internal error)."""
    x = torch.randn(8, dtype=torch.float64)
    f = shmap.shard_map(lambda x: shmap.psum((_OnceExp.apply(x) ** 2).sum(), "i"), mesh=MESH, in_specs=P("i"),
                        out_specs=P())
    for fn in ((lambda x: (_OnceExp.apply(x) ** 2).sum()), f):
        xr = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(xr), xr, create_graph=True)
        torch.testing.assert_close(g, 2 * (2 * x).exp())
        with pytest.raises(RuntimeError, match="differentiate twice a function that was marked"):
            g.sum().backward()


class _TooMany(Foo):
    @staticmethod
    def backward(ctx, g):
        return g, g


class _WrongShape(Foo):
    @staticmethod
    def backward(ctx, g):
        return g.sum(0)


def test_a_custom_backward_with_extra_or_misshapen_gradients_is_refused_in_the_bodys_terms():
    x = torch.randn(8, 4, requires_grad=True)
    for cls, match in [(_TooMany, r"_TooMany.backward returned 2 gradients but forward took 1 arguments"),
                       (_WrongShape, (r"_WrongShape.backward: the gradient of argument 0 has per-device shape "
                                      r"\(4,\), but the argument has \(2, 4\)"))]:
        with pytest.raises(RuntimeError, match=match):
            shmap.shard_map(cls.apply, mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x).sum().backward()
        with pytest.raises(RuntimeError):  # torch refuses both too
            cls.apply(x).sum().backward()


def test_vmap_in_a_body_refuses_out_of_range_dims():
    """in_dims / out_dims are dims of the block: out of range is torch's error, not a dim modulo the rank
    (in_dims=5 on a 2-d block mapped over dim 1)."""
    x = torch.arange(16.0).reshape(8, 2)
    for kw, exc, match in [({"in_dims": 5}, ValueError, r"in_dim=5 .* -2 <= in_dim < 2"),
                           ({"in_dims": -3}, ValueError, r"in_dim=-3"),
                           ({"out_dims": 2}, IndexError, r"out_dim=2 .* -2 <= out_dim < 2")]:
        g = shmap.shard_map(lambda x, kw=kw: torch.func.vmap(lambda r: r * 1, **kw)(x), mesh=MESH,
                            in_specs=P("i"), out_specs=P("i"))
        with pytest.raises(exc, match=match):
            g(x)
    g = shmap.shard_map(lambda x: torch.func.vmap(lambda r: r.sum(), in_dims=-1)(x), mesh=MESH, in_specs=P("i"),
                        out_specs=P("i"))
    torch.testing.assert_close(g(x), x.reshape(4, 2, 2).sum(1).reshape(8))  # (each block's columns summed)


def test_vjp_and_jvp_in_a_body_name_per_device_shapes_and_their_own_terms():
    with pytest.raises(RuntimeError, match=r"vjp: a cotangent has per-device shape \(3,\) but its output has \(2,\)"):
        shmap.shard_map(lambda x: torch.func.vjp(lambda v: v * 2, x)[1](torch.ones(3))[0], mesh=MESH,
                        in_specs=P("i"), out_specs=P("i"))(torch.randn(8))
    with pytest.raises(RuntimeError, match=r"jvp: a tangent has per-device shape \(3,\) but its primal has \(2,\)"):
        shmap.shard_map(lambda x: torch.func.jvp(torch.sin, (x,), (torch.ones(3),))[1], mesh=MESH,
                        in_specs=P("i"), out_specs=P("i"))(torch.randn(8))
    with pytest.raises(shmap.VmaError, match=r"jvp: a tangent varies along \{'i'\} but its primal is invariant"):
        shmap.shard_map(lambda w, x: torch.func.jvp(torch.sin, (w,), (x,))[1], mesh=MESH, in_specs=(P(), P("i")),
                        out_specs=P("i"))(torch.randn(2), torch.randn(8))
