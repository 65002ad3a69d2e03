"""JAX-vs-shmap differential check shared by the generated and hand-written tests.

Given the same per-device program written twice (a ``jax.shard_map``-ed
function and a ``shmap.shard_map``-ed one), :func:`assert_matches_jax` checks

* the outputs,
* first-order gradients of ``sum(out * cotangent)`` w.r.t. every input,
* optionally second-order gradients (gradient of the squared gradient norm),
* the collectives of the first-order backward pass, by kind: JAX's are read
  from the jaxpr of ``vjp_fn``, shmap's from ``comm_log`` around
  ``torch.autograd.grad``.  Equal numbers with different communication would
  still be a bug (it is the whole point of vma typing), so counts must match.

It returns the backward counts so callers can also assert absolute counts.
"""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_helpers import backward_collectives

RTOL, ATOL = 1e-10, 1e-10


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def tensors(arrays, requires_grad=False):
    return [torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=requires_grad)
            for a in arrays]


def assert_close(got, want, what):
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=what)


def jax_gradients(f, args, cots, second_order):
    """First-order grads of sum(out*cot) and, optionally, grads of ||grads||^2."""
    argnums = tuple(range(len(args)))

    def loss(*xs):
        return sum(jnp.sum(o * c) for o, c in zip(as_tuple(f(*xs)), cots))

    grad = jax.grad(loss, argnums=argnums)
    g1 = jax.jit(grad)(*args)
    if not second_order:
        return g1, None

    def grad_norm(*xs):
        return sum(jnp.sum(g ** 2) for g in grad(*xs))

    return g1, jax.jit(jax.grad(grad_norm, argnums=argnums))(*args)


def shmap_gradients(f, args, cots, second_order):
    """Same as jax_gradients through torch.autograd, plus the comm_log summary
    (a Counter by kind) of the first-order backward pass."""
    import shmap
    xs = tensors(args, requires_grad=True)
    outs = as_tuple(f(*xs))
    with shmap.comm_log() as log:
        g1 = torch.autograd.grad(outs, xs, tensors(cots), create_graph=second_order,
                                 allow_unused=True)
    backward = Counter(log.summary())
    g1 = [torch.zeros_like(x) if g is None else g for g, x in zip(g1, xs)]
    if not second_order:
        return g1, None, backward
    norm = sum((g ** 2).sum() for g in g1)
    if not norm.requires_grad:  # gradients do not depend on the inputs: all zero
        return g1, [torch.zeros_like(x) for x in xs], backward
    g2 = torch.autograd.grad(norm, xs, allow_unused=True)
    return g1, [torch.zeros_like(x) if g is None else g for g, x in zip(g2, xs)], backward


def assert_matches_jax(f_jax, f_shmap, args, *, seed=0, second_order=True, context=""):
    """Outputs, gradients (1st, optionally 2nd order) and backward collectives
    of ``f_shmap`` equal those of ``f_jax``; returns the backward Counter."""
    names = [f"input {k}" for k in range(len(args))]
    want = [np.asarray(o) for o in as_tuple(jax.jit(f_jax)(*args))]
    got = as_tuple(f_shmap(*tensors(args)))
    assert len(got) == len(want), f"{len(got)} outputs vs jax {len(want)}\n{context}"
    for k, (g, w) in enumerate(zip(got, want)):
        assert type(g) is torch.Tensor, f"output {k} is a {type(g).__name__}, not a plain tensor"
        assert_close(g, w, f"output {k} vs jax\n{context}")
    if not args:
        return Counter()

    rng = np.random.default_rng(seed + 7)
    cots = [rng.standard_normal(w.shape) for w in want]
    jg1, jg2 = jax_gradients(f_jax, args, cots, second_order)
    sg1, sg2, shmap_backward = shmap_gradients(f_shmap, args, cots, second_order)
    for name, g, w in zip(names, sg1, jg1):
        assert_close(g, w, f"d loss / d {name} vs jax\n{context}")
    if second_order:
        for name, g, w in zip(names, sg2, jg2):
            assert_close(g, w, f"d |grad|^2 / d {name} vs jax\n{context}")

    # vjp_fn takes cotangents structured like f's output (a tuple or one array).
    tupled = isinstance(jax.eval_shape(f_jax, *args), (tuple, list))
    jax_backward = backward_collectives(f_jax, args, tuple(cots) if tupled else cots[0])
    assert shmap_backward == jax_backward, (
        f"backward collectives: shmap {dict(shmap_backward)} vs jax {dict(jax_backward)}"
        f"\n{context}")
    return jax_backward
