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


class _FailedBoard:
    """Rank 1 failed; counts the looks at the store."""

    def __init__(self) -> None:
        self.looks = 0

    def first_failure(self):
        self.looks += 1
        return 1, "injected fault"


def test_the_watch_wakes_again_while_the_wait_lasts():
    """A wake that did not end this rank's wait (a CI run once saw a rank learn of the failure only from the failed
    process's exit) is repeated at the next look, and the looks stop once the wait is over."""
    import threading

    from pipeloom.runtime.comm.watch import PEER_POLL_S, PeerWatch

    woken = threading.Semaphore(0)
    board = _FailedBoard()
    watch = PeerWatch(board, woken.release)
    watch.waiting = 1  # a wait that no wake ends
    try:
        assert woken.acquire(timeout=10 * PEER_POLL_S) and woken.acquire(timeout=10 * PEER_POLL_S)
        assert watch.failure == (1, "injected fault") and board.looks == 1  # the failure is asked for once
        watch.waiting = 0  # the wait ended: no more wakes
        woken.acquire(timeout=3 * PEER_POLL_S)  # one wake may have been under way
        assert not woken.acquire(timeout=3 * PEER_POLL_S)
    finally:
        watch.stop()
