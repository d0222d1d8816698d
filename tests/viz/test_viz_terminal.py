"""The terminal view: one line per rank, idle columns exactly where the simulator idles a rank."""

from __future__ import annotations

import pytest

from pipeloom.schedules import build_schedule
from pipeloom.stages import Costs
from pipeloom.validate import validate
from pipeloom.viz import KIND_COLORS, render_timeline, render_timeline_rich
from pipeloom.viz.terminal import IDLE, timeline_cells


def _timeline(name: str = "1f1b", ranks: int = 4, microbatches: int = 4, costs: Costs = Costs()):
    return validate(build_schedule(name, ranks, microbatches, costs=costs))


def _rank_rows(text: str) -> list[str]:
    return [line.split("|")[1] for line in text.splitlines() if line.startswith("rank")]


def test_header_and_one_line_per_rank():
    text = render_timeline(_timeline(), width=60)
    lines = text.splitlines()
    assert lines[0] == "1f1b: makespan 21, bubble 42.9%, peak memory 4"  # (4+4-1)*3, 1 - 12/21
    assert lines[1].startswith("1 column = 0.35 time units")
    assert len(lines) == 2 + 4
    assert [line.split("|")[0] for line in lines[2:]] == [f"rank {r} " for r in range(4)]
    assert all(len(row) == 60 for row in _rank_rows(text))


def test_one_column_per_time_unit_snapshot():
    # 1F1B p=4 m=4, F=1, B=2: rank 3 waits 3 units for its first forward, rank 0 idles 6 before B0
    rows = _rank_rows(render_timeline(_timeline(), width=21))
    assert rows == [
        "FFFF......B0.B1.B2.B3",
        ".FFF....B0FB1.B2.B3..",
        "..FF..B0FB1FB2.B3....",
        "...FB0FB1FB2FB3......",
    ]


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches", "costs", "width"),
    [
        ("1f1b", 4, 4, Costs(), 100),
        ("1f1b", 5, 7, Costs(f=0.7, b=1.3, w=0.2, comm=0.15), 83),
        ("gpipe", 3, 6, Costs(f=1.0, b=0.5, w=0.5, comm=0.3), 47),
        ("gpipe", 8, 2, Costs(), 13),
    ],
)
def test_idle_columns_match_the_simulator(name, ranks, microbatches, costs, width):
    timeline = _timeline(name, ranks, microbatches, costs)
    grid = timeline_cells(timeline, width=width)
    column = timeline.makespan / width
    for rank, row in enumerate(grid):
        busy = [(s, e) for _, s, e in timeline.events(rank)]
        for c, (char, kind) in enumerate(row):
            lo, hi = c * column, (c + 1) * column
            overlap = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in busy)
            if overlap == 0:
                assert char == IDLE and kind is None, f"rank {rank} column {c} is idle in the simulator"
            elif overlap > column / 2:
                assert char != IDLE and kind is not None, f"rank {rank} column {c} is mostly busy"


def test_short_actions_still_show():
    # 64 micro-batches in 20 columns: each action is far narrower than a column
    rows = _rank_rows(render_timeline(_timeline("gpipe", 2, 64), width=20))
    assert all(set(row) <= {"F", "B", IDLE} for row in rows)
    assert "F" in rows[0] and "B" in rows[0]


def test_rich_text_has_the_same_characters_and_the_picture_colours():
    timeline = _timeline()
    rich_text = render_timeline_rich(timeline, width=21)
    assert rich_text.plain == render_timeline(timeline, width=21)
    styles = {str(span.style) for span in rich_text.spans}
    assert f"#FFFFFF on {KIND_COLORS['F']}" in styles
    assert f"#000000 on {KIND_COLORS['B']}" in styles


@pytest.mark.parametrize("width", [0, -3, 2.5, True])
def test_bad_width(width):
    with pytest.raises(ValueError, match="width"):
        render_timeline(_timeline(), width=width)
