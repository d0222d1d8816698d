"""1F1B: warm up with a few forwards, then alternate one forward and one backward (PipeDream-Flush)."""

from __future__ import annotations

from pipeloom.ir import Action, Schedule
from pipeloom.schedules.common import MemoryLimit, chain_problem, check_counts, make_schedule, merge_one_f_one_b
from pipeloom.stages import Costs

__all__ = ["one_f_one_b"]


def one_f_one_b(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
) -> Schedule:
    """1F1B on a linear chain, stage r on rank r; rank r warms up with p-r-1 forwards.

    Bubble per rank: (p-1)(F+B); makespan (m+p-1)(F+B) with no communication latency.
    Activation memory: min(p-r, m) micro-batches on rank r, so p at most (rank 0).
    """
    check_counts("1f1b", num_ranks, num_microbatches)
    problem = chain_problem(
        range(num_ranks), costs, num_ranks=num_ranks, split_backward=False, memory_limit=memory_limit
    )
    ranks = [
        merge_one_f_one_b(
            [Action(r, "F", mb) for mb in range(num_microbatches)],
            backwards=[Action(r, "B", mb) for mb in range(num_microbatches)],
            warmup=num_ranks - r - 1,
        )
        for r in range(num_ranks)
    ]
    return make_schedule("1f1b", problem=problem, num_microbatches=num_microbatches, ranks=ranks)
