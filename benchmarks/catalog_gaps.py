"""Which side is weak where the 8-rank catalog placements miss a 2 % gap: the schedule or the bound.

Run ``python benchmarks/catalog_gaps.py`` (``--help`` for the cases and time limits). Per case
(placement, memory limit) it prints:

- the answer of ``search(placement(name, 8, memory_limit=L), 128, time_limit, workers=1)``:
  makespan, lower bound, gap, origin, and its makespan per micro-batch after the fill
  (``(makespan(128) - OPT(M0)) / (128 - M0)``, the slope the schedule reaches);
- exact mode at small M (status ``optimal`` = proven): the optimum against the bound at that M;
- the slope of the bound, ``(LB(256) - LB(128)) / 128``;
- the steady state: the periodic model's repetend for R = 1, 2, 3 micro-batches per period,
  each solved for ``--repetend-time`` s, with its best time per micro-batch and the solver's
  proven least time per micro-batch for that R (``T/R >= proven``; the model's class only:
  R copies, in-flight counts up to its ``k_max``);
- a verdict: ``bound`` when no R <= 3 repetend beats the bound's slope by 2 % (proven), so the
  bound's slope is not reached by any such steady state; ``schedule`` when a repetend or the small-M
  slope is within 2 % of the bound's slope and the 128-micro-batch answer is not; ``open`` otherwise.
"""

from __future__ import annotations

import argparse
import time

import ortools  # noqa: F401  (before anything that may load SciPy)
from ortools.sat.python import cp_model

from pipeloom.search import placement, search
from pipeloom.search.common import lower_bound, to_integers
from pipeloom.search.repetend import RepetendModel, coarsen

__all__ = ["CASES", "main", "repetend_periods", "verdict"]

CASES = (("nnshape", 6), ("mllm", 6), ("alphafold", 6), ("nnshape", 8), ("mllm", 8), ("alphafold", 8))
"""The (placement, limit) pairs above a 2 % gap at 8 ranks, M = 128 (docs/search.md); vshape, mshape
and finetune at limit 6 left the list with the release-chain bound (``--cases vshape:6`` still runs them)."""

RANKS = 8
M = 128
TOLERANCE = 0.02


def repetend_periods(problem, copies: int, seconds: float) -> tuple[float | None, float, str]:
    """``(best T/R found, proven least T/R, status)`` of the R-copy repetend model, real units."""
    ip = coarsen(to_integers(problem))
    model = RepetendModel(ip, copies=copies, limits=ip.limits)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = 1
    status = solver.solve(model.model)
    scale = ip.time_scale * copies
    found = solver.value(model.period) / scale if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    proven = max(model.period_low, solver.best_objective_bound) / scale
    return found, proven, solver.status_name(status).lower()


def verdict(bound_slope: float, answer_slope: float, best_period: float | None, proven_period: float,
            exact_slope: float | None) -> str:
    """``bound`` / ``schedule`` / ``open`` (see the module docstring)."""
    if proven_period > bound_slope * (1 + TOLERANCE):
        return "bound"
    reachable = [s for s in (best_period, exact_slope) if s is not None]
    if reachable and min(reachable) <= bound_slope * (1 + TOLERANCE) < answer_slope:
        return "schedule"
    return "open"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(f"{n}:{limit}" for n, limit in CASES),
                        help="comma-separated NAME:LIMIT pairs")
    parser.add_argument("--time", type=float, default=10.0, help="search time limit at M=128 (s)")
    parser.add_argument("--exact", default="4,8", help="small M for exact mode, comma-separated")
    parser.add_argument("--exact-time", type=float, default=6.0, help="exact mode time limit per M (s)")
    parser.add_argument("--repetend-time", type=float, default=6.0, help="time per repetend model (s)")
    args = parser.parse_args()
    small = [int(m) for m in args.exact.split(",")]
    began = time.perf_counter()
    rows = []
    for case in args.cases.split(","):
        name, limit = case.split(":")
        problem = placement(name, RANKS, memory_limit=float(limit))
        answer = search(problem, M, time_limit=args.time, workers=1)
        exact = [(m, search(problem, m, mode="exact", time_limit=args.exact_time, workers=1)) for m in small]
        bound_slope = (lower_bound(problem, 2 * M) - lower_bound(problem, M)) / M
        (m0, r0), (m1, r1) = exact[0], exact[-1]
        proven_small = r0.status == "optimal" and r1.status == "optimal" and m1 > m0
        exact_slope = (r1.makespan - r0.makespan) / (m1 - m0) if proven_small else None
        answer_slope = (answer.makespan - r1.makespan) / (M - m1)
        periods = [repetend_periods(problem, r, args.repetend_time) for r in (1, 2, 3)]
        found = [p for p, _, _ in periods if p is not None]
        best_period = min(found, default=None)
        proven_period = min(p for _, p, _ in periods)
        rows.append((
            name, limit, f"{answer.makespan:g}", f"{answer.lower_bound:.1f}", f"{answer.gap:.1%}",
            answer.origin,
            "; ".join(f"M={m}: {r.makespan:g}/{r.lower_bound:.4g} {r.status[:3]}" for m, r in exact),
            f"{bound_slope:.3f}", f"{answer_slope:.3f}",
            " ".join(f"{'-' if p is None else f'{p:.3g}'}>={b:.3g}" for p, b, _ in periods),
            verdict(bound_slope, answer_slope, best_period, proven_period, exact_slope),
        ))
        print(f"  done {name}:{limit} ({time.perf_counter() - began:.0f} s)", flush=True)
    header = ("placement", "limit", "M=128", "bound", "gap", "origin", "exact small M (opt/bound)",
              "bound slope", "answer slope", "repetend T/R >= proven (R=1,2,3)", "weak side")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    print(f"8 ranks, M={M}, search {args.time:g} s, exact {args.exact_time:g} s, repetend "
          f"{args.repetend_time:g} s per R, workers 1")
    for row in [header, *rows]:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
    print(f"total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
