"""The cluster planner against published training runs (``benchmarks/data/published_runs.json``): each run's
published layout predicted (keys the source does not publish are searched, the published ones held), its
throughput error, and the planner's own choice on the same job.

    python benchmarks/cluster_published.py [--no-search | --search-up-to GPUS] [--only SUBSTRING] [--markdown]

Each row is priced with the framework choices it ran (:func:`options`): torchtitan's rows with torchtitan's
preset and Megatron-Bridge's with its recipes' (``pipeloom.plan.cluster.api.FRAMEWORKS``, what ``pipeloom plan
--framework`` sets), then what a row's source says differs; the 2021 Megatron, Llama 3, MLPerf and DeepSeek-V3
rows with their own (materialized attention and blocking sends in 2021, fp32 gradient reduce in Llama 3, tp
overlap in MLPerf, DeepSeek-V3's recomputation and all-to-all).
Keys a source leaves open are searched with the published ones held, except that the 2021 Megatron rows get
the schedules of their time (1F1B or interleaved 1F1B, the faster) and the recomputation their Eq. 3 assumes.
Throughput is compared in tokens/s per GPU where the source determines it (as published, or Megatron's Eq. 3
FLOPs over its TFLOP/s); for the Llama 3 rows, which publish only an MFU under an unpublished FLOP formula,
the MFU is compared (the planner's counts every matmul once and the causal half of the attention square).
No constant of the model is fitted to these rows. Timings on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeloom.plan.cluster.api import (
    framework_options,  # noqa: E402
    plan_cluster,  # noqa: E402
)
from pipeloom.plan.cluster.job import STAGE_CUTS  # noqa: E402
from pipeloom.plan.cluster.model.reader import model_spec  # noqa: E402
from pipeloom.plan.errors import NoLayoutFits  # noqa: E402
from published_runs import derived, load_runs, run_config, run_hardware  # noqa: E402

_SCHEDULE = {"none": "1f1b"}  # pp 1 has no schedule


def _fixed(run: dict) -> list[dict]:
    """The published keys to hold; where a 2021 Megatron row leaves the schedule open, one set per schedule it
    had (1F1B and interleaved 1F1B), and its Eq. 3's recomputation where recompute is not published."""
    fixed = {key: value for key, value in run["layout"].items() if value is not None}
    if "schedule" in fixed:
        fixed["schedule"] = _SCHEDULE.get(fixed["schedule"], fixed["schedule"])
    if "fsdp" in fixed:
        fixed["fsdp"] = bool(fixed["fsdp"])
    if run["id"].startswith("megatron2021"):
        fixed.setdefault("recompute", "full")
        if "schedule" not in fixed:
            return [dict(fixed, schedule="1f1b"), dict(fixed, schedule="interleaved-1f1b")]
    return [fixed]


def _published(run: dict, limit: float | None):
    """The fastest prediction over :func:`_fixed`'s key sets (NoLayoutFits if none fits)."""
    plans = []
    for fixed in _fixed(run):
        try:
            plans.append(_plan(run, fixed, limit))
        except NoLayoutFits:
            continue
    if not plans:
        raise NoLayoutFits("the published layout does not fit")
    return min(plans, key=lambda plan: plan.best.step_time)


def framework(run: dict) -> str | None:
    """The framework preset a row ran (``pipeloom.plan.cluster.api.FRAMEWORKS``): torchtitan's rows its job-config
    defaults, Megatron-Bridge's its performance recipes, as NeMo 2.0's (the same Megatron-Core with Transformer
    Engine, distributed optimizer, bf16 gradient reduce and current-scaling FP8 in its performance tables); None for
    the rest, whose choices :func:`options` gives."""
    if run["id"].startswith("torchtitan"):
        return "torchtitan"
    return "megatron-bridge" if run["id"].startswith(("mbridge", "nemo-")) else None


def options(run: dict) -> dict:
    """The framework choices a row ran, as ``plan_cluster`` keywords: its framework's preset, then what its source
    says differs (the planner's defaults, Megatron-Core's, for what neither sets).

    - torchtitan: its rows that name torch.compile fuse the elementwise kernels; "selective layer" recomputes
      every second layer whole; the "asyncTP" row ran PyTorch's async tensor parallelism.
    - Megatron-Bridge: only its Llama recipes overlap the tp exchanges (its Qwen3 H100 recipe turns
      ``tp_comm_overlap`` off; gpt-oss runs tp 1); Qwen3-235B-A22B's H100 recipe and gpt-oss-120b's GB200 one set
      ``moe_a2a_overlap`` (Megatron-Core's ``overlap_moe_expert_parallel_comm``); the gpt-oss recipes recompute
      ``recompute_modules=["layernorm", "moe_act"]``; Qwen3-30B-A3B's H100 recipe dispatches with Hybrid-EP
      (``moe_flex_dispatcher_backend="hybridep"``), as do NVIDIA's two BF16 runs of it in the skill's controlled
      comparison (``mbridge-skill-``, the second with ``overlap_moe_expert_parallel_comm``), the other MoE recipes
      with Megatron-Core's all-to-all. The 26.08
      release's MXFP8 rows (recipes in ``src/megatron/bridge/perf_recipes/`` at v0.6.0) all cast with Transformer
      Engine's MXFP8 block scaling, dispatch with Hybrid-EP sync-free (``moe_expert_rank_capacity_factor`` 1.5, paged
      stash, full-iteration CUDA graphs: ``moe_comm="hybridep-sync-free"``) and overlap the all-to-all with
      ``overlap_moe_expert_parallel_comm``; DeepSeek-V3's GB200 recipe recomputes ``mla_up_proj``, and the explicit
      16-stage pipeline layout both its recipes set is priced as written (the planner's own search cuts its own
      way, :func:`_plan`), with the precision-aware optimizer's bf16 moments their base recipe sets.
    - Megatron-LM 2021 predates flash attention (scores in HBM), sequence parallelism and the overlapped gradient
      reduce (all-reduced after the flush) and sent stage boundaries blocking (``_communicate``); it required the
      layers to divide evenly over the stages.
    - Llama 3 reduce-scatters gradients in fp32 (report sec. 3.3.2) and cut 126 layers evenly with one fewer on
      the first and last stages, which the even cut gives.
    - A row whose sharding is ``zero2`` (Llama 3's FSDP, sharding the optimizer state and the gradients) keeps its
      gradients sharded (``shard_gradients``).
    - MLPerf's NeMo configs set ``TP_COMM_OVERLAP=True``, cut evenly, and cast FP8 with Transformer Engine's
      delayed scaling (the default, ``cached``).
    - DeepSeek-V3: its own recomputation (norms, MLA up-projections and MoE SwiGLU; FP8-cached inputs) and
      all-to-all kernels (node-limited FP8 dispatch, 20 SMs); when it quantizes weights is not published, so every
      input is cast for every GEMM (``dynamic``, the most cast traffic it could have); its cut is not published
      (the planner's balanced one)."""
    fw, rid = framework(run), run["id"]
    opts = dict(framework_options(fw, dtype=run["dtype"])) if fw else {}
    if fw == "torchtitan":
        opts.update(kernels="fused" if "compile" in json.dumps(run) else opts["kernels"],
                    selective="layer" if "selective-layer" in rid else opts["selective"],
                    tp_overlap="asynctp" in rid)
    elif fw == "megatron-bridge":
        opts.update(tp_overlap=rid.startswith("mbridge-llama"),
                    moe_overlap=rid in ("mbridge-qwen3-235b-a22b-h100-fp8-256gpus",
                                        "mbridge-gpt-oss-120b-gb200-bf16-64gpus"))
        if rid.startswith("mbridge-gpt-oss"):
            opts.update(selective="layernorm,moe_act")
        if rid == "mbridge-qwen3-30b-a3b-h100-fp8-16gpus" or rid.startswith("mbridge-skill-qwen3-30b"):
            opts.update(moe_comm="hybridep", moe_overlap=rid.endswith("-epoverlap"))
        if "-mxfp8-" in rid:
            opts.update(fp8_cast="mxfp8", moe_comm="hybridep-sync-free", moe_overlap=True)
            if rid.startswith("mbridge-deepseek-v3"):
                opts.update(stage_cut="Et*4|(t*4|)*14tmL", selective="mla_up_proj", adam_moments="bf16")
    elif rid.startswith("megatron2021"):
        opts.update(attention="materialized", overlap_grad_reduce=False, p2p_overlap=False, sequence_parallel=False,
                    stage_cut="even")
    elif rid.startswith("llama3"):
        opts.update(grad_reduce="fp32", stage_cut="even")
    elif rid.startswith("mlperf"):
        opts.update(tp_overlap=True, stage_cut="even")
    elif rid.startswith("deepseek-v3"):
        opts.update(selective="deepseek", moe_comm="deepseek", fp8_cast="dynamic" if run["dtype"] == "fp8"
                    else "cached")
    if run.get("sharding") == "zero2":
        opts.update(shard_gradients=True)
    return opts


def _plan(run: dict, fixed: dict | None, limit: float | None):
    """The published layout (``fixed``: its keys) or, with ``fixed`` None, the planner's choice; that search cuts
    the stages its own way where the row's cut was written out for its layout's stage count."""
    opts = options(run)
    if fixed is None and opts.get("stage_cut") not in (None, *STAGE_CUTS):
        opts["stage_cut"] = "balanced"
    return plan_cluster(run_config(run), run_hardware(run), gpus=run["gpus"], global_batch=run["global_batch"],
                        seq=run["seq"], dtype=run["dtype"], layout=fixed, **opts, memory_limit=limit, runners_up=0)


def check(run: dict, *, search: bool) -> dict:
    """One row: the published layout's prediction and error, the planner's choice."""
    hw = run_hardware(run)
    row: dict = {"id": run["id"], "moe": model_spec(run_config(run)).experts is not None}
    try:
        published = _published(run, hw.memory_bytes)
    except NoLayoutFits:
        published = _published(run, 1e18)
    est = published.best
    row["fits"] = est.memory.total <= hw.memory_bytes  # a layout given whole is predicted whether it fits or not
    row.update(layout=str(est.layout), predicted=est.tokens_per_gpu_per_second, mfu=est.mfu,
               memory=est.memory.total / 2**30)
    measured = derived(run).get("tokens_per_gpu_per_second")
    if measured:
        row.update(measured=measured, error=est.tokens_per_gpu_per_second / measured - 1)
    elif "mfu" in run["measured"]:
        row.update(measured_mfu=run["measured"]["mfu"], error=est.mfu / run["measured"]["mfu"] - 1)
    if search:
        start = time.perf_counter()
        try:
            chosen = _plan(run, None, hw.memory_bytes).best
            row.update(chosen=str(chosen.layout), chosen_rate=chosen.tokens_per_gpu_per_second,
                       gain=chosen.tokens_per_gpu_per_second / est.tokens_per_gpu_per_second - 1)
        except NoLayoutFits as error:
            row.update(chosen=f"none fits: {error}")
        row["search_s"] = time.perf_counter() - start
    return row


def _line(row: dict, markdown: bool) -> str:
    measured = (f"{row['measured']:,.0f} tok/s" if "measured" in row else
                f"MFU {row['measured_mfu']:.2f}" if "measured_mfu" in row else "-")
    predicted = (f"{row['predicted']:,.0f} tok/s" if "measured" in row else f"MFU {row['mfu']:.2f}")
    error = f"{row['error'] * 100:+.1f}%" if "error" in row else "-"
    target = 0.20 if row["moe"] else 0.15
    verdict = "ok" if "error" in row and abs(row["error"]) <= target else "MISS"
    fits = "" if row["fits"] else f" (needs {row['memory']:.0f} GiB: over)"
    chosen = row.get("chosen", "-")
    gain = f"{row['gain'] * 100:+.1f}%" if "gain" in row else "-"
    cells = [row["id"], row["layout"] + fits, measured, predicted, error, verdict, chosen, gain,
             f"{row.get('search_s', 0):.1f}"]
    return "| " + " | ".join(cells) + " |" if markdown else "  ".join(cells)


_TIE = 0.02
"""Measured rates of two runs within this fraction of each other are a tie (run-to-run noise, rounding)."""


def _rate(row: dict) -> tuple[float, float] | None:
    """(measured, predicted) of a row in one unit: tokens/s per GPU, else MFU; None without a measurement."""
    if "measured" in row:
        return row["measured"], row["predicted"]
    return (row["measured_mfu"], row["mfu"]) if "measured_mfu" in row else None


def ordering(runs: list[dict], rows: list[dict]) -> list[str]:
    """Pairs of published runs of one job (model, GPU, GPU count, batch, sequence and dtype the same; the layout,
    framework or software release not): does the model order them as measured? A planner is used to rank
    layouts, so this is the check of what it is for; pairs the model prices alike (within 1 %: the same layout
    and settings, as two MLPerf rounds) and measured ties are listed apart."""
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for run, row in zip(runs, rows):
        if _rate(row) is not None:
            key = (run["model"], run["hardware"], run["gpus"], run["global_batch"], run["seq"], run["dtype"])
            groups.setdefault(key, []).append((run, row))
    lines, right, ranked = [], 0, 0
    for members in groups.values():
        for k, (_, a) in enumerate(members):
            for _, b in members[k + 1:]:
                (ma, pa), (mb, pb) = _rate(a), _rate(b)  # type: ignore[misc]
                measured, predicted = ma / mb, pa / pb
                if abs(predicted - 1) <= 0.01:
                    verdict = "priced alike (the model does not tell them apart)"
                elif abs(measured - 1) <= _TIE:
                    verdict = "a measured tie"
                else:
                    ranked += 1
                    same = (measured > 1) == (predicted > 1)
                    right += same
                    verdict = "ordered as measured" if same else "ORDERED WRONG"
                lines.append(f"{a['id']} / {b['id']}: measured x{measured:.2f}, predicted x{predicted:.2f}: {verdict}")
    lines.append(f"{right} of {ranked} pairs of runs of one job ordered as measured ({len(lines)} pairs; ties and "
                 "pairs priced alike not counted)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-search", action="store_true", help="only predict the published layouts")
    parser.add_argument("--only", help="runs whose id contains this")
    parser.add_argument("--search-up-to", type=int, default=None, metavar="GPUS",
                        help="run the planner's own search only on runs of at most this many GPUs")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    runs = [run for run in load_runs() if not args.only or args.only in run["id"]]
    if args.markdown:
        print("| run | published layout (searched where unpublished) | measured | predicted | error | within "
              "target | planner's choice | its gain | search s |")
        print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for run in runs:
        search = not args.no_search and (args.search_up_to is None or run["gpus"] <= args.search_up_to)
        row = check(run, search=search)
        rows.append(row)
        print(_line(row, args.markdown), flush=True)
    errors = [abs(r["error"]) for r in rows if "error" in r]
    inside = sum(abs(r["error"]) <= (0.20 if r["moe"] else 0.15) for r in rows if "error" in r)
    slower = [r["id"] for r in rows if r.get("gain", 0) < -1e-9 and r["fits"]]
    over = [r["id"] for r in rows if not r["fits"]]
    print(f"\n{inside} of {len(errors)} rows within target (15 % dense, 20 % MoE); median |error| "
          f"{sorted(errors)[len(errors) // 2] * 100:.1f} %; planner's choice predicted slower than a published "
          f"layout that fits in {len(slower)} rows {slower}; published layouts over the GPU's memory as the model "
          f"counts it (the planner's choice keeps within it): {len(over)} {over}")
    print("\n" + "\n".join(ordering(runs, rows)))


if __name__ == "__main__":
    main()
