"""Interleaved 1F1B (Narayanan et al., 2021; Megatron-LM): v looped stages per rank, 1F1B order.

Also holds the looped placement (stage s on rank s % p) that looped BFS shares.
"""

from __future__ import annotations

from pipeloom.errors import ArgumentError
from pipeloom.ir import Action, Schedule
from pipeloom.problem import Problem
from pipeloom.schedules.common import MemoryLimit, chain_problem, check_counts, make_schedule, merge_one_f_one_b
from pipeloom.stages import Costs

__all__ = ["interleaved_1f1b", "check_stages_per_rank", "looped_problem", "group_sizes", "grouped_order",
           "interleaved_warmup"]


def check_stages_per_rank(name: str, stages_per_rank: object) -> int:
    """ValueError unless ``stages_per_rank`` is an integer >= 1; returns it."""
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ArgumentError(
            f"{name}: stages_per_rank must be an integer >= 1 (the number of model stages each "
            f"rank holds, e.g. 2), got {stages_per_rank!r}"
        )
    return stages_per_rank


def looped_problem(
    num_ranks: int, *, stages_per_rank: int, costs: Costs, memory_limit: float | None,
    split_backward: bool = False,
) -> Problem:
    """The looped chain of p*v stages, stage s on rank s % p, each with share 1/v of ``costs``
    (backward split into I and W with ``split_backward``).

    Rank r holds stages r, r + p, ..., r + (v-1)p; its local stage c is stage c*p + r.
    """
    num_stages = num_ranks * stages_per_rank
    return chain_problem(
        [s % num_ranks for s in range(num_stages)],
        costs,
        num_ranks=num_ranks,
        split_backward=split_backward,
        memory_limit=memory_limit,
        share=1.0 / stages_per_rank,
    )


def group_sizes(num_ranks: int, num_microbatches: int) -> list[int]:
    """Sizes of the micro-batch groups: max(1, m // p) groups as equal as possible, larger first.

    Every group holds at least p micro-batches (one group of m when m < p) and sizes never
    grow; with p dividing m these are Megatron's groups of p, otherwise torch's rounds
    (``max(1, m // p)`` of them) extended to m that the rounds do not divide.
    """
    count = max(1, num_microbatches // num_ranks)
    base, extra = divmod(num_microbatches, count)
    return [base + 1] * extra + [base] * (count - extra)


def grouped_order(sizes: list[int], stages_per_rank: int, *, reverse: bool = False) -> list[tuple[int, int]]:
    """``(local stage, micro-batch)`` pairs: for each group, for each local stage, the group's
    micro-batches in order. ``reverse=True`` walks local stages v-1..0 (the backward order).
    """
    local_stages = range(stages_per_rank - 1, -1, -1) if reverse else range(stages_per_rank)
    order: list[tuple[int, int]] = []
    first = 0
    for size in sizes:
        group = range(first, first + size)
        order.extend((c, mb) for c in local_stages for mb in group)
        first += size
    return order


def interleaved_warmup(num_ranks: int, stages_per_rank: int, first_group: int, rank: int) -> int:
    """The forwards rank ``rank`` of :func:`interleaved_1f1b` runs before it alternates (before the cap at the
    m*v forwards it has): (v-1) g + 2(p-r-1) for ``first_group`` g, plain 1F1B's p-r-1 with v = 1."""
    p, v = num_ranks, stages_per_rank
    return (v - 1) * first_group + 2 * (p - rank - 1) if v > 1 else p - rank - 1


def interleaved_1f1b(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
    stages_per_rank: int = 2,
) -> Schedule:
    """Megatron-LM's interleaved 1F1B on the looped layout: p*v stages, stage s on rank s % p.

    Micro-batches go in groups (see :func:`group_sizes`: groups of p when p divides m, else
    max(1, m // p) near-equal groups of at least p, larger first). On every rank the forwards run
    group by group, local stages 0..v-1 within a group; the backwards the same way with local
    stages v-1..0. Rank r warms up with w_r = min((v-1)g + 2(p-r-1), m*v) forwards, g the first
    group's size, then alternates one forward and one backward, then runs the backwards left.
    With v = 1 the warm-up is p-r-1: plain 1F1B (Megatron runs its non-interleaved schedule then).
    With this warm-up a smaller last group (Megatron's table for m not a multiple of p) deadlocks,
    e.g. p=5, m=7, v=2; groups that never grow and hold at least p each, with the warm-up sized
    by the first group, are deadlock-free (checked by simulation for every p <= 16 and m <= 64
    with v <= 4, and sampled m with v = 5, 6, 8).

    Bubble per rank: (p-1)(F+B)/v, F and B the per-rank totals (F = f, B = b + w); makespan
    m(F+B) + (p-1)(F+B)/v with no communication latency when p divides m.
    Activation memory on rank r, in micro-batches of a rank's whole share (a stage's F holds 1/v
    of one): min(w_r + 1, m*v)/v. With p dividing m and m >= p + (p-1)/v that is p + (p-1)/v on
    rank 0 -- more than 1F1B's p; never more than GPipe's m.
    """
    check_counts("interleaved-1f1b", num_ranks, num_microbatches)
    v = check_stages_per_rank("interleaved-1f1b", stages_per_rank)
    p = num_ranks
    problem = looped_problem(p, stages_per_rank=v, costs=costs, memory_limit=memory_limit)
    sizes = group_sizes(p, num_microbatches)
    forward_order = grouped_order(sizes, v)
    backward_order = grouped_order(sizes, v, reverse=True)
    ranks = []
    for r in range(p):
        warmup = interleaved_warmup(p, v, sizes[0], r)
        ranks.append(
            merge_one_f_one_b(
                [Action(c * p + r, "F", mb) for c, mb in forward_order],
                backwards=[Action(c * p + r, "B", mb) for c, mb in backward_order],
                warmup=warmup,
            )
        )
    return make_schedule("interleaved-1f1b", problem=problem, num_microbatches=num_microbatches, ranks=ranks)
