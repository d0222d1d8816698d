"""What a picture's numbers count, and how every view writes them: thousands separators as in the
tables (``1,456,749``), seconds scaled to s/ms/us, bytes in binary units (``85.5 MiB``); the
number formats themselves live in :mod:`pipeloom.formatting` (re-exported here).

A timeline does not know its units: a schedule built from ``--f/--b/--w`` counts time in the unit of
those costs and memory in micro-batches of one rank's share of activations; a measured run or a plan
counts seconds (and a plan bytes). The caller says which with :class:`Units`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeloom.formatting import format_bytes, format_number, format_seconds

__all__ = ["COST_UNITS", "MEASURED_UNITS", "PLAN_UNITS", "Units", "format_memory", "format_time", "memory_ticks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Units:
    """The units of a timeline's times and memory."""

    time: Literal["cost", "seconds"] = "cost"
    """``cost``: the unit of the costs the schedule was built from; ``seconds``: a measured or planned run."""
    memory: Literal["cost", "bytes"] = "cost"
    """``cost``: the memory the tasks declare (by default micro-batches of one rank's share of
    activations); ``bytes``: a plan's."""

    def __post_init__(self) -> None:
        if self.time not in ("cost", "seconds"):
            raise ValueError(f"Units.time must be 'cost' or 'seconds', got {self.time!r}")
        if self.memory not in ("cost", "bytes"):
            raise ValueError(f"Units.memory must be 'cost' or 'bytes', got {self.memory!r}")


COST_UNITS = Units()
"""A schedule drawn from unit costs (``pipeloom show``, ``compare``, ``demo``)."""
MEASURED_UNITS = Units(time="seconds")
"""A measured run and its prediction (``pipeloom trace``): seconds, the schedule's own memory."""
PLAN_UNITS = Units(time="seconds", memory="bytes")
"""A plan (``pipeloom plan``): seconds and bytes."""

def format_time(value: float, units: Units) -> str:
    """A time in ``units``: ``1,456,749`` (cost units) or ``12.345 ms``."""
    return format_seconds(value) if units.time == "seconds" else format_number(value)


def format_memory(value: float, units: Units) -> str:
    """A memory amount in ``units``: ``8`` or ``85.5 MiB`` (binary units, as the plan tables)."""
    if units.memory == "bytes":
        return format_bytes(value)
    return format_number(value)


def memory_ticks(top: float, units: Units) -> tuple[list[float], list[str]]:
    """Up to four round tick values from 0 to ``top`` and their labels (bytes: whole KiB/MiB/GiB steps)."""
    from matplotlib.ticker import MaxNLocator

    top = top if top > 0 else 1.0
    factor, name = 1.0, ""
    if units.memory == "bytes":
        for name in ("B", "KiB", "MiB", "GiB", "TiB"):
            if top / factor < 1024 or name == "TiB":
                break
            factor *= 1024
    values = [v * factor for v in MaxNLocator(nbins=3, steps=[1, 2, 2.5, 5, 10]).tick_values(0, top / factor)
              if 0 <= v * factor <= top * 1.0001]
    labels = [f"{format_number(v / factor)} {name}".strip() for v in values]
    return values, labels
