"""The lowering pass ``lower(schedule) -> Schedule``: a compute-only schedule plus the send and
receive actions every cross-rank edge of its stage graph needs (docs/design.md §2)."""

from __future__ import annotations

from collections import defaultdict

from pipeloom.errors import LoweringError
from pipeloom.ir import Action, Comm, Overlap, Schedule
from pipeloom.lowering.graph import CommGraph, Message

__all__ = ["lower"]


def lower(schedule: Schedule) -> Schedule:
    """``schedule`` with communication actions: torch's ``_PipelineScheduleRuntime`` IR.

    - A send goes right after the compute action that makes its data: ``uSEND_Fm`` after ``uFm``,
      ``vSEND_Bm`` after v's ``B``/``I`` of m. One send covers every consumer stage on another rank
      (its messages go out in increasing peer stage); an edge within one rank carries nothing.
    - A receive goes right before the compute action that needs it (``vRECV_Fm`` before ``vFm``,
      ``uRECV_Bm`` before u's ``B``/``I``; torch's placement with ``defer_pp_recv``), unless a message
      the same peer rank sent earlier is still to be received: that receive then comes first, so that
      each (sender, receiver) pair takes its messages in the order they were sent (first-in first-out,
      as ``torch.distributed`` point-to-point messages match). Receiving an earlier message sooner adds
      no wait, because its sender issued it before the one needed.
    - An overlapped pair takes the receives of both its parts before it and the sends of both after
      it (forward's first); a B on a split stage sends and receives as its I.
    - The compute actions keep their order; only single-rank tasks, each stage on one rank, can be
      lowered (LoweringError naming the task otherwise).

    A schedule that already holds communication actions is refused (ScheduleError): lower the
    compute-only schedule once. The result is not validated here; :func:`pipeloom.validate.validate`
    checks it (matching, pair order, deadlock) like any schedule.
    """
    _refuse_lowered(schedule)
    graph = CommGraph.of(schedule.problem)
    with_sends = [_with_sends(actions, graph) for actions in schedule.ranks]
    order: dict[tuple[int, int], dict[Message, int]] = defaultdict(dict)  # (src, dst) -> message -> k
    for actions in with_sends:
        for action in actions:
            if type(action) is Comm:
                for message in graph.messages(action):
                    pair = order[(graph.source(message), graph.target(message))]
                    pair[message] = len(pair)
    ranks = tuple(_Receiver(rank, graph, order).run(actions) for rank, actions in enumerate(with_sends))
    return Schedule(name=schedule.name, problem=schedule.problem, num_microbatches=schedule.num_microbatches,
                    ranks=ranks)


def _refuse_lowered(schedule: Schedule) -> None:
    for rank, actions in enumerate(schedule.ranks):
        for step, action in enumerate(actions):
            if type(action) is Comm:
                raise LoweringError(
                    f"schedule {schedule.name!r} is already lowered (rank {rank} step {step}: {action}); "
                    "lower() takes a compute-only schedule: lower the original once"
                )


def _with_sends(actions: tuple, graph: CommGraph) -> list[Action | Overlap | Comm]:
    """``actions`` with each send right after the compute action that makes its data."""
    out: list[Action | Overlap | Comm] = []
    for action in actions:
        out.append(action)
        out.extend(graph.sends_after(action))
    return out


class _Receiver:
    """Places one rank's receives: before the compute that needs them, in each pair's send order."""

    def __init__(self, rank: int, graph: CommGraph, order: dict[tuple[int, int], dict[Message, int]]) -> None:
        self.rank, self.graph = rank, graph
        self.incoming = {src: list(pair) for (src, dst), pair in order.items() if dst == rank}
        self.position = {src: order[(src, rank)] for src in self.incoming}
        self.next = dict.fromkeys(self.incoming, 0)  # sender -> first message not yet received
        self.received: set[Message] = set()
        self.placed: set[Comm] = set()
        self.placing: list[Comm] = []
        self.out: list[Action | Overlap | Comm] = []

    def run(self, actions: list[Action | Overlap | Comm]) -> tuple[Action | Overlap | Comm, ...]:
        for action in actions:
            if type(action) is not Comm:
                for receive in self.graph.receives_before(action):
                    self._place(receive)
            self.out.append(action)
        return tuple(self.out)

    def _place(self, receive: Comm) -> None:
        """Append ``receive`` after the receives of every message its senders sent to us before."""
        if receive in self.placed:
            return
        if receive in self.placing:
            others = self.placing[self.placing.index(receive) + 1:]
            why = ("it takes several messages from one rank in increasing peer stage order and that rank "
                   "sends them in another order" if not others else
                   f"it must come both before and after {', '.join(map(str, others))}")
            raise LoweringError(
                f"rank {self.rank} cannot receive {receive} in pair order (messages between two ranks are "
                f"received in the order they are sent): {why}; change the compute order of the sending ranks"
            )
        self.placing.append(receive)
        for message in self.graph.messages(receive):
            src = self.graph.source(message)
            k = self.position.get(src, {}).get(message)
            while k is not None and self.next[src] < k:
                self._place(self.graph.receive_of(self.incoming[src][self.next[src]]))
        self.placing.pop()
        self.out.append(receive)
        self.placed.add(receive)
        for message in self.graph.messages(receive):
            self.received.add(message)
            src = self.graph.source(message)
            sent = self.incoming.get(src, ())
            while self.next.get(src, 0) < len(sent) and sent[self.next[src]] in self.received:
                self.next[src] += 1
