"""Fuzzing of every file reader and of the command line's flags (hypothesis).

Oracle: the contract of issue 16. A valid document, mutated anywhere (a value replaced by any JSON
value, a key dropped or added, the text cut or spliced), either loads or raises a
:class:`~pipeloom.errors.PipeloomError`; a command line with any flag values either succeeds or
exits 1 or 2 with exactly one ``pipeloom: error:`` line; and neither takes longer than a few seconds
(an alarm turns a hang into a failure). Example counts are small so that the file runs in ~20 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeloom import Costs, build_schedule
from pipeloom.cli import main
from pipeloom.errors import PipeloomError
from pipeloom.ir import schedule_from_csv, schedule_from_json, schedule_to_csv, schedule_to_json
from pipeloom.plan import CostTable, Link, Piece, RuntimeCorrections
from pipeloom.plan.costs.file import costs_from_json, costs_to_json
from pipeloom.plan.plan import Plan, plan_from_json, plan_to_json
from pipeloom.search.problem_file import problem_from_json

SECONDS = 10
"""Wall time one example may take before it counts as a hang."""

EXAMPLES = int(os.environ.get("PIPELOOM_FUZZ_EXAMPLES", "40"))
"""Examples per reader; set PIPELOOM_FUZZ_EXAMPLES (and PIPELOOM_FUZZ_SEED) for a longer hunt."""
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="PIPELOOM_FUZZ_SEED" not in os.environ,
                database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
"""Deterministic (derandomized) runs by default: a failure reproduces, and the file's run time stays put."""


@contextlib.contextmanager
def time_bound(seconds: int = SECONDS) -> Iterator[None]:
    """Fail when the body runs longer than ``seconds`` (a hang or a blow-up)."""

    def expired(signum, frame):
        raise AssertionError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def loads_or_refuses(reader: Callable[[str], object], text: str) -> None:
    """``reader(text)`` returns or raises a PipeloomError; anything else propagates (a failure)."""
    with time_bound():
        try:
            reader(text)
        except PipeloomError:
            pass


# ------------------------------------------------------------------------------ mutations

NUMBERS = st.sampled_from([0, 1, 2, -1, 0.5, -0.0, 1e308, -1e308, 1.7e308, 10**400, 2**63, 3.5e-320,
                           float("nan"), float("inf"), True, False])
LEAVES = st.one_of(st.none(), NUMBERS, st.integers(-5, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=8), st.sampled_from(["0F", "1B", "2W", "0F0", "(0F1;1B0)OVERLAP_F_B", "F",
                                                         "99999999999999999999F", "1" * 5000 + "F", "", "linear",
                                                         "1f1b", "interleaved-1f1b", "x.json"]))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=6)


_RARELY = st.sampled_from([False] * 9 + [True])
"""True one time in ten (hypothesis draws small integers, index 0 included, far more often)."""


def _paths(value, prefix=()) -> list[tuple]:
    """Every path (keys and indices) into a JSON value, the root included."""
    paths = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += _paths(item, (*prefix, index))
    return paths


def _mutated(document, path: tuple, how: str, value, key: str):
    """``document`` (a deep copy) with the value at ``path`` replaced, dropped, or given a new key."""
    document = json.loads(json.dumps(document))
    if not path:
        return value if how == "replace" else document
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    if how == "replace":
        parent[path[-1]] = value
    elif how == "drop":
        del parent[path[-1]]
    elif how == "add" and isinstance(parent[path[-1]], dict):
        parent[path[-1]][key] = value
    elif how == "add" and isinstance(parent[path[-1]], list):
        parent[path[-1]].append(value)
    return document


@st.composite
def mutated_json(draw, valid: dict) -> str:
    """The JSON text of ``valid`` after one to three mutations, sometimes cut or spliced as text."""
    document = valid
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(document)[1:] or [()]  # the root itself: rarely, below
        path = draw(st.sampled_from(paths)) if draw(_RARELY) is False else ()
        how = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        document = _mutated(document, path, how, draw(VALUES), draw(st.text(max_size=6)))
    text = json.dumps(document)
    if draw(_RARELY):  # a text-level fault: cut, or a character spliced in
        at = draw(st.integers(1, len(text)))
        text = text[:at] + draw(st.sampled_from(["", "\x00", "}", "\"", "1e999", "\ufeff"]))
    return text


# ------------------------------------------------------------------------------ valid documents

SCHEDULE = json.loads(schedule_to_json(build_schedule("zbv", 2, 4)))
OVERLAPPED = json.loads(schedule_to_json(build_schedule("dualpipev", 2, 4)))
PROBLEM = {"num_ranks": 2, "comm_latency": 0.5, "memory_limit": 4, "static_memory": [0, 1],
           "tasks": [t for t in SCHEDULE["tasks"]]}
COSTS = json.loads(costs_to_json(CostTable(
    pieces=(Piece(name="embed", f=1.0, i=0.0, w=2.0, activation_bytes=10, param_bytes=100, output_bytes=8),
            Piece(name="layers.0", f=2.0, i=2.0, w=2.0, activation_bytes=40, w_activation_bytes=10,
                  param_bytes=50, output_bytes=8, inputs=("embed",)),
            Piece(name="head", f=1.0, i=1.0, w=1.0, measured_full_backward=1.5, activation_bytes=20,
                  param_bytes=30)),
    microbatch_size=4, link=Link(latency=0.5, bandwidth=4.0),
    runtime=RuntimeCorrections(replica_link=Link(latency=1.0)))))
PLAN = json.loads(plan_to_json(Plan(num_ranks=2, split_points=("layers.2", "layers.4", "layers.6"),
                                    schedule="zbv", microbatches=4, global_batch=16, predicted_step_time=1.5,
                                    peak_memory=(1e9, 2e9), memory_limit=8e9, bubble_ratio=0.1,
                                    stage_times=(0.1, 0.2, 0.1, 0.2), device="cpu")))
INTERLEAVED_PLAN = {**PLAN, "schedule": "interleaved-1f1b", "schedule_options": {"stages_per_rank": 2}}
CSV = schedule_to_csv(build_schedule("zb-h1", 3, 4))


@pytest.mark.parametrize("reader, valid", [
    (schedule_from_json, SCHEDULE),
    (schedule_from_json, OVERLAPPED),
    (problem_from_json, PROBLEM),
    (costs_from_json, COSTS),
    (plan_from_json, PLAN),
    (plan_from_json, INTERLEAVED_PLAN),
], ids=["schedule", "schedule-overlapped", "problem", "costs", "plan", "plan-options"])
def test_json_readers_load_or_raise_a_pipeloom_error(reader, valid):
    reader(json.dumps(valid))  # the seed itself is valid

    @FUZZ
    @given(mutated_json(valid))
    def check(text):
        loads_or_refuses(reader, text)

    check()


CELLS = st.one_of(st.sampled_from(["0F0", "1B2", "2I0", "0W3", "9F0", "0F99999", "1SEND_F0", "2RECV_B1",
                                   "(0F1;1B0)OVERLAP_F_B", "0UNSHARD", "", " ", "\"", "1F-1", "0X0", "F",
                                   "99999999999999999999F0", "0f0"]),
                  st.text(alphabet="0123456789FBIW_;()SENDRCV\" ,", max_size=8))


@FUZZ
@given(st.data())
def test_torch_csv_reader_loads_or_raises_a_pipeloom_error(data):
    rows = [row.split(",") for row in CSV.splitlines()]
    for _ in range(data.draw(st.integers(1, 4))):
        r = data.draw(st.integers(0, len(rows)))
        if r == len(rows):
            rows.append(data.draw(st.lists(CELLS, max_size=4)))
            continue
        c = data.draw(st.integers(0, len(rows[r])))
        rows[r][c:c + 1] = [data.draw(CELLS)]
    text = "\n".join(",".join(row) for row in rows)
    costs = data.draw(st.sampled_from([Costs(), Costs(f=1e308), Costs(b=1e308, w=1e308), Costs(comm=3.0)]))
    loads_or_refuses(lambda t: schedule_from_csv(t, costs=costs), text)


# ------------------------------------------------------------------------------ the command line

FLAG_VALUES = st.sampled_from(["0", "1", "2", "3", "-1", "0.5", "1e308", "1.7e308", "nan", "inf", "-inf", "",
                               "abc", "80GiB", "1e400", "99999999999999999999", "0x10", " 2"])
SMALL = st.sampled_from(["1", "2", "3", "4"])
HUGE = st.sampled_from(["100000", "99999999999999999999", "-1", "0", "abc"])
COMMANDS = {
    "show": (["show", "1f1b", "-p", "2", "-m", "4"],
             ["--f", "--b", "--w", "--comm", "--memory-limit", "--width", "-p", "-m", "--stages-per-rank"],
             ["1f1b", "zbv", "interleaved-1f1b", "dualpipe", "gpipe", "nope"]),
    "compare": (["compare", "1f1b", "zb-h1", "-p", "2", "-m", "4"],
                ["--f", "--b", "--w", "--comm", "--memory-limit", "-p", "-m"], None),
    # the search's counts stay small (-p, -m and --time-limit drawn from SMALL and the cap-testing huge
    # values only): it overruns its time limit from a few hundred ranks on, which is the search's to fix
    "search": (["search", "--placement", "linear", "-p", "2", "-m", "2", "--time-limit", "0.5", "--workers", "1",
                "--mode", "exact"],
               ["--f", "--b", "--w", "--comm", "--memory-limit", "--w-memory"],
               ["linear", "v", "vshape", "nope"]),
}


def _one_line_or_success(argv: list[str], capsys) -> None:
    with time_bound():
        code = main(argv)
    err = capsys.readouterr().err
    if code == 0:
        return
    lines = err.strip().splitlines()
    assert code in (1, 2), (argv, code, err)
    assert len(lines) == 1 and lines[0].startswith("pipeloom: error: "), (argv, err)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_flags_succeed_or_give_one_error_line(command, capsys):
    base, flags, names = COMMANDS[command]

    counts = st.one_of(st.tuples(st.sampled_from(["-p", "-m"]), st.one_of(SMALL, HUGE)),
                       st.tuples(st.just("--time-limit"), st.sampled_from(["0.5", "0.001", "-1", "nan", "abc"])))
    changes = st.tuples(st.sampled_from(flags), st.one_of(FLAG_VALUES, SMALL))
    if command == "search":
        changes = st.one_of(changes, counts)

    @settings(FUZZ, max_examples=max(1, EXAMPLES * 5 // 8))
    @given(st.lists(changes, min_size=1, max_size=3),
           st.sampled_from(names or [None]), st.booleans())
    def check(changes, name, split):
        argv = list(base)
        if name is not None:
            argv[argv.index(base[1] if command == "show" else "linear")] = name
        for flag, value in changes:
            if flag in argv:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
        if split and command == "search":
            argv.append("--split-backward")
        if command != "search" and "--stages-per-rank" not in argv:
            argv.append("--json")
        _one_line_or_success(argv, capsys)

    check()


@FUZZ
@given(mutated_json(SCHEDULE), st.sampled_from([[], ["--memory-limit", "1"], ["--f", "2"], ["--allow-unordered"]]))
def test_simulate_on_mutated_files_succeeds_or_gives_one_error_line(tmp_path_factory, text, extra):
    path = tmp_path_factory.mktemp("fuzz") / "schedule.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    capsys = _Capture()
    with capsys:
        _one_line_or_success(["simulate", str(path), "--json", *extra], capsys)


class _Capture:
    """A minimal capsys for a hypothesis test (pytest's fixture is function-scoped)."""

    def __enter__(self):
        import io
        import sys

        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
        return self

    def __exit__(self, *exc):
        import sys

        sys.stdout, sys.stderr = self._saved

    def readouterr(self):
        import sys
        from types import SimpleNamespace

        out, err = sys.stdout.getvalue(), sys.stderr.getvalue()
        sys.stdout.seek(0), sys.stdout.truncate(), sys.stderr.seek(0), sys.stderr.truncate()
        return SimpleNamespace(out=out, err=err)


# ------------------------------------------------------------------------------ classes found

@pytest.mark.parametrize("reader, valid, change, words", [
    (costs_from_json, COSTS, lambda d: d["pieces"][0].update(f=10**400), "pieces[0].f: expected a finite number"),
    (plan_from_json, PLAN, lambda d: d.update(predicted_step_time=-10**400), "expected a finite number"),
    (plan_from_json, INTERLEAVED_PLAN, lambda d: d["schedule_options"].update(stages_per_rank="x"),
     "schedule_options.stages_per_rank: expected an integer >= 1"),
    (plan_from_json, INTERLEAVED_PLAN, lambda d: d["schedule_options"].update(stages_per_rank=None),
     "expected an integer >= 1, got None"),
    (schedule_from_json, SCHEDULE, lambda d: d["tasks"][1].update(deps=["1" * 5000 + "F"]),
     "at most 18 digits"),
    (schedule_from_json, SCHEDULE, lambda d: d["tasks"][0].update(duration=1e308),
     "schedule.tasks[0].duration 1e+308: the durations overflow the float range"),
    (problem_from_json, PROBLEM, lambda d: [d["tasks"][k].update(memory=-1.5e308) for k in (2, 3)],
     "problem.tasks[2].memory 1.5e+308: the memory changes overflow"),
], ids=["huge-int-number", "huge-negative-int", "option-string", "option-null", "long-task-name",
        "overflowing-duration", "overflowing-memory"])
def test_classes_the_fuzzing_found_are_refused_with_the_field_named(reader, valid, change, words):
    """Each was an OverflowError, ValueError or TypeError (or a later ``inf``) before."""
    document = json.loads(json.dumps(valid))
    change(document)
    with pytest.raises(PipeloomError) as caught:
        reader(json.dumps(document))
    assert words in str(caught.value)
