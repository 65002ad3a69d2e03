"""Exceptions of the public API and the message builders for them.

Every message names the API and the argument path, states the rule, shows the
expected and actual values (with the mesh) and suggests a fix as code.  They
live together so that wording stays consistent and tests can assert on it.
"""
from __future__ import annotations


class ShmapError(Exception):
    """Base class of every error shmap raises on purpose."""


class SpecError(ShmapError, ValueError):
    """An in_spec / out_spec is malformed or does not fit its value."""


class VmaError(ShmapError, ValueError):
    """A device-variance (replication) rule is violated."""


class UnboundAxisError(ShmapError, NameError):
    """A collective names a mesh axis no enclosing shard_map binds."""


class CollectiveShapeError(ShmapError, ValueError):
    """A collective's shape precondition does not hold."""


class CollectiveArgumentError(ShmapError, ValueError):
    """A collective got an invalid non-shape argument (e.g. a bad permutation)."""


class VaryingControlFlowError(ShmapError, RuntimeError):
    """Python needed one concrete value, but the value differs across devices."""


def fmt_axes(axes) -> str:
    axes = tuple(axes)
    if len(axes) == 1:
        return repr(axes[0])
    return "(" + ", ".join(repr(a) for a in axes) + ")"


def fmt_vma(vma, mesh_order=None) -> str:
    if mesh_order is not None:
        vma = [a for a in mesh_order if a in vma]
    else:
        vma = sorted(vma)
    return "{" + ", ".join(repr(a) for a in vma) + "}"


def unbound_axis(api: str, name, bound) -> UnboundAxisError:
    where = (
        f"the enclosing shard_map binds {tuple(bound)}"
        if bound
        else "no shard_map body is running (collectives only work inside one)"
    )
    return UnboundAxisError(
        f"{api}: axis name {name!r} is not bound: {where}. "
        f"Fix: use one of the bound names, or call {api} inside "
        f"shmap.shard_map(f, mesh=..., ...) whose mesh has an axis named {name!r}."
    )


def varying_control_flow(what: str, vma, mesh) -> VaryingControlFlowError:
    return VaryingControlFlowError(
        f"{what} needs one concrete Python value, but this value varies across devices along "
        f"{fmt_vma(vma, mesh.axis_names)} of mesh {mesh.describe()}. On real hardware each device "
        "would take its own branch; the simulated mesh refuses to silently pick one device's answer. "
        "Fix: make it invariant first (e.g. `shmap.pmax(x, axes)` / `shmap.psum(x, axes)`), or keep "
        "the choice per device with tensor ops such as `torch.where(cond, a, b)`."
    )
