"""V-Half and V-Min: V-placement schedules at 1/2 and 1/3 of 1F1B's activation memory.

"Pipeline Parallelism with Controllable Memory" (Qi et al., 2024) documents, for the V placement
(rank r holds stages r and 2p-1-r) with split backward and F = B = W:

| schedule | activation memory (micro-batches of a rank share) | bubble rate |
|---|---|---|
| V-Half | (p+2)//2 | about p/(2m) |
| V-Min  | (p+4)//3 | about 2p/(3m) |

Here the order comes from zbv's cost- and memory-aware list scheduler run under that memory limit,
so the peak is the documented one by construction (the validator enforces it) and the bubble is
whatever the scheduler reaches under it (measured in docs/search.md, "Controllable-memory V").
"""

from __future__ import annotations

import dataclasses

from pipeloom.errors import ArgumentError
from pipeloom.ir import Schedule
from pipeloom.problem import Costs
from pipeloom.schedules.common import check_counts
from pipeloom.schedules.zbv import zbv

__all__ = ["v_half", "v_half_memory", "v_min", "v_min_memory"]


def v_half_memory(num_ranks: int, *, costs: Costs = Costs()) -> float:
    """V-Half's activation memory per rank: ``(p+2)//2`` forwards of a rank share, about half of 1F1B's p."""
    return (num_ranks + 2) // 2 * costs.memory


def v_min_memory(num_ranks: int, *, costs: Costs = Costs()) -> float:
    """V-Min's activation memory per rank: ``(p+4)//3`` forwards of a rank share, about a third of 1F1B's p."""
    return (num_ranks + 4) // 3 * costs.memory


def _v_at(name: str, num_ranks: int, num_microbatches: int, costs: Costs, memory_limit: float | None,
          documented: float) -> Schedule:
    check_counts(name, num_ranks, num_microbatches)
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float))):
        raise ArgumentError(f"{name}: memory_limit must be a number or None, got {memory_limit!r}")
    cap = documented if memory_limit is None else min(memory_limit, documented)
    schedule = zbv(num_ranks, num_microbatches, costs=costs, memory_limit=cap)
    # the problem carries the caller's limit (a larger one still holds: the order stays within ``cap``)
    problem = dataclasses.replace(schedule.problem, memory_limit=documented if memory_limit is None else memory_limit)
    return Schedule(name=name, problem=problem, num_microbatches=num_microbatches, ranks=schedule.ranks)


def v_half(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: float | None = None,
) -> Schedule:
    """V-Half on the V placement: rank r runs stages r and 2p-1-r, each with half of ``costs``.

    Memory: at most ``(p+2)//2 * costs.memory`` per rank (about half of 1F1B's p), or the smaller
    ``memory_limit`` given; a larger limit is carried by the Schedule's problem (the validator
    enforces it) while the order stays at the documented memory (for more, use zbv).

    Bubble: documented as about p/(2m) of the makespan when f = b = w (against 1F1B's (p-1)/m);
    the order here is zbv's list scheduler under the limit, which reaches 0.07 at p=8, m=32 and
    0.09 at p=16, m=64 (f = b = w = 1). With other costs it is a heuristic.
    """
    return _v_at("v-half", num_ranks, num_microbatches, costs, memory_limit,
                 v_half_memory(num_ranks, costs=costs))


def v_min(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: float | None = None,
) -> Schedule:
    """V-Min on the V placement: rank r runs stages r and 2p-1-r, each with half of ``costs``.

    Memory: at most ``(p+4)//3 * costs.memory`` per rank (about a third of 1F1B's p), or the
    smaller ``memory_limit`` given; a larger limit is carried by the Schedule's problem while the
    order stays at the documented memory.

    Bubble: documented as about 2p/(3m) of the makespan when f = b = w; the order here is zbv's
    list scheduler under the limit: 0.11 at p=8, m=32 (below the documented 0.17) but 0.23 at
    p=16, m=64 (above it; the paper's building block would do better there). A heuristic.
    """
    return _v_at("v-min", num_ranks, num_microbatches, costs, memory_limit,
                 v_min_memory(num_ranks, costs=costs))
