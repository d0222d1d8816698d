"""Chimera (Li & Hoefler, SC'21): two opposite 1F1B pipelines over two model replicas.

The down replica enters at rank 0, the up replica at rank p-1; each rank holds one stage of each,
and the micro-batches are split evenly between them. Units of p micro-batches run back to back.
"""

from __future__ import annotations

from pipeloom.ir import Action, Schedule
from pipeloom.problem import Costs
from pipeloom.schedules._common import check_counts, make_schedule, two_replica_problem

__all__ = ["chimera", "chimera_slots"]


def chimera_slots(num_ranks: int, rank: int, num_pairs: int) -> list[tuple[int, Action]]:
    """Rank ``rank``'s actions with their slot in the paper's unit grid (one slot = one F or one B).

    A unit holds k = p/2 pairs (micro-batch j of each replica); unit u starts at slot 2pu and
    pair j = uk + i of it runs, on rank r, down stage r and up stage 2p-1-r:

    - down F at r + 2i,           up B at p + r + 2i        (slots of r's parity);
    - up F at p-1-r + 2i,         down B at 2p-1-r + 2i     (the other parity).

    F of a stage on rank r+1 (down) or r-1 (up) lands one slot later and B one slot earlier, so
    the grid is a valid timed schedule; p even keeps the two parities apart, and the next unit
    starts where this one's slots of each parity end ("direct concatenation", no gap).
    """
    p, r, k = num_ranks, rank, num_ranks // 2
    down, up = r, 2 * p - 1 - r
    slots = []
    for pair in range(num_pairs):
        unit, i = divmod(pair, k)
        base = 2 * p * unit + 2 * i
        slots += [
            (base + r, Action(down, "F", pair)),
            (base + p + r, Action(up, "B", pair)),
            (base + p - 1 - r, Action(up, "F", pair)),
            (base + 2 * p - 1 - r, Action(down, "B", pair)),
        ]
    return slots


def _in_slot_order(slots: list[tuple[int, Action]]) -> list[Action]:
    """The actions sorted by slot, in linear time (slots are distinct small integers)."""
    grid: list[Action | None] = [None] * (1 + max(slot for slot, _ in slots))
    for slot, action in slots:
        assert grid[slot] is None, f"two actions in slot {slot}"
        grid[slot] = action
    return [action for action in grid if action is not None]


def chimera(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: float | None = None,
) -> Schedule:
    """Chimera with two replicas and full backward; p even, m even (m/2 micro-batches per direction).

    Task stages 0..p-1 form the down replica (stage s on rank s), p..2p-1 the up replica (stage p+k
    on rank p-1-k), each a full rank share; one IR micro-batch is a *pair* of real micro-batches
    (one per direction), so the schedule has m // 2 micro-batches. Each rank runs its actions in
    the order of :func:`chimera_slots`: the paper's unit of p micro-batches, repeated.

    Bubble per rank, no communication latency, m a multiple of p, F and B = b + w the costs of a
    stage: (p-2)(max(F, B) + (m/p - 1)|B - F|). With F = B this is (p-2)F, the paper's bubble ratio
    (p-2)/(2m+p-2); with B = 2F each seam between units adds (p-2)F (the paper's "forward
    doubling" would remove it; not done here).
    Activation memory (m >= p): p/2 + 1 + min(r, p-1-r) micro-batches on rank r, from p/2+1 on the
    end ranks to p in the middle; 2x weights (two replicas).
    """
    check_counts("chimera", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    if p % 2:
        raise ValueError(
            f"chimera needs an even number of ranks (its two pipelines interleave on alternate slots), "
            f"got {p}; use an even count such as {p + 1}"
        )
    if m % 2:
        raise ValueError(
            f"chimera feeds half of the micro-batches to each pipeline, so their number must be even, "
            f"got {m}; use {m - 1} or {m + 1}"
        )
    problem = two_replica_problem(p, costs, split_backward=False, memory_limit=memory_limit)
    ranks = [_in_slot_order(chimera_slots(p, r, m // 2)) for r in range(p)]
    return make_schedule("chimera", problem, m // 2, ranks)
