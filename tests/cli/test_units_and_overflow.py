"""The command line names where a bad number came from and what unit a limit counts.

Oracles: the exact flag, file and field each error line must name (issue 16): an overflowing cost
names its flag (``--f``) or its file and field (``tasks[0].duration``), never a bare ``inf``;
``--memory-limit`` of show/simulate/compare/search counts micro-batches, so a byte size there points
to ``pipeloom plan``; ``trace`` stages its outputs like every other command.
"""

from __future__ import annotations

import json

import pytest

from pipeloom import build_schedule, simulate
from pipeloom.cli import main
from pipeloom.ir import save_schedule
from pipeloom.trace.format import write_run_trace
from pipeloom.trace.simulated import simulated_run_trace


def one_error_line(capsys, argv, status: int) -> str:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == status, captured.err
    assert captured.out == ""
    assert len(lines) == 1 and lines[0].startswith("pipeloom: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["show", "1f1b", "-p", "2", "-m", "4", "--f", "1e308"], "--f 1e+308 overflows the float range"),
    (["compare", "1f1b", "zbv", "-p", "2", "-m", "4", "--b", "1e308", "--w", "1e308"], "--b 1e+308 (with --w)"),
    (["search", "--placement", "linear", "-p", "2", "-m", "4", "--b", "1e308", "--w", "1e308"],
     "--b 1e+308 (with --w) overflows"),
])
def test_an_overflowing_cost_flag_is_named(capsys, argv, words):
    line = one_error_line(capsys, argv, 2)
    assert words in line and "inf" not in line


def test_an_overflowing_cost_flag_on_a_csv_is_named_before_reading(capsys, tmp_path):
    path = tmp_path / "s.csv"
    save_schedule(build_schedule("1f1b", 2, 4), path)
    line = one_error_line(capsys, ["simulate", path, "--b", "1e308", "--w", "1e308"], 2)
    assert "--b 1e+308 (with --w) overflows" in line and "got inf" not in line


def test_an_overflowing_duration_in_a_schedule_file_names_the_file_and_field(capsys, tmp_path):
    document = json.loads(json.dumps(_schedule_document()))
    document["tasks"][0]["duration"] = 1e308
    path = tmp_path / "big.json"
    path.write_text(json.dumps(document))
    line = one_error_line(capsys, ["simulate", path], 1)
    assert f"{path}: schedule.tasks[0].duration 1e+308: the durations overflow" in line


def test_an_overflowing_problem_file_names_the_file_and_field_for_the_microbatches_asked(capsys, tmp_path):
    tasks = [{"stage": 0, "kind": "F", "ranks": [0], "duration": 1e305},
             {"stage": 0, "kind": "B", "ranks": [0], "duration": 1, "deps": ["0F"]}]
    path = tmp_path / "problem.json"
    path.write_text(json.dumps({"num_ranks": 1, "tasks": tasks}))
    line = one_error_line(capsys, ["search", "--problem", path, "-m", "100000"], 1)
    assert f"{path}: problem.tasks[0].duration 1e+305" in line and "100,000 micro-batches" in line


@pytest.mark.parametrize("command", [["show", "1f1b", "-p", "2", "-m", "4"],
                                     ["compare", "1f1b", "-p", "2", "-m", "4"],
                                     ["search", "--placement", "linear", "-p", "2", "-m", "4"]])
@pytest.mark.parametrize("size", ["80GiB", "512 MB", "1e9B"])
def test_a_byte_size_memory_limit_points_to_plan(capsys, command, size):
    line = one_error_line(capsys, [*command, "--memory-limit", size], 2)
    assert f"{size!r} is a size in bytes, but `pipeloom {command[0]}` counts its limit in" in line
    assert "micro-batches" in line and "pipeloom plan --memory-limit" in line


@pytest.mark.parametrize("command", ["show", "simulate", "compare", "search"])
def test_help_says_the_memory_limit_unit(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("MICRO- BATCHES", "MICRO-BATCHES")  # wrapped
    assert "MICRO-BATCHES" in text and "not bytes" in text


def test_a_limit_error_names_its_unit(capsys):
    line = one_error_line(capsys, ["show", "1f1b", "-p", "4", "-m", "8", "--memory-limit", "1"], 1)
    assert "above the limit 1" in line and "[--memory-limit counts micro-batches of activations, not bytes]" in line


def test_trace_writes_no_output_when_another_output_cannot_be_written(capsys, tmp_path):
    write_run_trace(simulated_run_trace([simulate(build_schedule("1f1b", 2, 4))] * 2), tmp_path / "run")
    merged = tmp_path / "merged.json"
    line = one_error_line(capsys, ["trace", tmp_path / "run", "-o", merged, "--png", "/proc/x.png"], 2)
    assert "cannot write '/proc/x.png'" in line
    assert list(tmp_path.iterdir()) == [tmp_path / "run"]  # neither the merged trace nor a temporary file


def test_trace_help_says_o_is_the_merged_trace(capsys):
    with pytest.raises(SystemExit):
        main(["trace", "--help"])
    assert "the picture is --png" in " ".join(capsys.readouterr().out.split())


def _schedule_document() -> dict:
    from pipeloom.ir import schedule_to_json

    return json.loads(schedule_to_json(build_schedule("1f1b", 2, 4)))
