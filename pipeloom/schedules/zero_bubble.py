"""Zero-bubble schedules ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward is split into I (input gradient, on the critical path) and W (weight gradient, free
to move); W's fill the bubbles that 1F1B leaves. Stage r runs on rank r with share 1 of the costs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from pipeloom.ir import Action, Schedule
from pipeloom.schedules.common import MemoryLimit, chain_problem, check_counts, make_schedule
from pipeloom.stages import Costs

__all__ = ["zb_h1", "zb_h2"]


def _rank_actions(
    rank: int,
    num_microbatches: int,
    *,
    lead: int,
    weights_after: Callable[[int], int],
    weights_before_forward: bool,
) -> list[Action]:
    """One rank's list: ``lead`` forwards, then per micro-batch k: ``I_k``, a gap, and at the end the rest.

    The gap after ``I_k`` holds the next forward ``F_{lead+k}`` (while forwards remain) and
    ``weights_after(k)`` W's in micro-batch order (never more than the I's already run, so a W
    never precedes its own I); ``weights_before_forward`` puts the W's ahead of that forward.
    Every W not placed in a gap runs after the last I.
    """
    m = num_microbatches
    lead = min(lead, m)
    forwards = [Action(rank, "F", mb) for mb in range(m)]
    inputs = [Action(rank, "I", mb) for mb in range(m)]
    weights = [Action(rank, "W", mb) for mb in range(m)]
    actions = forwards[:lead]
    done = 0
    for k in range(m - 1):
        actions.append(inputs[k])
        count = max(0, min(weights_after(k), k + 1 - done))
        if lead + k < m and not weights_before_forward:
            actions.append(forwards[lead + k])
        actions += weights[done:done + count]
        done += count
        if lead + k < m and weights_before_forward:
            actions.append(forwards[lead + k])
    actions.append(inputs[m - 1])
    actions += weights[done:]
    return actions


def _h2_gap_weights(k: int, *, lead: int, num_microbatches: int, short_gaps: int) -> int:
    """W's in ZB-H2's gap after I_k: the gap holds 1 action for k < short_gaps, then 2; an F takes one."""
    gap = 1 if k < short_gaps else 2
    return gap - (1 if lead + k < num_microbatches else 0)


def _one_from(step: int) -> Callable[[int], int]:
    """``weights_after`` of zb-h1's rank ``step``: one W after each I from step ``step`` on, none before."""
    return lambda k: 1 if k >= step else 0


def zb_h1(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
) -> Schedule:
    """ZB-H1 on a linear chain, stage r on rank r: 1F1B's F/I order with W's filling the bubbles.

    Rank r runs 1F1B with I in place of B (p-r-1 warm-up forwards, then F, I in turn) and puts
    after each I the W of the oldest pending I, except that its first r W's are deferred to the
    end (the rule of torch's ZeroBubble schedules with one stage per rank: a W joins step k only
    when k >= r). The deferred W's fill the tail bubble 1F1B leaves on rank r.

    Bubble per rank (no communication latency, m >= p): (p-1) * max(F+I-W, F, I), which is the
    paper's (p-1)(F+I-W) whenever W <= F and W <= I; makespan m(F+I+W) plus that bubble. With
    F = I = W = 1: makespan 3m+p-1 (bubble over work (p-1)/(3m), a third of 1F1B's; also the
    lower bound for any schedule, as rank p-1 cannot start before (p-1)F), and 2m+2p-1 when m < p.
    Activation memory (M = costs.memory, M_W = costs.w_memory): with M_W = 0 rank r peaks at
    min(p-r, m)*M, exactly 1F1B's; for m >= p rank r peaks at (p-r)*M + r*M_W, because its r
    deferred W's hold M_W each, so the maximum over ranks stays p*M (rank 0) as in 1F1B.
    """
    check_counts("zb-h1", num_ranks, num_microbatches)
    problem = chain_problem(
        range(num_ranks), costs, num_ranks=num_ranks, split_backward=True, memory_limit=memory_limit
    )
    ranks = [
        _rank_actions(
            r,
            num_microbatches,
            lead=num_ranks - r,
            weights_after=_one_from(r),
            weights_before_forward=True,
        )
        for r in range(num_ranks)
    ]
    return make_schedule("zb-h1", problem=problem, num_microbatches=num_microbatches, ranks=ranks)


def zb_h2(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
) -> Schedule:
    """ZB-H2 on a linear chain, stage r on rank r: extra warm-up forwards, a bubble-free parallelogram.

    Rank r runs 2(p-r)-1 forwards before its first I (they fill rank 0's whole warm-up bubble),
    then after each I the next forward while any remain. The gaps between consecutive I's hold
    one action for the first 2p-2 gaps and two after that, the room a forward leaves being filled
    with W's; the W's left over, 2r+1 of them on rank r when m >= 2p-1, run after the last I.

    With F = I = W every rank is busy without a gap from its first action (at r*F) to its last
    (at 3mF + r*F): the paper's "zero bubble" parallelogram, whose slanted ends overlap with the
    neighbouring training iterations when the optimizer step needs no global synchronization.
    One iteration's makespan (no communication latency, m >= 2p-1, I <= 2F and I <= 2W) is
    m(F+I+W) + (p-1)F, the lower bound for any schedule; so bubble per rank (p-1)F, and with
    F = I = W = 1 a makespan of 3m+p-1, which ties ZB-H1; ZB-H2 is strictly faster when I > W
    (ZB-H1's bubble is then (p-1)(F+I-W) > (p-1)F) or when there is communication latency.
    Activation memory: with M_W = 0 rank r peaks at min(2(p-r)-1, m)*M, so 2p-1 micro-batches on
    rank 0 (about twice 1F1B's p); the W's deferred through the first 2p-2 gaps add at most
    (2p-1)*M_W on each rank (reached on rank r when m >= 4p-2r-2).
    """
    check_counts("zb-h2", num_ranks, num_microbatches)
    problem = chain_problem(
        range(num_ranks), costs, num_ranks=num_ranks, split_backward=True, memory_limit=memory_limit
    )
    m = num_microbatches
    ranks = []
    for r in range(num_ranks):
        lead = min(2 * (num_ranks - r) - 1, m)
        gap_weights = partial(_h2_gap_weights, lead=lead, num_microbatches=m, short_gaps=2 * num_ranks - 2)
        ranks.append(_rank_actions(r, m, lead=lead, weights_after=gap_weights, weights_before_forward=False))
    return make_schedule("zb-h2", problem=problem, num_microbatches=m, ranks=ranks)
