"""The timeline picture: files, pixel size, colours, box geometry against the simulator, labels."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeloom.ir import Action
from pipeloom.problem import Costs
from pipeloom.schedules import build_schedule
from pipeloom.schedules.common import chain_problem, make_schedule
from pipeloom.sim import simulate
from pipeloom.validate import validate
from pipeloom.viz import KIND_COLORS, draw_timeline, timeline_figure
from pipeloom.viz.style import IDLE_COLOR, STAGE_LIGHTEN, lighten


def _timeline(name: str = "1f1b", ranks: int = 4, microbatches: int = 8):
    return validate(build_schedule(name, ranks, microbatches), ordered=True)


def _looped(num_ranks: int = 4, num_microbatches: int = 6):
    """Breadth-first looped schedule, 2 stages per rank (r and r+p), split backward, built by hand."""
    problem = chain_problem([s % num_ranks for s in range(2 * num_ranks)], Costs(), num_ranks=num_ranks,
                            split_backward=True, memory_limit=None, share=0.5)
    mbs = range(num_microbatches)
    ranks = []
    for r in range(num_ranks):
        low, high = r, r + num_ranks
        ranks.append([Action(low, "F", i) for i in mbs] + [Action(high, "F", i) for i in mbs]
                     + [a for i in mbs for a in (Action(high, "I", i), Action(high, "W", i))]
                     + [a for i in mbs for a in (Action(low, "I", i), Action(low, "W", i))])
    schedule = make_schedule(
        "looped-by-hand", problem=problem, num_microbatches=num_microbatches, ranks=ranks
    )
    return validate(schedule, ordered=True)


def _rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def test_import_does_not_load_matplotlib_or_rich():
    code = "import sys, pipeloom.viz; print([m for m in ('matplotlib', 'rich', 'numpy') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_png_has_figure_size_and_kind_colours(tmp_path):
    import matplotlib.image
    import numpy as np

    path = tmp_path / "t.png"
    draw_timeline(_timeline(), path)
    image = matplotlib.image.imread(path)
    height_in = timeline_figure(_timeline()).get_size_inches()[1]
    assert image.shape[:2] == (round(height_in * 100), 1400)  # 14 in x 100 dpi, no tight-bbox cropping
    pixels = {tuple(p) for p in np.round(image[..., :3].reshape(-1, 3) * 255).astype(int).tolist()}
    for color in (KIND_COLORS["F"], KIND_COLORS["B"], IDLE_COLOR):
        assert _rgb(color) in pixels, f"{color} missing from the picture"
    assert len(pixels) > 10


def test_png_grows_with_ranks(tmp_path):
    small, big = (timeline_figure(_timeline("gpipe", p, 4)).get_size_inches()[1] for p in (2, 8))
    assert big > small


def test_svg_has_title_summary_and_microbatch_labels(tmp_path):
    path = tmp_path / "t.svg"
    draw_timeline(_timeline(), path, title="1F1B on 4 ranks")
    text = path.read_text()
    assert "1F1B on 4 ranks" in text
    assert "1f1b: makespan 33, bubble 27.3%, peak memory 4" in text  # (m+p-1)(F+B) = 11*3, 1 - 24/33
    # micro-batch 7 labels one F and one B box on each of 4 ranks; no x tick reads 7 (ticks 0, 5, ...)
    assert text.count(">7</text>") == 8


def test_boxes_sit_at_simulated_times():
    timeline = _timeline("1f1b", 3, 5)
    fig = timeline_figure(timeline)
    (ax,) = fig.axes
    drawn = set()
    for collection in ax.collections:
        for path in collection.get_paths():
            xs, ys = path.vertices[:, 0], path.vertices[:, 1]
            drawn.add((round(xs.min(), 9), round(xs.max(), 9), round((ys.min() + ys.max()) / 2)))
    expected = {
        (round(s, 9), round(e, 9), r)
        for r in range(3) for _, s, e in timeline.events(r)
    }
    assert drawn == expected
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top
    assert ax.get_xlim() == (0.0, timeline.makespan)


def test_labels_only_where_they_fit():
    (ax,) = timeline_figure(_timeline("1f1b", 4, 8)).axes
    assert sorted(t.get_text() for t in ax.texts) == sorted(str(m) for m in range(8) for _ in range(8))
    (ax,) = timeline_figure(_timeline("1f1b", 4, 512)).axes  # boxes ~0.8 px wide: no labels
    assert len(ax.texts) == 0


def test_several_stages_per_rank_are_shaded_and_labelled():
    timeline = _looped()
    (ax,) = timeline_figure(timeline).axes
    labels = {t.get_text() for t in ax.texts}
    assert {"0:0", "4:5", "7:3"} <= labels
    faces = {tuple(round(255 * c) for c in coll.get_facecolor()[0][:3]) for coll in ax.collections}
    assert _rgb(KIND_COLORS["F"]) in faces
    assert _rgb(lighten(KIND_COLORS["F"], STAGE_LIGHTEN[1])) in faces


@pytest.mark.parametrize("suffix", [".pdf", ".jpg", ""])
def test_bad_suffix_names_the_allowed_ones(tmp_path, suffix):
    path = tmp_path / f"t{suffix}"
    with pytest.raises(ValueError, match=r"\.png, \.svg"):
        draw_timeline(_timeline(), path)
    assert not path.exists()


def test_big_schedule_draws(tmp_path):
    """131k boxes go through collections (speed is measured in benchmarks/, not here)."""
    timeline = simulate(build_schedule("1f1b", 64, 1024))
    draw_timeline(timeline, tmp_path / "big.png")
    assert (tmp_path / "big.png").stat().st_size > 10_000
