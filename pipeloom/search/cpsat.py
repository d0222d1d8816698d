"""What every CP-SAT model here shares: real numbers scaled to integers, and the solver's status
read as found / optimal / feasible. No pipeloom module is imported."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import ortools  # noqa: F401 - import OR-Tools before anything that may load SciPy
from ortools.sat.python import cp_model

__all__ = ["Status", "found_solution", "integer_scale", "meets_bound", "status_word", "to_units"]

Status = Literal["optimal", "feasible"]


def integer_scale(values: Sequence[float], *, top: float, fitted: float, most: int = 10**6,
                  room: float = math.inf) -> tuple[float, bool]:
    """``(scale, exact)``: the smallest power of ten up to ``most`` that makes every value whole
    (within a relative 1e-9) and keeps ``top * scale <= room``, exact; else ``fitted / top``
    (``fitted`` integer units for the largest quantity ``top``; 1.0 when ``top`` is 0), not exact."""
    scale = 1
    while scale <= most:
        if top * scale <= room and all(_whole(v * scale) for v in values):
            return float(scale), True
        scale *= 10
    return (fitted / top if top > 0 else 1.0), False


def _whole(x: float) -> bool:
    """Whether ``x`` is a whole number up to a relative 1e-9 (never when it overflowed to infinity)."""
    return math.isfinite(x) and abs(x - round(x)) <= 1e-9 * max(1.0, abs(x))


def to_units(values: Sequence[float], scale: float, *, exact: bool = True,
             rounding: Callable[[float], float] = round) -> tuple[int, ...]:
    """``values`` in integer units: rounded to nearest when the scale is exact, else by ``rounding``
    (``math.floor`` or ``math.ceil`` where a bound must stay on one side)."""
    return tuple(round(v * scale) if exact else int(rounding(v * scale)) for v in values)


def found_solution(status: cp_model.CpSolverStatus) -> bool:
    """Whether a CP-SAT status carries a solution (OPTIMAL or FEASIBLE)."""
    return status in (cp_model.OPTIMAL, cp_model.FEASIBLE)


def meets_bound(value: float, bound: float) -> bool:
    """Whether ``value`` reaches the proven lower ``bound`` up to float rounding (relative 1e-9)."""
    return value <= bound + 1e-9 * max(1.0, abs(bound))


def status_word(optimal: bool) -> Status:
    """A result's status: ``optimal`` when proven, else ``feasible``."""
    return "optimal" if optimal else "feasible"
