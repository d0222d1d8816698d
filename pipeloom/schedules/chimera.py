"""Chimera (Li & Hoefler, SC'21): two opposite 1F1B pipelines over two model replicas.

The down replica enters at rank 0, the up replica at rank p-1; each rank holds one stage of each,
and the micro-batches are split evenly between them. Up to p micro-batches run the paper's unit;
more run either its units back to back or a time-aware list order, whichever finishes first.
"""

from __future__ import annotations

import heapq
import math
from typing import Literal

from pipeloom.ir import Action, Schedule
from pipeloom.problem import Costs
from pipeloom.schedules.common import (
    check_counts,
    check_even_ranks,
    even_microbatches_hint,
    make_schedule,
    two_replica_problem,
    v_rank_stages,
)
from pipeloom.sim import simulate

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


class _ListScheduler:
    """Event-driven list scheduling of the two replicas' chains (the state of one run).

    Rank r runs four streams (d, kind): its stage of direction d (0 down, 1 up) at chain position
    r (down) or p-1-r (up), forward or backward; each runs pairs 0, 1, ... in order (FIFO, so
    every stage keeps micro-batch order). ``finish[d][kind][k * n + j]``: end of pair j's
    ``kind`` at position k of direction d, None until placed.
    """

    def __init__(self, num_ranks: int, num_pairs: int, costs: Costs) -> None:
        p, n = num_ranks, num_pairs
        self.p, self.n, self.comm = p, n, costs.comm
        self.dur = (costs.f, costs.b + costs.w)  # indexed by kind: 0 = F, 1 = B
        self.finish = [[[None] * (p * n) for _ in range(2)] for _ in range(2)]
        self.head = [[0] * 4 for _ in range(p)]  # per rank, stream 2d + kind
        self.inflight = [[0, 0] for _ in range(p)]
        self.caps = [chimera_caps(p, r) for r in range(p)]
        self.free = [0.0] * p
        self.order: list[list[Action]] = [[] for _ in range(p)]
        F, B, c = costs.f, costs.b + costs.w, costs.comm
        # Priority offset: the action's start when its pair runs alone, F at k(F+c), B after all F.
        self.offset = [(k * (F + c), p * F + (p - 1) * c + (p - 1 - k) * (B + c)) for k in range(p)]

    def ready(self, d: int, kind: int, k: int, j: int) -> float | None:
        """Earliest start of pair j's ``kind`` at position k of direction d; None if a dep is unplaced."""
        fin, n, comm = self.finish[d], self.n, self.comm
        if kind == 0:
            if k == 0:
                return 0.0
            prev = fin[0][(k - 1) * n + j]
            return None if prev is None else prev + comm
        own = fin[0][k * n + j]
        if own is None or k == self.p - 1:
            return own
        later = fin[1][(k + 1) * n + j]
        return None if later is None else max(own, later + comm)

    def step(self, r: int, now: float) -> list[tuple[float, int]]:
        """Rank r, free at ``now``, starts its best ready action; returns the (time, rank) to wake.

        Best = smallest (j(F+B) + offset, F after B, down first): pair j is released once per
        F + B, as in 1F1B. A forward is admitted only under its direction's cap.
        """
        best, soonest, head = None, math.inf, self.head[r]
        for d, k in ((0, r), (1, self.p - 1 - r)):
            for kind in (1, 0):
                j = head[2 * d + kind]
                if j >= self.n or (kind == 0 and self.inflight[r][d] >= self.caps[r][d]):
                    continue
                ready = self.ready(d, kind, k, j)
                if ready is None:
                    continue
                if ready > now:
                    soonest = min(soonest, ready)
                    continue
                key = (j * sum(self.dur) + self.offset[k][kind], 1 - kind, d)
                if best is None or key < best[0]:
                    best = (key, d, kind, k, j)
        if best is None:
            return [] if soonest == math.inf else [(soonest, r)]
        _, d, kind, k, j = best
        end = now + self.dur[kind]
        self.finish[d][kind][k * self.n + j] = end
        head[2 * d + kind] += 1
        self.inflight[r][d] += 1 - 2 * kind
        self.free[r] = end
        self.order[r].append(Action(k if d == 0 else self.p + k, "FB"[kind], j))
        wake = [(end, r)]
        unblocked = k + 1 - 2 * kind  # F feeds the next position, B the previous one
        if 0 <= unblocked < self.p:
            wake.append((end + self.comm, unblocked if d == 0 else self.p - 1 - unblocked))
        return wake

    def run(self) -> list[list[Action]]:
        """Wake ranks in time order until every action is placed."""
        events = [(0.0, r) for r in range(self.p)]
        while events:
            now, r = heapq.heappop(events)
            if self.free[r] <= now:
                for event in self.step(r, now):
                    heapq.heappush(events, event)
        assert all(len(actions) == 4 * self.n for actions in self.order), "list scheduling stalled"
        return self.order


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
    return _ListScheduler(num_ranks, num_pairs, costs).run()


def chimera(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: float | None = None,
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
        raise ValueError(
            f"chimera feeds half of the micro-batches to each pipeline, so their number must be even, "
            f"got {m}; {even_microbatches_hint(m, minimum=2)}"
        )
    if order not in ("best", "grid", "list"):
        raise ValueError(f"chimera order must be 'best', 'grid' or 'list', got {order!r}")
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
