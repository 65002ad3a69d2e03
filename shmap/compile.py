"""`torch.compile` of shard_mapped functions.

Dynamo does not trace a shard_map call op by op: body values are a tensor
subclass whose `__torch_function__` runs the simulated devices through
functorch's batching, which Dynamo would have to inline for every op.
Instead every shard_mapped function is `allow_in_graph`: Dynamo puts the
call in its graph as one node, and AOT autograd traces *through* it (the body
runs once, on fake tensors, producing the physical ops: batched matmuls,
sums over device dims), so Inductor compiles the per-device program together
with the code around it, forward and backward (`graph_call`; `pmap` is one
node the same way).  The node returns the output's leaves (a graph node may
return tensors and tuples or lists of them, not dicts); the containers the
body returned (dicts, namedtuples, ...) are rebuilt around it by Python that
Dynamo traces, from a skeleton of constants read once the node has run on
fake tensors (`spec_tree.skeleton`).  Dict arguments reach the node as
torch.fx's immutable dicts; the body gets plain ones.  Each collective's
`comm_log` report is the ordered effectful op `shmap::record` (see `ops.py`),
so a compiled call reports the same events as an eager one.

Consequences:

- `fullgraph=True` works for programs whose shard_mapped functions take
  their tensors as arguments.  A tensor the body *closes over* is invisible to
  Dynamo (it does not look inside the call); it is rejected with an error
  naming the fix: pass it as an argument with `P()`.
- The body is Python run at trace time: Python control flow on values is
  already an error in bodies (`VaryingControlFlowError`), and prints run once
  per compilation, not per call.  Python values the body reads are frozen in
  the graph, and Dynamo, which does not look inside the node, guards none of
  them; so the call hands the node the ones a body most often reads
  (`python_state`: numbers, strings and flags it closes over or reads as
  globals, or in dicts, lists and tuples it closes over (nested up to three
  deep, at most 1024 values), directly or through a function it calls, and
  the `training` flag of modules it uses), which Dynamo guards: a change
  recompiles.  Each new value is a graph of its own (plain code's floats
  turn dynamic after a recompile; these are constants of the node), so a
  value that changes every call (a learning rate) recompiles until
  Dynamo's recompile limit and then runs eagerly: pass it as an argument.
  Other state (an attribute of a closed-over object, a NumPy scalar, which
  Dynamo makes a tensor it does not guard) stays frozen until a recompile
  (`torch._dynamo.reset()`): pass such values as arguments.
- Sizes may be symbolic (Dynamo's automatic dynamic shapes after a
  recompile); a collective's `comm_log` event needs concrete bytes, so the
  sizes it reports are specialised (guarded) in the graph.

**The distributed mesh** (one process per device) compiles too.  While a
graph is captured, each raw collective of `backends/transports.py` hands over
to its twin in `backends/traced.py`, which emits torch's functional
collectives (`_c10d_functional.all_reduce`, `all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_to_all_single` (ppermute too: its splits are
the permutation), then `wait_tensor`): they have fake kernels and Inductor
lowerings, so the compiled forward and backward graphs contain the
communication.  Results equal eager bit for bit (same wire dtypes, buffers and
rank-order permutations); values computed around them are Inductor's.
Arguments may be plain tensors (global values every rank holds) or DTensors
laid out as the in_specs; outputs are DTensors, as eagerly.  Take gradients
with `torch.autograd.grad` or `.backward()` (`torch.func` transforms do not
run the distributed backend's autograd Functions); `fullgraph=True` with
`torch.autograd.grad` inside needs `torch._dynamo.config.trace_autograd_ops`.
What a compiled call checks, at run time, on every call:

- *Signatures*: each collective is counted by the process's guard (the same
  counter eager collectives use, so compiled and eager calls interleave), and
  carries the same signature as eagerly: folded into its payload in the
  default mode (the trailer of `signatures.Seal`, written by the effectful op
  `shmap::coll_begin` and checked by `shmap::coll_wait`), or exchanged over
  the guard's own group before the data moves (strict mode, NCCL, large moved
  payloads).  A mismatch raises `CollectiveMismatchError` on every rank, as
  eagerly; the end of each body is counted (strict: exchanged) by
  `shmap::body_end`.
- *Watched waits*: every collective's wait watches the store and the clock,
  so a failed or exited rank raises `RankFailedError` and a rank that never
  arrives raises `CollectiveTimeoutError` (`configure_distributed(timeout=...)`),
  naming the ranks, as eagerly.  On gloo, all_reduce and all_gather are
  shmap's own ops that wait in slices on the calling thread, as eagerly; the
  other collectives are torch's functional collectives, whose wait
  `shmap::coll_wait` hands to the guard's helper thread while it polls (the
  graph's own `wait_tensor` then returns at once).
- `comm_log` records the same events per call as eagerly, in order
  (`shmap::coll_record`).

Where this differs from eager (weaker, or slower):

- The guard's options (`check_collectives`, the shared-memory transport)
  are read when the graph is traced, not at each call: recompile after
  `configure_distributed`.
- The shared-memory transport is not used; gloo moves the data (with 3 or
  more ranks a floating sum may then differ in the last bit from an eager
  run on shared memory, not from an eager run on gloo).
- A backward pass's reductions (and forward gathers issued back to back)
  are bucketed as eagerly (`backends/deferred.py`).  But each bucket's
  collective completes where the graph launches it; eagerly it is read
  last, overlapping the rest of the backward pass.  So a traced pass does
  not open a small first bucket (whose early launch would overlap nothing
  and add a wait): its gradients share full buckets (the recipe's small
  models: one collective per pass; on gloo eagerly too, see
  `first_bucket_bytes`).
- A process group for a new axis tuple is created while tracing, before
  any signature check (eagerly: after the first one); the groups of meshes
  of up to 3 axes exist from `make_mesh` on anyway.
- Error messages locate a rank in the compiled function's generated code,
  not in the user's file.

On a distributed mesh a shard_mapped call passes its `DeviceMesh` to the
node (`run(..., device_mesh=...)`): AOT autograd flattens a DTensor into its
local tensor and its (opaque) mesh, and the mesh of a DTensor *output* must
be a graph input, or the partitioner takes it for the output's tangent
("Node tangents_2 was invalid, but is output").  A pmap's mesh is made by
the call itself; the node gets the whole world's (`pmap._WORLD_DEVICE_MESHES`),
so a pmap over the world compiles with autograd, and a smaller one, with
autograd, raises `NotImplementedError` naming the fix.

**`torch.compile` and `shmap.jit`** (`jit.py`).  `torch.compile` stays on
the route above: it composes with everything around a shard_mapped call
(Python around it, graph breaks, `.backward()`, optimizers, dynamic shapes)
and carries the distributed guard (so do `shmap.jit`'s replays: it traces
the same functional collectives and guard ops).  Its per-call entry cost is Dynamo's and
AOT autograd's, whatever the backend: 0.08 to 0.15 ms for a plain `a @ b`
(8×16 @ 16×32) on this project's 2-core CPU machine (`bench/bench_core.py`,
`plain-comp`), 20 to 30 times the matmul itself, so no backend can make a
tiny program's compiled call "near plain eager".  `shmap.jit` is the low-overhead route for those: an
explicit capture keyed on shapes, strides, dtypes and grad mode, replaying
Inductor's code directly (see its docstring for what it refuses).  The two
meet without disagreeing: under `torch.compile` a jitted function runs its
Python function, so Dynamo traces it like any other (`torch.compile(jit(f))`
is `torch.compile(f)`), and a shard_mapped call inside it is the node
described above.

Registering a function with Dynamo needs `torch._dynamo`, whose import takes
seconds; shmap does not import it.  Functions created before it is imported
are registered when it is (an import hook), those created after at once.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import weakref

import torch

_PENDING: "weakref.WeakSet" = weakref.WeakSet()
_LOCK = threading.Lock()
_HOOKED = False


def register(fn):
    """Let Dynamo put calls of `fn` (a shard_mapped function) in its graph as one node."""
    if "torch._dynamo" in sys.modules and _dynamo_ready():
        _allow(fn)
        return fn
    with _LOCK:
        _PENDING.add(fn)
        _install_hook()
    return fn


def graph_call(call, name):
    """-> `traced(*args, **kwargs)`: `call` as one node of Dynamo's graph, for use while Dynamo traces.

    The node (`allow_in_graph`, named `name` so that each mapped function
    has its own code) returns the output's leaves: a graph node may return
    tensors and tuples or lists of them, not dicts.  The containers come back
    as constants (`spec_tree.skeleton`), read by `out_skeleton` (Dynamo's
    `assume_constant_result`) right after the node has run on fake tensors,
    and `traced` rebuilds them in Python that Dynamo traces.  `call` takes a
    `device_mesh` keyword: the DeviceMesh its outputs are placed on, passed
    so that it is an input of the graph (see the module docstring).

    The node runs `call` with Dynamo's frame evaluation off.  Where the body
    reads a value (`.item()`, `int()` of an invariant value), the node's fake
    run cannot, and Dynamo breaks the graph at the node and runs it eagerly;
    with frame evaluation on, Dynamo then compiled the body's own frames on
    body values, which it cannot trace (a wrong result of another shape, or
    a RecursionError).  That call is now the eager shard_map's.
    """
    from .spec_tree import flat_leaves, from_skeleton, skeleton

    last, types = [None], {}
    eager = []  # `call` with Dynamo's frame evaluation off (made on first use: Dynamo is imported by then)

    def node(*args, _state=(), **kwargs):  # (`_state`: guarded by Dynamo, see `python_state`)
        if not eager:
            import torch._dynamo

            eager.append(torch._dynamo.disable(call, recursive=True))
        out = eager[0](*_mutable(args), **_mutable(kwargs))
        last[0] = skeleton(out, types)
        return flat_leaves(out)

    def out_skeleton():
        return last[0]

    def traced(*args, **kwargs):
        leaves = node(*args, **kwargs)  # first: its fake run sets the skeleton
        return from_skeleton(out_skeleton(), leaves, types)

    out_skeleton._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result, unimported
    node.__code__ = node.__code__.replace(co_name=name)
    traced.__code__ = traced.__code__.replace(co_name=f"{name}_traced")
    register(node)
    return traced


_SIMPLE = (int, float, bool, str, type(None))


def python_state(f, depth=0) -> tuple:
    """The Python values a body reads that a trace would freeze and Dynamo can guard: numbers, strings and
    flags that `f` closes over or reads as globals, or holds in dicts, lists and tuples it closes over
    (`_numbers`; and, one call deep, those of the functions it names), and the `training` flag of modules
    among them (`nn.Dropout`, `BatchNorm`), or of `f` itself.

    Run by Dynamo while it traces the call (shard_map's and pmap's `mapped`): handed to the graph node as
    an argument, each value is guarded, so changing it recompiles instead of replaying the stale graph
    (`scale = 5` after the first call, a learning rate read from a global, `model.eval()`).
    """
    if isinstance(f, torch.nn.Module):
        return (f.training,) + python_state(type(f).forward, depth)
    while hasattr(f, "func") and hasattr(f, "args"):  # functools.partial (its arguments are bound)
        f = f.func
    code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
    if code is None:
        return ()
    values = [c.cell_contents for c in cells if not _empty(c)]
    scope = f.__globals__
    values += [scope[n] for n in code.co_names if n in scope]
    out = []
    for v in values:
        if depth < 1 and type(v) is _FUNCTION:
            out.extend(python_state(v, depth + 1))
        else:
            _numbers(v, out, 0)
    return tuple(out)


_FUNCTION = type(python_state)
#: how many numbers, strings and flags `python_state` hands the node at most (each is a guard Dynamo checks
#: on every call); and how deep into containers it looks
_MOST, _DEEPEST = 1024, 3


def _numbers(v, out, depth):
    """The numbers, strings and flags in `v` (itself one, or held in dicts, lists and tuples, `_DEEPEST`
    levels deep: a nested settings dict, a schedule's table), appended to `out`.  (Not a NumPy scalar:
    Dynamo makes one a tensor, whose value it does not guard.)"""
    if len(out) >= _MOST:
        return
    if type(v) in _SIMPLE:
        out.append(v)
    elif isinstance(v, torch.nn.Module):
        out.append(v.training)
    elif depth < _DEEPEST and isinstance(v, (dict, list, tuple)):
        for x in (v.values() if isinstance(v, dict) else v):
            _numbers(x, out, depth + 1)


def _empty(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # (a name assigned after the function was made)
        return True
    return False


def _mutable(tree):
    """`tree` with torch.fx's immutable dicts and lists (how Dynamo passes a node its containers) made
    plain again: pytree libraries take the immutable ones for leaves."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    if isinstance(tree, immutable_dict) or type(tree) is dict:
        return {k: _mutable(v) for k, v in tree.items()}
    if isinstance(tree, (immutable_list, list)):
        return [_mutable(v) for v in tree]
    if type(tree) is tuple:
        return tuple(_mutable(v) for v in tree)
    return tree


def _dynamo_ready() -> bool:
    mod = sys.modules.get("torch._dynamo")
    return mod is not None and hasattr(mod, "allow_in_graph")


def _allow(fn):
    import torch._dynamo

    torch._dynamo.allow_in_graph(fn)


def _register_pending():
    with _LOCK:
        fns = list(_PENDING)
        _PENDING.clear()
    for fn in fns:
        _allow(fn)


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Runs `_register_pending` right after `torch._dynamo` is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch._dynamo":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            global _HOOKED
            _HOOKED = False
            _register_pending()

        loader.exec_module = exec_module
        return spec


def _install_hook():
    global _HOOKED
    if not _HOOKED:
        sys.meta_path.insert(0, _DynamoImportHook())
        _HOOKED = True
