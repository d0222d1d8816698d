"""Looped BFS (Lamy-Poirier, 2023; torch's ScheduleLoopedBFS): v looped stages per rank, breadth-first."""

from __future__ import annotations

from pipeloom.ir import Action, Schedule
from pipeloom.schedules.common import MemoryLimit, check_counts, make_schedule
from pipeloom.schedules.interleaved import check_stages_per_rank, looped_problem
from pipeloom.stages import Costs

__all__ = ["looped_bfs"]


def looped_bfs(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
    stages_per_rank: int = 2,
) -> Schedule:
    """Looped BFS on the looped layout: p*v stages, stage s on rank s % p (local stage c = s // p).

    Each rank runs every forward of its local stage 0 in micro-batch order, then of local stage
    1, ..., then every backward of local stage v-1, ..., local stage 0, micro-batches in
    increasing order: GPipe over the p*v stages, looped over the ranks.

    Makespan with no communication latency: (v*max(m, p) + min(m, p) - 1)(F+B)/v, F and B the
    per-rank totals (F = f, B = b + w). So for m >= p the bubble per rank is (p-1)(F+B)/v, like
    interleaved 1F1B; for m < p each of the v waves waits for micro-batch 0 to cross all p ranks.
    Activation memory: every forward is held until the backwards start, m*v stage-shares of 1/v
    each, i.e. m micro-batches of a rank's whole share on every rank (GPipe's m).
    """
    check_counts("looped-bfs", num_ranks, num_microbatches)
    v = check_stages_per_rank("looped-bfs", stages_per_rank)
    p, m = num_ranks, num_microbatches
    problem = looped_problem(p, stages_per_rank=v, costs=costs, memory_limit=memory_limit)
    ranks = [
        [Action(c * p + r, "F", mb) for c in range(v) for mb in range(m)]
        + [Action(c * p + r, "B", mb) for c in reversed(range(v)) for mb in range(m)]
        for r in range(p)
    ]
    return make_schedule("looped-bfs", problem=problem, num_microbatches=m, ranks=ranks)
