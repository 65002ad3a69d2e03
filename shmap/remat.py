"""`torch.utils.checkpoint` in a body that is being compiled: the compiler recomputes, as eager does.

Eagerly, non-reentrant checkpointing keeps a region's inputs and reruns the
region in the backward pass.  A compiled shard_map (`torch.compile`, and
`shmap.jit`) is traced by AOT autograd, which runs that backward once, on
fake tensors, into one joint graph, and then decides by itself what the
compiled forward keeps for the backward.  Told nothing, it merged the
recomputation with the forward and kept every activation: `--remat
--compile` held what `--compile` alone holds (4.1 MB of saved tensors for
the tiny recipe against 0.8 MB eagerly), silently.

torch's way of telling it is selective checkpointing: a `context_fn` whose
dispatch mode tags each traced node of the region with a policy, which AOT
autograd's partitioner obeys (the tags `torch.compile` itself puts on a
checkpointed region).  So while a shard_map body is traced, a
non-reentrant checkpoint called with torch's default `context_fn` gets this
one: recompute every op (as eagerly), except what must run exactly once or
keep its value: collectives and shmap's effectful ops (the guard's
signatures, `comm_log` reports), whose results are kept, and random ops,
whose draws are kept (eager replays the RNG state to the same effect).
On the simulated mesh a collective is tensor ops (recomputed with the rest)
plus its `comm_log` report, an effectful op that is not repeated: the
compiled backward recomputes a region's data movement too (an FSDP weight is
gathered again), but `comm_log` shows no recomputed collective where eager
shows them.  A distributed mesh's body is left as it was (see
`_tracing_a_body`).

A caller's own `context_fn` (its own selective policy) is kept; its region is
only numbered, as Dynamo numbers the regions it traces (without a number
torch's partitioner fails).  Everything outside a traced body is left alone
(eager, and Dynamo, which tags checkpointed regions itself).
"""
from __future__ import annotations

import functools
import itertools

import torch
import torch.utils.checkpoint as _checkpoint

from . import context

#: op namespaces whose calls a recomputation must not repeat (collectives, shmap's effectful ops)
_ONCE = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "shmap"})


def _policy(ctx, op, *args, **kwargs):
    policy = _checkpoint.CheckpointPolicy
    namespace = getattr(op, "namespace", None)
    if namespace in _ONCE or torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return policy.MUST_SAVE
    return policy.MUST_RECOMPUTE


def _recompute_context():
    return _numbered(_checkpoint.create_selective_checkpoint_contexts(_policy))


def _numbered(contexts):
    """Each region's nodes carry their own id, as Dynamo numbers the regions it traces: where two regions
    meet, the partitioner keeps the boundary rather than recomputing one from the other (and with no id
    at all it fails comparing None with None)."""
    forward = contexts[0]
    if getattr(forward, "ac_graph_id", 0) is None:
        forward.ac_graph_id = next(_REGIONS)
    return contexts


_REGIONS = itertools.count(1)


def _tracing_a_body() -> bool:
    """Whether a simulated mesh's shard_map body is running under AOT autograd's (or make_fx's) trace.

    (Not a distributed one: there every collective is an ordered effectful op, and torch 2.13's
    partitioner keeps the effect tokens of such ops inside a tagged region as saved values, which it
    then refuses ("forward num_erased_outs ... != expected 1"); that body's compiled backward keeps
    the region's activations, as before.)"""
    body = context.current()
    return (body is not None and body.active and not body.mesh.is_distributed
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None)


_ORIG_GENERATOR = getattr(_checkpoint, "_checkpoint_without_reentrant_generator", None)  # (torch's, private)


def _checkpoint_without_reentrant_generator(fn, preserve_rng_state=True, context_fn=_checkpoint.noop_context_fn,
                                            *args, **kwargs):
    if _tracing_a_body():
        if context_fn is _checkpoint.noop_context_fn:
            context_fn = _recompute_context
        else:  # the caller's own selective policy
            context_fn = functools.partial(_numbered_call, context_fn)
    return _ORIG_GENERATOR(fn, preserve_rng_state, context_fn, *args, **kwargs)


def _numbered_call(context_fn):
    return _numbered(context_fn())


if _ORIG_GENERATOR is not None:  # (a torch without it: compiled checkpoints keep their activations, as before)
    _checkpoint._checkpoint_without_reentrant_generator = _checkpoint_without_reentrant_generator
