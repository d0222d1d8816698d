"""Search time of the cluster planner for 8B-, 70B-, 405B- and DeepSeek-V3-sized models on 64, 1,024 and 16,384
H100s (configs in benchmarks/data/configs/, from the published model cards), global batch 16M tokens capped at
what the GPUs can split, sequence 8,192 (DeepSeek-V3: 4,096).

    python benchmarks/cluster_search.py [--gpus 64 1024 16384] [--models llama3-8b ...]

Prints per case the seconds the whole search took, the layouts that could run, how many were simulated, the
chosen layout and its predicted step. Targets: 405B on 16,384 GPUs within 60 s and on 1,024 within 10 s (on
the project's 2-core machine; a loaded one is slower: say so when recording).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.errors import NoLayoutFits

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
MODELS = ("llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3")


def case(model: str, gpus: int) -> str:
    seq = 4096 if model.startswith("deepseek") else 8192
    batch = max(gpus // 8, 16 * 2**20 // seq) if gpus >= 1024 else 16 * 2**20 // seq // 4
    start = time.perf_counter()
    try:
        plan = plan_cluster(CONFIGS / f"{model}.json", "h100", gpus=gpus, global_batch=batch, seq=seq)
    except NoLayoutFits as error:
        return f"| {model} | {gpus} | {batch} x {seq} | {time.perf_counter() - start:.1f} | - | - | {error} | - |"
    best = plan.best
    return (f"| {model} | {gpus} | {batch} x {seq} | {plan.seconds:.1f} | {plan.candidates} | {plan.simulated} | "
            f"{best.layout} | {best.step_time:.2f} s, MFU {best.mfu:.2f}, {best.memory.total / 2**30:.0f} GiB |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args(argv)
    print("| model | GPUs | batch x seq | search s | layouts | simulated | chosen | predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for gpus in args.gpus:
            print(case(model, gpus), flush=True)


if __name__ == "__main__":
    main()
