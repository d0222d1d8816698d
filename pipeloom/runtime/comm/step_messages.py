"""One step's point-to-point messages on one rank (:class:`StepMessages`): receives posted early in each
sender's order, sends kept until done, and the first step's shape discovery (:class:`LeafMeta`)."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch
import torch.utils._pytree as pytree

from pipeloom.runtime.comm.transport import Posted
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.parallel.scatter import Traffic, gather_slices, identical_over_tp, slice_of, wire_bytes
from pipeloom.runtime.parallel.tp import is_dtensor, local_of
from pipeloom.runtime.program import Unit, forward_unit

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from pipeloom.runtime.comm.messenger import Messenger

__all__ = ["LeafMeta", "StepMessages", "kept_stride"]


@dataclass(frozen=True, slots=True)
class LeafMeta:
    """Shape, dtype and whether one tensor of a message requires grad; for a DTensor, the shape of its
    local tensor (what travels) and what rebuilds it on the receiver's "tp" sub-mesh."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    placements: tuple = ()  # a DTensor's placements (Shard(-1), Replicate(), ...); () for a plain tensor
    global_shape: tuple[int, ...] = ()  # a DTensor's shape and stride over the whole mesh
    global_stride: tuple[int, ...] = ()
    # a dense tensor's strides when it is not contiguous (channels-last, a permuted view): it travels in its
    # memory order and is received into the same strides, so the next kernels see the layout one device would
    # give them; () for contiguous ones and those with gaps or overlaps (sent .contiguous()). Not part of
    # equality: a step whose layout differs from the first's sends in the layout the receiver expects
    stride: tuple[int, ...] = field(default=(), compare=False)
    # > 1: equal on every "tp" rank, so each sends 1/split of its bytes and the receivers all-gather them
    # (pipeloom.runtime.parallel.scatter); decided by the sender on a discovering step, not part of equality
    split: int = field(default=1, compare=False)

    @staticmethod
    def of(tensor: torch.Tensor) -> LeafMeta:
        if is_dtensor(tensor):
            dtensor = cast("DTensor", tensor)
            return LeafMeta(tuple(dtensor.to_local().shape), dtensor.dtype, dtensor.requires_grad,
                            tuple(dtensor.placements), tuple(dtensor.shape), tuple(dtensor.stride()))
        return LeafMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad, stride=kept_stride(tensor))

    def describe(self) -> str:
        grad = " requiring grad" if self.requires_grad else ""
        sharded = f" (local shard of {list(self.global_shape)}, {list(self.placements)})" if self.placements else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}{sharded}{grad}"

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()

    def buffer(self, device: torch.device) -> torch.Tensor:
        """An empty tensor for what travels: the local tensor, or one uint8 slice of its bytes."""
        if self.split > 1:
            return torch.empty(wire_bytes(self.nbytes, self.split), dtype=torch.uint8, device=device)
        if self.stride:  # its memory, in order: ``shaped`` views it with the sender's strides
            return torch.empty(torch.Size(self.shape).numel(), dtype=self.dtype, device=device)
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def wire(self, local: torch.Tensor) -> torch.Tensor:
        """What travels for ``local`` (unsplit): its memory in order when its strides are kept (copied into
        those strides first if this step's tensor has others), else its contiguous copy."""
        if not self.stride:
            return local.contiguous()
        if tuple(local.stride()) != self.stride:
            local = torch.empty_strided(self.shape, self.stride, dtype=local.dtype, device=local.device).copy_(local)
        return local.as_strided((local.numel(),), (1,), local.storage_offset())

    def shaped(self, received: torch.Tensor) -> torch.Tensor:
        """The received tensor with the sender's strides (a reassembled split one is copied into them)."""
        if not self.stride:
            return received
        if self.split > 1:
            out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=received.device)
            return out.copy_(received)
        return received.as_strided(self.shape, self.stride)


def kept_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s strides if it is dense without being contiguous (its elements fill one block of memory,
    in another order: channels-last, a transpose), else ``()``."""
    if tensor.is_contiguous() or tensor.layout != torch.strided:
        return ()
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride()) if sz > 1):
        if stride != expected:  # a gap or an overlap: not one block
            return ()
        expected *= size
    return tuple(tensor.stride())


class StepMessages:
    """One step's messages on one rank: tags per peer, the receives posted and the sends to wait for.

    Every message belongs to a :class:`~pipeloom.runtime.program.Unit`. A unit's tensors travel as one
    message each, tagged with their position in the (sender, receiver) stream, and every receiver posts
    its receives in the sender's order — what gloo's tags and NCCL's in-order matching both need. On a
    step whose input shapes were not seen before, each forward unit is preceded by its description
    (structure, shapes, dtypes: :class:`LeafMeta`), so the receiver can allocate; later steps with the
    same input shapes post their receives before the data exists. With ``"tp"``, a tensor equal on every
    tp rank travels as 1/tp of its bytes, all-gathered by the receivers (:mod:`pipeloom.runtime.parallel.scatter`).
    Every wait is bounded by the messenger's timeout (:class:`~pipeloom.runtime.comm.messenger.Messenger`).
    """

    def __init__(self, messenger: Messenger, metas: dict[int, list[LeafMeta]], specs: dict[int, list], *,
                 discover: bool, events: list | None, unit_filter: Callable[[Unit], bool]) -> None:
        self.messenger = messenger
        self.transport = messenger.transport
        self.units = messenger.units
        self.metas = metas
        self.specs = specs
        self.discover = discover
        self.events = events
        self.filter = unit_filter
        self.send_tag: dict[int, int] = {}
        self.recv_tag: dict[int, int] = {}
        self.posted: dict[int, list[Posted]] = {}  # unit id -> its receives
        self.next_index = {src: 0 for src in messenger.incoming}
        self.sent: list[Posted] = []
        self.traffic = Traffic()

    @property
    def lookahead(self) -> int:
        """Compute actions whose receives are posted ahead (none while sizes are being discovered)."""
        return 0 if self.discover else self.transport.lookahead

    def _tag(self, table: dict[int, int], peer: int) -> int:
        tag = table.get(peer, 0)
        table[peer] = tag + 1
        return tag

    def _note(self, name: str, kind: str, start: int) -> None:
        if self.events is not None:
            self.events.append((name, kind, start, time.time_ns()))

    # --------------------------------------------------------------------------------- sending

    def send(self, unit: Unit, leaves: list[torch.Tensor], spec: list | None) -> None:
        """Send one unit's tensors (forward values, or gradients) to its receiver. On a discovering step a
        forward unit is preceded by its description (structure and metas), and so is a gradient unit when
        tensors may be split over "tp" (its metas say which)."""
        start = time.time_ns() if self.events is not None else 0
        device = self.messenger.device
        locals_ = [local_of(tensor.detach()) for tensor in leaves]  # a DTensor: its local tensor
        metas = self._sending_metas(unit, leaves, locals_)
        if self.discover:  # a gradient unit too: its strides may differ from its forward value's
            # text: a pickled TreeSpec warns on load; a gradient unit sends no structure (spec None)
            structures = None if unit.kind != "F" or spec is None else [pytree.treespec_dumps(one) for one in spec]
            blob = torch.frombuffer(bytearray(pickle.dumps((structures, metas))), dtype=torch.uint8)
            size = torch.tensor([blob.numel()], dtype=torch.int64)
            self._send(size.to(device), unit)
            self._send(blob.to(device), unit)
        tp_rank = self.messenger.tp.rank
        for local, meta in zip(locals_, metas):
            whole = local.numel() * local.element_size()
            self.traffic = replace(self.traffic, unsplit_bytes=self.traffic.unsplit_bytes + whole)
            self._send(slice_of(local.contiguous(), meta.split, tp_rank) if meta.split > 1 else meta.wire(local),
                       unit, counted=True)
        if self.events is not None:
            self._note(f"SEND {self.messenger.units_name(unit)} to {unit.dst}", "send", start)

    def _sending_metas(self, unit: Unit, leaves: list[torch.Tensor], locals_: list[torch.Tensor]) -> list[LeafMeta]:
        """The metas of a unit's tensors as they travel: on a discovering step with ``scatter``, those equal
        on every "tp" rank are split (a collective over "tp": every tp rank sends the same units in the
        same order); later steps reuse what was decided."""
        known = self.metas.get(unit.id)
        if known is not None and not self.discover:
            return known
        metas = known if unit.kind == "F" and known is not None else [LeafMeta.of(t) for t in leaves]
        if self.messenger.scatter and metas:
            try:
                same = identical_over_tp(locals_, self.messenger.tp, self.messenger.await_work,
                                         self.messenger.device)
            except RuntimeError as error:
                raise PipelineError(self.messenger.failure_text(unit.dst, "sending", unit, str(error))) from error
            metas = [replace(m, split=self.messenger.tp.size) if ok else m for m, ok in zip(metas, same)]
        self.metas[unit.id] = metas
        return metas

    def _send(self, tensor: torch.Tensor, unit: Unit, *, counted: bool = False) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.traffic = replace(self.traffic, sent_bytes=self.traffic.sent_bytes + nbytes,
                               unsplit_bytes=self.traffic.unsplit_bytes + (0 if counted else nbytes))
        posted = Posted(tensor, unit)
        self.sent.append(posted)
        self.transport.send(posted, self.messenger.to_global(unit.dst), self._tag(self.send_tag, unit.dst))

    def flush(self) -> None:
        """Hand the batched operations to the backend (NCCL; nothing on gloo)."""
        self.transport.flush()

    def finish(self) -> None:
        """Wait for every send of the step (bounded by the timeout)."""
        self.transport.flush()
        self.messenger.sends_posted()
        for posted in self.sent:
            if posted.work is not None:
                assert posted.unit is not None  # every message of the step belongs to a unit
                self._wait(posted.work, posted.unit, "sending")
        self.sent = []

    # ------------------------------------------------------------------------------- receiving

    def post_through(self, uid: int) -> None:
        """Post the receives of every unit from ``uid``'s sender up to ``uid`` (sender order)."""
        if self.discover:
            return
        unit = self.units[uid]
        order = self.messenger.incoming[unit.src]
        stop = self.messenger.position[uid]
        while self.next_index[unit.src] <= stop:
            other = self.units[order[self.next_index[unit.src]]]
            self.next_index[unit.src] += 1
            if self.filter(other):
                self._post(other)

    def _post(self, unit: Unit) -> None:
        start = time.time_ns() if self.events is not None else 0
        src = self.messenger.to_global(unit.src)
        received = []
        for meta in self._expected(unit):
            posted = Posted(meta.buffer(self.messenger.device), unit)
            self._call(self.transport.receive, posted, src, self._tag(self.recv_tag, unit.src), "receiving")
            received.append(posted)
        self.posted[unit.id] = received
        if self.events is not None and self.transport.lookahead:  # NCCL posts them later, with flush()
            self._note(f"POST {self.messenger.units_name(unit)} from {unit.src}", "post", start)

    def _expected(self, unit: Unit) -> list[LeafMeta]:
        if unit.kind == "F" or unit.id in self.metas:  # a gradient unit's own metas: sent when it may split
            return self.metas[unit.id]
        forward = self.metas[forward_unit(self.messenger.unit_of, unit)]
        return [m for m in forward if m.requires_grad]

    def receive(self, uid: int) -> list[torch.Tensor]:
        """The tensors of unit ``uid``, waiting for them (bounded by the timeout)."""
        unit = self.units[uid]
        start = time.time_ns() if self.events is not None else 0
        if self.discover:
            self.transport.flush()
            self._receive_in_order(unit)
        else:
            self.post_through(uid)
            self.transport.flush()
        received = self.posted.pop(uid)
        for posted in received:
            if posted.work is not None:
                self._wait(posted.work, unit, "receiving")
        tensors = [meta.shaped(t) for meta, t in zip(self._expected(unit),
                                                     self._whole(unit, [posted.tensor for posted in received]))]
        if self.events is not None:
            self._note(f"RECV {self.messenger.units_name(unit)} from {unit.src}", "wait", start)
        return tensors

    def _whole(self, unit: Unit, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Split tensors reassembled from this rank's slices and its "tp" peers' (one all-gather)."""
        metas = self._expected(unit)
        split = [i for i, meta in enumerate(metas) if meta.split > 1]
        if not split:
            return tensors
        tp = self.messenger.tp
        try:
            wholes = gather_slices([tensors[i] for i in split], [(metas[i].shape, metas[i].dtype) for i in split],
                                   tp, self.messenger.await_work)
        except RuntimeError as error:
            raise PipelineError(self.messenger.failure_text(unit.src, "receiving", unit, str(error))) from error
        gathered = sum(tensors[i].numel() for i in split) * (tp.size - 1)
        self.traffic = replace(self.traffic, gathered_bytes=self.traffic.gathered_bytes + gathered)
        for i, whole in zip(split, wholes):
            tensors[i] = whole
        return tensors

    def _receive_in_order(self, unit: Unit) -> None:
        """Discovery: receive (blocking) every unit from the sender up to ``unit``, in its order."""
        order = self.messenger.incoming[unit.src]
        src = self.messenger.to_global(unit.src)
        device = self.messenger.device
        while self.next_index[unit.src] <= self.messenger.position[unit.id]:
            other = self.units[order[self.next_index[unit.src]]]
            self.next_index[unit.src] += 1
            if not self.filter(other):
                continue
            # every unit of a discovering step is preceded by its metas (a gradient's strides are its own)
            size = self._receive_now(torch.empty(1, dtype=torch.int64, device=device), src, other)
            blob = self._receive_now(torch.empty(int(size.item()), dtype=torch.uint8, device=device), src,
                                     other)
            structures, metas = pickle.loads(blob.cpu().numpy().tobytes())
            self.metas[other.id] = metas
            if structures is not None:
                self.specs[other.id] = [pytree.treespec_loads(one) for one in structures]
            self.posted[other.id] = [Posted(self._receive_now(meta.buffer(device), src, other), other)
                                     for meta in self._expected(other)]

    def _receive_now(self, buffer: torch.Tensor, src: int, unit: Unit) -> torch.Tensor:
        posted = Posted(buffer, unit)
        self._call(self.transport.receive, posted, src, self._tag(self.recv_tag, unit.src), "receiving")
        self.transport.flush()
        self._wait(posted.work, unit, "receiving")
        return buffer

    # ---------------------------------------------------------------------------------- failure

    def _call(self, post: Callable, posted: Posted, peer: int, tag: int, doing: str) -> None:
        """Post one point-to-point operation; a broken connection becomes a PipelineError."""
        try:
            post(posted, peer, tag)
        except Exception as error:  # gloo reports a dead peer from the post itself
            unit = posted.unit
            assert unit is not None  # every message of the step belongs to a unit
            rank = unit.src if doing == "receiving" else unit.dst
            raise PipelineError(self.messenger.failure_text(rank, doing, unit,
                                                            f"{type(error).__name__}: {error}")) from error

    def _wait(self, work, unit: Unit, doing: str) -> None:
        failed = self.messenger.await_work(work)
        if failed is not None:
            peer = unit.src if doing == "receiving" else unit.dst
            raise PipelineError(self.messenger.failure_text(peer, doing, unit, failed[0])) from failed[1]
