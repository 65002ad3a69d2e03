"""Loop-over-mesh reference for shard_map, in plain numpy.

This is the oracle that does not share a single idea with shmap's
implementation: every device gets its own numpy block, the body runs for all
devices in lockstep, and each collective is computed by hand from the list of
per-device values.  It knows nothing about device-variance types; a value that
is "invariant" is simply equal on every device, and the output assembly checks
that (bit for bit) instead of trusting a type system.

Conventions
-----------
* Devices are enumerated in row-major (``np.ndindex``) order of the mesh shape;
  device ``d`` has mesh coordinates ``RefMesh.coords[d]``.
* An axis argument is a name or a tuple of names, linearised major-to-minor:
  the index of a device along ``('i', 'j')`` is ``idx_i * size_j + idx_j``.
* A spec is a tuple of entries (``None``, a name, or a tuple of names), one per
  leading dimension; missing trailing entries mean ``None``.
* A *lockstep body* is ``body(mesh, *inputs) -> tuple_of_outputs`` where every
  input and output is a list with one numpy array per device.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np


def entry_axes(entry) -> tuple[str, ...]:
    """Normalise a spec entry (None / name / tuple of names) to a tuple of names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def axis_tuple(axis_name) -> tuple[str, ...]:
    """Normalise a collective's axis argument (name or tuple) to a tuple."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def padded_spec(spec: Sequence, rank: int) -> list[tuple[str, ...]]:
    """Spec entries as tuples of names, padded with ``()`` up to ``rank``."""
    spec = list(spec)
    if len(spec) > rank:
        raise ValueError(f"spec {spec} is longer than the rank {rank}")
    return [entry_axes(e) for e in spec] + [()] * (rank - len(spec))


class RefMesh:
    """A mesh of simulated devices plus hand-written collectives.

    Every collective takes the list of per-device values of its operand and
    returns the list of per-device results.  Groups are the devices that agree
    on every mesh axis *not* named by the collective; within a group, devices
    are ordered by their linearised index along the named axes.
    """

    def __init__(self, shape: Sequence[int], names: Sequence[str]):
        if len(shape) != len(names):
            raise ValueError("mesh shape and axis names differ in length")
        self.shape = tuple(int(s) for s in shape)
        self.names = tuple(names)
        self.sizes = dict(zip(self.names, self.shape))
        self.coords = [dict(zip(self.names, c)) for c in np.ndindex(*self.shape)]

    @property
    def n_devices(self) -> int:
        return len(self.coords)

    def size(self, axes) -> int:
        return math.prod(self.sizes[a] for a in axis_tuple(axes))

    def index(self, d: int, axes) -> int:
        """Linearised (major-to-minor) index of device ``d`` along ``axes``."""
        idx = 0
        for a in axis_tuple(axes):
            idx = idx * self.sizes[a] + self.coords[d][a]
        return idx

    def group(self, d: int, axes) -> list[int]:
        """Devices sharing ``d``'s coordinates off ``axes``, ordered by index."""
        axes = axis_tuple(axes)
        members = [e for e in range(self.n_devices)
                   if all(self.coords[e][a] == self.coords[d][a]
                          for a in self.names if a not in axes)]
        members.sort(key=lambda e: self.index(e, axes))
        assert len(members) == self.size(axes)
        return members

    # -- reductions ---------------------------------------------------------
    def _reduce(self, vals, axes, fn):
        out = []
        for d in range(self.n_devices):
            acc = None
            for e in self.group(d, axes):  # same order on every member: bitwise equal
                acc = vals[e].copy() if acc is None else fn(acc, vals[e])
            out.append(acc)
        return out

    def psum(self, vals, axes):
        return self._reduce(vals, axes, np.add)

    def pmean(self, vals, axes):
        n = self.size(axes)
        return [v / n for v in self.psum(vals, axes)]

    def pmax(self, vals, axes):
        return self._reduce(vals, axes, np.maximum)

    def pmin(self, vals, axes):
        return self._reduce(vals, axes, np.minimum)

    # -- data movement ------------------------------------------------------
    def all_gather(self, vals, axes, axis=0, tiled=False):
        join = np.concatenate if tiled else np.stack
        return [join([vals[e] for e in self.group(d, axes)], axis=axis)
                for d in range(self.n_devices)]

    # Same values; only the type (invariant) differs, which the reference ignores.
    all_gather_invariant = all_gather

    def psum_scatter(self, vals, axes, scatter_dimension=0, tiled=False):
        n = self.size(axes)
        summed = self.psum(vals, axes)
        out = []
        for d in range(self.n_devices):
            k = self.index(d, axes)
            s = summed[d]
            if tiled:
                assert s.shape[scatter_dimension] % n == 0
                out.append(np.split(s, n, axis=scatter_dimension)[k])
            else:
                assert s.shape[scatter_dimension] == n
                out.append(np.take(s, k, axis=scatter_dimension))
        return out

    def ppermute(self, vals, axes, perm):
        """``perm`` is a list of (source, destination) pairs; no source -> zeros."""
        src_of = {dst: src for src, dst in perm}
        assert len(src_of) == len(perm), "duplicate destinations"
        out = []
        for d in range(self.n_devices):
            group = self.group(d, axes)
            k = self.index(d, axes)
            out.append(vals[group[src_of[k]]].copy() if k in src_of
                       else np.zeros_like(vals[d]))
        return out

    def pshuffle(self, vals, axes, perm):
        """``perm[i]`` is the source of the device with index ``i``."""
        return self.ppermute(vals, axes, [(src, dst) for dst, src in enumerate(perm)])

    def all_to_all(self, vals, axes, split_axis, concat_axis, tiled=False):
        """Device k receives chunk k of every group member, in member order."""
        n = self.size(axes)
        out = []
        for d in range(self.n_devices):
            k = self.index(d, axes)
            chunks = [np.split(vals[e], n, axis=split_axis)[k] for e in self.group(d, axes)]
            if tiled:
                out.append(np.concatenate(chunks, axis=concat_axis))
            else:
                chunks = [np.squeeze(c, axis=split_axis) for c in chunks]
                out.append(np.stack(chunks, axis=concat_axis))
        return out

    def axis_index(self, axes):
        return [np.asarray(self.index(d, axes)) for d in range(self.n_devices)]

    # -- the shard_map boundary ---------------------------------------------
    def split(self, x: np.ndarray, spec) -> list[np.ndarray]:
        """Per-device blocks of a global value; unnamed axes get full copies."""
        x = np.asarray(x)
        entries = padded_spec(spec, x.ndim)
        blocks = []
        for d in range(self.n_devices):
            index = []
            for dim, axes in enumerate(entries):
                n = self.size(axes) if axes else 1
                assert x.shape[dim] % n == 0, (x.shape, spec, self.sizes)
                b = x.shape[dim] // n
                k = self.index(d, axes) if axes else 0
                index.append(slice(k * b, (k + 1) * b))
            blocks.append(x[tuple(index)].copy())
        return blocks

    def assemble(self, blocks: Sequence[np.ndarray], spec) -> np.ndarray:
        """Concatenate blocks along named axes; check copies along unnamed axes.

        Along mesh axes the spec does not name, the body promised the blocks
        are equal; the reference verifies that exactly rather than trusting it.
        """
        rank = np.ndim(blocks[0])
        entries = padded_spec(spec, rank)
        named = {a for axes in entries for a in axes}
        block_shape = np.shape(blocks[0])
        out_shape = tuple(s * (self.size(axes) if axes else 1)
                          for s, axes in zip(block_shape, entries))
        out = np.zeros(out_shape, dtype=np.result_type(blocks[0]))
        first_writer: dict[tuple, int] = {}
        for d in range(self.n_devices):
            assert np.shape(blocks[d]) == block_shape, "blocks differ in shape"
            key = tuple(self.coords[d][a] for a in self.names if a in named)
            if key in first_writer:
                ref = blocks[first_writer[key]]
                if not np.array_equal(blocks[d], ref):
                    unnamed = [a for a in self.names if a not in named]
                    raise AssertionError(
                        f"output with spec {spec} is not invariant along unnamed "
                        f"axes {unnamed}: device {self.coords[d]} differs from "
                        f"device {self.coords[first_writer[key]]}")
                continue
            first_writer[key] = d
            index = []
            for dim, axes in enumerate(entries):
                b = block_shape[dim]
                k = self.index(d, axes) if axes else 0
                index.append(slice(k * b, (k + 1) * b))
            out[tuple(index)] = blocks[d]
        return out


def reference_shard_map(lockstep_body: Callable, mesh_shape: Sequence[int],
                        names: Sequence[str], in_specs: Sequence,
                        out_specs: Sequence) -> Callable:
    """The reference ``shard_map``: ``(*global_numpy_arrays) -> tuple of arrays``.

    ``lockstep_body(mesh, *inputs)`` receives one list of per-device blocks per
    input and returns a tuple with one list of per-device blocks per output
    (``programs.render_reference`` builds such bodies from a Program).
    """
    mesh = RefMesh(mesh_shape, names)

    def run(*arrays):
        if len(arrays) != len(in_specs):
            raise TypeError(f"expected {len(in_specs)} inputs, got {len(arrays)}")
        per_device = [mesh.split(np.asarray(x), spec) for x, spec in zip(arrays, in_specs)]
        outs = lockstep_body(mesh, *per_device)
        if len(outs) != len(out_specs):
            raise TypeError(f"body returned {len(outs)} outputs for {len(out_specs)} out_specs")
        return tuple(mesh.assemble(blocks, spec) for blocks, spec in zip(outs, out_specs))

    return run
