"""Two-replica schedules (DualPipe, Chimera): both copies of a model piece end a step with the same
``.grad``, the sum of every micro-batch's gradient in micro-batch order, as on one device.

Each gradient action of such a schedule leaves its micro-batch's gradients aside
(:meth:`ReplicaExchange.collect`). The second replica sends all its micro-batch gradients of a piece at
once, posted as soon as its last gradient action ended (where the transport may post during the step,
gloo) into receives posted at the start of the step; the first adds everything in micro-batch order
and sends the sums back (:meth:`ReplicaExchange.merge`).

``eval_step``'s outputs, each replica's on its own last piece, are joined over the pipeline
(:func:`replica_outputs`); buffers the replicas (or data-parallel replicas) changed apart in a training step are
refused (:func:`diverged_buffers`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from pipeloom.runtime.comm.messenger import Messenger
from pipeloom.runtime.comm.packed import Incoming, gather_objects, post_incoming, send_packed, take
from pipeloom.runtime.comm.transport import Posted
from pipeloom.runtime.parallel.ep import is_expert
from pipeloom.runtime.program import Lowering
from pipeloom.runtime.step.backward import accumulate_grad
from pipeloom.runtime.step.pieces import RankPieces

__all__ = ["REPLICA_TAG", "ReplicaExchange", "data_parallel_outputs", "diverged_buffers", "replica_outputs"]

REPLICA_TAG = 1 << 24  # tags of these messages, clear of the step's own


class ReplicaExchange:
    """One training step's replica gradients on one rank."""

    def __init__(self, pieces: RankPieces, params: Mapping[int, list[nn.Parameter]], messenger: Messenger) -> None:
        self.pieces = pieces
        self.low = pieces.lowering
        self.params = params
        self.messenger = messenger
        self.early = messenger.transport.early_traffic  # gloo matches by tag: post during the step
        self.grads: dict[int, dict[int, list]] = {}  # stage -> micro-batch -> its gradients
        self.early_sends: dict[int, list[Posted]] = {}  # second-replica stage -> its posted sends
        self.incoming: dict = self._post_receives() if self.early else {}

    def _held(self):
        """(piece, stages of its replicas, their ranks) for every piece held by this rank."""
        low, rank = self.low, self.pieces.rank
        for piece in range(low.num_pieces):
            stages = [low.stage_for[j][piece] for j in range(low.replicas)]
            ranks = [low.rank_of[s] for s in stages]
            if rank in ranks:
                yield piece, stages, ranks

    def _local_params(self, stages: list[int]) -> list:
        return self.params[next(s for s in stages if self.low.rank_of[s] == self.pieces.rank)]

    def _receive(self, peer: int, templates: list, tag: int) -> Incoming:
        return post_incoming(self.messenger, peer, templates, tag, self.pieces.device)

    def _post_receives(self) -> dict:
        """Every replica-gradient receive of this rank, posted at the start of the step: the first
        replica's rank waits for the others' micro-batch gradients, the others for the sums. Sizes are
        fixed (absent gradients travel as zeros, flagged in the mask)."""
        incoming: dict = {}
        per_step = self.low.schedule.num_microbatches
        for piece, stages, ranks in self._held():
            params = self._local_params(stages)
            tag = REPLICA_TAG + 4 * piece
            if ranks[0] == self.pieces.rank:
                for j, other in enumerate(ranks):
                    if other != self.pieces.rank:
                        incoming[(piece, j)] = self._receive(other, params * per_step, tag)
            else:
                incoming[(piece, "sums")] = self._receive(ranks[0], params, tag + 2)
        return incoming

    def collect(self, stage: int, mb: int, found: list) -> None:
        """Keep ``stage``'s gradients of micro-batch ``mb``; a second replica's stage that has all of them
        sends them at once where the transport allows (overlapping the rest of the step)."""
        self.grads.setdefault(stage, {})[mb] = found
        if (self.early and self.low.replica_of[stage] > 0
                and len(self.grads[stage]) == self.low.schedule.num_microbatches):
            self.early_sends[stage] = self._contribute(stage)

    def _contribute(self, stage: int) -> list[Posted]:
        """Second replica: send ``stage``'s micro-batch gradients to the first replica's rank."""
        low = self.low
        piece = low.piece_of[stage]
        owner = low.rank_of[low.stage_for[0][piece]]
        contributions = self.grads.get(stage, {})
        params = self.params[stage]
        flat = [g for mb in sorted(contributions) for g in contributions[mb]]
        return send_packed(self.messenger, owner, flat, params * len(contributions), REPLICA_TAG + 4 * piece,
                           self.pieces.device)

    def merge(self) -> None:
        """Add each piece's micro-batch gradients in micro-batch order on the first replica's rank, and
        give every replica the same result."""
        rank, low = self.pieces.rank, self.low
        sends: list[Posted] = []
        for _, stages, ranks in self._held():  # second replicas: make sure their sends are out
            for stage in stages[1:]:
                if low.rank_of[stage] == rank and ranks[0] != rank:
                    sends += self.early_sends.pop(stage, []) or self._contribute(stage)
        for piece, stages, ranks in self._held():  # first replicas: receive, add in order, answer
            if ranks[0] == rank:
                sends += self._merge_first(piece, stages, ranks)
        for piece, stages, ranks in self._held():  # second replicas: take the sums
            if ranks[0] == rank:
                continue
            params = self._local_params(stages)
            incoming = self.incoming.get((piece, "sums")) or self._receive(ranks[0], params,
                                                                           REPLICA_TAG + 4 * piece + 2)
            for param, grad in zip(params, take(self.messenger, incoming)):
                param.grad = None if grad is None else grad.clone()
        self.messenger.wait_posted(sends, "sending replica gradients")

    def _merge_first(self, piece: int, stages: list[int], ranks: list[int]) -> list[Posted]:
        rank, low = self.pieces.rank, self.low
        params = self.params[stages[0]]
        per_step = low.schedule.num_microbatches
        contributions: dict[int, list] = {}
        for stage in stages:
            if low.rank_of[stage] == rank:
                contributions.update(self.grads.get(stage, {}))
        for j, other in enumerate(ranks):
            if other == rank:
                continue
            incoming = self.incoming.get((piece, j)) or self._receive(other, params * per_step,
                                                                      REPLICA_TAG + 4 * piece)
            grads = take(self.messenger, incoming)
            for k in range(per_step):
                contributions[low.replicas * k + j] = grads[k * len(params):(k + 1) * len(params)]
        for mb in sorted(contributions):
            for param, grad in zip(params, contributions[mb]):
                if grad is not None:
                    accumulate_grad(param, grad)
        return [posted for other in sorted(set(ranks) - {rank})
                for posted in send_packed(self.messenger, other, [p.grad for p in params], params,
                                          REPLICA_TAG + 4 * piece + 2, self.pieces.device)]


def replica_outputs(outputs: dict[int, object], group: dist.ProcessGroup, world: int, rank: int, device: torch.device,
                    wait: Callable[[object, str], None]) -> dict[int, object]:
    """Under a two-replica schedule each replica's last piece holds the model outputs of its own micro-batches: every
    rank of the pipeline ``group`` gives its own (:func:`gather_objects`, from CPU), and a rank holding a last piece
    gets every micro-batch's, on ``device``; the others nothing."""
    every = _gathered(outputs, group, world, rank, device, wait, "exchanging the replicas' model outputs")
    if not outputs:
        return {}
    mesh = _mesh_of(outputs)
    return {mb: _moved(out, device, mesh) for part in every for mb, out in part.items()}


@dataclasses.dataclass(frozen=True)
class _Sharded:
    """A DTensor output as it travels: its local part (on the CPU) and layout, rebuilt on the receiver's own mesh (a
    pickled DTensor keeps its sender's process groups, which the receiver's "tp" ranks are not in)."""

    local: torch.Tensor
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


def _moved(value: object, to: torch.device, mesh: DeviceMesh | None = None) -> object:
    """``value``'s tensors on ``to``; a :class:`_Sharded` made a DTensor again on ``mesh``."""
    from torch.distributed.tensor import DTensor

    def move(t: object) -> object:
        if isinstance(t, _Sharded):
            return DTensor.from_local(t.local.to(to), mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride)
        return t.to(to) if isinstance(t, torch.Tensor) else t
    return pytree.tree_map(move, value)


def _gathered(outputs: dict[int, object], group: dist.ProcessGroup, world: int, rank: int, device: torch.device,
              wait: Callable[[object, str], None], doing: str) -> list[dict[int, object]]:
    """Every rank of ``group``'s model outputs by micro-batch, in the group's rank order (:func:`gather_objects`, on
    the CPU; a DTensor as its local part and layout, :class:`_Sharded`)."""
    from torch.distributed.tensor import DTensor

    def wire(t: object) -> object:
        if isinstance(t, DTensor):
            return _Sharded(t.to_local().to("cpu"), tuple(t.placements), t.shape, tuple(t.stride()))
        return t.to("cpu") if isinstance(t, torch.Tensor) else t
    mine = {mb: pytree.tree_map(wire, out) for mb, out in outputs.items()}
    return gather_objects(mine, group, world, rank, device, wait, doing)


def _mesh_of(outputs: dict[int, object]) -> DeviceMesh | None:
    """The device mesh of this rank's own DTensor outputs (None without): where received ones are rebuilt."""
    from torch.distributed.tensor import DTensor

    leaves = [t for out in outputs.values() for t in pytree.tree_leaves(out)]
    return next((t.device_mesh for t in leaves if isinstance(t, DTensor)), None)


def data_parallel_outputs(outputs: dict[int, object], group: dist.ProcessGroup, world: int, rank: int,
                          microbatches: int, device: torch.device, wait: Callable[[object, str], None]
                          ) -> dict[int, object]:
    """With ``world`` data-parallel replicas, replica ``r`` holds the model outputs of micro-batches ``r·M`` …
    ``r·M + M − 1`` under its own numbers 0 … M − 1: every rank of its ``"dp"`` ``group`` gives its own (from CPU), and
    a rank holding outputs gets every replica's under the whole batch's numbers, on ``device``; the others nothing.
    An eval step without a target had returned this replica's rows alone, without a word."""
    every = _gathered(outputs, group, world, rank, device, wait, "gathering the data-parallel replicas' model outputs")
    if not outputs:
        return {}
    mesh = _mesh_of(outputs)
    return {r * microbatches + mb: _moved(out, device, mesh)
            for r, part in enumerate(every) for mb, out in part.items()}


def diverged_buffers(modules: Mapping[int, nn.Module], lowering: Lowering, group: dist.ProcessGroup, world: int,
                     rank: int, device: torch.device, wait: Callable[[object, str], None], *,
                     data_parallel: int = 1) -> str | None:
    """Why the engine cannot go on where, after a training step, the replicas of a piece hold a buffer differently
    (each replica updates its buffers from its own micro-batches, as BatchNorm's running statistics do, so none holds
    one device's values); None where it can. The replicas are a two-replica schedule's, over the pipeline ``group``,
    or with ``data_parallel`` > 1 the data-parallel ones, over their ``group``. Every rank of ``group`` gives a digest
    of each buffer of its stages (a buffer no step changes stays equal on all: :func:`gather_objects`), and each gets
    the same answer."""
    mine = {}
    for stage, module in modules.items():
        experts = [f"{name}." for name, part in module.named_modules()
                   if any(is_expert(p) for p in part.parameters(recurse=False))]
        for name, buffer in module.named_buffers():
            if name.startswith(tuple(experts)):  # an expert module's own: each "ep" rank holds other experts'
                continue
            data = buffer.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            mine[(lowering.piece_of[stage], name)] = hashlib.sha256(data).hexdigest()
    every = gather_objects(mine, group, world, rank, device, wait, "comparing the replicas' buffers")
    seen: dict[tuple[int, str], str] = {}
    diverged = set()
    for part in every:
        for key, digest in part.items():
            if seen.setdefault(key, digest) != digest:
                diverged.add(key)
    if not diverged:
        return None
    names = ", ".join(f"piece {piece}'s {name!r}" for piece, name in sorted(diverged))
    why = ("(each replica updates its buffers from its own micro-batches, as BatchNorm's running statistics do, so "
           "none holds one device's values)")
    fixed = "keep those buffers fixed (BatchNorm(track_running_stats=False), or the module in eval mode)"
    if data_parallel > 1:
        return (f"the step changed {names} differently in each of the {data_parallel} data-parallel replicas {why}: "
                f"run one replica (a mesh without \"dp\"; pipeloom plan --dp 1), or {fixed}")
    return (f"schedule {lowering.schedule.name!r} holds two replicas of each piece, and the step changed {names} "
            f"differently in each {why}: choose a one-replica schedule (1f1b, zbv, dualpipev, ...), or {fixed}")
