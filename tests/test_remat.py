"""torch.utils.checkpoint in a compiled body (shmap/remat.py): the compiled backward recomputes.

AOT autograd traces a shard_map body's forward and backward into one graph and
then chooses what the forward keeps; told nothing, it merged a checkpointed
region's recomputation with the forward and kept every activation, so a
compiled `checkpoint` saved no memory at all.  Measured here as what the call
saves for its backward (`saved_tensors_hooks` sees the compiled function's
saved tensors too), with values and gradients equal to eager's.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp

import shmap
from shmap import P

MESH = shmap.make_mesh((4, 2), ("i", "j"))


def _region(w, x):
    h = x @ shmap.all_gather(w, "j", tiled=True)
    for _ in range(4):
        h = torch.tanh(h) * 1.5
    return h


def _f(remat):
    def body(w, x):
        h = cp.checkpoint(_region, w, x, use_reentrant=False) if remat else _region(w, x)
        return shmap.pmean((h ** 2).sum(), ("i", "j"))
    return shmap.shard_map(body, mesh=MESH, in_specs=(P("j"), P("i")), out_specs=P())


def _saved_bytes(fn, w, x):
    """Bytes of the distinct storages the call saves for its backward; (value, w's gradient)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        v = fn(w, x)
    (g,) = torch.autograd.grad(v, w)
    return sum(storages.values()), v.detach(), g


@pytest.mark.parametrize("compiled", ["torch.compile", "shmap.jit"])
def test_a_compiled_checkpoint_recomputes_instead_of_saving(compiled):
    torch.manual_seed(0)
    w, x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True), torch.randn(256, 64, dtype=torch.float64)

    def compile_(f):
        return torch.compile(f, backend="aot_eager") if compiled == "torch.compile" else shmap.jit(f, backend="eager")

    plain, remat = compile_(_f(False)), compile_(_f(True))
    for fn in (plain, remat):  # (the first calls trace)
        _saved_bytes(fn, w, x)
    kept, v, g = _saved_bytes(plain, w, x)
    kept_remat, v_remat, g_remat = _saved_bytes(remat, w, x)
    eager_remat, v_eager, g_eager = _saved_bytes(_f(True), w, x)
    # Without remat the region's five activations (and the gathered weight) are kept; with it, the region's
    # inputs. (Before shmap/remat.py the two compiled calls kept the same bytes.)
    assert kept_remat * 3 < kept, (kept_remat, kept)
    assert kept_remat <= eager_remat, (kept_remat, eager_remat)
    torch.testing.assert_close(v_remat, v_eager, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_remat, g_eager, rtol=1e-12, atol=0)
    torch.testing.assert_close(v, v_eager, rtol=1e-12, atol=0)


def test_a_callers_own_selective_policy_is_kept_and_compiles():
    """A `context_fn` of the caller's is used, not shmap's recompute-all; its region gets a number (torch's
    partitioner failed on a region without one: "'>' not supported between ... 'NoneType'")."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return (torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.bmm.default
                else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)

    def body(w, x):
        h = cp.checkpoint(_region, w, x, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))
        return shmap.pmean((h ** 2).sum(), ("i", "j"))

    f = torch.compile(shmap.shard_map(body, mesh=MESH, in_specs=(P("j"), P("i")), out_specs=P()),
                      backend="aot_eager")
    w, x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True), torch.randn(256, 64, dtype=torch.float64)
    (g,) = torch.autograd.grad(f(w, x), w)
    assert torch.ops.aten.bmm.default in calls
    torch.testing.assert_close(g, torch.autograd.grad(_f(True)(w, x), w)[0], rtol=1e-12, atol=0)


def test_eager_checkpoint_is_untouched():
    """Outside a trace the region is checkpointed as torch does it: recomputed, collectives and all."""
    w = torch.randn(64, 64, requires_grad=True)
    v = _f(True)(w, torch.randn(256, 64))
    with shmap.comm_log() as log:
        v.backward()
    assert log.count("all_gather") == 1  # (the recomputation's)
