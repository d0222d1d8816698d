"""A rank's point-to-point messages (:class:`Messenger`): the backend's transport, waits bounded by the
timeout, and the failures ranks leave for each other; one step's messages are
:class:`~pipeloom.runtime.comm.step_messages.StepMessages` (receives posted early, shape discovery).

Every wait is bounded by the timeout and hears of another rank's failure within about a second
(:mod:`pipeloom.runtime.comm.watch`). Gloo sends are posted by a helper thread; :meth:`Messenger.close`
ends it and the watch (also at interpreter exit, for a messenger never closed).
"""

from __future__ import annotations

import collections
import datetime
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeloom.runtime.comm.step_messages import LeafMeta, StepMessages
from pipeloom.runtime.comm.threads import HelperThreads
from pipeloom.runtime.comm.transport import Posted, Transport, transport_for
from pipeloom.runtime.comm.watch import (
    FailureBoard,
    PeerWatch,
    close_connections,
    completes_alone,
    mark_closed,
    poll_work,
    wait_in_slices,
)
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.parallel.tp import TensorParallel
from pipeloom.runtime.program import Unit

__all__ = ["KEPT_WORKS", "FailureScope", "Messenger"]

KEPT_WORKS = 4
"""How many of its last waited gloo works a messenger keeps until the next step begins (or the messenger
goes). Gloo's worker thread drops its own reference to a collective a moment after the waiting thread
returns; when it drops the last one, it frees the work's tensors on that thread, which takes the GIL, and
during interpreter shutdown right after a last step that aborts the process ("terminate called without an
active exception", seen under load about one exit in fifteen). Held here, the work is freed by Python."""


def _same(rank: int) -> int:
    return rank


@dataclass(frozen=True, slots=True)
class FailureScope:
    """Which ranks share one failure board: by default this pipeline's group (board numbers are group
    ranks); with data-parallel replicas every rank of the mesh (numbers are global ranks), so a failure
    in one replica stops the others' waits too."""

    rank: int  # this rank's number on the board
    world: int  # numbers on the board: 0 .. world - 1
    of_peer: Callable[[int], int] = _same  # a peer's group rank -> its number on the board
    name: Callable[[int], str] = str  # a board number -> how messages name that rank
    wake: tuple[dist.ProcessGroup, ...] = ()  # other groups whose connections a failure also closes


class Messenger:
    """The messages of one engine's rank over ``group`` (global peer ranks from ``to_global``): the
    backend's :class:`~pipeloom.runtime.comm.transport.Transport`, waits bounded by the timeout, and the
    failures other ranks leave in the store. Each step's messages live in a :class:`StepMessages`."""

    def __init__(self, *, rank: int, group: dist.ProcessGroup | None, to_global: Callable[[int], int],
                 device: torch.device, timeout: float, units: Sequence[Unit],
                 pair_order: dict[tuple[int, int], tuple[int, ...]],
                 unit_of: dict[tuple[str, int, int, int], int], store: dist.Store | None, run_id: str,
                 transport: Transport | None = None, scope: FailureScope | None = None,
                 tp: TensorParallel | None = None, scatter: bool = True) -> None:
        self.rank = rank
        self.tp = tp if tp is not None else TensorParallel()
        self.scatter = scatter and self.tp.size > 1  # replicated boundary tensors cross once per "tp" group
        self.group = group
        self.to_global = to_global
        self.device = device
        self.timeout = timeout
        self.units = units
        self.unit_of = unit_of
        self.store = store
        self.run_id = run_id
        world = dist.get_world_size(group) if group is not None else 1
        self.scope = scope if scope is not None else FailureScope(rank=rank, world=world)
        self.board = FailureBoard(store, run_id=run_id, rank=self.scope.rank, world_size=self.scope.world)
        self.polled = self.device.type != "cpu"  # NCCL works complete by themselves; gloo's need wait()
        self._wait_timeout = datetime.timedelta(seconds=timeout)
        self.position = {uid: i for order in pair_order.values() for i, uid in enumerate(order)}
        self.incoming = {src: order for (src, dst), order in pair_order.items() if dst == rank}
        self._send_error: PipelineError | None = None
        self._helpers = HelperThreads()
        self._waited: collections.deque = collections.deque(maxlen=KEPT_WORKS)  # see KEPT_WORKS
        self.transport = transport if transport is not None else transport_for(group, self._helpers)
        self._closer = weakref.finalize(self, self._helpers.stop)  # runs at close(), collection or exit

    def begin(self, metas: dict[int, list[LeafMeta]], specs: dict[int, list], *, discover: bool,
              events: list | None, unit_filter: Callable[[Unit], bool]) -> StepMessages:
        """A step's messages. ``metas``/``specs`` map unit id -> leaf metas / value structures: known from
        an earlier step with these input shapes, or (``discover``) filled as units arrive."""
        if self._helpers.stopped:
            raise PipelineError("this engine was closed (close()); build a new one to take more steps")
        self._waited.clear()
        return StepMessages(self, metas, specs, discover=discover, events=events, unit_filter=unit_filter)

    # --------------------------------------------------------------------- outside the units

    def post_send(self, tensor: torch.Tensor, peer: int, tag: int) -> Posted:
        """Send ``tensor`` to group rank ``peer`` outside the step's units (e.g. replica gradients); its
        work is filled in once posted (see :meth:`wait_posted`)."""
        if self._helpers.stopped:
            raise PipelineError("this engine was closed (close()); build a new one to take more steps")
        posted = Posted(tensor)
        self.transport.send_now(posted, self.to_global(peer), tag)
        return posted

    def wait_posted(self, entries: Sequence[Posted], what: str) -> None:
        """Wait (bounded by the timeout) for sends made with :meth:`post_send`."""
        self.sends_posted()
        for posted in entries:
            self._raise_failed(self.await_work(posted.work), what, None)

    def wait_work(self, work, what: str, peer: int | None = None) -> None:
        """Wait for a work outside the step's units (loss, replica gradients, collectives), bounded by
        the timeout; a failure names ``what`` and what the peer (or any rank) left in the store. ``peer``:
        the group rank of a point-to-point work's peer; without one the work may also be a collective,
        which is then waited for in slices (:func:`~pipeloom.runtime.comm.watch.wait_in_slices`)."""
        self._raise_failed(self.await_work(work) if peer is not None else self.await_any(work), what, peer)

    def _raise_failed(self, failed: tuple[str, Exception | None] | None, what: str, peer: int | None) -> None:
        if failed is not None:
            reason = self.failure_reason(peer)
            raise PipelineError(f"rank {self.rank}: {what} failed: {failed[0]}; "
                                f"{reason or 'another rank failed or hung'}") from failed[1]

    def await_any(self, work) -> tuple[str, Exception | None] | None:
        """:meth:`await_work` for a work that may be a gloo collective: those complete by themselves and are
        waited for in slices with a look at the store between two, so another rank's failure ends the wait
        whatever gloo's connections do. (Telling them apart costs tens of microseconds: the step's own
        point-to-point waits call :meth:`await_work` directly.)"""
        if self.polled or not completes_alone(work):
            return self.await_work(work)
        self._waited.append(work)
        failed = wait_in_slices(work, timeout=self.timeout, board=self.board)
        if failed is not None and failed[1] is None and self.store is not None:
            self._close_connections()  # frees gloo's thread still waiting in the collective
        return failed

    def await_work(self, work) -> tuple[str, Exception | None] | None:
        """Wait for ``work`` within the timeout: None when done, else (what went wrong, the error). Another
        rank's failure in the store ends the wait within about ``PEER_POLL_S`` seconds (module watch)."""
        if self.polled:
            return poll_work(work, timeout=self.timeout, board=self.board)
        self._waited.append(work)
        watch = self._watch()
        if watch is not None:
            watch.waiting += 1
        try:
            done = work.wait(timeout=self._wait_timeout)
        except Exception as error:  # noqa: BLE001 (gloo raises on timeouts and on a closed connection alike)
            if watch is not None and watch.failure is not None:  # the watch closed the connections
                return "stopped on another rank's failure", error
            # gloo closed the group's connections: on a timeout itself, or a peer closed its side
            mark_closed(self.closed_on_failure(), f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            return f"{type(error).__name__}: {error}", error
        finally:
            if watch is not None:
                watch.waiting -= 1
        return None if done is not False else (f"no answer within {self.timeout:g} s", None)

    def _watch(self) -> PeerWatch | None:
        """The thread looking for other ranks' failures while this one waits (none without a store)."""
        helpers = self._helpers
        if helpers.watch is None and self.store is not None and not helpers.stopped:
            helpers.watch = PeerWatch(self.board, self._close_connections)
        return helpers.watch

    def _close_connections(self) -> None:
        """Fail every pending operation of this rank on its groups (after another rank's failure)."""
        watch = self._helpers.watch
        found = watch.failure if watch is not None else None
        why = f"{self._named(found[0])} failed: {found[1]}" if found is not None else "another rank failed"
        for group in self.closed_on_failure():
            close_connections(group, why=why.splitlines()[0][:300])

    def closed_on_failure(self) -> list[dist.ProcessGroup]:
        """The groups whose connections a failure closes (this rank's after another's failure, and the peers'
        after this rank's)."""
        return [group for group in (self.group, *self.scope.wake) if group is not None]

    def sends_posted(self) -> None:
        """Wait until the transport has posted every queued send; a failed post raises here."""
        failure = self.transport.settle()
        if failure is not None and self._send_error is None:
            error, posted, dst = failure
            detail = f"{type(error).__name__}: {error}"
            unit = posted.unit
            self._send_error = PipelineError(
                self.failure_text(unit.dst, "sending", unit, detail) if unit is not None
                else f"rank {self.rank}: sending to global rank {dst} failed: {detail}")
            self._send_error.__cause__ = error
        if self._send_error is not None:
            raise self._send_error

    # ---------------------------------------------------------------------------- lifetime

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._helpers.stopped

    def close(self) -> None:
        """End the helper threads (sends, failure watch). Idempotent; also runs when the messenger is
        collected and at interpreter exit, before torch's teardown."""
        self._closer()

    def release(self) -> None:
        """After :meth:`close`: forget the process group and the store (a closed messenger sends nothing)."""
        self.group = None
        self.transport.group = None
        self.to_global = lambda r: r
        self.store = None
        self.board.store = None

    # ----------------------------------------------------------------------------- failures

    def units_name(self, unit: Unit) -> str:
        what = "outputs" if unit.kind == "F" else "gradients"
        return f"{what} of stage {unit.producer} for stage {unit.consumer}, micro-batch {unit.microbatch}"

    def failure_text(self, peer: int, doing: str, unit: Unit, detail: str) -> str:
        where = f"rank {self.rank} stopped while {doing} {self.units_name(unit)} (rank {peer})"
        reason = self.failure_reason(peer)
        if reason:
            return f"{where}: {reason}"
        return (f"{where}: {detail}; rank {peer} died, hung or runs a different schedule (raise timeout= if its "
                "work is just slow)")

    def failure_reason(self, peer: int | None) -> str | None:
        """``rank R failed: message`` for the failure behind a broken wait: ``peer``'s own, else the one
        the watch found (kept, as the store may be gone by now), else any other rank's."""
        watch = self._helpers.watch
        found = watch.failure if watch is not None else None
        mine = self.scope.of_peer(peer) if peer is not None else None
        if mine is not None and (found is None or found[0] != mine) and (message := self.board.message_of(mine)):
            return f"rank {peer} failed: {message}"
        if found is None:
            found = self.board.first_failure(quick=False)
        if found is None:
            return None
        return f"{self._named(found[0])} failed: {found[1]}"

    def _named(self, rank: int) -> str:
        """``rank R`` (a pipeline rank), or ``global rank G (pp, tp)`` on a mesh with "tp"."""
        who = self.scope.name(rank)
        return who if who.startswith("global") else f"rank {who}"

    def report(self, message: str) -> None:
        """Leave this rank's failure where the other ranks look while they wait."""
        self.board.report(message)
