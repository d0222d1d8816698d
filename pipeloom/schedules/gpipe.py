"""GPipe: every forward first, then every backward (Huang et al., 2019)."""

from __future__ import annotations

from pipeloom.ir import Action, Schedule
from pipeloom.schedules.common import MemoryLimit, chain_problem, check_counts, make_schedule
from pipeloom.stages import Costs

__all__ = ["gpipe"]


def gpipe(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
) -> Schedule:
    """GPipe on a linear chain, stage r on rank r: all F in micro-batch order, then all B.

    Bubble per rank: (p-1)(F+B); makespan (m+p-1)(F+B) with no communication latency.
    Activation memory: m micro-batches on every rank (all forwards are held until the backwards).
    """
    check_counts("gpipe", num_ranks, num_microbatches)
    problem = chain_problem(
        range(num_ranks), costs, num_ranks=num_ranks, split_backward=False, memory_limit=memory_limit
    )
    ranks = [
        [Action(r, "F", mb) for mb in range(num_microbatches)]
        + [Action(r, "B", mb) for mb in range(num_microbatches)]
        for r in range(num_ranks)
    ]
    return make_schedule("gpipe", problem=problem, num_microbatches=num_microbatches, ranks=ranks)
