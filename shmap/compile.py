"""`torch.compile` of shard_mapped functions.

Dynamo does not trace a shard_map call op by op: body values are a tensor
subclass whose `__torch_function__` runs the simulated devices through
functorch's batching, which Dynamo would have to inline for every op.
Instead every shard_mapped function is `allow_in_graph`: Dynamo puts the
call in its graph as one node, and AOT autograd traces *through* it (the body
runs once, on fake tensors, producing the physical ops: batched matmuls,
sums over device dims), so Inductor compiles the per-device program together
with the code around it, forward and backward.  Each collective's
`comm_log` report is the ordered effectful op `shmap::record` (see `ops.py`),
so a compiled call reports the same events as an eager one.

Consequences:

- `fullgraph=True` works for programs whose shard_mapped functions take
  their tensors as arguments.  A tensor the body *closes over* is invisible to
  Dynamo (it does not look inside the call); it is rejected with an error
  naming the fix: pass it as an argument with `P()`.
- The body is Python run at trace time: Python control flow on values is
  already an error in bodies (`VaryingControlFlowError`), and prints run once
  per compilation, not per call.

- Sizes may be symbolic (Dynamo's automatic dynamic shapes after a
  recompile); a collective's `comm_log` event needs concrete bytes, so the
  sizes it reports are specialised (guarded) in the graph.
- The distributed mesh does not compile yet: its collectives are c10d calls
  under a watchdog, which AOT autograd cannot trace; `check_mesh` says so
  instead of failing deep inside tracing.  (The route: trace them as
  `torch.distributed._functional_collectives`, which have fake kernels.)

Registering a function with Dynamo needs `torch._dynamo`, whose import takes
seconds; shmap does not import it.  Functions created before it is imported
are registered when it is (an import hook), those created after at once.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import weakref

_PENDING: "weakref.WeakSet" = weakref.WeakSet()
_LOCK = threading.Lock()
_HOOKED = False


def register(fn):
    """Let Dynamo put calls of `fn` (a shard_mapped function) in its graph as one node."""
    if "torch._dynamo" in sys.modules and _dynamo_ready():
        _allow(fn)
        return fn
    with _LOCK:
        _PENDING.add(fn)
        _install_hook()
    return fn


def _dynamo_ready() -> bool:
    mod = sys.modules.get("torch._dynamo")
    return mod is not None and hasattr(mod, "allow_in_graph")


def _allow(fn):
    import torch._dynamo

    torch._dynamo.allow_in_graph(fn)


def _register_pending():
    with _LOCK:
        fns = list(_PENDING)
        _PENDING.clear()
    for fn in fns:
        _allow(fn)


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Runs `_register_pending` right after `torch._dynamo` is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch._dynamo":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            global _HOOKED
            _HOOKED = False
            _register_pending()

        loader.exec_module = exec_module
        return spec


def _install_hook():
    global _HOOKED
    if not _HOOKED:
        sys.meta_path.insert(0, _DynamoImportHook())
        _HOOKED = True


def check_mesh(mesh):
    """A clear error for a distributed mesh reached by torch.compile's tracing."""
    import torch

    if getattr(mesh, "is_distributed", False) and (
            torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None):
        raise NotImplementedError(
            f"torch.compile of a shard_map on the distributed mesh {mesh.describe()} is not supported yet: "
            "its collectives are torch.distributed calls that compilation cannot trace. Fix: compile the "
            "code around the shard_mapped call (torch.compiler.disable it), or run it on a simulated mesh."
        )
