"""Writes to body values: read-only arguments, and copy-on-write for values that share memory.

JAX's values are immutable; a torch body may update its own values in place,
and the two meshes must then agree.  Two kinds of body value hold memory that
is not theirs alone:

- **Arguments** alias the caller's tensor: read-only (`check_not_argument`;
  shard_map marks their storage).
- **A pvary or collective result** (`mark_shared`).  pvary returns its input's
  memory: a stride-0 broadcast on the simulated mesh, the input's own tensor on
  a process.  A collective's result may be a view: of its input on the
  simulated mesh (all_gather, all_to_all), or the view autograd's recording
  node returns, which autograd forbids writing.  Such a value gets memory of
  its own on its first in-place update (`before_write`), as JAX's new array
  would have it, so the write reaches neither the input nor the other devices.

A view of a shared value taken *before* that first update cannot follow it:
the view keeps the old memory, so a write through it would be lost (the
simulated mesh's broadcast) or reach the pvary's input (a process), and a
read of it after the update would miss the update.  Both orders are refused,
alike on both meshes, with the fix (update first, or `clone()` first);
`note_views` records which values are such views.
"""
from __future__ import annotations

import weakref

import torch

from .errors import VmaError, inplace_input, op_name

#: tensors with real storage (a module's parameter included, closed over by a traced body)
PLAIN = (torch.Tensor, torch.nn.Parameter)


def storage_key(t):
    """Identity of `t`'s storage (views share it), or None where there is none to read.

    A real tensor's is its data pointer (empty tensors all sit at 0: none).  Under a torch.func
    transform the wrapped tensor's; while torch.compile traces (fake and functional tensors, which
    have no data) the storage object's: views share it, copies do not.  (Without these the read-only
    arguments and the copy of an argument returned as it is were skipped whenever a body was traced.)
    """
    while torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    try:
        if type(t) in PLAIN:
            return t.untyped_storage().data_ptr() or None
        return ("traced", t.untyped_storage()._cdata)
    except Exception:  # noqa: BLE001 - a tensor without storage
        return None


def mark_shared(x, always: bool):
    """`x` (a pvary or collective result) shares memory until its first in-place update; `always`:
    it is copied then whatever its layout (pvary: its input's memory on every mesh)."""
    x._shared = "always" if always else "view"
    return x


def shared_root(x):
    """The shared value whose memory `x` is or views (None: memory of its own)."""
    return x._root if x._root is not None else x if x._shared is not None else None


def note_view(view, of):
    """`view` shares the memory of `of`, a shared value or a view of one."""
    root = shared_root(of)
    view._root = root
    root._viewed = True


def lend(result, operand):
    """A collective `result` that still reads `operand`'s memory (a view of it on the simulated mesh, the
    same tensor for pvary, a gather waiting in its bucket on a process) is noted on the body: before
    anything writes that memory, `before_write` gives the result memory of its own (`_detach`), so it
    keeps the values the collective saw, as JAX's would.  Returns `result`."""
    key = storage_key(operand._phys)
    if key is None:
        return result
    if storage_key(result._phys) == key:
        result._shared = "always"  # (its own first write must copy too: pmax of an invariant value is its input)
    elif type(result._phys).__name__ != "Deferred":
        return result
    lent = result._body.__dict__.setdefault("lent", {})
    lent.setdefault(key, []).append(weakref.ref(result))
    return result


def _detach(func, key, x):
    """Before `func` writes the memory `key`: the results still reading it get their own (`lend`)."""
    for ref in x._body.lent.pop(key, ()):
        r = ref()
        if r is None or r is x or r._shared is None:  # (gone, the target itself, or already its own)
            continue
        if r._viewed:
            raise VmaError(
                f"{op_name(func)}: in-place update of the input of a pvary or collective whose result `y` has "
                "views (e.g. `v = y[0:2]`). `y` keeps the values the collective saw (JAX's is a new array), "
                "but its views share the input's memory and would change with it. Fix: update the input before "
                "the collective, or take the views of `y.clone()`."
            )
        r._phys = r._phys.clone()  # (a pending gather is read first: the wire carries the old values)
        r._shared = None


def note_views(out, shared_inputs):
    """After an op on shared values (or views of them): mark outputs that view their memory."""
    outs = out if isinstance(out, (list, tuple)) else (out,)
    for o in outs:
        phys = getattr(o, "_phys", None)
        key = None if phys is None else storage_key(phys)
        if key is None:
            continue
        for leaf in shared_inputs:
            if storage_key(leaf._phys) == key:
                note_view(o, leaf)
                break


def before_write(func, x):
    """Give `x` memory of its own before an in-place op writes it, where it shares memory; refuse a
    write that a view of shared memory cannot carry."""
    root = x._root
    if root is not None and (root._shared is not None or
                             storage_key(x._phys) != storage_key(root._phys)):
        raise VmaError(
            f"{op_name(func)}: in-place update through a view (e.g. `y[0:2]`, `y.view(...)`, `y.T`, or `y` "
            "as a custom autograd Function's forward or a torch.func transform sees it) of a "
            "pvary or collective result `y` that has not been updated itself. Such a result shares memory "
            "(its input's, or the other devices') until its first in-place update gives it its own, which a "
            "view taken before cannot follow: the write would be lost on the simulated mesh and reach the "
            "pvary's input on processes. Fix: `y = y.clone()` (or update `y` itself first), then take the view."
        )
    lent = x._body.__dict__.get("lent")
    if lent:
        key = storage_key(x._phys)
        if key in lent:
            _detach(func, key, x)
    copy = False
    if x._shared is not None:
        if x._viewed:
            raise VmaError(
                f"{op_name(func)}: in-place update of a pvary or collective result after a view of it was "
                "taken (e.g. `v = y[0:2]`). The result shares memory until its first in-place update gives it "
                "its own, so the view would keep the old values (and on processes the pvary's input would "
                "change). Fix: update it before taking views, or clone it first: `y = y.clone()`."
            )
        copy = x._shared == "always" or x._phys._is_view()
        x._shared = None
    if copy or _broadcast(x):  # (also a check_vma=False argument, lifted to every axis)
        x._phys = x._phys.clone()


def check_not_argument(func, x):
    """Arguments are read-only in the body (shard_map marks their storage; see shard_map._read_only).

    An argument or a view of it raises; a pvary or collective result that shares an argument's memory
    is a new value (`before_write` gives it its own on its first in-place update).
    """
    got = argument_of(x._body, x._phys)
    if got is None or shared_root(x) is not None:
        return
    who, arg_vma = got
    if x._vma <= arg_vma:
        raise inplace_input(op_name(func), who, x._body)
    x._phys = x._phys.clone()  # (a lifted argument: a new value in JAX)


def not_an_argument(body, phys):
    """An output's physical tensor, copied if it is an argument's memory (an argument, a view of it, a
    pvary of it, returned as it is): the output is a new tensor, as JAX's are.  Else it would alias the
    caller's tensor (the parent body's value, nested), and an in-place update of the output would write
    the whole of it on the simulated mesh but only this rank's block of it on a distributed one."""
    return phys.clone() if argument_of(body, phys) is not None else phys


def argument_of(body, phys):
    """(who, its type) of the argument whose memory `phys` is (shard_map marks its arguments' storage), or
    None: memory of the body's own."""
    marked = body.__dict__.get("read_only")
    return marked.get(storage_key(phys)) if marked else None


def _broadcast(x) -> bool:
    """Whether `x`'s device dims are a stride-0 broadcast (pvary on the simulated mesh)."""
    k = len(x._paxes)
    if not k:
        return False
    st = x._phys.stride()
    return any(st[d] == 0 and x._phys.shape[d] > 1 for d in range(k))
