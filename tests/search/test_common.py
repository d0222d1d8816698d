"""search.common: integer scaling, the lower bounds (checked against exact optima) and order building."""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.problem import Problem, Task
from pipeloom.schedules import build_schedule
from pipeloom.search.common import forced_idle, lower_bound, period_lower_bound, schedule_from_starts, to_integers
from pipeloom.search.exact import solve_exact
from pipeloom.search.memory_bounds import memory_bound, memory_time_per_microbatch, release_chain_bound
from pipeloom.search.placements import placement
from pipeloom.stages import Costs
from pipeloom.validate import validate


def test_scaling_is_exact_for_decimals_and_flags_rounding():
    problem = build_schedule("1f1b", 2, 2, costs=Costs(f=0.25, b=1.5, w=0.5)).problem
    scaled = to_integers(problem)
    assert scaled.exact and scaled.time_scale == 100 and scaled.durations == (25, 200, 25, 200)
    thirds = build_schedule("1f1b", 2, 2, costs=Costs(f=1 / 3)).problem
    assert not to_integers(thirds).exact


def test_lower_bound_of_the_linear_placement_is_1f1b_makespan():
    # (m + p - 1)(f + b + w): rank p-1 waits (p-1)f, works m(f+b+w), then (p-1)(b+w) remain.
    for p, m in [(1, 1), (2, 3), (4, 8)]:
        assert lower_bound(build_schedule("1f1b", p, m).problem, m) == (m + p - 1) * 3


def test_memory_time_area_is_the_path_from_forward_to_backward():
    # 1F1B, p=4: on rank 0, F0 holds its activation until B0 starts: 1 (F0) + 3 (F1..F3) + 3*2
    # (B3..B1) = 10 time units; on rank 3 only F3 itself: 1.
    problem = build_schedule("1f1b", 4, 8).problem
    assert memory_time_per_microbatch(problem) == [10.0, 7.0, 4.0, 1.0]
    assert period_lower_bound(problem) == 3.0  # no limit: the work per micro-batch
    # rank 0 holds each activation until B0 *ends* (it runs nothing else meanwhile): (10 + 2) / 2
    assert period_lower_bound(problem, memory_limit=2) == 6.0
    # the area window alone: 8 * 10 / 2 = 40 from the first F0's start, then the last B0 runs its 2
    assert memory_bound(problem, 8, memory_limit=2) == 8 * 12 / 2
    # the release chain: F0 of micro-batch k + 2 waits for a B0 that ended >= 12 after the k-th F0,
    # so the 8th F0 starts >= 3 * 12 + 1 and its B0 ends 12 later
    assert release_chain_bound(problem, 8, memory_limit=2) == lower_bound(problem, 8, memory_limit=2) == 49.0


@pytest.mark.parametrize(
    ("problem", "m", "limit"),
    [
        (build_schedule("1f1b", 3, 4).problem, 4, 1.0),
        (build_schedule("1f1b", 3, 4).problem, 4, 2.0),
        (build_schedule("zb-h1", 3, 3).problem, 3, 1.5),
        (placement("vshape", 4), 3, 2.0),
        (placement("xshape", 4), 3, 2.0),
        (placement("mshape", 4), 3, 3.0),
    ],
)
def test_lower_bound_never_exceeds_the_exact_optimum(problem, m, limit):
    result = solve_exact(problem, m, memory_limit=limit, time_limit=20)
    assert result.status == "optimal"
    assert lower_bound(problem, m, memory_limit=limit) <= result.makespan + 1e-9


@pytest.mark.parametrize(
    ("name", "limit", "m"),
    [("vshape", 2.0, 4), ("mshape", 2.0, 4), ("finetune", 2.0, 3), ("alphafold", 2.0, 4),
     ("nnshape", 3.0, 3), ("xshape", 4.0, 3)],
)
def test_memory_bound_with_fill_and_drain_never_exceeds_the_exact_optimum(name, limit, m):
    # Oracle: CP-SAT's proven optimum at 4 ranks. The fill/drain terms must add something over
    # the bare area bound M * area / room on the binding rank (else this test checks nothing new).
    problem = placement(name, 4, memory_limit=limit)
    result = solve_exact(problem, m, time_limit=20, workers=1)
    assert result.status == "optimal"
    bound = memory_bound(problem, m)
    assert m * max(memory_time_per_microbatch(problem)) / limit < bound <= result.makespan + 1e-9
    assert lower_bound(problem, m) <= result.makespan + 1e-9


def _static(problem: Problem, static: tuple[float, ...]) -> Problem:
    return dataclasses.replace(problem, static_memory=static)


@pytest.mark.parametrize(
    ("problem", "m", "limit", "tight"),
    [
        (build_schedule("1f1b", 4, 4).problem, 4, 2.0, False),
        (build_schedule("1f1b", 3, 4).problem, 5, 1.0, True),
        (build_schedule("1f1b", 3, 4, costs=Costs(f=1.5, b=2.5, comm=0.5, memory=2)).problem, 5, 5.0, True),
        (placement("vshape", 4), 5, 2.0, True),
        (_static(placement("vshape", 3, comm_latency=0.5), (1.0, 0.0, 0.5)), 5, 3.0, True),
        (placement("vshape", 3, f=2, b=1), 6, 2.0, False),
        (placement("vshape", 4, split_backward=True), 4, 2.0, False),
        (placement("finetune", 3, comm_latency=1.0), 5, 1.0, True),
    ],
)
def test_release_chain_bound_never_exceeds_the_exact_optimum(problem, m, limit, tight):
    # Oracle: CP-SAT's proven optimum (each under a second). Where marked, the chain *is* the
    # optimum, above the memory-area bound: the test would fail if the chain were dropped or loosened.
    result = solve_exact(problem, m, memory_limit=limit, time_limit=20, workers=1)
    assert result.status == "optimal"
    chain = release_chain_bound(problem, m, memory_limit=limit)
    assert 0 < chain <= result.makespan + 1e-9
    assert lower_bound(problem, m, memory_limit=limit) <= result.makespan + 1e-9
    if tight:
        assert chain == pytest.approx(result.makespan)


def test_schedule_from_starts_orders_each_rank_by_start():
    problem = build_schedule("gpipe", 2, 2).problem
    # one micro-batch after the other: F then B on rank 0 while rank 1 follows
    starts = {}
    for t, task in enumerate(problem.tasks):
        for mb in range(2):
            starts[(t, mb)] = {"F": 0, "B": 10}[task.kind] + task.stage + 3 * mb
    schedule = schedule_from_starts(problem, name="x", num_microbatches=2, starts=starts)
    assert [str(a) for a in schedule.ranks[0]] == ["0F0", "0F1", "0B0", "0B1"]
    validate(schedule, ordered=True)


def test_forced_idle_counts_the_waits_behind_all_rank_blocks():
    # nnshape, 4 ranks: rank r waits out the forwards of ranks < r in micro-batch 0 and the
    # backwards of ranks < r in the last one (span 3), so 4r; with 8 work per micro-batch the bound
    # is 8M + 12, the optimum the exact search proves.
    problem = placement("nnshape", 4, memory_limit=6)
    assert [forced_idle(problem, 8, r) for r in range(4)] == [0.0, 4.0, 8.0, 12.0]
    assert lower_bound(problem, 8) == 76.0
    assert [forced_idle(problem, 1, r) for r in range(4)] == [0.0, 4.0, 8.0, 12.0]


def test_forced_idle_counts_every_copy_of_a_task_that_blocks_the_whole_rank():
    # Rank 1 runs only X (ranks 0 and 1); rank 0 runs A before X: every A leaves rank 1 idle,
    # also in the middle copies (collapsed beyond 64 micro-batches, exactly below).
    problem = Problem(num_ranks=2, tasks=(
        Task(stage=0, kind="F", ranks=(0,), duration=2),
        Task(stage=1, kind="F", ranks=(0, 1), duration=1, deps=((0, "F"),)),
    ))
    for m in (1, 2, 3, 10, 100):
        assert forced_idle(problem, m, 1) == 2 * m
        assert lower_bound(problem, m) == 3 * m


def test_a_limit_beyond_integer_range_is_unlimited_and_huge_values_are_refused():
    from pipeloom.search.common import MAX_SCALED
    from pipeloom.search.errors import SearchError
    from pipeloom.search.periodic import solve_periodic

    problem = build_schedule("1f1b", 2, 2, costs=Costs(f=1, b=2)).problem
    assert to_integers(problem, memory_limit=1e308).limits == (None, None)
    assert to_integers(problem, memory_limit=float(MAX_SCALED)).limits != (None, None)
    for solve in (solve_exact, solve_periodic):  # no int64 overflow in either model
        result = solve(problem, 4, memory_limit=1e308, time_limit=2.0)
        assert validate(result.schedule, ordered=True).makespan == pytest.approx(result.makespan)
    slow = build_schedule("1f1b", 2, 2, costs=Costs(f=1e15, b=2e15)).problem
    to_integers(slow)  # one micro-batch still fits
    with pytest.raises(SearchError, match="durations and latencies of 1,000 micro-batches .* 2\\*\\*53"):
        to_integers(slow, num_microbatches=1000)


def test_the_range_error_names_a_scaled_total_past_the_float_range():
    """Each duration is a finite float, but a billion micro-batches of two of them make an integer
    over 1.8e308, which ``{:.3g}`` cannot format (an OverflowError before)."""
    from pipeloom.search.errors import SearchError

    problem = Problem(num_ranks=1, tasks=(
        Task(stage=0, kind="F", ranks=(0,), duration=1e300),
        Task(stage=1, kind="F", ranks=(0,), duration=1e300, deps=((0, "F"),)),
    ))
    with pytest.raises(SearchError, match=r"scale to 2e\+309 integer units"):
        to_integers(problem, num_microbatches=10**9)
