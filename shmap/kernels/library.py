"""Collectives written as kernels, with nothing but the public kernel API.

These follow the ring-of-neighbours style of TPU kernels (seed 002): data only
moves between ring neighbours, copies are asynchronous and overlapped with
compute, and every buffer that is written remotely is protected either by
having one slot per step or by double buffering plus a *capacity handshake*
(the receiver signals "that slot is free again" before the sender may
overwrite it).  Each kernel is checked by the interpreter (no race, no
leftover semaphore, no deadlock over explored schedules) and runs unchanged on
the shared-memory runtime.

Every collective has a kernel (`*_kernel`), and a function that takes the
per-device list of tensors and a runner (`run=interpret` by default, or a
`ShmGroup(...).run`, or `run_shm`), and returns the per-device results.
Parameters a kernel needs beyond its refs are bound with functools.partial, so
kernels stay picklable for the multi-process runtime.
"""
from __future__ import annotations

import functools

import torch

from .api import (
    device_id,
    local_copy,
    num_devices,
    program_id,
    remote_copy,
    semaphore_signal,
    semaphore_wait,
)
from .errors import KernelUsageError
from .interpreter import interpret
from .refs import Buffer, SemaphoreType, ds

DMA, REGULAR = SemaphoreType.DMA, SemaphoreType.REGULAR


def _blocks(xs) -> list[torch.Tensor]:
    xs = [x[0] if isinstance(x, (list, tuple)) else x for x in xs]
    if not xs:
        raise KernelUsageError("expected one tensor per device, got an empty list")
    return xs


def _copy(src, dst, sem) -> None:
    c = local_copy(src, dst, sem)
    c.start()
    c.wait()


# ---------------------------------------------------------------------------
# ppermute: every source pushes its block straight into its destination.


def ppermute_kernel(x_ref, o_ref, send_sem, recv_sem, *, perm):
    """o[dst] = x[src] for each (src, dst) in perm; devices nobody sends to get zeros."""
    me = device_id()
    dst = {s: d for s, d in perm}.get(me)
    src = {d: s for s, d in perm}.get(me)
    if dst is not None:
        send = remote_copy(x_ref, o_ref, send_sem, recv_sem, dst)
        send.start()
    if src is None:
        o_ref[...] = torch.zeros(o_ref.shape, dtype=o_ref.dtype)
    else:
        remote_copy(x_ref, o_ref, send_sem, recv_sem, me).wait_recv()
    if dst is not None:
        send.wait_send()


def _check_perm(perm, n):
    try:
        perm = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise KernelUsageError(
            f"ppermute: perm must be (source, destination) pairs of device indices, got {perm!r}. "
            "Fix: e.g. perm=[(0, 1), (1, 0)].") from None
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise KernelUsageError(f"ppermute: perm={perm} repeats a source or a destination")
    bad = [p for p in srcs + dsts if not 0 <= p < n]
    if bad:
        raise KernelUsageError(f"ppermute: perm={perm} names device {bad[0]} but there are {n}")
    return perm


def ppermute(xs, perm, *, run=interpret, **kw):
    """JAX's ppermute: returns per-device blocks, zeros where no one sends."""
    xs = _blocks(xs)
    perm = _check_perm(perm, len(xs))
    kernel = functools.partial(ppermute_kernel, perm=perm)
    return run(kernel, [[x] for x in xs], Buffer(xs[0].shape, xs[0].dtype),
               scratch=[DMA, DMA], **kw)


def right_permute(xs, *, shift=1, run=interpret, **kw):
    """Each device sends its block to device (i + shift) % n."""
    n = len(xs)
    return ppermute(xs, [(i, (i + shift) % n) for i in range(n)], run=run, **kw)


# ---------------------------------------------------------------------------
# Ring all-gather: one output slot per source, so slots never need a handshake;
# one receive semaphore per step, so a wait never consumes a later step's copy.


def all_gather_kernel(x_ref, o_ref, local_sem, send_sem, recv_sems):
    step, n, me = program_id(0), num_devices(), device_id()
    if step == 0:
        _copy(x_ref, o_ref.at[me], local_sem)
    if n == 1:
        return
    slot = (me - step) % n  # the block we got last step (our own at step 0)
    hop = remote_copy(o_ref.at[slot], o_ref.at[slot], send_sem, recv_sems.at[step], (me + 1) % n)
    hop.start()
    hop.wait()  # sent ours; received block (me - step - 1) from the left


def all_gather(xs, *, run=interpret, **kw):
    """Per device: torch.stack(xs) (shape [n, *block])."""
    xs = _blocks(xs)
    n = len(xs)
    return run(all_gather_kernel, [[x] for x in xs],
               Buffer((n,) + tuple(xs[0].shape), xs[0].dtype),
               scratch=[DMA, DMA, DMA((max(n - 1, 1),))], grid=(max(n - 1, 1),), **kw)


# ---------------------------------------------------------------------------
# All-reduce, unidirectional ring, double-buffered with a capacity handshake.
#
# Step s: buf[s % 2] holds x[me - s]; add it to the output while forwarding it
# into the right neighbour's *other* slot.  Before writing that slot again (two
# steps later) the sender waits for the receiver's "slot free" signal, which the
# receiver sends only after it has finished reading the slot and has received
# the copy that was in flight -- so at most one copy per receive semaphore is in
# flight and the receiver's wait always consumes the right one.


def all_reduce_kernel(x_ref, o_ref, buf, local_sem, send_sem, recv_sem, cap_sem):
    step, n, me = program_id(0), num_devices(), device_id()
    if n == 1:
        o_ref[...] = x_ref[...]
        return
    right, left = (me + 1) % n, (me - 1) % n
    slot = step % 2
    if step == 0:
        o_ref[...] = x_ref[...]
        _copy(x_ref, buf.at[0], local_sem)
    if step >= 1:
        semaphore_wait(cap_sem, 1)  # right has finished with the slot we are about to fill
    hop = remote_copy(buf.at[slot], buf.at[1 - slot], send_sem, recv_sem, right)
    hop.start()
    if step >= 1:
        o_ref[...] += buf[slot]  # overlaps with the copy (both only read buf[slot])
    hop.wait()
    if step <= n - 3:
        semaphore_signal(cap_sem, 1, device_id=left)  # buf[slot] is free for left's next copy
    if step == n - 2:
        o_ref[...] += buf[1 - slot]  # the last block arrived with the final copy


def all_reduce(xs, *, run=interpret, **kw):
    """Per device: the sum of all blocks."""
    xs = _blocks(xs)
    n, x = len(xs), xs[0]
    return run(all_reduce_kernel, [[x] for x in xs], Buffer(x.shape, x.dtype),
               scratch=[Buffer((2,) + tuple(x.shape), x.dtype), DMA, DMA, DMA, REGULAR],
               grid=(max(n - 1, 1),), **kw)


# ---------------------------------------------------------------------------
# Bidirectional reduce-scatter with a nested (chunked) accumulation pipeline.
#
# x[j] is this device's contribution to block j.  Rows [0, h) of every block
# travel left, rows [h, R) travel right, so both directions of every link carry
# data.  The partial sums (accumulators) travel, inputs stay put: at step s the
# left-moving accumulator held here is for block me+s+1, the right-moving one
# for block me-s-1; after n-1 hops each is back at its owner, complete.
#
# Accumulating `acc += x[b]` goes through a small double-buffered working
# buffer, `chunk` rows at a time (load chunk i+1 while adding chunk i, store
# asynchronously): the inner pipeline that lets blocks far larger than the
# working buffer be reduced (Pallas' emit_pipeline, written by hand).


def _accumulate(acc, x, work, load_sems, store_sems):
    """acc += x, through the working buffer work[2, chunk, ...]."""
    rows, chunk = acc.shape[0], work.shape[1]
    count = -(-rows // chunk)

    def piece(i):
        size = min(chunk, rows - i * chunk)
        return ds(i * chunk, size), ds(0, size)

    def load(i):
        rows_i, head = piece(i)
        return local_copy(acc.at[rows_i], work.at[i % 2, head], load_sems.at[i % 2])

    def store(i):
        rows_i, head = piece(i)
        return local_copy(work.at[i % 2, head], acc.at[rows_i], store_sems.at[i % 2])

    load(0).start()
    for i in range(count):
        if i >= 1:
            store(i - 1).wait()  # frees work[(i - 1) % 2] == work[(i + 1) % 2]
        if i + 1 < count:
            load(i + 1).start()  # prefetch while this chunk is being added
        load(i).wait()
        rows_i, head = piece(i)
        work[i % 2, head] += x[rows_i]
        store(i).start()
    store(count - 1).wait()


def reduce_scatter_kernel(x_ref, o_ref, acc_l, acc_r, work, init_sems, load_sems, store_sems,
                          send_l, recv_l, send_r, recv_r, cap_l, cap_r):
    step, n, me = program_id(0), num_devices(), device_id()
    right, left = (me + 1) % n, (me - 1) % n
    h = acc_l.shape[1]
    rows_l, rows_r = ds(0, h), ds(h, acc_r.shape[1])
    block_l, block_r = (me + step + 1) % n, (me - step - 1) % n
    slot = step % 2
    if step == 0:
        init_l = local_copy(x_ref.at[block_l, rows_l], acc_l.at[0], init_sems.at[0])
        init_r = local_copy(x_ref.at[block_r, rows_r], acc_r.at[0], init_sems.at[1])
        init_l.start()
        init_r.start()
        init_l.wait()
        init_r.wait()
    else:
        _accumulate(acc_l.at[slot], x_ref.at[block_l, rows_l], work, load_sems, store_sems)
    if step == n - 1:
        if step > 0:
            _accumulate(acc_r.at[slot], x_ref.at[block_r, rows_r], work, load_sems, store_sems)
        out_l = local_copy(acc_l.at[slot], o_ref.at[rows_l], init_sems.at[0])
        out_r = local_copy(acc_r.at[slot], o_ref.at[rows_r], init_sems.at[1])
        out_l.start()
        out_r.start()
        out_l.wait()
        out_r.wait()
        return
    if step >= 1:
        semaphore_wait(cap_l, 1)  # left has freed acc_l[1 - slot]
    hop_l = remote_copy(acc_l.at[slot], acc_l.at[1 - slot], send_l, recv_l, left)
    hop_l.start()
    if step > 0:  # add our share to the right-moving sum while the left copy flies
        _accumulate(acc_r.at[slot], x_ref.at[block_r, rows_r], work, load_sems, store_sems)
    if step >= 1:
        semaphore_wait(cap_r, 1)  # right has freed acc_r[1 - slot]
    hop_r = remote_copy(acc_r.at[slot], acc_r.at[1 - slot], send_r, recv_r, right)
    hop_r.start()
    hop_l.wait()
    hop_r.wait()
    if step <= n - 3:  # our slot is free for the neighbours' next copies
        semaphore_signal(cap_l, 1, device_id=right)
        semaphore_signal(cap_r, 1, device_id=left)


def reduce_scatter(xs, *, chunk_rows=None, run=interpret, **kw):
    """Per device d: sum over devices of x[d], for x of shape [n, R, ...] (R >= 2).

    `chunk_rows` is the working buffer's row count; blocks with more rows per
    half are accumulated through it in a pipelined loop.  Default: a whole half.
    """
    xs = _blocks(xs)
    n, x = len(xs), xs[0]
    if x.ndim < 2 or x.shape[0] != n or x.shape[1] < 2:
        raise KernelUsageError(
            f"reduce_scatter: each device's input must be [n={n}, R>=2, ...] (one block per "
            f"device, split in two halves by rows), got {tuple(x.shape)}")
    rows, rest = x.shape[1], tuple(x.shape[2:])
    h = rows // 2
    if chunk_rows is not None and int(chunk_rows) < 1:
        raise KernelUsageError(f"reduce_scatter: chunk_rows must be a positive row count, got {chunk_rows!r}. "
                               "Fix: chunk_rows >= 1, or None (a whole half).")
    chunk = max(1, min(int(chunk_rows or rows - h), rows - h))
    dt = x.dtype
    scratch = [Buffer((2, h) + rest, dt), Buffer((2, rows - h) + rest, dt),
               Buffer((2, chunk) + rest, dt), DMA((2,)), DMA((2,)), DMA((2,)),
               DMA, DMA, DMA, DMA, REGULAR, REGULAR]
    return run(reduce_scatter_kernel, [[x] for x in xs], Buffer((rows,) + rest, dt),
               scratch=scratch, grid=(n,), **kw)


# ---------------------------------------------------------------------------
# all_to_all: block j goes straight to device j (one slot per source).


def all_to_all_kernel(x_ref, o_ref, local_sem, send_sem, recv_sem):
    me, n = device_id(), num_devices()
    sends = []
    for k in range(1, n):
        peer = (me + k) % n
        c = remote_copy(x_ref.at[peer], o_ref.at[me], send_sem, recv_sem, peer)
        c.start()
        sends.append(c)
    _copy(x_ref.at[me], o_ref.at[me], local_sem)
    for k in range(1, n):
        src = (me - k) % n
        remote_copy(x_ref.at[me], o_ref.at[src], send_sem, recv_sem, me).wait_recv()
    for c in sends:
        c.wait_send()


def all_to_all(xs, *, run=interpret, **kw):
    """x of shape [n, ...] per device; device d gets [x_0[d], x_1[d], ...] stacked."""
    xs = _blocks(xs)
    n, x = len(xs), xs[0]
    if x.ndim < 1 or x.shape[0] != n:
        raise KernelUsageError(f"all_to_all: inputs must be [n={n}, ...], got {tuple(x.shape)}")
    return run(all_to_all_kernel, [[x] for x in xs], Buffer(x.shape, x.dtype),
               scratch=[DMA, DMA, DMA], **kw)


# ---------------------------------------------------------------------------
# Collective matmul (all-gather x, then x @ w), with the communication of each
# row block hidden behind the matmul of the previous one.


def allgather_matmul_kernel(x_ref, w_ref, o_ref, xbuf, local_sem, send_sem, recv_sem, cap_sem):
    step, n, me = program_id(0), num_devices(), device_id()
    right, left = (me + 1) % n, (me - 1) % n
    m = x_ref.shape[0]
    slot = step % 2
    if step == 0:
        _copy(x_ref, xbuf.at[0], local_sem)
    block = (me - step) % n
    last = step == n - 1
    if not last:
        if step >= 1:
            semaphore_wait(cap_sem, 1)
        hop = remote_copy(xbuf.at[slot], xbuf.at[1 - slot], send_sem, recv_sem, right)
        hop.start()
    o_ref[ds(block * m, m)] = xbuf[slot] @ w_ref[...]  # overlaps with the copy in flight
    if not last:
        hop.wait()
        if step <= n - 3:
            semaphore_signal(cap_sem, 1, device_id=left)


def allgather_matmul(xs, ws, *, run=interpret, **kw):
    """Per device d: torch.cat(xs) @ ws[d] (operands of two dtypes promoted first, as torch's matmul would not)."""
    xs, ws = _blocks(xs), _blocks(ws)
    n, x, w = len(xs), xs[0], ws[0]
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise KernelUsageError(
            f"allgather_matmul: need x [m, k] and w [k, n'], got {tuple(x.shape)} and "
            f"{tuple(w.shape)}")
    dt = torch.promote_types(x.dtype, w.dtype)
    if x.dtype != dt or w.dtype != dt:  # (the kernel's matmul takes one dtype; it failed on a device)
        xs, ws = [a.to(dt) for a in xs], [b.to(dt) for b in ws]
        x = xs[0]
    return run(allgather_matmul_kernel, [[a, b] for a, b in zip(xs, ws)],
               Buffer((n * x.shape[0], w.shape[1]), dt),
               scratch=[Buffer((2,) + tuple(x.shape), x.dtype), DMA, DMA, DMA, REGULAR],
               grid=(n,), **kw)


__all__ = [
    "ppermute", "right_permute", "all_gather", "all_reduce", "reduce_scatter", "all_to_all",
    "allgather_matmul",
    "ppermute_kernel", "all_gather_kernel", "all_reduce_kernel", "reduce_scatter_kernel",
    "all_to_all_kernel", "allgather_matmul_kernel",
]
