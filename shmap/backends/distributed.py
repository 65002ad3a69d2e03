"""Distributed mesh: one process per device, collectives on torch.distributed.

A body value's physical tensor is this rank's block (`_paxes == ()`); its
device variance is metadata only, checked by the same rules as on the
simulated mesh.  Each collective is a `torch.autograd.Function` whose backward
*calls the transpose collective* (itself a Function, so higher derivatives
transpose again), and records the same `comm.CommEvent`s the simulated
backend records, so `comm_log` reads the same on both:

    psum          <-> pvary (the automatic lift too): all_reduce / nothing
    all_gather    <-> psum_scatter: all_gather / reduce_scatter
    all_gather_invariant <-> own-block slice (no communication)
    ppermute      <-> ppermute with the inverse permutation
    all_to_all    <-> all_to_all with split and concat swapped

Axis tuples are linearised major-to-minor in the tuple's order; a process
group over several mesh axes orders its ranks in mesh order, so results are
permuted between the two where they differ.  Every wait is watched
(`watchdog`): a failing or diverging rank is reported instead of hung on.

At the boundary, `split` takes this rank's block of a global value (a DTensor
whose layout matches the in_spec is used in place; a plain tensor is a global
value every rank holds) and `assemble` returns a `DTensor` whose placements
follow the out_spec (`Partial` along the axes of a pending sum).
"""
from __future__ import annotations

import itertools
import math

import torch

from .. import comm
from ..errors import SpecError
from ..tensor import event, mesh_order
from . import watchdog


_DIST = None


def _dist():
    """torch.distributed, imported on first use (a simulated mesh never needs it)."""
    global _DIST
    if _DIST is None:
        import torch.distributed

        _DIST = torch.distributed
    return _DIST


# --------------------------------------------------------------------------
# Process groups over axis tuples
# --------------------------------------------------------------------------
class Group:
    """The devices that differ from this one only along `axes` (in the given order).

    `index` is this device's position along `axes` (major-to-minor in the
    tuple's order); `ranks[t]` the global rank at position `t`; `g2t` maps the
    process group's own rank order (mesh order) to positions, or is None when
    the two agree.
    """

    __slots__ = ("axes", "n", "index", "ranks", "g2t", "t2g", "_backend", "_pg", "gloo", "_shm")

    def __init__(self, axes, n, index, ranks, g2t, backend):
        self.axes, self.n, self.index, self.ranks, self._backend = axes, n, index, ranks, backend
        self.g2t = g2t
        self.t2g = None if g2t is None else [g2t.index(t) for t in range(n)]
        self._pg = None
        self.gloo = True
        self._shm = None

    def pg(self):
        """The process group, created on first use.

        Creating one is collective over the world, so it happens only after
        the signature check has confirmed every rank is at this collective.
        """
        if self._pg is None:
            self._pg = self._backend._pg(mesh_order_of(self.axes, self._backend.mesh))
            self.gloo = "gloo" in str(_dist().get_backend(self._pg)).lower()
        return self._pg

    def shm(self, x):
        """This group's shared-memory transport when configured and `x` is on the CPU, else None.

        Its ranks are the process group's, so the same position permutations apply.
        """
        from .watchdog import _OPTIONS

        if _OPTIONS["transport"] != "shm" or x.device.type != "cpu":
            return None
        if self._shm is None:
            from ..kernels.transport import ShmTransport

            self._shm = ShmTransport.from_process_group(self.pg())
        return self._shm

    def torch_ranks(self, positions):
        """Process-group ranks of tuple positions."""
        return list(positions) if self.t2g is None else [self.t2g[p] for p in positions]


class Distributed:
    """Physical collectives and the global<->per-device boundary for one rank."""

    name = "distributed"
    #: ordinary ops run once, on this rank's block
    batched = False

    def __init__(self, mesh):
        dist = _dist()
        self.mesh = mesh
        self.dm = mesh.device_mesh
        self.rank = dist.get_rank()
        pos = (mesh.devices == self.rank).nonzero()
        self.coords = dict(zip(mesh.axis_names, pos[0].tolist()))
        self._pgs: dict = {}
        self._groups: dict = {}
        # Built by make_mesh, on every rank together: the guard's own process
        # group, and the groups over several (not all) axes of a mesh of up to
        # 3 axes, so that no later wait is an unwatched group creation
        # (creating a group is collective over the world).
        self.watch = watchdog.watch()
        names = mesh.axis_names
        partial = [c for k in range(2, len(names)) for c in itertools.combinations(names, k)]
        if len(partial) <= 3:
            for axes in partial:
                self._pg(axes)

    # ------------------------------------------------------------------
    # Groups
    # ------------------------------------------------------------------
    def group(self, axes) -> Group:
        axes = tuple(axes)
        g = self._groups.get(axes)
        if g is None:
            g = self._make_group(axes)
            self._groups[axes] = g
        return g

    def _make_group(self, axes) -> Group:
        mesh = self.mesh
        sizes = [mesh.shape[a] for a in axes]
        n = math.prod(sizes)
        ranks = []
        for idx in itertools.product(*(range(s) for s in sizes)):
            c = dict(self.coords)
            c.update(zip(axes, idx))
            ranks.append(int(mesh.devices[tuple(c[a] for a in mesh.axis_names)]))
        index = ranks.index(self.rank)
        order = sorted(ranks)  # a process group ranks its members by global rank
        g2t = [ranks.index(r) for r in order]
        if g2t == list(range(n)):
            g2t = None
        return Group(axes, n, index, ranks, g2t, self)

    def _pg(self, axes):
        """A process group over the mesh axes `axes` (mesh order), cached per set."""
        key = frozenset(axes)
        pg = self._pgs.get(key)
        if pg is not None:
            return pg
        dist = _dist()
        mesh = self.mesh
        if len(axes) == 1:
            pg = self.dm.get_group(axes[0])
        elif len(axes) == len(mesh.axis_names):
            pg = dist.group.WORLD
        else:
            # Every rank creates every group of the partition (new_group is
            # collective over the world); SPMD programs reach here together.
            dims = [mesh.axis_names.index(a) for a in axes]
            rest = [d for d in range(len(mesh.axis_names)) if d not in dims]
            t = mesh.devices.permute(rest + dims).reshape(-1, math.prod(mesh.shape[a] for a in axes))
            from datetime import timedelta

            pg, _ = dist.new_subgroups_by_enumeration(
                [row.tolist() for row in t], timeout=timedelta(seconds=self.watch.pg_timeout)
            )
        self._pgs[key] = pg
        return pg

    # ------------------------------------------------------------------
    # Boundary
    # ------------------------------------------------------------------
    def split(self, x: torch.Tensor, spec, body):
        """Global value -> (this rank's block, the axes it varies along).

        A DTensor whose placements match `spec` is used in place (its local
        tensor); any other DTensor is refused with the fix.  A plain tensor is
        a global value every rank holds: the block is a view of it, and its
        gradient (assembled from every rank's block) is complete on every rank.
        The axes are handed to `input_value`, which types the value.
        """
        from .. import dtensor as dt

        axes = mesh_order(spec.axes(), body)
        if dt.is_dtensor(x):
            return dt.local_block(x, self.mesh, spec), axes
        starts = self._block_starts(spec, x.shape)
        if starts:
            x = TakeBlock.apply(x, self, spec, body) if _grad(x) else _take_block(x, starts)
        if spec.unreduced:
            # A pending sum of a global value: the first device along the axes holds it, the others zeros.
            first = all(self.coords[a] == 0 for a in spec.unreduced)
            x = PendingTerm.apply(x, first) if _grad(x) else (x if first else torch.zeros_like(x))
        return x, axes

    def _block_starts(self, spec, shape):
        """{dim: (start, length)} of this rank's block along each split dimension."""
        out = {}
        for d in range(len(spec)):
            axes = spec.dim_axes(d)
            if not axes:
                continue
            n = math.prod(self.mesh.shape[a] for a in axes)
            idx = self.linear_index(axes)
            size = shape[d] // n
            out[d] = (idx * size, size)
        return out

    def describe_device(self) -> str:
        """`rank 2 (i=1, j=0)`: how a body value's printout names this device."""
        return f"rank {self.rank} (" + ", ".join(f"{a}={i}" for a, i in self.coords.items()) + ")"

    def linear_index(self, axes) -> int:
        """This device's position along `axes`, major-to-minor in the tuple's order."""
        i = 0
        for a in axes:
            i = i * self.mesh.shape[a] + self.coords[a]
        return i

    def assemble(self, phys, paxes, spec, body, logical_shape):
        """This rank's block -> the global value as a DTensor placed by `spec`.

        `paxes` are the axes the block varies along (shard_map hands the type
        over, as there are no device axes).  Axes the spec leaves out are
        `Replicate`: with check_vma every rank holds the same block along them;
        with check_vma=False the caller vouches for it and the cotangent is
        divided by their size (JAX's defensive transpose, as on the simulated
        mesh).  Axes the spec lists as unreduced are `Partial`: the block is
        this rank's term of the pending sum (see `unreduced_output`).
        """
        from .. import dtensor as dt

        if not getattr(body, "_exit_checked", False):
            # The end of each body counts (default: every later signature
            # includes the count) or, in strict mode, exchanges a signature: a
            # rank that skipped a collective meets the others' here, not later.
            body._exit_checked = True
            if not self.watch.body_done():
                self.watch.check("end of shard_map body", (), logical_shape, phys.dtype, f"first out_spec {spec}")
        if not body.check_vma:
            named = set(spec.axes())
            drop = [a for a in body.axes if a not in named]
            if drop:
                n = math.prod(body.sizes[a] for a in drop)
                if torch.is_grad_enabled() and phys.requires_grad:
                    phys = ScaleGrad.apply(phys, 1.0 / n)
        return dt.from_block(phys, self.mesh, spec, tuple(logical_shape))

    def input_value(self, phys, paxes, body):
        """Type a block: it varies along the axes its spec names (`paxes` from `split`).

        With check_vma=False every value counts as varying on every axis, and
        the cotangent of an unmapped input is psum'd (JAX's defensive transpose).
        """
        if body.check_vma:
            return phys, (), frozenset(paxes)
        added = tuple(a for a in body.axes if a not in paxes)
        if added:
            phys = self.lift(phys, phys.shape, added, body)
        return phys, (), frozenset(body.axes)

    def unreduced_input(self, phys, paxes, axes, body):
        """A pending sum along `axes`: `split` already made the block this rank's term.

        (A `Partial` DTensor brings its own terms; a plain tensor's value is
        held by the first device along `axes`, zeros elsewhere.)
        """
        return phys, paxes

    def unreduced_output(self, phys, paxes, axes, body):
        """A pending sum leaves as it is: `assemble` places it `Partial` along `axes`.

        No collective runs; the DTensor reduces when it is redistributed (e.g.
        by `full_tensor()`).
        """
        return phys, paxes

    # ------------------------------------------------------------------
    # Automatic pvary: an identity whose transpose is a real psum
    # ------------------------------------------------------------------
    def lift(self, phys, logical_shape, added_axes, body):
        if not (torch.is_grad_enabled() and phys.requires_grad):
            return phys
        return Pvary.apply(phys, self.group(added_axes))

    # ------------------------------------------------------------------
    # psum: varying{A} -> invariant{A}        transpose: pvary
    # ------------------------------------------------------------------
    def psum(self, phys, paxes, axes, body, shape, unchecked):
        g = self.group(axes)
        if _grad(phys):
            return (PsumUnchecked if unchecked else Psum).apply(phys, g), ()
        _record("psum", axes, shape, phys.dtype)
        return _all_reduce(phys, g, "psum"), ()

    # ------------------------------------------------------------------
    # pmax / pmin: varying{A} -> invariant{A}  (subgradient as the simulated mesh)
    # ------------------------------------------------------------------
    def pextremum(self, kind, phys, paxes, axes, body, shape, unchecked):
        g = self.group(axes)
        if _grad(phys):
            return Pextremum.apply(phys, g, kind, unchecked), ()
        _record(kind, axes, shape, phys.dtype)
        return _all_reduce(phys, g, kind), ()

    # ------------------------------------------------------------------
    # pvary: invariant{A} -> varying{A}        transpose: psum
    # ------------------------------------------------------------------
    def pvary(self, phys, paxes, axes, body, shape):
        if not _grad(phys):
            return phys, ()
        return Pvary.apply(phys, self.group(axes)), ()

    # ------------------------------------------------------------------
    # all_gather: varying{A} -> varying{A}     transpose: psum_scatter
    # all_gather_invariant: varying{A} -> invariant{A}  transpose: own-block slice
    # ------------------------------------------------------------------
    def all_gather(self, phys, paxes, axes, body, shape, axis, tiled, invariant, unchecked):
        g = self.group(axes)
        inv = invariant and not unchecked
        if _grad(phys):
            return (AllGatherInvariant if inv else AllGather).apply(phys, g, axis, tiled), ()
        kind = "all_gather_invariant" if inv else "all_gather"
        _record(kind, axes, shape, phys.dtype)
        return _all_gather(phys, g, axis, tiled, kind), ()

    # ------------------------------------------------------------------
    # psum_scatter: varying{A} -> varying{A}   transpose: all_gather
    # ------------------------------------------------------------------
    def psum_scatter(self, phys, paxes, axes, body, shape, dim, tiled):
        g = self.group(axes)
        if _grad(phys):
            return PsumScatter.apply(phys, g, dim, tiled), ()
        _record("psum_scatter", axes, shape, phys.dtype)
        return _psum_scatter(phys, g, dim, tiled), ()

    # ------------------------------------------------------------------
    # ppermute: varying{A} -> varying{A}       transpose: ppermute(inverse)
    # ------------------------------------------------------------------
    def ppermute(self, phys, paxes, axes, body, shape, perm):
        g = self.group(axes)
        perm = tuple((int(s), int(d)) for s, d in perm)
        if _grad(phys):
            return Ppermute.apply(phys, g, perm), ()
        _record("ppermute", axes, shape, phys.dtype)
        return _ppermute(phys, g, perm), ()

    # ------------------------------------------------------------------
    # all_to_all: varying{A} -> varying{A}     transpose: all_to_all(concat, split)
    # ------------------------------------------------------------------
    def all_to_all(self, phys, paxes, axes, body, shape, split_axis, concat_axis, tiled):
        g = self.group(axes)
        if _grad(phys):
            return AllToAll.apply(phys, g, split_axis, concat_axis, tiled), ()
        _record("all_to_all", axes, shape, phys.dtype)
        return _all_to_all(phys, g, split_axis, concat_axis, tiled), ()

    # ------------------------------------------------------------------
    # axis_index: -> varying{A}, this rank's position (an integer scalar)
    # ------------------------------------------------------------------
    def axis_index(self, axes, body, device, unchecked):
        return torch.tensor(self.linear_index(axes), dtype=torch.int64, device=device), ()

    def _materialize(self, phys, paxes, axes, body):
        return phys, paxes


def mesh_order_of(axes, mesh) -> tuple:
    return tuple(a for a in mesh.axis_names if a in axes)


def _grad(t) -> bool:
    return torch.is_grad_enabled() and t.requires_grad


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
    w = g._backend.watch
    grad = torch.is_grad_enabled()
    if grad:  # raw data movement; autograd is the Functions' business
        torch.set_grad_enabled(False)
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
        for work in works if isinstance(works, list) else [works]:
            w.wait(work, None, g.ranks, gloo=g.gloo, blocking=blocking)
        if seal is not None:
            w.unseal(seal, g.ranks)
        w.verify(pending, moved=True)  # default mode, no payload signature: the exchange ran alongside
    finally:
        if grad:
            torch.set_grad_enabled(True)
    w.done()


# --------------------------------------------------------------------------
# Signatures in the payload (the default check; see watchdog.Seal)
# --------------------------------------------------------------------------
def _sealing(g: Group) -> bool:
    """Whether this group's collectives carry their signature in their payload (default mode, gloo)."""
    return g._backend.watch.sealing() and g.pg() is not None and g.gloo


def _sealed_reduce(src, dtype, g: Group, kind):
    """(buffer, data view, seal) for a reduction of `src` in `dtype`: the buffer is the data (a fresh
    copy of `src`) followed by the signature trailer, built by one `cat`; reduce the buffer, read the
    view."""
    if not (_sealing(g) and watchdog.sealable(dtype, g.n)):
        out = src.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        return out, out, None
    h = g._backend.watch.next_signature16(kind, g.axes, src.shape, src.dtype)
    lo, hi, expect = watchdog.reduce_trailer(h, dtype)
    if not src.is_cpu:
        lo, hi = lo.to(src.device), hi.to(src.device)
    m = src.numel()
    flat = src if src.dim() == 1 else src.reshape(-1)
    buf = torch.cat([flat if src.dtype == dtype else flat.to(dtype), lo, hi])
    # as_strided: the cheapest way to the two views (this runs on every collective)
    out = buf.as_strided(src.shape, _contiguous_strides(src.shape))
    return buf, out, watchdog.Seal("reduce", None, buf.as_strided((2 * watchdog.SEAL_BITS,), (1,), m), expect)


_STRIDES: dict = {}


def _contiguous_strides(shape) -> tuple:
    st = _STRIDES.get(shape)
    if st is None:
        acc, st = 1, []
        for d in reversed(shape):
            st.append(acc)
            acc *= max(d, 1)
        st = tuple(reversed(st))
        if len(_STRIDES) < 1024:
            _STRIDES[shape] = st
    return st


def _sealed_reduce_rows(inp, n, g: Group):
    """As `_sealed_reduce` for a reduce-scatter of the flat `inp` ([n] rows): (input, output, output's
    data view, seal), each row carrying the trailer."""
    m = inp.numel() // n
    big = inp.numel() * inp.element_size() > _SEAL_BYTES_LIMIT
    if big or not (_sealing(g) and watchdog.sealable(inp.dtype, g.n)):
        inp = inp.contiguous()
        out = inp.new_empty(m)
        return inp, out, out, None
    k = 2 * watchdog.SEAL_BITS
    rows = inp.new_empty((n, m + k))
    rows[:, :m].copy_(inp.view(n, m))
    out = inp.new_empty(m + k)
    return rows.view(-1), out, out[:m], watchdog.Seal("reduce", rows[:, m:], out[m:])


#: above this many bytes moved per rank, a collective that moves data (rather than reducing it) checks
#: its signature with a separate exchange running alongside it instead of copying its blocks in and out
#: of a sealed layout
_SEAL_BYTES_LIMIT = 256 << 10


def _sealed_bytes(rows, g: Group, kind, shape, dtype, extra):
    """Rows moved as they are (all_gather, all_to_all, ppermute): (`rows` ([r, ...]) as bytes with the
    8-byte signature of the collective about to run (kind, shape, dtype, extra as `_run` gets them)
    appended to each row, the data bytes per row, the signature as a list); (None, 0, None) when the
    payload carries no signature.  The caller makes the output of the same layout, the `Seal` over
    both, and reads the data back with `_unseal_bytes`."""
    if not _sealing(g) or rows.numel() * rows.element_size() * g.n > _SEAL_BYTES_LIMIT:
        return None, 0, None
    r = rows.shape[0]
    b = rows.contiguous().view(-1)  # 1-D with stride 1 (a size-1 dimension may carry any stride)
    b = (b.view(torch.uint8) if b.dtype != torch.uint8 else b).view(r, -1)
    sig = g._backend.watch.next_signature_bytes(kind, g.axes, shape, dtype, extra)
    st = torch.frombuffer(bytearray(sig), dtype=torch.uint8)
    if not b.is_cpu:
        st = st.to(b.device)
    send = torch.cat([b, st.expand(r, 8)], dim=1)  # one op: the copy and the signature
    return send, b.shape[1], list(sig)


def _unseal_bytes(out, nb, dtype, shape):
    """The data of a sealed output buffer ([r, nb + 8] bytes) as a contiguous tensor of `dtype`, `shape`."""
    return out[..., :nb].contiguous().view(dtype).view(shape)


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
    if g.n == 1:
        return x.clone(memory_format=torch.contiguous_format)
    wire = _reduce_dtype(x, kind)
    dist = _dist()
    shm = g.shm(x) if kind == "psum" else None
    if shm is not None:
        out = x.to(dtype=wire or x.dtype, memory_format=torch.contiguous_format, copy=True)
        _run_shm(g, kind, x.shape, x.dtype, lambda: shm.all_reduce(out, out=out))
        return out if wire is None else out.to(x.dtype)
    op = dist.ReduceOp.SUM if kind == "psum" else dist.ReduceOp.MAX if kind == "pmax" else dist.ReduceOp.MIN
    buf, out, seal = _sealed_reduce(x, wire or x.dtype, g, kind)  # a fresh copy (+ the signature trailer)
    _run(g, kind, x.shape, x.dtype, lambda pg: dist.all_reduce(buf, op=op, group=pg, async_op=True), seal=seal)
    return out if wire is None else out.to(x.dtype)


def _run_shm(g: Group, kind, shape, dtype, fn, extra=""):
    """As `_run`, with the data moved by the group's shared-memory transport."""
    w = g._backend.watch
    with torch.no_grad():
        w.verify(w.begin(kind, g.axes, shape, dtype, extra, exchange=True))  # no payload signature here
        result = fn()
    w.done()
    return result


def _gather_rows(x, g: Group, kind, extra=""):
    """[n, *x.shape]: every position's block, in the tuple's order."""
    x = x.contiguous()
    if g.n == 1:
        return x.unsqueeze(0).clone()
    dist = _dist()
    flat = x.reshape(-1) if x.dtype in _MOVABLE else _as_bytes(x)
    shm = g.shm(x)
    if shm is not None:
        out = _run_shm(g, kind, x.shape, x.dtype, lambda: shm.all_gather(flat), extra)
    else:
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        send, nb, expect = _sealed_bytes(flat.reshape(1, -1), g, kind, x.shape, x.dtype, extra)
        if send is None:
            out = flat.new_empty((g.n, flat.numel()))
            _run(g, kind, x.shape, x.dtype, lambda pg: fn(out, flat.reshape(1, -1), group=pg, async_op=True),
                 extra)
        else:
            got = send.new_empty((g.n, nb + 8))
            _run(g, kind, x.shape, x.dtype, lambda pg: fn(got, send, group=pg, async_op=True), extra,
                 seal=watchdog.Seal("bytes", None, got[:, nb:], expect))
            out = _unseal_bytes(got, nb, flat.dtype, (g.n, flat.numel()))
    if out.dtype != x.dtype:
        out = out.view(x.dtype)
    if g.g2t is not None:
        out = out.index_select(0, torch.tensor(g.t2g, device=out.device))
    return out.view(g.n, *x.shape)


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
    chunks = _chunks(x, g.n, dim, tiled)
    if g.n == 1:
        return chunks[0].clone()
    dist = _dist()
    if g.g2t is not None:  # row r of the input goes to group rank r
        chunks = chunks.index_select(0, torch.tensor(g.g2t, device=x.device))
    wire = _reduce_dtype(x, "psum_scatter")
    if wire is not None:
        chunks = chunks.to(wire)
    extra = f"scatter_dimension={dim}, tiled={tiled}"
    shm = g.shm(x)
    if shm is not None:
        inp = chunks.reshape(g.n, -1).contiguous()
        out = _run_shm(g, "psum_scatter", x.shape, x.dtype, lambda: shm.reduce_scatter(inp), extra)
        return out.reshape(chunks.shape[1:]).to(x.dtype)
    inp, buf, out, seal = _sealed_reduce_rows(chunks.reshape(-1), g.n, g)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    # gloo's reduce_scatter ignores a wait's timeout: a helper thread waits for it (blocking=True)
    _run(g, "psum_scatter", x.shape, x.dtype, lambda pg: fn(buf, inp, group=pg, async_op=True), extra, seal=seal,
         blocking=True)
    return out.view(chunks.shape[1:]).to(x.dtype)


def _own_block(x, g: Group, axis, tiled):
    """This position's block of a gathered value (the transpose of all_gather_invariant)."""
    if tiled:
        c = x.shape[axis] // g.n
        return x.narrow(axis, g.index * c, c).contiguous()
    return x.select(axis, g.index).contiguous()


def _ppermute(x, g: Group, perm):
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
        return _run_shm(g, "ppermute", x.shape, x.dtype, lambda: shm.ppermute(x, tperm), f"perm={list(perm)}")
    out = torch.empty_like(x) if recv else torch.zeros_like(x)  # a device with no source gets zeros
    if me in send and me in recv:
        out.copy_(x)
    sx, nb, expect = _sealed_bytes(x.reshape(1, -1), g, "ppermute", x.shape, x.dtype, f"perm={list(perm)}")
    if sx is None:
        sx, so, seal = x, out, None
    else:  # signature appended to what is sent; the received one is checked
        src = [s for s in recv if s != me]
        so = sx.new_empty(sx.shape) if src else None
        seal = watchdog.Seal("bytes", None, so[:, nb:] if src else None, expect)

    def launch(pg):
        ops = [dist.P2POp(dist.isend, sx, g.ranks[d], pg) for d in send if d != me]
        ops += [dist.P2POp(dist.irecv, so, g.ranks[s], pg) for s in recv if s != me]
        return dist.batch_isend_irecv(ops) if ops else []

    _run(g, "ppermute", x.shape, x.dtype, launch, f"perm={list(perm)}", seal=seal)
    if seal is not None and seal.recv is not None:
        out = _unseal_bytes(so, nb, x.dtype, x.shape)
    return out


def _all_to_all(x, g: Group, split_axis, concat_axis, tiled):
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
            out = _run_shm(g, "all_to_all", x.shape, x.dtype, lambda: shm.all_to_all(inp), extra)
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
                     seal=watchdog.Seal("bytes", None, sout[:, nb:], expect))
                out = _unseal_bytes(sout, nb, inp.dtype, inp.shape)
        if out.dtype != x.dtype:
            out = out.view(x.dtype).reshape(chunks.shape)
        if g.g2t is not None:
            out = out.index_select(0, torch.tensor(g.t2g, device=x.device))
        chunks = out  # [src, *chunk]
    else:
        chunks = chunks.clone()
    t = chunks.movedim(0, concat_axis)
    if tiled:
        t = t.flatten(concat_axis, concat_axis + 1)
    return t


def _take_block(x, starts):
    for d, (start, size) in starts.items():
        x = x.narrow(d, start, size)
    return x


# --------------------------------------------------------------------------
# Autograd: each collective's backward is its transpose collective
# --------------------------------------------------------------------------
def _record(kind, axes, shape, dtype):
    """Report a collective to every active `comm_log` (nothing to build when none is active)."""
    if comm._LOGS:
        comm.record(event(kind, axes, shape, dtype))


class Psum(torch.autograd.Function):
    """psum (V -> I); transpose: pvary (no communication)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        _record("psum", g.axes, x.shape, x.dtype)
        return _all_reduce(x, g, "psum")

    @staticmethod
    def backward(ctx, ct):
        return Pvary.apply(ct, ctx.g), None


class Pvary(torch.autograd.Function):
    """pvary and the automatic lift (I -> V, identity); transpose: psum."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, ct):
        return Psum.apply(ct, ctx.g), None


class PsumUnchecked(torch.autograd.Function):
    """psum with check_vma=False: every value counts as varying; transpose: psum.

    `log=False`: the same sum inside another collective's backward (pmax's),
    which the simulated mesh performs inside one batched op and does not log.
    """

    @staticmethod
    def forward(ctx, x, g, log=True):
        ctx.g, ctx.log = g, log
        if log:
            _record("psum", g.axes, x.shape, x.dtype)
        return _all_reduce(x, g, "psum")

    @staticmethod
    def backward(ctx, ct):
        return PsumUnchecked.apply(ct, ctx.g, ctx.log), None, None


class Pextremum(torch.autograd.Function):
    """pmax / pmin; subgradient: the devices holding the extremum, ties split evenly.

    Counting the ties (and, with check_vma=False, summing the cotangent first)
    communicates a little in the backward pass; like the simulated mesh, which
    does this inside one batched op, it is not reported to `comm_log`.
    """

    @staticmethod
    def forward(ctx, x, g, kind, unchecked):
        ctx.g, ctx.unchecked = g, unchecked
        _record(kind, g.axes, x.shape, x.dtype)
        out = _all_reduce(x, g, kind)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, ct):
        x, out = ctx.saved_tensors
        g = ctx.g
        if ctx.unchecked:
            ct = PsumUnchecked.apply(ct, g, False)
        mask = (x == out).to(ct.dtype)
        count = _all_reduce(mask, g, "psum")
        return ct * mask / count, None, None, None


class AllGather(torch.autograd.Function):
    """all_gather (V -> V); transpose: psum_scatter."""

    @staticmethod
    def forward(ctx, x, g, axis, tiled):
        ctx.args = (g, axis, tiled)
        _record("all_gather", g.axes, x.shape, x.dtype)
        return _all_gather(x, g, axis, tiled)

    @staticmethod
    def backward(ctx, ct):
        return PsumScatter.apply(ct, *ctx.args), None, None, None


class PsumScatter(torch.autograd.Function):
    """psum_scatter (V -> V); transpose: all_gather."""

    @staticmethod
    def forward(ctx, x, g, dim, tiled):
        ctx.args = (g, dim, tiled)
        _record("psum_scatter", g.axes, x.shape, x.dtype)
        return _psum_scatter(x, g, dim, tiled)

    @staticmethod
    def backward(ctx, ct):
        return AllGather.apply(ct, *ctx.args), None, None, None


class AllGatherInvariant(torch.autograd.Function):
    """all_gather_invariant (V -> I); transpose: the own-block slice."""

    @staticmethod
    def forward(ctx, x, g, axis, tiled):
        ctx.args = (g, axis, tiled)
        _record("all_gather_invariant", g.axes, x.shape, x.dtype)
        return _all_gather(x, g, axis, tiled, "all_gather_invariant")

    @staticmethod
    def backward(ctx, ct):
        return OwnBlock.apply(ct, *ctx.args), None, None, None


class OwnBlock(torch.autograd.Function):
    """The own-block slice (I -> V, no communication); transpose: all_gather_invariant."""

    @staticmethod
    def forward(ctx, x, g, axis, tiled):
        ctx.args = (g, axis, tiled)
        return _own_block(x, g, axis, tiled)

    @staticmethod
    def backward(ctx, ct):
        return AllGatherInvariant.apply(ct, *ctx.args), None, None, None


class Ppermute(torch.autograd.Function):
    """ppermute (V -> V); transpose: ppermute with the inverse permutation."""

    @staticmethod
    def forward(ctx, x, g, perm):
        ctx.g, ctx.perm = g, perm
        _record("ppermute", g.axes, x.shape, x.dtype)
        return _ppermute(x, g, perm)

    @staticmethod
    def backward(ctx, ct):
        return Ppermute.apply(ct, ctx.g, tuple((d, s) for s, d in ctx.perm)), None, None


class AllToAll(torch.autograd.Function):
    """all_to_all (V -> V); transpose: all_to_all with split and concat swapped."""

    @staticmethod
    def forward(ctx, x, g, split_axis, concat_axis, tiled):
        ctx.args = (g, split_axis, concat_axis, tiled)
        _record("all_to_all", g.axes, x.shape, x.dtype)
        return _all_to_all(x, g, split_axis, concat_axis, tiled)

    @staticmethod
    def backward(ctx, ct):
        g, s, c, tiled = ctx.args
        return AllToAll.apply(ct, g, c, s, tiled), None, None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity whose cotangent is scaled (the unmapped-output transpose of check_vma=False)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, ct):
        return ct * ctx.scale, None


class PendingTerm(torch.autograd.Function):
    """A global value -> this rank's term of a pending sum of it (itself on the first rank, else zeros).

    Transpose: the cotangent as it is.  A pending sum's cotangent is the same
    on every device of its axes, so every rank already holds the cotangent of
    the first rank's term, the global value's whole gradient.
    """

    @staticmethod
    def forward(ctx, x, first):
        ctx.first = first
        return x.view_as(x) if first else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, ct):
        return PendingTermT.apply(ct, ctx.first), None


class PendingTermT(torch.autograd.Function):
    """The transpose of `PendingTerm` (identity); its own transpose is `PendingTerm` again."""

    @staticmethod
    def forward(ctx, ct, first):
        ctx.first = first
        return ct.view_as(ct)

    @staticmethod
    def backward(ctx, g):
        return PendingTerm.apply(g, ctx.first), None


class TakeBlock(torch.autograd.Function):
    """This rank's block of a global value every rank holds.

    Its transpose assembles every rank's block cotangent (an all_gather over
    the split axes), so the global value's gradient is whole on every rank,
    as on the simulated mesh.  This boundary traffic is not a collective of
    the program and is not reported to `comm_log`.
    """

    @staticmethod
    def forward(ctx, x, backend, spec, body):
        ctx.args = (backend, spec, body, tuple(x.shape))
        return _take_block(x, backend._block_starts(spec, x.shape))

    @staticmethod
    def backward(ctx, ct):
        backend, spec, body, shape = ctx.args
        return AssembleBlocks.apply(ct, backend, spec, body), None, None, None


class AssembleBlocks(torch.autograd.Function):
    """Every rank's block -> the global value on every rank; transpose: `TakeBlock`."""

    @staticmethod
    def forward(ctx, block, backend, spec, body):
        ctx.args = (backend, spec, body)
        return _assemble_blocks(block, backend, spec, body)

    @staticmethod
    def backward(ctx, ct):
        return TakeBlock.apply(ct, *ctx.args), None, None, None


def _assemble_blocks(block, backend, spec, body):
    """Every rank's block of a global value (same spec) -> the global value, on every rank."""
    from .simulated import SIMULATED

    axes = mesh_order(spec.axes(), body)
    g = backend.group(axes)
    rows = _gather_rows(block, g, "assemble (boundary)")  # [n, *block], mesh order
    lead = [body.sizes[a] for a in axes]
    return SIMULATED.assemble(rows.reshape(*lead, *block.shape), axes, spec, body, tuple(block.shape))


def check_dtensor_layout(x, mesh, spec, expected):
    """Raise if DTensor `x` is not laid out as `spec` on `mesh` (placements `expected`)."""
    if x.device_mesh != mesh.device_mesh or tuple(x.placements) != tuple(expected):
        raise SpecError(
            f"shard_map: a DTensor argument is laid out as {tuple(x.placements)} on {x.device_mesh}, but its "
            f"in_spec {spec} on mesh {mesh.describe()} needs {tuple(expected)}. A DTensor is used in place only "
            "when its layout matches. Fix: reshard it explicitly first, "
            f"`x = shmap.device_put(x, mesh, {spec})`, or change the in_spec to match."
        )
