"""Search time of the cluster planner for 8B-, 70B-, 405B- and DeepSeek-V3-sized models on 64, 1,024 and 16,384
H100s (configs in benchmarks/data/configs/, from the published model cards), global batch 16M tokens capped at
what the GPUs can split, sequence 8,192 (DeepSeek-V3: 4,096).

    python benchmarks/cluster_search.py [--gpus 64 1024 16384] [--models llama3-8b ...] [--baseline DIR]
                                        [--recompute-search] [--memory-limit 30GiB] [--hardware gb300]
                                        [--global-batch 4096] [--seq 4096] [--layout fsdp=1]

Prints per case the seconds the whole search took (wall clock and the process's CPU time: on a loaded machine
the CPU time is the steadier figure), the layouts that could run, how many were priced (bounds computed) and
simulated, the chosen layout and its predicted step. ``--baseline DIR`` (a directory holding another version's
``pipeloom`` package, e.g. ``git archive REV pipeloom | tar -x -C DIR``) times that version on each case too,
each case in a fresh process for both, one after the other, and prints the ratios. Targets: 405B on 16,384 GPUs
within 60 s and on 1,024 within 10 s (on the project's 2-core machine; a loaded one is slower: say so when
recording). ``--hardware``, ``--global-batch``, ``--seq`` and ``--layout`` (fixed keys) change the job of every
case. ``--recompute-search`` plans with ``selective="search"`` and ``recompute_layers="search"`` (the
opt-in recomputation searches; the "plans" column counts the plans they made), ``--memory-limit`` below the
GPU's memory; any config in ``benchmarks/data/configs/`` may be named (``qwen3-30b-a3b``).
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


def run_case(model: str, gpus: int, options: dict[str, object] | None = None) -> dict[str, object]:
    """One search in this process (``options``: more ``plan_cluster`` keywords): its times, counts and answer (or
    the NoLayoutFits message)."""
    from pipeloom.plan.cluster.api import plan_cluster
    from pipeloom.plan.errors import NoLayoutFits

    options = dict(options or {})
    hw = options.pop("hardware", "h100")
    seq = int(options.pop("seq", 4096 if model.startswith("deepseek") else 8192))
    batch = int(options.pop("global_batch", max(gpus // 8, 16 * 2**20 // seq) if gpus >= 1024
                            else 16 * 2**20 // seq // 4))
    out: dict[str, object] = {"model": model, "gpus": gpus, "batch": f"{batch} x {seq}"}
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        plan = plan_cluster(CONFIGS / f"{model}.json", hw, gpus=gpus, global_batch=batch, seq=seq, **options)
    except NoLayoutFits as error:
        out.update(chosen="-", predicted=str(error), layouts="-", priced="-", simulated="-")
    else:
        best = plan.best
        chosen = str(best.layout) + "".join(f", {name} {getattr(plan.job, name)}"
                                            for name in getattr(plan, "searched", ()))
        out.update(chosen=chosen, layouts=plan.candidates, priced=getattr(plan, "priced", "-"),
                   plans=getattr(plan, "variants", 0) or 1,
                   simulated=plan.simulated,
                   predicted=f"{best.step_time:.2f} s, MFU {best.mfu:.2f}, {best.memory.total / 2**30:.0f} GiB")
    out.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)
    return out


def in_process(model: str, gpus: int, pythonpath: Path, options: dict[str, object]) -> dict[str, object]:
    """:func:`run_case` in a fresh interpreter importing ``pipeloom`` from ``pythonpath``."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    done = subprocess.run([sys.executable, __file__, "--one", model, str(gpus), "--options", json.dumps(options)],
                          env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--baseline", type=Path, help="a directory holding the pipeloom package to compare with")
    parser.add_argument("--recompute-search", action="store_true",
                        help="search the Megatron-Core module sets and block-recomputation depths too")
    parser.add_argument("--memory-limit", help="bytes or a size such as 30GiB (default: the GPU's memory)")
    parser.add_argument("--hardware", help="a built-in GPU name or a hardware file (default h100)")
    parser.add_argument("--global-batch", type=int, help="sequences per step (default: 16M tokens, as above)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 8,192; DeepSeek-V3 4,096)")
    parser.add_argument("--layout", help="keys held fixed, e.g. fsdp=1 (default: none)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "GPUS"), help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_case(args.one[0], int(args.one[1]), json.loads(args.options))))
        return
    options: dict[str, object] = {}
    if args.recompute_search:
        options.update(selective="search", recompute_layers="search")
    if args.memory_limit:
        options.update(memory_limit=args.memory_limit)
    for name in ("hardware", "global_batch", "seq", "layout"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.baseline:
        print("| model | GPUs | batch x seq | before wall s | after wall s | before CPU s | after CPU s | CPU ratio | "
              "layouts | simulated before / after | plans before / after | priced after | same answer | "
              "chosen (after) | predicted (after) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| model | GPUs | batch x seq | wall s | CPU s | layouts | priced | simulated | chosen | predicted |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for gpus in args.gpus:
            after = in_process(model, gpus, ROOT, options)
            if not args.baseline:
                print(f"| {model} | {gpus} | {after['batch']} | {after['wall']:.1f} | {after['cpu']:.1f} | "
                      f"{after['layouts']} | {after['priced']} | {after['simulated']} | {after['chosen']} | "
                      f"{after['predicted']} |", flush=True)
                continue
            before = in_process(model, gpus, args.baseline, options)
            same = before["chosen"] == after["chosen"] and (after["chosen"] == "-" or
                                                            before["predicted"] == after["predicted"])
            print(f"| {model} | {gpus} | {after['batch']} | {before['wall']:.1f} | {after['wall']:.1f} | "
                  f"{before['cpu']:.1f} | {after['cpu']:.1f} | {float(before['cpu']) / float(after['cpu']):.1f} | "
                  f"{after['layouts']} | {before['simulated']} / {after['simulated']} | "
                  f"{before.get('plans', '-')} / {after.get('plans', '-')} | {after['priced']} | "
                  f"{'yes' if same else 'no'} | {after['chosen']} | {after['predicted']} |", flush=True)


if __name__ == "__main__":
    main()
