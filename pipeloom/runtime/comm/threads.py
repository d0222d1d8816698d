"""The helper threads of a :class:`~pipeloom.runtime.comm.messenger.Messenger`: one posting gloo sends, one
watching the store for failed ranks (:class:`~pipeloom.runtime.comm.watch.PeerWatch`), stopped together by
``close()`` (or at interpreter exit, before torch's teardown, for an engine never closed)."""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from pipeloom.runtime.comm.watch import PeerWatch

if TYPE_CHECKING:
    from pipeloom.runtime.comm.transport import Posted

__all__ = ["STOP_JOIN_S", "HelperThreads", "SendThread", "close_at_exit", "end_group_at_exit"]


class _Closable(Protocol):
    def close(self) -> None: ...


_LIVE: weakref.WeakSet = weakref.WeakSet()  # engines not yet collected
_BUILT = [False]  # whether this process built an engine (then exit also ends a forgotten process group)


def close_at_exit(engine: _Closable) -> None:
    """Have ``engine`` closed at interpreter exit if the script does not close it (and the default process group
    destroyed if the script forgets it)."""
    _LIVE.add(engine)
    _BUILT[0] = True


def end_group_at_exit() -> None:
    """Have the default process group destroyed at interpreter exit if the script forgets it: this process runs
    pipeloom's runtime on it (``init_ranks`` made it, or ``pipeline()`` was called, whether or not it built an
    engine: one refused before any engine existed had exited aborted about one time in six)."""
    _BUILT[0] = True


@atexit.register
def _close_live_engines() -> None:
    """Close every engine still alive at exit (their threads and group references), while the
    interpreter is still whole; in a process that built an engine, also destroy the default process
    group the script forgot to destroy: left to the interpreter's teardown, gloo's threads abort the
    process ("terminate called without an active exception") in about one exit of five."""
    for engine in list(_LIVE):
        with contextlib.suppress(Exception):
            engine.close()
    if _BUILT[0] and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

STOP_JOIN_S = 5.0  # how long stopping waits for a helper thread


class SendThread:
    """A daemon thread posting gloo sends in queue order, so the compute thread never blocks on one.
    Queue items are ``(posted, global dst, tag)`` (a :class:`~pipeloom.runtime.comm.transport.Posted`); the
    thread fills ``posted.work``. After the first failure, ``(error, posted, dst)``, it posts nothing more."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.queue: queue.Queue[tuple[Posted, int, int] | None] = queue.Queue()
        self.failure: tuple[Exception, Posted, int] | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, args=(group,), name="pipeloom-sends", daemon=True)
        self.thread.start()

    def _run(self, group: dist.ProcessGroup | None) -> None:
        while (item := self.queue.get()) is not None:
            posted, dst, tag = item
            try:
                if self.failure is None and not self.stopping:
                    posted.work = dist.isend(posted.tensor, dst, group=group, tag=tag)
            except Exception as error:  # noqa: BLE001 (gloo reports a dead peer from the post itself)
                self.failure = (error, posted, dst)
            finally:
                del item, posted  # no work or tensor outlives its step in this thread's frame
                self.queue.task_done()
        self.queue.task_done()

    def stop(self) -> None:
        """Skip what is still queued and end the thread."""
        self.stopping = True
        self.queue.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(STOP_JOIN_S)


@dataclass(slots=True)
class HelperThreads:
    """A messenger's helper threads, each started when first needed; ``stop`` ends both."""

    sender: SendThread | None = None
    watch: PeerWatch | None = None
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True
        if self.sender is not None:
            self.sender.stop()
        if self.watch is not None:
            self.watch.stop(STOP_JOIN_S)
