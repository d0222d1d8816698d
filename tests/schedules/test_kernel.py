"""Tests of pipeloom.schedules.kernel, the list-scheduling kernel.

Oracles: closed forms (a chain of F then B on p ranks, one micro-batch at a time and pipelined),
hand-worked orders for the tie-breaks, and the rules' own counters. The schedulers built on the
kernel (ZB-V, interleaved zero bubble, Chimera's list order, the search's greedy) are compared
with their pre-kernel outputs in test_list_golden.py.
"""

from __future__ import annotations

import math
import time

import pytest

from pipeloom.schedules.kernel import (
    ListProblem,
    ListResult,
    ListTask,
    RankState,
    list_schedule_kernel,
    rank_schedule_kernel,
)


class _Fifo:
    """Priority: task index; admission: always (or only while a rank's forwards stay under ``cap``)."""

    def __init__(self, problem: ListProblem, cap: int | None = None) -> None:
        self.problem, self.cap = problem, cap
        self.held = [0] * problem.num_ranks
        self.calls: list[tuple[int, int]] = []

    def priority(self, task, microbatch):
        return (task,)

    def admits(self, task, microbatch):
        t = self.problem.tasks[task]
        return self.cap is None or t.kind != "F" or all(self.held[r] < self.cap for r in t.ranks)

    def started(self, task, microbatch):
        self.calls.append((task, microbatch))
        t = self.problem.tasks[task]
        for r in t.ranks:
            self.held[r] += 1 if t.kind == "F" else -1 if t.kind == "B" else 0


def chain(p: int, m: int, *, f: float = 1.0, b: float = 2.0, comm: float = 0.0) -> ListProblem:
    """F on ranks 0..p-1, then B on p-1..0 (task p + i is the B of rank p-1-i)."""
    forwards = [ListTask(stage=r, kind="F", ranks=(r,), duration=f, deps=((r - 1, comm),) if r else ())
                for r in range(p)]
    backwards = [ListTask(stage=p - 1 - i, kind="B", ranks=(p - 1 - i,), duration=b,
                          deps=((p - 1 - i, 0.0),) + (((p + i - 1, comm),) if i else ()))
                 for i in range(p)]
    return ListProblem(num_ranks=p, num_microbatches=m, tasks=tuple(forwards + backwards))


def run(problem: ListProblem, **kwargs) -> ListResult:
    return list_schedule_kernel(problem, _Fifo(problem, **kwargs))


@pytest.mark.parametrize(("p", "m", "comm"), [(1, 1, 0.0), (3, 1, 0.5), (4, 6, 0.0), (4, 6, 0.25)])
def test_unbounded_chain_runs_every_action_as_soon_as_ready(p, m, comm):
    result = run(chain(p, m, comm=comm))
    assert result.complete and not result.timed_out and result.placed == result.total == 2 * p * m
    assert all(len(actions) == 2 * m for actions in result.ranks)
    if m == 1:  # one micro-batch: down and back up the chain, latency on each of the 2(p-1) hops
        assert result.makespan == p * 3.0 + 2 * (p - 1) * comm
    # every stage runs its micro-batches in order
    for actions in result.ranks:
        for kind in "FB":
            assert [a.microbatch for a in actions if a.kind == kind] == list(range(m))


def test_priority_breaks_ties_and_admission_caps_the_forwards():
    # Unbounded, rank 0 starts every F before any B (F has the smaller priority and is always ready).
    free = run(chain(2, 3))
    assert [str(a) for a in free.ranks[0]] == ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"]
    # Capped at one held forward per rank: the one-at-a-time order, makespan m(2f + 2b) = 18.
    capped = run(chain(2, 3), cap=1)
    assert [str(a) for a in capped.ranks[0]] == ["0F0", "0B0", "0F1", "0B1", "0F2", "0B2"]
    assert capped.makespan == 18.0


def test_a_rule_that_never_admits_returns_an_incomplete_result():
    problem = chain(2, 2)
    result = run(problem, cap=0)
    assert not result.complete and not result.timed_out and result.placed == 0
    assert result.ranks == ((), ())


def test_deadline_in_the_past_times_out():
    result = list_schedule_kernel(chain(2, 2), _Fifo(chain(2, 2)), deadline=time.perf_counter() - 1)
    assert result.timed_out and not result.complete


def test_a_task_on_two_ranks_waits_for_both():
    tasks = (
        ListTask(stage=0, kind="F", ranks=(0,), duration=3.0),
        ListTask(stage=1, kind="F", ranks=(1,), duration=1.0),
        ListTask(stage=2, kind="F", ranks=(0, 1), duration=1.0, deps=((1, 0.0),)),
    )
    result = run(ListProblem(num_ranks=2, num_microbatches=1, tasks=tasks))
    assert [str(a) for a in result.ranks[1]] == ["1F0", "2F0"]
    assert result.ranks[0][-1] == result.ranks[1][-1] and result.makespan == 4.0  # starts when rank 0 frees


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ListTask(stage=0, kind="F", ranks=(), duration=1.0), "no ranks"),
        (lambda: ListTask(stage=0, kind="F", ranks=(0,), duration=-1.0), "must be >= 0"),
        (lambda: ListProblem(num_ranks=1, num_microbatches=0, tasks=()), "num_microbatches"),
        (lambda: ListProblem(num_ranks=1, num_microbatches=1,
                             tasks=(ListTask(stage=0, kind="F", ranks=(1,), duration=1.0),)), "outside"),
        (lambda: ListProblem(num_ranks=1, num_microbatches=1, tasks=(
            ListTask(stage=0, kind="F", ranks=(0,), duration=1.0, deps=((3, 0.0),)),)), "out of range"),
    ],
)
def test_bad_problem_data_is_rejected(build, message):
    with pytest.raises(ValueError, match=message):
        build()


class _FirstReady:
    """Rank rules: the first task of the rank (in index order) that is ready now; else sleep until
    the earliest known ready time."""

    def __init__(self, problem: ListProblem) -> None:
        self.problem = problem

    def choose(self, state: RankState, rank: int, now: float) -> float | None:
        wake = math.inf
        for t, task in enumerate(self.problem.tasks):
            if task.ranks != (rank,) or state.next_mb[t] >= self.problem.num_microbatches:
                continue
            ready = state.ready(t)
            if ready is not None and ready <= now:
                state.place(t, now)
                return None
            if ready is not None:
                wake = min(wake, ready)
        return wake


@pytest.mark.parametrize(("p", "m", "comm"), [(1, 1, 0.0), (3, 1, 0.5), (4, 6, 0.25)])
def test_rank_kernel_matches_the_candidate_kernel_on_a_chain(p, m, comm):
    # With every task admitted and F before B on each rank, both clocks give the same orders.
    problem = chain(p, m, comm=comm)
    ranked = rank_schedule_kernel(problem, _FirstReady(problem))
    assert ranked.complete and ranked == run(problem)
    if m == 1:
        assert ranked.makespan == p * 3.0 + 2 * (p - 1) * comm


def test_rank_kernel_wakes_a_sleeping_neighbour_and_reports_a_stall():
    # Rank 1's F waits on rank 0's F plus latency 2: it is woken by rank 0's placement, not by polling.
    problem = chain(2, 1, comm=2.0)
    result = rank_schedule_kernel(problem, _FirstReady(problem))
    assert [str(a) for a in result.ranks[1]] == ["1F0", "1B0"] and result.makespan == 1 + 2 + 3 + 2 + 2

    class _Never:
        def choose(self, state, rank, now):
            return math.inf

    stalled = rank_schedule_kernel(problem, _Never())
    assert not stalled.complete and stalled.placed == 0


def test_rank_kernel_rejects_tasks_on_several_ranks():
    problem = ListProblem(num_ranks=2, num_microbatches=1,
                          tasks=(ListTask(stage=0, kind="F", ranks=(0, 1), duration=1.0),))
    with pytest.raises(ValueError, match="one-rank tasks"):
        rank_schedule_kernel(problem, _FirstReady(problem))


class _Recording:
    """Rank rules: place the rank's first unplaced task now; record every (rank, time) decision."""

    def __init__(self, problem: ListProblem) -> None:
        self.problem, self.decisions = problem, []

    def choose(self, state: RankState, rank: int, now: float) -> float | None:
        self.decisions.append((rank, now))
        for t, task in enumerate(self.problem.tasks):
            if task.ranks == (rank,) and state.next_mb[t] < self.problem.num_microbatches:
                state.place(t, now)
                return None
        return math.inf


@pytest.mark.parametrize(("rank_order_ties", "at_one"), [(False, [1, 0]), (True, [0, 1])])
def test_ranks_due_at_the_same_time_decide_by_the_tie_rule(rank_order_ties, at_one):
    # Both ranks run a 1-long task from 0, so both are due at 1. Rank 1 places last at 0: by default
    # it decides again first at 1; with rank_order_ties rank 0 goes first.
    tasks = tuple(ListTask(stage=r, kind=kind, ranks=(r,), duration=1.0) for r in (0, 1) for kind in "FB")
    problem = ListProblem(num_ranks=2, num_microbatches=1, tasks=tasks)
    rules = _Recording(problem)
    result = rank_schedule_kernel(problem, rules, rank_order_ties=rank_order_ties)
    assert result.complete and result.makespan == 2.0
    assert [rank for rank, now in rules.decisions if now == 1.0] == at_one
    assert [rank for rank, now in rules.decisions if now == 0.0] == [0, 1]


def test_ready_at_follows_every_placement():
    # chain(2, 2): task 0 = 0F, 1 = 1F (after 0F + 0.5), 2 = 1B (after 1F), 3 = 0B (after 0F and 1B + 0.5).
    state = RankState(chain(2, 2, comm=0.5))
    assert state.ready_at == [0.0, None, None, None]
    state.place(0, 0.0)  # 0F0 ends at 1: 0F1 ready now, 1F0 at 1.5
    assert state.ready_at == [0.0, 1.5, None, None] and state.ready(1) == 1.5
    state.place(0, 1.0)  # 0F1: every micro-batch of task 0 placed
    assert state.ready_at[0] is None
    state.place(1, 1.5)  # 1F0 ends at 2.5: 1B0 ready then; 1F1 at 0F1's end 2 + 0.5
    assert state.ready_at == [None, 2.5, 2.5, None]
    state.place(2, 2.5)  # 1B0 ends at 4.5: 0B0 ready at 5
    assert state.ready_at[3] == 5.0 and state.ready_at[2] is None
