"""Cost tables: per-piece times and bytes of a model, the link between ranks, the runtime's fitted
corrections, and the ``pipeloom.costs/2`` JSON form users can read and edit (``/1`` files still load;
no torch here).

A *piece* is a part of the model the runtime can cut at: its name is a module name that
``pipeloom.runtime.split_model`` accepts as a split point (e.g. ``blocks.3``). Pieces are listed in
call order; each names the pieces whose outputs it reads (``inputs``), so they form a DAG, normally
a chain.

The types live in :mod:`~pipeloom.plan.cost_parts` and :mod:`~pipeloom.plan.cost_table`, the file
form in :mod:`~pipeloom.plan.costs_json`; this module gathers them and reads sizes such as ``80GiB``.
"""

from __future__ import annotations

import re

from pipeloom.formatting import format_bytes
from pipeloom.ir.core import shown
from pipeloom.plan.cost_parts import CostTableError, Link, Piece, RuntimeCorrections, SharedParam, check_number
from pipeloom.plan.cost_table import CostTable, table_for_size
from pipeloom.plan.costs_json import (
    COSTS_FORMAT,
    COSTS_FORMAT_V1,
    costs_from_json,
    costs_to_json,
    load_costs,
    save_costs,
)

__all__ = [
    "COSTS_FORMAT",
    "COSTS_FORMAT_V1",
    "CostTable",
    "CostTableError",
    "Link",
    "Piece",
    "RuntimeCorrections",
    "SharedParam",
    "costs_from_json",
    "costs_to_json",
    "format_bytes",
    "load_costs",
    "parse_bytes",
    "save_costs",
    "table_for_size",
]


# ----------------------------------------------------------------------------------------- bytes

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | float) -> float:
    """``"80GiB" -> 85899345920.0``: a number with an optional unit B, KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024), any case; a bare number is bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return check_number("a byte count", text)
    match = _SIZE.match(text) if isinstance(text, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise CostTableError(
            f"bad size {shown(text)}: write a number and a unit such as 80GiB, 512MiB, 16GB or 1e9 (bytes)"
        )
    return check_number("a byte count", float(match.group(1)) * _UNITS[unit])
