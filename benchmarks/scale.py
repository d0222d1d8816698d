"""Scale benchmark: seconds to build, validate and simulate big schedules, and how they grow.

Run ``python benchmarks/scale.py`` (``--help`` for sizes and repeats, ``--profile`` for a
cProfile of simulate and validate). Every time is the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time
from collections.abc import Callable

from pipeloom.ir import Schedule
from pipeloom.schedules import build_schedule
from pipeloom.sim import simulate
from pipeloom.validate import validate

__all__ = ["main"]

SCHEDULES = ("1f1b", "zbv")


def best_of(repeats: int, run: Callable[[], object]) -> tuple[float, object]:
    """Best wall time of ``repeats`` calls of ``run`` and the last result.

    Each call starts from a clean heap, as a fresh process would: the previous result is dropped
    and collected first, so the garbage collector (left on, as in real use) does not also walk
    the hundreds of thousands of actions of an earlier repeat.
    """
    best, result = float("inf"), None
    for _ in range(repeats):
        result = None
        gc.collect()
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(name: str, ranks: int, microbatches: int, repeats: int) -> dict[str, float] | None:
    """Seconds to build, validate (ordered; it simulates) and simulate one schedule; None if missing."""
    try:
        build, schedule = best_of(repeats, lambda: build_schedule(name, ranks, microbatches))
    except ImportError:
        return None
    assert isinstance(schedule, Schedule)
    check, _ = best_of(repeats, lambda: validate(schedule, ordered=True))
    replay, _ = best_of(repeats, lambda: simulate(schedule))
    return {"actions": schedule.num_actions, "build": build, "validate": check, "simulate": replay,
            "total": build + check + replay}


def size_table(ranks: int, microbatches: int, repeats: int) -> str:
    """One row per schedule at one size: build, validate, simulate and total seconds."""
    lines = [f"p={ranks}, m={microbatches}, best of {repeats}",
             (f"{'schedule':<10} {'actions':>9} {'build s':>8} {'validate s':>10} {'simulate s':>10} "
              f"{'total s':>8}")]
    for name in SCHEDULES:
        row = measure(name, ranks, microbatches, repeats)
        if row is None:
            lines.append(f"{name:<10} {'(missing: module not written yet)':>50}")
            continue
        lines.append(f"{name:<10} {row['actions']:>9} {row['build']:>8.3f} {row['validate']:>10.3f} "
                     f"{row['simulate']:>10.3f} {row['total']:>8.3f}")
    return "\n".join(lines)


def growth_table(name: str, ranks: int, sizes: list[int], repeats: int) -> str:
    """Total seconds as m doubles; the ratio to the previous row is ~2 when the work is linear."""
    lines = [f"{name}, p={ranks}: total = build + validate + simulate, best of {repeats}",
             f"{'m':>6} {'actions':>9} {'total s':>8} {'s/1k actions':>12} {'ratio':>6}"]
    previous = None
    for microbatches in sizes:
        row = measure(name, ranks, microbatches, repeats)
        if row is None:
            lines.append(f"{microbatches:>6} (missing: module not written yet)")
            break
        ratio = f"{row['total'] / previous:>6.2f}" if previous else f"{'-':>6}"
        per_k = 1000 * row["total"] / row["actions"]
        lines.append(f"{microbatches:>6} {row['actions']:>9} {row['total']:>8.3f} {per_k:>12.5f} {ratio}")
        previous = row["total"]
    return "\n".join(lines)


def profile(name: str, ranks: int, microbatches: int, top: int) -> str:
    """cProfile of validate (ordered) and simulate on one schedule, by own time."""
    schedule = build_schedule(name, ranks, microbatches)
    out = io.StringIO()
    for label, run in (("validate", lambda: validate(schedule, ordered=True)),
                       ("simulate", lambda: simulate(schedule))):
        profiler = cProfile.Profile()
        profiler.runcall(run)
        out.write(f"--- {label} {name} p={ranks} m={microbatches}\n")
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    """Print the size table and the growth tables (and a profile with --profile)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--growth", type=int, nargs=2, default=(128, 4096), metavar=("FIRST", "LAST"),
                        help="micro-batch counts of the growth table, doubling from FIRST to LAST")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print cProfile tables instead")
    args = parser.parse_args(argv)
    if args.profile:
        for name in SCHEDULES:
            print(profile(name, args.ranks, args.microbatches, top=12))
        return
    print(size_table(args.ranks, args.microbatches, args.repeats))
    sizes = []
    m = args.growth[0]
    while m <= args.growth[1]:
        sizes.append(m)
        m *= 2
    for name in SCHEDULES:
        print()
        print(growth_table(name, args.ranks, sizes, args.repeats))


if __name__ == "__main__":
    main()
