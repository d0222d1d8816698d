"""Point-to-point messages of one step: receives posted early in each sender's order, sends kept until
done, waits bounded by a timeout, and the first step's shape discovery.

Every message belongs to a :class:`~pipeloom.runtime.lower.Unit`. A unit's tensors travel as one
message each, tagged with their position in the (sender, receiver) stream, and every receiver posts
its receives in the sender's order — what gloo's tags and NCCL's in-order matching both need. On a
step whose input shapes were not seen before, each forward unit is preceded by its description
(structure, shapes, dtypes), so the receiver can allocate; later steps with the same input shapes
post their receives before the data exists.

Every wait is bounded by the timeout and hears of another rank's failure within about a second
(:mod:`pipeloom.runtime.watch`). Gloo sends are posted by a helper thread; :meth:`Messenger.close`
ends it and the watch (also at interpreter exit, for a messenger never closed).
"""

from __future__ import annotations

import datetime
import pickle
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeloom.runtime.lower import PipelineError, Unit, forward_unit
from pipeloom.runtime.threads import HelperThreads, SendThread
from pipeloom.runtime.watch import FailureBoard, PeerWatch, close_connections, poll_work

__all__ = ["LeafMeta", "Messenger", "flatten", "unflatten"]


@dataclass(frozen=True, slots=True)
class LeafMeta:
    """Shape, dtype and whether one tensor of a message requires grad."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(tensor: torch.Tensor) -> LeafMeta:
        return LeafMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    def describe(self) -> str:
        grad = " requiring grad" if self.requires_grad else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}{grad}"


def flatten(value: object) -> tuple[list[torch.Tensor], object]:
    """Tensor leaves of a (nested) tuple/list/dict of tensors, and its structure for :func:`unflatten`."""
    leaves: list[torch.Tensor] = []

    def walk(v: object) -> object:
        if isinstance(v, torch.Tensor):
            leaves.append(v)
            return None
        if isinstance(v, (tuple, list)) and v:
            return (type(v).__name__, [walk(x) for x in v])
        if isinstance(v, dict) and v:
            return ("dict", list(v.keys()), [walk(x) for x in v.values()])
        raise TypeError(type(v).__name__)  # what check_stage_value refuses, so callers can ask it why

    return leaves, walk(value)


def unflatten(leaves: Sequence[torch.Tensor], spec: object) -> object:
    """Rebuild a value from its leaves and the structure :func:`flatten` returned."""
    it = iter(leaves)

    def build(s: object) -> object:
        if s is None:
            return next(it)
        if s[0] == "dict":
            return dict(zip(s[1], (build(x) for x in s[2])))
        items = [build(x) for x in s[1]]
        return tuple(items) if s[0] == "tuple" else items

    return build(spec)


@dataclass(slots=True)
class _Posted:
    """Receives of one unit: buffers and their works (None where already complete)."""

    buffers: list[torch.Tensor]
    works: list


class Messenger:
    """The step's messages for one rank over ``group`` (global peer ranks from ``to_global``)."""

    def __init__(self, *, rank: int, group: object, to_global: Callable[[int], int], device: torch.device,
                 timeout: float, units: Sequence[Unit], pair_order: dict[tuple[int, int], tuple[int, ...]],
                 unit_of: dict[tuple[str, int, int, int], int], batch: bool, store: object, run_id: str) -> None:
        self.rank = rank
        self.group = group
        self.to_global = to_global
        self.device = device
        self.timeout = timeout
        self.units = units
        self.unit_of = unit_of
        self.batch = batch  # NCCL: post each point's sends and receives as one batch
        self.store = store
        self.run_id = run_id
        world = dist.get_world_size(group) if group is not None else 1
        self.board = FailureBoard(store, run_id=run_id, rank=rank, world_size=world)
        self.peer = to_global((rank + 1) % world)  # whom close_connections' receive names
        self.polled = self.device.type != "cpu"  # NCCL works complete by themselves; gloo's need wait()
        self._wait_timeout = datetime.timedelta(seconds=timeout)
        self.position = {uid: i for order in pair_order.values() for i, uid in enumerate(order)}
        self.incoming = {src: order for (src, dst), order in pair_order.items() if dst == rank}
        self.events: list | None = None
        self._send_error: PipelineError | None = None
        self._helpers = HelperThreads()
        self._closer = weakref.finalize(self, self._helpers.stop)  # runs at close(), collection or exit

    # --------------------------------------------------------------------------- per step state

    def begin(self, metas: dict[int, list[LeafMeta]], specs: dict[int, list], *, discover: bool,
              events: list | None, unit_filter: Callable[[Unit], bool]) -> None:
        """Start a step. ``metas``/``specs`` map unit id -> leaf metas / value structures: known from an
        earlier step with these input shapes, or (``discover``) filled as units arrive."""
        self.metas = metas
        self.discover = discover
        self.specs = specs
        self.events = events
        self.filter = unit_filter
        self.send_tag = {}
        self.recv_tag = {}
        self.posted: dict[int, _Posted] = {}
        self.next_index = {src: 0 for src in self.incoming}
        self.sent: list[list] = []
        self.batch_ops: list = []

    def _tag(self, table: dict[int, int], peer: int) -> int:
        tag = table.get(peer, 0)
        table[peer] = tag + 1
        return tag

    def _note(self, name: str, kind: str, start: int) -> None:
        if self.events is not None:
            self.events.append((name, kind, start, time.time_ns()))

    # --------------------------------------------------------------------------------- sending

    def send(self, unit: Unit, leaves: list[torch.Tensor], spec: list | None) -> None:
        """Send one unit's tensors (forward values, or gradients) to its receiver."""
        start = time.time_ns() if self.events is not None else 0
        dst = self.to_global(unit.dst)
        if self.discover and unit.kind == "F":
            blob = torch.frombuffer(bytearray(pickle.dumps((spec, [LeafMeta.of(t) for t in leaves]))),
                                    dtype=torch.uint8)
            size = torch.tensor([blob.numel()], dtype=torch.int64)
            self._isend(size.to(self.device), dst, unit)
            self._isend(blob.to(self.device), dst, unit)
        for tensor in leaves:
            self._isend(tensor.detach().contiguous(), dst, unit)
        if self.events is not None:
            self._note(f"SEND {self.units_name(unit)} to {unit.dst}", "send", start)

    def _isend(self, tensor: torch.Tensor, dst: int, unit: Unit) -> None:
        tag = self._tag(self.send_tag, unit.dst)
        if self.batch:
            entry = [None, tensor, unit]
            self.batch_ops.append((dist.P2POp(dist.isend, tensor, dst, self.group, tag), entry, 0))
            self.sent.append(entry)
        else:
            entry = [None, tensor, unit]
            self.sent.append(entry)
            self._sender().queue.put((entry, dst, tag))

    def post_send(self, tensor: torch.Tensor, peer: int, tag: int) -> list:
        """Send ``tensor`` to group rank ``peer`` outside the step's units (e.g. replica gradients);
        returns ``[work, tensor, None]``, the work filled in once posted (see :meth:`wait_posted`)."""
        entry = [None, tensor, None]
        if self.batch:
            entry[0] = dist.isend(tensor, self.to_global(peer), group=self.group, tag=tag)
        else:
            self._sender().queue.put((entry, self.to_global(peer), tag))
        return entry

    def wait_posted(self, entries: list, what: str) -> None:
        """Wait (bounded by the timeout) for sends made with :meth:`post_send`."""
        self._sends_posted()
        for work, _, _ in entries:
            self.wait_work(work, what)

    def wait_work(self, work, what: str, peer: int | None = None) -> None:
        """Wait for a work outside the step's units (loss, replica gradients, collectives), bounded by
        the timeout; a failure names ``what`` and what the peer (or any rank) left in the store."""
        failed = self._await(work)
        if failed is not None:
            reason = self.failure_reason(peer)
            raise PipelineError(f"rank {self.rank}: {what} failed: {failed[0]}; "
                                f"{reason or 'another rank failed or hung'}") from failed[1]

    def _await(self, work) -> tuple[str, Exception | None] | None:
        """Wait for ``work`` within the timeout: None when done, else (what went wrong, the error). Another
        rank's failure in the store ends the wait within about ``PEER_POLL_S`` seconds (module watch)."""
        if self.polled:
            return poll_work(work, timeout=self.timeout, board=self.board)
        watch = self._watch()
        if watch is not None:
            watch.waiting += 1
        try:
            done = work.wait(timeout=self._wait_timeout)
        except Exception as error:  # noqa: BLE001 (gloo raises on timeouts and on a closed connection alike)
            if watch is not None and watch.failure is not None:  # the watch closed the connections
                return "stopped on another rank's failure", error
            return f"{type(error).__name__}: {error}", error
        finally:
            if watch is not None:
                watch.waiting -= 1
        return None if done is not False else (f"no answer within {self.timeout:g} s", None)

    def _watch(self) -> PeerWatch | None:
        """The thread looking for other ranks' failures while this one waits (none without a store)."""
        helpers = self._helpers
        if helpers.watch is None and self.store is not None and not helpers.stopped:
            group, peer = self.group, self.peer
            helpers.watch = PeerWatch(self.board, lambda: close_connections(group, peer))
        return helpers.watch

    def _sends_posted(self) -> None:
        """Wait until the helper thread has posted every queued send; its failure, if any, raised here."""
        sender = self._helpers.sender
        if sender is not None:
            sender.queue.join()
            if sender.failure is not None and self._send_error is None:
                error, entry, dst = sender.failure
                detail = f"{type(error).__name__}: {error}"
                unit = entry[2]
                self._send_error = PipelineError(
                    self._failure(unit.dst, "sending", unit, detail) if unit is not None
                    else f"rank {self.rank}: sending to global rank {dst} failed: {detail}")
                self._send_error.__cause__ = error
        if self._send_error is not None:
            raise self._send_error

    def _sender(self) -> SendThread:
        """The thread that posts the sends (gloo), started with the first one."""
        helpers = self._helpers
        if helpers.stopped:
            raise PipelineError("this engine was closed (close()); build a new one to take more steps")
        if helpers.sender is None:
            helpers.sender = SendThread(self.group)
        return helpers.sender

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
        self.to_global = lambda r: r
        self.store = None
        self.board.store = None

    def flush(self) -> None:
        """Post the batched operations (NCCL): an action's sends and the next action's receives go
        out as one ``batch_isend_irecv``, as NCCL needs to progress both directions together."""
        if self.batch_ops:
            works = dist.batch_isend_irecv([op for op, _, _ in self.batch_ops])
            for (_, holder, index), work in zip(self.batch_ops, works):
                holder[index] = work
            self.batch_ops = []

    def finish(self) -> None:
        """Wait for every send of the step (bounded by the timeout)."""
        self.flush()
        self._sends_posted()
        for work, _, unit in self.sent:
            if work is not None:
                self._wait(work, unit, "sending")
        self.sent = []

    # ------------------------------------------------------------------------------- receiving

    def units_name(self, unit: Unit) -> str:
        what = "outputs" if unit.kind == "F" else "gradients"
        return f"{what} of stage {unit.producer} for stage {unit.consumer}, micro-batch {unit.microbatch}"

    def post_through(self, uid: int) -> None:
        """Post the receives of every unit from ``uid``'s sender up to ``uid`` (sender order)."""
        unit = self.units[uid]
        if self.discover:
            return
        order = self.incoming[unit.src]
        stop = self.position[uid]
        while self.next_index[unit.src] <= stop:
            other = self.units[order[self.next_index[unit.src]]]
            self.next_index[unit.src] += 1
            if self.filter(other):
                self._post(other)

    def _post(self, unit: Unit) -> None:
        start = time.time_ns() if self.events is not None else 0
        src = self.to_global(unit.src)
        buffers, works = [], []
        for meta in self._expected(unit):
            buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            tag = self._tag(self.recv_tag, unit.src)
            if self.batch:
                self.batch_ops.append((dist.P2POp(dist.irecv, buffer, src, self.group, tag), works, len(works)))
                works.append(None)
            else:
                works.append(self._call(dist.irecv, buffer, src, tag, unit, "receiving"))
            buffers.append(buffer)
        self.posted[unit.id] = _Posted(buffers, works)
        if self.events is not None and not self.batch:  # NCCL posts them later, with flush()
            self._note(f"POST {self.units_name(unit)} from {unit.src}", "post", start)

    def _expected(self, unit: Unit) -> list[LeafMeta]:
        if unit.kind == "F":
            return self.metas[unit.id]
        forward = self.metas[forward_unit(self.unit_of, unit)]
        return [m for m in forward if m.requires_grad]

    def receive(self, uid: int) -> list[torch.Tensor]:
        """The tensors of unit ``uid``, waiting for them (bounded by the timeout)."""
        unit = self.units[uid]
        start = time.time_ns() if self.events is not None else 0
        if self.discover:
            self.flush()
            self._receive_in_order(unit)
        else:
            self.post_through(uid)
            self.flush()
        posted = self.posted.pop(uid)
        for work in posted.works:
            if work is not None:
                self._wait(work, unit, "receiving")
        if self.events is not None:
            self._note(f"RECV {self.units_name(unit)} from {unit.src}", "wait", start)
        return posted.buffers

    def _receive_in_order(self, unit: Unit) -> None:
        """Discovery: receive (blocking) every unit from the sender up to ``unit``, in its order."""
        order = self.incoming[unit.src]
        src = self.to_global(unit.src)
        while self.next_index[unit.src] <= self.position[unit.id]:
            other = self.units[order[self.next_index[unit.src]]]
            self.next_index[unit.src] += 1
            if not self.filter(other):
                continue
            if other.kind == "F":
                size = torch.empty(1, dtype=torch.int64, device=self.device)
                self._recv_now(size, src, other)
                blob = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
                self._recv_now(blob, src, other)
                spec, metas = pickle.loads(blob.cpu().numpy().tobytes())
                self.metas[other.id] = metas
                self.specs[other.id] = spec
            buffers = []
            for meta in self._expected(other):
                buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                self._recv_now(buffer, src, other)
                buffers.append(buffer)
            self.posted[other.id] = _Posted(buffers, [None] * len(buffers))

    def _recv_now(self, buffer: torch.Tensor, src: int, unit: Unit) -> None:
        tag = self._tag(self.recv_tag, unit.src)
        self._wait(self._call(dist.irecv, buffer, src, tag, unit, "receiving"), unit, "receiving")

    # ---------------------------------------------------------------------------------- failure

    def _call(self, op, tensor: torch.Tensor, peer: int, tag: int, unit: Unit, doing: str):
        """Post one point-to-point operation; a broken connection becomes a PipelineError."""
        try:
            return op(tensor, peer, group=self.group, tag=tag)
        except Exception as error:  # gloo reports a dead peer from the post itself
            rank = unit.src if doing == "receiving" else unit.dst
            raise PipelineError(self._failure(rank, doing, unit, f"{type(error).__name__}: {error}")) from error

    def _wait(self, work, unit: Unit, doing: str) -> None:
        failed = self._await(work)
        if failed is not None:
            peer = unit.src if doing == "receiving" else unit.dst
            raise PipelineError(self._failure(peer, doing, unit, failed[0])) from failed[1]

    def _failure(self, peer: int, doing: str, unit: Unit, detail: str) -> str:
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
        if peer is not None and (found is None or found[0] != peer) and (message := self.board.message_of(peer)):
            return f"rank {peer} failed: {message}"
        if found is None:
            found = self.board.first_failure(quick=False)
        return f"rank {found[0]} failed: {found[1]}" if found is not None else None

    def report(self, message: str) -> None:
        """Leave this rank's failure where the other ranks look while they wait."""
        self.board.report(message)
