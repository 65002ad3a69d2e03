"""A backward pass's reductions, overlapped with the rest of it and bucketed (as DDP's and FSDP's are).

The transposes that bring a gradient home are the psum of `pvary` (a
replicated weight used with sharded data: DP's all-reduce) and the
psum_scatter of `all_gather` (a sharded weight gathered for use: FSDP's
reduce-scatter).  Run synchronously, each stalls the backward pass until
every rank has sent its share.  Instead each is *launched* when autograd
computes the cotangent and handed on as a `Deferred` tensor: a wrapper with
the result's shape and dtype whose first use by any torch op waits for the
collective (a watched wait: the timeout, failed ranks and signatures are
checked as for any other) and then reads the result.

Both are also *bucketed*: cotangents of one group, kind and dtype gather in
a `Bucket` until it holds at least `bucket_bytes`, and one collective reduces
them all; 29 small all_reduces cost a step about four times the time of one
big one on gloo.  As DDP's, a pass's first bucket is small on NCCL
(`first_bucket_bytes`, 1 MiB), so the wire starts while the last layers'
backward still runs, and the later ones large (25 MiB): each collective has a
fixed cost, and on a CPU the overlap of many small ones buys little (on gloo
no first bucket is smaller: `first_bucket_bytes`).  A bucket
launches when it is full, when any of its values is read, or when the
backward pass ends (a read launches its own bucket only: a tensor-parallel
activation's psum is read at once, mid-pass, and must not launch the FSDP
buckets still filling).  Every rank runs the same program, so every rank
fills and launches the same buckets in the same order; `comm_log` still
reports one psum per transpose (the program's collectives), the guard
counts the buckets (the wire's).

Nothing may read a gradient before it has arrived, and nothing does: every
op on a `Deferred` waits first.  Where the cotangent goes straight into the
next backward op (a tensor-parallel activation's psum), that op waits at
once; where it goes to a weight, the weight's boundary node
(`boundary.Arrive`, or a DTensor's `dtensor._ToBlock`, created when the body
started, so autograd runs it last)
waits, and the pass runs every later layer's backward meanwhile.  A
`Deferred` never leaves a shard_map's backward pass.

Deferred only where this is plainly safe: eager autograd with grad mode off
(no double backward, whose graph would have to record the wait), a plain
tensor (not a functorch or compile wrapper), on torch.distributed.

**Under torch.compile** the same buckets fill.  AOT autograd traces the
forward and backward passes by running them on functional tensors (a
`Deferred` wrapping one is just another tensor subclass to it), so the buckets
fill as they do eagerly, and each bucket's one collective (`traced.py`'s
functional collective between the guard ops) is recorded in the graph where
the eager bucket would launch.  There the collective also completes (the graph
waits for it where it is launched): what the graph gains is the eager bucket
count, one all_reduce for a small model's gradients instead of one per
weight, which on gloo was a third of a compiled step (recipe, 2 processes:
29 all_reduces, 255 ms a step; bucketed, 192 ms).  Since a traced launch
completes, a bucket the pass's end launches leaves no collective of the graph
without its wait.
"""
from __future__ import annotations

import torch

from .config import _OPTIONS
from .sealed import _contiguous_strides
from .traced import tracing
from . import transports
from .transports import (_MOVABLE, _all_gather, _chunks, _launch_all_reduce, _launch_gather_rows,
                         _launch_psum_scatter, result_shape)


class Deferred(torch.Tensor):
    """The result of a collective still on the wire; any op on it waits for it first."""

    @staticmethod
    def __new__(cls, resolve, shape, dtype, device):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, strides=_contiguous_strides(tuple(shape)),
                                                dtype=dtype, device=device, requires_grad=False)
        t._resolve, t._value = resolve, None
        return t

    def wait(self) -> torch.Tensor:
        """The collective's result (waits for it, once)."""
        if self._value is None:
            self._value, self._resolve = self._resolve(), None
        return self._value

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is _DETACH and args[0]._value is None and torch._C._current_graph_task_id() == -1:
            # A forward's output saved by autograd (a loss still on the wire): a pending detach, no wait.
            # (In a backward pass a detach waits: AccumulateGrad's, say; no Deferred leaves the pass.)
            d = args[0]
            return Deferred(lambda: d.wait().detach(), d.shape, d.dtype, d.device)
        if func in _METADATA_ONLY:  # (autograd's ones_like seed of a loss still on the wire: no wait)
            args = tuple(torch.empty(a.shape, dtype=a.dtype, device=a.device) if isinstance(a, Deferred) else a
                         for a in args)
            return func(*args, **(kwargs or {}))
        args = tuple(_arrived_arg(a) for a in args)
        if kwargs:
            kwargs = {k: _arrived_arg(v) for k, v in kwargs.items()}
        return func(*args, **(kwargs or {}))

    def __repr__(self):
        return f"Deferred({self.wait()!r})"

    # Reads torch refuses for any tensor subclass ("not supported for tensor subclasses"): a gradient that
    # `torch.autograd.grad` hands back still on the wire (a closed-over weight's: no boundary node reads
    # it) is read as its value.
    def tolist(self):
        return self.wait().tolist()

    def numpy(self, *, force=False):
        return self.wait().numpy(force=force)

    def __array__(self, dtype=None, copy=None):
        value = self.wait().numpy()
        return value if dtype is None else value.astype(dtype)

    # Storage-level methods, which do not dispatch: on the wrapper, which has no storage of its own, torch
    # read a null pointer (`share_memory_()` killed the process).  They act on the value.  (Not
    # `untyped_storage()` / `data_ptr()`: shmap's own bookkeeping reads them, and must not wait.)
    def share_memory_(self):
        self.wait().share_memory_()
        return self

    def is_shared(self):
        return self.wait().is_shared()

    def __deepcopy__(self, memo):
        import copy

        return copy.deepcopy(self.wait(), memo)

    def __reduce_ex__(self, protocol):
        """Pickled as its value (`torch.save` of a global loss still on the wire, say): the collective
        and its wait belong to this process."""
        return self.wait().__reduce_ex__(protocol)


_DETACH = torch.ops.aten.detach.default
#: ops that read only a tensor's shape, dtype and device
_METADATA_ONLY = frozenset({torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
                            torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default})


def _arrived_arg(a):
    """An op's argument with every `Deferred` in it arrived: a tensor, or a list of them (a `_foreach_*`
    op's, e.g. over gradients taken inside a body), which would otherwise dispatch back here forever."""
    if isinstance(a, Deferred):
        return a.wait()
    if isinstance(a, (list, tuple)) and any(isinstance(t, Deferred) for t in a):
        return type(a)(t.wait() if isinstance(t, Deferred) else t for t in a)
    return a


def arrived(t):
    """`t`, or the value of a `Deferred` once it has arrived.

    A `Deferred` with a history (the transpose of a tiled psum_scatter, an all_gather launched inside a
    `create_graph=True` backward pass) is read through autograd, a clone, so that the value keeps it: its
    bare value has none, and the second derivative lost that term (raising, or silently dropped with
    `allow_unused=True`)."""
    if not isinstance(t, Deferred):
        return t
    return t.clone() if t.requires_grad else t.wait()


def _deferrable(ct) -> bool:
    return (not torch.is_grad_enabled() and type(ct) is torch.Tensor
            and not torch._C._functorch.is_functorch_wrapped_tensor(ct) and not torch.compiler.is_compiling()
            and not tracing())


def forward_psum(x, g):
    """psum of a forward value, launched and handed on as a `Deferred` where that is plainly safe (eager,
    outside any backward pass and torch.func transform), else None.

    A forward psum read at once (a tensor-parallel projection's) waits at its next op, as before.  One
    that leaves the body as it is (a global loss: `shmap.psum(loss / n, axes)`) is waited for where the
    caller first reads it, or before the next collective starts (a backward pass's first bucket; its
    signature is then checked even if nobody reads it), so the backward pass starts without the sync
    point that DDP does not have either.  (autograd's `ones_like` seed of it does not wait.)
    """
    if (type(x) is not torch.Tensor or tracing() or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active() or torch._C._functorch.is_functorch_wrapped_tensor(x)
            or torch._C._current_graph_task_id() != -1 or torch._C._len_torch_dispatch_stack()):
        # (a dispatch mode, e.g. selective checkpointing's, sees the ops: the forward dispatches the one
        # `shmap::psum` that a recomputation in the backward pass does; launched here, it dispatched none)
        return None
    flight, result = _launch_all_reduce(x, g, "psum")
    out = _hand_on(flight, result, x, x.shape)
    if isinstance(out, Deferred):
        transports.UNREAD.append(out)
    return out


# --------------------------------------------------------------------------
# psum (the transpose of pvary) and psum_scatter (of all_gather): bucketed
# --------------------------------------------------------------------------
def psum(ct, g):
    """psum of a cotangent over group `g`: bucketed and read later where that is safe."""
    ct = arrived(ct)
    if not _bucketable(ct, g):
        flight, result = _launch_all_reduce(ct, g, "psum")
        return _hand_on(flight, result, ct, ct.shape, defer=_deferrable(ct))
    return _bucket(g, "psum", ct).add(ct.reshape(-1), ct.shape, ct.dtype)


def psum_scatter(ct, g, dim, tiled):
    """psum_scatter of a cotangent over group `g`: bucketed and read later where that is safe."""
    ct = arrived(ct)
    shape = result_shape("psum_scatter", ct.shape, g, scatter_dimension=dim, tiled=tiled)
    if not _bucketable(ct, g):
        flight, result = _launch_psum_scatter(ct, g, dim, tiled)
        return _hand_on(flight, result, ct, shape, defer=_deferrable(ct))
    rows = _chunks(ct, g.n, dim, tiled).reshape(g.n, -1)  # [n, m]: row r is summed onto position r
    return _bucket(g, "psum_scatter", ct).add(rows, shape, ct.dtype)


def all_gather(x, g, axis, tiled):
    """all_gather of a forward value (FSDP's weight gather): bucketed with the gathers that follow it.

    A program that gathers its weights ahead of use (the training recipe
    gathers every FSDP weight at the top of its forward, as FSDP2 does for a
    unit) then moves them in a few collectives instead of one each (one, for a
    model under `bucket_bytes`): the bucket launches when it holds
    `bucket_bytes`, or when one of its values is first read.  Under a
    functorch transform the value is gathered at once.
    """
    if not (_bucketable(x, g) and x.dtype in _MOVABLE
            and torch._C._functorch.peek_interpreter_stack() is None):
        return _all_gather(x, g, axis, tiled)
    shape = result_shape("all_gather", x.shape, g, axis=axis, tiled=tiled)
    part = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
    return _bucket(g, "all_gather", x).add(part, shape, x.dtype, (tuple(x.shape), axis, tiled))


def _traced(ct) -> bool:
    """Whether AOT autograd is tracing this (torch.compile) where the eager call would bucket."""
    return (not torch.is_grad_enabled() and tracing()
            and not torch._C._functorch.is_functorch_wrapped_tensor(ct))


def _bucketable(ct, g) -> bool:
    return (_deferrable(ct) or _traced(ct)) and g.n > 1 and g.shm(ct) is None


def _bucket(g, kind, ct):
    key = (id(g), kind, ct.dtype, ct.device)
    b = _OPEN.get(key)
    if b is None:
        b = _OPEN[key] = Bucket(g, kind, key)
    return b


#: (group, kind, dtype, device) -> the bucket filling for it
_OPEN: dict = {}
#: [backward pass (graph task id), the keys whose first reduction bucket it has opened]
_STARTED: list = [None, set()]


def first_bucket_bytes(g):
    """The cap of a backward pass's first bucket over group `g`, or None for none smaller than the rest.

    `'auto'` (the default): DDP's 1 MiB where the wire runs beside the
    compute (NCCL), none on gloo, where the processes' own threads move
    the data: there an early launch overlapped too little to pay for one
    more collective (the recipe's step on 2 and 4 processes, interleaved:
    a small first bucket cost 2-3% on fsdp and 0-3% on data).
    """
    first = _OPTIONS["first_bucket_bytes"]
    if first == "auto":
        return None if g.gloo else 1 << 20
    return first


class Bucket:
    """Cotangents of one group, kind and dtype reduced by one collective (see the module docstring).

    psum: each part is a flat cotangent; the bucket sums their concatenation.
    psum_scatter: each part is [n, m] (row r for position r); the bucket
    reduce-scatters the parts side by side, [n, sum of m], and each position
    reads its columns back.
    """

    def __init__(self, g, kind, key):
        self.g, self.kind, self.key = g, kind, key
        self.parts, self.nbytes, self.starts, self.gathered = [], 0, [0], []
        self.flight = self.result = self.value = None
        self.cap = _OPTIONS["bucket_bytes"]
        try:  # launch at the end of this backward pass at the latest (nobody may read some values)
            torch.autograd.Variable._execution_engine.queue_callback(self.launch)
        except RuntimeError:  # not inside a backward pass: the first read launches
            return
        # A small first bucket starts the wire while the pass's last layers still run.  A traced
        # launch completes where it is launched (see the module docstring): there an early launch
        # overlaps nothing and would only add a wait, so the pass's gradients share full buckets.
        first = first_bucket_bytes(g)
        if first is not None and kind != "all_gather" and not tracing():
            task = torch._C._current_graph_task_id()
            if _STARTED[0] != task:
                _STARTED[:] = [task, set()]
            if key not in _STARTED[1]:  # this pass's first bucket of its group, kind and dtype: a small one
                _STARTED[1].add(key)
                self.cap = min(self.cap, first)

    def add(self, part, shape, dtype, gathered=None) -> Deferred:
        i = len(self.parts)
        self.parts.append(part)
        self.starts.append(self.starts[-1] + part.shape[-1])
        self.nbytes += part.numel() * part.element_size()
        if gathered is not None:
            self.gathered.append(gathered)
        d = Deferred(lambda: self.read(i, shape), shape, dtype, part.device)
        if self.nbytes >= self.cap:
            self.launch()
        return d

    def launch(self):
        if self.parts is None:
            return
        if _OPEN.get(self.key) is self:
            del _OPEN[self.key]
        parts, self.parts = self.parts, None
        if self.kind == "psum":  # the parts are copied once, into the sealed buffer
            self.flight, self.result = _launch_all_reduce(parts, self.g, "psum")
        elif self.kind == "all_gather":  # the parts are copied once, into the (sealed) row sent
            self.flight, self.result = _launch_gather_rows(parts, self.g, "all_gather", f"bucket of {len(parts)}")
        else:  # [n, m_i] side by side, copied once (into the sealed rows)
            self.flight, self.result = _launch_psum_scatter(parts, self.g, 0, False)

    def read(self, i, shape):
        self.launch()
        if self.value is None:
            if self.flight is not None:
                self.flight.finish()
            self.value, self.flight, self.result = self.result(), None, None
        if self.kind == "all_gather":  # [n, total] -> this part's rows, laid out as its all_gather's result
            block, axis, tiled = self.gathered[i]
            t = self.value[:, self.starts[i]:self.starts[i + 1]].reshape(self.g.n, *block).movedim(0, axis)
            t = t.flatten(axis, axis + 1) if tiled else t
            return t.contiguous()  # the strides its Deferred promised
        return self.value[self.starts[i]:self.starts[i + 1]].view(shape)


def _hand_on(flight, result, ct, shape, defer=True):
    if flight is None:  # completed already (one device, shared memory)
        return result()
    if not defer:
        flight.finish()
        return result()

    def resolve():
        flight.finish()
        return result()

    return Deferred(resolve, shape, ct.dtype, ct.device)
