"""Physical execution behind one small interface; `for_mesh` picks it from the mesh.

A simulated mesh runs every device batched in this process (`simulated`); a
mesh laid over a `torch.distributed` world runs one device per process
(`distributed`).  The choice is the mesh's, so the same program runs on both.
"""
from __future__ import annotations


def for_mesh(mesh):
    """The backend that executes shard_map bodies on `mesh`."""
    if getattr(mesh, "device_mesh", None) is None:
        from .simulated import SIMULATED

        return SIMULATED
    backend = getattr(mesh, "_backend", None)
    if backend is None:
        from .distributed import Distributed

        backend = Distributed(mesh)
        mesh._backend = backend
    return backend
