"""Two-replica schedules (DualPipe, Chimera): both copies of a model piece end a step with the same
``.grad``, the sum of every micro-batch's gradient in micro-batch order, as on one device."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pipeloom.runtime.backward import accumulate_grad
from pipeloom.runtime.lower import PipelineError

if TYPE_CHECKING:
    from pipeloom.runtime.engine import PipelineEngine
    from pipeloom.runtime.step import StepRun

__all__ = ["merge_replicas"]

REPLICA_TAG = 1 << 24  # tags of these messages, clear of the step's own


def merge_replicas(engine: PipelineEngine, run: StepRun) -> None:
    """Two-replica schedules: add each piece's micro-batch gradients in micro-batch order on the
    first replica's rank, and give both replicas the same result.

    The second replica sends all its micro-batch gradients of a piece at once (a presence mask and
    one flat buffer per dtype); the first adds everything in micro-batch order and sends the sums
    back the same way. Pieces go in index order on every rank, so the exchanges pair up.
    """
    if engine.lowering.replicas == 1:
        return
    low = engine.lowering
    sends: list = []
    for piece in range(low.num_pieces):
        stages = [low.stage_for[j][piece] for j in range(low.replicas)]
        ranks = [low.rank_of[s] for s in stages]
        if engine.rank not in ranks:
            continue
        owner = ranks[0]
        mine = [s for s in stages if low.rank_of[s] == engine.rank]
        params = engine.params[mine[0]]
        contributions: dict[int, list] = {}
        for s in mine:
            contributions.update(run.replica_grads.get(s, {}))
        tag = REPLICA_TAG + 4 * piece
        if engine.rank == owner:
            for j, other in enumerate(ranks):
                if other == engine.rank:
                    continue
                mbs = [low.replicas * m + j for m in range(low.schedule.num_microbatches)]
                grads = _receive_packed(engine, other, params * len(mbs), tag)
                for k, mb in enumerate(mbs):
                    contributions[mb] = grads[k * len(params):(k + 1) * len(params)]
            for mb in sorted(contributions):
                for param, grad in zip(params, contributions[mb]):
                    if grad is not None:
                        accumulate_grad(param, grad)
            for other in sorted(set(ranks) - {engine.rank}):
                sends += _send_packed(engine, other, [p.grad for p in params], tag + 2)
        else:
            flat = [g for mb in sorted(contributions) for g in contributions[mb]]
            sends += _send_packed(engine, owner, flat, tag)
            for param, grad in zip(params, _receive_packed(engine, owner, params, tag + 2)):
                param.grad = None if grad is None else grad.clone()
    for work, peer in sends:
        _wait(engine, work, peer)

def _wait(engine: PipelineEngine, work, peer: int) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=engine.timeout))
    except Exception as error:
        raise PipelineError(f"rank {engine.rank}: exchanging replica gradients with rank {peer} failed: {error}; "
                            f"{engine.messenger.peer_error(peer) or 'it failed or hung'}") from error

def _send_packed(engine: PipelineEngine, peer: int, grads: list, tag: int) -> list:
    """Post the sends of ``grads`` (None where absent) as a mask and one flat buffer per dtype."""
    mask = torch.tensor([g is not None for g in grads], dtype=torch.uint8, device=engine.device)
    by_dtype: dict[torch.dtype, list] = {}
    for grad in grads:
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad.reshape(-1))
    global_peer = dist.get_global_rank(engine.group, peer)
    works = [(dist.isend(mask, global_peer, group=engine.group, tag=tag), peer)]
    works += [(dist.isend(torch.cat(parts), global_peer, group=engine.group, tag=tag + 1), peer)
              for parts in by_dtype.values()]
    return works

def _receive_packed(engine: PipelineEngine, peer: int, templates: list, tag: int) -> list:
    """Receive what :meth:`_send_packed` sent for tensors shaped like ``templates``."""
    global_peer = dist.get_global_rank(engine.group, peer)
    mask = torch.empty(len(templates), dtype=torch.uint8, device=engine.device)
    _wait(engine, dist.irecv(mask, global_peer, group=engine.group, tag=tag), peer)
    present = mask.tolist()
    sizes: dict[torch.dtype, int] = {}
    for template, here in zip(templates, present):
        if here:
            sizes[template.dtype] = sizes.get(template.dtype, 0) + template.numel()
    buffers = {}
    for dtype, size in sizes.items():
        buffers[dtype] = torch.empty(size, dtype=dtype, device=engine.device)
        _wait(engine, dist.irecv(buffers[dtype], global_peer, group=engine.group, tag=tag + 1), peer)
    offsets = dict.fromkeys(sizes, 0)
    grads = []
    for template, here in zip(templates, present):
        if not here:
            grads.append(None)
            continue
        start = offsets[template.dtype]
        offsets[template.dtype] = start + template.numel()
        grads.append(buffers[template.dtype][start:start + template.numel()].view(template.shape))
    return grads
