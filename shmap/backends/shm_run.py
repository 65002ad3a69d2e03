"""A collective through a registered transport (`configure_distributed(transport='shm')`), under the guard.

The transport (`shmap.kernels.ShmTransport`: kernels on shared memory) moves the
data and completes the collective in the caller; around it the guard does what
it does around a gloo collective (`transports._start` and `InFlight.finish`):
counts it, carries its signature in the payload or exchanges one first, and
watches the wait.
"""
from __future__ import annotations

import time

import torch

from ..errors import DistributedError
from .groups import Group
from .waits import Stall


def _run_shm(g: Group, shm, kind, shape, dtype, fn, extra="", seal=None):
    """As `_run`, with the data moved by the group's shared-memory transport `shm` (completes here).

    `seal`: the payload carries the signature (a psum's trailer, an all_gather's sealed rows: built by
    the caller as for gloo, `sealed.py`); its received part (`recv`, set by `fn` where the transport
    allocates the output) is checked.  Without one, a signature exchange runs first (checks on).  While the transport's kernel
    waits, the guard watches as a gloo wait does (`waits.Stall`): a peer that failed or exited outside
    any kernel is reported within a poll interval, a stalled mismatch is named, the timeout applies."""
    w = g._backend.watch
    with torch.no_grad():
        pending = w.begin(kind, g.axes, shape, dtype, extra, exchange=seal is None)
        w.verify(pending)
        if seal is not None:
            w.seal(seal)
        # (a transport that takes a watcher, not watched already)
        began = time.monotonic()
        stall = Stall(w, None, g.ranks, begun=began) if getattr(shm, "watcher", False) is None else None
        if stall is not None:
            shm.watcher = stall.tick
        try:
            result = fn()
        except DistributedError:  # the guard's own findings, while the kernel waited
            raise
        except Exception as e:  # noqa: BLE001 - the transport's: a mismatch the black boxes show is named
            raise w.transport_failed(e, g.ranks, time.monotonic() - began) from e
        finally:
            if stall is not None:
                shm.watcher = None
                stall.close()
        if seal is not None:
            w.unseal(seal, g.ranks)
    w.done()
    return result
