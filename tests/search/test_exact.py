"""Tests of pipeloom.search.exact against brute force and closed-form optima.

Oracles: every per-rank order of tiny problems simulated with pipeloom.sim (the minimum makespan
within the memory limit); 1F1B's (m + p - 1)(f + b + w), optimal for the linear placement with
unbounded memory; the built-in schedules' makespans (the search is never worse).
"""

from __future__ import annotations

from itertools import permutations, product

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeloom.errors import DeadlockError
from pipeloom.ir import Action, Schedule
from pipeloom.problem import Problem, Task
from pipeloom.schedules import build_schedule
from pipeloom.search.common import lower_bound, schedule_from_starts
from pipeloom.search.errors import SearchError
from pipeloom.search.exact import solve_exact
from pipeloom.search.memory_bounds import memory_bound
from pipeloom.search.placements import placement
from pipeloom.sim import simulate
from pipeloom.stages import Costs, Stage, stage_graph
from pipeloom.validate import validate


def brute_force(problem: Problem, num_mb: int, limit: float | None) -> float | None:
    """Minimum simulated makespan over every combination of per-rank orders (None: none fits)."""
    per_rank = [
        [Action(t.stage, t.kind, mb) for t in problem.tasks_on(r) for mb in range(num_mb)]
        for r in range(problem.num_ranks)
    ]
    best = None
    orders = [list(filter(_keeps_rank_deps(problem, r), permutations(a))) for r, a in enumerate(per_rank)]
    for lists in product(*orders):
        schedule = Schedule(name="brute", problem=problem, num_microbatches=num_mb, ranks=lists)
        try:
            timeline = simulate(schedule)
        except DeadlockError:
            continue
        if limit is not None and max(timeline.peak_memory) > limit + 1e-9:
            continue
        if best is None or timeline.makespan < best:
            best = timeline.makespan
    return best


def _keeps_rank_deps(problem: Problem, rank: int):
    """Whether an order of ``rank``'s actions runs each after its deps of the same micro-batch that
    also run on ``rank`` (any other order deadlocks, so skipping it only saves time)."""

    def keeps(order) -> bool:
        seen = set()
        for action in order:
            task = problem.task(action.task)
            for dep in task.deps:
                if rank in problem.task(dep).ranks and (*dep, action.microbatch) not in seen:
                    return False
            seen.add(tuple(action))
        return True

    return keeps


def check(result, limit: float | None) -> None:
    """The result validates (ordered), simulates to its makespan, and respects the limit."""
    timeline = validate(result.schedule, ordered=True)
    assert timeline.makespan == pytest.approx(result.makespan)
    assert result.lower_bound <= result.makespan + 1e-9
    if limit is not None:
        assert max(timeline.peak_memory) <= limit + 1e-9
    assert tuple(timeline.peak_memory) == pytest.approx(result.peak_memory)


def chain(num_ranks: int, *, split: bool = False, costs: Costs | None = None) -> Problem:
    costs = costs or Costs()
    return stage_graph([costs.stage(r) for r in range(num_ranks)], backward="split" if split else "full")


@pytest.mark.parametrize("limit", [None, 1.0, 2.0])
def test_two_stage_chain_matches_brute_force(limit):
    problem = chain(2, costs=Costs(f=1, b=2, w=1))
    result = solve_exact(problem, 2, memory_limit=limit, time_limit=5)
    check(result, limit)
    assert result.makespan == pytest.approx(brute_force(problem, 2, limit))
    assert result.status == "optimal"


@pytest.mark.parametrize("limit", [None, 1.0])
def test_split_backward_with_latency_matches_brute_force(limit):
    problem = stage_graph(
        [Stage(ranks=0, f=1, b=1, w=1), Stage(ranks=1, f=2, b=1, w=2)],
        backward="split", comm_latency=0.5,
    )
    result = solve_exact(problem, 2, memory_limit=limit, time_limit=5)
    check(result, limit)
    assert result.makespan == pytest.approx(brute_force(problem, 2, limit))
    assert result.status == "optimal"


def multi_rank_problem() -> Problem:
    # A on rank 0 feeds X on ranks 0 and 1 (both at once), which feeds C on rank 1; X also frees.
    return Problem(num_ranks=2, comm_latency=1.0, tasks=(
        Task(stage=0, kind="F", ranks=(0,), duration=2, memory=1),
        Task(stage=1, kind="F", ranks=(0, 1), duration=1, memory=1, deps=((0, "F"),)),
        Task(stage=2, kind="F", ranks=(1,), duration=3, memory=-1, deps=((1, "F"),)),
        Task(stage=3, kind="F", ranks=(0,), duration=1, memory=-2, deps=((1, "F"),)),
    ))


@pytest.mark.parametrize("limit", [None, 2.0, 3.0])
def test_multi_rank_task_matches_brute_force(limit):
    problem = multi_rank_problem()
    result = solve_exact(problem, 2, memory_limit=limit, time_limit=5)
    check(result, limit)
    assert result.makespan == pytest.approx(brute_force(problem, 2, limit))
    for rank in range(2):  # the shared task appears on both lists
        assert {str(a) for a in result.schedule.ranks[rank]} >= {"1F0", "1F1"}


@st.composite
def tiny_problems(draw):
    """2 ranks, 2-4 tasks, at most 2 on a rank (4 actions with 2 micro-batches), any deps and memory."""
    tasks = []
    load = [0, 0]
    for i in range(draw(st.integers(2, 4))):
        choices = [ranks for ranks in [(0,), (1,), (0, 1)] if all(load[r] < 2 for r in ranks)]
        if not choices:
            break
        ranks = draw(st.sampled_from(choices))
        for r in ranks:
            load[r] += 1
        deps = tuple((j, "F") for j in range(i) if draw(st.booleans()))
        tasks.append(Task(stage=i, kind="F", ranks=ranks, duration=draw(st.integers(0, 3)),
                          memory=draw(st.integers(-1, 2)), deps=deps))
    return Problem(num_ranks=2, tasks=tuple(tasks), comm_latency=draw(st.sampled_from([0, 1])))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=tiny_problems(), limit=st.sampled_from([None, 1.0, 2.0, 3.0]))
def test_random_tiny_graphs_match_brute_force(problem, limit):
    expected = brute_force(problem, 2, limit)
    if expected is None:
        with pytest.raises(SearchError):
            solve_exact(problem, 2, memory_limit=limit, time_limit=5)
        return
    assert lower_bound(problem, 2, memory_limit=limit) <= expected + 1e-9  # the model's floor is valid
    result = solve_exact(problem, 2, memory_limit=limit, time_limit=5)
    check(result, limit)
    assert result.makespan == pytest.approx(expected)
    assert result.status == "optimal"


def test_a_zero_duration_action_sharing_a_start_runs_before_the_longer_one():
    """Hypothesis found it (the CI run before had passed): the solver starts rank 0's zero-duration collective F1 of
    both micro-batches at time 2, where F0 of micro-batch 1 (2 long) also starts; reading the order by task position
    put F0 first, so F1 waited for it, and the re-simulated order took 9 where the solver's took 7 (the brute-force
    optimum). A zero-duration action that starts where a longer one starts also ends there: it goes first."""
    problem = Problem(num_ranks=2, comm_latency=1.0, tasks=(
        Task(stage=0, kind="F", ranks=(0,), duration=2.0),
        Task(stage=1, kind="F", ranks=(0, 1), duration=0.0),
        Task(stage=2, kind="F", ranks=(1,), duration=2.0, deps=((0, "F"), (1, "F"))),
    ))
    assert brute_force(problem, 2, None) == 7.0
    result = solve_exact(problem, 2, time_limit=5)
    assert result.makespan == pytest.approx(7.0) and result.status == "optimal"
    starts = {(0, 0): 0, (0, 1): 2, (1, 0): 2, (1, 1): 2, (2, 0): 3, (2, 1): 5}  # the solver's solution
    schedule = schedule_from_starts(problem, name="s", num_microbatches=2, starts=starts)
    assert [(a.stage, a.microbatch) for a in schedule.ranks[0]] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert simulate(schedule).makespan == 7.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=tiny_problems(), num_mb=st.sampled_from([1, 2]))
def test_lower_bound_with_forced_idle_never_beats_brute_force(problem, num_mb):
    expected = brute_force(problem, num_mb, None)
    assert lower_bound(problem, num_mb) <= expected + 1e-9


def test_forced_idle_bound_is_tight_on_the_three_rank_chain_with_a_shared_block():
    # F0 (rank 0) -> F1 (rank 1) -> A (ranks 0-2) -> F2 (rank 2): rank 2 waits out F0 and F1 of
    # micro-batch 0 and can share nothing with them; rank 0 waits out F2 of the last micro-batch.
    problem = Problem(num_ranks=3, tasks=(
        Task(stage=0, kind="F", ranks=(0,), duration=1),
        Task(stage=1, kind="F", ranks=(1,), duration=2, deps=((0, "F"),)),
        Task(stage=2, kind="F", ranks=(0, 1, 2), duration=1, deps=((1, "F"),)),
        Task(stage=3, kind="F", ranks=(2,), duration=2, deps=((2, "F"),)),
    ))
    assert lower_bound(problem, 2) == brute_force(problem, 2, None)
    result = solve_exact(problem, 3, time_limit=5)
    check(result, None)
    assert result.status == "optimal"


@pytest.mark.parametrize("name", ["nnshape", "mllm"])
def test_tessel_placements_with_all_rank_blocks_are_proven_optimal(name):
    # Each rank works 8 per micro-batch; rank 3 also waits out F on ranks 0-2 of the first
    # micro-batch (3) and B on ranks 2-0 of the last (9): the optimum is 8M + 12.
    problem = placement(name, 4, memory_limit=6)
    result = solve_exact(problem, 4, time_limit=10)
    check(result, 6.0)
    assert result.status == "optimal" and result.makespan == 4 * 8 + 12


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (3, 3), (4, 4)])
@pytest.mark.parametrize("costs", [Costs(), Costs(f=2, b=3, w=1)])
def test_linear_placement_optimum_is_1f1b(p, m, costs):
    builtin = build_schedule("1f1b", p, m, costs=costs)
    result = solve_exact(builtin.problem, m, time_limit=5)
    check(result, None)
    assert result.status == "optimal"
    assert result.makespan == pytest.approx((m + p - 1) * (costs.f + costs.b + costs.w))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 4), (4, 4)])
def test_split_backward_never_worse_than_zb_h1(p, m):
    builtin = build_schedule("zb-h1", p, m, costs=Costs(f=2, b=2, w=1))
    peak = max(simulate(builtin).peak_memory)
    result = solve_exact(builtin.problem, m, memory_limit=peak, time_limit=5, hints=(builtin,))
    check(result, peak)
    assert result.makespan <= simulate(builtin).makespan + 1e-9


@pytest.mark.parametrize("limit", [1.0, 2.0, 3.0])
def test_memory_limit_is_honoured_and_costs_time(limit):
    problem = chain(3)
    unlimited = solve_exact(problem, 4, time_limit=5)
    result = solve_exact(problem, 4, memory_limit=limit, time_limit=5)
    check(result, limit)
    assert result.schedule.problem.memory_limit == limit
    assert result.makespan >= unlimited.makespan


def v_problem() -> Problem:
    """Two stages per rank in a V: rank 0 must hold both forwards before either backward."""
    return stage_graph([Stage(ranks=r) for r in (0, 1, 1, 0)])


def test_infeasible_limit_names_the_smallest_feasible_one():
    with pytest.raises(SearchError, match="at most 2"):
        solve_exact(v_problem(), 2, memory_limit=1.5, time_limit=5)
    check(solve_exact(v_problem(), 2, memory_limit=2.0, time_limit=5), 2.0)


def test_finds_a_schedule_below_the_list_schedulers_limit():
    # Two independent F/B pairs on one rank: the list scheduler reserves 2, but running one pair
    # after the other needs only 1.
    problem = Problem(num_ranks=1, tasks=(
        Task(stage=0, kind="F", ranks=(0,), duration=1, memory=1),
        Task(stage=0, kind="B", ranks=(0,), duration=1, memory=-1, deps=((0, "F"),)),
        Task(stage=1, kind="F", ranks=(0,), duration=1, memory=1),
        Task(stage=1, kind="B", ranks=(0,), duration=1, memory=-1, deps=((1, "F"),)),
    ))
    result = solve_exact(problem, 2, memory_limit=1.0, time_limit=5)
    check(result, 1.0)
    assert result.makespan == 8


def test_real_durations_give_a_valid_bound():
    costs = Costs(f=1 / 3, b=2 / 7, w=0.1)  # no power of ten makes these whole
    builtin = build_schedule("1f1b", 2, 3, costs=costs)
    result = solve_exact(builtin.problem, 3, time_limit=5)
    check(result, None)
    assert result.lower_bound <= (3 + 2 - 1) * (costs.f + costs.b + costs.w) + 1e-9
    assert result.makespan <= simulate(builtin).makespan + 1e-9


def test_hints_of_another_problem_are_skipped_and_progress_is_reported():
    problem = chain(3, split=True)
    reports = []
    other = build_schedule("1f1b", 3, 4)  # a different task graph (no split backward)
    result = solve_exact(problem, 4, memory_limit=3.0, time_limit=5, hints=(other,), progress=reports.append)
    check(result, 3.0)
    for report in reports:
        assert report.best >= report.bound - 1e-9


def test_bound_includes_the_memory_time_term_of_the_limit_argument():
    """1F1B placement, p=4, m=8, thirds (scaling inexact: the bound is the analytic one). Rank 0
    holds each activation 10/3 time units, so limit 2 admits one micro-batch per 5/3: 8 * 5/3
    beats the path bound (8 + 3) * 1; its last B (2/3) gives the memory back when it starts (the
    memory bound's drain term)."""
    costs = Costs(f=1 / 3, b=1 / 3, w=1 / 3)
    problem = build_schedule("1f1b", 4, 8, costs=costs).problem  # no limit of its own
    result = solve_exact(problem, 8, memory_limit=2.0, time_limit=3)
    check(result, 2.0)
    assert memory_bound(problem, 8, memory_limit=2.0) >= 8 * 5 / 3 + 2 / 3 - 1e-9  # the analytic term at least
    # the release chain (a B that frees memory ends before the F two later starts) is stronger still
    assert lower_bound(problem, 8, memory_limit=2.0) == pytest.approx(49 / 3)
    assert result.makespan >= 49 / 3 - 1e-9
    assert lower_bound(problem, 8) == pytest.approx(11.0)
    assert result.lower_bound >= 8 * 5 / 3 - 1e-9
