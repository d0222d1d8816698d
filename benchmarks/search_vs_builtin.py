"""Search versus the built-in schedules on the placements they were made for.

Run ``python benchmarks/search_vs_builtin.py`` (``--help`` for ranks, micro-batches, time limit).
For the linear placement (1F1B; ZB-H1 with a split backward), the V placement (ZB-V) and the
interleaved placement (interleaved 1F1B, 2 stages per rank), at several rank counts,
micro-batch counts and memory limits, it prints the built-in's makespan (built by the library,
re-targeted and validated under the same limit; "-" when it does not meet it), the search's
makespan, its proven lower bound and gap, and the seconds the search took. Costs are the
library's defaults (F 1, I 1, W 1 per rank share; B = I + W) and the zero-bubble paper's; limits
are in units of one rank share's activations (1F1B holds p).
"""

from __future__ import annotations

import argparse
import time

import ortools  # noqa: F401  (before anything that may load SciPy)

from pipeloom.problem import Problem
from pipeloom.search import placement, search
from pipeloom.search.builtins import builtin_candidates
from pipeloom.stages import Costs, stage_graph
from pipeloom.validate import validate

__all__ = ["CASES", "COSTS", "main", "problem_for"]

CASES = (
    # (placement, split backward, built-in it is compared with, limits as functions of p)
    ("linear", False, "1f1b", (lambda p: p, lambda p: None)),
    ("linear", True, "zb-h1", (lambda p: p, lambda p: 2 * p)),
    ("v", True, "zbv", (lambda p: p, lambda p: p / 2)),
    ("interleaved", False, "interleaved-1f1b", (lambda p: 1.5 * p, lambda p: None)),
)
COSTS = {"unit": Costs(), "zb": Costs(f=18522, b=18086, w=9337, comm=601)}
"""Per-rank-share costs: the library's defaults, and the zero-bubble paper's (F, I, W, comm)."""
COLUMNS = ("placement", "built-in", "ranks", "M", "limit", "built-in makespan", "search makespan",
           "search/built-in", "lower bound", "gap", "mode", "winner", "seconds")


def problem_for(name: str, ranks: int, *, split: bool, costs: Costs, limit: float | None) -> Problem:
    """The catalog's classic placement ``name`` with ``costs`` (the catalog uses Costs()):
    linear = stage r on rank r; v = 2p stages down and back up the ranks; interleaved = 2p stages,
    stage s on rank s % p; v and interleaved stages carry half a rank share each."""
    if name == "linear":
        stage_ranks, share = list(range(ranks)), 1.0
    elif name == "v":
        stage_ranks, share = [s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)], 0.5
    else:
        stage_ranks, share = [s % ranks for s in range(2 * ranks)], 0.5
    problem = stage_graph([costs.stage(r, share=share) for r in stage_ranks], num_ranks=ranks,
                          backward="split" if split else "full", comm_latency=costs.comm,
                          memory_limit=limit)
    if costs == Costs():
        assert problem == placement(name, ranks, split_backward=split, memory_limit=limit)
    return problem


def number(value: float) -> str:
    """Up to one decimal from 1000 on (the paper's costs run to millions), else 4 digits."""
    return f"{value:.1f}".rstrip("0").rstrip(".") if abs(value) >= 1000 else f"{value:.4g}"


def compare(name: str, split: bool, builtin: str, ranks: int, microbatches: int, limit: float | None,
            *, costs: Costs, time_limit: float, workers: int) -> list[str]:
    """One row: the built-in at this limit, the search, its bound; the answer re-validated."""
    problem = problem_for(name, ranks, split=split, costs=costs, limit=limit)
    builtins = {key: t.makespan for key, t in builtin_candidates(problem, microbatches)}
    result = search(problem, microbatches, time_limit=time_limit, workers=workers)
    timeline = validate(result.schedule, ordered=True)
    assert abs(timeline.makespan - result.makespan) <= 1e-9 * max(1.0, result.makespan)
    reference = builtins.get(builtin)
    if reference is not None:
        assert result.makespan <= reference + 1e-9, f"search worse than {builtin}"
    winner = result.schedule.name.partition("(=")[2].rstrip(")") or "search"
    return [name + (" split" if split else ""), builtin, str(ranks), str(microbatches),
            "none" if limit is None else f"{limit:g}", "-" if reference is None else number(reference),
            number(result.makespan), "-" if reference is None else f"{result.makespan / reference:.3f}",
            number(result.lower_bound), f"{result.gap:.2%}", result.mode, winner, f"{result.seconds:.2f}"]


def print_table(title: str, rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print(f"\n{title}")
    for cells in (COLUMNS, *rows):
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--costs", nargs="+", choices=sorted(COSTS), default=["unit", "zb"])
    parser.add_argument("--time-limit", type=float, default=10.0, help="per search, seconds (default 10)")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT workers (default 2)")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    for label in args.costs:
        costs = COSTS[label]
        rows = [compare(name, split, builtin, ranks, microbatches, limit(ranks), costs=costs,
                        time_limit=args.time_limit, workers=args.workers)
                for name, split, builtin, limits in CASES for ranks in args.ranks
                for microbatches in args.microbatches for limit in limits]
        print_table(f"{label} costs: f={costs.f:g}, b={costs.b:g}, w={costs.w:g}, comm={costs.comm:g} "
                    "(per rank share; B = b + w)", rows)
    print(f"\ntotal {time.perf_counter() - began:.1f} s, time limit {args.time_limit:g} s per search, "
          f"{args.workers} workers")


if __name__ == "__main__":
    main()
