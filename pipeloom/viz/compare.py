"""Several schedules' timelines stacked on one shared time axis, so their lengths compare by eye."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeloom.sim import Timeline
from pipeloom.viz.timeline import (
    add_legend,
    check_figure_path,
    figure_for_panels,
    legend_rows_of,
    plot_timeline,
    save_figure,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["comparison_figure", "draw_comparison"]


def comparison_figure(timelines: Sequence[Timeline], *, title: str | None = None) -> Figure:
    """The Figure :func:`draw_comparison` saves: one axes per timeline, all with the same x limits."""
    timelines = list(timelines)
    if not timelines:
        raise ValueError("draw_comparison needs at least one timeline; pass a list of simulated schedules")
    for i, timeline in enumerate(timelines):
        if not isinstance(timeline, Timeline):
            raise ValueError(
                f"timelines[{i}] is {type(timeline).__name__}, expected a Timeline "
                "(simulate or validate the schedule first)"
            )
    fig, axes = figure_for_panels([t.num_ranks for t in timelines], heading=title is not None,
                                  legend_rows=legend_rows_of(timelines))
    xmax = max(t.makespan for t in timelines)
    for ax, timeline in zip(axes, timelines):
        plot_timeline(ax, timeline, xmax=xmax)
    for ax in axes[:-1]:
        ax.tick_params(axis="x", labelbottom=False)
    axes[-1].set_xlabel("time", fontsize=9)
    if title is not None:
        fig.suptitle(title, fontsize=12, fontweight="bold", y=1 - 0.1 / fig.get_size_inches()[1], va="top")
    add_legend(fig, timelines)
    return fig


def draw_comparison(timelines: Sequence[Timeline], path: str | Path, *, title: str | None = None) -> None:
    """Save several timelines stacked vertically on ONE time axis (same x scale) as PNG or SVG.

    Each panel is titled with its schedule's name, makespan, bubble ratio and peak memory, so a
    shorter schedule visibly ends earlier.
    """
    path, fmt = check_figure_path(path)
    save_figure(comparison_figure(timelines, title=title), path=path, fmt=fmt)
