"""Periodic (repetend) search: unrolling correctness up to 4096 micro-batches, the steady-state
memory formula against the simulator, the period against the per-rank work bound and the
memory-aware bounds of search.common, the list-schedule/exact fallback, and errors."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import ortools  # noqa: F401  (before anything that may load SciPy)
import pytest
from ortools.sat.python import cp_model

from pipeloom.errors import MemoryLimitError
from pipeloom.problem import Problem, Task
from pipeloom.schedules import build_schedule
from pipeloom.search.common import lower_bound, period_lower_bound, to_integers
from pipeloom.search.errors import SearchError
from pipeloom.search.periodic import solve_periodic
from pipeloom.search.placements import placement
from pipeloom.search.repetend import Repetend, RepetendModel, coarsen, solver_period_bound, steady_state_peak
from pipeloom.search.result import SearchProgress
from pipeloom.search.steady import solve_repetend, unroll
from pipeloom.sim import simulate
from pipeloom.stages import Costs, Stage, stage_graph
from pipeloom.validate import validate


def chain(num_ranks: int, *, f: float = 1, b: float = 3, limit: float | None = None) -> Problem:
    """Tessel's vshape: F on ranks 0..n-1, then B on n-1..0 (F span 1 memory +1, B span 3)."""
    stages = [Stage(ranks=r, f=f, b=b, w=0) for r in range(num_ranks)]
    return stage_graph(stages, memory_limit=limit)


def branches(num_ranks: int = 4) -> Problem:
    """Tessel's kshape: two half-rank chains joined by a loss block on every rank."""
    half = num_ranks // 2
    stages = [Stage(ranks=r, f=1, b=3, w=0) for r in range(num_ranks)]
    stages.append(Stage(ranks=tuple(range(num_ranks)), f=1, b=1, w=0, memory=1))
    edges = [(r, r + 1) for r in range(half - 1)] + [(r, r + 1) for r in range(half, num_ranks - 1)]
    edges += [(half - 1, num_ranks), (num_ranks - 1, num_ranks)]
    return stage_graph(stages, edges=edges)


def mllm(num_ranks: int = 4) -> Problem:
    """F(all) -> chain -> F(all), backward mirrored: multi-rank blocks between chains."""
    every = Stage(ranks=tuple(range(num_ranks)), f=1, b=1, w=0, memory=0)
    stages = [every] + [Stage(ranks=r, f=1, b=3, w=0) for r in range(num_ranks)] + [every]
    return stage_graph(stages)


PROBLEMS = {
    "vshape": lambda: chain(4),
    "kshape": branches,
    "mllm": mllm,
    "1f1b": lambda: build_schedule("1f1b", 4, 8).problem,
    "zbv": lambda: build_schedule("zbv", 4, 8).problem,
    "zb-h1": lambda: build_schedule("zb-h1", 4, 8).problem,
}


@functools.cache
def repetend_of(name: str, limit: float | None, copies: int = 1) -> tuple[Problem, Repetend | None]:
    """A fast repetend of ``copies`` micro-batches of ``name``'s problem under ``limit``: CP-SAT on one worker within
    a deterministic time (its own work count, not the clock), so the same on every run and machine; None where it
    proves none exists. (A search on two workers within 1 s had found none on a loaded machine, which the tests took
    for a limit below every repetend; a first solution, tried next, kept the copies' peaks apart and no longer
    guarded the formula's sum over them.)"""
    problem = replace(PROBLEMS[name](), memory_limit=limit)
    ip = to_integers(problem)
    model = RepetendModel(ip, copies=copies, limits=ip.limits)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = 2.0
    solver.parameters.max_time_in_seconds = 120.0  # a guard against a hang, never the budget
    status = solver.solve(model.model)
    if status == cp_model.INFEASIBLE:
        return problem, None
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), solver.status_name(status)
    return problem, model.repetend(solver)


def periodic_finish(problem: Problem, repetend: Repetend, num_microbatches: int) -> float:
    """Latest finish of the timed periodic schedule (micro-batch R*i + c at i*T + o_{c,t})."""
    ip = to_integers(problem)
    rows = repetend.copies
    last = max(
        (j // rows) * repetend.period + repetend.offsets[j % rows][t] + ip.durations[t]
        for t in range(len(problem.tasks))
        for j in range(max(0, num_microbatches - 2 * rows), num_microbatches)
    )
    return last / ip.time_scale


@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 7, 128, 4096])
def test_unrolled_schedule_is_valid_and_no_later_than_the_periodic_timing(num_microbatches: int) -> None:
    problem, repetend = repetend_of("vshape", 6.0)
    assert repetend is not None
    schedule = unroll(problem, repetend, num_microbatches)
    timeline = validate(schedule, ordered=True)
    assert max(timeline.peak_memory) <= 6.0
    assert timeline.makespan <= periodic_finish(problem, repetend, num_microbatches)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("limit", [None, 2.0, 3.0, 6.0])
@pytest.mark.parametrize("copies", [1, 2, 3])
def test_steady_state_memory_formula_matches_the_simulated_unrolled_peak(name: str, limit: float | None,
                                                                         copies: int) -> None:
    """Oracle: simulate() of the unrolled schedule; for M large enough its peak on every rank is
    the model's steady-state peak (warm-up and cool-down hold no more, F runs before its B); repetends of one to
    three micro-batches (a review found the formula's sum over copies unguarded by one-copy repetends alone)."""
    problem, repetend = repetend_of(name, limit, copies)
    if repetend is None:
        pytest.skip("proven: no repetend meets this limit (covered by the infeasible-limit test)")
    ip = to_integers(problem)
    timeline = simulate(unroll(problem, repetend, 40 * repetend.copies))
    assert timeline.peak_memory == pytest.approx(steady_state_peak(ip, repetend))
    if limit is not None:
        assert max(timeline.peak_memory) <= limit


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "vshape"])
def test_period_reaches_the_work_bound_on_the_linear_placement_with_unbounded_memory(name: str) -> None:
    problem = replace(PROBLEMS[name](), memory_limit=None)
    result = solve_periodic(problem, 64, time_limit=5.0)
    assert result.period == pytest.approx(result.period_lower_bound)
    assert result.period_lower_bound == max(problem.work_per_microbatch())
    assert result.mode == "periodic"
    assert result.lower_bound == lower_bound(problem, 64)
    assert (result.status == "optimal") == (result.makespan == pytest.approx(result.lower_bound))


def test_result_simulates_to_its_makespan_and_respects_the_limit() -> None:
    problem = mllm(4)
    result = solve_periodic(problem, 128, memory_limit=6, time_limit=5.0)
    timeline = validate(result.schedule, ordered=True)
    assert timeline.makespan == result.makespan
    assert timeline.peak_memory == result.peak_memory
    assert max(result.peak_memory) <= 6
    assert result.makespan >= result.lower_bound
    assert result.period >= result.period_lower_bound


def test_memory_limit_raises_the_period_of_a_long_chain() -> None:
    """8 ranks need 8 micro-batches in flight on rank 0 at the work bound; 6 cannot reach it."""
    free = solve_periodic(chain(8), 64, time_limit=5.0)
    tight = solve_periodic(chain(8), 64, memory_limit=6, time_limit=5.0)
    assert free.period == 4
    assert tight.period > 4
    assert max(tight.peak_memory) <= 6


def test_infeasible_limit_names_the_smallest_limit_known_to_work() -> None:
    with pytest.raises(SearchError, match=r"memory limit 0\.5 .*smallest limit known to work is 1\b"):
        solve_periodic(chain(4), 16, memory_limit=0.5, time_limit=5.0)


def test_static_memory_counts_against_the_limit() -> None:
    problem = replace(chain(4), static_memory=(2.0, 0.0, 0.0, 0.0))
    result = solve_periodic(problem, 32, memory_limit=4, time_limit=5.0)
    assert result.peak_memory[0] <= 4
    with pytest.raises(SearchError, match="smallest limit known to work is 3"):
        solve_periodic(problem, 32, memory_limit=2.5, time_limit=5.0)


def test_large_real_durations_are_searched_on_a_coarse_grid_and_re_simulated_exactly() -> None:
    costs = Costs(f=18522, b=18086, w=9337, comm=601)
    problem = build_schedule("zb-h1", 4, 8, costs=costs).problem
    assert coarsen(to_integers(problem)).time_scale < 1
    result = solve_periodic(problem, 64, memory_limit=4, time_limit=5.0)
    timeline = validate(result.schedule, ordered=True)
    assert timeline.makespan == result.makespan
    assert max(result.peak_memory) <= 4
    assert result.period >= result.period_lower_bound - 1e-6


def test_progress_reports_real_units() -> None:
    seen: list[SearchProgress] = []
    solve_periodic(chain(4, f=0.5, b=1.5), 16, memory_limit=6, time_limit=5.0, progress=seen.append)
    assert seen
    assert all(report.best is not None and report.best >= report.bound - 1e-9 for report in seen)
    assert min(report.best for report in seen) == pytest.approx(2.0)


def test_bad_microbatch_count_is_rejected() -> None:
    with pytest.raises(SearchError, match="positive integer"):
        solve_periodic(chain(2), 0)


def test_reported_bounds_use_the_memory_limit_argument() -> None:
    """8-rank vshape, limit 6: rank 0 holds F0's activation from F0's start until B0 ends, at least
    1 + 7 + 7*3 + 3 = 32 time units per micro-batch, so 6 units of memory admit one micro-batch per
    32/6 at best (work alone: 4). The release chain: F0 of micro-batch k + 6 waits for a B0 that
    ended >= 32 after the k-th F0, so the 64th F0 starts >= 10 * 32 + 3 and its B0 ends 32 later."""
    problem = placement("vshape", 8)  # no limit of its own: the argument must be used
    result = solve_periodic(problem, 64, memory_limit=6, time_limit=3.0)
    assert result.period_lower_bound == pytest.approx(32 / 6)
    assert result.lower_bound == lower_bound(problem, 64, memory_limit=6) == pytest.approx(10 * 32 + 3 + 32)
    assert result.lower_bound > lower_bound(problem, 64)
    assert result.makespan >= result.lower_bound
    assert result.period >= result.period_lower_bound - 1e-9
    assert max(result.peak_memory) <= 6


def test_the_period_lower_bound_is_the_models_least_period() -> None:
    """In solver units (integer here: scale 1) T >= ceil(R * 32/6) for R copies."""
    ip = to_integers(placement("vshape", 8, memory_limit=6))
    assert solver_period_bound(ip, ip.limits) == pytest.approx(32 / 6)
    assert solver_period_bound(ip, (None,) * 8) == 4  # unlimited: the work per micro-batch
    for copies in (1, 2, 3):
        assert RepetendModel(ip, copies=copies, limits=ip.limits).period_low == math.ceil(copies * 32 / 6)


@pytest.mark.parametrize("name", ["vshape", "xshape", "mshape", "kshape", "finetune", "alphafold"])
@pytest.mark.parametrize("limit", [3.0, 6.0])
def test_results_never_beat_the_memory_aware_bounds(name: str, limit: float) -> None:
    problem = placement(name, 4, memory_limit=limit)
    try:
        result = solve_periodic(problem, 32, time_limit=1.0)
    except SearchError:
        pytest.skip("limit below every schedule of this placement")
    timeline = validate(result.schedule, ordered=True)
    assert max(timeline.peak_memory) <= limit
    assert result.lower_bound == lower_bound(problem, 32, memory_limit=limit)
    assert result.makespan >= result.lower_bound - 1e-9
    assert result.period_lower_bound == period_lower_bound(problem, memory_limit=limit)
    assert (result.status == "optimal") == (result.makespan <= result.lower_bound + 1e-9)


def growing() -> Problem:
    """Rank 0 keeps 1 unit per micro-batch (F0 +2, B0 -1): its memory never returns to 0, so the
    steady state cannot bound it; rank 1 is balanced. Chain F0 -> F1 -> B1 -> B0, all span 1."""
    return Problem(num_ranks=2, tasks=(
        Task(stage=0, kind="F", ranks=(0,), duration=1, memory=2),
        Task(stage=1, kind="F", ranks=(1,), duration=1, memory=1, deps=((0, "F"),)),
        Task(stage=1, kind="B", ranks=(1,), duration=1, memory=-1, deps=((1, "F"),)),
        Task(stage=0, kind="B", ranks=(0,), duration=1, memory=-1, deps=((1, "B"),)),
    ))


@pytest.mark.parametrize(("num_microbatches", "mode"), [(4, "exact"), (128, "periodic")])
def test_unrolled_schedule_over_the_limit_falls_back_to_a_valid_schedule(num_microbatches: int, mode: str) -> None:
    """At period 2 rank 0 runs F0 twice before its first B0 and peaks at M + 2; one micro-batch
    at a time peaks at M + 1 (the limit). Small problems fall back to exact mode, large ones to
    the list schedule."""
    limit = num_microbatches + 1.0
    problem = replace(growing(), memory_limit=limit)
    repetend = solve_repetend(to_integers(problem), time_limit=2.0)
    with pytest.raises(MemoryLimitError):  # the case this test is about
        validate(unroll(problem, repetend, num_microbatches), ordered=True)
    result = solve_periodic(problem, num_microbatches, time_limit=2.0)
    timeline = validate(result.schedule, ordered=True)
    assert result.mode == mode
    assert max(timeline.peak_memory) <= limit
    assert timeline.makespan == result.makespan
    assert result.lower_bound >= lower_bound(problem, num_microbatches)
    assert result.makespan >= result.lower_bound
    assert (result.status == "optimal") == (result.makespan <= result.lower_bound + 1e-9)


def test_fallback_that_also_fails_still_raises() -> None:
    """Limit M: rank 0 holds M + 1 when the last F0 adds 2, so nothing fits; no repetend limit is
    named, since the repetend model does not bound rank 0, but the list schedule's, running rank 0's
    micro-batches one after another (3 left held, then one micro-batch's peak of 2), is."""
    with pytest.raises(SearchError, match="nor does the list schedule") as error:
        solve_periodic(growing(), 4, memory_limit=4, time_limit=2.0)
    assert "smallest limit known to work is 5 (the list schedule meets it)" in str(error.value)
    assert "a periodic schedule" not in str(error.value)
