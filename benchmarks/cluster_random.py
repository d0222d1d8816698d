"""The cluster planner called as users call it, at random, each answer checked.

    python benchmarks/cluster_random.py [--seed 1] [--jobs 1000] [--slow 30]

Draws jobs from the benchmark's configs (``benchmarks/data/configs/``), the built-in GPUs, GPU counts of 1 to
1,024, global batches, sequences, dtypes and at most one fixed layout key, and plans each with
``plan_cluster``. Checks every answer: tokens per GPU per second equal the batch's tokens over the GPUs and the
step time, the MFU lies between 0 and 1, the memory per GPU is within the limit, the JSON form serializes; a
refusal is one of pipeloom's own errors, one line. Prints one line per failed check, crash or search slower than
``--slow`` seconds, then how many jobs ran.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
MODELS = ("llama3-8b", "llama3-70b", "qwen3-30b-a3b", "gpt-oss-120b", "llama4-scout", "deepseek-v3",
          "qwen3-235b-a22b", "mlperf-gpt3-175b", "megatron-gpt-1.7b")
GPU_TYPES = ("h100", "h200", "a100-40gb", "a100-80gb", "b200", "gb200", "gb300", "mi300x")
FIXED = (None, None, "pp=2", "tp=2", "recompute=full", "schedule=zbv", "schedule=dualpipev", "ep=4", "cp=2",
         "fsdp=1", "mbs=2,schedule=interleaved-1f1b")


def draw(rng: random.Random) -> tuple[str, str, dict[str, object]]:
    """One job: the config, the GPU type and ``plan_cluster``'s keywords."""
    job = dict(gpus=rng.choice([1, 2, 6, 8, 12, 16, 24, 48, 64, 96, 128, 200, 256, 512, 1000, 1024]),
               global_batch=rng.choice([1, 3, 7, 8, 16, 32, 64, 100, 128, 256, 512, 1536, 4096]),
               seq=rng.choice([128, 1000, 2048, 4096, 8192, 32768, 131072]),
               dtype=rng.choice(["bf16", "bf16", "fp8"]), layout=rng.choice(FIXED), runners_up=2)
    return rng.choice(MODELS), rng.choice(GPU_TYPES), job


def check(model: str, gpu: str, job: dict[str, object], slow: float) -> list[str]:
    """What is wrong with the planner's answer to one job (nothing: an empty list)."""
    from pipeloom.errors import PipeloomError
    from pipeloom.plan.cluster.api import plan_cluster

    start = time.perf_counter()
    try:
        plan = plan_cluster(CONFIGS / f"{model}.json", gpu, **job)
    except PipeloomError as refusal:
        text = str(refusal).strip()
        return [f"refusal not one line: {text[:200]!r}"] if "\n" in text else []
    seconds, best = time.perf_counter() - start, plan.best
    tokens = float(job["global_batch"]) * float(job["seq"]) / float(job["gpus"]) / best.step_time
    problems = []
    if abs(tokens - best.tokens_per_gpu_per_second) > 1e-6 * tokens:
        problems.append(f"tokens/s per GPU {best.tokens_per_gpu_per_second} against {tokens} from the step")
    if not 0 < best.mfu < 1:
        problems.append(f"MFU {best.mfu}")
    if best.memory.total > plan.memory_limit * (1 + 1e-9):
        problems.append(f"memory {best.memory.total:.0f} B over the limit {plan.memory_limit:.0f} B")
    json.dumps(plan.as_dict())
    if seconds > slow:
        problems.append(f"searched {seconds:.1f} s")
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1000, help="how many jobs to draw")
    parser.add_argument("--slow", type=float, default=30.0, help="report searches longer than this (seconds)")
    args = parser.parse_args(argv)
    rng, start, failed = random.Random(args.seed), time.perf_counter(), 0
    for _ in range(args.jobs):
        model, gpu, job = draw(rng)
        try:
            problems = check(model, gpu, job, args.slow)
        except Exception as error:  # noqa: BLE001 (a crash is what this looks for)
            problems = [f"crash: {type(error).__name__}: {error}"]
        failed += bool(problems)
        for problem in problems:
            print(f"{model} on {job['gpus']} {gpu}, {job}: {problem}", flush=True)
    print(f"{args.jobs} jobs planned in {time.perf_counter() - start:.0f} s, {failed} with a problem")


if __name__ == "__main__":
    main()
