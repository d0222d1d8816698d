"""Failures that reach every rank within a second: a rank that fails leaves its message in the process
group's store, and every wait of the engine looks there at most every ``PEER_POLL_S`` seconds, so the
other ranks raise that message whether or not the failed process exits.

Gloo's point-to-point works cannot be polled (``is_completed`` stays False until ``wait`` is called, and
a ``wait`` that times out closes the group's connections), so on the CPU the wait blocks as before and a
helper thread (:class:`PeerWatch`) looks at the store while it lasts; on finding another rank's failure
it closes this rank's connections of the group, which wakes the wait at once. Gloo's collectives
complete by themselves and survive a ``wait`` that times out: :func:`wait_in_slices` waits for them in
slices and looks at the store between two, so a failure is seen even where closing connections would not
end the collective. Accelerator backends
(NCCL) complete their works by themselves: there :func:`poll_work` polls ``is_completed`` and the store.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["PEER_POLL_S", "FailureBoard", "PeerWatch", "close_connections", "closed_by", "completes_alone",
           "mark_closed", "poll_work", "wait_in_slices"]

ERROR_KEY = "pipeloom/error/{run}/{rank}"  # a failed rank's message
COUNT_KEY = "pipeloom/failed/{run}"  # ranks that reported so far: one store round trip per look
FIRST_KEY = "pipeloom/first/{run}"  # the first rank that reported: the cause, the others' reports follow it
PEER_POLL_S = 0.5  # seconds between two looks at the store while a wait lasts
BREAK_TAG = (1 << 30) + 1  # a tag no rank sends on: a receive on it that times out closes the connections
_FIRST_PAUSE_S = 2e-6  # poll_work's first sleep; it doubles up to _LAST_PAUSE_S
_LAST_PAUSE_S = 1e-3

logger = logging.getLogger(__name__)


class FailureBoard:
    """The failure messages of one engine's ranks in the process group's store (none without a store)."""

    def __init__(self, store: dist.Store | None, *, run_id: str, rank: int, world_size: int) -> None:
        self.store = store
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self._count_key = COUNT_KEY.format(run=run_id)
        self._first_key = FIRST_KEY.format(run=run_id)

    def report(self, message: str) -> None:
        """Leave this rank's failure where the other ranks look while they wait."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # best effort: the peers' timeouts still bound their wait
                self.store.set(ERROR_KEY.format(run=self.run_id, rank=self.rank), message)
                if self.store.add(self._count_key, 1) == 1:
                    self.store.set(self._first_key, str(self.rank))

    def message_of(self, rank: int) -> str | None:
        """The failure message ``rank`` left, if any."""
        if self.store is None:
            return None
        key = ERROR_KEY.format(run=self.run_id, rank=rank)
        try:
            if self.store.check([key]):
                return self.store.get(key).decode()
        except Exception:  # noqa: BLE001 (the store may be gone with the failed rank; the wait's error says)
            return None
        return None

    def first_failure(self, *, quick: bool = True) -> tuple[int, str] | None:
        """(rank, message) of another rank that failed: the first to report, else the lowest. ``quick``:
        one store round trip (the count of reports) while no rank failed; else every rank is asked for."""
        if self.store is None:
            return None
        try:
            if quick and self.store.add(self._count_key, 0) == 0:
                return None
            first = int(self.store.get(self._first_key)) if self.store.check([self._first_key]) else self.rank
        except Exception:  # noqa: BLE001 (a store that is gone cannot tell; the waits' own errors will)
            return None
        if first != self.rank and (message := self.message_of(first)) is not None:
            return first, message
        for rank in range(self.world_size):
            if rank != self.rank and (message := self.message_of(rank)) is not None:
                return rank, message
        return None


class PeerWatch:
    """While this rank waits (``waiting`` > 0), a daemon thread asks ``board`` for another rank's failure
    every ``PEER_POLL_S`` seconds; on the first one it records it in ``failure`` and calls ``wake``, and calls it
    again at each later look that finds this rank still waiting (a wake that did not end the wait, or a wait begun
    after it, is not left to the engine's timeout or to the failed process's exit)."""

    def __init__(self, board: FailureBoard, wake: Callable[[], None]) -> None:
        self.board = board
        self.wake = wake
        self.waiting = 0  # waits in progress, counted by the compute thread (an int: no lock, no cost)
        self.failure: tuple[int, str] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeloom-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(PEER_POLL_S):
            if not self.waiting:
                continue
            found = self.failure or self.board.first_failure()
            if found is not None and not self._stopped.is_set():
                if self.failure is None:
                    logger.warning("rank %d failed (%s); waking this rank's waits", found[0], found[1])
                self.failure = found
                self.wake()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (within ``timeout`` seconds even if a store call hangs)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


_CLOSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> the failure that closed its connections


def mark_closed(groups: list[dist.ProcessGroup], why: str) -> None:
    """Remember that ``groups``' connections are gone (by the group object: a new group, even of the same name, is
    another): this rank closed them after another's failure, gloo closed them on a wait that failed or timed out, or
    this rank's own step failed while its peers waited on it (they close theirs on hearing of it)."""
    for group in groups:
        _CLOSED.setdefault(group, why)


def closed_by(group: dist.ProcessGroup) -> str | None:
    """Why ``group``'s connections were closed in this process (:func:`mark_closed`), or None: nothing sent on it
    arrives again."""
    return _CLOSED.get(group)


def close_connections(group: dist.ProcessGroup | None, *, why: str = "another rank failed") -> None:
    """Make every pending operation of this rank on ``group`` (gloo) fail now, as if the process had
    exited: a receive that times out makes gloo close all of the group's connections ("Application
    timeout caused pair closure"), which also tells the peers.

    A receive from a peer that closed its side first fails at once without closing the others (a
    pending collective may still wait on a live but failed peer), so this tries every other rank of the
    group in turn; after the first timeout the remaining receives fail at once too."""
    if group is None:
        return
    mark_closed([group], why)
    buffer = torch.empty(1)
    me = dist.get_rank()
    for peer in dist.get_process_group_ranks(group):
        if peer != me:
            with contextlib.suppress(Exception):
                work = dist.irecv(buffer, peer, group=group, tag=BREAK_TAG)
                if work is not None:  # None only for a group without this rank
                    work.wait(timeout=datetime.timedelta(milliseconds=1))


def completes_alone(work: dist.Work) -> bool:
    """Whether ``work`` completes without a ``wait`` (and so can be waited for in slices): gloo's
    collectives run on its own threads and have a future; its point-to-point works have none."""
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


def wait_in_slices(work: dist.Work, *, timeout: float, board: FailureBoard) -> tuple[str, Exception | None] | None:
    """Wait for a work that completes alone (:func:`completes_alone`) in slices of ``PEER_POLL_S`` s,
    looking at the store between two: None when done, else (why not, the work's error). A slice that
    ends first leaves the work running (gloo's "Operation timed out!" for a collective), so a failed
    rank is seen within a slice whatever its process and connections do; no latency is added."""
    start = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            return f"no answer within {timeout:g} s", None
        try:
            work.wait(timeout=datetime.timedelta(seconds=min(PEER_POLL_S, left)))
            return None
        except Exception:  # noqa: BLE001 (a slice's end and the work's own failure raise alike)
            if work.is_completed():  # it failed, or it completed just after the slice ended: its own outcome
                return _outcome(work)
        if (found := board.first_failure()) is not None:
            return f"rank {found[0]} failed: {found[1]}", None


def poll_work(work: dist.Work, *, timeout: float, board: FailureBoard) -> tuple[str, Exception | None] | None:
    """Wait for ``work`` by polling ``is_completed`` (sleeping 2 us, doubling up to 1 ms) and the store
    (every ``PEER_POLL_S`` s): None when done, else (why not, the work's error). For backends whose works
    complete by themselves (NCCL), never gloo's point-to-point ones."""
    if not work.is_completed():
        start = time.monotonic()
        look = start + PEER_POLL_S
        pause = _FIRST_PAUSE_S
        while not work.is_completed():
            now = time.monotonic()
            if now >= look:
                look = now + PEER_POLL_S
                if (found := board.first_failure()) is not None:
                    return f"rank {found[0]} failed: {found[1]}", None
            if now - start >= timeout:
                return f"no answer within {timeout:g} s", None
            time.sleep(pause)
            pause = min(2 * pause, _LAST_PAUSE_S)
    return _outcome(work)


def _outcome(work: dist.Work) -> tuple[str, Exception | None] | None:
    """A completed work's outcome: None when it succeeded, else (its error, as text, and the error). A slice's
    timeout is not the work's error: the work may complete between the slice's end and the look at it."""
    try:
        work.wait()  # complete: raises the work's own error, if it failed
    except Exception as error:  # noqa: BLE001 (the caller names the peer and the store's message)
        return f"{type(error).__name__}: {error}", error
    return None
