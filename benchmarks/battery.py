"""The reliability battery (docs/limits.md): how long each oversized input takes to end, against 20 s.

Run ``python benchmarks/battery.py`` (``--help``). It writes the inputs (tests/battery_inputs.py) into a
scratch folder, runs each ``pipeloom`` command as a subprocess (``--repeats`` times, the median wall time
kept) and prints a table: the command, its exit status and the expected one, the last line it printed and
its time as a ratio of the 20 s target. The machine's load goes into the times: say so with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from battery_inputs import BATTERY_COMMANDS, write_inputs  # noqa: E402

__all__ = ["main"]

TARGET = 20.0
"""Seconds each command must end within (issue 28)."""


def _run(folder: Path, args: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
    """``(exit status, wall seconds, last line printed)`` of ``pipeloom ARGS`` in ``folder``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pipeloom", *args], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - started, f"killed after {timeout:g} s"
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines() or [""]
    return done.returncode, time.perf_counter() - started, lines[-1][:100]


def main(argv: list[str] | None = None) -> int:
    """Write the inputs, run the battery, print the table; exit 1 when a command missed its status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per command, the median kept (default 1)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a run is killed (default 120)")
    args = parser.parse_args(argv)
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        started = time.perf_counter()
        write_inputs(folder)
        print(f"inputs written in {time.perf_counter() - started:.1f} s")
        print(f"{'case':<30} {'status':>6} {'want':>4} {'seconds':>8} {'/ 20 s':>7}  last line")
        for what, command, want in BATTERY_COMMANDS:
            runs = [_run(folder, command, args.timeout) for _ in range(args.repeats)]
            status, last = runs[-1][0], runs[-1][2]
            seconds = statistics.median(run[1] for run in runs)
            failed |= status != want
            print(f"{what:<30} {status:>6} {want:>4} {seconds:>8.1f} {seconds / TARGET:>7.2f}  {last}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
