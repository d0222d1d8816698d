"""Search benchmark on the Tessel placements (docs/design.md §6) and the zero-bubble paper's setting.

Run ``python benchmarks/search_tessel_placements.py`` (``--help`` for the sections, the time
limit and the worker count). Each row is one ``pipeloom.search.search`` call, re-validated here:
makespan, proven lower bound, gap, solver status and wall seconds, plus the best built-in
schedule that fits the placement (re-targeted to its costs) where one does.

Sections: ``tessel4`` (every placement, 4 ranks, M=128, limit 6), ``tessel8`` (8 ranks, M=128,
limit 6), ``exact4`` (4 ranks, M = 4 and 8, exact mode: is optimality proven?), ``zb`` (p=8, m=24,
f=18522, b=18086, w=9337, comm=601, limit = 1F1B's peak, linear and V placements).
"""

from __future__ import annotations

import argparse
import time

import ortools  # noqa: F401  (before anything that may load SciPy)

from pipeloom.problem import Problem
from pipeloom.schedules import build_schedule
from pipeloom.search import PLACEMENTS, placement, search
from pipeloom.search.builtins import builtin_candidates
from pipeloom.sim import simulate
from pipeloom.stages import Costs, stage_graph
from pipeloom.validate import validate

__all__ = ["TESSEL", "ZB_COSTS", "main", "number", "print_table", "row"]

TESSEL = ("vshape", "xshape", "mshape", "nnshape", "mllm", "kshape", "finetune", "alphafold")
ZB_COSTS = Costs(f=18522, b=18086, w=9337, comm=601)
"""The zero-bubble paper's per-rank costs (p=8, m=24), as in ``pipeloom demo``."""

COLUMNS = ("placement", "ranks", "M", "limit", "mode", "makespan", "lower bound", "gap", "status",
           "period (bound)", "seconds", "best built-in")


def number(value: float) -> str:
    """Up to one decimal from 1000 on (the paper's costs run to millions), else 4 digits."""
    return f"{value:.1f}".rstrip("0").rstrip(".") if abs(value) >= 1000 else f"{value:.4g}"


def row(label: str, problem: Problem, microbatches: int, *, mode: str, time_limit: float,
        workers: int) -> list[str]:
    """Search once, check the answer independently, and format a table row."""
    builtins = {name: t.makespan for name, t in builtin_candidates(problem, microbatches)}
    best_builtin = min(builtins, key=builtins.__getitem__, default=None)
    result = search(problem, microbatches, mode=mode, time_limit=time_limit, workers=workers)
    timeline = validate(result.schedule, ordered=True)
    assert abs(timeline.makespan - result.makespan) <= 1e-6 * result.makespan, "reported makespan"
    limit = problem.memory_limit
    assert limit is None or max(timeline.peak_memory) <= limit + 1e-9, "memory limit"
    if best_builtin is not None:
        assert result.makespan <= builtins[best_builtin] + 1e-9, "worse than a built-in"
    period = "-"
    if result.period is not None:
        period = f"{number(result.period)} ({number(result.period_lower_bound)})"
    builtin = "-" if best_builtin is None else f"{best_builtin} {number(builtins[best_builtin])}"
    return [label, str(problem.num_ranks), str(microbatches), "-" if limit is None else f"{limit:g}",
            result.mode + (" (=built-in)" if "(=" in result.schedule.name else ""),
            number(result.makespan), number(result.lower_bound), f"{result.gap:.2%}", result.status,
            period, f"{result.seconds:.2f}", builtin]


def print_table(title: str, rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(COLUMNS, widths))))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))),
              flush=True)


def zero_bubble_problems() -> list[tuple[str, Problem, float]]:
    """The paper's setting as the linear (ZB-H1 layout) and V (ZB-V layout) placements, limit =
    1F1B's peak on these costs."""
    p, m = 8, 24
    peak = max(simulate(build_schedule("1f1b", p, m, costs=ZB_COSTS)).peak_memory)
    linear = stage_graph([ZB_COSTS.stage(r) for r in range(p)], backward="split",
                         comm_latency=ZB_COSTS.comm, memory_limit=peak)
    v_ranks = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    v = stage_graph([ZB_COSTS.stage(r, share=0.5) for r in v_ranks], num_ranks=p, backward="split",
                    comm_latency=ZB_COSTS.comm, memory_limit=peak)
    return [("linear (zb)", linear, peak), ("v (zb)", v, peak)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["tessel4", "tessel8", "exact4", "zb"],
                        choices=["tessel4", "tessel8", "exact4", "zb"])
    parser.add_argument("--time-limit", type=float, default=10.0, help="per search, seconds (default 10)")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT workers (default 2)")
    args = parser.parse_args(argv)
    run = {"time_limit": args.time_limit, "workers": args.workers}
    assert set(TESSEL) <= set(PLACEMENTS)
    began = time.perf_counter()
    for ranks, section in ((4, "tessel4"), (8, "tessel8")):
        if section in args.sections:
            rows = [row(name, placement(name, ranks, memory_limit=6), 128, mode="auto", **run)
                    for name in TESSEL]
            print_table(f"Tessel placements, {ranks} ranks, M=128, memory limit 6, auto mode", rows)
    if "exact4" in args.sections:
        rows = [row(name, placement(name, 4, memory_limit=6), m, mode="exact", **run)
                for name in TESSEL for m in (4, 8)]
        print_table("Tessel placements, 4 ranks, M <= 8, memory limit 6, exact mode", rows)
    if "zb" in args.sections:
        rows = [row(label, problem, 24, mode=mode, **run)
                for label, problem, _ in zero_bubble_problems() for mode in ("auto", "exact")]
        print_table("Zero-bubble paper setting: p=8, m=24, f=18522, b=18086, w=9337, comm=601, "
                    "limit = 1F1B's peak", rows)
    print(f"\ntotal {time.perf_counter() - began:.1f} s, time limit {args.time_limit:g} s per search, "
          f"{args.workers} workers")


if __name__ == "__main__":
    main()
