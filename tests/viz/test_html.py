"""The self-contained interactive view (pipeloom.viz.html): its data against the simulator's timeline
(the oracle), that the file needs no network, the notebook views, and ``-o .html`` on the CLI."""

from __future__ import annotations

import json
import re

import pytest

from pipeloom.cli import main
from pipeloom.ir import Action
from pipeloom.schedules import build_schedule
from pipeloom.sim import simulate
from pipeloom.viz.html import NOTEBOOK_MAX_ACTIONS, notebook_html, timeline_data, timeline_html


def test_view_data_is_the_timeline():
    timeline = simulate(build_schedule("zbv", 4, 8, memory_limit=6))
    data = timeline_data(timeline)
    assert len(data["ranks"]) == 4 and data["makespan"] == timeline.makespan and data["limit"] == 6
    for rank, row in enumerate(data["ranks"]):
        assert row["start"] == list(timeline.starts[rank]) and row["end"] == list(timeline.ends[rank])
        assert row["mem"] == list(timeline.memory[rank])
        assert row["text"] == [str(a) for a in timeline.schedule.ranks[rank]]
        times, held = data["memory"][rank]
        assert list(zip(times, held)) == timeline.memory_curve(rank)
    assert "memory limit" in [name for name, _ in data["legend"]]


def test_two_replica_schedules_show_real_microbatches():
    data = timeline_data(simulate(build_schedule("dualpipe", 4, 8)))
    texts = [t for row in data["ranks"] for t in row["text"]]
    assert any("real micro-batch" in t for t in texts)


def test_the_file_is_self_contained():
    text = timeline_html([simulate(build_schedule(n, 4, 8)) for n in ("1f1b", "zb-h1")], title="p=4, m=8 </script>")
    assert text.startswith("<!DOCTYPE html>") and text.count("PipeloomTimeline.render(") == 2
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", text)  # nothing loaded from elsewhere
    assert "http://" not in text and "https://" not in text
    assert "p=4, m=8 &lt;/script&gt;" in text and text.count("</script>") == 2


def test_notebook_views_of_schedules_and_timelines():
    schedule = build_schedule("1f1b", 2, 4)
    for item in (schedule, simulate(schedule)):
        view = item._repr_html_()
        assert "PipeloomTimeline.render(" in view and "<html" not in view
        data = json.loads(re.search(r"var d=(\[.*?\]);PipeloomTimeline", view).group(1))
        assert data[0]["makespan"] == simulate(schedule).makespan
    big = build_schedule("1f1b", 8, NOTEBOOK_MAX_ACTIONS // 8)
    assert "PipeloomTimeline" not in notebook_html(big) and "write_html" in notebook_html(big)
    stuck = build_schedule("1f1b", 2, 2)
    stuck = type(stuck)(name="stuck", problem=stuck.problem, num_microbatches=2,
                        ranks=(tuple(reversed(stuck.ranks[0])), stuck.ranks[1]))
    assert "cannot simulate" in notebook_html(stuck)


@pytest.mark.parametrize("argv", [["show", "zbv", "-p", "4", "-m", "8"],
                                  ["compare", "1f1b", "zbv", "-p", "4", "-m", "8"]])
def test_cli_writes_html(tmp_path, capsys, argv):
    out = tmp_path / "view.html"
    assert main([*argv, "-o", str(out)]) == 0, capsys.readouterr().err
    text = out.read_text()
    assert "PipeloomTimeline.render(" in text and str(Action(0, "F", 0)) in text


def test_cli_refuses_other_suffixes(tmp_path, capsys):
    assert main(["show", "1f1b", "-p", "2", "-m", "2", "-o", str(tmp_path / "x.pdf")]) == 2
    assert ".html" in capsys.readouterr().err
