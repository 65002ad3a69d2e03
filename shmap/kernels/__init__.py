"""Kernels: collectives written from remote copies and semaphores (seed 002)."""
from .api import *  # noqa: F401,F403  (temporary during development)
from .refs import Buffer, SemaphoreType, ds, Ref, SemaphoreRef  # noqa: F401
from .interpreter import interpret  # noqa: F401
from .errors import *  # noqa: F401,F403
