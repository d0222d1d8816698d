"""Helpers shared by the schedule families: argument checks, linear problems, 1F1B merging."""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.ir import Action, Schedule
from pipeloom.problem import Costs, Problem, stage_graph

__all__ = ["check_counts", "chain_problem", "two_replica_problem", "merge_one_f_one_b", "make_schedule"]


def check_counts(name: str, num_ranks: int, num_microbatches: int, *, min_microbatches: int = 1) -> None:
    """ValueError unless ranks >= 1 and micro-batches >= ``min_microbatches`` (integers)."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"{name}: the number of ranks must be a positive integer, got {num_ranks!r}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            f"{name}: the number of micro-batches must be a positive integer, got {num_microbatches!r}"
        )
    if num_microbatches < min_microbatches:
        raise ValueError(
            f"{name} needs at least {min_microbatches} micro-batches with {num_ranks} ranks, "
            f"got {num_microbatches}; raise --microbatches"
        )


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
    at rank p-1. One micro-batch of this problem is a pair of real ones, one per direction.
    """
    p = num_ranks
    stage_ranks = list(range(p)) + [p - 1 - k for k in range(p)]
    edges = [(s, s + 1) for s in range(p - 1)] + [(p + k, p + k + 1) for k in range(p - 1)]
    return stage_graph(
        [costs.stage(rank) for rank in stage_ranks],
        num_ranks=p,
        edges=edges,
        backward="split" if split_backward else "full",
        comm_latency=costs.comm,
        memory_limit=memory_limit,
    )


def merge_one_f_one_b(
    forwards: Sequence[Action], backwards: Sequence[Action], warmup: int
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


def make_schedule(name: str, problem: Problem, num_microbatches: int, ranks: Sequence[Sequence[Action]]) -> Schedule:
    """Wrap per-rank lists into a Schedule."""
    return Schedule(
        name=name,
        problem=problem,
        num_microbatches=num_microbatches,
        ranks=tuple(tuple(actions) for actions in ranks),
    )
