"""The published training runs of ``benchmarks/data/published_runs.json``: loading with consistency checks,
the figures derivable from what each source published, and a table of them.

    python benchmarks/published_runs.py            # the table (docs/cluster-plan.md, 'Published runs')
    python benchmarks/published_runs.py --markdown # the same as a Markdown table

Torch-free. The planner's predictions against these rows are made by the cluster planner's own benchmark;
this module only reads, checks and derives (tokens per second per GPU and the step time where the source
gives TFLOP/s with its FLOP-count formula).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.hardware import Hardware

__all__ = ["DATA", "LAYOUT_KEYS", "RUNS", "derived", "load_runs", "main", "megatron_iteration_flops",
           "run_config", "run_hardware"]

DATA = Path(__file__).resolve().parent / "data"
RUNS = DATA / "published_runs.json"
FORMAT = "pipeloom.published_runs/1"
LAYOUT_KEYS = ("tp", "pp", "vp", "cp", "ep", "dp", "mbs", "fsdp", "recompute", "schedule")
_REQUIRED = ("id", "source", "verification", "model", "hardware", "gpus", "global_batch", "seq", "dtype", "layout",
             "measured", "sharding")
_MEASURES = ("tokens_per_gpu_per_second", "tflops_per_gpu", "mfu", "peak_fraction", "aggregate_pflops")


def load_runs(path: str | Path = RUNS) -> list[dict]:
    """The rows, each checked: required fields, sources with a URL, the layout's keys, the GPU count equal
    to tp·pp·cp·dp (ep lies inside tp·dp·cp), a model config and a hardware description that load."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: 'format' must be {FORMAT!r}, got {doc.get('format')!r}")
    runs = doc["runs"]
    ids = [run.get("id") for run in runs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate run ids")
    for run in runs:
        _check(run)
    return runs


def _check(run: dict) -> None:
    name = run.get("id", "?")
    missing = [key for key in _REQUIRED if key not in run]
    if missing:
        raise ValueError(f"run {name}: missing {', '.join(missing)}")
    if not str(run["source"].get("url", "")).startswith("https://") or not run["source"].get("where"):
        raise ValueError(f"run {name}: the source needs a https URL and the place in it ('where')")
    layout = run["layout"]
    if tuple(layout) != LAYOUT_KEYS:
        raise ValueError(f"run {name}: layout keys must be {', '.join(LAYOUT_KEYS)} in that order")
    if not run["measured"] or set(run["measured"]) - set(_MEASURES):
        raise ValueError(f"run {name}: measured must hold some of {', '.join(_MEASURES)}")
    product = math.prod(layout[key] for key in ("tp", "pp", "cp", "dp"))
    if product != run["gpus"]:
        raise ValueError(f"run {name}: tp·pp·cp·dp = {product}, not the {run['gpus']} GPUs")
    if (layout["tp"] * layout["dp"] * layout["cp"]) % layout["ep"]:
        raise ValueError(f"run {name}: ep {layout['ep']} does not divide tp·dp·cp")
    if run["global_batch"] % layout["dp"]:
        raise ValueError(f"run {name}: global batch {run['global_batch']} is not a multiple of dp {layout['dp']}")
    if layout["fsdp"] != (1 if run["sharding"] == "zero3" else 0):
        raise ValueError(f"run {name}: layout.fsdp must be 1 exactly when sharding is zero3")
    run_config(run)
    hw = run_hardware(run)
    if run["dtype"] not in hw.peak_flops:
        raise ValueError(f"run {name}: {hw.name} has no {run['dtype']} rate")


def run_config(run: dict) -> dict:
    """The run's model config (the transformers config.json as a dict)."""
    path = DATA / "configs" / f"{run['model']}.json"
    if not path.is_file():
        raise ValueError(f"run {run['id']}: no model config {path.name} in {path.parent}")
    return json.loads(path.read_text())


def run_hardware(run: dict) -> Hardware:
    """The run's hardware: a built-in name or a file relative to ``benchmarks/data``."""
    name = run["hardware"]
    return hardware(DATA / name if name.endswith(".json") else name)


def megatron_iteration_flops(config: dict, *, batch: int, seq: int) -> float:
    """FLOPs of one iteration by Narayanan et al. 2021, Eq. 3 (GEMMs only, the recomputed forward included):
    ``96·B·s·l·h²·(1 + s/6h + V/16lh)``."""
    layers, hidden, vocab = config["n_layer"], config["n_embd"], config["vocab_size"]
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def derived(run: dict) -> dict:
    """Step time (s) and tokens per second per GPU where the published figures determine them."""
    tokens = run["global_batch"] * run["seq"]
    measured = run["measured"]
    if "tokens_per_gpu_per_second" in measured:
        rate = measured["tokens_per_gpu_per_second"]
        return {"tokens_per_gpu_per_second": rate, "step_time": tokens / (rate * run["gpus"])}
    if "tflops_per_gpu" in measured and run["id"].startswith("megatron2021"):
        flops = megatron_iteration_flops(run_config(run), batch=run["global_batch"], seq=run["seq"])
        step = flops / (measured["tflops_per_gpu"] * 1e12 * run["gpus"])
        return {"tokens_per_gpu_per_second": tokens / (step * run["gpus"]), "step_time": step}
    return {}  # MFU or TFLOP/s under an unpublished FLOP-count formula: the planner compares those directly


def _layout_text(layout: dict) -> str:
    parts = [f"{key}={'?' if value is None else value}" for key, value in layout.items()
             if key not in ("recompute", "schedule")]
    return ",".join(parts) + f" {layout['recompute'] or '?'} {layout['schedule'] or '?'}"


def _measured_text(measured: dict) -> str:
    names = {"tokens_per_gpu_per_second": "tok/s/GPU", "tflops_per_gpu": "TFLOP/s", "mfu": "MFU",
             "peak_fraction": "of peak", "aggregate_pflops": "PFLOP/s total"}
    return ", ".join(f"{value:g} {names[key]}" for key, value in measured.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    runs = load_runs()
    header = ("run", "model", "hardware", "GPUs", "batch x seq", "dtype", "layout", "published", "tok/s/GPU",
              "step s")
    rows = []
    for run in runs:
        more = derived(run)
        rate = more.get("tokens_per_gpu_per_second")
        step = more.get("step_time")
        rows.append((run["id"], run["model"], run["hardware"].removeprefix("hardware/"), str(run["gpus"]),
                     f"{run['global_batch']} x {run['seq']}", run["dtype"], _layout_text(run["layout"]),
                     _measured_text(run["measured"]), "-" if rate is None else f"{rate:,.0f}",
                     "-" if step is None else f"{step:.2f}"))
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
