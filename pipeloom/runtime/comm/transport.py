"""How one backend moves the point-to-point messages of a step, behind one small interface: post a
receive, send, flush, and hand over what is queued (:meth:`Transport.settle`, which reports a failed
post). Failures and bounded waits stay with the :class:`~pipeloom.runtime.comm.messenger.Messenger`.

- :class:`TaggedTransport` (gloo) matches messages by tag: receives are posted as soon as their sizes
  are known, several actions ahead, and sends are posted by a helper thread (a gloo send to a peer
  that is not receiving yet blocks the poster), so compute never waits on a post.
- :class:`OrderedTransport` (NCCL) matches messages in posting order per pair: nothing is posted ahead,
  and an action's sends go out together with the next action's receives as one ``batch_isend_irecv``,
  as NCCL needs to progress both directions together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeloom.runtime.comm.threads import HelperThreads, SendThread
from pipeloom.runtime.program import Unit

__all__ = ["OrderedTransport", "Posted", "TaggedTransport", "Transport", "transport_for"]


@dataclass(slots=True)
class Posted:
    """One point-to-point operation: its tensor, the step's unit it belongs to (None for traffic outside
    the units: replica and shared-parameter gradients) and, once posted, its work."""

    tensor: torch.Tensor
    unit: Unit | None = None
    work: dist.Work | None = None


class Transport:
    """Posts point-to-point operations on ``group`` (peers are global ranks)."""

    lookahead = 0  # compute actions whose receives are posted ahead of time
    early_traffic = False  # whether messages outside the units may be posted during the step

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send(self, posted: Posted, dst: int, tag: int) -> None:
        raise NotImplementedError

    def receive(self, posted: Posted, src: int, tag: int) -> None:
        """Post a receive into ``posted.tensor``; a broken connection raises here."""
        raise NotImplementedError

    def send_now(self, posted: Posted, dst: int, tag: int) -> None:
        """Send outside the step's batches (replica and shared-parameter gradients)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Post what is batched (NCCL); nothing elsewhere."""

    def settle(self) -> tuple[Exception, Posted, int] | None:
        """Every queued send handed to the backend; the first failed post, as (error, posted, dst)."""
        return None


class TaggedTransport(Transport):
    """gloo: receives posted ahead, sends posted by a helper thread (see the module doc)."""

    lookahead = 2
    early_traffic = True

    def __init__(self, group: dist.ProcessGroup | None, helpers: HelperThreads) -> None:
        super().__init__(group)
        self.helpers = helpers

    def send(self, posted: Posted, dst: int, tag: int) -> None:
        helpers = self.helpers
        if helpers.sender is None:
            helpers.sender = SendThread(self.group)
        helpers.sender.queue.put((posted, dst, tag))

    def receive(self, posted: Posted, src: int, tag: int) -> None:
        posted.work = dist.irecv(posted.tensor, src, group=self.group, tag=tag)

    def send_now(self, posted: Posted, dst: int, tag: int) -> None:
        self.send(posted, dst, tag)

    def settle(self) -> tuple[Exception, Posted, int] | None:
        sender = self.helpers.sender
        if sender is None:
            return None
        sender.queue.join()
        return sender.failure


class OrderedTransport(Transport):
    """NCCL: an action's sends and the next action's receives posted as one batch, in order."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__(group)
        self.ops: list[tuple[dist.P2POp, Posted]] = []

    def send(self, posted: Posted, dst: int, tag: int) -> None:
        self.ops.append((dist.P2POp(dist.isend, posted.tensor, dst, self.group, tag), posted))

    def receive(self, posted: Posted, src: int, tag: int) -> None:
        self.ops.append((dist.P2POp(dist.irecv, posted.tensor, src, self.group, tag), posted))

    def send_now(self, posted: Posted, dst: int, tag: int) -> None:
        posted.work = dist.isend(posted.tensor, dst, group=self.group, tag=tag)

    def flush(self) -> None:
        if self.ops:
            works = dist.batch_isend_irecv([op for op, _ in self.ops])
            for (_, posted), work in zip(self.ops, works):
                posted.work = work
            self.ops = []


def transport_for(group: dist.ProcessGroup | None, helpers: HelperThreads) -> Transport:
    """The transport of ``group``'s backend: NCCL matches in order, every other backend by tag."""
    backend = dist.get_backend(group) if group is not None else "gloo"
    return OrderedTransport(group) if backend == "nccl" else TaggedTransport(group, helpers)
