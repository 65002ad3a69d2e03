"""The backend protocol: everything the front end asks of the machine a body runs on.

The front end (`tensor.py`, `collectives.py`, `shard_map.py`, `nesting.py`) types values and
checks programs; a `Backend` holds the physical values and moves their data.  Two implement it:
`simulated.Simulated` (every device in this process, a value varying along axes `L` stored as
one tensor `[size of each axis in L, in mesh order] + per-device shape`) and
`distributed.Distributed` (one process per device, a value is this device's block).  The front
end calls only the methods below and never asks which backend it has.

Conventions shared by every method:

- `phys` is a value's physical tensor and `paxes` its device axes: the mesh axes its leading
  dims stand for, in mesh order (always `()` where `device_dims` is False).
- `body` is the running `context.Body` (mesh, manual axes, sizes, `check_vma`, `order`).
- `shape` / `logical_shape` is the per-device (logical) shape, for events and messages.
- `axes` name the collective's mesh axes in the caller's order (a tuple is linearised
  major-to-minor); results come back as `(phys, paxes)`.
- Each collective records its `comm.CommEvent` when it runs and, under autograd, its transpose
  when transposed, so `comm_log` reads the same on every backend.
"""
from __future__ import annotations

import abc


class Backend(abc.ABC):
    """What the front end needs from a backend (see the module docstring for the conventions)."""

    #: "simulated" or "distributed": for messages only
    name: str = ""
    #: whether a value's physical tensor carries a leading dim per axis it varies along (every
    #: device's block in this process), or is one device's block (`paxes == ()` always)
    device_dims: bool = False
    #: the types of global value `enter_block` may take (DTensors), or (): no such shortcut
    block_types: tuple = ()

    # ------------------------------------------------------------------
    # The boundary: global values in and out of a body
    # ------------------------------------------------------------------
    def enter_block(self, x, spec, body):
        """`(phys, vma)` for an argument `x` of a type in `block_types` in a top-level body, as `split`
        then `input_value` would give it (its in_spec checked already), or None to take that
        general path.  A shortcut for the common argument; the default takes none."""
        return None

    def quick_psum(self, x, axis_name):
        """`shmap.psum(x, axis_name)` for a body value `x` and one axis name by a direct path, or None
        to take the general one (`psum`).  A shortcut for the commonest collectives; the default
        takes none."""
        return None

    def quick_all_gather(self, x, axis_name, axis, tiled, invariant):
        """As `quick_psum`, for `shmap.all_gather` (`all_gather_invariant` if `invariant`); the
        arguments as the caller gave them, unchecked (None: the general path checks them)."""
        return None

    @abc.abstractmethod
    def split(self, x, spec, body):
        """Global value `x` -> `(phys, axes)`: this body's value of it, cut by `spec`.

        `axes` are the axes `spec` splits, in mesh order (the value's device axes where
        `device_dims`); `input_value` turns them into the value's type.  Differentiable: the
        gradient of `x` is assembled from every device's cotangent.
        """

    @abc.abstractmethod
    def input_value(self, phys, paxes, body):
        """`(phys, paxes, vma)`: type a value `split` made.  With `check_vma`, it varies along
        `paxes`; without, along every axis of the body (an unmapped input's cotangent is then
        psum'd: JAX's defensive transpose)."""

    @abc.abstractmethod
    def unreduced_input(self, phys, paxes, axes, body):
        """`(phys, paxes)`: the value as a pending sum along `axes` (mesh order), i.e. one term
        per device whose sum is the value (a plain global value: the first device holds it, the
        others zeros; a `Partial` DTensor brings its own terms)."""

    @abc.abstractmethod
    def unreduced_output(self, phys, paxes, axes, body):
        """`(phys, paxes)`: a pending sum along `axes` made ready for `assemble` (summed on the
        simulated mesh; left as the terms of a `Partial` DTensor on the distributed one).  Records
        no collective: the caller, not the program, asked for it."""

    @abc.abstractmethod
    def assemble(self, phys, paxes, spec, body, logical_shape):
        """A body output -> the global value laid out by `spec` (a tensor, or a DTensor).

        The front end has checked the type: the value varies only along axes `spec` names (or
        is a pending sum along `spec.unreduced`) and, with `check_vma`, was `pvary`'d along every
        named axis it was invariant along.
        With `check_vma=False`, axes `spec` leaves out keep one device's copy, and the cotangent
        is divided by their size (JAX's defensive transpose).
        """

    # ------------------------------------------------------------------
    # A shard_map nested in a running body over the same mesh
    # ------------------------------------------------------------------
    @abc.abstractmethod
    def enter_nested(self, phys, paxes, spec, body):
        """`(phys, paxes)`: a parent body's value (whole along the axes the parent leaves free)
        -> the nested `body`'s, cut along the axes `spec` splits.  Differentiable.  A backend
        that cannot take a pending sum in (`spec.unreduced`) raises `SpecError` here."""

    @abc.abstractmethod
    def exit_nested(self, phys, paxes, spec, body, logical_shape, pending, tiled):
        """`(phys, paxes)`: the nested `body`'s output -> the parent body's value, whole along
        the nested call's own axes.

        `pending`: the own axes it is a pending sum along (`spec.unreduced`; summed here, or
        `SpecError` where the backend cannot); `tiled`: named axes it is invariant along,
        `pvary`'d first (JAX's implicit pvary, whose transpose is a psum).
        """

    # ------------------------------------------------------------------
    # Running the program
    # ------------------------------------------------------------------
    @abc.abstractmethod
    def run_op(self, func, leaves, treedef, batched, union, inplace, body):
        """Run one torch op on physical values (called once per op: keep it lean).

        `leaves` / `treedef`: the op's flattened arguments, body values replaced by their
        physical tensors, already lifted to the op's type `union` (the vma of the result);
        `batched`: `(leaf index, device axes)` of leaves with device dims; `inplace`: the op
        updates its first argument.  Returns `(result, its device axes)`.
        """

    @abc.abstractmethod
    def lift(self, phys, logical_shape, added_axes, body):
        """The automatic `pvary` of an operand along `added_axes` (mesh order) before an op
        mixes it with values varying there: physically nothing, its transpose a `psum`."""

    @abc.abstractmethod
    def describe_device(self):
        """How a printout names the one device whose block this process holds (`rank 2 (i=1)`),
        or None where every device's block is here."""

    # ------------------------------------------------------------------
    # Collectives (`collectives.py` checks arguments and types before calling in;
    # `unchecked` is `not body.check_vma`: JAX's defensive transposes)
    # ------------------------------------------------------------------
    @abc.abstractmethod
    def psum(self, phys, paxes, axes, body, shape, unchecked):
        """Sum over the devices of `axes`: varying{A} -> invariant{A}; transpose pvary."""

    @abc.abstractmethod
    def pextremum(self, kind, phys, paxes, axes, body, shape, unchecked):
        """`kind` 'pmax' / 'pmin' over `axes`: varying{A} -> invariant{A}; subgradient to the
        devices holding the extremum, ties split evenly."""

    @abc.abstractmethod
    def pvary(self, phys, paxes, axes, body, shape):
        """invariant{A} -> varying{A} without communication; transpose psum."""

    @abc.abstractmethod
    def all_gather(self, phys, paxes, axes, body, shape, axis, tiled, invariant, unchecked):
        """Every device's block stacked (`tiled`: concatenated) at `axis`: varying{A} ->
        varying{A}, transpose psum_scatter; `invariant`: -> invariant{A}, transpose the own block."""

    @abc.abstractmethod
    def psum_scatter(self, phys, paxes, axes, body, shape, dim, tiled):
        """Sum over `axes`, each device keeping its slice of `dim`: varying{A} -> varying{A};
        transpose all_gather."""

    @abc.abstractmethod
    def ppermute(self, phys, paxes, axes, body, shape, perm):
        """Send blocks along `(src, dst)` pairs (no source: zeros); transpose the inverse."""

    @abc.abstractmethod
    def all_to_all(self, phys, paxes, axes, body, shape, split_axis, concat_axis, tiled):
        """Chunk j of `split_axis` to device j, concatenated at `concat_axis`; transpose
        all_to_all with the two swapped."""

    @abc.abstractmethod
    def axis_index(self, axes, body, device, unchecked):
        """This device's index along `axes` (int64 scalar per device): -> varying{A}."""
