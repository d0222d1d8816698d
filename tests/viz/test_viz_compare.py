"""The comparison figure: one panel per schedule, all on the same time axis."""

from __future__ import annotations

import pytest

from pipeloom.schedules import build_schedule
from pipeloom.validate import validate
from pipeloom.viz import comparison_figure, draw_comparison


def _pair():
    # 1F1B p=4 m=8: makespan (8+3)*3 = 33; GPipe p=4 m=4: (4+3)*3 = 21 (docs/design.md §6 with F=1, B=2)
    return [validate(build_schedule("1f1b", 4, 8)), validate(build_schedule("gpipe", 4, 4))]


def test_one_axes_per_schedule_sharing_x_limits():
    timelines = _pair()
    assert [t.makespan for t in timelines] == [33.0, 21.0]
    fig = comparison_figure(timelines + [validate(build_schedule("gpipe", 2, 3))])
    assert len(fig.axes) == 6  # a timeline and its memory panel per schedule
    assert {ax.get_xlim() for ax in fig.axes} == {(0.0, 33.0)}
    assert [ax.get_xlabel() for ax in fig.axes] == [""] * 5 + ["time (cost units)"]
    tops = [ax.get_position().y1 for ax in fig.axes]
    assert tops == sorted(tops, reverse=True)  # stacked top to bottom in the given order


def test_panels_are_titled_with_their_metrics():
    fig = comparison_figure(_pair(), title="four ranks")
    titles = [ax.get_title(loc="left") for ax in fig.axes[::2]]
    assert titles == [
        "1f1b: makespan 33, bubble 27.3%, peak memory 4",  # bubble (p-1)/(m+p-1) = 3/11
        "gpipe: makespan 21, bubble 42.9%, peak memory 4",  # 3/7; GPipe holds m = 4
    ]
    assert fig.get_suptitle() == "four ranks"


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_files_are_written(tmp_path, suffix):
    path = tmp_path / f"cmp{suffix}"
    draw_comparison(_pair(), path, title="four ranks")
    assert path.stat().st_size > 1000
    if suffix == ".svg":
        text = path.read_text()
        assert "gpipe: makespan 21" in text and "1f1b: makespan 33" in text


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"\.png, \.svg"):
        draw_comparison(_pair(), tmp_path / "cmp.gif")
    with pytest.raises(ValueError, match="at least one timeline"):
        draw_comparison([], tmp_path / "cmp.png")
    with pytest.raises(ValueError, match="expected a Timeline"):
        draw_comparison([build_schedule("1f1b", 2, 2)], tmp_path / "cmp.png")
