"""Search time of the cluster planner for 8B-, 70B-, 405B- and DeepSeek-V3-sized models on 64, 1,024 and 16,384
H100s (configs in benchmarks/data/configs/, from the published model cards), global batch 16M tokens capped at
what the GPUs can split, sequence 8,192 (DeepSeek-V3: 4,096).

    python benchmarks/cluster_search.py [--gpus 64 1024 16384] [--models llama3-8b ...] [--baseline DIR]

Prints per case the seconds the whole search took (wall clock and the process's CPU time: on a loaded machine
the CPU time is the steadier figure), the layouts that could run, how many were priced (bounds computed) and
simulated, the chosen layout and its predicted step. ``--baseline DIR`` (a directory holding another version's
``pipeloom`` package, e.g. ``git archive REV pipeloom | tar -x -C DIR``) times that version on each case too,
each case in a fresh process for both, one after the other, and prints the ratios. Targets: 405B on 16,384 GPUs
within 60 s and on 1,024 within 10 s (on the project's 2-core machine; a loaded one is slower: say so when
recording).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
MODELS = ("llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3")
ROOT = Path(__file__).resolve().parent.parent


def run_case(model: str, gpus: int) -> dict[str, object]:
    """One search in this process: its times, counts and answer (or the NoLayoutFits message)."""
    from pipeloom.plan.cluster.api import plan_cluster
    from pipeloom.plan.errors import NoLayoutFits

    seq = 4096 if model.startswith("deepseek") else 8192
    batch = max(gpus // 8, 16 * 2**20 // seq) if gpus >= 1024 else 16 * 2**20 // seq // 4
    out: dict[str, object] = {"model": model, "gpus": gpus, "batch": f"{batch} x {seq}"}
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        plan = plan_cluster(CONFIGS / f"{model}.json", "h100", gpus=gpus, global_batch=batch, seq=seq)
    except NoLayoutFits as error:
        out.update(chosen="-", predicted=str(error), layouts="-", priced="-", simulated="-")
    else:
        best = plan.best
        out.update(chosen=str(best.layout), layouts=plan.candidates, priced=getattr(plan, "priced", "-"),
                   simulated=plan.simulated,
                   predicted=f"{best.step_time:.2f} s, MFU {best.mfu:.2f}, {best.memory.total / 2**30:.0f} GiB")
    out.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)
    return out


def in_process(model: str, gpus: int, pythonpath: Path) -> dict[str, object]:
    """:func:`run_case` in a fresh interpreter importing ``pipeloom`` from ``pythonpath``."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    done = subprocess.run([sys.executable, __file__, "--one", model, str(gpus)], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--baseline", type=Path, help="a directory holding the pipeloom package to compare with")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "GPUS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_case(args.one[0], int(args.one[1]))))
        return
    if args.baseline:
        print("| model | GPUs | batch x seq | before wall s | after wall s | before CPU s | after CPU s | CPU ratio | "
              "layouts | simulated before / after | priced after | same answer | chosen (after) | predicted (after) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| model | GPUs | batch x seq | wall s | CPU s | layouts | priced | simulated | chosen | predicted |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for gpus in args.gpus:
            after = in_process(model, gpus, ROOT)
            if not args.baseline:
                print(f"| {model} | {gpus} | {after['batch']} | {after['wall']:.1f} | {after['cpu']:.1f} | "
                      f"{after['layouts']} | {after['priced']} | {after['simulated']} | {after['chosen']} | "
                      f"{after['predicted']} |", flush=True)
                continue
            before = in_process(model, gpus, args.baseline)
            same = before["chosen"] == after["chosen"] and (after["chosen"] == "-" or
                                                            before["predicted"] == after["predicted"])
            print(f"| {model} | {gpus} | {after['batch']} | {before['wall']:.1f} | {after['wall']:.1f} | "
                  f"{before['cpu']:.1f} | {after['cpu']:.1f} | {float(before['cpu']) / float(after['cpu']):.1f} | "
                  f"{after['layouts']} | {before['simulated']} / {after['simulated']} | {after['priced']} | "
                  f"{'yes' if same else 'no'} | {after['chosen']} | {after['predicted']} |", flush=True)


if __name__ == "__main__":
    main()
