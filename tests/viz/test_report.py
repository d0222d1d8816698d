"""Tests of the report dict and terminal tables: numbers against the 1F1B/GPipe closed forms
(docs/design.md §6) and the simulator called directly, tables rendered to plain text."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from pipeloom.formatting import format_number
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.viz.report import (
    COMPARE_COLUMNS,
    PER_RANK_ROWS,
    compare_markdown,
    compare_table,
    comparison_rows,
    per_rank_table,
    print_comparison,
    schedules_table,
    summary_table,
    terminal_timeline,
    timeline_report,
)


def console() -> Console:
    return Console(width=120, file=io.StringIO(), color_system=None, highlight=False)


def plain(*renderables) -> str:
    out = console()
    for renderable in renderables:
        out.print(renderable)
    return out.file.getvalue()


def test_report_of_1f1b_matches_its_closed_form():
    # 1F1B, f=2, b+w=4: makespan (m+p-1)(f+b+w), every rank busy m(f+b+w), rank r holds p-r.
    p, m, costs = 4, 8, Costs(f=2, b=1, w=3)
    report = timeline_report(simulate(build_schedule("1f1b", p, m, costs=costs)), costs=costs)
    assert report["makespan"] == (m + p - 1) * 6
    assert report["busy"] == [m * 6.0] * p and report["lower_bound"] == m * 6.0
    assert report["peak_memory"] == [p - r for r in range(p)]
    assert report["num_actions"] == 2 * p * m
    assert report["num_microbatches"] == report["schedule_microbatches"] == m
    assert report["costs"]["f"] == 2 and report["memory_limit"] is None


def test_report_keeps_the_users_microbatches_for_paired_schedules():
    timeline = simulate(build_schedule("dualpipe", 4, 8))
    report = timeline_report(timeline, microbatches=8)
    assert (report["num_microbatches"], report["schedule_microbatches"]) == (8, 4)
    assert "8 (4 pairs)" in plain(summary_table(report))


@pytest.mark.parametrize("value, text", [(33.0, "33"), (1234.5, "1,234.5"), (0.12345, "0.123"), (0.0, "0")])
def test_format_number(value, text):
    assert format_number(value) == text


def test_summary_and_per_rank_tables_of_gpipe():
    # GPipe p=3, m=5, f=b=w=1: makespan (m+p-1)*3 = 21, busy 15, idle 6, bubble 6/21 = 28.57%.
    report = timeline_report(simulate(build_schedule("gpipe", 3, 5)))
    text = plain(summary_table(report), per_rank_table(report))
    for fragment in ("schedule gpipe", "21", "28.57%", "1.400", "per rank"):
        assert fragment in text
    rows = [line.split("│")[1:-1] for line in text.splitlines() if line.count("│") == 5]
    assert [[cell.strip() for cell in row] for row in rows] == [[str(r), "15", "6", "5"] for r in range(3)]


def test_a_per_rank_table_of_many_ranks_folds_alike_ranks_and_counts_the_middle():
    """Above PER_RANK_ROWS ranks: consecutive ranks alike share a row, and of more rows than that the middle ones are
    counted in one (65,536 ranks had printed 65,536 rows in half a minute)."""
    def rows(report):
        text = plain(per_rank_table(report))
        return [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if line.count("│") == 5]

    alike = timeline_report(simulate(build_schedule("gpipe", PER_RANK_ROWS + 1, 2)))
    assert rows(alike) == [[f"0-{PER_RANK_ROWS}", "6", format_number(alike["makespan"] - 6), "2"]]  # f=b=1, m=2
    ranks = 3 * PER_RANK_ROWS
    differ = rows(timeline_report(simulate(build_schedule("1f1b", ranks, ranks))))  # every rank's peak its own
    half = PER_RANK_ROWS // 2
    assert len(differ) == PER_RANK_ROWS + 1 and differ[half] == [
        f"{half}-{ranks - half - 1}", "...", "...", f"({2 * PER_RANK_ROWS:,} rows left out)"]
    assert differ[0][0] == "0" and differ[-1][0] == str(ranks - 1)
    # one row more than the limit is shown, not replaced by a row counting it
    one_more = rows(timeline_report(simulate(build_schedule("1f1b", PER_RANK_ROWS + 1, PER_RANK_ROWS + 1))))
    assert [row[0] for row in one_more] == [str(rank) for rank in range(PER_RANK_ROWS + 1)]


def _rows():
    good = simulate(build_schedule("1f1b", 4, 8))  # makespan 33
    slow = simulate(build_schedule("gpipe", 4, 8, costs=Costs(f=2)))  # (8+4-1)*4 = 44
    return comparison_rows([("1f1b", good), ("gpipe", slow), ("dualpipe", "needs | even ranks")])


def test_comparison_rows_are_relative_to_the_best_makespan():
    rows = {row["name"]: row for row in _rows()}
    assert rows["1f1b"]["relative_makespan"] == 1.0
    assert rows["gpipe"]["relative_makespan"] == pytest.approx(44 / 33)
    assert rows["dualpipe"] == {"name": "dualpipe", "error": "needs | even ranks"}


def test_compare_table_has_a_note_column_only_when_a_row_failed():
    rows = _rows()
    with_failure = plain(compare_table(rows, "p=4"))
    assert "note" in with_failure and "not built" in with_failure and "1.333" in with_failure
    assert "needs" not in with_failure  # reasons go under the table, not in it
    assert "note" not in plain(compare_table(rows[:2], "p=4"))
    out = console()
    print_comparison(out, rows, "p=4")
    assert out.file.getvalue().endswith("dualpipe not built: needs | even ranks\n")


def test_compare_markdown_escapes_pipes_and_keeps_reasons():
    page = compare_markdown(_rows(), heading="demo", title="p=4", footer=["made by x"])
    lines = page.splitlines()
    assert lines[:3] == ["# demo", "", "p=4"]
    assert lines[4] == "| " + " | ".join(COMPARE_COLUMNS) + " |"
    assert "| dualpipe | - | - | - | - | not built: needs \\| even ranks |" in lines
    assert lines[-1] == "made by x"


def test_schedules_table_lists_every_registry_entry_with_its_flags():
    text = plain(schedules_table(REGISTRY.values()))
    for info in REGISTRY.values():
        assert info.name in text
    assert "--stages-per-rank" in text and "I + W" in text


def test_terminal_timeline_fills_the_console_or_takes_a_width():
    timeline = simulate(build_schedule("1f1b", 2, 2))
    margin = len("rank 1 |") + 1
    for kwargs, columns in (({"width": 30}, 30), ({}, 80 - margin)):
        lines = terminal_timeline(timeline, console_width=80, **kwargs).plain.splitlines()
        ranks = [line for line in lines if line.startswith("rank ")]
        assert len(ranks) == 2
        assert all(len(line) == len("rank 0 |") + columns + 1 for line in ranks), ranks
