"""Building blocks shared by the schedule families and the search's placements: checks, layouts, 1F1B merging."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

from pipeloom.errors import ArgumentError
from pipeloom.ir import Action, Comm, Overlap, Schedule
from pipeloom.problem import Problem
from pipeloom.stages import Costs, stage_graph

__all__ = [
    "MemoryLimit",
    "check_counts",
    "check_even_ranks",
    "even_microbatches_hint",
    "chain_problem",
    "v_stage_ranks",
    "v_rank_stages",
    "v_problem",
    "two_replica_problem",
    "merge_one_f_one_b",
    "make_schedule",
]

MemoryLimit: TypeAlias = float | None
"""A generator's ``memory_limit``: the per-rank memory its Schedule's problem carries, which the validator
enforces and a memory-aware generator (:attr:`~pipeloom.schedules.ScheduleInfo.memory_aware`) orders its
actions for. None means the schedule's own default memory, stated in its docstring: no limit for a schedule
that is not memory-aware; zbv: 1F1B's peak ``min(p, m) * costs.memory``; interleaved-zb: what its first
candidate order holds per rank; v-half and v-min: their documented ``(p+2)//2`` and ``(p+4)//3``
micro-batches. A limit given is carried as it is. (The search differs: its problem exists already, and
there None means that problem's own limit, :func:`pipeloom.search.memory_bounds.limit_of`.)"""


def check_counts(name: str, num_ranks: int, num_microbatches: int, *, min_microbatches: int = 1) -> None:
    """ArgumentError (a ValueError) unless ranks >= 1 and micro-batches >= ``min_microbatches`` (integers)."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ArgumentError(f"{name}: the number of ranks must be a positive integer, got {num_ranks!r}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ArgumentError(
            f"{name}: the number of micro-batches must be a positive integer, got {num_microbatches!r}"
        )
    if num_microbatches < min_microbatches:
        raise ArgumentError(
            f"{name} needs at least {min_microbatches} micro-batches with {num_ranks} "
            f"rank{'s' if num_ranks != 1 else ''}, got {num_microbatches}; use {min_microbatches} or more"
        )


def check_even_ranks(name: str, num_ranks: int, *, reason: str) -> None:
    """ArgumentError (a ValueError) unless ``num_ranks`` is even; ``reason`` says why the schedule needs it."""
    if num_ranks % 2:
        raise ArgumentError(
            f"{name} needs an even number of ranks ({reason}), got {num_ranks}; "
            f"use an even count such as {num_ranks + 1}"
        )


def even_microbatches_hint(num_microbatches: int, *, minimum: int) -> str:
    """The valid micro-batch counts nearest to an invalid one, when valid means even and >= ``minimum``.

    "use 8" for 3 with minimum 8 (the smallest valid count, max(minimum, next even number)),
    "use 10 or 12" for 11 when both neighbours are valid.
    """
    minimum = max(minimum, 2)
    larger = max(minimum + minimum % 2, num_microbatches + num_microbatches % 2)
    smaller = num_microbatches - 1
    if num_microbatches % 2 and smaller >= minimum:
        return f"use {smaller} or {larger}"
    return f"use {larger}"


def chain_problem(
    stage_ranks: Sequence[int],
    costs: Costs,
    *,
    num_ranks: int,
    split_backward: bool,
    memory_limit: float | None,
    share: float = 1.0,
) -> Problem:
    """A linear stage chain: stage s on ``stage_ranks[s]``, each carrying ``share`` of ``costs``."""
    return stage_graph(
        [costs.stage(rank, share=share) for rank in stage_ranks],
        num_ranks=num_ranks,
        backward="split" if split_backward else "full",
        comm_latency=costs.comm,
        memory_limit=memory_limit,
        overlap_fraction=costs.overlap,
        pair_time=costs.pair_time,
    )


def v_stage_ranks(num_ranks: int) -> list[int]:
    """The V placement of 2p stages on p ranks: stage s on rank s for s < p, on rank 2p-1-s after.

    So rank r holds stages r and 2p-1-r (:func:`v_rank_stages`); a chain through the stages goes
    down the ranks and comes back up.
    """
    p = num_ranks
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


def v_rank_stages(num_ranks: int, *, rank: int) -> tuple[int, int]:
    """The two stages rank ``rank`` holds in the V placement: (rank, 2p-1-rank), the way down first."""
    return rank, 2 * num_ranks - 1 - rank


def v_problem(num_ranks: int, *, costs: Costs, memory_limit: float | None) -> Problem:
    """One model as a chain of 2p stages in the V placement, split backward, each stage half a rank share."""
    return chain_problem(
        v_stage_ranks(num_ranks),
        costs,
        num_ranks=num_ranks,
        split_backward=True,
        memory_limit=memory_limit,
        share=0.5,
    )


def two_replica_problem(
    num_ranks: int,
    costs: Costs,
    *,
    split_backward: bool,
    memory_limit: float | None,
) -> Problem:
    """Two model replicas as two disjoint chains, each stage a full rank share (share 1).

    Down chain: stage s on rank s (0..p-1). Up chain: stage p+k on rank p-1-k, so data enters it
    at rank p-1. The stages sit as in the V placement (:func:`v_stage_ranks`), but the chain is
    cut between stages p-1 and p. One micro-batch of this problem is a pair of real ones, one
    per direction.
    """
    p = num_ranks
    stage_ranks = v_stage_ranks(p)
    edges = [(s, s + 1) for s in range(p - 1)] + [(p + k, p + k + 1) for k in range(p - 1)]
    return stage_graph(
        [costs.stage(rank) for rank in stage_ranks],
        num_ranks=p,
        edges=edges,
        backward="split" if split_backward else "full",
        comm_latency=costs.comm,
        memory_limit=memory_limit,
        overlap_fraction=costs.overlap,
        pair_time=costs.pair_time,
    )


def merge_one_f_one_b(
    forwards: Sequence[Action], *, backwards: Sequence[Action], warmup: int
) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    f, b = warmup, 0
    while f < len(forwards) or b < len(backwards):
        if f < len(forwards):
            order.append(forwards[f])
            f += 1
        if b < len(backwards):
            order.append(backwards[b])
            b += 1
    return order


def make_schedule(
    name: str, *, problem: Problem, num_microbatches: int, ranks: Sequence[Sequence[Action | Overlap | Comm]]
) -> Schedule:
    """Wrap per-rank lists (compute actions, overlapped pairs, communication) into a Schedule."""
    return Schedule(
        name=name,
        problem=problem,
        num_microbatches=num_microbatches,
        ranks=tuple(tuple(actions) for actions in ranks),
    )
