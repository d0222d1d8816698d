"""Two-replica schedules (DualPipe, Chimera): both copies of a model piece end a step with the same
``.grad``, the sum of every micro-batch's gradient in micro-batch order, as on one device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pipeloom.runtime.backward import accumulate_grad

if TYPE_CHECKING:
    from pipeloom.runtime.comm import Messenger
    from pipeloom.runtime.engine import PipelineEngine
    from pipeloom.runtime.step import StepRun

__all__ = ["merge_replicas", "post_contributions", "post_receives", "receive_packed", "send_packed"]

REPLICA_TAG = 1 << 24  # tags of these messages, clear of the step's own


def _pieces(engine: PipelineEngine):
    """(piece, stages of its replicas, their ranks) for every piece held by this rank."""
    low = engine.lowering
    for piece in range(low.num_pieces):
        stages = [low.stage_for[j][piece] for j in range(low.replicas)]
        ranks = [low.rank_of[s] for s in stages]
        if engine.rank in ranks:
            yield piece, stages, ranks


def _local_params(engine: PipelineEngine, stages: list[int]) -> list:
    low = engine.lowering
    return engine.params[next(s for s in stages if low.rank_of[s] == engine.rank)]


@dataclass(slots=True)
class _Incoming:
    """Receives posted for one packed message: a presence mask and one flat buffer per dtype."""

    peer: int
    templates: list  # tensors shaped like the gradients to come, in order
    mask: torch.Tensor
    buffers: dict  # dtype -> flat buffer
    works: list


def post_receives(engine: PipelineEngine) -> dict:
    """At the start of a step, post every replica-gradient receive of this rank, so the transfers
    happen while it computes: the first replica's rank waits for the others' micro-batch gradients,
    the others for the sums. Sizes are fixed (absent gradients travel as zeros, flagged in the mask)."""
    low = engine.lowering
    incoming: dict = {}
    for piece, stages, ranks in _pieces(engine):
        params = _local_params(engine, stages)
        tag = REPLICA_TAG + 4 * piece
        if ranks[0] == engine.rank:
            for j, other in enumerate(ranks):
                if other != engine.rank:
                    incoming[(piece, j)] = _post_incoming(engine.messenger, other,
                                                          params * low.schedule.num_microbatches, tag, engine.device)
        else:
            incoming[(piece, "sums")] = _post_incoming(engine.messenger, ranks[0], params, tag + 2, engine.device)
    return incoming


def post_contributions(engine: PipelineEngine, run: StepRun, stage: int) -> list:
    """Second replica: send ``stage``'s micro-batch gradients to the first replica's rank (async).

    Called as soon as the stage's last gradient action ran, so the transfer overlaps the rest of the
    step; returns the posted entries.
    """
    low = engine.lowering
    piece = low.piece_of[stage]
    owner = low.rank_of[low.stage_for[0][piece]]
    contributions = run.replica_grads.get(stage, {})
    params = engine.params[stage]
    flat = [g for mb in sorted(contributions) for g in contributions[mb]]
    return send_packed(engine.messenger, owner, flat, params * len(contributions), REPLICA_TAG + 4 * piece,
                       engine.device)


def merge_replicas(engine: PipelineEngine, run: StepRun) -> None:
    """Two-replica schedules: add each piece's micro-batch gradients in micro-batch order on the
    first replica's rank, and give both replicas the same result.

    The second replica sends all its micro-batch gradients of a piece at once (posted when its last
    gradient action ends, into receives posted at the start of the step); the first adds everything
    in micro-batch order and sends the sums back the same way.
    """
    low = engine.lowering
    sends: list = []
    for piece, stages, ranks in _pieces(engine):  # second replicas: make sure their sends are out
        for stage in stages[1:]:
            if low.rank_of[stage] == engine.rank and ranks[0] != engine.rank:
                sends += run.early_sends.pop(stage, None) or post_contributions(engine, run, stage)
    for piece, stages, ranks in _pieces(engine):  # first replicas: receive, add in order, answer
        if ranks[0] != engine.rank:
            continue
        params = engine.params[stages[0]]
        contributions: dict[int, list] = {}
        for stage in stages:
            if low.rank_of[stage] == engine.rank:
                contributions.update(run.replica_grads.get(stage, {}))
        for j, other in enumerate(ranks):
            if other == engine.rank:
                continue
            mbs = [low.replicas * m + j for m in range(low.schedule.num_microbatches)]
            incoming = run.replica_incoming.get((piece, j))
            if incoming is None:
                incoming = _post_incoming(engine.messenger, other, params * low.schedule.num_microbatches,
                                          REPLICA_TAG + 4 * piece, engine.device)
            grads = _take(engine.messenger, incoming)
            for k, mb in enumerate(mbs):
                contributions[mb] = grads[k * len(params):(k + 1) * len(params)]
        for mb in sorted(contributions):
            for param, grad in zip(params, contributions[mb]):
                if grad is not None:
                    accumulate_grad(param, grad)
        for other in sorted(set(ranks) - {engine.rank}):
            sends += send_packed(engine.messenger, other, [p.grad for p in params], params,
                                 REPLICA_TAG + 4 * piece + 2, engine.device)
    for piece, stages, ranks in _pieces(engine):  # second replicas: take the sums
        if ranks[0] == engine.rank:
            continue
        params = _local_params(engine, stages)
        incoming = run.replica_incoming.get((piece, "sums"))
        if incoming is None:
            incoming = _post_incoming(engine.messenger, ranks[0], params, REPLICA_TAG + 4 * piece + 2,
                                      engine.device)
        for param, grad in zip(params, _take(engine.messenger, incoming)):
            param.grad = None if grad is None else grad.clone()
    engine.messenger.wait_posted(sends, "sending replica gradients")


def _sizes(templates: list) -> dict:
    """Elements per dtype, in the order dtypes first appear."""
    sizes: dict = {}
    for template in templates:
        sizes[template.dtype] = sizes.get(template.dtype, 0) + template.numel()
    return sizes


def send_packed(messenger: Messenger, peer: int, grads: list, templates: list, tag: int,
                device: torch.device) -> list:
    """Post ``grads`` (None where absent, sent as zeros) to group rank ``peer`` as a mask and one flat
    buffer per dtype; returns the posted entries (:meth:`Messenger.wait_posted`)."""
    mask = torch.tensor([g is not None for g in grads], dtype=torch.uint8, device=device)
    by_dtype: dict = {dtype: [] for dtype in _sizes(templates)}
    for grad, template in zip(grads, templates):
        part = grad if grad is not None else torch.zeros_like(template)
        by_dtype[template.dtype].append(part.reshape(-1))
    entries = [messenger.post_send(mask, peer, tag)]
    entries += [messenger.post_send(torch.cat(parts), peer, tag + 1) for parts in by_dtype.values()]
    return entries


def _post_incoming(messenger: Messenger, peer: int, templates: list, tag: int, device: torch.device) -> _Incoming:
    global_peer = messenger.to_global(peer)
    mask = torch.empty(len(templates), dtype=torch.uint8, device=device)
    works = [dist.irecv(mask, global_peer, group=messenger.group, tag=tag)]
    buffers = {}
    for dtype, size in _sizes(templates).items():
        buffers[dtype] = torch.empty(size, dtype=dtype, device=device)
        works.append(dist.irecv(buffers[dtype], global_peer, group=messenger.group, tag=tag + 1))
    return _Incoming(peer=peer, templates=templates, mask=mask, buffers=buffers, works=works)


def receive_packed(messenger: Messenger, peer: int, templates: list, tag: int, device: torch.device, *,
                   what: str = "replica gradients") -> list:
    """Receive what :func:`send_packed` sent from group rank ``peer``: gradients shaped like ``templates``."""
    return _take(messenger, _post_incoming(messenger, peer, templates, tag, device), what)


def _take(messenger: Messenger, incoming: _Incoming, what: str = "replica gradients") -> list:
    """Wait for a posted packed message and cut it back into gradients (None where flagged absent)."""
    for work in incoming.works:
        messenger.wait_work(work, f"receiving {what} from rank {incoming.peer}", incoming.peer)
    offsets = dict.fromkeys(incoming.buffers, 0)
    grads = []
    for template, present in zip(incoming.templates, incoming.mask.tolist()):
        start = offsets[template.dtype]
        offsets[template.dtype] = start + template.numel()
        view = incoming.buffers[template.dtype][start:start + template.numel()].view(template.shape)
        grads.append(view if present else None)
    return grads
