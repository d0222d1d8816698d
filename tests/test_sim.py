"""Tests of pipeloom.sim against hand-computed timelines and a naive reference simulator.

Oracles: start/end/memory values worked out on paper from docs/design.md §3, and (hypothesis) a slow
"run any rank whose head can start" replay written here from the same rules.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeloom.errors import DeadlockError, ScheduleError
from pipeloom.ir import Action, Schedule
from pipeloom.plan.noise import expected_makespan, starting_ranks
from pipeloom.problem import Problem, Task
from pipeloom.sim import simulate
from pipeloom.stages import Stage, stage_graph


def _schedule(problem: Problem, rows: list[str], num_mb: int = 1) -> Schedule:
    ranks = [[Action.parse(a) for a in row.split()] for row in rows]
    return Schedule(name="hand", problem=problem, num_microbatches=num_mb, ranks=ranks)


def _two_stage_chain(comm: float) -> Problem:
    # F0 1, F1 2, B1 3, B0 4 (b + w), memory 2 / 5 per stage.
    return stage_graph(
        [Stage(ranks=0, f=1, b=3, w=1, memory=2), Stage(ranks=1, f=2, b=2, w=1, memory=5)],
        comm_latency=comm,
    )


def test_chain_with_comm_latency_by_hand():
    timeline = simulate(_schedule(_two_stage_chain(0.5), ["0F0 0B0", "1F0 1B0"]))
    # 0F0 [0, 1]; 1F0 waits 1 + 0.5 -> [1.5, 3.5]; 1B0 same rank, no latency -> [3.5, 6.5];
    # 0B0 waits 6.5 + 0.5 -> [7, 11].
    assert timeline.starts == ((0.0, 7.0), (1.5, 3.5))
    assert timeline.ends == ((1.0, 11.0), (3.5, 6.5))
    assert timeline.makespan == 11.0
    assert timeline.busy == (5.0, 5.0)
    assert timeline.bubble_ratio == pytest.approx(1 - 10 / 22)
    # Memory changes when an action starts: +2 then -2 on rank 0, +5 then -5 on rank 1.
    assert timeline.memory == ((2.0, 0.0), (5.0, 0.0))
    assert timeline.peak_memory == (2.0, 5.0)
    assert timeline.memory_curve(1) == [(0.0, 0.0), (1.5, 5.0), (3.5, 0.0)]


def _simulate(problem: Problem, rows: list[str], num_mb: int = 1):
    return simulate(_schedule(problem, rows, num_mb))


def test_rank_runs_in_order_and_waits_for_its_own_previous_action():
    timeline = _simulate(_two_stage_chain(0.0), ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"], num_mb=2)
    # rank 0: F0 [0,1] F1 [1,2]; rank 1: F0 [1,3] F1 [3,5] B0 [5,8] B1 [8,11];
    # rank 0: B0 waits 8 -> [8,12], B1 waits 11 and 12 -> [12,16].
    assert timeline.starts == ((0, 1, 8, 12), (1, 3, 5, 8))
    assert timeline.makespan == 16
    assert timeline.memory == ((2, 4, 2, 0), (5, 10, 5, 0))
    assert timeline.peak_memory == (4, 10)


def test_comm_latency_only_between_different_rank_sets():
    # A on {0,1}; B on {1,0} (same set, listed in another order) -> no latency;
    # C on {0} only -> latency 10 after B.
    problem = Problem(num_ranks=2, comm_latency=10.0, tasks=(
        Task(stage=0, kind="F", ranks=(0, 1), duration=1),
        Task(stage=1, kind="F", ranks=(1, 0), duration=1, deps=((0, "F"),)),
        Task(stage=2, kind="F", ranks=(0,), duration=1, deps=((1, "F"),)),
    ))
    timeline = _simulate(problem, ["0F0 1F0 2F0", "0F0 1F0"])
    assert timeline.starts == ((0.0, 1.0, 12.0), (0.0, 1.0))
    assert timeline.makespan == 13.0


def test_multi_rank_task_waits_for_all_its_ranks():
    # Rank 1 is busy with a 5-long task first; the joint task starts at 5 on both ranks.
    problem = Problem(num_ranks=2, tasks=(
        Task(stage=0, kind="F", ranks=(1,), duration=5),
        Task(stage=1, kind="F", ranks=(0, 1), duration=2),
        Task(stage=2, kind="F", ranks=(0,), duration=1),
    ))
    timeline = _simulate(problem, ["1F0 2F0", "0F0 1F0"])
    assert timeline.starts == ((5.0, 7.0), (0.0, 5.0))
    assert timeline.ends == ((7.0, 8.0), (5.0, 7.0))
    assert timeline.busy == (3.0, 7.0)
    assert timeline.bubble_ratio == pytest.approx(1 - 10 / 16)
    assert timeline.action_times()[Action(1, "F", 0)] == (5.0, 7.0)
    assert list(timeline.events(0)) == [(Action(1, "F", 0), 5.0, 7.0), (Action(2, "F", 0), 7.0, 8.0)]


def test_multi_rank_task_started_by_the_rank_that_is_free_first():
    # Rank 1 (replayed first) reaches the joint task at 5 and waits for rank 0, which gets
    # there at 1 after a short task: the joint task must still start at 5, not at 1.
    problem = Problem(num_ranks=2, tasks=(
        Task(stage=0, kind="F", ranks=(1,), duration=5),
        Task(stage=1, kind="F", ranks=(0,), duration=1),
        Task(stage=2, kind="F", ranks=(0, 1), duration=2),
    ))
    timeline = _simulate(problem, ["1F0 2F0", "0F0 2F0"])
    assert timeline.starts == ((0.0, 5.0), (0.0, 5.0))
    assert timeline.ends == ((1.0, 7.0), (5.0, 7.0))


def test_static_memory_is_the_baseline_of_every_curve():
    problem = stage_graph([Stage(ranks=0, memory=3), Stage(ranks=1, memory=1)],
                          static_memory=[10, 0.5])
    timeline = _simulate(problem, ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"], num_mb=2)
    assert timeline.memory == ((13, 16, 13, 10), (1.5, 0.5, 1.5, 0.5))
    assert timeline.peak_memory == (16, 1.5)
    assert timeline.memory_curve(0)[0] == (0.0, 10)


def test_negative_static_peak_is_the_static_value_and_empty_rank_is_idle():
    problem = Problem(num_ranks=2, static_memory=(4.0, 2.0),
                      tasks=(Task(stage=0, kind="B", ranks=(0,), duration=0, memory=-1),))
    timeline = _simulate(problem, ["0B0", ""])
    assert timeline.peak_memory == (4.0, 2.0)
    assert timeline.makespan == 0.0 and timeline.bubble_ratio == 0.0
    assert timeline.starts == ((0.0,), ())


def test_bubble_ratio_formula():
    timeline = _simulate(_two_stage_chain(0.0), ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"], num_mb=2)
    assert timeline.busy == (10, 10)
    assert timeline.bubble_ratio == pytest.approx(1 - 20 / (2 * 16))


# ------------------------------------------------------------------------------------- deadlock


def test_deadlock_names_rank_action_and_marks_the_grid():
    # Rank 0 runs its backward before its forward: 0B0 waits for 1B0, which waits for 1F0 <- 0F0.
    schedule = _schedule(_two_stage_chain(0.0), ["0B0 0F0", "1F0 1B0"])
    with pytest.raises(DeadlockError) as caught:
        simulate(schedule)
    message = str(caught.value)
    assert "deadlock in schedule 'hand'" in message
    assert "rank 0 step 0: 0B0 waits for 0F0, 1B0, which never runs first" in message
    assert "rank 1 step 0: 1F0 waits for 0F0" in message
    assert ">0B0<" in message and "<-- here" in message


def test_deadlock_of_multi_rank_tasks_in_opposite_orders():
    problem = Problem(num_ranks=2, tasks=(
        Task(stage=0, kind="F", ranks=(0, 1), duration=1),
        Task(stage=1, kind="F", ranks=(0, 1), duration=1),
    ))
    with pytest.raises(DeadlockError, match="rank 0 step 0: 0F0 waits for ranks 1 to reach it too"):
        _simulate(problem, ["0F0 1F0", "1F0 0F0"])


def test_simulate_rejects_foreign_actions_with_a_pointer_to_the_validator():
    with pytest.raises(ScheduleError, match="rank 1 step 1: 1W0 is not a task.*validator"):
        _simulate(_two_stage_chain(0.0), ["0F0 0B0", "1F0 1W0"])
    with pytest.raises(ScheduleError, match="rank 0 step 0: 0F3"):
        _simulate(_two_stage_chain(0.0), ["0F3 0B0", "1F0 1B0"])


# ---------------------------------------------------------------------- huge micro-batch counts


@pytest.mark.timeout(20)
def test_simulate_allocates_by_actions_not_by_microbatch_count():
    """Oracle: the same lists replay alike with M = 3 and M = 10**12 (micro-batch 1 never runs)."""
    problem = _two_stage_chain(0.5)
    rows = ["0F0 0F2 0B0 0B2", "1F0 1B0 1F2 1B2"]
    small, huge = _simulate(problem, rows, num_mb=3), _simulate(problem, rows, num_mb=10**12)
    assert (huge.starts, huge.ends, huge.memory, huge.makespan) == (
        small.starts, small.ends, small.memory, small.makespan)


@pytest.mark.timeout(20)
def test_deadlock_message_with_a_huge_microbatch_count_names_the_real_microbatch():
    schedule = _schedule(_two_stage_chain(0.0), ["0F0 0B0 0B999999999999", "1F0 1B0"], num_mb=10**12)
    with pytest.raises(DeadlockError, match="0B999999999999 waits for 0F999999999999, 1B999999999999"):
        simulate(schedule)


# ------------------------------------------------------------------------ reference simulator


def _reference(schedule: Schedule):
    """Naive replay: repeatedly start any action whose ranks all have it at their head."""
    problem = schedule.problem
    pos = [0] * problem.num_ranks
    free = [0.0] * problem.num_ranks
    finish: dict[Action, float] = {}
    starts = [[None] * len(row) for row in schedule.ranks]
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(schedule.ranks):
            if pos[r] >= len(row):
                continue
            action = row[pos[r]]
            task = problem.task(action.task)
            heads_agree = all(pos[q] < len(schedule.ranks[q]) and schedule.ranks[q][pos[q]] == action
                              for q in task.ranks)
            deps = [Action(s, k, action.microbatch) for s, k in task.deps]
            if not heads_agree or any(d not in finish for d in deps):
                continue
            start = max([free[q] for q in task.ranks] + [
                finish[d] + (0 if set(problem.task(d.task).ranks) == set(task.ranks)
                             else problem.comm_latency)
                for d in deps
            ])
            finish[action] = start + task.duration
            for q in task.ranks:
                starts[q][pos[q]] = start
                free[q] = finish[action]
                pos[q] += 1
            progress = True
    done = all(pos[r] == len(row) for r, row in enumerate(schedule.ranks))
    return done, starts, max(finish.values(), default=0.0)


@st.composite
def random_schedules(draw) -> Schedule:
    """Random multi-rank task DAGs, each rank's list a random order (valid or not)."""
    num_ranks = draw(st.integers(1, 4))
    tasks: list[Task] = []
    for i in range(draw(st.integers(1, 5))):
        deps = draw(st.sets(st.sampled_from([t.key for t in tasks]), max_size=2)) if tasks else set()
        tasks.append(Task(
            stage=i, kind="F", ranks=tuple(sorted(draw(st.sets(st.integers(0, num_ranks - 1), min_size=1)))),
            duration=draw(st.sampled_from([0, 0.5, 1, 2, 3])), memory=draw(st.integers(-2, 2)),
            deps=tuple(deps),
        ))
    problem = Problem(num_ranks=num_ranks, tasks=tuple(tasks),
                      comm_latency=draw(st.sampled_from([0, 0.25, 1])))
    num_mb = draw(st.integers(1, 3))
    rows = []
    for r in range(num_ranks):
        own = [Action(t.stage, t.kind, mb) for t in problem.tasks_on(r) for mb in range(num_mb)]
        rows.append(draw(st.permutations(own)))
    return Schedule(name="random", problem=problem, num_microbatches=num_mb, ranks=rows)


@settings(max_examples=150, deadline=None)
@given(random_schedules())
def test_simulate_agrees_with_the_naive_reference(schedule):
    done, starts, makespan = _reference(schedule)
    if not done:
        with pytest.raises(DeadlockError):
            simulate(schedule)
        return
    timeline = simulate(schedule)
    assert timeline.makespan == pytest.approx(makespan)
    for r, row in enumerate(schedule.ranks):
        assert list(timeline.starts[r]) == pytest.approx(starts[r])
        durations = [schedule.problem.task(a.task).duration for a in row]
        assert list(timeline.ends[r]) == pytest.approx([s + d for s, d in zip(starts[r], durations)])
        assert timeline.busy[r] == pytest.approx(sum(durations))


# ------------------------------------------------------------------------------- compiled once, repriced


def _priced_anew(schedule: Schedule, seed: int, **fields) -> Schedule:
    """``schedule`` with random durations, communication inside them, memory and latency (and ``fields``)."""
    import random

    draw = random.Random(seed)
    tasks = tuple(dataclasses.replace(task, duration=0.2 + draw.random(), comm=0.2 * draw.random(),
                                      memory=task.memory * draw.random()) for task in schedule.problem.tasks)
    problem = dataclasses.replace(schedule.problem, tasks=tasks, comm_latency=0.1 * draw.random(), **fields)
    return dataclasses.replace(schedule, problem=problem)


@pytest.mark.parametrize(("name", "ranks", "options"), [
    ("dualpipe", 4, {}), ("dualpipev", 4, {}), ("zbv", 4, {}), ("zb-h1", 4, {}), ("1f1b", 4, {}),
    ("interleaved-1f1b", 2, {"stages_per_rank": 2}),
])
@pytest.mark.parametrize("fields", [{}, {"overlap_fraction": 0.5, "overlap_overhead": 0.05}, {"pair_time": 1.5}])
def test_a_compiled_schedule_repriced_replays_as_one_compiled_anew(name, ranks, options, fields):
    """Compiling once and replaying with other costs (the cluster planner's way: one compilation per schedule,
    many layouts) gives the very timeline a fresh compilation does, pairs' pricing included."""
    from pipeloom.schedules import build_schedule
    from pipeloom.sim import compile_schedule
    from pipeloom.stages import Costs

    built = build_schedule(name, ranks, 2 * ranks, costs=Costs(f=1, b=1.5, w=0.5, memory=1, w_memory=0.3), **options)
    compiled = compile_schedule(built)
    for seed in range(3):
        schedule = _priced_anew(built, seed, **fields)
        assert simulate(schedule, compiled=compiled) == simulate(schedule)


def test_a_compiled_schedule_refuses_other_lists_or_tasks():
    from pipeloom.schedules import build_schedule
    from pipeloom.sim import compile_schedule

    compiled = compile_schedule(build_schedule("1f1b", 4, 8))
    with pytest.raises(ScheduleError, match="lists or its tasks differ"):
        simulate(build_schedule("1f1b", 4, 12), compiled=compiled)
    with pytest.raises(ScheduleError, match="lists or its tasks differ"):
        simulate(build_schedule("gpipe", 4, 8), compiled=compiled)
    other = build_schedule("1f1b", 4, 8)
    moved = dataclasses.replace(other.problem, tasks=tuple(dataclasses.replace(task, deps=())
                                                           for task in other.problem.tasks))
    with pytest.raises(ScheduleError, match="lists or its tasks differ"):
        simulate(dataclasses.replace(other, problem=moved), compiled=compiled)


def _renumbered(schedule: Schedule, number) -> Schedule:
    """``schedule`` with micro-batch ``k`` of every action (each part of a pair) numbered ``number(k)``."""
    from pipeloom.ir import Overlap

    def moved(action):
        if type(action) is Overlap:
            return Overlap(moved(action.forward), moved(action.backward))
        return action._replace(microbatch=number(action.microbatch))

    top = max(number(k) for k in range(schedule.num_microbatches)) + 1
    ranks = [[moved(a) for a in row] for row in schedule.ranks]
    return dataclasses.replace(schedule, num_microbatches=top, ranks=ranks)


def _pairs_of_two_offsets() -> Schedule:
    """Two ranks, stage 0's list pairing forwards with backwards three micro-batches back, then two back
    (``(0F3;0B0)``, ``(0F7;0B5)``); stage 1 runs 1F1B."""
    from pipeloom.ir import Overlap

    def parsed(text: str) -> list:
        return [Overlap(*map(Action.parse, word.split(";"))) if ";" in word else Action.parse(word)
                for word in text.split()]

    problem = stage_graph([Stage(ranks=0, f=1, b=2, memory=1), Stage(ranks=1, f=1.5, b=2.5, memory=1)],
                          comm_latency=0.25)
    ranks = [parsed("0F0 0F1 0F2 0F3;0B0 0F4 0B1 0F5 0B2 0F6 0B3 0B4 0F7;0B5 0B6 0B7"),
             parsed(" ".join(f"1F{k} 1B{k}" for k in range(8)))]
    return Schedule(name="hand", problem=problem, num_microbatches=8, ranks=ranks)


@pytest.mark.parametrize("name", ["hand", "dualpipe", "dualpipev", "zb-h1"])
def test_pairs_replay_alike_whatever_the_microbatch_numbers(name):
    """Oracle: renumbering the micro-batches (those from 6 on numbered one up: the lists leave number 6 unused,
    so the replay numbers them densely) changes no start, end or memory of a schedule of overlapped pairs or full
    backwards on split stages. In the hand schedule ``(0F3;0B0)`` and ``(0F7;0B5)``, renumbered ``(0F8;0B5)``,
    are then both three micro-batches apart as written and not in the replay's numbers, so no one template of
    the pair can stand for both (the replay then keeps one per action)."""
    from pipeloom.schedules import build_schedule
    from pipeloom.stages import Costs

    if name == "hand":
        schedule = _pairs_of_two_offsets()
    else:
        built = build_schedule(name, 4, 8, costs=Costs(f=1, b=1.5, w=0.5, memory=1, w_memory=0.3))
        schedule = _priced_anew(built, 0, overlap_fraction=0.3)
    sparse = simulate(_renumbered(schedule, lambda k: k + (k >= 6)))
    dense = simulate(schedule)
    assert (sparse.starts, sparse.ends, sparse.memory, sparse.makespan) == (
        dense.starts, dense.ends, dense.memory, dense.makespan)


def test_a_multi_rank_action_beside_a_pair_joins_its_ranks():
    """Oracle: the same lists with ``1F1`` and ``1B0`` run as a pair replay (the pair apart) as the lists without it
    do; a multi-rank task in a list that held a pair had been compiled as a one-part composite, which never waits
    for its other rank, and the replay reported a deadlock."""
    from pipeloom.ir import Overlap

    problem = stage_graph([Stage(ranks=(0, 1), f=1, b=2, memory=1), Stage(ranks=1, f=1.5, b=2.5, memory=1)])
    plain = ["0F0 0F1 0B0 0B1", "0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1"]
    rows = [[Action.parse(word) for word in row.split()] for row in plain]
    paired = [rows[0], [*rows[1][:3], Overlap(rows[1][3], rows[1][4]), *rows[1][5:]]]
    alone, together = simulate(_schedule(problem, plain, num_mb=2)), simulate(
        Schedule(name="hand", problem=problem, num_microbatches=2, ranks=paired))
    assert together.starts[0] == alone.starts[0] and together.ends[0] == alone.ends[0]
    assert together.makespan == alone.makespan  # the pair (1F1; 1B0) takes F + B, as the two did one after the other


@pytest.mark.parametrize("number", [lambda k: k, lambda k: k + (k >= 6)], ids=["every", "sparse"])
def test_a_pairs_action_scale_is_its_parts_factors(number):
    """Oracle: a composite action's factor is its parts' own factors applied to its duration
    (:meth:`Composite.scaled` on the action as written), whichever micro-batch each part is of."""
    from pipeloom.schedules import build_schedule
    from pipeloom.sim import compile_schedule
    from pipeloom.sim_pricing import Pricing, composite_of
    from pipeloom.stages import Costs

    schedule = _renumbered(_priced_anew(build_schedule("dualpipev", 4, 8, costs=Costs(f=1, b=1.5, w=0.5)), 1),
                           number)
    compiled = compile_schedule(schedule)
    num_mb = compiled.num_slots
    factors = [1 + (7 * i % 11) / 10 for i in range(len(compiled.index) * num_mb)]
    scales = compiled.action_scales(factors)
    pricing = Pricing.of(schedule.problem, schedule.problem.overlap_overhead)
    checked = 0
    for row, row_scales in zip(schedule.ranks, scales):
        for action, scale in zip(row, row_scales):
            composite = composite_of(schedule.problem, compiled.index, action)
            if composite is None or (type(action) is Action and len(composite.units[0]) == 1):
                continue
            price = pricing.price(composite.shape)
            want = composite.scaled(price, pricing.durations,
                                    lambda task, mb: factors[task * num_mb + compiled.dense[mb]]) / price.duration
            assert scale == pytest.approx(want, rel=1e-12)
            checked += 1
    assert checked > 8


# ------------------------------------------------------------------------------- expected_makespan


def _busy_pipeline() -> Schedule:
    from pipeloom.schedules import build_schedule

    return build_schedule("1f1b", 4, 8)


def test_expected_makespan_without_spread_is_the_simulated_one():
    schedule = _busy_pipeline()
    assert expected_makespan(schedule, 0.0) == simulate(schedule).makespan
    assert expected_makespan(schedule, [0.0] * schedule.problem.num_stages) == simulate(schedule).makespan


def test_expected_makespan_is_reproducible_and_grows_with_the_spread():
    schedule = _busy_pipeline()
    plain = simulate(schedule).makespan
    small, large = expected_makespan(schedule, 0.1), expected_makespan(schedule, 0.4)
    assert expected_makespan(schedule, 0.4) == large  # seeded
    assert expected_makespan(schedule, 0.4, seed=1) != large
    # waiting for the later of two paths costs time on average: the mean step is longer
    assert plain < small < large


def test_expected_makespan_of_one_rank_is_the_sum_of_its_actions():
    # no waiting on another path: the mean of a sum of mean-1 factors stays close to the plain sum
    problem = stage_graph([Stage(ranks=0, f=1.0, b=2.0)], num_ranks=1)
    schedule = _schedule(problem, ["0F0 0F1 0B0 0B1"], num_mb=2)
    assert expected_makespan(schedule, 0.2, samples=2000) == pytest.approx(simulate(schedule).makespan, rel=0.02)


def test_expected_makespan_factors_have_mean_one():
    # one action: the mean makespan is the mean factor times the duration (a mean-1 lognormal)
    schedule = _schedule(stage_graph([Stage(ranks=0, f=1.0, b=0.0)], num_ranks=1, backward="none"), ["0F0"])
    assert expected_makespan(schedule, 0.3, samples=20000) == pytest.approx(1.0, rel=0.01)


def test_expected_makespan_draws_per_action_not_per_position():
    # one rank: the makespan is the sum of its actions whatever their order; the same (task,
    # micro-batch) draws give the same sum to both orders
    problem = stage_graph([Stage(ranks=0, f=1.0, b=2.0)], num_ranks=1)
    first = _schedule(problem, ["0F0 0F1 0B0 0B1"], num_mb=2)
    second = _schedule(problem, ["0F0 0B0 0F1 0B1"], num_mb=2)
    assert expected_makespan(first, 0.3, samples=8) == pytest.approx(expected_makespan(second, 0.3, samples=8),
                                                                       rel=1e-12)


def test_expected_makespan_spread_per_stage():
    schedule = _busy_pipeline()
    only_last = [0.0, 0.0, 0.0, 0.5]
    assert simulate(schedule).makespan < expected_makespan(schedule, only_last) < expected_makespan(schedule, 0.5)


def test_starting_ranks_are_those_whose_first_action_needs_nothing():
    from pipeloom.schedules import build_schedule

    assert starting_ranks(build_schedule("1f1b", 4, 8)) == [0]
    assert starting_ranks(build_schedule("chimera", 4, 8)) == [0, 3]  # each replica's first stage
    assert starting_ranks(build_schedule("dualpipev", 4, 8)) == [0]  # both directions start on rank 0


def test_start_skew_delays_one_of_two_ranks_that_start_at_once():
    from pipeloom.schedules import build_schedule

    chimera = build_schedule("chimera", 2, 2)  # symmetric: the later rank's first forward holds up both
    plain = simulate(chimera).makespan
    skewed = expected_makespan(chimera, 0.0, start_skew=0.5, samples=4000)
    # exponential delays of mean 0.5 on both ranks: the later one starts 0.5 after the other on average
    assert skewed == pytest.approx(plain + 0.5, rel=0.01)
    assert expected_makespan(chimera, 0.0, start_skew=0.5, samples=50) == \
        expected_makespan(chimera, 0.0, start_skew=0.5, samples=50)  # seeded
    one_start = _busy_pipeline()  # one starting rank: nothing to skew
    assert expected_makespan(one_start, 0.0, start_skew=5.0) == simulate(one_start).makespan
    assert expected_makespan(one_start, 0.2, start_skew=5.0) == expected_makespan(one_start, 0.2)
    assert expected_makespan(chimera, 0.2, start_skew=0.5) > expected_makespan(chimera, 0.2)


@pytest.mark.parametrize("skew", [-1.0, float("inf"), True])
def test_expected_makespan_refuses_a_bad_start_skew(skew):
    with pytest.raises(ValueError, match="start_skew must be a finite number of seconds >= 0"):
        expected_makespan(_busy_pipeline(), 0.1, start_skew=skew)


@pytest.mark.parametrize(("spread", "samples", "words"), [
    (-0.1, 8, "finite number >= 0"), (float("nan"), 8, "finite number >= 0"), ([0.1], 8, "one per stage \\(4\\)"),
    (0.1, 0, "positive integer"),
])
def test_expected_makespan_refuses_bad_arguments(spread, samples, words):
    with pytest.raises(ValueError, match=words):
        expected_makespan(_busy_pipeline(), spread, samples=samples)
