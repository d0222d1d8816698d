"""Tests of the command line: run ``main([...])`` in-process and compare its numbers with the
closed forms of GPipe/1F1B (docs/design.md §6) and with the library called directly; every bad input
must give one ``pipeloom: error:`` line and a non-zero status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeloom.cli import DEMO_SCHEDULES, main
from pipeloom.ir import save_schedule
from pipeloom.schedules import REGISTRY, build_schedule, schedule_names
from pipeloom.search.placements import PLACEMENTS
from pipeloom.sim import simulate
from pipeloom.stages import Costs


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """Run the CLI in-process; returns (exit status, stdout, stderr)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def assert_one_line_error(result: tuple[int, str, str], status: int, *fragments: str) -> str:
    """Exit ``status``, nothing on stdout, exactly one ``pipeloom: error:`` line on stderr holding
    ``fragments``."""
    code, out, err = result
    lines = err.strip().splitlines()
    assert code == status, err
    assert out == "", out  # refused before any report is printed
    assert len(lines) == 1, err
    assert lines[0].startswith("pipeloom: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


# ------------------------------------------------------------------------------- list and show


def test_list_names_every_registered_schedule_and_a_placements_section(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    for name in schedule_names():
        assert name in out
    assert "Placements" in out
    listing = run_json(capsys, "list")
    assert [entry["name"] for entry in listing["schedules"]] == list(schedule_names())
    assert [entry["name"] for entry in listing["placements"]] == list(PLACEMENTS)


def test_show_json_matches_the_1f1b_closed_form(capsys):
    # docs/design.md §6: 1F1B makespan (m+p-1)(F+B) with B = b+w; rank r holds min(p-r, m) activations.
    p, m, f, b, w = 4, 8, 2.0, 1.0, 3.0
    report = run_json(capsys, "show", "1f1b", "--ranks", str(p), "--microbatches", str(m),
                      "--f", str(f), "--b", str(b), "--w", str(w))
    assert report["name"] == "1f1b"
    assert (report["num_ranks"], report["num_microbatches"]) == (p, m)
    assert report["makespan"] == (m + p - 1) * (f + b + w)
    assert report["busy"] == [m * (f + b + w)] * p
    assert report["lower_bound"] == m * (f + b + w)
    assert report["bubble_ratio"] == pytest.approx(1 - m / (m + p - 1))
    assert report["peak_memory"] == [min(p - r, m) for r in range(p)]
    assert report["num_actions"] == 2 * m * p
    assert report["costs"] == {"f": f, "b": b, "w": w, "comm": 0.0, "memory": 1.0, "w_memory": 0.0}


def test_show_table_prints_makespan_bubble_and_per_rank_rows(capsys):
    code, out, _ = run(capsys, "show", "gpipe", "-p", "3", "-m", "5")
    assert code == 0
    # GPipe, f=b=w=1: makespan (5+3-1)*3 = 21, bubble 1 - 15/21 = 28.57%, every rank holds m = 5.
    assert "21" in out and "28.57%" in out
    assert "per rank" in out and "peak memory" in out


def test_show_matches_the_library_with_communication_and_memory_limit(capsys):
    costs = Costs(f=1.5, b=2.0, w=0.5, comm=0.25)
    direct = simulate(build_schedule("1f1b", 5, 7, costs=costs, memory_limit=5))
    report = run_json(capsys, "show", "1f1b", "-p", "5", "-m", "7", "--f", "1.5", "--b", "2",
                      "--w", "0.5", "--comm", "0.25", "--memory-limit", "5")
    assert report["makespan"] == direct.makespan
    assert report["peak_memory"] == list(direct.peak_memory)
    assert report["memory_limit"] == 5


def test_show_save_json_and_csv_round_trip_through_simulate(capsys, tmp_path):
    saved_json, saved_csv = tmp_path / "s.json", tmp_path / "s.csv"
    shown = run_json(capsys, "show", "1f1b", "-p", "4", "-m", "6", "--f", "2",
                     "--save", str(saved_json))
    run_json(capsys, "show", "1f1b", "-p", "4", "-m", "6", "--f", "2", "--save", str(saved_csv))
    from_json = run_json(capsys, "simulate", str(saved_json))
    from_csv = run_json(capsys, "simulate", str(saved_csv), "--f", "2")
    for report in (from_json, from_csv):
        assert report["makespan"] == shown["makespan"]
        assert report["peak_memory"] == shown["peak_memory"]
    assert from_json["costs"] is None and from_csv["costs"]["f"] == 2.0


def test_stages_per_rank_reaches_interleaved_1f1b(capsys):
    # docs/design.md §6: interleaved 1F1B bubble (p-1)(F+B)/v; p | m, so makespan m(F+B) + (p-1)(F+B)/v.
    p, m, v = 4, 8, 3
    report = run_json(capsys, "show", "interleaved-1f1b", "-p", str(p), "-m", str(m),
                      "--stages-per-rank", str(v))
    assert report["makespan"] == pytest.approx(m * 3 + (p - 1) * 3 / v)
    assert report["num_actions"] == 2 * m * p * v


@pytest.mark.parametrize("argv", [["zbv"], ["interleaved-1f1b", "--stages-per-rank", "3"]])
def test_csv_round_trip_gives_each_stage_its_rank_share(capsys, tmp_path, argv):
    # A CSV carries no costs: with v stages on a rank, each gets 1/v of the --f/--b/--w share,
    # so the CSV replays the schedule exactly as the generator built it.
    saved = tmp_path / "s.csv"
    costs = ["--f", "1.5", "--b", "2", "--w", "0.7", "--comm", "0.1"]
    shown = run_json(capsys, "show", *argv, "-p", "4", "-m", "8", *costs, "--save", str(saved))
    replayed = run_json(capsys, "simulate", str(saved), *costs)
    assert replayed["makespan"] == shown["makespan"]
    assert replayed["peak_memory"] == shown["peak_memory"]
    assert replayed["busy"] == shown["busy"]


def test_simulate_reads_a_hand_written_torch_csv_with_costs_from_flags(capsys, tmp_path):
    # Two ranks, split backward: makespan by hand = F0 F0' ... see the closed timeline below.
    path = tmp_path / "zb.csv"
    path.write_text("0F0,0F1,0I0,0W0,0I1,0W1\n,1F0,1I0,1F1,1I1,1W0,1W1\n")
    report = run_json(capsys, "simulate", str(path), "--f", "1", "--b", "1", "--w", "1")
    # rank1: 1F0 [1,2] 1I0 [2,3] 1F1 [3,4] 1I1 [4,5] 1W0 [5,6] 1W1 [6,7]
    # rank0: 0F0 [0,1] 0F1 [1,2] 0I0 [3,4] 0W0 [4,5] 0I1 [5,6] 0W1 [6,7]
    assert report["makespan"] == 7.0
    assert report["busy"] == [6.0, 6.0]


def test_simulate_rejects_unordered_backwards_unless_allowed(capsys, tmp_path):
    path = tmp_path / "unordered.csv"
    path.write_text("0F0,0F1,0B1,0B0\n")
    assert_one_line_error(run(capsys, "simulate", str(path)), 1, "micro-batch order")
    report = run_json(capsys, "simulate", str(path), "--allow-unordered")
    assert report["makespan"] == 6.0


# ------------------------------------------------------------------------------------ compare


def test_compare_rows_match_closed_forms_and_mark_the_best(capsys):
    result = run_json(capsys, "compare", "gpipe", "1f1b", "-p", "4", "-m", "8")
    rows = {row["name"]: row for row in result["schedules"]}
    assert rows["gpipe"]["makespan"] == rows["1f1b"]["makespan"] == 33.0
    assert rows["gpipe"]["relative_makespan"] == rows["1f1b"]["relative_makespan"] == 1.0
    assert max(rows["gpipe"]["peak_memory"]) == 8 and max(rows["1f1b"]["peak_memory"]) == 4


def test_compare_gives_a_row_to_a_schedule_that_cannot_be_built(capsys):
    code, out, _ = run(capsys, "compare", "1f1b", "gpipe", "-p", "4", "-m", "8", "--memory-limit", "4")
    assert code == 0 and "not built" in out
    rows = {row["name"]: row for row in run_json(
        capsys, "compare", "1f1b", "gpipe", "-p", "4", "-m", "8", "--memory-limit", "4")["schedules"]}
    assert "above the limit" in rows["gpipe"]["error"]  # GPipe holds m = 8 > 4
    assert rows["1f1b"]["makespan"] == 33.0


def test_compare_with_dualpipe_on_odd_ranks_keeps_the_other_rows(capsys):
    result = run_json(capsys, "compare", "1f1b", "dualpipe", "-p", "3", "-m", "6")
    rows = {row["name"]: row for row in result["schedules"]}
    assert rows["1f1b"]["makespan"] == (6 + 3 - 1) * 3
    assert "error" in rows["dualpipe"] and "cannot be imported" not in rows["dualpipe"]["error"]


def test_compare_fails_when_no_schedule_can_be_built(capsys):
    result = run(capsys, "compare", "1f1b", "gpipe", "-p", "4", "-m", "8", "--memory-limit", "0.5")
    assert_one_line_error(result, 1, "no schedule could be built", "1f1b", "gpipe")


# ------------------------------------------------------------------------------------ pictures


def test_show_writes_png_svg_trace_and_terminal_view(capsys, tmp_path):
    from pipeloom import viz

    png, svg, trace = tmp_path / "t.png", tmp_path / "t.svg", tmp_path / "t.json"
    code, out, err = run(capsys, "show", "1f1b", "-p", "4", "-m", "8", "-o", str(png),
                         "--trace", str(trace), "--terminal", "--width", "90")
    assert code == 0, err
    assert png.read_bytes().startswith(b"\x89PNG")
    assert json.loads(trace.read_text())  # a trace is a non-empty JSON document
    view = viz.render_timeline_rich(simulate(build_schedule("1f1b", 4, 8)), width=90).plain
    assert all(line.rstrip() in out for line in view.splitlines() if line.strip())
    assert run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "-o", str(svg))[0] == 0
    assert "<svg" in svg.read_text()


def test_compare_writes_the_comparison_figure(capsys, tmp_path):
    figure = tmp_path / "compare.png"
    code, _, err = run(capsys, "compare", "gpipe", "1f1b", "-p", "4", "-m", "8", "-o", str(figure))
    assert code == 0, err
    assert figure.read_bytes().startswith(b"\x89PNG")


def test_demo_writes_its_files_and_a_summary_with_the_command(capsys, tmp_path):
    out_dir = tmp_path / "demo"
    code, out, err = run(capsys, "demo", "--out", str(out_dir))
    assert code == 0, err
    assert (out_dir / "compare.png").read_bytes().startswith(b"\x89PNG")
    timelines = list(out_dir.glob("timeline-*.png"))
    traces = list(out_dir.glob("trace-*.json"))
    assert len(timelines) == len(traces) == 1
    summary = (out_dir / "summary.md").read_text()
    assert f"pipeloom demo --out {out_dir}" in summary and "pipeloom compare" in summary
    for name in DEMO_SCHEDULES:
        assert f"| {name} |" in summary
    best = timelines[0].stem.removeprefix("timeline-")
    assert f"| {best} |" in summary and str(out_dir / "compare.png") in out


# -------------------------------------------------------------------------------------- errors


def test_unknown_schedule_lists_the_valid_names(capsys):
    line = assert_one_line_error(run(capsys, "show", "pipedream", "-p", "2", "-m", "2"), 2)
    for name in schedule_names():
        assert name in line


def test_unknown_schedule_in_compare_is_a_usage_error(capsys):
    assert_one_line_error(run(capsys, "compare", "1f1b", "nope", "-p", "2", "-m", "2"), 2, "'nope'")


def test_missing_file(capsys, tmp_path):
    assert_one_line_error(run(capsys, "simulate", str(tmp_path / "none.json")), 1, "none.json")


def test_malformed_json(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "pipeloom.schedule/1", "tasks": [')
    assert_one_line_error(run(capsys, "simulate", str(path)), 1, "malformed JSON")


def test_json_of_another_format(capsys, tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"format": "other/2"}')
    assert_one_line_error(run(capsys, "simulate", str(path)), 1, "pipeloom.schedule/1")


def test_malformed_csv(capsys, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0X0\n")
    assert_one_line_error(run(capsys, "simulate", str(path)), 1, "row 1, column 2")


def test_schedule_file_of_unknown_suffix(capsys, tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("0F0\n")
    assert_one_line_error(run(capsys, "simulate", str(path)), 1, ".json")


def test_deadlocked_csv_names_the_stuck_action(capsys, tmp_path):
    path = tmp_path / "deadlock.csv"
    path.write_text("0F0,0B1,0F1,0B0\n")
    assert_one_line_error(run(capsys, "simulate", str(path)), 1, "deadlock", "0B1")
    code, _, err = run(capsys, "--verbose", "simulate", str(path))
    assert code == 1 and "<-- here" in err  # --verbose adds the validator's step x rank grid


def test_cost_flags_on_a_json_schedule_are_a_usage_error(capsys, tmp_path):
    path = tmp_path / "s.json"
    save_schedule(build_schedule("1f1b", 2, 2), path)
    assert_one_line_error(run(capsys, "simulate", str(path), "--f", "2"), 2, "--f", "CSV")


def test_dualpipe_with_odd_ranks(capsys):
    line = assert_one_line_error(run(capsys, "show", "dualpipe", "-p", "3", "-m", "4"), 1, "dualpipe")
    assert "cannot be imported" not in line  # the generator itself must refuse odd ranks


def test_memory_limit_no_schedule_can_meet(capsys):
    result = run(capsys, "show", "1f1b", "-p", "4", "-m", "8", "--memory-limit", "2")
    assert_one_line_error(result, 1, "above the limit 2", "--verbose")


@pytest.mark.parametrize("flag", ["--f", "--b", "--w", "--comm", "--memory-limit"])
def test_negative_or_non_finite_costs(capsys, flag):
    for value in ("-1", "nan", "inf", "abc"):
        assert_one_line_error(run(capsys, "show", "1f1b", "-p", "2", "-m", "2", f"{flag}={value}"), 2, flag)


@pytest.mark.parametrize("counts", [("0", "2"), ("2", "0"), ("2", "1.5")])
def test_non_positive_counts(capsys, counts):
    result = run(capsys, "show", "1f1b", "--ranks", counts[0], "--microbatches", counts[1])
    assert_one_line_error(result, 2, "positive integer")


@pytest.mark.parametrize("argv", [
    ["show", "1f1b", "-p", "2", "-m", "2", "-o", "t.pdf"],
    ["show", "1f1b", "-p", "2", "-m", "2", "--trace", "t.txt"],
    ["show", "1f1b", "-p", "2", "-m", "2", "--save", "s.yaml"],
    ["compare", "1f1b", "-p", "2", "-m", "2", "-o", "c.jpg"],
])
def test_bad_output_suffix(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run(capsys, *argv), 2, "file name")
    assert list(tmp_path.iterdir()) == []  # rejected before anything is written


def test_stages_per_rank_only_for_schedules_that_take_it(capsys):
    result = run(capsys, "show", "gpipe", "-p", "2", "-m", "2", "--stages-per-rank", "2")
    assert_one_line_error(result, 2, "--stages-per-rank", "interleaved-1f1b")


def test_missing_command_and_missing_required_flags(capsys):
    assert_one_line_error(run(capsys), 2, "COMMAND")
    assert_one_line_error(run(capsys, "show", "1f1b", "-m", "2"), 2, "--ranks")


@pytest.mark.parametrize("flag", ["-o", "--trace", "--save"])
def test_output_in_a_missing_folder_is_refused_before_the_report(capsys, tmp_path, flag):
    suffix = {"-o": ".PNG", "--trace": ".json", "--save": ".Csv"}[flag]  # suffixes in any case
    target = tmp_path / "no" / "such" / f"x{suffix}"
    result = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", flag, str(target))
    assert_one_line_error(result, 2, flag, "does not exist")
    assert not (tmp_path / "no").exists()


def test_output_under_a_file_or_onto_a_folder_is_refused(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "dir.svg").mkdir()
    under_file = run(capsys, "simulate", "x.csv", "--trace", str(tmp_path / "file" / "t.json"))
    assert_one_line_error(under_file, 2, "--trace", "is not a folder")
    onto_folder = run(capsys, "compare", "1f1b", "-p", "2", "-m", "2", "-o", str(tmp_path / "dir.svg"))
    assert_one_line_error(onto_folder, 2, "-o/--out", "is a folder")


def test_two_outputs_naming_one_file_are_refused_before_anything_is_written(capsys, tmp_path, monkeypatch):
    """``--save same.json --perfetto same.json`` had written both and kept the trace alone, the schedule lost."""
    monkeypatch.chdir(tmp_path)
    same = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--save", "same.json", "--perfetto", "./same.json")
    assert_one_line_error(same, 2, "both write 'same.json'", "give each output a file of its own")
    assert not list(tmp_path.iterdir())
    # one output option given twice had written only the last file, without a word
    twice = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "-o", "a.png", "-o", "b.svg")
    assert_one_line_error(twice, 2, "-o is given twice ('a.png' and 'b.svg') and writes one file; give it once")
    assert not list(tmp_path.iterdir())
    assert run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "-p", "4")[0] == 0  # other options: the last counts


@pytest.mark.parametrize("name", ["dualpipe", "chimera"])
def test_a_saved_two_replica_schedule_reports_as_show_did(capsys, tmp_path, name):
    """The file counts pairs (docs/format.md); ``simulate`` had reported 4 micro-batches where ``show`` said 8."""
    path = str(tmp_path / "s.json")
    code, out, _ = run(capsys, "show", name, "-p", "4", "-m", "8", "--json", "--save", path)
    shown = json.loads(out)
    code, out, _ = run(capsys, "simulate", path, "--json")
    again = json.loads(out)
    assert code == 0 and (again["num_microbatches"], again["schedule_microbatches"]) == (8, 4)
    assert {k: again[k] for k in ("num_microbatches", "schedule_microbatches", "makespan")} == {
        k: shown[k] for k in ("num_microbatches", "schedule_microbatches", "makespan")}


def test_width_without_the_terminal_view_is_refused(capsys):
    """``--width`` alone had drawn nothing and said nothing."""
    assert_one_line_error(run(capsys, "show", "1f1b", "-p", "3", "-m", "4", "--width", "50"), 2,
                          "--width sets the --terminal view's width: add --terminal")
    assert run(capsys, "show", "1f1b", "-p", "3", "-m", "4", "--width", "50", "--terminal")[0] == 0


@pytest.mark.parametrize("folder", ["file/sub", "file"])
def test_demo_folder_that_cannot_be_created_is_refused_first(capsys, tmp_path, monkeypatch, folder):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr("pipeloom.cli.demo.compare_schedules", pytest.fail)  # nothing may be built
    assert_one_line_error(run(capsys, "demo", "--out", str(tmp_path / folder)), 2, "--out", "cannot create")


@pytest.mark.parametrize("argv", [
    ["show", "1f1b", "-p", "4", "-m", "100000000000"],
    ["show", "interleaved-1f1b", "-p", "4", "-m", "8", "--stages-per-rank", "100000000"],
    ["compare", "gpipe", "zbv", "-p", "60000", "-m", "100000"],
])
def test_huge_inputs_are_refused_before_building(capsys, monkeypatch, argv):
    monkeypatch.setattr("pipeloom.cli.schedules.build_schedule", pytest.fail)
    assert_one_line_error(run(capsys, *argv), 2, "actions, above the limit of 10,000,000", "use fewer")


def test_size_limit_counts_ranks_microbatches_stages_and_kinds(capsys, monkeypatch):
    # the schedule's own count, stages x m x kinds: 1f1b p=4 holds 4 stages (it had been counted as 2 a rank),
    # m=8 -> 4*8*2 = 64 (F and B); zb-h1 splits the backward (F, I, W): 4*8*3 = 96; interleaved v=3: 12*4*2 = 96;
    # zbv holds 2 a rank: 8*4*3 = 96; dualpipe's two replicas take half the micro-batches each: 2*4*4*3 = 96.
    monkeypatch.setattr("pipeloom.cli.schedules.MAX_ACTIONS", 64)
    assert run(capsys, "show", "1f1b", "-p", "4", "-m", "8")[0] == 0
    assert_one_line_error(run(capsys, "show", "1f1b", "-p", "4", "-m", "9"), 2, "about 72 actions")
    assert_one_line_error(run(capsys, "show", "zb-h1", "-p", "4", "-m", "8"), 2, "about 96 actions")
    result = run(capsys, "show", "interleaved-1f1b", "-p", "4", "-m", "4", "--stages-per-rank", "3")
    assert_one_line_error(result, 2, "v=3", "about 96 actions")
    assert_one_line_error(run(capsys, "show", "zbv", "-p", "4", "-m", "4"), 2, "about 96 actions")
    assert_one_line_error(run(capsys, "show", "dualpipe", "-p", "4", "-m", "8"), 2, "about 96 actions")
    for name, options in (("1f1b", {}), ("zbv", {}), ("dualpipe", {}), ("interleaved-1f1b", {"stages_per_rank": 3})):
        built = build_schedule(name, 4, 8, **options)  # the count is exact: (task, micro-batch) pairs
        assert len(built.problem.tasks) * built.num_microbatches == REGISTRY[name].num_actions(4, 8, options), name


def test_out_of_memory_is_one_line(capsys, monkeypatch):
    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr("pipeloom.cli.schedules.build_schedule", exhausted)
    assert_one_line_error(run(capsys, "show", "1f1b", "-p", "2", "-m", "2"), 1, "out of memory", "fewer")


# ------------------------------------------------------------- errors from generators and files


def test_zbv_memory_limit_below_one_microbatch(capsys):
    result = run(capsys, "show", "zbv", "-p", "4", "-m", "8", "--memory-limit", "0.5")
    assert_one_line_error(result, 1, "zbv", "0.5")


def test_dualpipev_with_fewer_than_2p_microbatches(capsys):
    assert_one_line_error(run(capsys, "show", "dualpipev", "-p", "4", "-m", "7"), 1, "dualpipev", "8")


def test_dualpipe_with_odd_microbatches(capsys):
    assert_one_line_error(run(capsys, "show", "dualpipe", "-p", "4", "-m", "7"), 1, "dualpipe", "even")


def _saved_json(tmp_path, **changes) -> str:
    path = tmp_path / "s.json"
    save_schedule(build_schedule("1f1b", 2, 2), path)
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return str(path)


def test_json_with_an_unknown_top_level_key(capsys, tmp_path):
    assert_one_line_error(run(capsys, "simulate", _saved_json(tmp_path, colour="red")), 1, "colour")


def test_json_with_a_static_memory_that_is_not_a_list(capsys, tmp_path):
    # static_memory is one number per rank; a bare number must be a format error, not a traceback
    code, out, err = run(capsys, "simulate", _saved_json(tmp_path, static_memory=5))
    assert code != 0 and out == ""
    assert err.startswith("pipeloom: error: ") and len(err.strip().splitlines()) == 1, err


def test_csv_with_a_garbage_cell(capsys, tmp_path):
    path = tmp_path / "garbage.csv"
    path.write_text("0F0,hello\n")
    assert_one_line_error(run(capsys, "simulate", str(path)), 1, "row 1, column 2", "'hello'")


@pytest.mark.parametrize("name", ["empty.csv", "empty.json"])
def test_empty_file(capsys, tmp_path, name):
    path = tmp_path / name
    path.write_text("")
    assert_one_line_error(run(capsys, "simulate", str(path)), 1)


@pytest.mark.parametrize("name", ["binary.csv", "binary.json"])
def test_binary_file(capsys, tmp_path, name):
    path = tmp_path / name
    path.write_bytes(bytes(range(256)))
    assert_one_line_error(run(capsys, "simulate", str(path)), 1, name, "not UTF-8 text")


def test_saving_dualpipe_as_csv_is_refused(capsys, tmp_path):
    # torch's CSV has no room for DualPipe's two replicas; ir.save_schedule refuses it and the
    # CLI writes files before printing, so the refusal leaves stdout empty.
    code, out, err = run(capsys, "show", "dualpipe", "-p", "4", "-m", "8", "--save", str(tmp_path / "x.csv"))
    assert code != 0 and out == ""
    assert err.startswith("pipeloom: error: ") and len(err.strip().splitlines()) == 1, err


def test_help_documents_the_cost_convention(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["show", "--help"])
    assert exit_info.value.code == 0
    assert "ONE RANK'S SHARE" in capsys.readouterr().out


# ------------------------------------------------------------------------------ entry point


def test_python_dash_m_entry_point_runs_in_a_fresh_process(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "pipeloom", "show", "1f1b", "-p", "2", "-m", "3", "--json"],
                        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["makespan"] == (3 + 2 - 1) * 3
    bad = subprocess.run([sys.executable, "-m", "pipeloom", "show", "nope", "-p", "2", "-m", "2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith("pipeloom: error: unknown schedule 'nope'")


def test_a_reader_closing_the_pipe_early_ends_the_command_quietly(monkeypatch, capsys):
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write fails with EPIPE
    with open(write_end, "w", buffering=1) as closed:
        monkeypatch.setattr("sys.stdout", closed)
        assert main(["list", "--json"]) == 0
        closed.write("x" * 10)  # stdout now goes to the null device: the exit's flush cannot fail
        closed.flush()
    assert capsys.readouterr().err == ""


def test_version_and_verbose_after_the_command(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("pipeloom ")
    argv = ["show", "1f1b", "--ranks", "2", "--microbatches", "2", "--memory-limit", "0.5"]
    assert main(argv) == 1
    short = capsys.readouterr().err
    assert "(add --verbose for details)" in short and len(short.strip().splitlines()) == 1
    for verbose in (["--verbose", *argv], [*argv, "--verbose"], [*argv, "-v"]):
        assert main(verbose) == 1
        assert "<-- here" in capsys.readouterr().err  # the validator's grid


def test_compare_refuses_a_schedule_named_twice(capsys):
    assert main(["compare", "1f1b", "zbv", "1f1b", "--ranks", "4", "--microbatches", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "'1f1b' is named twice" in captured.err


def test_outputs_are_all_written_or_none(capsys, tmp_path, monkeypatch):
    saved, picture = tmp_path / "ok.json", tmp_path / "x.png"
    # an unwritable place fails before any work, naming the path; nothing is written
    argv = ["show", "1f1b", "--ranks", "2", "--microbatches", "4", "--save", str(saved)]
    assert main([*argv, "-o", "/proc/x.png"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot write '/proc/x.png'" in captured.err
    assert list(tmp_path.iterdir()) == []
    # a failure while writing the second file leaves neither
    import pipeloom.viz

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeloom.viz, "draw_timeline", broken)
    assert main([*argv, "-o", str(picture)]) == 1
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert main([*argv, "-o", str(picture)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json", "x.png"]
    assert oct(saved.stat().st_mode & 0o777) != oct(0o600)  # a new file's usual permissions, not mkstemp's


def test_a_reader_that_goes_away_keeps_the_files_the_report_follows(tmp_path):
    """`pipeloom show ... -o x.png | head -1`: the report's reader goes away (here before the report, so that its
    first write fails); the picture and schedule, written before the report, are kept and the exit is 0 (rich had
    exited 1 there, and the files were dropped)."""
    picture, saved = tmp_path / "x.png", tmp_path / "s.json"
    command = [sys.executable, "-m", "pipeloom", "show", "1f1b", "--ranks", "4", "--microbatches", "8", "-o",
               str(picture), "--save", str(saved)]
    shown = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert shown.stdout is not None
    shown.stdout.close()  # the reader gone before the report is printed
    assert shown.wait(timeout=120) == 0, shown.stderr.read() if shown.stderr else ""
    assert picture.stat().st_size > 0 and json.loads(saved.read_text())["format"].startswith("pipeloom.schedule")


def test_an_argument_no_option_takes_points_to_its_commands_help(capsys):
    """It had pointed to `pipeloom --help`, which does not list show's options."""
    assert main(["show", "1f1b", "--ranks", "2", "--microbatches", "4", "--bogus"]) == 2
    assert capsys.readouterr().err.strip() == ("pipeloom: error: unrecognized arguments: --bogus (see `pipeloom show "
                                               "--help`)")


def test_too_many_ranks_are_refused_before_building(capsys):
    assert main(["show", "1f1b", "--ranks", "1000000", "--microbatches", "1"]) == 2
    assert "above the limit of 65,536 ranks" in capsys.readouterr().err


def test_the_cli_starts_without_its_heavy_dependencies():
    """``import pipeloom.cli`` loads none of OR-Tools (with pandas, 0.4 s), torch, numpy or the cluster planner: each
    command imports what it uses, so ``pipeloom plan --model`` starts in about half the time it took when the
    schedule commands' action cap was read from the search module."""
    heavy = ("ortools", "pandas", "torch", "numpy", "transformers", "pipeloom.plan.cluster")
    code = f"import sys, pipeloom.cli; print([m for m in {heavy!r} if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
