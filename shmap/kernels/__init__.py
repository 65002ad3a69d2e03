"""Kernels: collectives written from remote copies and semaphores (seed 002).

A kernel is a Python function over *refs* (views of a device's buffers and
semaphores) that runs on every device of one mesh axis.  It moves data by
pushing asynchronous remote copies into peers' buffers and synchronises with
DMA, REGULAR and BARRIER semaphores, as on TPU.  The same kernel runs on:

- `interpret(...)`: simulated devices under a seeded scheduler that reports
  data races, deadlocks, leftover semaphores and device exceptions, naming
  the kernel source lines (the specification; what tests use);
- `run_shm(...)` / `ShmGroup(n).run(...)`: real processes on shared memory;
  `ShmTransport` offers the usual collectives per rank process.

`shmap.kernels.library` has ring collectives (ppermute, all-gather, all-reduce,
bidirectional reduce-scatter with nested pipelining, all-to-all, collective
matmul) written only with this API; `shmap.kernels.transport` the direct
shared-memory collectives.

Two additions to the Pallas model, both checked by the interpreter:
`borrow(ref)` (a zero-copy view for heavy local compute, an access lasting
for its `with` block) and `Buffer(..., local=True)` (private memory, like
VMEM: never a remote copy's destination, so the shared-memory runtime can
keep it out of shared memory).

    def right_permute(x_ref, o_ref, send_sem, recv_sem):
        me, n = kernels.device_id(), kernels.num_devices()
        copy = kernels.remote_copy(x_ref, o_ref, send_sem, recv_sem, (me + 1) % n)
        copy.start()
        copy.wait()

    outs = kernels.interpret(right_permute, [[x0], [x1], [x2]], kernels.Buffer(x0.shape),
                             scratch=[kernels.SemaphoreType.DMA] * 2)
"""
from .api import (
    DeviceContext,
    LocalCopy,
    RemoteCopy,
    borrow,
    device_id,
    get_barrier_semaphore,
    local_copy,
    num_devices,
    num_programs,
    program_id,
    remote_copy,
    run_scoped,
    semaphore_read,
    semaphore_signal,
    semaphore_wait,
)
from .errors import (
    DataRaceError,
    DeadlockError,
    DeviceError,
    KernelError,
    KernelTimeoutError,
    KernelUsageError,
    PeerFailedError,
    ScheduleDependenceError,
    SemaphoreLeakError,
)
from .bridge import IDENTITY, call
from .group import ShmGroup, run_shm
from .interpreter import interpret
from .refs import Buffer, Ref, SemaphoreRef, SemaphoreType, ds
from .shm import ShmComm
from .transport import ShmTransport

__all__ = [
    # running kernels
    "interpret", "run_shm", "ShmGroup", "ShmComm", "ShmTransport",
    # calling a kernel from a shard_map body over a mesh axis
    "call", "IDENTITY",
    # specs and refs
    "Buffer", "SemaphoreType", "ds", "Ref", "SemaphoreRef",
    # inside a kernel
    "device_id", "num_devices", "program_id", "num_programs",
    "remote_copy", "local_copy", "RemoteCopy", "LocalCopy",
    "semaphore_signal", "semaphore_wait", "semaphore_read", "get_barrier_semaphore",
    "run_scoped", "borrow", "DeviceContext",
    # errors
    "KernelError", "KernelUsageError", "DataRaceError", "DeadlockError", "SemaphoreLeakError",
    "DeviceError", "ScheduleDependenceError", "KernelTimeoutError", "PeerFailedError",
]
