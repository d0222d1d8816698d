"""Gradients sent as one packed message: a presence mask and one flat buffer per dtype, so a list of
gradients (None where absent) crosses ranks in two or three messages. Used by the replica merge of
two-replica schedules and by the shared-parameter exchange. Python values gathered over a group as
pickled bytes, awaited as the step's messages are (:func:`gather_objects`)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeloom.runtime.comm.messenger import Messenger
from pipeloom.runtime.comm.transport import Posted
from pipeloom.runtime.errors import PipelineError

__all__ = ["Incoming", "gather_objects", "post_incoming", "receive_packed", "send_packed", "take"]


@dataclass(slots=True)
class Incoming:
    """Receives posted for one packed message: a presence mask and one flat buffer per dtype."""

    peer: int
    templates: list  # tensors shaped like the gradients to come, in order
    mask: torch.Tensor
    buffers: dict  # dtype -> flat buffer
    works: list


def _sizes(templates: list) -> dict:
    """Elements per dtype, in the order dtypes first appear."""
    sizes: dict = {}
    for template in templates:
        sizes[template.dtype] = sizes.get(template.dtype, 0) + template.numel()
    return sizes


def send_packed(messenger: Messenger, peer: int, grads: list, templates: list, tag: int,
                device: torch.device) -> list[Posted]:
    """Post ``grads`` (None where absent, sent as zeros) to group rank ``peer`` as a mask and one flat
    buffer per dtype; returns the posted sends (:meth:`Messenger.wait_posted`)."""
    mask = torch.tensor([g is not None for g in grads], dtype=torch.uint8, device=device)
    by_dtype: dict = {dtype: [] for dtype in _sizes(templates)}
    for grad, template in zip(grads, templates):
        part = grad if grad is not None else torch.zeros_like(template)
        by_dtype[template.dtype].append(part.reshape(-1))
    entries = [messenger.post_send(mask, peer, tag)]
    entries += [messenger.post_send(torch.cat(parts), peer, tag + 1) for parts in by_dtype.values()]
    return entries


def post_incoming(messenger: Messenger, peer: int, templates: list, tag: int, device: torch.device) -> Incoming:
    """Post the receives of a packed message from group rank ``peer`` (gradients shaped like ``templates``)."""
    global_peer = messenger.to_global(peer)
    mask = torch.empty(len(templates), dtype=torch.uint8, device=device)
    works = [dist.irecv(mask, global_peer, group=messenger.group, tag=tag)]
    buffers = {}
    for dtype, size in _sizes(templates).items():
        buffers[dtype] = torch.empty(size, dtype=dtype, device=device)
        works.append(dist.irecv(buffers[dtype], global_peer, group=messenger.group, tag=tag + 1))
    return Incoming(peer=peer, templates=templates, mask=mask, buffers=buffers, works=works)


def receive_packed(messenger: Messenger, peer: int, templates: list, tag: int, device: torch.device, *,
                   what: str = "replica gradients") -> list:
    """Receive what :func:`send_packed` sent from group rank ``peer``: gradients shaped like ``templates``."""
    return take(messenger, post_incoming(messenger, peer, templates, tag, device), what)


def take(messenger: Messenger, incoming: Incoming, what: str = "replica gradients") -> list:
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


def gather_objects(value: object, group: object, world: int, rank: int, device: torch.device,
                   wait: Callable[[object, str], None], doing: str) -> list[Any]:
    """Every rank's ``value`` of ``group`` (pickled, on ``device`` as the backend needs), each exchange posted and
    awaited with ``wait`` (the messenger's: a rank failing meanwhile raises its PipelineError, not a hang until the
    group's timeout, as a blocking ``all_gather_object`` would); a refused post or a value that cannot be pickled
    raises a PipelineError naming ``rank`` and ``doing``."""
    try:
        mine = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        wait(dist.all_gather(sizes, torch.tensor([mine.numel()], device=device), group=group, async_op=True), doing)
        longest = int(max(size.item() for size in sizes))
        parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
        padded = torch.cat([mine, torch.zeros(longest - mine.numel(), dtype=torch.uint8, device=device)])
        wait(dist.all_gather(parts, padded, group=group, async_op=True), doing)
    except PipelineError:
        raise
    except Exception as error:  # noqa: BLE001 (a broken group refuses the post; a value may not pickle)
        raise PipelineError(f"rank {rank}: {doing} failed: {type(error).__name__}: {error}") from error
    return [pickle.loads(part[:int(size.item())].cpu().numpy().tobytes()) for part, size in zip(parts, sizes)]
