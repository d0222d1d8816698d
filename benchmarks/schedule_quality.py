"""Schedule quality against references: one table per section, ratios measured side by side.

Run ``python benchmarks/schedule_quality.py`` (all sections) or ``--section zbv``. Sections:

- ``zbv``: pipeloom's ``zbv`` against the zero-bubble authors' ZB-V generator, whose makespans are
  recorded in ``benchmarks/data/zbv_reference.json`` by ``python benchmarks/zbv_reference_data.py``.
  Target: no cell slower than the reference.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from pipeloom.problem import Costs
from pipeloom.schedules import build_schedule
from pipeloom.sim import simulate

__all__ = ["SECTIONS", "main", "zbv_section"]

DATA = Path(__file__).resolve().parent / "data"
_TOLERANCE = 1e-9
"""Relative slack for "not slower": both sides add the same floats in different orders."""


def zbv_section() -> bool:
    """Every recorded cell: zbv's makespan, the reference's, the ratio; True if no cell is slower."""
    data = json.loads((DATA / "zbv_reference.json").read_text())
    print(f"== zbv against the authors' ZB-V generator ({data['command']}) ==")
    print(f"{'costs':<7} {'p':>3} {'m':>4} {'limit':>6} {'w_mem':>5} {'reference':>12} {'zbv':>12} {'ratio':>7} {'build s':>7}")
    slower, ratios, skipped = [], [], 0
    for cell in data["cells"]:
        if cell["makespan"] is None:
            skipped += 1
            print(f"{cell['costs']:<7} {cell['p']:>3} {cell['m']:>4} skipped: {cell['skipped']}")
            continue
        costs = Costs(f=cell["f"], b=cell["b"], w=cell["w"], comm=cell["comm"], w_memory=cell["w_memory"])
        start = time.perf_counter()
        schedule = build_schedule("zbv", cell["p"], cell["m"], costs=costs, memory_limit=cell["memory_limit"])
        seconds = time.perf_counter() - start
        ours, reference = simulate(schedule).makespan, cell["makespan"]
        ratio = ours / reference
        ratios.append(ratio)
        mark = "  SLOWER" if ratio > 1 + _TOLERANCE else ""
        if mark:
            slower.append(cell)
        print(f"{cell['costs']:<7} {cell['p']:>3} {cell['m']:>4} {cell['memory_limit']:>6g} {cell['w_memory']:>5g} "
              f"{reference:>12.6g} {ours:>12.6g} {ratio:>7.4f} {seconds:>7.3f}{mark}")
    ratios.sort()
    print(f"zbv verdict: {len(slower)} of {len(ratios)} cells slower than the reference "
          f"(worst ratio {ratios[-1]:.4f}, median {ratios[len(ratios) // 2]:.4f}, best {ratios[0]:.4f}"
          f"{f', {skipped} skipped' if skipped else ''}); target: none slower -> "
          f"{'MET' if not slower else 'NOT MET'}")
    return not slower


SECTIONS: dict[str, Callable[[], bool]] = {"zbv": zbv_section}
"""Section name -> function printing its table and returning whether its target is met."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append",
                        help="run only this section (repeatable); default: all")
    args = parser.parse_args(argv)
    met = [SECTIONS[name]() for name in (args.section or list(SECTIONS))]
    return 0 if all(met) else 1


if __name__ == "__main__":
    raise SystemExit(main())
