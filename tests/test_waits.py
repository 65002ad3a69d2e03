"""The guard's watched wait (shmap/backends/waits.py) against works that finish at awkward moments."""
from __future__ import annotations

import pytest

from shmap.backends.waits import WatchedWaits


class _Work:
    """A gloo work whose sliced wait runs out just before it completes (the race a loaded host hits)."""

    def __init__(self, error=None):
        self.completed, self.error, self.waits = False, error, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if timeout is not None and not self.completed:
            self.completed = True  # completes right after the slice's verdict
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self):
        return self.completed


class _Broken(Exception):
    pass


class _Waits(WatchedWaits):
    def _broken(self, e, what, ranks):
        return _Broken(str(e))

    def describe_current(self):
        return "collective #1"


def test_a_work_that_completes_as_its_slice_runs_out_is_a_success():
    work = _Work()
    _Waits().wait(work, "all_gather", None, gloo=True)  # before the fix: reported as a timed-out collective
    assert len(work.waits) == 2  # the slice that ran out, then the completed work's own answer


def test_a_work_that_completed_with_an_error_still_raises_it():
    with pytest.raises(_Broken, match="Connection closed by peer"):
        _Waits().wait(_Work(error="Connection closed by peer"), "all_gather", None, gloo=True)
