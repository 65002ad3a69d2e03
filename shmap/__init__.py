"""shmap: JAX's per-device SPMD programming model (`shard_map`) for PyTorch.

Write one per-device program with explicit collectives; run it on a simulated
mesh in one process (the default: debug with print/pdb) or on real processes.
Values in a body carry their device variance; autodiff gets the cheapest
correct backward communication.
"""
from .collectives import (
    all_gather,
    all_gather_invariant,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pcast,
    pmin,
    ppermute,
    pshuffle,
    psum,
    psum_scatter,
    pvary,
    unreduced_axes,
    vma,
)
from .comm import CommEvent, CommLog, comm_log
from .errors import (
    CollectiveArgumentError,
    CollectiveShapeError,
    InPlaceInputError,
    InPlaceOutputError,
    ShmapError,
    SpecError,
    TransformError,
    UnboundAxisError,
    VaryingControlFlowError,
    VmaError,
)
from .mesh import Mesh, P, PartitionSpec, make_mesh
from .shard_map import shard_map
from . import interop  # noqa: F401  (autograd.Function and torch.func on body values)
from . import remat  # noqa: F401  (torch.utils.checkpoint in a compiled body: the compiler recomputes)
from .pmap import pmap
from .jit import JitError, jit
from .backends.watchdog import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    RankFailedError,
    configure_distributed,
    shutdown_distributed,
)
from .dtensor import device_put
from .visualize import visualize_sharding
from .launch import SpawnError, spawn
from . import kernels  # noqa: E402  (remote copies, semaphores, the verifying interpreter)

__all__ = [
    "Mesh", "make_mesh", "P", "PartitionSpec", "shard_map", "pmap", "jit",
    "psum", "pmean", "pmax", "pmin", "psum_scatter", "all_gather", "all_gather_invariant",
    "ppermute", "pshuffle", "all_to_all", "axis_index", "axis_size", "pvary", "pcast", "vma",
    "unreduced_axes",
    "comm_log", "CommLog", "CommEvent",
    "ShmapError", "SpecError", "VmaError", "UnboundAxisError", "CollectiveShapeError",
    "CollectiveArgumentError", "VaryingControlFlowError", "InPlaceInputError", "InPlaceOutputError", "JitError",
    "TransformError",
    "device_put", "visualize_sharding", "configure_distributed", "shutdown_distributed", "spawn",
    "DistributedError", "RankFailedError", "CollectiveMismatchError", "CollectiveTimeoutError", "SpawnError",
    "kernels",
]
