"""Who sends what to whom once a schedule is lowered: the cross-rank edges of a problem's stage
graph, the messages each communication action carries, and the compute actions around them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from pipeloom.errors import LoweringError
from pipeloom.ir import Action, Comm, Overlap, compute_parts
from pipeloom.problem import Problem, task_name

__all__ = ["CommGraph", "Message"]

_GRADIENT_KINDS = ("B", "I")
_SEND = {"F": "SEND_F", "B": "SEND_B"}
_RECV = {"F": "RECV_F", "B": "RECV_B"}


class Message(NamedTuple):
    """What one stage edge carries for one micro-batch: ``producer``'s forward values for
    ``consumer`` (direction ``"F"``), or the gradients of those values going back (``"B"``)."""

    direction: str
    producer: int
    consumer: int
    microbatch: int

    def __str__(self) -> str:
        if self.direction == "F":
            return f"stage {self.producer}'s values for stage {self.consumer} (micro-batch {self.microbatch})"
        return f"stage {self.consumer}'s gradients for stage {self.producer} (micro-batch {self.microbatch})"


def _sorted_map(table: dict[int, set[int]]) -> Mapping[int, tuple[int, ...]]:
    return MappingProxyType({stage: tuple(sorted(peers)) for stage, peers in table.items()})


@dataclass(frozen=True, slots=True)
class CommGraph:
    """The cross-rank edges of a problem whose tasks each run on one rank, every task of a stage
    on the same rank.

    A forward edge u -> v (task ``vF`` waits for ``uF``) on two ranks makes ``uSEND_Fm`` after ``uFm``
    and ``vRECV_Fm`` before ``vFm``; a gradient edge (``uB``/``uI`` waits for ``vB``/``vI``) makes
    ``vSEND_Bm`` after v's backward and ``uRECV_Bm`` before u's. Edges within a rank carry nothing.
    One action covers every peer stage on another rank; its messages go out (or are taken) in
    increasing order of the peer stage.
    """

    rank_of: Mapping[int, int]
    """Stage -> the one rank its tasks run on."""
    backward: Mapping[int, str]
    """Stage -> the kind (``B`` or ``I``) of its task that sends or receives gradients."""
    consumers: Mapping[int, tuple[int, ...]]
    """Stage u -> stages on other ranks whose F waits for u's F (``uSEND_F`` goes to them)."""
    producers: Mapping[int, tuple[int, ...]]
    """Stage v -> stages on other ranks whose F v's F waits for (``vRECV_F`` takes from them)."""
    gradient_targets: Mapping[int, tuple[int, ...]]
    """Stage v -> stages on other ranks whose backward waits for v's (``vSEND_B`` goes to them)."""
    gradient_sources: Mapping[int, tuple[int, ...]]
    """Stage u -> stages on other ranks whose backward u's waits for (``uRECV_B`` takes from them)."""

    @classmethod
    def of(cls, problem: Problem) -> CommGraph:
        """The graph of ``problem``; LoweringError naming the task when it cannot be lowered."""
        rank_of: dict[int, int] = {}
        for task in problem.tasks:
            if len(task.ranks) != 1:
                raise LoweringError(
                    f"task {task.name} runs on ranks {list(task.ranks)}; lowering needs every task on one "
                    "rank (a multi-rank block has no single sender or receiver): keep this schedule "
                    "compute-only, or give the block one rank"
                )
            owner = rank_of.setdefault(task.stage, task.ranks[0])
            if owner != task.ranks[0]:
                raise LoweringError(
                    f"stage {task.stage} runs on ranks {owner} and {task.ranks[0]}; lowering needs all "
                    "tasks of a stage on one rank (its activations stay there): split it into two stages"
                )
        edges: dict[str, dict[int, set[int]]] = {name: {} for name in ("cons", "prod", "gt", "gs")}
        backward: dict[int, str] = {}
        for task in problem.tasks:
            for dep in task.deps:
                if dep[0] == task.stage or rank_of[dep[0]] == rank_of[task.stage]:
                    continue
                if task.kind == "F" and dep[1] == "F":
                    edges["cons"].setdefault(dep[0], set()).add(task.stage)
                    edges["prod"].setdefault(task.stage, set()).add(dep[0])
                elif task.kind in _GRADIENT_KINDS and dep[1] in _GRADIENT_KINDS:
                    _note_backward(backward, task.stage, task.kind)
                    _note_backward(backward, dep[0], dep[1])
                    edges["gt"].setdefault(dep[0], set()).add(task.stage)
                    edges["gs"].setdefault(task.stage, set()).add(dep[0])
                else:
                    raise LoweringError(
                        f"task {task.name} on rank {rank_of[task.stage]} waits for {task_name(dep)} on rank "
                        f"{rank_of[dep[0]]}; lowering carries forward values (F after F) and gradients "
                        "(B or I after B or I) between ranks, nothing else: put both tasks on one rank"
                    )
        return cls(
            rank_of=MappingProxyType(rank_of), backward=MappingProxyType(backward),
            consumers=_sorted_map(edges["cons"]), producers=_sorted_map(edges["prod"]),
            gradient_targets=_sorted_map(edges["gt"]), gradient_sources=_sorted_map(edges["gs"]),
        )

    def messages(self, comm: Comm) -> tuple[Message, ...]:
        """The messages ``comm`` sends or takes, in the order they go out; () for a foreign kind."""
        s, m = comm.stage, comm.microbatch
        if comm.kind == "SEND_F":
            return tuple(Message("F", s, v, m) for v in self.consumers.get(s, ()))
        if comm.kind == "RECV_F":
            return tuple(Message("F", u, s, m) for u in self.producers.get(s, ()))
        if comm.kind == "SEND_B":
            return tuple(Message("B", u, s, m) for u in self.gradient_targets.get(s, ()))
        if comm.kind == "RECV_B":
            return tuple(Message("B", s, v, m) for v in self.gradient_sources.get(s, ()))
        return ()

    def source(self, message: Message) -> int:
        """The rank that sends ``message``."""
        return self.rank_of[message.producer if message.direction == "F" else message.consumer]

    def target(self, message: Message) -> int:
        """The rank that receives ``message``."""
        return self.rank_of[message.consumer if message.direction == "F" else message.producer]

    def send_of(self, message: Message) -> Comm:
        """The send action that carries ``message``."""
        stage = message.producer if message.direction == "F" else message.consumer
        return Comm(stage, _SEND[message.direction], message.microbatch)

    def receive_of(self, message: Message) -> Comm:
        """The receive action that takes ``message``."""
        stage = message.consumer if message.direction == "F" else message.producer
        return Comm(stage, _RECV[message.direction], message.microbatch)

    def _moves_gradients(self, action: Action) -> bool:
        """Whether ``action`` is its stage's gradient task (its B or I; a B on a split stage runs its I)."""
        kind = self.backward.get(action.stage)
        return kind == action.kind or (kind == "I" and action.kind == "B")

    def send_after(self, action: Action) -> Comm | None:
        """The send that follows compute ``action`` (it makes the data), or None when none does."""
        stage = action.stage
        if action.kind == "F" and stage in self.consumers:
            return Comm(stage, "SEND_F", action.microbatch)
        if stage in self.gradient_targets and self._moves_gradients(action):
            return Comm(stage, "SEND_B", action.microbatch)
        return None

    def receive_before(self, action: Action) -> Comm | None:
        """The receive compute ``action`` needs first (its inputs), or None when it needs none."""
        stage = action.stage
        if action.kind == "F" and stage in self.producers:
            return Comm(stage, "RECV_F", action.microbatch)
        if stage in self.gradient_sources and self._moves_gradients(action):
            return Comm(stage, "RECV_B", action.microbatch)
        return None

    def sends_after(self, action: Action | Overlap) -> tuple[Comm, ...]:
        """The sends that follow a compute action or an overlapped pair (both parts' sends, in order)."""
        return tuple(send for part in compute_parts(action) if (send := self.send_after(part)) is not None)

    def receives_before(self, action: Action | Overlap) -> tuple[Comm, ...]:
        """The receives a compute action or an overlapped pair needs first (both parts', in order)."""
        return tuple(receive for part in compute_parts(action)
                     if (receive := self.receive_before(part)) is not None)

    def compute_of(self, comm: Comm) -> Action:
        """The compute action a send's data comes from, or the one a receive's data is for."""
        kind = "F" if comm.direction == "F" else self.backward.get(comm.stage, "B")
        return Action(comm.stage, kind, comm.microbatch)

    def comm_kinds(self, stage: int) -> tuple[str, ...]:
        """The communication kinds stage ``stage`` runs for every micro-batch, in COMM_KINDS order."""
        return tuple(kind for kind, table in (
            ("SEND_F", self.consumers), ("RECV_F", self.producers),
            ("SEND_B", self.gradient_targets), ("RECV_B", self.gradient_sources),
        ) if stage in table)


def _note_backward(backward: dict[int, str], stage: int, kind: str) -> None:
    """Record that ``stage`` moves gradients through its ``kind`` task; one kind per stage."""
    if backward.setdefault(stage, kind) != kind:
        raise LoweringError(
            f"stage {stage} moves gradients through both its B and its I task; lowering needs one "
            "gradient task per stage: give the stage a full B or a split I + W, not both"
        )
