"""The timeline picture: files, pixel size, colours, box geometry against the simulator, labels."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pipeloom.ir import Action
from pipeloom.schedules import build_schedule
from pipeloom.schedules.common import chain_problem, make_schedule
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate
from pipeloom.viz import KIND_COLORS, draw_timeline, timeline_figure
from pipeloom.viz.style import IDLE_COLOR, STAGE_HUES, real_microbatch, stage_color
from pipeloom.viz.units import PLAN_UNITS


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
    ax, _ = fig.axes
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
    fig = timeline_figure(_timeline("1f1b", 4, 8))
    assert sorted(t.get_text() for t in fig.axes[0].texts) == sorted(str(m) for m in range(8) for _ in range(8))
    assert "labels: micro-batch" in _legend(fig)
    fig = timeline_figure(_timeline("1f1b", 4, 512))  # boxes ~0.8 px wide: no labels, and the legend says so
    assert len(fig.axes[0].texts) == 0 and "no labels: boxes too narrow" in _legend(fig)


def _legend(fig) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_labels_drop_to_the_micro_batch_then_to_none_as_boxes_narrow():
    assert "labels: stage:micro-batch" in _legend(timeline_figure(_looped()))
    fig = timeline_figure(_timeline("zbv", 4, 16))
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert labels and all(":" not in label for label in labels) and "labels: micro-batch" in _legend(fig)
    assert "no labels: boxes too narrow" in _legend(timeline_figure(_timeline("zbv", 8, 24)))


def test_two_replica_labels_show_real_micro_batches():
    """DualPipe on 4 ranks: stage 7 belongs to the up replica, so its IR pair 0 is real micro-batch 1
    (IR m of replica j is real 2m + j, as the runtime feeds them)."""
    timeline = _timeline("dualpipe", 4, 8)
    number = real_microbatch(timeline.schedule)
    assert (number(0, 0), number(7, 0), number(3, 2), number(4, 2)) == (0, 1, 4, 5)
    assert real_microbatch(_timeline("zbv", 4, 8).schedule) is None
    fig = timeline_figure(timeline)
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert "0:0" in labels and "7:1" in labels and "7:0" not in labels
    assert any("real micro-batches" in text for text in _legend(fig))


def test_time_axis_has_its_unit_and_no_offset():
    timeline = simulate(build_schedule("1f1b", 4, 8, costs=Costs(f=18522, b=18086, w=9337)))
    fig = timeline_figure(timeline)
    fig.canvas.draw()
    memory_ax = fig.axes[1]
    assert memory_ax.get_xlabel() == "time (cost units)"
    ticks = [t.get_text() for t in memory_ax.get_xticklabels() if t.get_text()]
    assert "200,000" in ticks and memory_ax.xaxis.get_offset_text().get_text() == ""
    assert fig.axes[0].get_title(loc="left") == "1f1b: makespan 505,395, bubble 27.3%, peak memory 4"  # 11 (F + B)


def test_plan_units_write_seconds_and_binary_bytes():
    timeline = _timeline("1f1b", 2, 4)
    schedule = timeline.schedule
    tasks = tuple(dataclasses.replace(t, duration=t.duration * 1e-3, memory=t.memory * 2**20)
                  for t in schedule.problem.tasks)
    problem = dataclasses.replace(schedule.problem, tasks=tasks, memory_limit=3 * 2**20)
    timeline = simulate(dataclasses.replace(schedule, problem=problem))
    fig = timeline_figure(timeline, units=PLAN_UNITS)
    fig.canvas.draw()
    title = fig.axes[0].get_title(loc="left")
    assert "makespan 15 ms" in title and "peak memory 2 MiB" in title
    assert fig.axes[1].get_xlabel() == "time (ms)"
    assert {"0 MiB", "2 MiB"} <= {t.get_text() for t in fig.axes[1].get_yticklabels()}


def test_memory_curve_follows_the_simulator_and_the_limit_is_drawn():
    timeline = _timeline("1f1b", 4, 8)
    fig = timeline_figure(timeline)
    memory_ax = fig.axes[1]
    (lines,) = [c for c in memory_ax.collections if type(c).__name__ == "LineCollection"]
    for rank, path in enumerate(lines.get_paths()):
        heights = [y for _, y in timeline.memory_curve(rank)]
        assert max(path.vertices[:, 1]) == timeline.peak_memory[rank] == max(heights)
        assert path.vertices[-1, 0] == timeline.makespan
    assert not memory_ax.lines  # no limit
    limited = validate(build_schedule("1f1b", 4, 8, memory_limit=4), ordered=True)
    fig = timeline_figure(limited)
    assert [line.get_ydata()[0] for line in fig.axes[1].lines] == [4]
    assert "memory limit" in _legend(fig)


def test_dense_rows_are_an_image_with_the_same_busy_share_on_every_rank():
    """1F1B at m = 512: boxes under a pixel; each rank's row is one coverage image whose mean alpha is
    the rank's busy share of the makespan (1 - its idle), not stripes that depend on the rank."""
    import numpy as np

    timeline = simulate(build_schedule("1f1b", 4, 512))
    fig = timeline_figure(timeline)
    ax = fig.axes[0]
    (image,) = ax.images
    data = np.asarray(image.get_array())
    rows = data.shape[0] // 4
    for rank in range(4):
        band = data[rank * rows + rows // 2, :, 3]
        assert abs(float(band.mean()) - timeline.busy[rank] / timeline.makespan) < 0.01
        steady = band[len(band) // 4: 3 * len(band) // 4]
        assert steady.min() > 0.95  # the steady state reads solid on every rank


def test_several_stages_per_rank_get_their_own_hue_and_are_labelled():
    timeline = _looped()
    ax = timeline_figure(timeline).axes[0]
    labels = {t.get_text() for t in ax.texts}
    assert {"0:0", "4:5", "7:3"} <= labels
    faces = {tuple(round(255 * c) for c in coll.get_facecolor()[0][:3]) for coll in ax.collections}
    assert _rgb(KIND_COLORS["F"]) in faces and _rgb(STAGE_HUES["F"][1]) in faces
    assert stage_color("F", 1) == STAGE_HUES["F"][1] != KIND_COLORS["F"]
    hue = [_hue(stage_color(kind, k)) for kind in STAGE_HUES for k in (0, 1)]
    for first, second in zip(hue[::2], hue[1::2]):
        assert 20 <= min(abs(first - second), 360 - abs(first - second))  # degrees apart, not a lighter shade


def _hue(color: str) -> float:
    import colorsys

    return 360 * colorsys.rgb_to_hsv(*(c / 255 for c in _rgb(color)))[0]


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
