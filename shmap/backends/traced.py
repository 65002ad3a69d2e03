"""The distributed mesh's collectives under tracing (`torch.compile`, `make_fx`): ops in the graph.

Eagerly a collective is a c10d call under the guard (`transports._run`).  A
graph cannot contain that: AOT autograd traces the body on fake tensors, and
whatever a Python call does happens once, at trace time.  So while tracing
(`tracing()`: a fake, proxy or functional dispatch mode is active) each raw
collective of `transports` hands over to its twin here, which emits the
collective as an op between small ordered effectful shmap ops, each of which
also takes the previous one's output (`after`: a data dependency keeps them
in order where Inductor's reorderings do not honour the effect order).  The
compiled graph then performs, on every call, what the eager path does:

    shmap.coll_begin(like, after, spec)   count the collective (the guard's
                                          counter, black box); strict mode:
                                          exchange and check a signature now,
                                          before any data moves; default mode:
                                          return the signature trailer, or, for
                                          a payload with no room for one, launch
                                          its exchange to run alongside the data
    the collective                        the data, with the trailer folded in as
                                          eagerly (same layout, same wire dtype),
                                          waited for (watched: failed or exited
                                          ranks, the timeout) and checked (the
                                          trailers received, or the exchange
                                          alongside, against the one sent)

The collective is one of two forms.  On gloo, all_reduce and all_gather are
shmap's own effectful ops (`shmap.gloo_all_reduce`, `shmap.gloo_all_gather`):
each builds the payload, launches it and waits for it in slices on the
calling thread, exactly as an eager collective does, and returns it complete.
The others (reduce_scatter and all_to_all on gloo, whose waits ignore a
timeout, and everything on NCCL) are torch's functional collectives
(`torch.ops._c10d_functional.*`, with fake kernels and Inductor lowerings),
followed by

    shmap.coll_wait(out, sent, spec)      the watched wait (a helper thread waits
                                          on the work, since `wait_tensor` takes
                                          no timeout; this one polls the store
                                          and the clock) and the same checks
    _c10d_functional.wait_tensor          (already complete: a no-op)

The helper's two thread switches are why all_reduce and all_gather avoid it:
on 2 gloo processes they cost a jitted data-parallel step about a tenth of
DDP's step time (MLP 512-512-1, `bench/bench_distributed.py`).

`shmap.coll_record` (as `ops.record` does) reports each event to `comm_log`
where the eager path does; `shmap.body_end` counts the end of each body (or,
strict, exchanges its signature) at run time.  Results equal eager bit for bit: the
same wire dtypes (`transports._reduce_dtype`), the same buffers, the same
rank-order permutations.

The ops, and what each does when the graph runs: `graph_ops.py`.  Where
this differs from eager: `shmap/compile.py`'s docstring.
"""
from __future__ import annotations

import math

import torch

from ..recording import event
from .graph_ops import _c10d, _get, _spec
from .groups import Group
from .signatures import sealable

_MODES = tuple(torch._C._TorchDispatchModeKey.__members__.values())


def tracing() -> bool:
    """Whether a graph is being captured (fake, proxy or functional tensors): collectives must be ops."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    get = torch._C._get_dispatch_mode
    return any(get(k) is not None for k in _MODES)


# Ordered effects alone do not keep these ops in order under Inductor (torch 2.13: its locality and
# peak-memory reorderings moved a collective's `coll_begin` before the previous one's `coll_wait`), so
# each op also takes the previous one's output as an input (`after`; `coll_wait` takes `coll_begin`'s):
# a data dependency every pass keeps.  `_CHAIN` is that last output, for the graph being captured (the
# dispatch modes of its capture: a new capture starts a new chain).
_CHAIN: list = [None, None]


def _modes():
    get = torch._C._get_dispatch_mode
    return tuple(get(k) for k in _MODES)


def _after(like):
    """The output of the last guard op of this capture (an empty tensor if it has none yet)."""
    modes, last = _CHAIN
    if modes is not None and all(a is b for a, b in zip(modes, _modes())):
        return last
    return like.new_empty(0, dtype=torch.uint8)


def _chained(out):
    _CHAIN[0], _CHAIN[1] = _modes(), out
    return out


def _begin(like, spec):
    return _chained(torch.ops.shmap.coll_begin(like, _after(like), spec))


def _depend(x, on):
    """`x`, computed so that the graph sees it depend on `on` (possibly empty): x + (-0.0 * ...), exact.

    A dependency through an empty tensor (`torch.cat([x, on])` with `on` empty) is simplified away
    before AOT autograd partitions the joint graph, and then a collective that should wait for its
    `coll_begin` (or a result that should wait for its collective) floats free: the partitioner
    moved a backward collective whose data did not depend on the tangents into the forward graph,
    on the ranks where that was so only (a partial permutation makes ranks' graphs differ), and the
    ranks met different collectives (a gloo abort; found with checks off, where the trailer is
    empty).  Adding `on`'s sum negated, -0.0 for a float (0 for an integer), leaves every bit of
    `x` as it is, a -0.0 included (a bool `x`: or-ed with `on.any()`, False).

    An empty `on` is first replaced by `shmap.token(on)`, a zero made after it that Inductor cannot
    see through: the sum of an empty tensor is a constant it folds, and then it launched a
    reduce_scatter before its own `coll_begin` and before the psums that came first (checks off: the
    same order on every jitted rank, so unnoticed, but not a rank running eagerly's, whose gloo
    aborted at the mismatched messages)."""
    if on.numel() == 0:
        on = torch.ops.shmap.token(on)
    if x.dtype == torch.bool:
        return x | on.any()
    return x + on.sum().to(x.dtype).neg()


def _moved(launch, buf, sent, spec):
    """Launch a functional collective on `buf`; the watched wait and check; its (complete) output."""
    if sent.numel() == 0:  # no trailer: the payload must still come after `coll_begin` (see `_depend`)
        buf = _depend(buf, sent)
    out = launch(buf)
    _chained(torch.ops.shmap.coll_wait(out, sent, spec))
    return _c10d().wait_tensor(out)


def untraced():
    """A context in which no dispatch mode is active: building a group or a process group while tracing
    runs on real tensors, once."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _name(g: Group) -> str:
    """The group's name for the functional ops (its process group made outside the trace if new)."""
    if g._pg is None:
        with untraced():
            g.pg()
    return g._pg.group_name


def _sealing(g: Group) -> bool:
    return g._backend.watch.sealing() and g.gloo


def _bytes(t, rows=None):
    """`t` (contiguous) as flat uint8, or as [rows, bytes]."""
    b = t.reshape(-1)
    b = b if b.dtype == torch.uint8 else b.view(torch.uint8)
    return b if rows is None else b.view(rows, -1)


# --------------------------------------------------------------------------
# The collectives (each the twin of one in `transports`)
# --------------------------------------------------------------------------
def record(kind, axes, shape, dtype):
    """comm_log's report of a collective, as the op `shmap.coll_record` (as `ops.record` under tracing)."""
    e = event(kind, axes, shape, dtype)
    spec = repr((e.kind, e.axes, e.bytes, e.shape, e.dtype))
    _chained(torch.ops.shmap.coll_record(_after(torch.empty(0, dtype=torch.uint8)), spec))


def body_end(shape, dtype, extra, like):
    """The end of a body (`Distributed.assemble`): counted, or exchanged (strict), at run time."""
    kind = "end of shard_map body"
    s = repr((kind, (), tuple(int(d) for d in shape), str(dtype).replace("torch.", ""), extra, (), None,
              "float32", 0, True))
    _get(s)
    _chained(torch.ops.shmap.body_end(_after(like), s))


def all_reduce(x, g: Group, kind):
    """`x`: a tensor, or a list of 1-D tensors of one dtype (a bucket: their concatenation reduced; the
    parts are copied once, into the payload, as eagerly)."""
    from .transports import _reduce_dtype, gathered_reduce, reduce_rows

    parts = x if isinstance(x, list) else [x.reshape(-1)]
    head, shape = parts[0], (sum(p.numel() for p in parts),) if isinstance(x, list) else x.shape
    if g.n == 1 or gathered_reduce(g, math.prod(shape) * head.element_size()):
        if not isinstance(x, list):
            whole = x.clone(memory_format=torch.contiguous_format) if g.n == 1 else x
        else:
            whole = torch.cat(parts)  # (a fresh tensor already)
        # one position: the value itself; small: gathered and reduced here, as eagerly
        return whole if g.n == 1 else reduce_rows(gather_rows(whole, g, kind), kind)
    name = _name(g)
    wire = _reduce_dtype(head, kind) or head.dtype
    seal = "reduce" if _sealing(g) and sealable(wire, g.n) and not wire.is_complex else None
    spec = _spec(g, kind, shape, head.dtype, "", seal, wire)
    m = math.prod(shape)
    t = _begin(head, spec)
    parts = [*(p.to(wire) for p in parts), t]  # the payload: the parts, then the signature trailer
    op = "sum" if kind == "psum" else "max" if kind == "pmax" else "min"
    if g.gloo:  # shmap's op: launched, waited for on this thread and checked (see `_all_reduce_impl`)
        out = _chained(torch.ops.shmap.gloo_all_reduce(parts, op, name, spec))
    else:  # a functional collective (on NCCL, Inductor schedules around it)
        buf = torch.cat(parts)  # a fresh copy
        reduce = lambda b: _c10d().all_reduce(b, op, name)  # noqa: E731
        if wire.is_complex:
            out = torch.view_as_complex(_moved(reduce, torch.view_as_real(buf), t, spec))
        else:
            out = _moved(reduce, buf, t, spec)
    out = out[:m].view(shape)
    return out if wire == head.dtype else out.to(head.dtype)


def launch_all_reduce(x, g: Group, kind):
    """`transports._launch_all_reduce` under tracing: complete at once (a list: a bucket)."""
    out = all_reduce(x, g, kind)
    return None, lambda: out


def gather_rows(x, g: Group, kind, extra="", bucket=False):
    """[n, *x.shape]: every position's block, in the tuple's order.  A `bucket` (its parts concatenated,
    `transports._launch_gather_rows`) carries its signature at any size, as eagerly."""
    from .sealed import _SEAL_BYTES_LIMIT, _unsealed_rows
    from .transports import _MOVABLE, _as_bytes

    x = x.contiguous()
    if g.n == 1:
        return x.unsqueeze(0).clone()
    name = _name(g)
    flat = x.reshape(-1) if x.dtype in _MOVABLE and not x.is_complex() else _as_bytes(x)
    sealed = _sealing(g) and (bucket or flat.numel() * flat.element_size() * g.n <= _SEAL_BYTES_LIMIT)

    def gather(parts, spec):  # [n, payload]: every rank's `parts` concatenated (the last: the trailer sent)
        if g.gloo:  # shmap's op: launched, waited for on this thread and checked (`_all_gather_impl`)
            return _chained(torch.ops.shmap.gloo_all_gather(parts, g.n, name, spec))
        return _moved(lambda b: _c10d().all_gather_into_tensor(b, g.n, name), torch.cat(parts).view(1, -1),
                      parts[-1], spec)  # a functional collective

    if sealed:
        b = _bytes(flat)
        nb = b.numel()
        spec = _spec(g, kind, x.shape, x.dtype, extra, "bytes", torch.uint8, nb + 8)
        t = _begin(flat, spec)
        got = gather([b, t], spec)  # [n, nb + 8]
        out = _unsealed_rows(got, nb, flat.dtype, g.n)  # (a view of the rows, as eagerly, where strides allow)
    else:
        spec = _spec(g, kind, x.shape, x.dtype, extra, None, flat.dtype)
        t = _begin(flat, spec)
        out = gather([flat, t], spec)
    if out.dtype != x.dtype:  # (bytes of a dtype the wire lacks)
        out = out.contiguous().view(x.dtype)
    if g.g2t is not None:
        out = out.index_select(0, torch.tensor(g.t2g, device=out.device))
    return out.reshape(g.n, *x.shape)


def launch_psum_scatter(x, g: Group, dim, tiled, bucket=False):
    """`transports._launch_psum_scatter` under tracing: complete at once (a `bucket` carries its
    signature at any size, as eagerly)."""
    from .sealed import _SEAL_BYTES_LIMIT
    from .transports import _chunks, _reduce_dtype

    chunks = _chunks(x, g.n, dim, tiled)
    if g.n == 1:
        out = chunks[0].clone()
        return None, lambda: out
    name = _name(g)
    if g.g2t is not None:  # row r of the input goes to group rank r
        chunks = chunks.index_select(0, torch.tensor(g.g2t, device=x.device))
    wire = _reduce_dtype(x, "psum_scatter")
    if wire is not None:
        chunks = chunks.to(wire)
    n = g.n
    inp = chunks.reshape(n, -1)
    m = inp.shape[1]
    big = not bucket and inp.numel() * inp.element_size() > _SEAL_BYTES_LIMIT
    seal = "reduce" if not big and _sealing(g) and sealable(inp.dtype, n) and not inp.is_complex() else None
    spec = _spec(g, "psum_scatter", x.shape, x.dtype, f"scatter_dimension={dim}, tiled={tiled}", seal, inp.dtype)
    t = _begin(inp, spec)
    rows = torch.cat([inp, t.expand(n, t.numel())], dim=1).reshape(-1)  # each row carries the trailer
    scatter = lambda b: _c10d().reduce_scatter_tensor(b, "sum", n, name)  # noqa: E731
    if inp.is_complex():
        out = torch.view_as_complex(_moved(scatter, torch.view_as_real(rows), t, spec))
    else:
        out = _moved(scatter, rows, t, spec)
    out = out[:m].view(chunks.shape[1:]).to(x.dtype)
    return None, lambda: out


def ppermute(x, g: Group, perm):
    """One all_to_all_single whose splits are the permutation (eagerly: point-to-point sends)."""
    from .sealed import _SEAL_BYTES_LIMIT
    from .transports import _MOVABLE, _as_bytes

    me = g.index
    send = [d for s, d in perm if s == me and d != me]
    recv = [s for s, d in perm if d == me and s != me]
    own = (me, me) in perm
    if g.n == 1:
        return x.clone() if own else torch.zeros_like(x)
    if x.dtype not in _MOVABLE or x.is_complex():
        return ppermute(_as_bytes(x), g, perm).view(x.dtype).reshape(x.shape)
    x = x.contiguous()
    name = _name(g)
    extra = f"perm={list(perm)}"
    sealed = _sealing(g) and x.numel() * x.element_size() * g.n <= _SEAL_BYTES_LIMIT
    flat = _bytes(x) if sealed else x.reshape(-1)
    length = flat.numel() + (8 if sealed else 0)
    spec = _spec(g, "ppermute", x.shape, x.dtype, extra, "bytes" if sealed else None,
                 torch.uint8 if sealed else x.dtype, length)
    t = _begin(flat, spec)
    payload = torch.cat([flat, t])
    rank = g.torch_ranks
    ins, outs = [0] * g.n, [0] * g.n
    for d in send:
        ins[rank([d])[0]] = length
    for s in recv:
        outs[rank([s])[0]] = length
    if any(s != d for s, d in perm):
        got = _moved(lambda b: _c10d().all_to_all_single(b, outs, ins, name), payload if send else payload[:0],
                     t, spec)
    else:  # nothing moves anywhere: still counted and closed, as eagerly
        got = payload[:0]
        _chained(torch.ops.shmap.coll_wait(got, t, spec))
    if recv:
        data = got[:flat.numel()]
        return (data.view(x.dtype) if sealed else data).view(x.shape)
    # A device with no source gets zeros (its own block, if it keeps it), made from the collective's
    # (empty) output: a graph that did not consume it would let what follows on this rank float free
    # of the collective, and AOT autograd's partitioner then moved a backward collective fed by these
    # zeros into the forward graph on this rank only (ranks' graphs differ where a permutation is
    # partial), so the ranks met different collectives (a gloo abort; found with checks off).
    keep = x.reshape(-1) if own else torch.zeros_like(x).reshape(-1)
    return _depend(keep, got).view(x.shape)


def all_to_all(x, g: Group, split_axis, concat_axis, tiled):
    from .sealed import _SEAL_BYTES_LIMIT
    from .transports import _MOVABLE, _all_to_all_result, _as_bytes, _chunks

    chunks = _chunks(x, g.n, split_axis, tiled)  # [dst, *chunk]
    if g.n > 1:
        name = _name(g)
        n = g.n
        if g.g2t is not None:
            chunks = chunks.index_select(0, torch.tensor(g.g2t, device=x.device))
        inp = chunks.contiguous()
        if inp.dtype not in _MOVABLE or inp.is_complex():
            inp = _as_bytes(inp).view(n, -1)
        extra = f"split_axis={split_axis}, concat_axis={concat_axis}, tiled={tiled}"
        sealed = _sealing(g) and inp.numel() * inp.element_size() * n <= _SEAL_BYTES_LIMIT
        ones = [1] * n
        exchange = lambda b: _c10d().all_to_all_single(b, ones, ones, name)  # noqa: E731
        if sealed:
            b = _bytes(inp, n)
            nb = b.shape[1]
            spec = _spec(g, "all_to_all", x.shape, x.dtype, extra, "bytes", torch.uint8, nb + 8)
            t = _begin(b, spec)
            got = _moved(exchange, torch.cat([b, t.expand(n, 8)], dim=1), t, spec)
            out = got[:, :nb].contiguous().view(inp.dtype).view(inp.shape)
        else:
            spec = _spec(g, "all_to_all", x.shape, x.dtype, extra, None, inp.dtype)
            t = _begin(inp, spec)
            out = _moved(exchange, torch.cat([inp.reshape(-1), t]).view(inp.shape), t, spec)
        return _all_to_all_result(out, x, chunks, g, concat_axis, tiled)
    return _all_to_all_result(None, x, chunks, g, concat_axis, tiled)
