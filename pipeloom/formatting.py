"""How numbers are written for people, in every view and message: thousands separators as in the
tables (``1,456,749``), seconds scaled to s/ms/us (``12.345 ms``), bytes in binary units (``80 GiB``).

It imports nothing from pipeloom, so any layer may use it (the planner's messages, the trace
analysis, the pictures).
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_number", "format_seconds", "time_scale"]

_SECOND_SCALES = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"))


def format_number(value: float) -> str:
    """``value`` with thousands separators and at most 3 decimals, trailing zeros dropped (the tables'
    form, :func:`pipeloom.formatting.format_number`); from 10^15 on, 6 significant digits."""
    if abs(value) >= 1e15:
        return f"{value:.6g}"
    text = f"{value:,.3f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def time_scale(span: float) -> tuple[float, str]:
    """``(seconds per unit, unit)`` that writes times up to ``span`` seconds with 1 to 3 integer digits."""
    for factor, name in _SECOND_SCALES:
        if span >= factor:
            return factor, name
    return _SECOND_SCALES[-1]


def format_seconds(value: float) -> str:
    """``0.012345 -> "12.345 ms"``: seconds in s, ms or us, 3 decimals at most."""
    factor, name = time_scale(abs(value))
    return f"{format_number(value / factor)} {name}"


def format_bytes(nbytes: float) -> str:
    """``85899345920 -> "80 GiB"`` (binary units, three significant digits)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"
