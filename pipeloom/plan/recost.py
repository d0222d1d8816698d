"""Re-costing for the plan search: a library schedule's task graph priced with a cut's real stage costs
(:func:`recost`), how much its stages' times vary, and what the step adds after the makespan: the
replicas' gradient exchange (two-replica schedules) and the shared parameters' exchange."""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.ir import Schedule
from pipeloom.plan.costs.parts import Link, Piece
from pipeloom.plan.costs.shared import shared_static_bytes, shared_sync_time
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.partitioning.rules import Partition
from pipeloom.plan.partitioning.shape import ScheduleShape, schedule_shape
from pipeloom.problem import Problem
from pipeloom.stages import Stage, stage_graph

__all__ = ["exchange_time", "piece_ranks", "recost", "replica_sync_time", "shared_time", "stage_spreads"]


def recost(schedule: Schedule, table: CostTable, found: Partition, *, memory_limit: float | None,
           shape: ScheduleShape | None = None) -> Problem:
    """The problem of ``schedule``'s task graph with the real costs of ``found``'s stages.

    Stage durations are F, I (the :class:`~pipeloom.stages.Stage`'s ``b``) and W of the stage's pieces
    in seconds (for a schedule with a full backward, B is the pieces' full backward,
    :attr:`Piece.full_backward`), activations in bytes, static memory per rank the weights, gradients
    and optimizer state of its stages, and the communication latency the link time of the largest
    output crossing ranks. A stage that reads only model inputs (no gradient flows into it) has its I
    counted as W, as the engine's I has no input gradient to compute there. Every task also pays
    ``table.runtime.action_overhead`` (a full B once), and a stage's F and its B or I pay
    ``table.runtime.message_cost`` once per edge of the stage to or from another rank (the send or the
    receive that action posts). The task graph keeps the schedule's (same ranks, edges and backward
    split), so its action order stays valid. ``shape``: ``schedule_shape(schedule)``, when the caller has it.
    """
    shape = shape or schedule_shape(schedule)
    pieces = table.pieces
    starts = [found.stage_of.index(j) for j in range(found.num_stages)] + [len(pieces)]
    parts = [pieces[starts[j]:starts[j + 1]] for j in range(found.num_stages)]
    split = schedule.problem.splits_backward
    extra = table.runtime.action_overhead
    stages = []
    static = [0.0] * shape.num_ranks
    edges = [(s, c) for s in range(len(shape.rank)) for c in shape.consumers[s]]
    crossings = [0] * len(shape.rank)  # edges to or from another rank, per stage
    for s, c in edges:
        if shape.rank[c] != shape.rank[s]:
            crossings[s] += 1
            crossings[c] += 1
    for s, j in enumerate(shape.model_stage):
        part = parts[j]
        i, w = sum(p.i for p in part), sum(p.w for p in part)
        if not split:
            i, w = sum(p.full_backward for p in part), 0.0  # one autograd.backward, as the engine's B
        elif _reads_model_inputs_only(part):
            i, w = 0.0, i + w
        messages = table.runtime.message_cost * crossings[s]
        stages.append(Stage(ranks=(shape.rank[s],), f=sum(p.f for p in part) + extra + messages,
                            b=i + extra + messages, w=w + (extra if split else 0.0),
                            memory=sum(p.activation_bytes for p in part),
                            w_memory=sum(p.w_activation_bytes for p in part)))
        static[shape.rank[s]] += sum(table.static_bytes(p) for p in part)
    if table.shared and shape.replicas == 1:  # a shared parameter is held once by every rank that uses it
        for rank, extra_bytes in shared_static_bytes(table, piece_ranks(shape, found)).items():
            static[rank] += extra_bytes
    crossing = [pieces[starts[shape.model_stage[c]] - 1].output_bytes for s, c in edges
                if shape.rank[s] != shape.rank[c]]
    problem = stage_graph(
        stages, num_ranks=shape.num_ranks, edges=edges,
        backward="split" if split else "full",
        comm_latency=max((table.link.time(b) for b in crossing), default=0.0),
        memory_limit=memory_limit, static_memory=static,
    )
    _check_same_graph(schedule.problem, problem)
    return problem


def piece_ranks(shape: ScheduleShape, found: Partition) -> tuple[int, ...]:
    """Per piece of the table: the rank that holds it (one-replica schedules)."""
    rank_of_model_stage = {j: shape.rank[s] for s, j in enumerate(shape.model_stage)}
    return tuple(rank_of_model_stage[j] for j in found.stage_of)


def shared_time(table: CostTable, schedule: Schedule, found: Partition, *,
                shape: ScheduleShape | None = None) -> float:
    """Seconds the after-step exchange of shared parameters' gradients takes (:func:`shared_sync_time`;
    0 without shared parameters on several ranks)."""
    shape = shape or schedule_shape(schedule)
    if not table.shared or shape.replicas > 1:
        return 0.0
    return shared_sync_time(table, piece_ranks(shape, found), schedule.num_microbatches)


def _reads_model_inputs_only(part: Sequence[Piece]) -> bool:
    """True when the pieces of a stage read nothing from other stages (only model inputs and each other)."""
    inside = {p.name for p in part}
    return all(name in inside for p in part for name in p.inputs or ())  # a table's inputs are never None


def replica_sync_time(table: CostTable, schedule: Schedule, found: Partition, *, link: Link | None = None,
                      shape: ScheduleShape | None = None) -> float:
    """Seconds to add up the replicas' weight gradients after the step (two-replica schedules, else 0).

    As the engine does it, per model stage: the second replica's rank sends its M/2 micro-batch
    gradients of the stage (one buffer per micro-batch, ``M/2 x`` parameter bytes) to the first
    replica's rank, which adds them up and sends the sums back (parameter bytes once). All sends are
    posted before waiting, so the stages' exchanges overlap; what arrives at one rank is serialised:
    the time is the busiest rank's incoming ``M/2`` messages, then the busiest rank's incoming sums,
    each message paying the link's latency. The link is ``link``, else the table's ``runtime.replica_link``
    (measured as the engine exchanges), else its ``link``.
    """
    params = [0.0] * found.num_stages
    for piece, j in zip(table.pieces, found.stage_of):
        params[j] += piece.param_bytes
    return exchange_time(params, schedule, link or table.runtime.replica_link or table.link, shape=shape)


def stage_spreads(table: CostTable, schedule: Schedule, found: Partition, *,
                  shape: ScheduleShape | None = None) -> list[float]:
    """Per stage of ``schedule``: how much its actions' times vary (coefficient of variation): the
    table's ``runtime.time_spread``, measured on one piece's actions, for every stage with work to do.

    A stage of several pieces varies about as much as one piece does (measured on the example GPT's
    plans: their stages' spread was that of the profile's pieces, not the smaller one independent
    pieces would add up to); what varies is the machine's speed during the action, not each kernel.
    """
    shape = shape or schedule_shape(schedule)
    work = [0.0] * found.num_stages
    for piece, j in zip(table.pieces, found.stage_of):
        work[j] += piece.f + piece.full_backward
    return [table.runtime.time_spread if work[j] > 0 else 0.0 for j in shape.model_stage]


def exchange_time(stage_params: Sequence[float], schedule: Schedule, link: Link, *,
                  shape: ScheduleShape | None = None) -> float:
    """:func:`replica_sync_time` for model stages of ``stage_params`` bytes of parameters each."""
    shape = shape or schedule_shape(schedule)
    if shape.replicas == 1:
        return 0.0
    half = schedule.num_microbatches  # micro-batches per replica (M/2)
    gather = [0.0] * shape.num_ranks
    back = [0.0] * shape.num_ranks
    for j, params in enumerate(stage_params):
        holders = sorted(s for s in range(len(shape.model_stage)) if shape.model_stage[s] == j)
        owner = shape.rank[holders[0]]
        for s in holders[1:]:
            if shape.rank[s] != owner and params > 0:
                gather[owner] += half * link.time(params)
                back[shape.rank[s]] += link.time(params)
    return max(gather) + max(back)


def _check_same_graph(original: Problem, costed: Problem) -> None:
    def shape(problem: Problem) -> dict[tuple[int, str], tuple[tuple[int, ...], frozenset[tuple[int, str]]]]:
        return {task.key: (task.ranks, frozenset(task.deps)) for task in problem.tasks}

    assert shape(original) == shape(costed), "re-costing changed the schedule's task graph"
