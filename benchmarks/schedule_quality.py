"""Schedule quality against references: one table per section, ratios measured side by side.

Run ``python benchmarks/schedule_quality.py`` (all sections) or ``--section zbv``. Sections:

- ``zbv``: pipeloom's ``zbv`` against the zero-bubble authors' ZB-V generator, whose makespans are
  recorded in ``benchmarks/data/zbv_reference.json`` by ``python benchmarks/zbv_reference_data.py``.
  Target: no cell slower than the reference.
- ``zbv-search``: the search (``pipeloom.search``, 5 s, 1 worker) on the V placement with the same
  costs, limit and W memory, on every cell where ``zbv`` is slower than the reference. Target: none
  slower.
- ``torch``: ``interleaved-zb`` and the search against torch's own ``ScheduleInterleavedZeroBubble``
  orders (``benchmarks/interleaved_zb_quality.py``'s grid), and ``zbv`` and the search against
  torch's ``ScheduleZBVZeroBubble`` orders (computed by torch's classes, loaded as torch CSV, timed
  by pipeloom's simulator under the same costs). Target: none slower, at most torch's memory.
- ``catalog``: the 8-device catalogue placements, 128 micro-batches, memory limits 6 and 8, 10 s:
  makespan, lower bound, gap and the search's wall time. Targets: gap <= 2 % on every placement,
  every search within its limit + 0.5 s.
- ``v-memory``: ``v-half`` and ``v-min`` at p in {4, 8, 16}, m in {2p, 4p}, unit and paper costs:
  bubble and peak of the paper's building block alone, of zbv's list order under the same memory,
  and of the schedule (the shorter), against the paper's documented memory ((p+2)//2, (p+4)//3;
  1F1B: p) and bubble (about p/(2m), 2p/(3m) at f = b = w). Targets: every peak within the
  documented memory; at unit costs every bubble at most the documented one.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from pipeloom.schedules import build_schedule
from pipeloom.sim import simulate
from pipeloom.stages import Costs

__all__ = ["SECTIONS", "catalog_section", "main", "torch_section", "v_memory_section", "zbv_search_section",
           "zbv_section"]

DATA = Path(__file__).resolve().parent / "data"
_TOLERANCE = 1e-9
"""Relative slack for "not slower": both sides add the same floats in different orders."""


def zbv_section() -> bool:
    """Every recorded cell: zbv's makespan, the reference's, the ratio; True if no cell is slower."""
    data = json.loads((DATA / "zbv_reference.json").read_text())
    print(f"== zbv against the authors' ZB-V generator ({data['command']}) ==")
    print(f"{'costs':<7} {'p':>3} {'m':>4} {'limit':>6} {'w_mem':>5} {'reference':>12} {'zbv':>12} {'ratio':>7} "
          f"{'build s':>7}")
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


def _v_costs(cell: dict) -> Costs:
    return Costs(f=cell["f"], b=cell["b"], w=cell["w"], comm=cell["comm"], w_memory=cell["w_memory"])


def zbv_search_section() -> bool:
    """The search on the cells where zbv is slower than the reference."""
    import ortools  # noqa: F401  (before anything that loads SciPy's HiGHS)

    from pipeloom.search import placement, search

    data = json.loads((DATA / "zbv_reference.json").read_text())
    print("== the search on the V placement, on the cells where zbv is slower than the generator ==")
    print(f"{'costs':<7} {'p':>3} {'m':>4} {'limit':>6} {'w_mem':>5} {'reference':>12} {'zbv':>12} "
          f"{'search':>12} {'ratio':>7} {'s':>5}  origin")
    slower, cells = [], 0
    for cell in data["cells"]:
        if cell["makespan"] is None:
            continue
        costs = _v_costs(cell)
        zbv_makespan = simulate(build_schedule("zbv", cell["p"], cell["m"], costs=costs,
                                               memory_limit=cell["memory_limit"])).makespan
        if zbv_makespan <= cell["makespan"] * (1 + _TOLERANCE):
            continue
        cells += 1
        problem = placement("v", cell["p"], split_backward=True, memory_limit=cell["memory_limit"],
                            comm_latency=cell["comm"], f=cell["f"], b=cell["b"], w=cell["w"],
                            w_memory=cell["w_memory"])
        found = search(problem, cell["m"], time_limit=5.0, workers=1)
        ratio = found.makespan / cell["makespan"]
        if ratio > 1 + _TOLERANCE:
            slower.append(cell)
        print(f"{cell['costs']:<7} {cell['p']:>3} {cell['m']:>4} {cell['memory_limit']:>6g} {cell['w_memory']:>5g} "
              f"{cell['makespan']:>12.6g} {zbv_makespan:>12.6g} {found.makespan:>12.6g} {ratio:>7.4f} "
              f"{found.seconds:>5.1f}  {found.origin}")
    print(f"zbv-search verdict: the search is slower than the reference on {len(slower)} of the {cells} cells "
          f"where zbv is; target: none -> {'MET' if not slower else 'NOT MET'}")
    return not slower


def torch_section() -> bool:
    """interleaved-zb / zbv and the search against torch's own zero-bubble orders."""
    import ortools  # noqa: F401

    from interleaved_zb_quality import (
        COST_SETS,
        interleaved_zb_vs_torch,
        torch_interleaved_zb_csv,
        torch_order_csv,
    )
    from pipeloom.ir import schedule_from_csv
    from pipeloom.search import placement, search
    from pipeloom.validate import validate

    print("== interleaved-zb against torch's InterleavedZeroBubble ==")
    rows = interleaved_zb_vs_torch()
    bad = [r for r in rows if r.ratio > 1 + _TOLERANCE or not r.memory_ok]
    print("== the search (3 s) and zbv against torch's orders, at torch's peak memory ==")
    print(f"{'order':<12} {'costs':>14} {'p':>2} {'m':>3} {'torch':>12} {'built-in':>12} {'search':>12} "
          f"{'ratio':>7} {'mem ok':>6}")
    for kind, builtin in (("interleaved", "interleaved-zb"), ("v", "zbv")):
        for name, costs in COST_SETS.items():
            for p in (2, 4, 8):
                for m in (8, 16, 24):
                    text = (torch_interleaved_zb_csv(p, m, 2) if kind == "interleaved"
                            else torch_order_csv("ScheduleZBVZeroBubble", p, m, 2))
                    if text is None:
                        continue
                    theirs = validate(schedule_from_csv(text, costs=costs), ordered=True)
                    limit = max(theirs.peak_memory)
                    options = {"stages_per_rank": 2} if kind == "interleaved" else {}
                    ours = validate(build_schedule(builtin, p, m, costs=costs, memory_limit=limit, **options),
                                    ordered=True)
                    problem = placement(kind, p, split_backward=True, memory_limit=limit, comm_latency=costs.comm,
                                        f=costs.f, b=costs.b, w=costs.w)
                    found = search(problem, m, time_limit=3.0, workers=1)
                    best = min(ours.makespan, found.makespan)
                    ratio = best / theirs.makespan
                    memory_ok = max(ours.peak_memory if ours.makespan <= found.makespan
                                    else simulate(found.schedule).peak_memory) <= limit + 1e-9
                    if ratio > 1 + _TOLERANCE or not memory_ok:
                        bad.append((kind, name, p, m))
                    print(f"{kind:<12} {name:>14} {p:>2} {m:>3} {theirs.makespan:>12.8g} {ours.makespan:>12.8g} "
                          f"{found.makespan:>12.8g} {ratio:>7.4f} {'yes' if memory_ok else 'NO':>6}")
    print(f"torch verdict: {len(bad)} cells slower than torch's order or above its memory; target: none -> "
          f"{'MET' if not bad else 'NOT MET'}")
    return not bad


CATALOG = ("vshape", "xshape", "mshape", "nnshape", "mllm", "kshape", "finetune", "alphafold")


def catalog_section() -> bool:
    """The 8-device catalogue: the search's makespan, bound, gap and wall time."""
    import ortools  # noqa: F401

    from pipeloom.search import placement, search

    print("== the 8-device catalogue, 128 micro-batches, 10 s per search (1 worker) ==")
    print(f"{'placement':<10} {'limit':>5} {'makespan':>10} {'bound':>10} {'gap':>7} {'wall s':>7}  origin")
    gaps, late = [], []
    for name in CATALOG:
        for limit in (6, 8):
            started = time.perf_counter()
            found = search(placement(name, 8, memory_limit=limit), 128, time_limit=10.0, workers=1)
            wall = time.perf_counter() - started
            gap = found.makespan / found.lower_bound - 1
            gaps.append((gap, name, limit))
            if wall > 10.5:
                late.append((name, limit, wall))
            print(f"{name:<10} {limit:>5} {found.makespan:>10.6g} {found.lower_bound:>10.6g} {gap:>7.2%} "
                  f"{wall:>7.2f}  {found.origin}")
    over = [g for g in gaps if g[0] > 0.02 + 1e-9]
    print(f"catalog verdict: gap <= 2 % on {len(gaps) - len(over)} of {len(gaps)} "
          f"(worst {max(gaps)[0]:.2%}: {max(gaps)[1]} at limit {max(gaps)[2]}); searches over limit + 0.5 s: "
          f"{len(late)} -> {'MET' if not over and not late else 'NOT MET'}")
    return not over and not late


def v_memory_section() -> bool:
    """V-Half and V-Min: the building block, zbv's list order at the same memory, the schedule's choice."""
    from pipeloom.schedules.common import make_schedule
    from pipeloom.schedules.v_block import block_order
    from pipeloom.schedules.v_memory import v_half_memory, v_min_memory

    print("== v-half and v-min: bubble ratio (peak memory) of the building block, zbv's list order at the "
          "documented memory, and the schedule; doc = the paper's ==")
    print(f"{'schedule':<7} {'costs':<5} {'p':>3} {'m':>4} {'block':>13} {'list':>13} {'schedule':>13} "
          f"{'doc bubble':>10} {'doc mem':>7} {'1F1B mem':>8}")
    cost_sets = {"unit": Costs(), "paper": Costs(f=18522, b=18086, w=9337, comm=601)}
    misses = []
    for name, variant, memory, documented_bubble in (
            ("v-half", "half", v_half_memory, lambda p, m: p / (2 * m)),
            ("v-min", "min", v_min_memory, lambda p, m: 2 * p / (3 * m))):
        for label, costs in cost_sets.items():
            for p in (4, 8, 16):
                for m in (2 * p, 4 * p):
                    chosen = build_schedule(name, p, m, costs=costs)
                    block = make_schedule(name, problem=chosen.problem, num_microbatches=m,
                                          ranks=block_order(p, m, variant))
                    listed = build_schedule("zbv", p, m, costs=costs, memory_limit=memory(p, costs=costs))
                    shown = []
                    for schedule in (block, listed, chosen):
                        timeline = simulate(schedule)
                        shown.append(f"{timeline.bubble_ratio:.3f} ({max(timeline.peak_memory):g})")
                    final = simulate(chosen)
                    limit, doc = memory(p, costs=costs), documented_bubble(p, m)
                    miss = max(final.peak_memory) > limit + _TOLERANCE or (
                        label == "unit" and final.bubble_ratio > doc + _TOLERANCE)
                    if miss:
                        misses.append((name, label, p, m))
                    print(f"{name:<7} {label:<5} {p:>3} {m:>4} {shown[0]:>13} {shown[1]:>13} {shown[2]:>13} "
                          f"{doc:>10.3f} {limit:>7g} {p:>8}{'  MISS' if miss else ''}")
    print(f"v-memory verdict: {len(misses)} cells miss (memory above the documented one anywhere, or bubble "
          f"above the documented one at unit costs) -> {'MET' if not misses else 'NOT MET'}")
    return not misses


SECTIONS: dict[str, Callable[[], bool]] = {"zbv": zbv_section, "zbv-search": zbv_search_section,
                                           "torch": torch_section, "catalog": catalog_section,
                                           "v-memory": v_memory_section}
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
