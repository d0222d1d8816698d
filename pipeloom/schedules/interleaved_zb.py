"""Interleaved zero bubble: v looped stages per rank (stage s on rank s % p), split backward.

Candidates are interleaved 1F1B's order with I in place of B and deferred W's (the ZB-H1 rule on the
looped layout), and a family of cost- and memory-aware list schedules; the fastest valid one wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeloom.errors import ArgumentError, DeadlockError, PipeloomError
from pipeloom.ir import Action, Schedule
from pipeloom.problem import Problem
from pipeloom.schedules.common import MemoryLimit, check_counts, make_schedule
from pipeloom.schedules.interleaved import check_stages_per_rank, group_sizes, grouped_order, looped_problem
from pipeloom.schedules.kernel import ListProblem, ListTask, RankState, rank_schedule_kernel
from pipeloom.sim import simulate
from pipeloom.stages import Costs

__all__ = ["interleaved_zb"]

_INF = float("inf")
_VARIANT_ACTIONS = 40_000
"""Try every list-scheduling policy only while the schedule has at most this many actions."""
_TOLERANCE = 1e-9
"""Relative slack on memory caps (the validator allows 1e-9 absolute)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Policy:
    """How a rank of the list scheduler picks its next action among the ready ones."""

    order: str
    """Priority of the candidates: ``"I"`` input gradients first, ``"F"`` forwards first,
    ``"R"`` forwards of returning micro-batches (local stage >= 1), then I, then new forwards."""
    patient: bool
    """Start a new micro-batch's forward only if it ends before a higher-priority action is ready."""
    w_only_if_fits: bool
    """Fill an idle gap with W only when it ends before the next known F/I becomes ready."""
    reserve: int
    """Stage forwards of room kept free when admitting a forward of a local stage below the last;
    -1 admits a new micro-batch only with room for all its forwards on the rank, besides the
    forwards still owed to the micro-batches in flight (never deadlocks for a cap >= v forwards)."""


_POLICIES = tuple(
    _Policy(order=order, patient=patient, w_only_if_fits=fits, reserve=reserve)
    for order, patient, fits, reserve in (
        ("F", True, False, 0), ("F", True, True, 0), ("I", True, True, 0), ("F", True, False, 1),
        ("R", False, False, 0), ("F", False, False, 0), ("F", False, True, 0), ("R", True, False, 0),
        ("I", True, True, 1), ("I", True, True, -1), ("R", False, False, -1),
    )
)
"""Eleven of the 38 combinations of the flags above (36 with reserve 0..2, two with -1): over 120
cases (p 2..8, m 8..32, v 2 and 3, four cost sets incl. latency and w_memory, default caps) each
case's fastest list schedule was among these. The two with reserve -1 never deadlock."""
_DEFAULT = _Policy(order="I", patient=True, w_only_if_fits=True, reserve=-1)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Plan:
    """Per-stage durations, memory deltas and latencies read off the Problem, and per-rank caps."""

    num_ranks: int
    num_microbatches: int
    stages_per_rank: int
    duration: tuple[tuple[float, ...], ...]
    """``duration[kind][stage]`` for kind 0 = F, 1 = I, 2 = W."""
    memory: tuple[tuple[float, ...], ...]
    """``memory[kind][stage]``: held-memory change when the action starts."""
    comm: float
    """Latency between consecutive stages (always on different ranks when p > 1)."""
    caps: tuple[float, ...]
    """``caps[r]``: the most memory rank r may hold."""


def _plan(problem: Problem, num_microbatches: int, stages_per_rank: int, caps: list[float]) -> _Plan:
    tasks = [[problem.task((s, kind)) for s in range(problem.num_stages)] for kind in "FIW"]
    return _Plan(
        num_ranks=problem.num_ranks,
        num_microbatches=num_microbatches,
        stages_per_rank=stages_per_rank,
        duration=tuple(tuple(t.duration for t in row) for row in tasks),
        memory=tuple(tuple(t.memory for t in row) for row in tasks),
        comm=problem.comm_latency if problem.num_ranks > 1 else 0.0,
        caps=tuple(cap + _TOLERANCE * max(1.0, abs(cap)) for cap in caps),
    )


def _one_f_one_b_order(num_ranks: int, num_microbatches: int, stages_per_rank: int, *, rank: int) -> list[Action]:
    """Interleaved 1F1B on rank ``rank`` with I for B and W's deferred (ZB-H1's rule, looped).

    Forwards and I's go in interleaved 1F1B's groups (:func:`group_sizes`). Rank r warms up with
    (v-1)g + p-r-1 forwards (g the first group's size), one step fewer per rank than 1F1B-style
    interleaving; then step k runs the next forward (while any remain) and the k-th I, and from
    step r on also the oldest pending W. The W's deferred on rank r fill its tail.
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    sizes = group_sizes(p, m)
    forwards = [Action(c * p + rank, "F", mb) for c, mb in grouped_order(sizes, v)]
    backwards = grouped_order(sizes, v, reverse=True)
    inputs = [Action(c * p + rank, "I", mb) for c, mb in backwards]
    weights = [Action(c * p + rank, "W", mb) for c, mb in backwards]
    lead = min((v - 1) * sizes[0] + p - rank - 1, m * v)
    order = forwards[:lead]
    done = 0
    for k, action in enumerate(inputs):
        if lead + k < len(forwards):
            order.append(forwards[lead + k])
        order.append(action)
        if k >= rank:
            order.append(weights[done])
            done += 1
    return order + weights[done:]


def _looped_list_problem(plan: _Plan) -> ListProblem:
    """The kernel's problem data for a _Plan: with S = p*v stages, task s is F of stage s, S + s its
    I, 2S + s its W; stage s runs on rank s % p."""
    p, stages = plan.num_ranks, plan.num_ranks * plan.stages_per_rank
    (f_dur, i_dur, w_dur), (f_mem, i_mem, w_mem), comm = plan.duration, plan.memory, plan.comm
    forwards = [ListTask(stage=s, kind="F", ranks=(s % p,), duration=f_dur[s], memory=f_mem[s],
                         deps=((s - 1, comm),) if s else ()) for s in range(stages)]
    inputs = [ListTask(stage=s, kind="I", ranks=(s % p,), duration=i_dur[s], memory=i_mem[s],
                       deps=((s, 0.0),) + (((stages + s + 1, comm),) if s < stages - 1 else ()))
              for s in range(stages)]
    weights = [ListTask(stage=s, kind="W", ranks=(s % p,), duration=w_dur[s], memory=w_mem[s],
                        deps=((stages + s, 0.0),)) for s in range(stages)]
    return ListProblem(num_ranks=p, num_microbatches=plan.num_microbatches, tasks=tuple(forwards + inputs + weights))


class _PolicyRules:
    """A :class:`_Policy` as :class:`~pipeloom.schedules.kernel.RankRules` (tasks numbered as in
    :func:`_looped_list_problem`): a free rank runs the first ready F or I in its policy's order (a
    forward only within its memory cap), else its oldest pending W, else sleeps."""

    def __init__(self, plan: _Plan, policy: _Policy) -> None:
        self.plan, self.policy = plan, policy
        p, v = plan.num_ranks, plan.stages_per_rank
        self.stages = stages = p * v
        f_mem = plan.memory[0]
        self.need = [f_mem[s] * (1 + (policy.reserve if s // p < v - 1 else 0)) for s in range(stages)]
        self.local = [range(rank, stages, p) for rank in range(p)]
        self.candidates = [self._candidates(r) for r in range(p)]

    def _candidates(self, rank: int) -> tuple[tuple[int, int, bool], ...]:
        """(task, stage, patient) in priority order; later local stages first."""
        p, v, policy, stages = self.plan.num_ranks, self.plan.stages_per_rank, self.policy, self.stages
        local = [c * p + rank for c in range(v - 1, -1, -1)]
        new = [(local[-1], local[-1], policy.patient)]
        returning = [(s, s, False) for s in local[:-1]]
        inputs = [(stages + s, s, False) for s in local]
        if policy.order == "I":
            return tuple(inputs + returning + new)
        if policy.order == "R":
            return tuple(returning + inputs + new)
        return tuple(returning + new + inputs)

    def _blocked(self, state: RankState, rank: int, s: int) -> bool:
        """Whether the next forward of stage s would break rank's memory cap (see _Policy.reserve)."""
        if self.policy.reserve >= 0:
            return state.held[rank] + self.need[s] > self.plan.caps[rank]
        local, f_mem, nf = self.local[rank], self.plan.memory[0], state.next_mb
        if s != local[0]:
            return False  # room reserved when the micro-batch entered the rank
        owed = sum((nf[s] - nf[t]) * f_mem[t] for t in local[1:])
        return state.held[rank] + owed + sum(f_mem[t] for t in local) > self.plan.caps[rank]

    def choose(self, state: RankState, rank: int, t: float) -> float | None:
        """Place the first ready candidate (patience: a new micro-batch's forward only if it ends before
        a higher-priority candidate is ready), else the W whose I ended first if it fits the gap; else
        return the next known ready time."""
        nxt, f_dur, ready_at = _INF, self.plan.duration[0], state.ready_at
        for task, s, patient in self.candidates[rank]:
            if task == s and self._blocked(state, rank, s):
                continue
            ready = ready_at[task]
            if ready is None or (patient and ready <= t and t + f_dur[s] > nxt):
                continue
            if ready <= t:
                state.place(task, t)
                return None
            nxt = min(nxt, ready)
        stages, nmb, finish = self.stages, state.next_mb, state.finish
        pending = [s for s in self.local[rank] if nmb[2 * stages + s] < nmb[stages + s]]
        if pending:
            s = min(pending, key=lambda s: finish[stages + s][nmb[2 * stages + s]])
            if not self.policy.w_only_if_fits or t + self.plan.duration[2][s] <= nxt:
                state.place(2 * stages + s, t)
                return None
        return nxt


def _list_schedule(plan: _Plan, policy: _Policy) -> list[list[Action]] | None:
    """Every rank's order, built while simulating it on
    :func:`~pipeloom.schedules.kernel.rank_schedule_kernel`; None when this policy deadlocks.

    Ranks decide in order of the time they become free, ranks due at the same time in rank order,
    so every action that starts before a rank's decision time t is placed and "ready at t" is
    exact. Each stage runs its F, I and W in micro-batch order.
    """
    result = rank_schedule_kernel(_looped_list_problem(plan), _PolicyRules(plan, policy), rank_order_ties=True)
    return [list(actions) for actions in result.ranks] if result.complete else None


def _evaluate(schedule: Schedule, caps: list[float]) -> float | None:
    """The makespan of ``schedule`` if it runs without deadlock within ``caps``, else None."""
    try:
        timeline = simulate(schedule)
    except DeadlockError:
        return None
    if any(peak > cap + _TOLERANCE * max(1.0, abs(cap)) for peak, cap in zip(timeline.peak_memory, caps)):
        return None
    return timeline.makespan


def _default_caps(num_ranks: int, num_microbatches: int, stages_per_rank: int, *, costs: Costs) -> list[float]:
    """Rank r's activations in interleaved 1F1B-with-I/W order: min(vm, (v-1)g + p - r) stage forwards.

    g is the first group's size (p when p divides m), so with p | m rank r holds p - r/v
    micro-batches' worth (1F1B's p on rank 0); the deferred W's add their w_memory on top.
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    g = group_sizes(p, m)[0]
    unit, w_unit = costs.memory / v, costs.w_memory / v
    return [min(v * m, (v - 1) * g + p - r) * unit + min(r, v * m) * w_unit for r in range(p)]


def interleaved_zb(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
    stages_per_rank: int = 2,
) -> Schedule:
    """Zero bubble on the looped layout: p*v stages, stage s on rank s % p, backward split into I and W.

    Candidates, each simulated with f, b, w and the latency ``costs.comm``; the fastest that
    runs within the memory caps wins (ties: the first):
    1. interleaved 1F1B's order (same groups) with I for B, a warm-up of (v-1)g + p-r-1
       forwards on rank r and, from step r on, the oldest pending W after each I -- the ZB-H1
       rule on the looped layout (torch's ``ScheduleInterleavedZeroBubble`` runs the same order);
    2. list schedules that simulate as they go: a free rank runs the first ready F or I in its
       policy's priority order (a forward only within its cap), else a W to fill the gap.
       Up to 40k actions eleven policies are tried, beyond that one that never deadlocks.

    Memory: with ``memory_limit=None`` rank r holds at most what candidate 1 holds,
    min(vm, (v-1)g + p - r) stage forwards of ``costs.memory / v`` each (g the first group's
    size; p - r/v micro-batches, 1F1B's p on rank 0, when p divides m) plus min(r, vm) deferred
    W's of ``costs.w_memory / v``; the Problem's limit is the largest of these. A given
    ``memory_limit`` caps every rank.

    Bubble: no schedule beats ``(p-1)(f/v + comm) + m(f+b+w)`` (rank p-1 cannot start before
    p-1 forwards of a stage have run). With f = b = w, no latency and p | m, candidate 1 meets
    it: makespan 3m + (p-1)/v for f = 1, a bubble of (p-1)f/v per rank, 1/v of ZB-H1's. With
    other costs, latency or tighter limits the winner is a heuristic; it is never slower than
    candidate 1 when that fits the limit. v = 1 gives ZB-H1's order as candidate 1.
    """
    check_counts("interleaved-zb", num_ranks, num_microbatches)
    v = check_stages_per_rank("interleaved-zb", stages_per_rank)
    p, m = num_ranks, num_microbatches
    if memory_limit is None:
        caps = _default_caps(p, m, v, costs=costs)
        memory_limit = max(caps)
    else:
        caps = [memory_limit] * p
    problem = looped_problem(p, stages_per_rank=v, costs=costs, memory_limit=memory_limit, split_backward=True)
    limit = problem.memory_limit
    assert limit is not None, "looped_problem keeps the limit it is given"
    if limit < costs.memory * (1 - 1e-12):
        raise ArgumentError(
            f"interleaved-zb: memory_limit {limit:g} is below what one micro-batch needs "
            f"on a rank (the activations of its {v} stages there, costs.memory = {costs.memory:g}); "
            f"the smallest workable limit is {costs.memory:g}"
        )
    plan = _plan(problem, m, v, caps)
    candidates = [[_one_f_one_b_order(p, m, v, rank=r) for r in range(p)]]
    for policy in _POLICIES if 3 * p * v * m <= _VARIANT_ACTIONS else (_DEFAULT,):
        orders = _list_schedule(plan, policy)
        if orders is not None:
            candidates.append(orders)
    best, best_makespan = None, _INF
    for orders in candidates:
        schedule = make_schedule("interleaved-zb", problem=problem, num_microbatches=m, ranks=orders)
        makespan = _evaluate(schedule, caps)
        if makespan is not None and makespan < best_makespan:
            best, best_makespan = schedule, makespan
    if best is None:
        raise PipeloomError(
            f"interleaved-zb found no deadlock-free order for p={p}, m={m}, v={v}, "
            f"memory_limit={problem.memory_limit:g}, {costs}: every candidate deadlocked or went over "
            f"the limit; a larger memory_limit may work (about {costs.memory * min(p, m):g}, 1F1B's)"
        )
    return best
