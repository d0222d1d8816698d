"""``pipeloom trace`` on synthetic runs (trace files written from a simulated 1F1B, 1 time unit =
1 ms): the report must show measured = predicted (ratio 1) and the library's numbers, write a valid
merged Perfetto trace and a PNG, and refuse bad input with one line before doing any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeloom import Costs, build_schedule, simulate
from pipeloom.cli import main
from pipeloom.trace.analysis import compare_run
from pipeloom.trace.format import write_run_trace
from pipeloom.trace.reader import load_run_trace
from pipeloom.trace.simulated import simulated_run_trace
from pipeloom.trace.summary import trace_summary

SCHEDULE = build_schedule("1f1b", 2, 4, costs=Costs(comm=0.5))
MAKESPAN_MS = simulate(SCHEDULE).makespan  # 1 unit = 1 ms


@pytest.fixture
def run_folder(tmp_path: Path) -> Path:
    timeline = simulate(SCHEDULE)
    write_run_trace(simulated_run_trace([timeline] * 3), tmp_path / "run")
    return tmp_path / "run"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(result, status: int, *fragments: str) -> None:
    code, out, err = result
    lines = err.strip().splitlines()
    assert code == status, err
    assert out == ""
    assert len(lines) == 1 and lines[0].startswith("pipeloom: error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


def test_table_shows_measured_and_predicted_step_time_and_their_ratio(capsys, run_folder):
    code, out, err = run(capsys, "trace", run_folder)
    assert code == 0, err
    assert "measured / predicted" in out and "1.000" in out
    assert f"{MAKESPAN_MS:,.3f} ms" in out  # measured and predicted step time
    assert "2 of 3 (left out: step 0)" in out  # the warm-up step
    assert "0.500 ms" in out  # the comm latency the run was simulated with
    for header in ("recv wait", "pred. busy", "pred. idle", "median task time"):
        assert header in out
    rank1 = next(line for line in out.splitlines() if line.startswith("│    1 │"))
    # busy 12, idle 5 = 17 - 12, recv wait 2.5 (rank 1 waits only until its last action), send 0
    assert [cell.strip() for cell in rank1.split("│")[2:8]] == ["12.000", "5.000", "2.500", "0.000",
                                                               "12.000", "5.000"]


def test_json_matches_the_library(capsys, run_folder):
    code, out, err = run(capsys, "trace", run_folder, "--json", "--steps", "all")
    assert code == 0, err
    report = json.loads(out)
    expected = trace_summary(compare_run(load_run_trace(run_folder), steps="all"))
    assert report == json.loads(json.dumps(expected))
    assert report["steps_used"] == [0, 1, 2]
    assert report["ratio"] == pytest.approx(1.0)
    assert report["measured_step_time"] == pytest.approx(MAKESPAN_MS * 1e-3)


def test_writes_merged_trace_and_picture(capsys, run_folder, tmp_path):
    merged, picture = tmp_path / "merged.json", tmp_path / "side.png"
    files = [run_folder / "rank1.json", run_folder / "rank0.json"]
    code, out, err = run(capsys, "trace", *files, "-o", merged, "--png", picture, "--step", 2)
    assert code == 0, err
    trace = json.loads(merged.read_text())
    processes = sorted(e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name")
    assert processes == ["measured rank 0", "measured rank 1", "predicted rank 0", "predicted rank 1"]
    assert trace["otherData"]["step_shown"] == 2
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote merged trace {merged}" in out and f"wrote picture {picture}" in out


def test_missing_path_is_a_usage_error_before_any_work(capsys, run_folder, tmp_path):
    merged = tmp_path / "merged.json"
    result = run(capsys, "trace", run_folder, tmp_path / "nope", "-o", merged)
    assert_one_line_error(result, 2, "does not exist")
    assert not merged.exists()


def test_incomplete_run_fails_with_one_line_and_writes_nothing(capsys, run_folder, tmp_path):
    (run_folder / "rank1.json").unlink()
    merged = tmp_path / "merged.json"
    assert_one_line_error(run(capsys, "trace", run_folder, "-o", merged), 1, "missing rank1.json")
    assert not merged.exists()


def test_a_folder_without_trace_files(capsys, tmp_path):
    assert_one_line_error(run(capsys, "trace", tmp_path), 1, "no rank<N>.json files", "record=")


@pytest.mark.parametrize("argv, fragment", [
    (["-o", "merged.txt"], "use a .json file name"),
    (["--png", "side.jpg"], "use a .png or .svg file name"),
    (["-o", "missing/merged.json"], "does not exist; create it first"),
    (["--steps", "first"], "invalid choice"),
    (["--step", "7"], "step 7 is not in the trace"),
])
def test_bad_options_are_usage_errors(capsys, run_folder, tmp_path, monkeypatch, argv, fragment):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run(capsys, "trace", run_folder, *argv), 2, fragment)


def test_help_lists_the_trace_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "trace" in capsys.readouterr().out
