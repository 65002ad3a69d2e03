"""`shmap.jit`: capture a function's physical program once, replay it with almost no Python.

A shard_map body costs Python per op (typing, automatic `pvary`, batching).
`torch.compile` removes that from the program but adds its own per-call entry
cost (Dynamo's frame evaluation and guards, AOT autograd's runtime wrappers):
tens to hundreds of microseconds, more than a tiny program's whole compute.
`jit(f)` is the explicit capture that removes both:

- **Trace once per key.**  The first call with a new *key* runs `f` once on
  fake tensors under `make_fx` (the body's Python runs at trace time only) and
  keeps the physical program: the batched GEMMs, the sums over device dims,
  and one `shmap::record` node per collective (`ops.py`).
- **Replay.**  Later calls with the same key check the key and call the
  captured program directly.  Without gradients (no tensor argument requires
  grad, or grad mode is off) the program is functionalized and compiled by
  Inductor (`compile_fx_inner`), and its generated `call` is invoked
  directly; the `shmap::record` nodes are taken out of the graph and their
  events reported in order after the call (only when a `comm_log` is
  active), because Inductor's handling of effectful ops costs more than the
  program.  Tiny matrix products (float32/64, at most `small_matmul.LIMIT`
  multiply-adds) become a product and a sum first, which Inductor fuses with
  the ops around them (a psum's sum over device dims) into one C++ loop: a
  BLAS call costs more than such a product.  Values then differ from eager in
  the last bits, as Inductor's do.  `backend="eager"` replays the FX graph
  instead (no compilation, results bit-identical to eager, slower per call).
- **Differentiable calls** (grad mode on and some tensor argument requires
  grad) are captured by AOT autograd (`aot_function`) instead, which traces
  forward and backward *through* autograd Functions (the `LogComm` nodes that
  report a transpose's `psum`, a user's custom backward, checkpointing), so
  gradients and the backward's `comm_log` events equal eager's.  Inductor
  compiles its forward and backward graphs (`backend="eager"`: FX replay);
  AOT autograd's runtime wrapper stays, so these calls cost more per call
  than the inference path.  A double backward
  (`create_graph=True` through a captured call) raises `JitError` (AOT
  autograd's backward is not differentiable); call `f` itself (or
  `jit(...).eager`) for that.

**The key** is everything the trace depends on that can change between calls:
the argument pytree's structure; every tensor's shape, strides, dtype, device
and requires_grad; every non-tensor leaf, by type and value (non-tensor
arguments are static, as `static_argnums` in JAX: a new value retraces; they
must be hashable); which arguments are the same tensor; grad mode, the
default dtype, and the distributed options a trace bakes in
(`configure_distributed`'s checks, transport and bucket sizes: a replay sends
what an eager call would send now, so a rank running `f` eagerly still meets
the others on the wire).  A changed key traces again (`traces` counts them); up to
`max_entries` entries are kept per function.  The common call (positional
plain tensors, or lists / tuples of them) is checked by one C++
`TensorGuards.check` per entry (Dynamo's tensor check: type, dispatch keys,
dtype, device, requires_grad, sizes, strides), without building the key.

**What replays would get wrong, and what happens instead:**

- A tensor `f` *closes over* (a module's parameter, a global) would be a
  constant of the graph: a rebound or grad-requiring tensor would be silently
  stale.  It is refused at trace time (`JitError` naming the fix: pass it as
  an argument).
- Python state `f` reads (globals, numbers, meshes, `print`) is read at trace
  time, once per key, as in `jax.jit`; Python control flow on values raises
  `JitError` (fake tensors have no values).
- Calls that cannot be replayed run `f` itself (eager semantics, so never a
  different answer): inside a running shard_map body, under a `torch.func`
  transform (`grad`, `vmap`, ...), under a dispatch mode or another trace
  (`make_fx`, `torch.compile`: Dynamo inlines `f` into its own graph, so
  `torch.compile(jit(f))` is `torch.compile(f)`), under autocast, or with
  tensor arguments that are not plain tensors (subclasses, body values;
  DTensors are replayed: see the distributed mesh below).
- A call whose capture fails for any other reason (for example AOT autograd
  cannot differentiate an output whose graph `f` already consumed with
  `torch.autograd.grad`) runs `f` eagerly, for that key from then on, with
  a warning naming the cause; if `f` fails eagerly too, that error is raised.
  A capture that fails after the call communicated (AOT autograd's first
  call runs the program; a peer's failure, say) raises instead: running `f`
  again would repeat collectives the other ranks have passed.  A capture
  that fails on one rank only leaves that rank running `f` eagerly beside
  the others' replays: with the default checks its collectives meet theirs
  on the wire (tested on 2 and 4 processes), except a ppermute
  (point-to-point sends eagerly, an all_to_all in a graph), and the guard
  names that mismatch or the stall (an error, or the timeout); with checks
  off too (where Inductor once launched a collective ahead of its turn:
  `traced._depend`).  Inductor may skip a bfloat16 rounding that eager code
  performs (its `emulate_precision_casts` is off by default), so such a
  rank's values can differ by an ulp.
- On the distributed mesh (one process per device) a body's collectives are
  traced as `torch.compile` traces them (`backends/traced.py`: torch's
  functional collectives between the guard's ops), so every replay counts,
  checks and watches its collectives as an eager call does (a rank that
  fails, exits or never arrives is named; programs that differ by rank are
  reported) and reports the same `comm_log` events.  Arguments may be plain
  tensors (global values every rank holds) or DTensors: a DTensor's local
  tensor is the program's input, its layout part of the key, and outputs
  come back as DTensors (`jit_dtensor.py`).  Each rank captures on its own
  first call with a key; the capture itself communicates nothing.
- Random ops draw from torch's global generator on every call; Inductor's
  stream differs from eager's (`backend="eager"` keeps it).
- An input mutated in place by `f` (outside a body: bodies refuse it) is
  written back by the compiled program, as eagerly.  Which arguments share a
  storage (views of one tensor) is part of the key, and a function that
  mutates an input skips the fast path, whose check does not see sharing.

Why not `torch.compile`: its per-call entry cost is Dynamo's, whatever the
backend, more than a tiny program's compute (`compile.py`, and the bench's
`shmap-jit` column).  Under `torch.compile` a jitted function is inlined.
"""
from __future__ import annotations

import functools
import threading
import warnings

import torch
import torch.utils._pytree as pytree
from torch._C._dynamo.guards import TensorGuards

from . import comm, context, jit_dtensor
from .backends.config import traced_options
from .capture import JitError, capture_grad, capture_inference
from .cow import storage_key

__all__ = ["jit", "Jitted", "JitError"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_grad_enabled = torch.is_grad_enabled
_dispatch_depth = torch._C._len_torch_dispatch_stack
_transforms = torch._C._functorch.peek_interpreter_stack
_autocast = torch._C._is_any_autocast_enabled
_default_dtype = torch.get_default_dtype
_compiling = torch.compiler.is_compiling
_LOGS = comm._LOGS  # the active comm logs (the list object itself; comm.record appends to each)
_record = comm.record


def jit(f=None, /, *, backend: str = "inductor", max_entries: int = 64):
    """Capture `f` (a function of tensors, typically shard_mapped) once per key; replay it cheaply.

    `backend`: "inductor" (default: compile the captured program; the fastest
    per call) or "eager" (replay the FX graph; no compilation, bit-identical
    to eager).  Differentiable calls replay AOT autograd's graphs either way.
    `max_entries`: traces kept per function (one per key; the oldest goes first).
    Usable as `jit(f)`, `@jit` or `@jit(backend=...)`; the module docstring has the key and the rules.
    """
    if f is None:
        return functools.partial(jit, backend=backend, max_entries=max_entries)
    if backend not in ("inductor", "eager"):
        raise ValueError(f"shmap.jit: backend must be 'inductor' or 'eager', got {backend!r}.")
    if type(max_entries) is not int or max_entries < 1:  # (bool is not int here)
        raise ValueError(f"shmap.jit: max_entries must be a positive int (traces kept), got {max_entries!r}.")
    if not callable(f):
        raise TypeError(f"shmap.jit: f must be callable, got {type(f).__name__}.")
    return Jitted(f, backend, max_entries)


class Jitted:
    """A jitted function: `__call__` replays the captured program for its key."""

    def __init__(self, f, backend, max_entries):
        self.eager = f  # the function itself (eager semantics; what inlined calls run)
        self.backend = backend
        self.max_entries = max_entries
        self.traces = 0  # how many times a program was captured (tests: cache hits vs retraces)
        self._cache: dict = {}
        self._fast: list = []  # (structure, grad mode, default dtype, traced options, TensorGuards, entry)
        self._lock = threading.Lock()
        functools.update_wrapper(self, f)

    def __get__(self, obj, objtype=None):  # as a method: bind like a function
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args, **kwargs):
        if _compiling():  # Dynamo tracing this call: it inlines `f` into its graph
            return self.eager(*args, **kwargs)
        # Fast path: positional arguments that are plain tensors or lists / tuples of them, with a
        # captured program for their signature.  One C++ check per entry (`TensorGuards`: type,
        # dispatch keys, dtype, device, requires_grad, sizes, strides of every tensor).
        if self._fast and not kwargs and not (_dispatch_depth() or _transforms() is not None or _autocast()
                                              or context.stack()):
            grad = _grad_enabled()
            dtype = _default_dtype()
            opts = traced_options()
            n = len(args)
            leaves = None
            for st, g, dt, o, guard, entry in self._fast:
                if g is not grad or dt is not dtype or o != opts:
                    continue
                if st is n:  # positional tensors only (a list or tuple argument fails the check)
                    if guard.check(*args):
                        return entry(list(args))
                    continue
                if leaves is None:
                    struct, leaves = _shallow(args)
                if st == struct and guard.check(*leaves):
                    return entry(leaves)
        return self._call(args, kwargs)

    def clear(self):
        """Forget every captured program."""
        self._cache.clear()
        self._fast = []

    # ------------------------------------------------------------------
    def _call(self, args, kwargs):
        if _inline(args, kwargs):
            return self.eager(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        seen, storages = {}, {}
        key = (_grad_enabled(), _default_dtype(), traced_options(), spec,
               *[_leaf_key(x, seen.setdefault(id(x), k), storages, k) for k, x in enumerate(leaves)])
        entry = self._cache.get(key)
        tensors = [x for x in leaves if isinstance(x, _Tensor)]
        dpos = [k for k, x in enumerate(tensors) if type(x) is not _Tensor and jit_dtensor.is_plain_dtensor(x)]
        if dpos:  # their local tensors are the program's inputs
            tensors = jit_dtensor.locals_of(tensors, dpos)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is None:
                    entry, first = self._capture(leaves, spec, tensors, dpos)
                    if len(self._cache) >= self.max_entries:  # forget the oldest
                        old = self._cache.pop(next(iter(self._cache)))
                        self._fast = [e for e in self._fast if e[-1] is not old]
                    self._cache[key] = entry
                    self._add_fast(args, kwargs, leaves, key, entry)
                    if first is not None:
                        return first
        return entry(tensors)

    def _add_fast(self, args, kwargs, leaves, key, entry):
        if kwargs or len(self._fast) >= 8 or entry.mutates:  # (views of one storage: the keyed path sees them)
            return
        struct, shallow = _shallow(args)
        if all(x is None for x in struct):
            struct = len(args)  # (small ints are shared: `is` compares them)
        if len(shallow) != len(leaves) or any(type(x) is not _Tensor and type(x) is not _Parameter for x in shallow):
            return
        if len({id(x) for x in shallow}) != len(shallow):  # the same tensor twice: the keyed path
            return
        guard = TensorGuards(*shallow, dynamic_dims_sizes=[list(x.shape) for x in shallow],
                             dynamic_dims_strides=[list(x.stride()) for x in shallow])
        self._fast.append((struct, key[0], key[1], key[2], guard, entry))

    def _capture(self, leaves, spec, tensors, dpos):
        """(entry, the first call's result or None) for this key; `tensors`: the program's inputs (a DTensor
        argument's local tensor at each of `dpos`: see jit_dtensor.py)."""
        name = getattr(self.eager, "__name__", "f")
        tensor_pos = [k for k, x in enumerate(leaves) if isinstance(x, _Tensor)]
        dspecs = {k: leaves[tensor_pos[k]]._spec for k in dpos}  # the DTensor arguments' layouts
        statics = list(leaves)
        for k in tensor_pos:  # (flat_fn fills them from its arguments; AOT autograd keeps flat_fn, which
            statics[k] = None  # must not keep the first call's tensors, a batch say, alive with it)
        out_info = {}
        f = self.eager

        def flat_fn(*tensors):
            versions = [t._version for t in tensors]
            vals = list(statics)
            for k, t in enumerate(tensors):
                # (a DTensor argument, rebuilt on the traced local tensor: what `f` sees eagerly)
                vals[tensor_pos[k]] = t if k not in dspecs else jit_dtensor.on_spec(t, dspecs[k])
            if spec is None:
                out = f(*vals)
            else:
                a, kw = pytree.tree_unflatten(vals, spec)
                out = f(*a, **kw)
            outs, out_spec = pytree.tree_flatten(out)
            out_info["spec"] = out_spec
            out_info["single"] = isinstance(out, _Tensor)
            out_info["consts"] = {}
            tens = []
            for k, o in enumerate(outs):
                if isinstance(o, _Tensor):
                    tens.append(o)
                else:
                    out_info["consts"][k] = o
            out_info["n"] = len(outs)
            out_info["mutates"] = out_info.get("mutates") or versions != [t._version for t in tensors]
            out_info["dspecs"] = {}
            return jit_dtensor.trace_outputs(tens, out_info)  # (a DTensor's local tensor, its spec kept)

        grad = _grad_enabled() and any(t.requires_grad for t in tensors)
        first = None
        sent = _collectives_so_far()
        try:
            with _trace_errors(name):
                if grad:
                    # AOT autograd traces on its first call, which also runs the program (once: this
                    # call's result, so comm_log sees each event once)
                    run = capture_grad(flat_fn, name, self.backend)
                    first = run(list(tensors))
                else:
                    run = capture_inference(flat_fn, tensors, self.backend, name)
        except (JitError, NotImplementedError):
            raise
        except Exception as e:
            if _collectives_so_far() != sent:
                # The program ran (AOT autograd's first call runs what it compiled) and failed partway,
                # a peer's failure say: running `f` again would repeat collectives the other ranks have
                # passed.  The error is the call's.
                raise
            # The rule for what cannot be captured: this key runs `f` itself (eager semantics).  If
            # `f` fails eagerly too, that (clearer) error is the caller's.
            first = flat_fn(*tensors)
            warnings.warn(
                f"shmap.jit({name}): could not capture this call ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); calls with this signature run the "
                "function eagerly.", stacklevel=4)
            run = lambda ts: flat_fn(*ts)  # noqa: E731
        self.traces += 1
        entry = _finish(run, out_info)
        entry.mutates = out_info.get("mutates", True)  # (not traced: unknown)
        if first is not None:
            first = _finish(lambda ts: first, out_info)(tensors)
        return entry, first


def _collectives_so_far():
    """The distributed guard's collective count (None without a world): whether a call communicated."""
    from .backends import watchdog

    w = watchdog._WATCH
    return None if w is None else w.counter


def _shallow(args):
    """(structure, leaves) of positional arguments, one level of lists / tuples flattened."""
    struct = []
    leaves = []
    for a in args:
        t = type(a)
        if t is list or t is tuple:
            struct.append(len(a) if t is list else -1 - len(a))
            leaves.extend(a)
        else:
            struct.append(None)
            leaves.append(a)
    return tuple(struct), leaves


def _inline(args, kwargs) -> bool:
    """Whether this call must run `f` itself (see the module docstring)."""
    leaves = pytree.tree_leaves((args, kwargs))
    for x in leaves:
        if isinstance(x, _Tensor) and type(x) is not _Tensor and type(x) is not _Parameter:
            if jit_dtensor.is_plain_dtensor(x) and type(x._local_tensor) is _Tensor:
                continue  # the distributed mesh's global values: their local tensors are the inputs
            return True  # body values, fake/functional tensors, other subclasses
    return bool(_dispatch_depth() or _transforms() is not None or _autocast() or context.stack()
                or torch.compiler.is_compiling())


def _leaf_key(x, first, storages, k):
    if type(x) is not _Tensor and jit_dtensor.is_plain_dtensor(x):
        return jit_dtensor.leaf_key(x, first, storages, k)
    if isinstance(x, _Tensor):  # `first`: the first position of this object (the same tensor twice), and of its
        # storage (views of one tensor: a program that writes one of them reads the other as written)
        ptr = storage_key(x)
        shared = k if ptr is None else storages.setdefault(ptr, k)
        return (first, shared, x.shape, x.stride(), x.dtype, x.device, x.requires_grad, x.is_conj(), x.is_neg())
    if type(x) is float or type(x) is complex:  # by its bits: 0.0 == -0.0 but 1 / x differs; nan != nan
        return (type(x), x.hex() if type(x) is float else (x.real.hex(), x.imag.hex()))
    try:
        hash(x)
    except TypeError:
        raise JitError(
            f"shmap.jit: a non-tensor argument of type {type(x).__name__} is not hashable. Non-tensor "
            "arguments are static (part of the cache key, compared by value). Fix: pass tensors, "
            "hashable values (numbers, strings, tuples), or bind it with functools.partial before jit."
        ) from None
    return (type(x), x)


class _trace_errors:
    """Errors raised while tracing, restated for jit where the cause is known."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or isinstance(exc, (JitError, NotImplementedError)):
            return False
        msg = str(exc)
        if "closes over" in msg or "FakeTensor" in msg and "non-Fake" in msg or "convert all Tensors to FakeTensors" in msg:
            raise JitError(
                f"shmap.jit({self.name}): the function uses a tensor it closes over (a global, a captured "
                "variable or a module's parameter) instead of taking it as an argument. A captured program "
                "would keep that tensor as a constant: a rebound, updated or grad-requiring tensor would "
                "be silently stale. Fix: pass it as an argument (in a shard_map, with in_spec P() if "
                "replicated); for a module, pass its parameters and use torch.func.functional_call."
            ) from exc
        if "data-dependent" in msg.lower() or "DataDependent" in type(exc).__name__ or "DynamicOutputShape" in type(exc).__name__:
            raise JitError(
                f"shmap.jit({self.name}): the function depends on tensor values in Python (.item(), bool(), "
                "a data-dependent shape), which a captured program cannot replay: it traces on fake "
                "tensors. Fix: keep the decision in tensor ops (torch.where), pass the value as a static "
                "Python argument, or call the function without jit."
            ) from exc
        return False  # the caller's rule: run `f` eagerly for this key


def _finish(run, out_info):
    """The replay entry: tensors in, `f`'s output structure out."""
    spec, consts, n = out_info["spec"], out_info["consts"], out_info["n"]
    events = getattr(run, "shmap_events", ())
    if events:  # Inductor's code without the shmap::record nodes: report their events here
        call = run

        def run(ts):
            outs = call(ts)
            if _LOGS:
                for e in events:
                    _record(e)
            return outs
    dspecs = out_info.get("dspecs")
    if dspecs:  # the distributed mesh: DTensor outputs, from their local tensors
        local = run

        def run(ts):
            return jit_dtensor.wrap_outputs(local(ts), dspecs)
    if out_info["single"] and not consts:
        return lambda ts: run(ts)[0]
    if not consts and spec.num_leaves == n:
        unflatten = pytree.tree_unflatten
        return lambda ts: unflatten(list(run(ts)), spec)

    def entry(ts):
        outs = iter(run(ts))
        leaves = [consts[k] if k in consts else next(outs) for k in range(n)]
        return pytree.tree_unflatten(leaves, spec)
    return entry
