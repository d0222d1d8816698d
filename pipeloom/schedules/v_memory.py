"""V-Half and V-Min: V-placement schedules at 1/2 and 1/3 of 1F1B's activation memory.

"Pipeline Parallelism with Controllable Memory" (Qi et al., 2024) documents, for the V placement
(rank r holds stages r and 2p-1-r) with split backward and F = B = W:

| schedule | activation memory (micro-batches of a rank share) | bubble rate |
|---|---|---|
| V-Half | (p+2)//2 | about p/(2m) |
| V-Min  | (p+4)//3 | about 2p/(3m) |

The order is the paper's building block (:mod:`pipeloom.schedules.v_block`: one micro-batch's
passes repeated every 6 slots, W in the free slots, squeezed at warm-up and cool-down) or zbv's
list scheduler run under the same memory, whichever the simulator finds shorter with the given
costs; both stay within the documented memory (the validator enforces it). Measured in
docs/schedules.md, "V-Half and V-Min".
"""

from __future__ import annotations

import dataclasses

from pipeloom.errors import ArgumentError
from pipeloom.ir import Schedule
from pipeloom.schedules.common import MemoryLimit, check_counts, make_schedule
from pipeloom.schedules.v_block import Variant, block_order
from pipeloom.schedules.zbv import zbv
from pipeloom.sim import simulate
from pipeloom.stages import Costs

__all__ = ["v_half", "v_half_memory", "v_min", "v_min_memory"]


def v_half_memory(num_ranks: int, *, costs: Costs = Costs()) -> float:
    """V-Half's activation memory per rank: ``(p+2)//2`` forwards of a rank share, about half of 1F1B's p."""
    return (num_ranks + 2) // 2 * costs.memory


def v_min_memory(num_ranks: int, *, costs: Costs = Costs()) -> float:
    """V-Min's activation memory per rank: ``(p+4)//3`` forwards of a rank share, about a third of 1F1B's p."""
    return (num_ranks + 4) // 3 * costs.memory


def _v_at(name: str, variant: Variant, num_ranks: int, num_microbatches: int, costs: Costs,
          memory_limit: float | None, documented: float) -> Schedule:
    """The shorter of the building-block order and zbv's list order, both within ``min(limit, documented)``.

    The problem carries the caller's limit (a larger one still holds: the order stays within the
    documented memory). Ties go to the building block.
    """
    check_counts(name, num_ranks, num_microbatches)
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float))):
        raise ArgumentError(f"{name}: memory_limit must be a number or None, got {memory_limit!r}")
    cap = documented if memory_limit is None else min(memory_limit, documented)
    listed = zbv(num_ranks, num_microbatches, costs=costs, memory_limit=cap)
    carried = documented if memory_limit is None else memory_limit
    problem = dataclasses.replace(listed.problem, memory_limit=carried)
    best = make_schedule(name, problem=problem, num_microbatches=num_microbatches, ranks=listed.ranks)
    best_makespan = simulate(best).makespan
    block = make_schedule(name, problem=problem, num_microbatches=num_microbatches,
                          ranks=block_order(num_ranks, num_microbatches, variant))
    timeline = simulate(block)
    if max(timeline.peak_memory) <= cap * (1 + 1e-12) and timeline.makespan <= best_makespan:
        best = block
    return best


def v_half(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
) -> Schedule:
    """V-Half on the V placement: rank r runs stages r and 2p-1-r, each with half of ``costs``.

    Memory: at most ``(p+2)//2 * costs.memory`` per rank (about half of 1F1B's p), or the smaller
    ``memory_limit`` given (then the block, which needs the documented memory, gives way to zbv's
    list order); a larger limit is carried by the Schedule's problem (the validator enforces it)
    while the order stays at the documented memory (for more, use zbv).

    Bubble: documented as about p/(2m) of the makespan when f = b = w (against 1F1B's (p-1)/m);
    measured (f = b = w = 1) 0.072 at p=8, m=32 and 0.092 at p=16, m=64; at the zero-bubble paper's
    costs 0.133 and 0.150 (docs/schedules.md). The order is the shorter of the building block and
    zbv's list order at this memory; with other costs it is a heuristic.
    """
    return _v_at("v-half", "half", num_ranks, num_microbatches, costs, memory_limit,
                 v_half_memory(num_ranks, costs=costs))


def v_min(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
) -> Schedule:
    """V-Min on the V placement: rank r runs stages r and 2p-1-r, each with half of ``costs``.

    Memory: at most ``(p+4)//3 * costs.memory`` per rank (about a third of 1F1B's p), or the
    smaller ``memory_limit`` given; a larger limit is carried by the Schedule's problem while the
    order stays at the documented memory.

    Bubble: documented as about 2p/(3m) of the makespan when f = b = w; measured (f = b = w = 1)
    0.107 at p=8, m=32 (zbv's list order; the block: 0.123) and 0.133 at p=16, m=64 (the paper's
    building block; the list order: 0.227), documented 0.167 for both. Unequal costs
    stretch the tight block: 0.32 at p=16, m=64 at the zero-bubble paper's costs. The order is the
    shorter of the building block and zbv's list order at this memory.
    """
    return _v_at("v-min", "min", num_ranks, num_microbatches, costs, memory_limit,
                 v_min_memory(num_ranks, costs=costs))
