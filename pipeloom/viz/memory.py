"""The memory panel under a timeline: each rank's held memory over time as a step line (it changes
when an action starts, :meth:`pipeloom.sim.Timeline.memory_curve`), and the memory limit when the
schedule has one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeloom.sim import Timeline
from pipeloom.viz.units import Units, format_memory, memory_ticks

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["LIMIT_COLOR", "plot_memory", "rank_colors"]

LIMIT_COLOR = "#D55E00"
"""The memory limit's dashed line (Okabe-Ito vermillion)."""


def rank_colors(num_ranks: int) -> list[tuple[float, float, float, float]]:
    """One colour per rank's memory line: viridis from dark (rank 0) to light (the last rank)."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.85 * r / max(num_ranks - 1, 1)) for r in range(num_ranks)]


def _steps(curve: list[tuple[float, float]], xmax: float) -> list[tuple[float, float]]:
    """Vertices of the step line of ``[(time, held), ...]``, held until ``xmax``."""
    points: list[tuple[float, float]] = []
    for (time, held), (after, _) in zip(curve, [*curve[1:], (xmax, 0.0)]):
        points += [(time, held), (max(after, time), held)]
    return points


def plot_memory(ax: Axes, timeline: Timeline, *, units: Units, xmax: float) -> None:
    """Draw every rank's memory step line onto ``ax`` (one LineCollection) and the limit, with
    round ticks in ``units`` (bytes as KiB/MiB/GiB)."""
    from matplotlib.collections import LineCollection

    curves = [_steps(timeline.memory_curve(rank), xmax) for rank in range(timeline.num_ranks)]
    ax.add_collection(LineCollection(curves, colors=rank_colors(timeline.num_ranks), linewidths=1.0),
                      autolim=False)
    limit = timeline.schedule.problem.memory_limit
    top = max([held for curve in curves for _, held in curve] + [limit or 0.0, 0.0])
    if limit is not None:
        ax.axhline(limit, color=LIMIT_COLOR, linestyle="--", linewidth=1.0)
        ax.text(xmax, limit, f"limit {format_memory(limit, units)} ", ha="right", va="top", fontsize=7,
                color=LIMIT_COLOR, clip_on=True)
    low = min([held for curve in curves for _, held in curve] + [0.0])
    ax.set_ylim(low, top * 1.12 if top > 0 else 1.0)
    ticks, labels = memory_ticks(top, units)
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_ylabel("memory", fontsize=8)
    ax.tick_params(axis="y", length=2, pad=1)
    ax.grid(axis="x", color="white", linewidth=0.8)
    ax.grid(axis="y", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_facecolor("#F7F7F7")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
