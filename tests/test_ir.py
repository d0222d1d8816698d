"""Tests of pipeloom.ir: action text, JSON and torch-CSV forms, and the step x rank grid.

Oracles: parsing undoes printing (hypothesis round trips over generated schedules), the JSON
example of docs/design.md §2, and hand-written golden text.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeloom.errors import ScheduleFormatError
from pipeloom.ir import (
    FORMAT,
    Action,
    Schedule,
    format_grid,
    load_schedule,
    save_schedule,
    schedule_from_csv,
    schedule_from_json,
    schedule_to_csv,
    schedule_to_json,
)
from pipeloom.problem import Problem, Task
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.stages import Costs, Stage, stage_graph
from pipeloom.validate import validate

# ------------------------------------------------------------------------------------ strategies

actions = st.builds(
    Action, st.integers(0, 10_000), st.sampled_from("FBIW"), st.integers(0, 10_000)
)
numbers = st.one_of(st.integers(-5, 5), st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False))
limits = st.one_of(st.none(), st.integers(0, 5), st.floats(0, 1e6, allow_nan=False, allow_infinity=False))
durations = st.one_of(st.integers(0, 5), st.floats(0, 1e6, allow_nan=False, allow_infinity=False))


@st.composite
def chain_schedules(draw) -> Schedule:
    """A linear stage chain, each stage on one rank, and any order of all its actions per rank.

    Costs are a rank's share, split evenly over the stages a rank holds (the CSV reader's rule).

    Every (task, micro-batch) appears once, so the torch CSV (which infers the problem from the
    rows) can carry it; validity does not matter for I/O.
    """
    num_ranks = draw(st.integers(1, 4))
    num_stages = draw(st.integers(1, 6))
    stage_ranks = [draw(st.integers(0, num_ranks - 1)) for _ in range(num_stages)]
    num_ranks = 1 + max(stage_ranks)  # a CSV has no row for a trailing idle rank (middle ones: yes)
    costs = Costs(f=draw(durations), b=draw(durations), w=draw(durations), comm=draw(durations),
                  memory=3.0, w_memory=draw(st.sampled_from([0.0, 1.0, 3.0])))
    backward = draw(st.sampled_from(["full", "split", "none"]))
    limit = draw(limits)
    share = {rank: 1.0 / stage_ranks.count(rank) for rank in stage_ranks}  # a rank's share split evenly
    problem = stage_graph(
        [costs.stage(rank, share=share[rank]) for rank in stage_ranks], num_ranks=num_ranks, backward=backward,
        comm_latency=costs.comm, memory_limit=limit,
    )
    num_mb = draw(st.integers(1, 4))
    ranks = []
    for r in range(num_ranks):
        own = [Action(t.stage, t.kind, mb) for t in problem.tasks_on(r) for mb in range(num_mb)]
        ranks.append(draw(st.permutations(own)))
    schedule = Schedule(name="gen", problem=problem, num_microbatches=num_mb, ranks=ranks)
    return schedule, costs, limit


@st.composite
def task_graph_schedules(draw) -> Schedule:
    """Arbitrary tasks (multi-rank, any deps on earlier tasks, static memory) and arbitrary lists."""
    num_ranks = draw(st.integers(1, 4))
    tasks = []
    for i in range(draw(st.integers(1, 5))):
        ranks = draw(st.sets(st.integers(0, num_ranks - 1), min_size=1))
        deps = draw(st.sets(st.sampled_from([t.key for t in tasks]), max_size=3)) if tasks else set()
        tasks.append(Task(stage=i, kind=draw(st.sampled_from("FBIW")), ranks=tuple(sorted(ranks)),
                          duration=draw(durations), memory=draw(numbers), deps=tuple(sorted(deps))))
    static = draw(st.one_of(st.none(), st.lists(numbers, min_size=num_ranks, max_size=num_ranks)))
    problem = Problem(num_ranks=num_ranks, tasks=tuple(tasks), comm_latency=draw(durations),
                      memory_limit=draw(limits),
                      static_memory=None if static is None else tuple(static))
    rows = [draw(st.lists(actions, max_size=6)) for _ in range(num_ranks)]
    return Schedule(name=draw(st.text(max_size=8)), problem=problem,
                    num_microbatches=draw(st.integers(1, 9)), ranks=rows)


# ---------------------------------------------------------------------------------------- actions


def test_action_text_matches_torch_letters():
    assert str(Action(2, "F", 0)) == "2F0"
    assert str(Action(0, "I", 13)) == "0I13"
    assert Action.parse("1W3") == Action(1, "W", 3)
    assert Action.parse(" 10B12 ").task == (10, "B")


@given(actions)
def test_action_text_round_trip(action):
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["", "F0", "2F", "2X0", "2F-1", "-2F0", "2 F0", "2F0x", "(0F1;1B0)OVERLAP_F_B",
                                  "1SEND_F0"])
def test_bad_action_text_is_a_format_error_with_an_example(text):
    with pytest.raises(ScheduleFormatError, match=r"e\.g\. '2F0'"):
        Action.parse(text)


def test_action_parse_rejects_non_strings():
    with pytest.raises(ScheduleFormatError):
        Action.parse(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ JSON


@settings(max_examples=60, deadline=None)
@given(task_graph_schedules())
def test_json_round_trip_of_any_schedule(schedule):
    assert schedule_from_json(schedule_to_json(schedule)) == schedule
    assert schedule_from_json(schedule_to_json(schedule, indent=2)) == schedule


def test_json_document_follows_design_example():
    schedule = build_schedule("1f1b", 2, 2, costs=Costs(f=1, b=1, w=1))
    document = json.loads(schedule_to_json(schedule))
    assert document["format"] == FORMAT == "pipeloom.schedule/1"
    assert (document["name"], document["num_ranks"], document["num_microbatches"]) == ("1f1b", 2, 2)
    assert document["tasks"][1] == {"stage": 0, "kind": "B", "ranks": [0], "duration": 2.0,
                                    "memory": -1.0, "deps": ["0F", "1B"]}
    assert document["ranks"] == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert document["comm_latency"] == 0.0 and document["memory_limit"] is None


def _document() -> dict:
    return json.loads(schedule_to_json(build_schedule("gpipe", 2, 2)))


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d.pop("format"), ["missing key 'format'", FORMAT]),
        (lambda d: d.update(format="pipeloom.schedule/2"), ["pipeloom.schedule/2", "expected", FORMAT]),
        (lambda d: d.update(colour="red"), ["unknown key", "colour"]),
        (lambda d: d["tasks"][0].update(size=3), ["tasks[0]", "unknown key", "size"]),
        (lambda d: d.pop("ranks"), ["missing key 'ranks'"]),
        (lambda d: d.update(num_ranks="2"), ["num_ranks", "integer"]),
        (lambda d: d.update(num_ranks=True), ["num_ranks", "True"]),
        (lambda d: d["ranks"][1].__setitem__(0, "1Q0"), ["ranks[1]", "1Q0"]),
        (lambda d: d["tasks"][0].update(deps=["zz"]), ["zz", "task name"]),
        (lambda d: d["tasks"][0].update(duration=-2), ["tasks[0]", "duration", "-2"]),
        (lambda d: d["tasks"][0].update(ranks=[5]), ["rank 5", "only 2 ranks"]),
        (lambda d: d.update(num_microbatches=0), ["num_microbatches", "positive"]),
        (lambda d: d["ranks"].pop(), ["1 rank lists", "2 ranks"]),
        (lambda d: d.update(static_memory=5), ["static_memory", "list of numbers or null", "5"]),
        (lambda d: d.update(static_memory=["a", 1]), ["static_memory", "list of numbers or null"]),
        (lambda d: d.update(static_memory={"0": 1}), ["static_memory", "list of numbers or null"]),
        (lambda d: d.update(static_memory=[1]), ["static_memory", "one per rank"]),
        (lambda d: d.update(name=None), ["name", "string", "None"]),
        (lambda d: d.update(name=3), ["name", "string", "3"]),
        (lambda d: d.update(comm_latency=None), ["comm_latency", "number", "None"]),
        (lambda d: d.update(comm_latency="1"), ["comm_latency", "number"]),
        (lambda d: d.update(memory_limit=[1]), ["memory_limit", "number or null"]),
        (lambda d: d.update(memory_limit=True), ["memory_limit", "True"]),
        (lambda d: d.update(memory_limit=-1), ["memory_limit", ">= 0"]),
        (lambda d: d["tasks"][0].update(stage=True), ["tasks[0].stage", "integer", "True"]),
        (lambda d: d["tasks"][0].update(memory="x"), ["tasks[0]", "memory", "'x'"]),
        (lambda d: d["tasks"][0].update(ranks=[[0]]), ["tasks[0]", "rank", "[0]"]),
        (lambda d: d["tasks"][0].update(duration=10**400), ["tasks[0]", "duration", "finite"]),
    ],
)
def test_bad_json_is_a_format_error_naming_the_key(edit, words):
    document = _document()
    edit(document)
    with pytest.raises(ScheduleFormatError) as caught:
        schedule_from_json(json.dumps(document))
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{", "malformed JSON"),
        ("[]", "JSON object"),
        ("[" * 100_000 + "]" * 100_000, "malformed JSON"),  # deeper than the parser's recursion limit
        ('{"format": ' + "1" * 5000 + "}", "malformed JSON"),  # longer than Python's int-digit limit
    ],
)
def test_unreadable_json_is_a_format_error(text, words):
    with pytest.raises(ScheduleFormatError, match=words):
        schedule_from_json(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(10**400), 10**400)
    | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    where=st.sampled_from(["top", "task"]),
    key=st.sampled_from(sorted({"format", "name", "num_ranks", "num_microbatches", "tasks", "comm_latency",
                                "memory_limit", "static_memory", "ranks", "stage", "kind", "duration",
                                "memory", "deps"})),
    value=json_values,
)
def test_any_json_value_for_any_key_loads_or_is_a_format_error(where, key, value):
    """Property: replacing one top-level or task value by any JSON value never escapes as TypeError etc."""
    document = _document()
    (document if where == "top" else document["tasks"][1])[key] = value
    try:
        schedule_from_json(json.dumps(document))
    except ScheduleFormatError:
        pass


# ------------------------------------------------------------------------------------------- CSV


@settings(max_examples=80, deadline=None)
@given(chain_schedules())
def test_csv_round_trip_of_single_rank_stage_schedules(drawn):
    schedule, costs, limit = drawn
    back = schedule_from_csv(schedule_to_csv(schedule), costs=costs, memory_limit=limit)
    assert back.ranks == schedule.ranks
    assert back.num_microbatches == schedule.num_microbatches
    assert back.problem == schedule.problem


def test_csv_is_one_row_per_rank_and_empty_cells_are_idle():
    schedule = build_schedule("1f1b", 2, 2)
    assert schedule_to_csv(schedule) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    loaded = schedule_from_csv(",0F0,,0F1,0B0,0B1\n,,1F0,1B0,1F1,,1B1,\n")
    assert loaded.ranks == schedule.ranks and loaded.problem == schedule.problem


def test_csv_with_an_idle_rank_and_split_backward():
    loaded = schedule_from_csv("0F0,0I0,0W0\n\n1F0,1I0,1W0\n")
    assert loaded.num_ranks == 3 and loaded.ranks[1] == ()
    assert [t.name for t in loaded.problem.tasks] == ["0F", "0I", "0W", "1F", "1I", "1W"]
    assert [t.ranks for t in loaded.problem.tasks] == [(0,)] * 3 + [(2,)] * 3


@pytest.mark.parametrize("tail", ["\n", "\n\n", "\n\n\n", "\r\n\r\n", "\n,,\n \n"])
def test_csv_blank_rows_after_the_last_action_row_are_not_ranks(tail):
    loaded = schedule_from_csv("0F0,0B0" + tail)
    assert loaded.num_ranks == 1 and loaded.ranks == ((Action(0, "F", 0), Action(0, "B", 0)),)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", ["empty"]),
        ("\n,\n", ["no actions"]),
        ("0F0,1F0\n1B0\n", ["row 2", "stage 1", "rank 0", "JSON"]),
        ("0F0,0B0\n2F0\n", ["stages [1] never run"]),
        # the stages a stage number of 18 digits leaves are counted, not listed (that list had taken 4 GB)
        ("123456789012345678F0\n", ["stages [0, 1, 2, 3, 4, 5, ... (123,456,789,012,345,672 more)] never run"]),
        ("0F0,0Z0\n", ["row 1, column 2", "0Z0"]),
        ('0F0,"0B0\n', ["malformed CSV", "line 1", "unexpected end of data", "quote"]),
        ('0F0,0B0\n"1F0,1B0\n\n', ["malformed CSV", "line 3", "unexpected end of data"]),
        ('0F0,"0B"0\n', ["malformed CSV", "line 1", "',' expected after '\"'"]),
        ("0F0,0B" + "9" * 5000 + "\n", ["row 1, column 2", "too long"]),
        ("0F0,\u0663B0\n", ["row 1, column 2", "e.g. '2F0'"]),  # ASCII digits only
    ],
)
def test_bad_csv_is_a_format_error_naming_the_cell(text, words):
    with pytest.raises(ScheduleFormatError) as caught:
        schedule_from_csv(text)
    for word in words:
        assert word in str(caught.value)


# ----------------------------------------------------------------------------------------- files


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_save_and_load_by_suffix(tmp_path, suffix):
    schedule = build_schedule("1f1b", 3, 4)
    path = tmp_path / f"one{suffix}"
    save_schedule(schedule, path)
    back = load_schedule(path)
    assert back.ranks == schedule.ranks and back.problem == schedule.problem
    assert back.name == ("1f1b" if suffix == ".json" else "one")


@pytest.mark.parametrize("suffix", [".JSON", ".Csv"])
def test_suffixes_are_case_insensitive(tmp_path, suffix):
    schedule = build_schedule("1f1b", 2, 3)
    path = tmp_path / f"one{suffix}"
    save_schedule(schedule, path)
    assert load_schedule(path).ranks == schedule.ranks


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_a_file_that_is_not_utf8_is_a_format_error(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes("0F0,0B0 \u00e9\n".encode("latin-1"))
    with pytest.raises(ScheduleFormatError, match=r"cannot read .*latin1.*: not UTF-8 text \(byte 8\)$"):
        load_schedule(path)


def _registry_schedule(name: str) -> Schedule:
    """A small instance every family accepts (4 ranks, 8 micro-batches, split costs)."""
    return build_schedule(name, 4, 8, costs=Costs(f=1, b=1, w=1))


@pytest.mark.parametrize("name", list(REGISTRY))
def test_csv_export_round_trips_or_refuses_each_registry_schedule(name, tmp_path):
    """Oracle: the CSV reader. A schedule saved as CSV reads back with the same lists and tasks; the
    registry says which cannot be: the two-replica (bidirectional) ones, whose second chain a CSV
    cannot express."""
    schedule = _registry_schedule(name)
    if REGISTRY[name].replicas == 1:
        back = schedule_from_csv(schedule_to_csv(schedule))
        assert back.ranks == schedule.ranks and back.num_microbatches == schedule.num_microbatches

        def shape(problem):
            return [(t.key, t.ranks, set(t.deps)) for t in problem.tasks]

        assert shape(back.problem) == shape(schedule.problem)
        return
    for write in (schedule_to_csv, lambda s: save_schedule(s, tmp_path / "x.csv")):
        with pytest.raises(ScheduleFormatError) as caught:
            write(schedule)
        message = str(caught.value)
        assert f"schedule {name!r}" in message and "torch CSV" in message and "save it as .json" in message
        assert "stage 4 does not depend on stage 3" in message  # the second replica's chain starts afresh
    assert not (tmp_path / "x.csv").exists()


def _problem_with(**changes) -> Problem:
    problem = stage_graph([Stage(ranks=0), Stage(ranks=1)], backward="split")
    tasks = [dataclasses.replace(t, **changes[t.name]) if t.name in changes else t for t in problem.tasks]
    return dataclasses.replace(problem, tasks=tuple(tasks))


@pytest.mark.parametrize(
    ("problem", "words"),
    [
        (_problem_with(**{"1W": {"ranks": (0, 1)}}), ["task 1W runs on ranks [0, 1]", "one rank"]),
        (_problem_with(**{"1W": {"ranks": (0,)}}), ["stage 1 runs on ranks 1 and 0"]),
        (_problem_with(**{"1F": {"deps": ()}}), ["stage 1 does not depend on stage 0"]),
        (_problem_with(**{"0I": {"deps": ((0, "F"),)}}), ["task 0I waits for 0F,", "wait for 0F, 1F, 1I"]),
        (_problem_with(**{"1W": {"deps": ((1, "I"), (0, "W"))}}),
         ["task 1W waits for 0F, 0I, 0W, 1F, 1I,", "wait for 0F, 1F, 1I (directly or through others)"]),
        (_problem_with(**{"1W": {"kind": "B", "deps": ((1, "F"),)}}),
         ["stage 1 has tasks B, F, I and stage 0 has F, I, W", "one backward style"]),
        (Problem(num_ranks=2, tasks=(Task(stage=0, kind="F", ranks=(0,), duration=1),
                                     Task(stage=1, kind="F", ranks=(1,), duration=1, deps=((0, "F"),)),
                                     Task(stage=1, kind="B", ranks=(1,), duration=1, deps=((1, "F"),)))),
         ["stage 1 has tasks B, F and stage 0 has F;"]),
        (stage_graph([Stage(ranks=0), Stage(ranks=1), Stage(ranks=0)], edges=[(0, 1), (0, 2)]),
         ["stage 2 does not depend on stage 1"]),
        (Problem(num_ranks=1, tasks=(Task(stage=1, kind="F", ranks=(0,), duration=1),)),
         ["stages 0..1", "[0]"]),
        (stage_graph([Stage(ranks=0), Stage(ranks=0)], num_ranks=2), ["rank 1", "last", "no actions"]),
    ],
)
def test_csv_export_names_what_the_csv_cannot_carry(problem, words):
    ranks = [[Action(t.stage, t.kind, 0) for t in problem.tasks_on(r)] for r in range(problem.num_ranks)]
    schedule = Schedule(name="odd", problem=problem, num_microbatches=1, ranks=ranks)
    with pytest.raises(ScheduleFormatError) as caught:
        schedule_to_csv(schedule)
    message = str(caught.value)
    assert message.startswith("schedule 'odd' cannot be saved as torch CSV because ")
    assert message.endswith("; save it as .json")
    for word in words:
        assert word in message


def test_csv_export_takes_a_wait_implied_through_others():
    """A search's problem may wait for less directly than the CSV reader's chain (0B waits for 1B alone,
    not also for 0F, which 1B waits for already): the CSV holds it, and reads back as a valid schedule."""
    for backward, kinds in (("full", "B"), ("split", "I")):
        chain = stage_graph([Stage(ranks=0), Stage(ranks=1)], backward=backward)
        tasks = [dataclasses.replace(t, deps=((1, kinds),)) if t.name == f"0{kinds}" else t for t in chain.tasks]
        problem = dataclasses.replace(chain, tasks=tuple(tasks))
        assert problem.task((0, kinds)).deps == ((1, kinds),)
        ranks = [[Action(t.stage, t.kind, 0) for t in problem.tasks_on(r)] for r in range(2)]
        text = schedule_to_csv(Schedule(name="v", problem=problem, num_microbatches=1, ranks=ranks))
        back = schedule_from_csv(text)
        validate(back)
        assert back.problem.waits_for() == problem.waits_for()


def test_save_and_load_reject_unknown_suffix_and_missing_file(tmp_path):
    schedule = build_schedule("gpipe", 1, 1)
    with pytest.raises(ScheduleFormatError, match=r"\.json or \.csv"):
        save_schedule(schedule, tmp_path / "x.txt")
    with pytest.raises(ScheduleFormatError, match="cannot read"):
        load_schedule(tmp_path / "missing.json")
    (tmp_path / "x.yaml").write_text("")
    with pytest.raises(ScheduleFormatError, match=r"\.json"):
        load_schedule(tmp_path / "x.yaml")


# --------------------------------------------------------------------------------- text and grid


def test_schedule_text_golden():
    assert build_schedule("1f1b", 3, 3).to_text() == (
        "rank 0: 0F0 0F1 0F2 0B0 0B1 0B2\n"
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1B2\n"
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2"
    )


def test_schedule_counts_and_rank_list_check():
    schedule = build_schedule("gpipe", 3, 5)
    assert (schedule.num_ranks, schedule.num_actions) == (3, 30)
    with pytest.raises(ValueError, match="one list per rank"):
        Schedule(name="x", problem=schedule.problem, num_microbatches=5, ranks=schedule.ranks[:2])
    with pytest.raises(ValueError, match="positive integer"):
        Schedule(name="x", problem=schedule.problem, num_microbatches=0, ranks=schedule.ranks)


def test_format_grid_golden_with_mark():
    grid = format_grid([["0F0", "0B0"], ["1F0"]], mark=(1, 0))
    assert grid == (
        "step | rank 0 | rank 1\n"
        "   0 |    0F0 |  >1F0<   <-- here\n"
        "   1 |    0B0 |       "
    )


def test_format_grid_windows_long_schedules():
    ranks = [[f"{r}F{i}" for i in range(100)] for r in range(30)]
    grid = format_grid(ranks, mark=(29, 50), context=2, max_ranks=4)
    lines = grid.splitlines()
    assert lines[0].split(" | ") == ["step", "rank 26", "rank 27", "rank 28", "rank 29"]
    assert [line.split(" | ")[0].strip() for line in lines[1:6]] == ["48", "49", "50", "51", "52"]
    assert ">29F50<" in lines[3] and lines[3].endswith("<-- here")
    assert lines[-1] == "(steps 48..52 of 100, ranks 26..29 of 30)"
    head = format_grid(ranks, context=1, max_ranks=2).splitlines()
    assert len(head) == 1 + 3 + 1 and head[-1] == "(steps 0..2 of 100, ranks 0..1 of 30)"


def test_csv_with_b_and_i_of_one_stage_loads_and_the_validator_names_the_duplicate():
    """With I or W in a CSV the backward is split and a B is its stage's I and W run together
    (docs/semantics.md), so B and I of one micro-batch run that I twice."""
    from pipeloom.errors import ScheduleError

    schedule = schedule_from_csv("0F0,0B0,0I0\n")
    assert schedule.problem.splits_backward
    with pytest.raises(ScheduleError, match=r"0I0 runs twice"):
        validate(schedule)


def test_a_csv_with_a_huge_stage_gap_gives_one_short_error_line():
    with pytest.raises(ScheduleFormatError) as caught:
        schedule_from_csv("0F0,0B0\n1000000F0,1000000B0\n")
    message = str(caught.value)
    assert len(message) < 200 and "[1, 2, 3, 4, 5, 6, ... (999,993 more)]" in message


def test_a_micro_batch_count_beyond_floats_is_a_format_error_not_an_overflow():
    from pipeloom.ir import check_totals

    with pytest.raises(ScheduleFormatError, match="overflow the float range when added up over about 1e400"):
        check_totals(build_schedule("1f1b", 2, 2).problem, 10**400)
