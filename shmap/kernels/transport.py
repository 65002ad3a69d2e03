"""Collectives between processes on one host, as kernels on the shared-memory runtime.

`ShmTransport` is the per-rank object a torch.distributed-style backend would
hold: each rank process creates one with the same group name (or from an
existing process group with `from_process_group`), and then calls
`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `ppermute` and
`barrier` in SPMD fashion.

The kernels here are *direct* rather than rings: on shared memory every rank
is one `copy_` away from every other, so pushing each piece straight to its
destination needs one or two synchronisation rounds instead of 2(n-1), and
moves the same number of bytes.  They use only the public kernel API, so the
interpreter verifies them like the ring kernels of library.py (tests run
both).  Sums are taken in rank order, by one rank per piece, so every rank
gets bitwise identical results.

Memory traffic is what limits these on a CPU, so:
- outputs are *local* buffers (`Buffer(..., local=True)`): a copy's
  destination must be in shared memory, its source need not, so results are
  computed straight into the caller's tensor and only peers' pieces go through
  shared memory (no final copy out of it);
- reductions read the shared inbox through `borrow` (no `ref[...]` copies);
- small all-reduces (all of them on two ranks) use a one-shot kernel (one
  round of synchronisation), larger ones reduce-scatter + all-gather (fewer
  bytes per rank when there are more than two ranks).

Tensors larger than the group's arena are processed in chunks.
"""
from __future__ import annotations

import functools
import socket

import torch

from .api import borrow, device_id, local_copy, num_devices, remote_copy
from .errors import KernelUsageError
from .interpreter import interpret
from .library import _check_perm, all_to_all_kernel, ppermute_kernel
from .refs import Buffer, SemaphoreType
from .segments import new_group_name
from .shm import ShmComm

DMA = SemaphoreType.DMA


# ---------------------------------------------------------------------------
# Building blocks.


def _push_to_all(src_of, dst_of, send_sem, recv_sem):
    """Start copy src_of(peer) -> peer's dst_of(me) for every peer; then wait until every
    peer's copy into our dst_of(peer) has arrived.  Returns the started copies."""
    me, n = device_id(), num_devices()
    sends = []
    for k in range(1, n):
        peer = (me + k) % n
        c = remote_copy(src_of(peer), dst_of(me), send_sem, recv_sem, peer)
        c.start()
        sends.append(c)
    for k in range(1, n):
        src = (me - k) % n
        remote_copy(src_of(me), dst_of(src), send_sem, recv_sem, me).wait_recv()
    return sends


def _sum_in_rank_order(mine_ref, inbox, out_ref):
    """out = sum over ranks s of (mine if s == me else inbox[s]), in rank order."""
    me, n = device_id(), num_devices()
    with borrow(inbox) as parts, borrow(mine_ref) as mine, borrow(out_ref, write=True) as out:
        out.copy_(mine if me == 0 else parts[0])
        for s in range(1, n):
            out.add_(mine if s == me else parts[s])


def _collect(gathered, o_ref, sem):
    """o[src] = gathered[src] for every peer src (local copies)."""
    me, n = device_id(), num_devices()
    copies = [local_copy(gathered.at[(me - k) % n], o_ref.at[(me - k) % n], sem)
              for k in range(1, n)]
    for c in copies:
        c.start()
    for c in copies:
        c.wait()


# ---------------------------------------------------------------------------
# Kernels.


def direct_all_reduce_kernel(x_ref, o_ref, inbox, gathered, local_sem, send_a, recv_a, send_b,
                             recv_b):
    """x: [n, c]; o (local): [n, c].  Piece j of every x goes to rank j, which sums it
    straight into its o[j] and pushes that to every peer's `gathered[j]`."""
    me = device_id()
    sends = _push_to_all(lambda p: x_ref.at[p], lambda p: inbox.at[p], send_a, recv_a)
    _sum_in_rank_order(x_ref.at[me], inbox, o_ref.at[me])
    sends += _push_to_all(lambda p: o_ref.at[me], lambda p: gathered.at[p], send_b, recv_b)
    _collect(gathered, o_ref, local_sem)
    for c in sends:
        c.wait_send()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges intersect."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def one_shot_all_reduce_kernel(x_ref, o_ref, inbox, send_sem, recv_sem):
    """x, o (local): [L].  Everyone pushes all of x to everyone and sums locally: one round
    of synchronisation instead of two, for small tensors where latency dominates."""
    sends = _push_to_all(lambda p: x_ref, lambda p: inbox.at[p], send_sem, recv_sem)
    _sum_in_rank_order(x_ref, inbox, o_ref)
    for c in sends:
        c.wait_send()


def direct_reduce_scatter_kernel(x_ref, o_ref, inbox, send_sem, recv_sem):
    """x: [n, c] -> o (local): [c], the sum over ranks of their x[me]."""
    sends = _push_to_all(lambda p: x_ref.at[p], lambda p: inbox.at[p], send_sem, recv_sem)
    _sum_in_rank_order(x_ref.at[device_id()], inbox, o_ref)
    for c in sends:
        c.wait_send()


def direct_all_gather_kernel(x_ref, o_ref, gathered, local_sem, send_sem, recv_sem):
    """x: [c] -> o (local): [n, c]."""
    own = local_copy(x_ref, o_ref.at[device_id()], local_sem)
    own.start()
    sends = _push_to_all(lambda p: x_ref, lambda p: gathered.at[p], send_sem, recv_sem)
    own.wait()
    _collect(gathered, o_ref, local_sem)
    for c in sends:
        c.wait_send()


@functools.lru_cache(maxsize=256)
def _specs(op: str, n: int, c: int, dtype: torch.dtype):
    """(out_shape, scratch) of each kernel for n ranks and pieces of c elements."""
    if op == "all_reduce":
        return (Buffer((n, c), dtype, local=True),
                (Buffer((n, c), dtype), Buffer((n, c), dtype), DMA, DMA, DMA, DMA, DMA))
    if op == "one_shot":
        return Buffer((c,), dtype, local=True), (Buffer((n, c), dtype), DMA, DMA)
    if op == "reduce_scatter":
        return Buffer((c,), dtype, local=True), (Buffer((n, c), dtype), DMA, DMA)
    if op == "all_gather":
        return Buffer((n, c), dtype, local=True), (Buffer((n, c), dtype), DMA, DMA, DMA)
    raise ValueError(op)


# ---------------------------------------------------------------------------
# Per-device-list front ends (any runner), used by tests.


def _call(run, kernel, op, inputs, c, dtype, kw):
    out_shape, scratch = _specs(op, len(inputs), c, dtype)
    return run(kernel, inputs, out_shape, scratch=scratch, **kw)


def _pieces(x: torch.Tensor, n: int) -> torch.Tensor:
    """Flatten and zero-pad to [n, c]."""
    flat = x.reshape(-1)
    c = -(-flat.numel() // n)
    if c * n != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(c * n - flat.numel())])
    return flat.view(n, c)


def all_reduce(xs, *, run=interpret, **kw):
    """Per device: the elementwise sum of all devices' tensors (reduce-scatter + all-gather)."""
    n, x = len(xs), xs[0]
    parts = [_pieces(t, n) for t in xs]
    outs = _call(run, direct_all_reduce_kernel, "all_reduce", [[p] for p in parts],
                 parts[0].shape[1], x.dtype, kw)
    return [o.reshape(-1)[:x.numel()].view(x.shape) for o in outs]


def one_shot_all_reduce(xs, *, run=interpret, **kw):
    """Per device: the elementwise sum, by the one-shot kernel."""
    x = xs[0]
    flat = [t.reshape(-1) for t in xs]
    outs = _call(run, one_shot_all_reduce_kernel, "one_shot", [[f] for f in flat], x.numel(),
                 x.dtype, kw)
    return [o.view(x.shape) for o in outs]


def reduce_scatter(xs, *, run=interpret, **kw):
    """x of shape [n, ...] per device; device d gets sum over devices of x[d]."""
    n, x = len(xs), xs[0]
    if x.ndim < 1 or x.shape[0] != n:
        raise KernelUsageError(f"reduce_scatter: inputs must be [n={n}, ...], got {tuple(x.shape)}")
    parts = [t.reshape(n, -1) for t in xs]
    outs = _call(run, direct_reduce_scatter_kernel, "reduce_scatter", [[p] for p in parts],
                 parts[0].shape[1], x.dtype, kw)
    return [o.view(x.shape[1:]) for o in outs]


def all_gather(xs, *, run=interpret, **kw):
    """Per device: torch.stack(xs)."""
    n, x = len(xs), xs[0]
    flat = [t.reshape(-1) for t in xs]
    outs = _call(run, direct_all_gather_kernel, "all_gather", [[f] for f in flat], x.numel(),
                 x.dtype, kw)
    return [o.view((n,) + tuple(x.shape)) for o in outs]


# ---------------------------------------------------------------------------
# The per-rank transport.


class ShmTransport:
    """This process's handle on a shared-memory group of `world_size` ranks.

    Every rank must call the same collectives in the same order with tensors
    of the same shape and dtype (as with torch.distributed).  Results are new
    tensors; `all_reduce(x, out=x)` updates in place.
    """

    def __init__(self, name: str, rank: int, world_size: int, *, capacity: int = 64 << 20,
                 timeout: float = 60.0, one_shot_bytes: int | None = None):
        self.rank, self.world_size = rank, world_size
        self.comm = ShmComm.connect(name, rank, world_size, capacity=capacity, timeout=timeout)
        self.capacity = self.comm.seg.capacity // 2  # parity kernels use half the arena each
        if one_shot_bytes is None:
            # all_reduce up to this size uses the one-shot kernel.  With two ranks it also moves
            # fewer bytes (S per rank, against 1.5 S), so it wins at any size; with more ranks
            # it moves (n-1) S and only pays off while latency dominates (measured: ~1 MiB).
            one_shot_bytes = 1 << 62 if world_size <= 2 else 512 << 10
        self.one_shot_bytes = one_shot_bytes

    @classmethod
    def from_process_group(cls, group=None, **kw) -> "ShmTransport":
        """Build from an initialised torch.distributed group whose ranks share this host."""
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) != 1:
            raise KernelUsageError(
                f"ShmTransport needs every rank on one host; the group spans {sorted(set(hosts))}")
        box = [new_group_name() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)
        return cls(box[0], rank, world, **kw)

    def _run(self, kernel, x, specs, out, sync="parity"):
        # Every kernel but ppermute makes each rank wait for every other rank, so it can skip
        # the entry barrier (see ShmComm.run).
        out_shape, scratch = specs
        return self.comm.run(kernel, [x], out_shape, scratch=scratch, outputs="view", sync=sync,
                             out=[out])

    def _step(self, bytes_per_elem: int, multiple: int = 1) -> int:
        """Elements per chunk so that a kernel's shared buffers fit half the arena."""
        room = self.capacity - 8 * 64
        c = max(room // bytes_per_elem, 1)
        return max(c // multiple * multiple, multiple)

    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elementwise sum over ranks, into `out` if given (may be x itself)."""
        n, es = self.world_size, x.element_size()
        flat = x.reshape(-1)
        # Writing straight into `out` is only safe when it is not the input: peers read
        # this rank's input while results land.
        direct = out is not None and out.is_contiguous() and not _overlaps(out, x)
        result = out.view(-1) if direct else torch.empty_like(flat)
        numel = flat.numel()
        if numel * es <= self.one_shot_bytes and n * numel * es <= self.capacity - 8 * 64:
            self._run(one_shot_all_reduce_kernel, flat, _specs("one_shot", n, numel, x.dtype),
                      result)
        else:
            step = self._step(2 * es, n)  # inbox + gathered, one chunk each
            for a in range(0, numel, step):
                piece = flat[a:a + step]
                k = piece.numel()
                parts = _pieces(piece, n)
                target = result[a:a + k].view(parts.shape) if k == parts.numel() else None
                o = self._run(direct_all_reduce_kernel, parts,
                              _specs("all_reduce", n, parts.shape[1], x.dtype), target)
                if target is None:
                    result[a:a + k] = o.view(-1)[:k]
        if out is None:
            return result.view(x.shape)
        if not direct:
            out.copy_(result.view(out.shape))
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, *x.shape]: every rank's x, stacked in rank order."""
        n = self.world_size
        flat = x.reshape(-1)
        result = torch.empty((n, flat.numel()), dtype=x.dtype)
        step = self._step(n * x.element_size())
        for a in range(0, flat.numel(), step):
            piece = flat[a:a + step]
            self._run(direct_all_gather_kernel, piece,
                      _specs("all_gather", n, piece.numel(), x.dtype), result[:, a:a + step])
        return result.view((n,) + tuple(x.shape))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, ...] -> the sum over ranks of x[rank]."""
        n = self.world_size
        if x.ndim < 1 or x.shape[0] != n:
            raise KernelUsageError(f"reduce_scatter: x must be [n={n}, ...], got {tuple(x.shape)}")
        parts = x.reshape(n, -1)
        m = parts.shape[1]
        result = torch.empty(m, dtype=x.dtype)
        step = self._step(n * x.element_size())
        for a in range(0, m, step):
            piece = parts[:, a:a + step]
            self._run(direct_reduce_scatter_kernel, piece,
                      _specs("reduce_scatter", n, piece.shape[1], x.dtype), result[a:a + step])
        return result.view(x.shape[1:])

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, ...]; returns y with y[j] = rank j's x[rank]."""
        n = self.world_size
        if x.ndim < 1 or x.shape[0] != n:
            raise KernelUsageError(f"all_to_all: x must be [n={n}, ...], got {tuple(x.shape)}")
        parts = x.reshape(n, -1)
        m = parts.shape[1]
        result = torch.empty((n, m), dtype=x.dtype)
        step = self._step(n * x.element_size())
        for a in range(0, m, step):
            piece = parts[:, a:a + step]
            o = self._run(all_to_all_kernel, piece,
                          (Buffer(piece.shape, x.dtype), (DMA, DMA, DMA)), None)
            result[:, a:a + piece.shape[1]] = o
        return result.view(x.shape)

    def ppermute(self, x: torch.Tensor, perm) -> torch.Tensor:
        """JAX's ppermute: x goes from src to dst for each (src, dst); zeros where none."""
        perm = _check_perm(perm, self.world_size)
        kernel = functools.partial(ppermute_kernel, perm=perm)
        flat = x.reshape(-1)
        result = torch.empty_like(flat)
        step = self._step(x.element_size())
        for a in range(0, flat.numel(), step):
            piece = flat[a:a + step]
            # A permutation does not make every rank wait for every other: keep the barrier.
            result[a:a + piece.numel()] = self._run(
                kernel, piece, (Buffer(piece.shape, x.dtype), (DMA, DMA)), None, sync="barrier")
        return result.view(x.shape)

    @property
    def watcher(self):
        """Called between the sleeps of a wait that did not complete at once; may raise to end it
        (`ShmComm.watcher`: shmap's guard watches the store for failed and exited peers there)."""
        return self.comm.watcher

    @watcher.setter
    def watcher(self, fn):
        self.comm.watcher = fn

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.comm.close()


__all__ = ["ShmTransport", "all_reduce", "one_shot_all_reduce", "all_gather", "reduce_scatter",
           "direct_all_reduce_kernel", "one_shot_all_reduce_kernel",
           "direct_all_gather_kernel", "direct_reduce_scatter_kernel"]


def _register():
    """Plug this transport into the distributed mesh: `configure_distributed(transport='shm')`.  Its waits
    take the mesh's collective timeout (`configure_distributed(timeout=...)`, `SHMAP_COLLECTIVE_TIMEOUT`)
    when one is set, as gloo's watched waits do, else the transport's own 60 s."""
    from ..backends.config import _OPTIONS, register_transport

    def for_mesh(group):
        timeout = _OPTIONS["timeout"]
        return ShmTransport.from_process_group(group, **({"timeout": timeout} if timeout else {}))

    register_transport("shm", for_mesh)


_register()
