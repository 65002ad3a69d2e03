"""Kernel errors, and where in the user's kernel they happened.

A kernel bug (a race, a hang, a leftover semaphore) is only useful to report if
the report points at the kernel's own source line, not at the runtime that
noticed it.  `capture_site` walks the Python stack outwards and stops at the
first frame that is not part of the kernel runtime; every recorded event (an
access, a copy start, a signal, a wait) carries such a `Site`.

All errors are plain exceptions with a single message argument so that the
shared-memory runtime can pickle them across processes unchanged.
"""
from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass

from ..errors import ShmapError

# Files of the runtime itself.  Frames in them are skipped when looking for the
# user's line.  The kernel library (library.py, transport.py) is *user* code as
# far as reports go: a bug in a library kernel should point into the library.
_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNTIME_FILES = frozenset(
    os.path.join(_HERE, name)
    for name in ("errors.py", "refs.py", "api.py", "common.py", "races.py", "interpreter.py",
                 "interpreter_device.py", "segments.py", "shm.py", "shm_device.py", "group.py")
)
_CONTEXTLIB = os.path.abspath(__import__("contextlib").__file__)


class KernelError(ShmapError):
    """Base class of every error the kernel runtimes raise on purpose."""


class KernelUsageError(KernelError, ValueError):
    """A kernel API was called with arguments that can never be right
    (mismatched copy shapes, a DMA semaphore used as a regular one, ...)."""


class DataRaceError(KernelError):
    """Two accesses to overlapping elements, at least one a write, that no
    semaphore wait or barrier orders."""


class DeadlockError(KernelError):
    """Every live device is blocked and no copy is in flight that could wake one."""


class SemaphoreLeakError(KernelError):
    """A kernel ended with a semaphore not at zero (a signal or copy nobody waited for)."""


class DeviceError(KernelError):
    """An exception escaped the kernel on one device; every other device was stopped."""


class ScheduleDependenceError(KernelError):
    """Two schedules of the same kernel produced different outputs."""


class KernelTimeoutError(KernelError, TimeoutError):
    """Shared-memory runtime: a wait did not complete within the timeout
    (a deadlock, or a peer process that stalled or died)."""


class PeerFailedError(KernelError):
    """Shared-memory runtime: another process of the group failed, so this one stopped."""


@dataclass(frozen=True)
class Site:
    """A source location in user code."""

    filename: str
    lineno: int
    function: str

    def code(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def __str__(self) -> str:
        name = self.filename
        try:
            rel = os.path.relpath(name)
            if not rel.startswith(".."):
                name = rel
        except ValueError:  # different drive (Windows)
            pass
        code = self.code()
        where = f"{name}:{self.lineno} in {self.function}"
        return f"{where}: `{code}`" if code else where


UNKNOWN_SITE = Site("<unknown>", 0, "?")


_runtime_cache: dict = {}


def _is_runtime(filename: str) -> bool:
    hit = _runtime_cache.get(filename)
    if hit is None:
        path = os.path.abspath(filename)
        hit = _runtime_cache[filename] = (path in _RUNTIME_FILES or path == _CONTEXTLIB
                                          or filename == "<string>")
    return hit


def capture_site(skip: int = 1) -> Site:
    """The innermost frame of the caller's stack that is user code (cheap: a hot path)."""
    frame = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if not _is_runtime(code.co_filename):
            return Site(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return UNKNOWN_SITE


def site_from_traceback(tb) -> Site:
    """The innermost user frame of an exception's traceback."""
    best = UNKNOWN_SITE
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not _is_runtime(filename):
            best = Site(filename, tb.tb_lineno, tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return best
