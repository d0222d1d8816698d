"""Record the zero-bubble authors' ZB-V generator's makespans as data: benchmarks/data/zbv_reference.json.

Run ``python benchmarks/zbv_reference_data.py`` (``--reference`` points at the runner,
default ``../shared/reference/zb_v_run.py`` beside the repository). It runs the runner once per
cell of the grid below, one process per cell with a time limit, and writes every cell's settings
and makespan (or ``skipped`` with the reason). The per-rank orders are not kept.
``benchmarks/schedule_quality.py --section zbv`` compares pipeloom's ``zbv`` against this file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["COST_SETS", "MEMORY_FACTORS", "MICROBATCHES", "RANKS", "W_MEMORY", "cells", "main"]

RANKS = (4, 8, 16)
MICROBATCHES = (8, 16, 24, 32, 64, 128)
COST_SETS = {
    "unit": {"f": 1.0, "b": 1.0, "w": 1.0, "comm": 0.0},
    "uneven": {"f": 1.0, "b": 2.0, "w": 0.5, "comm": 0.1},
    "paper": {"f": 18522.0, "b": 18086.0, "w": 9337.0, "comm": 601.0},
}
"""f, b (input gradient), w and comm of one rank's share, pipeloom's units (docs/semantics.md)."""
MEMORY_FACTORS = (1.0, 1.5, 2.0)
"""Memory limit as a multiple of 1F1B's peak, p micro-batches of one rank's share."""
W_MEMORY = (0.0, 0.43)
"""Fraction of a forward's memory that W frees (the rest is freed by I)."""

ROOT = Path(__file__).resolve().parent
DEFAULT_REFERENCE = ROOT.parent.parent / "shared" / "reference" / "zb_v_run.py"
DEFAULT_OUTPUT = ROOT / "data" / "zbv_reference.json"


def cells() -> list[dict[str, object]]:
    """Every setting of the grid: p, m, cost set name and costs, memory_limit, w_memory."""
    grid = []
    for name, costs in COST_SETS.items():
        for p in RANKS:
            for m in MICROBATCHES:
                for factor in MEMORY_FACTORS:
                    for w_memory in W_MEMORY:
                        grid.append({"p": p, "m": m, "costs": name, **costs,
                                     "memory_limit": factor * p, "w_memory": w_memory})
    return grid


def command(reference: Path, cell: dict[str, object]) -> list[str]:
    """The runner's command line for one cell."""
    return [sys.executable, str(reference), str(cell["p"]), str(cell["m"]),
            "--f", repr(cell["f"]), "--b", repr(cell["b"]), "--w", repr(cell["w"]),
            "--comm", repr(cell["comm"]), "--memory-limit", repr(cell["memory_limit"]),
            "--w-memory", repr(cell["w_memory"])]


def run_cell(reference: Path, cell: dict[str, object], timeout: float) -> dict[str, object]:
    """The cell with ``makespan`` and ``seconds``, or ``skipped`` and the reason."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command(reference, cell), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {**cell, "makespan": None, "skipped": f"took more than {timeout:g} s"}
    seconds = round(time.perf_counter() - start, 2)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**cell, "makespan": None, "skipped": f"runner failed: {reason}", "seconds": seconds}
    return {**cell, "makespan": json.loads(done.stdout)["makespan"], "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE, help="path of zb_v_run.py")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per cell before it is skipped")
    args = parser.parse_args(argv)
    results = []
    for index, cell in enumerate(cells(), 1):
        results.append(run_cell(args.reference, cell, args.timeout))
        print(f"{index:4d} {cell['costs']:<7} p={cell['p']:<3} m={cell['m']:<4} limit={cell['memory_limit']:<5g} "
              f"w_memory={cell['w_memory']:<5g} -> {results[-1]['makespan']}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "format": "pipeloom.zbv_reference/1",
        "command": "python benchmarks/zbv_reference_data.py",
        "reference": "zero-bubble authors' ZB-V generator via ../shared/reference/zb_v_run.py "
                     "P M --f F --b B --w W --comm C --memory-limit L --w-memory X",
        "units": "pipeloom's: f, b, w, comm per rank share; memory_limit in micro-batches of a rank share; "
                 "w_memory is the fraction of a forward's memory that W frees",
        "cells": results,
    }
    args.output.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.output} ({sum(r['makespan'] is not None for r in results)} of {len(results)} cells)")


if __name__ == "__main__":
    main()
