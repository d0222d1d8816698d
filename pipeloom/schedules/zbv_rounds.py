"""ZB-V built in rounds: a deep, staggered warm-up, then one I and one F per rank per round, W in the waits.

A second construction beside zbv's list scheduler (zbv keeps whichever the simulator finds shorter).
It follows the shape of the zero-bubble authors' ZB-V generator (Qi et al., 2024), written afresh:

1. Warm-up. Micro-batch 0 goes down the first stages. Then, from rank p-1 up to rank 0, rank r runs
   extra first-stage forwards (the ranks above it one each, so the micro-batch is there) while each
   ends before micro-batch 0 comes back to its second stage and memory keeps room for 2r+2 more
   forwards: rank r ends up about 2(p-r)-1 deep. Then each rank r > 0 runs forwards, alternating
   first/second stage together with the ranks below it, until it has as many as rank r-1 and more
   second-stage ones (the stagger).
2. Steady state, 2m rounds. Each round every rank runs one I (the returning second-stage one
   unless its first-stage one is ready or ahead), then one F (second stage if its input is there,
   else first stage). Before each, W fills the wait for its input while a whole W fits in it; a W
   also goes in a shorter wait when idling would push the rank's idle time past the worst rank's
   (the "bubble budget"), always before a first-stage I and, per option, before a second-stage I
   and before an F: the four options are tried. A W also runs when an F would break the limit.
3. Cool-down: the W left, oldest first.

Each option is rerun with the previous run's per-rank idle times as extra budget while the worst
idle time shrinks. All runs are candidates; infeasible ones (a dependency or memory not there when
the round wants it) are dropped.
"""

from __future__ import annotations

from collections import deque

from pipeloom.ir import Action
from pipeloom.schedules.zbv_plan import VPlan

__all__ = ["round_candidates"]

_MAX_REFINEMENTS = 16
"""Reruns with the previous run's idle times as budget (in practice it stops after 1 to 4)."""


class _Infeasible(Exception):
    """The round pattern needs an action whose input or memory is not there yet."""


class _Builder:
    """One run: per-stage counts and end times, per-rank clock, memory, idle time and pending W."""

    def __init__(self, plan: VPlan, *, w_before_i: bool, w_before_f: bool, budget: list[float] | None):
        p, m = plan.num_ranks, plan.num_microbatches
        self.plan, self.p, self.m, self.last = plan, p, m, 2 * p - 1
        self.w_before_i, self.w_before_f = w_before_i, w_before_f
        self.budget = budget or [0.0] * p
        self.budget_max = max(self.budget)
        self.done = [[0] * (2 * p) for _ in range(3)]  # done[kind][stage]: actions placed
        self.end = [[[0.0] * m for _ in range(2 * p)] for _ in range(2)]  # end[kind][stage][k], F and I
        self.clock, self.held, self.idle = [0.0] * p, [0.0] * p, [0.0] * p
        self.worst_idle = 0.0
        self.waiting_w: list[deque[int]] = [deque() for _ in range(p)]  # stages whose oldest W is due
        self.orders: list[list[Action]] = [[] for _ in range(p)]
        self.makespan = 0.0

    def input_ready(self, kind: int, stage: int) -> float | None:
        """When the next F/I of ``stage`` may start because of its cross-rank input; None: not placed.

        -inf for an input on the same rank (the rank's own order already covers it).
        """
        k, plan = self.done[kind][stage], self.plan
        if kind == 0:
            if stage == 0 or plan.owner[stage - 1] == plan.owner[stage]:
                return -float("inf")
            source, latency = stage - 1, plan.latency_f[stage]
        else:
            if stage == self.last or plan.owner[stage + 1] == plan.owner[stage]:
                return -float("inf")
            source, latency = stage + 1, plan.latency_i[stage]
        if self.done[kind][source] <= k:
            return None
        return self.end[kind][source][k] + latency

    def place(self, rank: int, kind: int, stage: int) -> None:
        """Append the next F (0), I (1) or W (2) of ``stage`` to ``rank``; start after clock and input."""
        k, plan = self.done[kind][stage], self.plan
        if k >= self.m or kind == 2 and self.done[1][stage] <= k or kind == 1 and self.done[0][stage] <= k:
            raise _Infeasible
        start = self.clock[rank]
        if kind < 2:
            ready = self.input_ready(kind, stage)
            if ready is None:
                raise _Infeasible
            if ready > start:
                if self.done[0][plan.rank_stages[rank][0]]:
                    idle = self.idle[rank] = self.idle[rank] + ready - start
                    self.worst_idle = max(self.worst_idle, idle)
                start = ready
        held = self.held[rank] + plan.memory[kind][stage]
        if held > plan.limit:
            raise _Infeasible
        self.held[rank] = held
        end = start + plan.duration[kind][stage]
        if kind < 2:
            self.end[kind][stage][k] = end
        if kind == 1:
            self.waiting_w[rank].append(stage)
        self.done[kind][stage] = k + 1
        self.clock[rank] = end
        self.makespan = max(self.makespan, end)
        self.orders[rank].append(tuple.__new__(Action, (stage, "FIW"[kind], k)))

    def place_w(self, rank: int) -> None:
        if not self.waiting_w[rank]:
            raise _Infeasible
        self.place(rank, 2, self.waiting_w[rank].popleft())

    def fill_wait(self, rank: int, kind: int, stage: int, *, budget_w: bool) -> None:
        """W before the next F/I of ``stage``: every whole W that fits in the wait, then one more
        when ``budget_w`` and the remaining wait would push the rank's idle time past the worst."""
        ready, pending = self.input_ready(kind, stage), self.waiting_w[rank]
        if ready is None or ready == -float("inf"):
            return
        while pending and ready >= self.clock[rank] + self.plan.duration[2][pending[0]]:
            self.place_w(rank)
        if budget_w and pending and ready - self.clock[rank] > (
                max(self.worst_idle, self.budget_max - self.budget[rank]) - self.idle[rank]):
            self.place_w(rank)

    def warm_up(self) -> None:
        """Micro-batch 0 down, each rank filled to about 2(p-r)-1 first-stage forwards, then staggered."""
        p, m, f_dur, f_mem = self.p, self.m, self.plan.duration[0], self.plan.memory[0]
        stages = self.plan.rank_stages
        for r in range(p):
            self.place(r, 0, stages[r][0])
        for r in reversed(range(p)):
            first, second = stages[r]
            if r < p - 1:
                back = self.input_ready(0, second)
                assert back is not None, "rank r+1 placed micro-batch 0 of its second stage above"
                while (self.done[0][first] < m and self.clock[r] + f_dur[first] <= back
                       and self.held[r] + (2 * r + 2) * f_mem[first] <= self.plan.limit):
                    for above in range(r + 1):
                        self.place(above, 0, stages[above][0])
            self.place(r, 0, second)
        side = 0
        for r in range(1, p):
            while (self._forwards(r) < self._forwards(r - 1)
                   or self.done[0][stages[r][1]] <= self.done[0][stages[r - 1][1]] < m):
                for below in reversed(range(r, p)):
                    if self.done[0][stages[below][side]] < m:
                        self.place(below, 0, stages[below][side])
                side = 1 - side

    def _forwards(self, rank: int) -> int:
        first, second = self.plan.rank_stages[rank]
        return self.done[0][first] + self.done[0][second]

    def next_i(self, rank: int) -> int:
        """The stage of the rank's next I: its second stage's unless the first stage's is due."""
        first, second = self.plan.rank_stages[rank]
        if self.done[1][first] >= self.done[1][second]:
            return second
        if rank == self.p - 1 or self.input_ready(1, first) is not None or self.done[1][second] >= self.m:
            return first
        return second

    def next_f(self, rank: int) -> int | None:
        """The stage of the rank's next F (second stage if its input is there), None if none is ready."""
        first, second = self.plan.rank_stages[rank]
        done = self.done[0]
        if done[second] >= done[first]:
            return first
        if rank == self.p - 1 or self.input_ready(0, second) is not None:
            return second
        if done[first] < self.m and self.input_ready(0, first) is not None:
            return first
        return None

    def steady(self) -> None:
        p, m, plan = self.p, self.m, self.plan
        for _ in range(2 * m):
            targets = [(r, self.next_i(r)) for r in range(p)]
            # First-stage I flow up from rank p-1, second-stage ones down from rank 0.
            ups = [t for t in reversed(targets) if t[1] < p]
            downs = [t for t in targets if t[1] >= p]
            for r, stage in ups + downs:
                self.fill_wait(r, 1, stage, budget_w=stage < p or self.w_before_i)
                self.place(r, 1, stage)
            for r in range(p):
                if self.done[0][plan.rank_stages[r][1]] >= m:
                    continue
                forward = self.next_f(r)
                if forward is None:
                    continue
                while self.held[r] + plan.memory[0][forward] > plan.limit:
                    self.place_w(r)
                self.fill_wait(r, 0, forward, budget_w=self.w_before_f)
                self.place(r, 0, forward)

    def run(self) -> list[list[Action]]:
        self.warm_up()
        self.steady()
        for r in range(self.p):
            while self.waiting_w[r]:
                self.place_w(r)
        if any(len(order) != 6 * self.m for order in self.orders):
            raise _Infeasible
        return self.orders


def round_candidates(plan: VPlan) -> list[tuple[float, list[list[Action]]]]:
    """Every feasible run's (makespan by its own clocks, per-rank orders), for the caller to validate."""
    found = []
    for w_before_i in (True, False):
        for w_before_f in (True, False):
            budget, worst = None, float("inf")
            for _ in range(_MAX_REFINEMENTS):
                builder = _Builder(plan, w_before_i=w_before_i, w_before_f=w_before_f, budget=budget)
                try:
                    orders = builder.run()
                except _Infeasible:
                    break
                found.append((builder.makespan, orders))
                if builder.worst_idle >= worst:
                    break
                budget, worst = builder.idle, builder.worst_idle
    return found
