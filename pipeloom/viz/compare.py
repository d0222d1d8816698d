"""Several schedules' timelines stacked on one shared time axis, so their lengths compare by eye."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeloom.sim import Timeline
from pipeloom.viz.figure import check_figure_path, save_figure
from pipeloom.viz.timeline import panels_figure
from pipeloom.viz.units import COST_UNITS, Units

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["comparison_figure", "draw_comparison"]


def comparison_figure(timelines: Sequence[Timeline], *, title: str | None = None,
                      units: Units = COST_UNITS) -> Figure:
    """The Figure :func:`draw_comparison` saves: per timeline a timeline axes and its memory axes,
    all with the same x limits."""
    timelines = list(timelines)
    if not timelines:
        raise ValueError("draw_comparison needs at least one timeline; pass a list of simulated schedules")
    for i, timeline in enumerate(timelines):
        if not isinstance(timeline, Timeline):
            raise ValueError(
                f"timelines[{i}] is {type(timeline).__name__}, expected a Timeline "
                "(simulate or validate the schedule first)"
            )
    return panels_figure(timelines, title=title, units=units)


def draw_comparison(timelines: Sequence[Timeline], path: str | Path, *, title: str | None = None,
                    units: Units = COST_UNITS) -> None:
    """Save several timelines stacked vertically on ONE time axis (same x scale) as PNG or SVG.

    Each panel is titled with its schedule's name, makespan, bubble ratio and peak memory, so a
    shorter schedule visibly ends earlier, and has its ranks' memory curves under it.
    """
    path, fmt = check_figure_path(path)
    save_figure(comparison_figure(timelines, title=title, units=units), path=path, fmt=fmt)
