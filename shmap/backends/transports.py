"""Raw collectives on one rank's block of a distributed mesh (no autograd, no comm_log).

Each runs under the guard (`_run`: signature check, launch, watched wait) on
torch.distributed (gloo / NCCL) or, when configured, the shared-memory
transport (`_run_shm`); every result equals the simulated mesh's bit for bit.
"""
from __future__ import annotations

import math

import torch

from .groups import Group, _dist, _gather_into
from . import sealed
from .sealed import (_sealed_bytes, _sealed_reduce, _sealed_reduce_rows, _sealing, _unseal_bytes,
                     _unsealed_rows)
from .signatures import Seal
from . import traced
from .traced import tracing
from .shm_run import _run_shm


# --------------------------------------------------------------------------
# Raw collectives on one rank's block (no autograd, no comm_log)
# --------------------------------------------------------------------------
def _run(g: Group, kind, shape, dtype, launch, extra="", seal=None, blocking=False):
    """Check the signature, launch, and watch the wait of one collective.

    Default mode: the signature travels in the payload (`seal`, from the
    `_sealed_*` helpers below) and is checked when the data arrives.  Strict
    mode (or a group not on gloo, e.g. NCCL, where reading the trailer back
    would synchronise the GPU): a separate exchange completes before any data
    moves.
    """
    _start(g, kind, shape, dtype, launch, extra, seal, blocking).finish()


class InFlight:
    """A launched collective: `finish()` waits for it (watched), checks its signature and closes it.

    `_run` finishes at once; `deferred` finishes when the result is first read,
    so a backward pass's reductions overlap the rest of it.
    """

    __slots__ = ("g", "record", "works", "seal", "pending", "blocking")

    def finish(self):
        g = self.g
        w = g._backend.watch
        w.current = self.record  # a deferred finish: its messages and stall checks name this collective
        for work in self.works:
            w.wait(work, None, g.ranks, gloo=g.gloo, blocking=self.blocking)
        if self.seal is not None:
            w.unseal(self.seal, g.ranks)
        w.verify(self.pending, moved=True)  # default mode, no payload signature: the exchange ran alongside
        w.done()


#: forward psums handed on unread (`deferred.forward_psum`): finished, their signatures checked, before
#: the next collective starts, eager or compiled (`settle_unread`), so an unread one is checked too (by
#: then it has long arrived)
UNREAD: list = []


def settle_unread():
    """Finish the forward psums handed on unread, oldest first (before any collective starts)."""
    while UNREAD:
        UNREAD.pop(0).wait()


def _start(g: Group, kind, shape, dtype, launch, extra="", seal=None, blocking=False) -> InFlight:
    """Count the collective, check (strict) or seal (default) its signature, and launch it."""
    if UNREAD:
        settle_unread()
    w = g._backend.watch
    grad = torch.is_grad_enabled()
    if grad:  # raw data movement; autograd is the Functions' business
        torch._C._set_grad_enabled(False)  # (torch.set_grad_enabled builds a context object: this runs per call)
    try:
        # A collective whose payload carries no signature (NCCL, a dtype that cannot) exchanges one first
        # whenever checks are on; the exchange completes before any data moves (and before a new
        # process group is created: that is collective over the world).
        pending = w.begin(kind, g.axes, shape, dtype, extra, exchange=seal is None)
        if pending is not None and not (w.overlapping() and g._pg is not None):
            w.verify(pending)  # strict: before the data moves
            pending = None
        if seal is not None:
            w.seal(seal)
        works = launch(g.pg())
    finally:
        if grad:
            torch._C._set_grad_enabled(True)
    f = InFlight()
    f.g, f.record, f.seal, f.pending, f.blocking = g, w.current, seal, pending, blocking
    f.works = works if isinstance(works, list) else [works]
    return f


# --------------------------------------------------------------------------
# Dtypes on the wire: every result equals the simulated mesh's, bit for bit.
# Integer sums wrap in their own dtype there and here (gloo and NCCL wrap);
# booleans never reach a sum (collectives.psum counts them in int32, as JAX).
# --------------------------------------------------------------------------
#: dtypes gloo and NCCL move natively (torch.distributed views complex as real pairs)
_MOVABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                      torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128})


def _reduce_dtype(x, kind):
    """The dtype a reduction of `x` runs in on the wire, or None for its own.

    - 16-bit floats on the CPU (gloo, shared memory) are summed in float32 and
      rounded once, as torch's sum on the simulated mesh does; gloo would round
      after every addition, so 3+ devices could differ in the last bit.  NCCL
      keeps its own 16-bit reduction (bandwidth matters there).
    - int16 (gloo and NCCL lack it) runs in int32: the truncation back wraps
      exactly as an int16 sum would; max/min are exact.
    """
    if x.dtype in (torch.float16, torch.bfloat16):
        return torch.float32 if kind in ("psum", "psum_scatter") and x.device.type == "cpu" else None
    if x.dtype == torch.int16:
        return torch.int32
    return None


def _as_bytes(x):
    """`x` flattened to its bytes (uint8), for moving a dtype the backend does not know; bit-exact.
    (A fresh copy: a size-1 dimension may have any stride, which `view` to another item size refuses.)"""
    return x.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _all_reduce(x, g: Group, kind):
    flight, result = _launch_all_reduce(x, g, kind)
    if flight is not None:
        flight.finish()
    return result()


def _launch_all_reduce(x, g: Group, kind):
    """(the collective in flight, or None when it already completed; its result once finished).

    `x` may be a list of 1-D tensors of one dtype (a bucket of psums, `deferred.Bucket`): the result
    is their concatenation reduced, and the data is copied once."""
    if tracing():  # torch.compile: functional collectives (traced.py)
        return traced.launch_all_reduce(x, g, kind)
    if isinstance(x, list):
        head, shape = x[0], (sum(p.numel() for p in x),)
    else:
        head, shape = x, x.shape
    if g.n == 1:
        out = torch.cat(x) if isinstance(x, list) else x.clone(memory_format=torch.contiguous_format)
        return None, lambda: out
    wire = _reduce_dtype(head, kind)
    dist = _dist()
    shm = g.shm(head) if kind == "psum" else None
    flight = None
    if shm is not None:  # completes here
        buf, out, seal = _sealed_reduce(x, wire or head.dtype, g, kind)  # a fresh copy (+ the signature trailer)
        _run_shm(g, shm, kind, shape, head.dtype, lambda: shm.all_reduce(buf, out=buf), seal=seal)
    elif g.shm(head) is None and gathered_reduce(g, math.prod(shape) * head.element_size()):
        return _launch_gathered_reduce(x, g, kind)  # (pmax/pmin stay off a shared-memory transport)
    else:
        op = dist.ReduceOp.SUM if kind == "psum" else dist.ReduceOp.MAX if kind == "pmax" else dist.ReduceOp.MIN
        buf, out, seal = _sealed_reduce(x, wire or head.dtype, g, kind)  # a fresh copy (+ the signature trailer)
        flight = _start(g, kind, shape, head.dtype, lambda pg: _pg_all_reduce(buf, op, pg), seal=seal)
    return flight, (lambda: out) if wire is None else (lambda: out.to(head.dtype))


# --------------------------------------------------------------------------
# A small reduction, checked: an all_gather of the blocks, reduced here
# --------------------------------------------------------------------------
def gathered_reduce(g: Group, nbytes) -> bool:
    """Whether a reduction of `nbytes` a rank over `g` runs as `_launch_gathered_reduce`: in the default
    mode on gloo, over 3 or more positions, when every rank's blocks together fit a sealed all_gather
    (256 KiB; above it the ring's bandwidth wins).  Two positions keep the all_reduce: a + b is b + a,
    and there the gather's extra copies cost more than the steps it saves.  (The traced twin asks the
    same: compiled and eager move the same bytes.)"""
    return g.n > 2 and _sealing(g) and nbytes * g.n <= sealed._SEAL_BYTES_LIMIT  # (one binding: tests lower it)


def _launch_gathered_reduce(x, g: Group, kind):
    """A small reduction as an all_gather of every position's block, each row sealed with the
    reduction's signature (kind, shape, dtype), then reduced here in position order by
    `reduce_rows`, the simulated mesh's own reduction.

    Why: a sealed all_reduce carries its 32-element signature trailer, and
    gloo's ring all_reduce takes 2(n-1) message steps for any payload of n
    or more elements (a single element skips most of them).  On a loaded
    CPU a step costs a thread wake-up, so a sealed scalar psum cost 0.6 ms
    on 2 processes and 5.9 ms on 4, against 0.27 and 1.2 ms for an
    unsealed one; an all_gather of the same bytes takes 0.37 and 3.5-4 ms,
    up to 256 KiB a rank (`/tmp` timings of raw calls after 1 ms of compute,
    medians of 100 interleaved rounds; this project's 2-core machine).
    Through shmap, A/B in one run: a psum of 4 B to 64 KiB a rank about
    20% faster on 4 processes (3.7-4.3 against 4.8-5.7 ms); on 2, where the
    call's own path is most of its 0.65 ms, 1-6% slower (so 2 keep the ring).  The
    signature check is the all_gather's exact 8 bytes a row (gathered by
    `_launch_gather_rows`, as the traced twin uses `gather_rows`), and every rank
    reduces the same rows in the same order: the same bits everywhere, and
    the simulated mesh's (16-bit floats summed in float32 and rounded once,
    integers wrapping in their own dtype).
    """
    # (a bucket's parts: gathered as their concatenation, copied once into the sealed row, and its
    # signature names the concatenation)
    flight, rows = _launch_gather_rows(x, g, kind)  # sealed: `gathered_reduce` asked that it fits
    return flight, lambda: reduce_rows(rows(), kind)


def reduce_rows(rows, kind):
    """`rows` ([n, ...], position order) reduced over the first dim, as the simulated mesh reduces its
    device dims (`simulated._device_sum`, `amax`, `amin`)."""
    if kind == "psum":
        from .simulated import _device_sum  # (the simulated backend imports this module)

        return _device_sum(rows, 0)
    return rows.amax(0) if kind == "pmax" else rows.amin(0)


def _pg_all_reduce(buf, op, pg):
    """`dist.all_reduce(buf, op, group=pg, async_op=True)`, called on the process group itself.

    What the wrapper adds is done already or does not arise here (one plain
    tensor of this process's group, no coalescing manager), and its Python (an
    exception-logging decorator, argument checks, the options object) costs
    about 8 us of CPU on every psum and gradient bucket (52.9 against 45.0 us
    a call, timed side by side on gloo).  A complex tensor keeps the wrapper
    (which moves it as real pairs).
    """
    if buf.is_complex():
        return _dist().all_reduce(buf, op=op, group=pg, async_op=True)
    opts = _AR_OPTIONS.get(op)
    if opts is None:  # read by the launch only: one per op serves every call
        opts = _AR_OPTIONS[op] = _dist().AllreduceOptions()
        opts.reduceOp = op
        opts.asyncOp = True
    return pg.allreduce([buf], opts)


_AR_OPTIONS: dict = {}


def _sealed_bucket(part, g: Group) -> bool:
    """Whether a bucket of parts like `part` travels sealed as their concatenation (eager, gloo, default mode)."""
    return not tracing() and g.n > 1 and g.shm(part) is None and _sealing(g)


def _gather_rows(x, g: Group, kind, extra=""):
    """[n, *x.shape]: every position's block, in the tuple's order."""
    flight, result = _launch_gather_rows(x, g, kind, extra)
    if flight is not None:
        flight.finish()
    return result()


def _launch_gather_rows(x, g: Group, kind, extra=""):
    """As `_gather_rows`, launched: (the collective in flight or None, its result once finished).

    `x` may be a list of contiguous 1-D tensors of one movable dtype (a bucket's parts, `deferred`):
    gathered as their concatenation, which then carries its signature at any size (`_sealed_bytes`:
    the one copy the concatenation makes anyway, instead of an exchange beside the data).
    """
    parts = x if isinstance(x, list) else None
    bucket = parts is not None and len(parts) > 1
    if parts is not None and not (bucket and _sealed_bucket(parts[0], g)):
        x, parts = (parts[0] if len(parts) == 1 else torch.cat(parts)), None
    if parts is not None:
        shape, dtype, shm = (sum(p.numel() for p in parts),), parts[0].dtype, None
        wire, src = dtype, parts
    else:
        if tracing():  # torch.compile: functional collectives (traced.py), complete at once
            out = traced.gather_rows(x, g, kind, extra, bucket=bucket)
            return None, lambda: out
        x = x.contiguous()
        if g.n == 1:
            out = x.unsqueeze(0).clone()
            return None, lambda: out
        shape, dtype, shm = x.shape, x.dtype, g.shm(x)
        flat = x.reshape(-1) if x.dtype in _MOVABLE else _as_bytes(x)
        wire, src = flat.dtype, flat.reshape(1, -1)
    flight = None
    send, nb, expect = _sealed_bytes(src, g, kind, shape, dtype, extra)
    if shm is not None and send is None:  # completes here
        got = _run_shm(g, shm, kind, shape, dtype, lambda: shm.all_gather(flat), extra)
        read = lambda: got  # noqa: E731
    elif shm is not None:  # completes here, its rows sealed as on gloo
        seal = Seal("bytes", None, None, expect)

        def gather():
            rows = shm.all_gather(send.view(-1)).view(g.n, nb + 8)
            seal.recv = rows[:, nb:]
            return rows

        rows = _run_shm(g, shm, kind, shape, dtype, gather, extra, seal=seal)
        read = lambda: _unsealed_rows(rows, nb, wire, g.n)  # noqa: E731
    else:
        if send is None:
            out = flat.new_empty((g.n, flat.numel()))
            flight = _start(g, kind, shape, dtype,
                            lambda pg: _gather_into(out, src, pg), extra)
            read = lambda: out  # noqa: E731
        else:
            got = send.new_empty((g.n, nb + 8))
            flight = _start(g, kind, shape, dtype, lambda pg: _gather_into(got, send, pg), extra,
                            seal=Seal("bytes", None, got[:, nb:], expect))
            read = lambda: _unsealed_rows(got, nb, wire, g.n)  # noqa: E731

    def result():
        out = read()
        if out.dtype != dtype:  # (bytes of a dtype the wire lacks)
            out = out.contiguous().view(dtype)
        if g.g2t is not None:
            out = out.index_select(0, torch.tensor(g.t2g, device=out.device))
        return out.view(g.n, *shape)

    return flight, result


def result_shape(name, shape, g: Group, **params) -> tuple:
    """The shape collective `name` gives a block of `shape` over group `g`: its type rule
    (`collectives.COLLECTIVES`), the one definition both meshes type results by."""
    from ..collectives import COLLECTIVES  # (the front end: imported on use, not at start-up)

    return COLLECTIVES[name].rule(frozenset(), tuple(shape), g.axes, g.n, **params)[1]


def _all_gather(x, g: Group, axis, tiled, kind="all_gather"):
    rows = _gather_rows(x, g, kind, f"axis={axis}, tiled={tiled}")
    t = rows.movedim(0, axis)
    if tiled:
        t = t.flatten(axis, axis + 1)
    return t


def _chunks(x, n, dim, tiled):
    """[n, *chunk]: `x` cut into n chunks along `dim` (tiled) or unstacked (untiled)."""
    if tiled:
        x = x.unflatten(dim, (n, x.shape[dim] // n))
    return x.movedim(dim, 0)


def _psum_scatter(x, g: Group, dim, tiled):
    flight, result = _launch_psum_scatter(x, g, dim, tiled)
    if flight is not None:
        flight.finish()
    return result()


def _launch_psum_scatter(x, g: Group, dim, tiled):
    """As `_launch_all_reduce`, for psum_scatter.

    `x` may be a list of [n, m_i] tensors (a bucket's parts, `deferred`; dim 0, untiled): reduce-scattered
    side by side, their concatenation carrying its signature at any size (`_sealed_reduce_rows`).
    """
    bucket = isinstance(x, list) and len(x) > 1
    if isinstance(x, list):
        if bucket and _sealed_bucket(x[0], g) and g.g2t is None and _reduce_dtype(x[0], "psum_scatter") is None:
            return _launch_sealed_scatter(x, g)
        x = x[0] if len(x) == 1 else torch.cat(x, dim=1)
    if tracing():  # torch.compile: functional collectives (traced.py)
        return traced.launch_psum_scatter(x, g, dim, tiled, bucket=bucket)
    chunks = _chunks(x, g.n, dim, tiled)
    if g.n == 1:
        out = chunks[0].clone()
        return None, lambda: out
    if g.g2t is not None:  # row r of the input goes to group rank r
        chunks = chunks.index_select(0, torch.tensor(g.g2t, device=x.device))
    wire = _reduce_dtype(x, "psum_scatter")
    if wire is not None:
        chunks = chunks.to(wire)
    extra = f"scatter_dimension={dim}, tiled={tiled}"
    shm = g.shm(x)
    if shm is not None:
        inp = chunks.reshape(g.n, -1).contiguous()
        out = _run_shm(g, shm, "psum_scatter", x.shape, x.dtype, lambda: shm.reduce_scatter(inp), extra)
        return None, lambda: out.reshape(chunks.shape[1:]).to(x.dtype)
    flight, out = _start_scatter(chunks.reshape(-1), g, x.shape, x.dtype, extra)
    return flight, lambda: out.view(chunks.shape[1:]).to(x.dtype)


def _launch_sealed_scatter(parts, g: Group):
    """A bucket's [n, m_i] parts reduce-scattered side by side: (in flight, [sum of m_i] once finished)."""
    shape = (g.n, sum(p.shape[1] for p in parts))
    flight, out = _start_scatter(parts, g, shape, parts[0].dtype, "scatter_dimension=0, tiled=False")
    return flight, lambda: out


def _start_scatter(inp, g: Group, shape, dtype, extra):
    """Launch the reduce-scatter of `inp` (flat [n] rows, or a bucket's parts): (in flight, output data)."""
    inp, buf, out, seal = _sealed_reduce_rows(inp, g.n, g)
    fn = getattr(_dist(), "reduce_scatter_single", None) or _dist().reduce_scatter_tensor
    # gloo's reduce_scatter ignores a wait's timeout: a helper thread waits for it (blocking=True)
    flight = _start(g, "psum_scatter", shape, dtype, lambda pg: fn(buf, inp, group=pg, async_op=True), extra,
                    seal=seal, blocking=True)
    return flight, out


def _own_block(x, g: Group, axis, tiled):
    """This position's block of a gathered value (the transpose of all_gather_invariant)."""
    if tiled:
        c = x.shape[axis] // g.n
        return x.narrow(axis, g.index * c, c).contiguous()
    return x.select(axis, g.index).contiguous()


def _ppermute(x, g: Group, perm):
    if tracing():  # torch.compile: functional collectives (traced.py)
        return traced.ppermute(x, g, perm)
    me = g.index
    send = [d for s, d in perm if s == me]
    recv = [s for s, d in perm if d == me]
    if g.n == 1:
        return x.clone() if recv else torch.zeros_like(x)
    if x.dtype not in _MOVABLE:
        return _ppermute(_as_bytes(x), g, perm).view(x.dtype).reshape(x.shape)
    dist = _dist()
    x = x.contiguous()
    shm = g.shm(x)
    if shm is not None:
        tperm = [tuple(g.torch_ranks((s, d))) for s, d in perm]
        return _run_shm(g, shm, "ppermute", x.shape, x.dtype, lambda: shm.ppermute(x, tperm), f"perm={list(perm)}")
    out = torch.empty_like(x) if recv else torch.zeros_like(x)  # a device with no source gets zeros
    if me in send and me in recv:
        out.copy_(x)
    sx, nb, expect = _sealed_bytes(x.reshape(1, -1), g, "ppermute", x.shape, x.dtype, f"perm={list(perm)}")
    if sx is None:
        sx, so, seal = x, out, None
    else:  # signature appended to what is sent; the received one is checked
        src = [s for s in recv if s != me]
        so = sx.new_empty(sx.shape) if src else None
        seal = Seal("bytes", None, so[:, nb:] if src else None, expect)

    def launch(pg):
        ops = [dist.P2POp(dist.isend, sx, g.ranks[d], pg) for d in send if d != me]
        ops += [dist.P2POp(dist.irecv, so, g.ranks[s], pg) for s in recv if s != me]
        return dist.batch_isend_irecv(ops) if ops else []

    # A gloo send or receive whose wait times out is abandoned (its later waits never return), and a
    # slice of the watched wait can time out on a loaded machine: a helper thread waits (blocking).
    _run(g, "ppermute", x.shape, x.dtype, launch, f"perm={list(perm)}", seal=seal, blocking=g.gloo)
    if seal is not None and seal.recv is not None:
        out = _unseal_bytes(so, nb, x.dtype, x.shape)
    return out


def _all_to_all(x, g: Group, split_axis, concat_axis, tiled):
    if tracing():  # torch.compile: functional collectives (traced.py)
        return traced.all_to_all(x, g, split_axis, concat_axis, tiled)
    chunks = _chunks(x, g.n, split_axis, tiled)  # [dst, *chunk]
    if g.n > 1:
        dist = _dist()
        if g.g2t is not None:
            chunks = chunks.index_select(0, torch.tensor(g.g2t, device=x.device))
        inp = chunks.contiguous()
        if inp.dtype not in _MOVABLE:
            inp = _as_bytes(inp).view(g.n, -1)
        extra = f"split_axis={split_axis}, concat_axis={concat_axis}, tiled={tiled}"
        shm = g.shm(inp)
        if shm is not None:
            out = _run_shm(g, shm, "all_to_all", x.shape, x.dtype, lambda: shm.all_to_all(inp), extra)
        else:
            sin, nb, expect = _sealed_bytes(inp, g, "all_to_all", x.shape, x.dtype, extra)
            if sin is None:
                out = torch.empty_like(inp)
                _run(g, "all_to_all", x.shape, x.dtype,
                     lambda pg: dist.all_to_all_single(out, inp, group=pg, async_op=True), extra)
            else:
                sout = torch.empty_like(sin)
                _run(g, "all_to_all", x.shape, x.dtype,
                     lambda pg: dist.all_to_all_single(sout, sin, group=pg, async_op=True), extra,
                     seal=Seal("bytes", None, sout[:, nb:], expect))
                out = _unseal_bytes(sout, nb, inp.dtype, inp.shape)
        return _all_to_all_result(out, x, chunks, g, concat_axis, tiled)
    return _all_to_all_result(None, x, chunks, g, concat_axis, tiled)


def _all_to_all_result(out, x, chunks, g: Group, concat_axis, tiled):
    """The rows an all_to_all received (`out`, [src, *chunk] in group order, as bytes where `x`'s
    dtype does not move; None with one device: its own `chunks`) -> the result: `x`'s dtype, mesh
    order, the rows concatenated along `concat_axis`.  (traced.py's all_to_all ends here too.)"""
    if out is None:
        out = chunks.clone()
    else:
        if out.dtype != x.dtype:
            out = out.view(x.dtype).reshape(chunks.shape)
        if g.g2t is not None:
            out = out.index_select(0, torch.tensor(g.t2g, device=x.device))
    t = out.movedim(0, concat_axis)
    return t.flatten(concat_axis, concat_axis + 1) if tiled else t
