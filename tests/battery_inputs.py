"""The inputs of the reliability battery (docs/limits.md, "The battery"): oversized problem, schedule and cost
files written as plain JSON, shared by ``tests/test_battery.py`` and ``benchmarks/battery.py``."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["BATTERY_COMMANDS", "chain_problem_file", "cost_table_file", "wide_schedule_file", "write_inputs"]


def chain_problem_file(path: Path, stages: int, *, ranks: int = 8) -> Path:
    """A search problem file: a chain of ``stages`` stages (an F and a B each, so 2 x ``stages`` tasks)."""
    tasks = []
    for s in range(stages):
        tasks.append({"stage": s, "kind": "F", "ranks": [s % ranks], "duration": 1, "memory": 1,
                      "deps": [f"{s - 1}F"] if s else []})
        tasks.append({"stage": s, "kind": "B", "ranks": [s % ranks], "duration": 2, "memory": -1,
                      "deps": [f"{s}F"] + ([f"{s + 1}B"] if s + 1 < stages else [])})
    path.write_text(json.dumps({"num_ranks": ranks, "tasks": tasks}))
    return path


def wide_schedule_file(path: Path, ranks: int) -> Path:
    """A ``pipeloom.schedule/1`` file of ``ranks`` ranks, one task on rank 0 and the others idle."""
    document = {"format": "pipeloom.schedule/1", "name": "wide", "num_ranks": ranks, "num_microbatches": 1,
                "tasks": [{"stage": 0, "kind": "F", "ranks": [0], "duration": 1, "memory": 0, "deps": []}],
                "ranks": [["0F0"]] + [[] for _ in range(ranks - 1)]}
    path.write_text(json.dumps(document))
    return path


def cost_table_file(path: Path, pieces: int) -> Path:
    """A ``pipeloom.costs/2`` table of ``pieces`` equal pieces (1 ms forward, 1 ms I, 0.5 ms W, 1 MB each)."""
    entries = [{"name": f"b.{k}", "f": 1e-3, "i": 1e-3, "w": 5e-4, "activation_bytes": 1e6, "param_bytes": 1e6,
                "output_bytes": 1e5} for k in range(pieces)]
    path.write_text(json.dumps({"format": "pipeloom.costs/2", "microbatch_size": 1, "pieces": entries}))
    return path


def write_inputs(folder: Path) -> dict[str, Path]:
    """Every file the battery's commands read, written into ``folder``."""
    return {
        "problem200k.json": chain_problem_file(folder / "problem200k.json", 100_000),
        "ranks1m.json": wide_schedule_file(folder / "ranks1m.json", 1_000_000),
        "small.json": cost_table_file(folder / "small.json", 8),
        "p5k.json": cost_table_file(folder / "p5k.json", 5_000),
        "p100k.json": cost_table_file(folder / "p100k.json", 100_000),
    }


BATTERY_COMMANDS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("search, 200k tasks", ("search", "--problem", "problem200k.json", "--microbatches", "2"), 1),
    ("simulate, 10^6 ranks", ("simulate", "ranks1m.json"), 2),
    ("plan, 5,000 pieces", ("plan", "--costs", "p5k.json", "--ranks", "4", "--global-batch", "8"), 0),
    ("plan, 100,000 pieces", ("plan", "--costs", "p100k.json", "--ranks", "4", "--global-batch", "8"), 1),
    ("plan --global-batch 10**12", ("plan", "--costs", "small.json", "--ranks", "4", "--global-batch",
                                    str(10**12)), 0),
    ("plan --stages-per-rank 1000", ("plan", "--costs", "small.json", "--ranks", "4", "--global-batch", "8",
                                     "--stages-per-rank", "1000"), 0),
    ("picture, 200k actions", ("show", "1f1b", "--ranks", "100", "--microbatches", "1000", "-o", "big.png"), 0),
)
"""The battery's commands: (what, ``pipeloom`` arguments run in the inputs' folder, expected exit status)."""
