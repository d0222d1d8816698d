"""Per-rank programs of a compute-only schedule on a staged model (:func:`build_programs`): which piece each
schedule stage runs, which real micro-batch each action works on, and the messages between ranks in send order.

A schedule whose forward graph has c disjoint components, each shaped like the model, runs c model
replicas (DualPipe, Chimera): component j's stages run the model's pieces in index order, and IR
micro-batch m of component j is real micro-batch ``c * m + j``. Every other schedule has c = 1.

This module needs no torch: it works on the schedule and on the stage graph's value references.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeloom.ir import Action, Comm, Overlap, Schedule, compute_parts
from pipeloom.runtime.errors import PipelineError
from pipeloom.schedules import REGISTRY

__all__ = ["MODEL_INPUT", "Lowering", "Source", "Step", "Unit", "build_programs", "check_pieces", "forward_unit",
           "model_pieces"]

class Source(enum.Enum):
    """Where a value comes from when it is not a piece's output."""

    MODEL_INPUT = "model input"

    def __repr__(self) -> str:
        return self.name


MODEL_INPUT = Source.MODEL_INPUT
"""The producer of a value that is a model input, not a piece's output (in ``ValueRef.stage`` and in
``lower``'s piece inputs): a marker of its own type, so it is never taken for a stage number (a list
indexed by it fails loudly instead of reading the last entry)."""


@dataclass(frozen=True, slots=True)
class Unit:
    """One message between ranks: stage outputs (kind "F") or their gradients (kind "B") of one
    micro-batch; ``indices`` are output positions of the producer's piece."""

    id: int
    kind: str  # "F": producer -> consumer values; "B": consumer -> producer gradients
    producer: int  # schedule stage making the values
    consumer: int  # schedule stage using them
    microbatch: int  # real micro-batch
    indices: tuple[int, ...]
    src: int  # sending rank
    dst: int  # receiving rank


@dataclass(frozen=True, slots=True)
class Step:
    """One compute action of a rank with the messages it needs first and sends after.

    An overlapped pair is two steps, its forward then its backward, each with ``pair`` set: the step
    run receives both parts' messages before the forward and sends both parts' after the backward.
    """

    action: Action
    piece: int
    microbatch: int  # real micro-batch
    recvs: tuple[int, ...]  # unit ids to have received before running
    sends: tuple[int, ...]  # unit ids to send after running
    posts: tuple[int, ...] = ()  # a lowered schedule's receives placed before this action (unit ids)
    pair: Overlap | None = None  # the overlapped pair this step is a part of

    @property
    def opens_pair(self) -> bool:
        """Whether this step is the forward part of an overlapped pair (its backward is the next step)."""
        return self.pair is not None and self.action == self.pair.forward

    @property
    def closes_pair(self) -> bool:
        """Whether this step is the backward part of an overlapped pair."""
        return self.pair is not None and self.action == self.pair.backward


@dataclass(frozen=True, slots=True)
class Lowering:
    """Everything the engine needs to run a schedule on a model, for every rank."""

    schedule: Schedule
    replicas: int  # c: model replicas (1, or 2 for DualPipe/Chimera)
    num_microbatches: int  # real micro-batches per step (c × the schedule's)
    piece_of: tuple[int, ...]  # schedule stage -> model piece
    replica_of: tuple[int, ...]  # schedule stage -> component
    stage_for: tuple[tuple[int, ...], ...]  # [component][piece] -> schedule stage
    rank_of: tuple[int, ...]  # schedule stage -> rank
    # per stage: its piece's inputs (stage or MODEL_INPUT, index)
    sources: tuple[tuple[tuple[int | Source, int], ...], ...]
    units: tuple[Unit, ...]
    unit_of: dict[tuple[str, int, int, int], int]  # (kind, producer, consumer, real micro-batch) -> unit id
    programs: tuple[tuple[Step, ...], ...]  # per rank
    pair_order: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # (src, dst) -> unit ids
    explicit_posts: bool = False  # lowered from a schedule with RECV actions: receives posted where they stand

    @property
    def num_pieces(self) -> int:
        """Pieces of the model (stages of one replica)."""
        return len(self.stage_for[0])

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """Schedule stages held by ``rank``, sorted."""
        return tuple(s for s, r in enumerate(self.rank_of) if r == rank)


def _components(num_stages: int, edges: set[tuple[int, int]]) -> list[list[int]]:
    """Connected components of the forward graph (undirected), each sorted, ordered by first stage."""
    parent = list(range(num_stages))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u, v in edges:
        parent[find(u)] = find(v)
    groups: dict[int, list[int]] = defaultdict(list)
    for s in range(num_stages):
        groups[find(s)].append(s)
    return sorted(groups.values(), key=lambda g: g[0])


def _reachable(num_stages: int, edges: set[tuple[int, int]]) -> list[set[int]]:
    """For every stage, the stages its forward output reaches (transitively)."""
    after: dict[int, list[int]] = defaultdict(list)
    for u, v in edges:
        after[u].append(v)
    reach: list[set[int]] = []
    for s in range(num_stages):
        seen: set[int] = set()
        stack = list(after[s])
        while stack:
            v = stack.pop()
            if v not in seen:
                seen.add(v)
                stack.extend(after[v])
        reach.append(seen)
    return reach


def _forward_edges(schedule: Schedule) -> set[tuple[int, int]]:
    return {(dep[0], task.stage) for task in schedule.problem.tasks if task.kind == "F"
            for dep in task.deps if dep[1] == "F"}


def check_pieces(schedule: Schedule, num_pieces: int, components: list[list[int]] | None = None) -> None:
    """PipelineError unless every replica of ``schedule`` (a connected component of its forward stages;
    ``components`` when already found) has ``num_pieces`` stages: the model's pieces, one per stage."""
    num_stages = schedule.problem.num_stages
    components = _components(num_stages, _forward_edges(schedule)) if components is None else components
    replicas = len(components)
    if any(len(c) != num_pieces for c in components):
        sizes = sorted({len(c) for c in components})
        per = f"{replicas} replicas of {sizes} stages" if replicas > 1 else _counted(num_stages, "stage")
        wanted = num_stages // replicas if num_stages % replicas == 0 else num_stages
        per_rank, extra = divmod(num_pieces, schedule.num_ranks)
        takers = [name for name, info in REGISTRY.items()
                  if info.placement == "interleaved" or (per_rank == 2 and info.placement == "v")]
        holds = f" ({', '.join(takers)} hold {per_rank} stages a rank)" if per_rank > 1 and not extra else ""
        raise PipelineError(
            f"the schedule {schedule.name!r} has {per}, but the model is cut into {_counted(num_pieces, 'piece')} "
            f"({_points(num_pieces - 1)}); cut the model into {_counted(wanted, 'piece')} ({_points(wanted - 1)}), "
            f"or choose a schedule with as many stages as pieces{holds}"
        )


def model_pieces(schedule: Schedule) -> int:
    """How many pieces the model must be cut into to run ``schedule``: its stages over its replicas."""
    num_stages = schedule.problem.num_stages
    return num_stages // len(_components(num_stages, _forward_edges(schedule)))


def forward_unit(unit_of: dict[tuple[str, int, int, int], int], unit: Unit) -> int:
    """The id of the forward unit whose values gradient ``unit`` answers (``unit_of``: Lowering.unit_of)."""
    return unit_of[("F", unit.producer, unit.consumer, unit.microbatch)]


def build_programs(schedule: Schedule, piece_inputs: Sequence[Sequence[tuple[int | Source, int]]],
          output_refs: Sequence[tuple[int | Source, int]]) -> Lowering:
    """Map ``schedule`` onto a model of ``len(piece_inputs)`` pieces and list every rank's steps.

    ``piece_inputs[k]`` are piece k's inputs as ``(piece or MODEL_INPUT, index)``;
    ``output_refs`` are the model output's leaves the same way. The loss runs on the last piece.
    A lowered schedule (with SEND/RECV actions) runs its compute actions, its receives posted where
    they stand (:func:`_receive_points`).
    """
    given = schedule
    if schedule.lowered:
        schedule = dataclasses.replace(schedule, ranks=tuple(
            tuple(a for a in actions if not isinstance(a, Comm)) for actions in schedule.ranks))
    placed = _place(schedule, piece_inputs)
    sources = tuple(tuple((MODEL_INPUT if u is MODEL_INPUT else placed.stage_for[placed.replica_of[s]][u], i)
                          for u, i in piece_inputs[placed.piece_of[s]]) for s in range(len(placed.piece_of)))
    consumers, producers = _routes(placed, sources, output_refs, last=len(piece_inputs) - 1)
    units, unit_of, programs = _programs(schedule, placed, consumers, producers)
    pair_order: dict[tuple[int, int], list[int]] = defaultdict(list)
    for u in units:
        pair_order[(u.src, u.dst)].append(u.id)
    if given.lowered:
        programs = [_receive_points(given.ranks[rank], program) for rank, program in enumerate(programs)]
    return Lowering(
        schedule=schedule, replicas=placed.replicas, num_microbatches=placed.replicas * schedule.num_microbatches,
        piece_of=placed.piece_of, replica_of=placed.replica_of, stage_for=placed.stage_for,
        rank_of=placed.rank_of, sources=sources, units=tuple(units), unit_of=unit_of, programs=tuple(programs),
        pair_order={k: tuple(v) for k, v in pair_order.items()}, explicit_posts=given.lowered,
    )


@dataclass(frozen=True, slots=True)
class _Placed:
    """Which piece, replica and rank every schedule stage runs."""

    piece_of: tuple[int, ...]
    replica_of: tuple[int, ...]
    stage_for: tuple[tuple[int, ...], ...]  # [replica][piece] -> stage
    rank_of: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.stage_for)

    def real(self, stage: int, m: int) -> int:
        """The real micro-batch of IR micro-batch ``m`` of ``stage``."""
        return self.replicas * m + self.replica_of[stage]


def _place(schedule: Schedule, piece_inputs: Sequence[Sequence[tuple[int | Source, int]]]) -> _Placed:
    """The stages' pieces (one chain of pieces per forward component), checked against the model."""
    problem = schedule.problem
    num_pieces, num_stages = len(piece_inputs), problem.num_stages
    for task in problem.tasks:
        if len(task.ranks) != 1:
            raise PipelineError(f"task {task.name} runs on ranks {list(task.ranks)}; the runtime runs each stage "
                                "on one rank: use a schedule whose stages each have one rank")
    rank_of = [0] * num_stages
    for task in problem.tasks:
        rank_of[task.stage] = task.ranks[0]
    edges = _forward_edges(schedule)
    components = _components(num_stages, edges)
    check_pieces(schedule, num_pieces, components)
    piece_of, replica_of = [0] * num_stages, [0] * num_stages
    for j, comp in enumerate(components):
        for k, s in enumerate(comp):
            piece_of[s], replica_of[s] = k, j
    reach = _reachable(num_stages, edges)
    for comp in components:
        for k, inputs in enumerate(piece_inputs):
            for u, _ in inputs:
                if u is not MODEL_INPUT and comp[k] not in reach[comp[u]]:
                    raise PipelineError(
                        f"model piece {k} reads piece {u}'s output, but in the schedule stage {comp[k]} does not "
                        f"come after stage {comp[u]}; the pieces' dataflow must follow the schedule's stage order"
                    )
    return _Placed(piece_of=tuple(piece_of), replica_of=tuple(replica_of),
                   stage_for=tuple(tuple(comp) for comp in components), rank_of=tuple(rank_of))


Routes = dict[int, list[tuple[int, tuple[int, ...]]]]  # stage -> [(other stage, output indices)]


def _routes(placed: _Placed, sources: tuple, output_refs: Sequence[tuple[int | Source, int]],
            last: int) -> tuple[Routes, Routes]:
    """(consumers, producers): what each consumer stage needs from each producer stage, both ways."""
    needs: dict[tuple[int, int], set[int]] = defaultdict(set)
    for s, stage_sources in enumerate(sources):
        for u, i in stage_sources:
            if u is not MODEL_INPUT:
                needs[(u, s)].add(i)
        if placed.piece_of[s] == last:
            for piece, i in output_refs:
                if piece is MODEL_INPUT:  # a model input returned as an output: every rank has it
                    continue
                u = placed.stage_for[placed.replica_of[s]][piece]
                if u != s:
                    needs[(u, s)].add(i)
    consumers: Routes = defaultdict(list)
    for (u, s), indices in sorted(needs.items()):
        consumers[u].append((s, tuple(sorted(indices))))
    producers: Routes = defaultdict(list)
    for (u, s), indices in sorted(needs.items(), key=lambda item: (item[0][1], item[0][0])):
        producers[s].append((u, tuple(sorted(indices))))
    return consumers, producers


def _programs(schedule: Schedule, placed: _Placed, consumers: Routes,
              producers: Routes) -> tuple[list[Unit], dict, list[tuple[Step, ...]]]:
    """Every message unit (numbered in each sender's program order, so ids are each pair's send order)
    and every rank's steps."""
    rank_of = placed.rank_of
    units: list[Unit] = []
    unit_of: dict[tuple[str, int, int, int], int] = {}

    def unit(kind: str, u: int, s: int, mb: int, indices: tuple[int, ...]) -> int:
        src, dst = (rank_of[u], rank_of[s]) if kind == "F" else (rank_of[s], rank_of[u])
        units.append(Unit(id=len(units), kind=kind, producer=u, consumer=s, microbatch=mb, indices=indices,
                          src=src, dst=dst))
        unit_of[(kind, u, s, mb)] = len(units) - 1
        return len(units) - 1

    flat = [_flatten(actions) for actions in schedule.ranks]  # per rank: (compute action, its pair or None)
    sends: dict[tuple[int, int], tuple[int, ...]] = {}  # (rank, position) -> unit ids sent after it
    for rank in range(schedule.num_ranks):
        for t, (action, _) in enumerate(flat[rank]):
            s, kind, mb = action.stage, action.kind, placed.real(action.stage, action.microbatch)
            if kind == "F":
                sends[(rank, t)] = tuple(unit("F", s, c, mb, indices) for c, indices in consumers[s]
                                         if rank_of[c] != rank)
            elif kind in ("B", "I"):
                sends[(rank, t)] = tuple(unit("B", u, s, mb, indices) for u, indices in producers[s]
                                         if rank_of[u] != rank)
    backward_kinds = {t.stage: t.kind for t in schedule.problem.tasks if t.kind in ("B", "I")}
    programs = []
    for rank in range(schedule.num_ranks):
        program = []
        for t, (action, pair) in enumerate(flat[rank]):
            s, kind, mb = action.stage, action.kind, placed.real(action.stage, action.microbatch)
            recvs: tuple[int, ...] = ()
            if kind == "F":
                recvs = tuple(unit_of[("F", u, s, mb)] for u, _ in producers[s] if rank_of[u] != rank)
            elif kind in ("B", "I"):
                recvs = tuple(unit_of[("B", s, c, mb)] for c, _ in consumers[s]
                              if rank_of[c] != rank and backward_kinds.get(c))
            program.append(Step(action=action, piece=placed.piece_of[s], microbatch=mb, recvs=recvs,
                                sends=sends.get((rank, t), ()), pair=pair))
        programs.append(tuple(program))
    return units, unit_of, programs


def _flatten(actions: Sequence[Action | Overlap | Comm]) -> list[tuple[Action, Overlap | None]]:
    """Each compute action with None, and each overlapped pair as its forward then its backward, with
    the pair (a B on a split stage stays one step: the runtime runs it as one full backward)."""
    return [(part, action if type(action) is Overlap else None)
            for action in actions for part in compute_parts(action)]


def _receive_points(actions: Sequence[Action | Overlap | Comm], program: Sequence[Step]) -> tuple[Step, ...]:
    """A lowered rank list's receives as post points: ``xRECV_Fm`` posts the receives of ``xFm``, and
    ``xRECV_Bm`` those of ``xBm``/``xIm``, before the compute action that follows it in the list."""
    needs = {(step.action.stage, "F" if step.action.kind == "F" else "B", step.action.microbatch): step.recvs
             for step in program if step.action.kind != "W"}
    posts: list[list[int]] = [[] for _ in range(len(program) + 1)]
    done = 0
    for action in actions:
        if isinstance(action, Comm):
            if not action.is_send:
                posts[min(done, len(program) - 1)].extend(
                    needs.get((action.stage, action.direction, action.microbatch), ()))
        else:
            done += len(compute_parts(action))  # a pair is two steps
    return tuple(dataclasses.replace(step, posts=tuple(posts[t])) for t, step in enumerate(program))


def _points(count: int) -> str:
    return _counted(count, "split point")


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"
