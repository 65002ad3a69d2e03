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


class InPlaceInputError(ShmapError, RuntimeError):
    """An in-place op would update a body value that aliases the caller's data (an argument)."""


class InPlaceOutputError(ShmapError, RuntimeError):
    """Kept for code that catches it; no longer raised.  An output updated in place after the call and then
    differentiated through raises torch's own "modified by an inplace operation" error on both meshes,
    where the body's backward saved the output (a RuntimeError, as this class is), and is differentiated
    as plain torch does where it did not (the distributed mesh refused every such update)."""


class TransformError(ShmapError, NotImplementedError):
    """A torch.func transform applied where the distributed mesh cannot carry it (a DTensor argument
    of a shard_mapped function under a transform from outside)."""


class DistributedError(ShmapError, RuntimeError):
    """A distributed mesh could not complete a collective (base class)."""


class RankFailedError(DistributedError):
    """Another rank raised (or exited) while this one waited for it."""


class CollectiveMismatchError(DistributedError):
    """Ranks called different collectives at the same point of the program."""


class CollectiveTimeoutError(DistributedError):
    """A collective did not complete within the timeout."""


def fmt_axes(axes) -> str:
    axes = tuple(axes)
    if len(axes) == 1:
        return repr(axes[0])
    return "(" + ", ".join(repr(a) for a in axes) + ")"


def fmt_vma(vma, order=None) -> str:
    if order is not None:
        vma = [a for a in order if a in vma]
    else:
        vma = sorted(vma)
    return "{" + ", ".join(repr(a) for a in vma) + "}"


#: how a pmap without an axis_name names its axis (pmap.py), which no collective can name
ANONYMOUS_AXIS = "_pmap"


def unbound_axis(api: str, name, bound, kind="shard_map", free_in=None) -> UnboundAxisError:
    """`name` is bound by no running body.  (`kind`: the innermost body's, "shard_map" or "pmap"; a pmap
    without an axis_name binds an anonymous axis, which no collective can name: it is not listed.
    `free_in`: the innermost body's mesh, when `name` is an axis of it that its axis_names leave free.)"""
    if free_in is not None:
        axes = ", ".join(repr(a) for a in (*bound, name))
        return UnboundAxisError(
            f"{api}: axis name {name!r} is not bound: it is an axis of the enclosing shard_map's mesh "
            f"{free_in.describe()}, which that shard_map leaves free (its axis_names bind {tuple(bound)}), so "
            f"a collective there cannot name it. Fix: bind it too, axis_names={{{axes}}}, or call {api} inside "
            f"a shard_map nested in this body that binds {name!r} (axis_names={{{name!r}}})."
        )
    named = tuple(a for a in bound if not (isinstance(a, str) and a.startswith(ANONYMOUS_AXIS)))
    anonymous = len(named) < len(bound)
    if not bound:
        return UnboundAxisError(
            f"{api}: axis name {name!r} is not bound: no shard_map or pmap body is running (collectives only "
            f"work inside one). Fix: call {api} inside shmap.shard_map(f, mesh=..., ...) whose mesh has an axis "
            f"named {name!r}, or inside shmap.pmap(f, axis_name={name!r})."
        )
    where = (f"the enclosing {kind} binds {named}" if named else f"the enclosing {kind} binds no named axis")
    where += " (and an anonymous pmap axis: give that pmap axis_name=... to use it)" if anonymous else ""
    return UnboundAxisError(
        f"{api}: axis name {name!r} is not bound: {where}. Fix: use one of the bound names, or call {api} "
        + (f"inside shmap.pmap(f, axis_name={name!r})." if kind == "pmap" else
           f"inside shmap.shard_map(f, mesh=..., ...) whose mesh has an axis named {name!r}.")
    )


def varying_control_flow(what: str, vma, mesh) -> VaryingControlFlowError:
    if getattr(mesh, "is_distributed", False):
        why = ("Each process would take its own branch, and the ranks would then run different programs "
               "(different collectives, or a hang); the distributed mesh refuses, as every mesh does, so a "
               "program means the same on one process as on one process per device.")
    else:
        why = ("On real hardware each device would take its own branch; the simulated mesh refuses to "
               "silently pick one device's answer.")
    return VaryingControlFlowError(
        f"{what} needs one concrete Python value, but this value varies across devices along "
        f"{fmt_vma(vma, mesh.axis_names)} of mesh {mesh.describe()}. {why} "
        "Fix: make it invariant first (e.g. `shmap.pmax(x, axes)` / `shmap.psum(x, axes)`), or keep "
        "the choice per device with tensor ops such as `torch.where(cond, a, b)`."
    )


def inplace_input(op: str, who: str, mesh) -> InPlaceInputError:
    """`op` would update `who` (e.g. "argument 0 ('x') of shard_map(f) at in_specs[0]") in place."""
    return InPlaceInputError(
        f"{op}: in-place update of {who} (mesh {mesh.describe()}). Arguments are read-only inside a "
        "shard_map body, as JAX arrays are immutable: the body value aliases the caller's tensor, and with "
        "one process per device each rank would update only its own block of its own copy, so the "
        "caller's tensor would end up different on the simulated and the distributed mesh (and a "
        "requires_grad input cannot be updated in place at all). Values created inside the body may be "
        "updated in place. Fix: compute out of place, e.g. `x = x + y` instead of `x += y` / `x.add_(y)`, "
        "or copy first (`x = x.clone()`) and update the copy."
    )


def op_name(func) -> str:
    """How messages name a torch op: `torch.exp`, `Tensor.add`, `Tensor.T`, `torch.nn.functional.linear`."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and hasattr(owner, "__objclass__"):  # a property's getter
        return f"Tensor.{owner.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if name.startswith("_VariableFunctionsClass."):
        return f"torch.{func.__name__}"
    if name.startswith("TensorBase."):
        return "Tensor." + name[len("TensorBase."):]
    mod = getattr(func, "__module__", "") or ""
    if name.startswith("linalg_") and mod.startswith("torch"):
        return "torch.linalg." + name[len("linalg_"):]
    if mod == "torch._C._nn" or mod == "torch.nn.functional":
        return f"torch.nn.functional.{func.__name__}"
    if "<locals>" in name and mod.startswith("torch"):  # (torch.unique: a closure a decorator built)
        import torch

        for space, prefix in ((torch, "torch."), (torch.nn.functional, "torch.nn.functional.")):
            if getattr(space, func.__name__, None) is func:
                return prefix + func.__name__
    if mod.startswith("torch") and not name.startswith("Tensor") and "." not in name:
        return f"torch.{name}"
    return name


def storage_layout(what: str) -> NotImplementedError:
    """An op that reads or rewrites a body value's storage layout (`what`, e.g. "`resize_`"), refused on
    both meshes (special.py; `set_` in `ShTensor.__torch_dispatch__`)."""
    return NotImplementedError(
        f"{what} on a shard_map body value: its storage is laid out by the mesh (every device's block in one "
        "tensor on the simulated mesh, a view into the global tensor on a process), so the result would differ "
        "between the meshes. Fix: build the value you need with out-of-place ops (reshape, view, narrow, "
        "torch.cat, new_zeros), or as_strided without a storage_offset."
    )


_BN_STATS = "BatchNorm's running statistics in training mode"


def shared_write(op: str, shape, mesh: str, what: str = "", fix: str = "") -> VmaError:
    """An op that writes a tensor every device shares (closed over, or invariant) from values that vary
    across the devices: each device would write its own, the simulated mesh one copy for all and each
    process its own.  Refused on both meshes (special.py before the op; per_device.py after a write
    it then undoes)."""
    return VmaError(
        f"{op}: updates a tensor of shape {tuple(shape)} that is the same on every device (closed over, or "
        f"invariant: e.g. {what or _BN_STATS}) from values that vary "
        f"across the devices (mesh {mesh}): each device would write its own. Fix: "
        + (fix or "keep such state per device (pass it in with a sharded spec, write a copy made in the body, "
           "`s = s.clone()`, and return it), reduce the statistics first (shmap.pmean), or run the module in eval "
           "mode.")
    )


def as_tensor_arg(api: str, what: str, x):
    """`torch.as_tensor(x)` for an argument that may be a number or array-like, or a TypeError naming
    `api` and the argument (torch's own names neither: "Could not infer dtype of NoneType")."""
    import torch

    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        shown = repr(x) if len(repr(x)) <= 60 else repr(x)[:57] + "..."
        reason = str(e).split("\n")[0]  # (torch's own reason, kept short: a shmap error's would be a page)
        reason = reason if len(reason) <= 100 else reason[:97] + "..."
        raise TypeError(
            f"{api}: {what} must be a tensor or a number, got {type(x).__name__} {shown} ({reason}). "
            "Fix: pass a torch.Tensor."
        ) from None


def nested_in_pmap(what: str) -> str:
    """The message for a shard_map given (or closing over) a value of a running pmap body."""
    return (
        f"{what}: a shard_map cannot nest in a pmap. pmap builds its own mesh, which no shard_map can name, "
        "so a shard_map in its body runs over another mesh than the pmap's values live on. Fix: nest a pmap "
        "(shmap.pmap inside the pmap body binds a new axis), or write the outer map as a shard_map over a "
        "mesh with both axes that leaves the inner one free (axis_names=...), and nest the shard_map in that."
    )


def no_torch_function(func) -> str:
    """The message for a body value reached by torch with `__torch_function__` off: it cannot be typed."""
    return (
        f"{func} on a shard_map body value with __torch_function__ disabled, so shmap cannot type it. Most "
        "often a torch.compile'd function called on body values (Dynamo's guards and traces read its inputs "
        "that way), or torch._C.DisableTorchFunctionSubclass. Fix: call the function uncompiled in the body and "
        "compile the shard_mapped function instead, torch.compile(shard_map(f, ...)): the body is then traced "
        "once, with its collectives, into the graph."
    )
