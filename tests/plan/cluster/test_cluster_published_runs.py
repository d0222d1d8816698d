"""benchmarks/data/published_runs.json: every row consistent (GPU count = tp·pp·cp·dp, its config and
hardware load, a source with a URL), the derived figures against hand arithmetic, bad rows refused."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _module(name: str = "published_runs"):
    """benchmarks/NAME.py (cluster_published.py puts its folder on the path for published_runs itself)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PUBLISHED = _module()


def test_every_row_loads_and_is_consistent():
    runs = PUBLISHED.load_runs()
    assert len(runs) >= 40
    families = {run["id"].split("-")[0] for run in runs}
    assert {"megatron2021", "llama3", "torchtitan", "deepseek", "mlperf", "mbridge", "nemo"} <= families
    for run in runs:
        assert PUBLISHED.run_hardware(run).memory_bytes > 0
        assert PUBLISHED.run_config(run)["model_type"] in ("gpt2", "llama", "deepseek_v3", "qwen3_moe", "gpt_oss",
                                                           "llama4_text")


def test_the_megatron_bridge_rows_models_count_as_their_cards_say():
    """The configs of the Megatron-Bridge and NeMo rows' models (from their model cards' config.json) count the
    parameters their names and cards give: Qwen3-235B-A22B 235B with 22B active, Qwen3-30B-A3B 30.5B with 3.3B,
    gpt-oss-120b 116.8B, Llama 4 Scout's language model 107.8B with 17.2B (its card: 17B active)."""
    from pipeloom.plan.cluster.counts import layer_counts
    from pipeloom.plan.cluster.model.kinds import layer_kinds
    from pipeloom.plan.cluster.model.reader import model_spec

    def billions(name: str) -> tuple[float, float]:
        spec = model_spec(PUBLISHED.run_config({"id": name, "model": name}))
        counts = [layer_counts(spec, kind, 4096) for kind in (*layer_kinds(spec), "embedding", "head")]
        total, expert = sum(c.params for c in counts), sum(c.expert_params for c in counts)
        return total / 1e9, (total - expert + expert * spec.experts.top_k / spec.experts.count) / 1e9

    assert billions("qwen3-235b-a22b") == pytest.approx((235.1, 22.2), abs=0.05)
    assert billions("qwen3-30b-a3b") == pytest.approx((30.5, 3.35), abs=0.05)
    assert billions("gpt-oss-120b")[0] == pytest.approx(116.8, abs=0.05)
    assert billions("llama4-scout") == pytest.approx((107.77, 17.17), abs=0.005)  # NeMo's Llama 4 Scout row


def test_megatron_derived_figures_by_hand():
    run = next(r for r in PUBLISHED.load_runs() if r["id"] == "megatron2021-table1-1.7b")
    # Eq. 3 for l=24, h=2304, V=51200, s=2048, B=512, at 137 TFLOP/s on each of 32 GPUs
    flops = 96 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    step = flops / (137e12 * 32)
    assert PUBLISHED.derived(run)["step_time"] == pytest.approx(step)
    assert PUBLISHED.derived(run)["tokens_per_gpu_per_second"] == pytest.approx(512 * 2048 / step / 32)
    # the 1T row: 502 PFLOP/s aggregate = 163 TFLOP/s x 3072 GPUs (the abstract's figure)
    big = next(r for r in PUBLISHED.load_runs() if r["id"] == "megatron2021-table1-1008b")
    assert big["measured"]["tflops_per_gpu"] * big["gpus"] / 1000 == pytest.approx(502, rel=0.01)


def test_deepseek_and_torchtitan_rates():
    runs = {r["id"]: r for r in PUBLISHED.load_runs()}
    assert runs["deepseek-v3-2048gpus"]["measured"]["tokens_per_gpu_per_second"] == pytest.approx(
        1e12 / (180e3 * 3600), abs=0.1)
    row = runs["torchtitan-llama3-8b-8gpus-fsdp"]
    assert PUBLISHED.derived(row)["step_time"] == pytest.approx(16 * 8192 / (5762 * 8))
    assert PUBLISHED.derived(runs["llama3-405b-8192gpus-seq8192"]) == {}


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.update(gpus=r["gpus"] + 8), "tp·pp·cp·dp"),
    (lambda r: r["source"].update(url="arxiv"), "https URL"),
    (lambda r: r.update(model="no-such-model"), "no model config"),
    (lambda r: r["layout"].update(fsdp=1), "fsdp must be 1 exactly when sharding is zero3"),
    (lambda r: r.update(measured={"speed": 1}), "measured must hold"),
    (lambda r: r.update(hardware="a100-40gb", dtype="fp8"), "has no fp8 rate"),
])
def test_bad_rows_are_refused(tmp_path, change, message):
    doc = json.loads(PUBLISHED.RUNS.read_text())
    row = copy.deepcopy(doc["runs"][0])
    change(row)
    doc["runs"] = [row]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        PUBLISHED.load_runs(path)


def test_pairs_of_runs_of_one_job_are_judged_by_their_order():
    """The ordering check: two runs of one job ordered as measured or wrong; a measured tie (within 2 %) and a
    pair the model prices alike (within 1 %) listed but not counted; runs of other jobs never paired."""
    job = {"model": "m", "hardware": "h100", "gpus": 8, "global_batch": 16, "seq": 4096, "dtype": "bf16"}
    runs = [dict(job, id=name) for name in ("a", "b", "c", "d")] + [dict(job, id="e", gpus=16)]
    rates = {"a": (100.0, 130.0), "b": (80.0, 120.0), "c": (99.0, 90.0), "d": (70.0, 129.5), "e": (50.0, 1.0)}
    rows = [{"id": r["id"], "measured": rates[r["id"]][0], "predicted": rates[r["id"]][1]} for r in runs]
    lines = _module("cluster_published").ordering(runs, rows)
    verdicts = {line.split(":")[0]: line.rsplit(": ", 1)[1] for line in lines[:-1]}
    assert verdicts == {
        "a / b": "ordered as measured", "a / c": "a measured tie", "a / d": "priced alike (the model does not tell "
        "them apart)", "b / c": "ORDERED WRONG", "b / d": "ORDERED WRONG", "c / d": "ORDERED WRONG"}
    assert lines[-1].startswith("1 of 4 pairs of runs of one job ordered as measured (6 pairs;")
