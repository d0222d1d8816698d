"""Point-to-point messages of one step: receives posted early in each sender's order, sends kept until
done, waits bounded by a timeout, and the first step's shape discovery.

Every message belongs to a :class:`~pipeloom.runtime.lower.Unit`. A unit's tensors travel as one
message each, tagged with their position in the (sender, receiver) stream, and every receiver posts
its receives in the sender's order — what gloo's tags and NCCL's in-order matching both need. On a
step whose input shapes were not seen before, each forward unit is preceded by its description
(structure, shapes, dtypes), so the receiver can allocate; later steps with the same input shapes
post their receives before the data exists.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeloom.runtime.lower import PipelineError, Unit, forward_unit

__all__ = ["LeafMeta", "Messenger", "flatten", "unflatten"]

ERROR_KEY = "pipeloom/error/{run}/{rank}"


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
        self.position = {uid: i for order in pair_order.values() for i, uid in enumerate(order)}
        self.incoming = {src: order for (src, dst), order in pair_order.items() if dst == rank}
        self.events: list | None = None
        self._queue: queue.Queue | None = None  # gloo: sends are posted by a helper thread
        self._send_error: PipelineError | None = None

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
            self._sender().put((entry, dst, tag))

    def post_send(self, tensor: torch.Tensor, peer: int, tag: int) -> list:
        """Send ``tensor`` to group rank ``peer`` outside the step's units (e.g. replica gradients);
        returns ``[work, tensor, None]``, the work filled in once posted (see :meth:`wait_posted`)."""
        entry = [None, tensor, None]
        if self.batch:
            entry[0] = dist.isend(tensor, self.to_global(peer), group=self.group, tag=tag)
        else:
            self._sender().put((entry, self.to_global(peer), tag))
        return entry

    def wait_posted(self, entries: list, what: str) -> None:
        """Wait (bounded by the timeout) for sends made with :meth:`post_send`."""
        self._sends_posted()
        for work, _, _ in entries:
            self.wait_work(work, what)

    def wait_work(self, work, what: str, peer: int | None = None) -> None:
        """Wait for a work outside the step's units (loss, replica gradients), bounded by the timeout;
        a failure names ``what`` and what the peer (or any rank) left in the store."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as error:
            reason = (self.peer_error(peer) if peer is not None else None) or self.any_error()
            raise PipelineError(f"rank {self.rank}: {what} failed: {error}; "
                                f"{reason or 'another rank failed or hung'}") from error

    def _sends_posted(self) -> None:
        """Wait until the helper thread has posted every queued send; its failure, if any, raised here."""
        if self._queue is not None:
            self._queue.join()
        if self._send_error is not None:
            raise self._send_error

    def _sender(self) -> queue.Queue:
        """The queue of a thread that posts the sends, so the compute thread never blocks on one."""
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._post_sends, name="pipeloom-sends", daemon=True).start()
        return self._queue

    def _post_sends(self) -> None:
        while True:
            entry, dst, tag = self._queue.get()
            try:
                if self._send_error is None:
                    entry[0] = self._call(dist.isend, entry[1], dst, tag, entry[2],
                                          "sending" if entry[2] is not None else "sending replica gradients")
            except PipelineError as error:
                self._send_error = error
            finally:
                self._queue.task_done()

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

    def _call(self, op, tensor: torch.Tensor, peer: int, tag: int, unit: Unit | None, doing: str):
        """Post one point-to-point operation; a broken connection becomes a PipelineError."""
        try:
            return op(tensor, peer, group=self.group, tag=tag)
        except Exception as error:  # gloo reports a dead peer from the post itself
            if unit is None:
                raise PipelineError(f"rank {self.rank}: {doing} to global rank {peer} failed: "
                                    f"{type(error).__name__}: {error}") from error
            rank = unit.src if doing == "receiving" else unit.dst
            raise PipelineError(self._failure(rank, doing, unit, f"{type(error).__name__}: {error}")) from error

    def _wait(self, work, unit: Unit, doing: str) -> None:
        peer = unit.src if doing == "receiving" else unit.dst
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as error:  # gloo raises on timeouts and on a closed connection alike
            raise PipelineError(self._failure(peer, doing, unit, f"{type(error).__name__}: {error}")) from error
        if done is False:
            raise PipelineError(self._failure(peer, doing, unit, f"no answer within {self.timeout:g} s"))

    def _failure(self, peer: int, doing: str, unit: Unit, detail: str) -> str:
        reason = self.peer_error(peer)
        where = f"rank {self.rank} stopped while {doing} {self.units_name(unit)} (rank {peer})"
        if reason:
            return f"{where}: rank {peer} failed: {reason}"
        others = self.any_error()
        if others:
            return f"{where}: {others}"
        return (f"{where}: {detail}; rank {peer} died, hung or runs a different schedule (raise timeout= if its "
                "work is just slow)")

    def peer_error(self, rank: int) -> str | None:
        """The failure message another rank left in the store, if any."""
        if self.store is None:
            return None
        key = ERROR_KEY.format(run=self.run_id, rank=rank)
        try:
            if self.store.check([key]):
                return self.store.get(key).decode()
        except Exception:  # noqa: BLE001 (the store may be gone with the failed rank; the timeout message stands)
            return None
        return None

    def any_error(self) -> str | None:
        for rank in range(dist.get_world_size(self.group)):
            if rank != self.rank and (message := self.peer_error(rank)):
                return f"rank {rank} failed: {message}"
        return None

    def report(self, message: str) -> None:
        """Leave this rank's failure where the other ranks look when their waits break."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # best effort: the peers' timeouts still bound their wait
                self.store.set(ERROR_KEY.format(run=self.run_id, rank=self.rank), message)
