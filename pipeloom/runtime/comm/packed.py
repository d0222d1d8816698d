"""Gradients sent as one packed message: a presence mask and one flat buffer per dtype, so a list of
gradients (None where absent) crosses ranks in two or three messages. Used by the replica merge of
two-replica schedules and by the shared-parameter exchange."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeloom.runtime.comm.messenger import Messenger
from pipeloom.runtime.comm.transport import Posted

__all__ = ["Incoming", "post_incoming", "receive_packed", "send_packed", "take"]


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
