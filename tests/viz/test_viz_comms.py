"""Pictures of lowered schedules: the communication lane, the legend, the trace and terminal views.

Oracles: the compute-only figure of the same schedule (same boxes in x, no communication marks, one
legend row), the simulator's send/receive times, and the terminal view of the compute-only schedule
(with latency 0 the views agree: the terminal view leaves communication out).
"""

from __future__ import annotations

import numpy as np

from pipeloom import Comm, lower
from pipeloom.schedules import build_schedule
from pipeloom.stages import Costs
from pipeloom.validate import validate
from pipeloom.viz import perfetto_events, render_timeline, timeline_figure
from pipeloom.viz.style import COMM_COLORS, COMM_NAMES
from pipeloom.viz.timeline import legend_rows_of


def _timelines(comm: float = 0.0):
    schedule = build_schedule("1f1b", 4, 8, costs=Costs(comm=comm))
    return validate(schedule, ordered=True), validate(lower(schedule), ordered=True)


def _faces(ax) -> set[tuple[int, int, int]]:
    return {tuple(round(255 * c) for c in coll.get_facecolor()[0][:3])
            for coll in ax.collections if len(coll.get_facecolor())}


def _edges(ax) -> set[tuple[int, int, int]]:
    return {tuple(round(255 * c) for c in coll.get_edgecolor()[0][:3])
            for coll in ax.collections if type(coll).__name__ == "LineCollection"}


def _rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def test_lowered_picture_draws_communication_and_the_compute_only_one_does_not():
    plain, lowered = _timelines(comm=0.25)
    plain_ax = timeline_figure(plain).axes[0]
    ax = timeline_figure(lowered).axes[0]
    comm = {_rgb(color) for color in COMM_COLORS.values()}
    assert comm <= _faces(ax) and not comm & _faces(plain_ax)
    labels = [t.get_text() for t in timeline_figure(lowered).legends[0].get_texts()]
    assert all(name in labels for name in COMM_NAMES.values())
    plain_labels = [t.get_text() for t in timeline_figure(plain).legends[0].get_texts()]
    assert len(labels) == len(plain_labels) + 2  # send and receive
    assert legend_rows_of([lowered]) >= legend_rows_of([plain])


def test_zero_time_communication_is_drawn_as_ticks_at_its_time():
    _, lowered = _timelines(comm=0.0)
    ax = timeline_figure(lowered).axes[0]
    assert _rgb(COMM_COLORS["send"]) in _edges(ax)
    lines = [coll for coll in ax.collections if type(coll).__name__ == "LineCollection"]
    ticks = [segment for coll in lines for segment in coll.get_segments()]
    times = sorted(s for r in range(4) for a, s, e in lowered.events(r) if type(a) is Comm and e == s)
    assert sorted(float(seg[0][0]) for seg in ticks) == times


def _compute_spans(ax) -> list[tuple[float, float]]:
    """``(start, end)`` of every box not drawn in a communication colour."""
    comm = {_rgb(color) for color in COMM_COLORS.values()}
    spans = []
    for coll in ax.collections:
        faces = {tuple(round(255 * c) for c in face[:3]) for face in np.atleast_2d(coll.get_facecolor())}
        if type(coll).__name__ == "PolyCollection" and not faces & comm:
            spans += [(float(path.vertices[0, 0]), float(path.vertices[2, 0])) for path in coll.get_paths()]
    return sorted(spans)


def test_compute_boxes_keep_their_times_in_the_lowered_picture():
    plain, lowered = _timelines()
    plain_ax = timeline_figure(plain).axes[0]
    ax = timeline_figure(lowered).axes[0]
    assert _compute_spans(ax) == _compute_spans(plain_ax) and len(_compute_spans(ax)) == 4 * 8 * 2
    assert timeline_figure(lowered).get_size_inches()[1] >= timeline_figure(plain).get_size_inches()[1]


def test_trace_holds_communication_events():
    _, lowered = _timelines(comm=0.25)
    events = [e for e in perfetto_events(lowered)["traceEvents"] if e.get("ph") == "X"]
    comm = [e for e in events if e["cat"] == "communication"]
    assert {e["name"] for e in comm} >= {"0SEND_F0", "1RECV_F0", "3SEND_B7", "0RECV_B7"}
    assert len(comm) == 4 * 3 * 8 and len(events) == lowered.schedule.num_actions


def test_terminal_view_leaves_communication_out():
    plain, lowered = _timelines()
    assert render_timeline(lowered, width=80) == render_timeline(plain, width=80)
