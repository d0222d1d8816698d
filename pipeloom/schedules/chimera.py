"""Chimera (Li & Hoefler, SC'21): two opposite 1F1B pipelines over two model replicas.

The down replica enters at rank 0, the up replica at rank p-1; each rank holds one stage of each,
and the micro-batches are split evenly between them. Up to p micro-batches run the paper's unit;
more run either its units back to back or a time-aware list order, whichever finishes first.
"""

from __future__ import annotations

from typing import Literal

from pipeloom.errors import ArgumentError
from pipeloom.ir import Action, Schedule
from pipeloom.schedules.common import (
    MemoryLimit,
    check_counts,
    check_even_ranks,
    even_microbatches_hint,
    make_schedule,
    two_replica_problem,
    v_rank_stages,
)
from pipeloom.schedules.kernel import ListProblem, ListTask, list_schedule_kernel
from pipeloom.sim import simulate
from pipeloom.stages import Costs

__all__ = ["chimera", "chimera_caps", "chimera_list_order", "chimera_slots"]

Order = Literal["best", "grid", "list"]


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
    down, up = v_rank_stages(p, rank=r)
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


def chimera_caps(num_ranks: int, rank: int) -> tuple[int, int]:
    """(down, up) cap on the forwards rank ``rank`` holds at once in :func:`chimera_list_order`.

    1F1B's in-flight counts (p-r down, r+1 up) less one on the larger side, so they sum to p
    (1F1B's peak) and each is >= 1: (p-r-1, r+1) for r < p/2, (p-r, r) for r >= p/2.
    """
    p, r = num_ranks, rank
    return (p - r - 1, r + 1) if r < p // 2 else (p - r, r)


def _chain_tasks(num_ranks: int, costs: Costs) -> tuple[ListTask, ...]:
    """The kernel's tasks: index 2(p d + k) + kind is position k of direction d (0 down, 1 up),
    kind 0 = F, 1 = B = b + w; F waits for F one position back, B for its own F and the B one
    position on (each across ranks with ``costs.comm``, except a rank's own F)."""
    p, comm = num_ranks, costs.comm
    tasks = []
    for d in (0, 1):
        for k in range(p):
            rank, stage = (k, k) if d == 0 else (p - 1 - k, p + k)
            index = 2 * (p * d + k)
            tasks += [
                ListTask(stage=stage, kind="F", ranks=(rank,), duration=costs.f,
                         deps=((index - 2, comm),) if k else ()),
                ListTask(stage=stage, kind="B", ranks=(rank,), duration=costs.b + costs.w,
                         deps=((index, 0.0),) + (((index + 2 + 1, comm),) if k < p - 1 else ())),
            ]
    return tuple(tasks)


class _CapRules:
    """Chimera's list rules: 1F1B-like release by priority, forwards admitted under :func:`chimera_caps`."""

    def __init__(self, num_ranks: int, costs: Costs) -> None:
        p = num_ranks
        F, B, c = costs.f, costs.b + costs.w, costs.comm
        self.p, self.period = p, F + B
        # Priority offset: the action's start when its pair runs alone, F at k(F+c), B after all F.
        self.offset = [(k * (F + c), p * F + (p - 1) * c + (p - 1 - k) * (B + c)) for k in range(p)]
        self.caps = [chimera_caps(p, r) for r in range(p)]
        self.inflight = [[0, 0] for _ in range(p)]

    def _where(self, t: int) -> tuple[int, int, int, int]:
        """(direction, position, kind, rank) of task index t."""
        chain, kind = divmod(t, 2)
        d, k = divmod(chain, self.p)
        return d, k, kind, (k if d == 0 else self.p - 1 - k)

    def priority(self, t: int, j: int) -> tuple[float, int, int]:
        """j(F+B) + the lone pair's start (pair j released once per F + B), then B before F, down first."""
        d, k, kind, _ = self._where(t)
        return (j * self.period + self.offset[k][kind], 1 - kind, d)

    def admits(self, t: int, j: int) -> bool:
        """A forward of direction d only while its rank holds fewer than its cap of d's forwards."""
        d, _, kind, r = self._where(t)
        return kind == 1 or self.inflight[r][d] < self.caps[r][d]

    def started(self, t: int, j: int) -> None:
        d, _, kind, r = self._where(t)
        self.inflight[r][d] += 1 - 2 * kind


def chimera_list_order(num_ranks: int, num_pairs: int, costs: Costs = Costs()) -> list[list[Action]]:
    """Per-rank action lists from time-aware list scheduling of Chimera's two replicas.

    Simulates while ordering: a rank, when free, starts the ready action of smallest priority
    j(F+B) + (its start for a lone micro-batch), pair j being released once per F + B as in
    1F1B; a forward of direction d is admitted only while the rank holds fewer than
    :func:`chimera_caps` forwards of d. Each stage runs its micro-batches in order, and the
    oldest unfinished pair of a direction can always move (its stage holds no other forward of
    that direction, or already holds it), so no deadlock; the caps bound memory by p per rank.
    Linear time: O(log p) per action.
    """
    tasks = _chain_tasks(num_ranks, costs)
    problem = ListProblem(num_ranks=num_ranks, num_microbatches=num_pairs, tasks=tasks)
    result = list_schedule_kernel(problem, _CapRules(num_ranks, costs))
    assert result.complete, "list scheduling stalled"
    return [list(actions) for actions in result.ranks]


def chimera(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
    order: Order = "best",
) -> Schedule:
    """Chimera with two replicas and full backward; p even, m even (m/2 micro-batches per direction).

    Task stages 0..p-1 form the down replica (stage s on rank s), p..2p-1 the up replica (stage p+k
    on rank p-1-k), each a full rank share; one IR micro-batch is a *pair* of real micro-batches
    (one per direction), so the schedule has m // 2 micro-batches. ``order``:

    - ``"grid"``: each rank runs :func:`chimera_slots` in slot order, the paper's unit of p
      micro-batches repeated ("direct concatenation").
    - ``"list"``: :func:`chimera_list_order`, which fills the seams between units.
    - ``"best"`` (default): the grid for m <= p (the paper's unit), else whichever of the two
      finishes first in :func:`pipeloom.sim.simulate` (the grid on a tie).

    Bubble per rank, no communication latency, F and B = b + w the costs of a stage. Grid, m a
    multiple of p: (p-2)(max(F, B) + (m/p - 1)|B - F|); with F = B this is (p-2)F, the paper's
    bubble ratio (p-2)/(2m+p-2), but each seam adds (p-2)|B - F|. List, m a multiple of p and
    B = 2F or 4F: (p-2)B, the unit's bubble with no seams (tested), e.g. ratio 0.059 at p=8, m=64
    with f=b=w=1 against 1F1B's 0.099 and the grid's 0.220.
    Activation memory: grid (m >= p) p/2 + 1 + min(r, p-1-r) micro-batches on rank r, from p/2+1
    at the ends to p in the middle; list at most p (:func:`chimera_caps`); 2x weights.
    """
    check_counts("chimera", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    check_even_ranks("chimera", p, reason="its two pipelines interleave on alternate slots")
    if m % 2:
        raise ArgumentError(
            f"chimera feeds half of the micro-batches to each pipeline, so their number must be even, "
            f"got {m}; {even_microbatches_hint(m, minimum=2)}"
        )
    if order not in ("best", "grid", "list"):
        raise ArgumentError(f"chimera order must be 'best', 'grid' or 'list', got {order!r}")
    problem = two_replica_problem(p, costs, split_backward=False, memory_limit=memory_limit)
    grid_ranks = [_in_slot_order(chimera_slots(p, r, m // 2)) for r in range(p)]
    grid = make_schedule("chimera", problem=problem, num_microbatches=m // 2, ranks=grid_ranks)
    if order == "grid" or (order == "best" and m <= p):
        return grid
    listed = make_schedule(
        "chimera", problem=problem, num_microbatches=m // 2, ranks=chimera_list_order(p, m // 2, costs)
    )
    if order == "list" or simulate(listed).makespan < simulate(grid).makespan:
        return listed
    return grid
