""":func:`~pipeloom.runtime.comm.watch.wait_in_slices` when a gloo collective completes just after one of its
slices ended: torch's ``Work.wait(timeout)`` raises "Operation timed out!" at the slice's end, and the work may
complete before ``is_completed()`` is asked. That timeout is not the work's error (a CI run once reported a
full_state_dict that every other rank had finished as failed with it); the work's own outcome is."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pipeloom.runtime.comm.watch import poll_work, wait_in_slices


class _Board:
    def first_failure(self):
        return None


class _LateWork:
    """A work whose first timed wait ends with torch's slice timeout, then found complete: successfully, or with
    ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.waits = error, 0

    def wait(self, timeout=None):
        self.waits += 1
        if self.waits == 1 and timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.waits > 0


def test_a_work_that_completes_after_a_slice_ends_succeeded():
    assert wait_in_slices(_LateWork(), timeout=5.0, board=_Board()) is None


def test_a_work_that_failed_reports_its_own_error():
    error = RuntimeError("Connection closed by peer")
    assert wait_in_slices(_LateWork(error), timeout=5.0, board=_Board()) == (f"RuntimeError: {error}", error)
    done = _LateWork(error)
    done.waits = 1  # complete when first looked at (NCCL's works are polled)
    assert poll_work(done, timeout=5.0, board=_Board()) == (f"RuntimeError: {error}", error)
