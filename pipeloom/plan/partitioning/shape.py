"""Schedule shapes: from a schedule to the partitioner's stage rules: which rank holds each model
stage, how many micro-batches of activations it holds at its peak, and what memory share each copy
may take. (Called ``pipeloom.plan.placement`` before; a *placement* is the stage layout kind,
:attr:`pipeloom.schedules.ScheduleInfo.placement`, see docs/architecture.md's glossary.)

Schedule stages and model stages differ only for two-replica schedules (dualpipe, chimera), where
each model stage runs on two ranks, once per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pipeloom.ir import Schedule, compute_parts, sequential_pairs
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import PartitionError
from pipeloom.plan.partitioning.rules import MemoryRule, Partition, StageRule
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.stages import Costs

__all__ = [
    "PARTITION_PROFILES",
    "PartitionPlacement",
    "ScheduleShape",
    "copy_memory",
    "least_limit",
    "unbounded_limit",
    "in_flight",
    "library_costs",
    "library_schedule",
    "rank_memory",
    "rank_objective",
    "rank_time_objective",
    "schedule_shape",
    "stage_rules",
    "visits_per_rank",
]

PartitionPlacement = Literal["linear", "interleaved", "v"]
"""The placements (:data:`pipeloom.schedules.Placement`, a schedule's stage layout) that
:func:`~pipeloom.plan.partitioning.partitioner.partition` cuts for: all but ``bidirectional``."""
PARTITION_PROFILES: dict[str, str] = {"linear": "1f1b", "interleaved": "interleaved-1f1b", "v": "zbv"}
"""Placement (:attr:`ScheduleInfo.placement`) -> the built-in schedule whose memory profile
:func:`~pipeloom.plan.partitioning.partitioner.partition` assumes when cutting for that placement."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleShape:
    """How a schedule lays the model's stages on ranks."""

    num_ranks: int
    """Ranks of the schedule."""
    model_stage: tuple[int, ...]
    """Per schedule stage: the model stage it runs."""
    rank: tuple[int, ...]
    """Per schedule stage: the rank it runs on."""
    consumers: tuple[tuple[int, ...], ...]
    """Per schedule stage: the schedule stages whose forward reads its output."""
    replicas: int
    """Model copies (2 for dualpipe and chimera)."""
    held: tuple[tuple[int, int], ...]
    """Per schedule stage: ``(held, w_held)`` micro-batches at most, see :func:`in_flight`."""
    visits: int
    """Forwards the busiest rank runs per step, see :func:`visits_per_rank`."""

    @property
    def num_stages(self) -> int:
        """Schedule stages."""
        return len(self.rank)

    def stages_on(self, rank: int) -> int:
        """How many schedule stages ``rank`` holds."""
        return self.rank.count(rank)

    @property
    def num_model_stages(self) -> int:
        """Stages the model is cut into."""
        return len(self.model_stage) // self.replicas


def schedule_shape(schedule: Schedule) -> ScheduleShape:
    """The shape of a schedule: its task graph, one or more disjoint chains of single-rank stages,
    and the memory its action order holds.

    Each chain (a replica) starts at a stage whose forward waits for no other forward; a stage's
    position along its chain is its model stage. PartitionError for other graphs. It walks every
    action: a caller judging many splits of one schedule computes it once and passes it on.
    """
    problem = schedule.problem
    count = problem.num_stages
    producers: list[list[int]] = [[] for _ in range(count)]
    consumers: list[list[int]] = [[] for _ in range(count)]
    ranks = []
    for s in range(count):
        task = problem.task((s, "F"))
        if len(task.ranks) != 1:
            raise PartitionError(f"stage {s} runs on ranks {list(task.ranks)}; the planner places each stage "
                                 f"on one rank")
        ranks.append(task.ranks[0])
        for u, kind in task.deps:
            if kind == "F":
                producers[s].append(u)
                consumers[u].append(s)
    heads = [s for s in range(count) if not producers[s]]
    model_stage = [-1] * count
    for head in heads:
        s, position = head, 0
        while True:
            model_stage[s] = position
            if len(consumers[s]) > 1 or any(len(producers[c]) > 1 for c in consumers[s]):
                raise PartitionError(f"the schedule's stages branch at stage {s}; the planner needs chains")
            if not consumers[s]:
                break
            s, position = consumers[s][0], position + 1
    if len(heads) * (1 + max(model_stage)) != count:
        raise PartitionError("the schedule's replicas have different lengths; the planner needs equal chains")
    return ScheduleShape(num_ranks=problem.num_ranks, model_stage=tuple(model_stage), rank=tuple(ranks),
                         consumers=tuple(map(tuple, consumers)), replicas=len(heads), held=in_flight(schedule),
                         visits=visits_per_rank(schedule))


def in_flight(schedule: Schedule) -> tuple[tuple[int, int], ...]:
    """Per schedule stage: the most micro-batches it holds at once on its rank, ``(held, w_held)``.

    ``held`` counts micro-batches whose F has started and whose I (or B) has not; ``w_held`` those
    whose W (or B) has not. Read off each rank's action order (memory changes when actions start),
    so they are exact for that order: 1F1B gives p - r on rank r, GPipe gives M.
    """
    count = schedule.problem.num_stages
    held, w_held = [0] * count, [0] * count
    top, w_top = [0] * count, [0] * count
    for actions in schedule.ranks:
        for action in (part for whole in actions for part in compute_parts(whole)):  # a pair: F, then B
            s, kind = action.stage, action.kind
            if kind == "F":
                held[s] += 1
                w_held[s] += 1
                top[s] = max(top[s], held[s])
                w_top[s] = max(w_top[s], w_held[s])
            elif kind == "B":
                held[s] -= 1
                w_held[s] -= 1
            elif kind == "I":
                held[s] -= 1
            else:
                w_held[s] -= 1
    return tuple(zip(top, w_top))


def visits_per_rank(schedule: Schedule) -> int:
    """Forwards the busiest rank runs per step: M for one stage per rank, v·M for v stages per rank,
    M for two-replica schedules (M/2 pairs through two stages). The DP's weight is this minus one."""
    return max(sum(1 for action in actions for part in compute_parts(action) if part.kind == "F")
               for actions in schedule.ranks)


def stage_rules(shape: ScheduleShape, *, memory_limit: float | None,
                shares: Sequence[float] | None = None) -> tuple[StageRule, ...]:
    """One :class:`StageRule` per model stage of a schedule of this shape.

    Schedule stage s may take ``shares[s] * memory_limit`` bytes on its rank; by default the stages
    of a rank share its limit equally (exact for one stage per rank). A stage sends when a consumer
    of any of its copies runs on another rank (not between the two halves of a V on one rank).
    """
    if shares is None:
        shares = [1.0 / shape.stages_on(shape.rank[s]) for s in range(shape.num_stages)]
    rules = []
    for j in range(shape.num_model_stages):
        copies = [s for s in range(shape.num_stages) if shape.model_stage[s] == j]
        rules.append(StageRule(
            sends=any(shape.rank[c] != shape.rank[s] for s in copies for c in shape.consumers[s]),
            copies=tuple(MemoryRule(held=shape.held[s][0], w_held=shape.held[s][1],
                                    limit=None if memory_limit is None else memory_limit * shares[s])
                         for s in copies),
        ))
    return tuple(rules)


def copy_memory(table: CostTable, shape: ScheduleShape, found: Partition) -> tuple[float, ...]:
    """Per schedule stage: the bytes its copy of ``found``'s model stage takes (see :class:`MemoryRule`)."""
    totals = [[0.0, 0.0, 0.0] for _ in range(found.num_stages)]  # static, activation, W-kept bytes
    for piece, j in zip(table.pieces, found.stage_of):
        totals[j][0] += table.static_bytes(piece)
        totals[j][1] += piece.activation_bytes
        totals[j][2] += piece.w_activation_bytes
    return tuple(MemoryRule(held=shape.held[s][0], w_held=shape.held[s][1]).bytes(*totals[j])
                 for s, j in enumerate(shape.model_stage))


def rank_memory(table: CostTable, shape: ScheduleShape, found: Partition) -> tuple[float, ...]:
    """Per rank: the bytes the rules count for ``found`` (an upper bound of the simulated peak)."""
    held = [0.0] * shape.num_ranks
    for s, nbytes in enumerate(copy_memory(table, shape, found)):
        held[shape.rank[s]] += nbytes
    return tuple(held)


def rank_objective(shape: ScheduleShape, found: Partition) -> float:
    """``Σ_j T_j + (m - 1) · max_r L_r``: the pipeline-time objective with the busiest rank's load
    ``L_r`` (the times of all the stages it holds) in place of the slowest stage; m is the forwards
    per stage and step. Equals the DP's objective for one stage per rank."""
    return rank_time_objective(shape, found.stage_times)


def rank_time_objective(shape: ScheduleShape, stage_times: Sequence[float]) -> float:
    """:func:`rank_objective` of a split with these model stage times."""
    load = [0.0] * shape.num_ranks
    for s, j in enumerate(shape.model_stage):
        load[shape.rank[s]] += stage_times[j]
    per_stage = shape.visits // max(shape.stages_on(r) for r in range(shape.num_ranks))
    return sum(stage_times) + (per_stage - 1) * max(load)


def library_costs(table: CostTable, num_ranks: int) -> Costs:
    """One rank's share of ``table`` as the schedule library's uniform :class:`~pipeloom.stages.Costs`
    (seconds and bytes): what the cost- and memory-aware generators (ZB-V) order actions by."""
    pieces = table.pieces
    mean_out = sum(p.output_bytes for p in pieces[:-1]) / max(1, len(pieces) - 1)
    return Costs(
        f=sum(p.f for p in pieces) / num_ranks, b=sum(p.i for p in pieces) / num_ranks,
        w=sum(p.w for p in pieces) / num_ranks, comm=table.link.time(mean_out),
        memory=sum(p.activation_bytes for p in pieces) / num_ranks,
        w_memory=sum(p.w_activation_bytes for p in pieces) / num_ranks,
    )


def _static_share(table: CostTable, num_ranks: int) -> float:
    """A rank's share of ``table``'s weights, gradients and optimizer state (bytes)."""
    return sum(table.static_bytes(p) for p in table.pieces) / num_ranks


def unbounded_limit(table: CostTable, num_ranks: int, microbatches: int) -> float:
    """A per-rank memory limit no order of ``table``'s schedules reaches (every micro-batch's activations of a rank's
    share held at once, twice over, beside its static bytes): a memory-aware generator built for it orders for speed
    alone, where its default keeps near 1F1B's memory."""
    costs = library_costs(table, num_ranks)
    return _static_share(table, num_ranks) + 2.0 * (costs.memory + costs.w_memory) * microbatches


def least_limit(table: CostTable, num_ranks: int) -> float:
    """The least per-rank memory limit a memory-aware generator orders for (a rank's static bytes and one
    micro-batch's activations of its share): :func:`library_schedule` passes it on, where a smaller one is not."""
    return _static_share(table, num_ranks) + library_costs(table, num_ranks).memory * (1 + 1e-9)  # over by rounding


def library_schedule(table: CostTable, name: str, num_ranks: int, microbatches: int, *,
                     memory_limit: float | None, **options: object) -> Schedule:
    """The built-in schedule ``name`` ordered for ``table``'s per-rank costs; a memory-aware generator
    (ZB-V) gets the per-rank limit less the average weights, gradients and optimizer state. With
    ``memory_limit`` None (or a limit the static bytes leave too little of) the generator gets None: its own
    default memory (:data:`pipeloom.schedules.MemoryLimit`)."""
    costs = library_costs(table, num_ranks)
    limit = None
    if REGISTRY[name].memory_aware and memory_limit is not None:
        static = _static_share(table, num_ranks)
        limit = memory_limit - static if memory_limit - static >= costs.memory else None
    built = build_schedule(name, num_ranks, microbatches, costs=costs, memory_limit=limit, **options)
    return sequential_pairs(built)  # the runtime runs an overlapped pair's parts one after the other
