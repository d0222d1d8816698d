"""Tests of pipeloom.validate: one test per corruption kind, then hypothesis corruption properties.

Oracles: hand-corrupted 1F1B/GPipe lists whose error must name the action, rank and step and show
the marked grid; and the property that ANY corruption of a valid schedule (registry schedules and
topological-order schedules of random task graphs) is rejected.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeloom.errors import DeadlockError, MemoryLimitError, OrderError, ScheduleError
from pipeloom.ir import Action, Schedule, schedule_from_csv, task_actions
from pipeloom.problem import Problem, Task
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.stages import Costs
from pipeloom.validate import check_structure, is_valid, validate


def _edit(schedule: Schedule, rank: int, row: str, **changes) -> Schedule:
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(Action.parse(a) for a in row.split())
    return Schedule(name=schedule.name, problem=changes.get("problem", schedule.problem),
                    num_microbatches=schedule.num_microbatches, ranks=ranks)


def _one_f_one_b(**costs) -> Schedule:
    # rank 0: 0F0 0F1 0B0 0F2 0B1 0B2; rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
    return build_schedule("1f1b", 2, 3, costs=Costs(**costs))


def _assert_error(error: Exception, *words: str) -> None:
    message = str(error)
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"
    assert "<-- here" in message, "the grid must mark the failing step"


@pytest.mark.parametrize(
    ("rank", "row", "words"),
    [
        # missing: 0B2 dropped -> reported after the last step of rank 0.
        (0, "0F0 0F1 0B0 0F2 0B1", ["rank 0 step 5", "never runs 1 action(s)", "0B2"]),
        # duplicate: 0F1 twice.
        (0, "0F0 0F1 0F1 0B0 0F2 0B1 0B2", ["rank 0 step 2", "0F1 runs twice on rank 0", ">0F1<"]),
        # foreign task: stage 0 has no W.
        (1, "1F0 1B0 1F1 1B1 1F2 1B2 0W0", ["rank 1 step 6", "0W0", "task 0W", "does not have"]),
        # wrong rank: stage 0's forward on rank 1.
        (1, "1F0 0F0 1B0 1F1 1B1 1F2 1B2", ["rank 1 step 1", "0F0 belongs to ranks [0], not rank 1"]),
        # micro-batch out of range.
        (1, "1F0 1B0 1F1 1B1 1F2 1B2 1F3", ["rank 1 step 6", "1F3", "micro-batch 3", "0..2"]),
        # deadlock: rank 1 runs its backward before the forward it needs.
        (1, "1B0 1F0 1F1 1B1 1F2 1B2", ["deadlock", "rank 1 step 0: 1B0 waits for 1F0"]),
    ],
    ids=["missing", "duplicate", "foreign", "wrong-rank", "microbatch", "deadlock"],
)
def test_each_corruption_names_action_rank_and_step(rank, row, words):
    corrupted = _edit(_one_f_one_b(), rank, row)
    with pytest.raises(ScheduleError) as caught:
        validate(corrupted)
    _assert_error(caught.value, *words)
    assert not is_valid(corrupted)


def test_order_is_checked_only_in_ordered_mode():
    # 1B1 before 1B0 on rank 1 is runnable (both forwards ran) but breaks exact gradients.
    swapped = _edit(_one_f_one_b(), 1, "1F0 1F1 1B1 1B0 1F2 1B2")
    validate(swapped)
    with pytest.raises(OrderError) as caught:
        validate(swapped, ordered=True)
    _assert_error(caught.value, "rank 1 step 3", "1B0 runs after 1B1 (step 2)", "micro-batch order")
    assert is_valid(swapped) and not is_valid(swapped, ordered=True)


def test_order_of_split_backward_checks_w_not_i():
    problem = Problem(num_ranks=1, tasks=(
        Task(stage=0, kind="F", ranks=(0,), duration=1),
        Task(stage=0, kind="I", ranks=(0,), duration=1, deps=((0, "F"),)),
        Task(stage=0, kind="W", ranks=(0,), duration=1, deps=((0, "I"),)),
    ))
    rows = "0F0 0F1 0I1 0I0 0W0 0W1"
    schedule = Schedule(name="zb", problem=problem, num_microbatches=2,
                        ranks=[[Action.parse(a) for a in rows.split()]])
    validate(schedule, ordered=True)
    late_w = _edit(schedule, 0, "0F0 0F1 0I1 0I0 0W1 0W0")
    with pytest.raises(OrderError, match="0W0 runs after 0W1"):
        validate(late_w, ordered=True)


def test_memory_limit_names_the_action_that_crosses_it():
    # GPipe on 2 ranks, 3 micro-batches holds 3 activations; a limit of 2 fails at 0F2.
    schedule = build_schedule("gpipe", 2, 3, memory_limit=2.0)
    with pytest.raises(MemoryLimitError) as caught:
        validate(schedule)
    _assert_error(caught.value, "rank 0 step 2", "0F2 raises held memory to 3", "limit 2", "peak on rank 0: 3")
    timeline = validate(schedule, check_memory_limit=False)
    assert timeline.peak_memory == (3.0, 3.0)
    validate(build_schedule("1f1b", 2, 3, memory_limit=2.0))  # 1F1B holds p = 2: fits exactly


def test_static_memory_above_the_limit_is_reported():
    problem = Problem(num_ranks=1, memory_limit=1.0, static_memory=(5.0,),
                      tasks=(Task(stage=0, kind="F", ranks=(0,), duration=1, memory=-1),))
    schedule = Schedule(name="s", problem=problem, num_microbatches=1, ranks=[[Action(0, "F", 0)]])
    with pytest.raises(MemoryLimitError, match="static memory 5 exceeds the limit 1"):
        validate(schedule)


def test_valid_schedule_returns_its_timeline():
    timeline = validate(_one_f_one_b(f=1, b=1, w=1), ordered=True)
    assert timeline.makespan == (3 + 2 - 1) * 3


def test_multi_rank_task_missing_on_one_of_its_ranks():
    problem = Problem(num_ranks=2, tasks=(Task(stage=0, kind="F", ranks=(0, 1), duration=1),))
    schedule = Schedule(name="tp", problem=problem, num_microbatches=1, ranks=[[Action(0, "F", 0)], []])
    with pytest.raises(ScheduleError, match="rank 1 never runs 1 action"):
        validate(schedule)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("num_mb", [10**5, 10**12])
def test_a_huge_microbatch_count_fails_fast_naming_the_count(num_mb):
    """A file may claim 10**12 micro-batches: the structure check counts the gap, lists 6, and stops."""
    small = build_schedule("gpipe", 2, 2)
    big = Schedule(name="big", problem=small.problem, num_microbatches=num_mb, ranks=small.ranks)
    with pytest.raises(ScheduleError) as caught:
        validate(big)
    assert (f"rank 0 step 4: rank 0 never runs {2 * num_mb - 4} action(s) it owns: "
            "0B2, 0B3, 0B4, 0B5, 0B6, 0B7, ...\n") in str(caught.value)


@pytest.mark.timeout(20)
def test_a_csv_cell_with_a_huge_microbatch_fails_fast():
    schedule = schedule_from_csv("0F0,0B0,0F99999999999999\n")
    assert schedule.num_microbatches == 10**14
    with pytest.raises(ScheduleError, match=r"never runs 199999999999997 action\(s\) it owns: 0B1, 0B2,"):
        validate(schedule)


def test_the_missing_list_is_sorted_and_cut_at_six():
    schedule = _edit(_one_f_one_b(), 1, "1F1 1B1")
    with pytest.raises(ScheduleError, match=r"never runs 4 action\(s\) it owns: 1B0, 1B2, 1F0, 1F2\n"):
        check_structure(schedule)


# ------------------------------------------------------------------------ corruption properties


def _available() -> list[str]:
    names = []
    for name, info in REGISTRY.items():
        try:
            info.generator  # noqa: B018 - imports the module
        except (ImportError, AttributeError):
            continue
        names.append(name)
    return names


AVAILABLE = _available()
"""Registry schedules whose module exists now (computed once so that hypothesis draws stay stable)."""


@st.composite
def registry_schedules(draw) -> Schedule:
    """A registry schedule for a small size it accepts, with random costs."""
    name = draw(st.sampled_from(AVAILABLE))
    costs = Costs(f=draw(st.sampled_from([1, 2])), b=draw(st.sampled_from([1, 3])),
                  w=draw(st.sampled_from([0, 1])), comm=draw(st.sampled_from([0, 0.5])))
    try:
        return build_schedule(name, draw(st.integers(1, 5)), draw(st.integers(1, 8)), costs=costs)
    except ValueError:
        assume(False)


@st.composite
def topological_schedules(draw) -> Schedule:
    """A random task DAG and a random global topological order of (task, micro-batch) split by rank.

    Each task's micro-batches enter the order increasingly, so the schedule is ordered too.
    """
    num_ranks = draw(st.integers(1, 4))
    tasks: list[Task] = []
    for i in range(draw(st.integers(1, 5))):
        deps = draw(st.sets(st.sampled_from([t.key for t in tasks]), max_size=2)) if tasks else set()
        tasks.append(Task(
            stage=i, kind=draw(st.sampled_from("FBIW")),
            ranks=tuple(sorted(draw(st.sets(st.integers(0, num_ranks - 1), min_size=1, max_size=2)))),
            duration=draw(st.sampled_from([0, 1, 2])), memory=draw(st.integers(-1, 1)), deps=tuple(deps),
        ))
    problem = Problem(num_ranks=num_ranks, tasks=tuple(tasks), comm_latency=draw(st.sampled_from([0, 1])))
    num_mb = draw(st.integers(1, 3))
    next_mb = {t.key: 0 for t in tasks}
    done: set[tuple[int, str, int]] = set()
    rows: list[list[Action]] = [[] for _ in range(num_ranks)]
    while len(done) < len(tasks) * num_mb:
        ready = [t for t in tasks if next_mb[t.key] < num_mb
                 and all((*dep, next_mb[t.key]) in done for dep in t.deps)]
        task = draw(st.sampled_from(ready))
        action = Action(task.stage, task.kind, next_mb[task.key])
        for r in task.ranks:
            rows[r].append(action)
        done.add(tuple(action))
        next_mb[task.key] += 1
    return Schedule(name="topo", problem=problem, num_microbatches=num_mb, ranks=rows)


valid_schedules = st.one_of(registry_schedules(), topological_schedules())
PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(valid_schedules)
def test_generated_schedules_are_valid(schedule):
    """The sources of the properties below must themselves be valid (else they prove nothing)."""
    validate(schedule, ordered=True)


def _replace(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(actions)
    return Schedule(name=schedule.name, problem=schedule.problem,
                    num_microbatches=schedule.num_microbatches, ranks=ranks)


def _busy_rank(draw, schedule: Schedule) -> int:
    ranks = [r for r, row in enumerate(schedule.ranks) if row]
    return draw(st.sampled_from(ranks))


@PROPERTY
@given(valid_schedules, st.data())
def test_dropping_any_action_is_caught(schedule, data):
    rank = _busy_rank(data.draw, schedule)
    row = list(schedule.ranks[rank])
    dropped = row.pop(data.draw(st.integers(0, len(row) - 1)))
    # a composite (a pair, a B standing for I and W) is reported by the tasks it completes
    names = "|".join(re.escape(str(a)) for a in (dropped, *task_actions(schedule.problem, dropped)))
    with pytest.raises(ScheduleError, match=names):
        validate(_replace(schedule, rank, row))


@PROPERTY
@given(valid_schedules, st.data())
def test_duplicating_any_action_is_caught(schedule, data):
    rank = _busy_rank(data.draw, schedule)
    row = list(schedule.ranks[rank])
    copy = row[data.draw(st.integers(0, len(row) - 1))]
    row.insert(data.draw(st.integers(0, len(row))), copy)
    # a composite copy is named by the part found first: "1I0 (in 1B0) runs twice on rank 0"
    with pytest.raises(ScheduleError, match=rf"{re.escape(str(copy))}\)? runs twice on rank {rank}"):
        validate(_replace(schedule, rank, row))


def _ancestors(problem: Problem) -> dict[tuple[int, str], set[tuple[int, str]]]:
    """Transitive deps of every task (same micro-batch)."""
    result: dict[tuple[int, str], set[tuple[int, str]]] = {}

    def visit(key):
        if key not in result:
            result[key] = set()
            for dep in problem.task(key).deps:
                result[key] |= {dep} | visit(dep)
        return result[key]

    for task in problem.tasks:
        visit(task.key)
    return result


@PROPERTY
@given(valid_schedules, st.data())
def test_swapping_two_actions_against_a_dependency_is_caught(schedule, data):
    """Swap a[i] and a[j] where a[j] needs a[i] (deadlock) or both are B/W of one stage (order)."""
    ancestors = _ancestors(schedule.problem)

    def plain(action):  # one task's action
        return isinstance(action, Action) and action.task in ancestors

    pairs = [
        (r, i, j)
        for r, row in enumerate(schedule.ranks)
        for i, early in enumerate(row)
        for j in range(i + 1, len(row))
        if plain(early) and plain(row[j])
        and ((row[j].microbatch == early.microbatch and early.task in ancestors[row[j].task])
             or (row[j].task == early.task and early.kind in "BW"))
    ]
    assume(pairs)
    rank, i, j = data.draw(st.sampled_from(pairs))
    row = list(schedule.ranks[rank])
    row[i], row[j] = row[j], row[i]
    with pytest.raises((DeadlockError, OrderError)):
        validate(_replace(schedule, rank, row), ordered=True)


@PROPERTY
@given(valid_schedules, st.data())
def test_moving_an_action_to_a_rank_that_does_not_run_it_is_caught(schedule, data):
    problem = schedule.problem
    keys = {task.key for task in problem.tasks}
    moves = [  # plain actions of one task (not an overlapped pair, not a B standing for I and W)
        (r, i, q)
        for r, row in enumerate(schedule.ranks)
        for i, action in enumerate(row)
        if isinstance(action, Action) and action.task in keys
        for q in range(problem.num_ranks)
        if q not in problem.task(action.task).ranks
    ]
    assume(moves)
    rank, i, target = data.draw(st.sampled_from(moves))
    ranks = [list(row) for row in schedule.ranks]
    action = ranks[rank].pop(i)
    ranks[target].insert(data.draw(st.integers(0, len(ranks[target]))), action)
    moved = Schedule(name=schedule.name, problem=problem, num_microbatches=schedule.num_microbatches,
                     ranks=ranks)
    with pytest.raises(ScheduleError, match=str(action)):
        validate(moved)


@PROPERTY
@given(valid_schedules, st.data())
def test_changing_a_microbatch_index_is_caught(schedule, data):
    rank = _busy_rank(data.draw, schedule)
    row = list(schedule.ranks[rank])
    plain = [k for k, action in enumerate(row) if isinstance(action, Action)]  # pairs have two indices
    assume(plain)
    i = data.draw(st.sampled_from(plain))
    new_mb = data.draw(st.integers(0, schedule.num_microbatches + 2).filter(lambda mb: mb != row[i].microbatch))
    row[i] = row[i]._replace(microbatch=new_mb)
    with pytest.raises(ScheduleError):
        validate(_replace(schedule, rank, row))
