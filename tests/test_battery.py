"""The reliability battery (docs/limits.md): oversized inputs end with an answer or one clear error instead of
running for minutes, and the schedule readers refuse what is no text or no path with pipeloom's exception.

The commands run as subprocesses under a timeout that only catches a hang (the machine running the tests
may be loaded); how long each takes is measured by ``benchmarks/battery.py``, against 20 s."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from battery_inputs import BATTERY_COMMANDS, chain_problem_file, cost_table_file, write_inputs
from pipeloom.errors import PipeloomError, ScheduleFormatError
from pipeloom.ir import load_schedule, save_schedule, schedule_from_csv, schedule_from_json
from pipeloom.plan.costs.file import MAX_PIECES, load_costs
from pipeloom.plan.planner import plan_pipeline
from pipeloom.schedules import build_schedule
from pipeloom.search import search
from pipeloom.search.problem_file import MAX_SEARCH_TASKS
from pipeloom.sim import simulate
from pipeloom.stages import Stage, stage_graph
from pipeloom.viz import draw_timeline

ROOT = Path(__file__).resolve().parent.parent
HANG = 240
"""Seconds after which a command counts as hung (the target is 20 s on an unloaded machine)."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("battery")
    write_inputs(folder)
    return folder


def _pipeloom(folder: Path, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "pipeloom", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=HANG)


@pytest.mark.parametrize(("what", "args", "status"), BATTERY_COMMANDS, ids=[c[0] for c in BATTERY_COMMANDS])
def test_each_battery_command_ends_with_an_answer_or_one_clear_error(inputs, what, args, status):
    done = _pipeloom(inputs, args)
    assert done.returncode == status, done.stderr
    if status:
        lines = done.stderr.strip().splitlines()
        assert done.stdout == "" and len(lines) == 1 and lines[0].startswith("pipeloom: error: ")
        assert "limit" in lines[0]
    else:
        assert done.stdout.strip(), done.stderr
    if "-o" in args:
        assert (inputs / args[args.index("-o") + 1]).stat().st_size > 0


def test_the_refusals_name_the_limit_and_the_fix(inputs):
    assert "20,000 (its bounds grow" in _pipeloom(inputs, BATTERY_COMMANDS[0][1]).stderr
    assert "1,000,000 ranks is above the limit of 65,536 ranks" in _pipeloom(inputs, BATTERY_COMMANDS[1][1]).stderr
    assert "100,000 pieces, above the limit of 10,000; profile coarser" in \
        _pipeloom(inputs, BATTERY_COMMANDS[3][1]).stderr
    wide = _pipeloom(inputs, ("show", "gpipe", "--ranks", "4096", "--microbatches", "1", "-o", "wide.png"))
    assert wide.returncode == 2 and "4,096 rank rows is above the limit of 2,048" in wide.stderr


def test_a_plan_past_its_time_limit_answers_with_the_candidates_tried(inputs):
    done = _pipeloom(inputs, ("plan", "--costs", "small.json", "--ranks", "4", "--global-batch", str(10**12),
                              "--time-limit", "0.01"))
    assert done.returncode == 0, done.stderr
    assert "--time-limit 0.01 s reached" in done.stdout and "candidate(s) left untried" in done.stdout


def test_plan_pipeline_stops_at_its_deadline_after_one_candidate(inputs):
    table = load_costs(inputs / "small.json")
    everything = plan_pipeline(table, num_ranks=4, global_batch=8)
    assert everything.untried == 0
    cut = plan_pipeline(table, num_ranks=4, global_batch=8, deadline=time.perf_counter() - 1)
    assert len(cut.candidates) == 1 and cut.untried == len(everything.candidates) - 1


def test_stages_beyond_the_pieces_are_refused_without_building_them(inputs):
    table = load_costs(inputs / "small.json")
    result = plan_pipeline(table, num_ranks=4, global_batch=8, schedules=["interleaved-1f1b", "1f1b"],
                           stages_per_rank=[1000], microbatches=[8])
    looped = next(c for c in result.candidates if c.schedule == "interleaved-1f1b")
    assert looped.reason == "too many stages: 4000 stages (4 ranks x 1000 per rank) for 8 pieces"
    assert result.plan.schedule == "1f1b"


def test_the_library_caps_hold_outside_the_command_line(tmp_path):
    with pytest.raises(PipeloomError, match=f"above the limit of {MAX_PIECES:,}"):
        load_costs(cost_table_file(tmp_path / "big.json", MAX_PIECES + 1))
    tasks = MAX_SEARCH_TASKS // 2 + 1
    with pytest.raises(PipeloomError, match=f"{2 * tasks:,} tasks per micro-batch, above the search's limit"):
        search(stage_graph([Stage(ranks=s % 4) for s in range(tasks)]), 2, time_limit=1)
    with pytest.raises(ScheduleFormatError, match="above the search's limit"):
        from pipeloom.search import load_problem

        load_problem(chain_problem_file(tmp_path / "p.json", tasks))
    wide = build_schedule("gpipe", 2049, 1)
    with pytest.raises(PipeloomError, match="2,049 ranks is above the limit of 2,048 rank rows"):
        draw_timeline(simulate(wide), tmp_path / "wide.png")


@pytest.mark.parametrize(("call", "argument", "message"), [
    (load_schedule, 123, r"expected a file path \(a str or pathlib.Path\), got 123 \(int\)"),
    (load_schedule, None, r"expected a file path .*got None \(NoneType\)"),
    (schedule_from_json, None, r"the schedule file must be text \(str\), got None"),
    (schedule_from_csv, b"0F0,1F0\n", r"the CSV must be text \(str\), got bytes; decode it first"),
    (schedule_from_csv, 7, r"the CSV must be text \(str\), got 7 \(int\)"),
])
def test_the_readers_refuse_what_is_no_text_or_no_path(call, argument, message):
    with pytest.raises(ScheduleFormatError, match=message):
        call(argument)


def test_save_schedule_refuses_no_path_and_json_still_reads_bytes():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleFormatError, match="expected a file path"):
        save_schedule(schedule, 5)
    from pipeloom.ir import schedule_to_json

    assert schedule_from_json(schedule_to_json(schedule).encode()) == schedule
