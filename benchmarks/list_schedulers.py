"""List-scheduler benchmark: CPU and wall seconds of the schedules built on the kernel's list scheduler
(zbv, interleaved-zb) and of the plan search that tries every schedule.

Run ``python benchmarks/list_schedulers.py`` (``--repeats N``). It times the package on PYTHONPATH, so
an older tree is measured with the same script side by side::

    git worktree add /tmp/before c7cf0fc
    PYTHONPATH=/tmp/before python benchmarks/list_schedulers.py
    python benchmarks/list_schedulers.py

CPU seconds (``time.process_time``) are the figure to compare on a shared machine; wall seconds are
printed too. Each time is the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

from pipeloom.plan import parse_bytes, plan_pipeline
from pipeloom.schedules import build_schedule
from pipeloom.schedules import zbv as zbv_module
from pipeloom.schedules.common import v_problem
from pipeloom.schedules.zbv_plan import v_plan
from pipeloom.stages import Costs
from plan_gpt import gpt_table

__all__ = ["best_of", "cases", "main"]

_PAPER = Costs(f=18522, b=18086, w=9337, comm=601)


def best_of(repeats: int, run: Callable[[], object]) -> tuple[float, float]:
    """Least (CPU seconds, wall seconds) over ``repeats`` calls of ``run``, each after a collection."""
    cpu, wall = [], []
    for _ in range(repeats):
        gc.collect()
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        run()
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    return min(cpu), min(wall)


def cases() -> list[tuple[str, Callable[[], object]]]:
    """(label, run) of each timed case; the zbv list scheduler alone also on its old kernel path where
    the measured tree still has one (up to c7cf0fc zbv ran an inlined copy and kept the kernel path
    as the tested reference)."""
    plan = v_plan(v_problem(64, costs=Costs(), memory_limit=64), 1024, 64)
    table = gpt_table(48)
    found: list[tuple[str, Callable[[], object]]] = [
        ("zbv list scheduler, default policy, p=64 m=1024 (393k actions)",
         lambda: zbv_module._list_schedule(plan, zbv_module._DEFAULT)),
    ]
    old_kernel_path = getattr(zbv_module, "_kernel_list_schedule", None)
    if old_kernel_path is not None:
        found.append(("  the same on the old kernel path (_kernel_list_schedule)",
                      lambda: old_kernel_path(plan, zbv_module._DEFAULT)))
    return found + [
        ("build zbv p=64 m=1024 (one policy)", lambda: build_schedule("zbv", 64, 1024)),
        ("build interleaved-zb p=32 m=256 v=2 (one policy)",
         lambda: build_schedule("interleaved-zb", 32, 256, stages_per_rank=2)),
        ("build zbv p=16 m=64 paper costs (11 policies + rounds)", lambda: build_schedule("zbv", 16, 64, costs=_PAPER)),
        ("build interleaved-zb p=8 m=32 v=3 paper costs (11 policies)",
         lambda: build_schedule("interleaved-zb", 8, 32, stages_per_rank=3, costs=_PAPER)),
        ("plan search, 48-layer GPT on 8 ranks, 80 GiB, batch 512",
         lambda: plan_pipeline(table, num_ranks=8, global_batch=512, memory_limit=parse_bytes("80GiB"))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'case':62} {'cpu s':>7} {'wall s':>7}  (best of {args.repeats})")
    for label, run in cases():
        cpu, wall = best_of(args.repeats, run)
        print(f"{label:62} {cpu:7.2f} {wall:7.2f}", flush=True)


if __name__ == "__main__":
    main()
