"""``pipeloom show NAME --with-comms``: the lowered schedule reported, drawn, saved and read back.

Oracles: the library (``lower`` then ``validate``), the closed-form count of a lowered 1F1B's actions
(2 compute actions per stage and micro-batch, 4 communication actions per chain edge and micro-batch),
and ``pipeloom simulate`` of the saved compute_comms CSV.
"""

from __future__ import annotations

import json

import pytest

from pipeloom import lower, validate
from pipeloom.cli import main
from pipeloom.schedules import build_schedule
from pipeloom.stages import Costs


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_show_with_comms_reports_and_draws_the_lowered_schedule(capsys, tmp_path):
    png, trace, csv = tmp_path / "x.png", tmp_path / "x.json", tmp_path / "x.csv"
    code, out, err = _run(capsys, "show", "1f1b", "--ranks", "4", "--microbatches", "8", "--with-comms",
                          "--comm", "0.25", "-o", str(png), "--trace", str(trace), "--save", str(csv),
                          "--json")
    assert code == 0, err
    report = json.loads(out)
    expected = validate(lower(build_schedule("1f1b", 4, 8, costs=Costs(comm=0.25))))
    assert report["num_actions"] == 4 * 8 * 2 + 4 * 3 * 8
    assert report["makespan"] == expected.makespan and report["busy"] == list(expected.busy)
    assert png.read_bytes().startswith(b"\x89PNG")
    assert any(e.get("cat") == "communication" for e in json.loads(trace.read_text())["traceEvents"])
    assert "0SEND_F0" in csv.read_text().splitlines()[0]
    code, out, err = _run(capsys, "simulate", str(csv), "--comm", "0.25", "--json")
    assert code == 0, err
    assert json.loads(out)["makespan"] == expected.makespan


def test_show_without_the_flag_stays_compute_only(capsys):
    code, out, err = _run(capsys, "show", "1f1b", "--ranks", "4", "--microbatches", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["num_actions"] == 4 * 8 * 2


def test_with_comms_refuses_a_json_save_in_one_line(capsys, tmp_path):
    code, out, err = _run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--with-comms",
                          "--save", str(tmp_path / "x.json"))
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"pipeloom: error: --save {tmp_path / 'x.json'}: a lowered schedule (--with-comms) is saved as torch "
        "compute_comms CSV; use a .csv file name"]
    assert not (tmp_path / "x.json").exists()


def test_with_comms_has_its_own_size_limit(capsys):
    """Lowering checks and replays each action in Python: the limit is lower than show's."""
    from pipeloom.cli.schedules import MAX_ACTIONS, MAX_LOWERED_ACTIONS

    assert MAX_LOWERED_ACTIONS < MAX_ACTIONS
    code, out, err = _run(capsys, "show", "1f1b", "-p", "64", "-m", "8192", "--with-comms")
    assert code == 2 and out == ""
    assert "1,048,576 compute actions to lower (--with-comms), above the limit of 1,000,000" in err
