"""Tests of pipeloom.search.greedy: valid, limit-respecting list schedules for any problem.

Oracles: the validator (ordered mode) and simulator; the built-in schedules' problems and memory
peaks; closed forms (unbounded 1F1B placement: (m + p - 1)(f + b + w)); for the per-micro-batch
memory, every dependency-closed task set enumerated by brute force.
"""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeloom.problem import Problem, Task
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.search.errors import SearchError
from pipeloom.search.greedy import list_schedule, microbatch_peak_memory
from pipeloom.sim import simulate
from pipeloom.stages import Stage, stage_graph
from pipeloom.validate import validate

# (name, ranks, micro-batches) for every registry entry, at sizes each one accepts.
BUILTINS = [(name, p, 8) for name in REGISTRY for p in (2, 4)]


def check(schedule, limit):
    timeline = validate(schedule, ordered=True)
    if limit is not None:
        assert max(timeline.peak_memory) <= limit + 1e-9
    return timeline


@pytest.mark.parametrize(("name", "p", "m"), BUILTINS)
def test_builtin_problems_at_their_peak_and_at_the_minimum(name, p, m):
    builtin = build_schedule(name, p, m)
    problem = builtin.problem
    minimum = max(microbatch_peak_memory(problem))
    for limit in (None, max(simulate(builtin).peak_memory), minimum):
        check(list_schedule(problem, m, memory_limit=limit), limit)


@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 8)])
def test_unbounded_linear_placement_reaches_the_1f1b_makespan(p, m):
    problem = build_schedule("1f1b", p, m).problem
    assert check(list_schedule(problem, m), None).makespan == (m + p - 1) * 3


def test_limit_below_one_microbatch_names_the_minimum():
    v = stage_graph([Stage(ranks=r) for r in (0, 1, 1, 0)])  # rank 0 holds both forwards of the V
    assert microbatch_peak_memory(v) == (2.0, 2.0)
    with pytest.raises(SearchError, match="at least 2"):
        list_schedule(v, 4, memory_limit=1.5)
    schedule = list_schedule(v, 4, memory_limit=2.0, name="v")
    assert schedule.name == "v" and schedule.problem.memory_limit == 2.0
    check(schedule, 2.0)


def test_static_memory_counts_towards_the_limit():
    problem = stage_graph([Stage(ranks=0), Stage(ranks=1)], static_memory=(1.5, 0.0))
    with pytest.raises(SearchError, match="at least 2.5"):
        list_schedule(problem, 2, memory_limit=2.0)
    check(list_schedule(problem, 2, memory_limit=2.5), 2.5)


def test_memory_that_grows_every_microbatch_is_reported():
    leak = Problem(num_ranks=1, tasks=(Task(stage=0, kind="F", ranks=(0,), duration=1, memory=1),))
    with pytest.raises(SearchError, match="each micro-batch leaves 1"):
        list_schedule(leak, 3, memory_limit=2.0)


@st.composite
def random_problems(draw):
    """DAGs of 1-6 tasks on 1-3 ranks (some tasks on several), any kinds of memory change."""
    num_ranks = draw(st.integers(1, 3))
    tasks = []
    for i in range(draw(st.integers(1, 6))):
        ranks = tuple(sorted(draw(st.sets(st.integers(0, num_ranks - 1), min_size=1, max_size=2))))
        deps = tuple((j, "F") for j in range(i) if draw(st.booleans()))
        tasks.append(Task(stage=i, kind="F", ranks=ranks, duration=draw(st.sampled_from([0, 0.5, 1, 2, 3])),
                          memory=draw(st.sampled_from([-2, -1, 0, 1, 1.5, 2])), deps=deps))
    return Problem(num_ranks=num_ranks, tasks=tuple(tasks), comm_latency=draw(st.sampled_from([0, 0.25, 1])))


def closed_set_peaks(problem: Problem) -> tuple[float, ...]:
    """Per rank, the largest memory sum over every dependency-closed set of tasks (brute force)."""
    keys = [task.key for task in problem.tasks]
    best = [0.0] * problem.num_ranks
    for size in range(1, len(keys) + 1):
        for chosen in map(set, combinations(keys, size)):
            if all(dep in chosen for key in chosen for dep in problem.task(key).deps):
                for r in range(problem.num_ranks):
                    held = sum(problem.task(k).memory for k in chosen if r in problem.task(k).ranks)
                    best[r] = max(best[r], held)
    return tuple(best)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=random_problems(), m=st.integers(1, 5), slack=st.sampled_from([None, 0.0, 0.5, 3.0]))
def test_random_dags_give_valid_schedules_within_the_limit(problem, m, slack):
    peaks = microbatch_peak_memory(problem)
    assert peaks == pytest.approx(closed_set_peaks(problem))
    limit = None if slack is None else max(peaks) + slack
    grows = any(sum(t.memory for t in problem.tasks_on(r)) > 0 for r in range(problem.num_ranks))
    try:
        schedule = list_schedule(problem, m, memory_limit=limit)
    except SearchError:
        assert limit is not None and grows  # only a per-micro-batch leak can stop it
        return
    check(schedule, limit)
