"""Pictures of simulated schedules: timeline PNG/SVG, comparisons, Perfetto traces, terminal view.

Nothing heavy is imported here: matplotlib and rich load inside the functions that need them.
"""

from pipeloom.viz.compare import comparison_figure, draw_comparison
from pipeloom.viz.figure import FIGURE_SUFFIXES
from pipeloom.viz.perfetto import perfetto_events, write_perfetto
from pipeloom.viz.style import KIND_COLORS, KIND_NAMES
from pipeloom.viz.terminal import render_timeline, render_timeline_rich
from pipeloom.viz.timeline import draw_timeline, timeline_figure

__all__ = [
    "FIGURE_SUFFIXES",
    "KIND_COLORS",
    "KIND_NAMES",
    "comparison_figure",
    "draw_comparison",
    "draw_timeline",
    "render_timeline",
    "render_timeline_rich",
    "timeline_figure",
    "perfetto_events",
    "write_perfetto",
]
