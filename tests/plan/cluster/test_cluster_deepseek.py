"""DeepSeek-V3's own selective recomputation (``selective="deepseek"``): the bytes a layer keeps, counted by
hand from the technical report (arXiv:2412.19437, sec. 3.2.3 and 3.3.4), and what the recomputation costs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.cluster.config import model_spec
from pipeloom.plan.cluster.counts import layer_counts
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.layer_time import Job, deepseek_activations, layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.errors import LayoutError

CONFIG = json.loads((Path(__file__).parents[3] / "benchmarks/data/configs/deepseek-v3.json").read_text())
FP8 = 1 + 4 / 128  # one fp32 scale per 128 elements


def test_moe_layer_bytes_by_hand():
    kept = deepseek_activations(model_spec(CONFIG), "moe")
    assert kept.sequence == 2 * 2 * 7168  # the two RMSNorms' inputs, bf16
    mla = 2 * (1536 + 512 + 64) + 1.5 * 128 * 128 + 4 * 128  # latents, E5M6 attention output, log-sum-exp
    experts = FP8 * 8 * (7168 + 2 * 2048) + FP8 * 2 * 2048 + 4 * 256  # dispatched input, SwiGLU inputs, scores
    assert kept.tensor == pytest.approx(mla + experts)


def test_dense_layer_bytes_by_hand():
    kept = deepseek_activations(model_spec(CONFIG), "dense")
    mla = 2 * (1536 + 512 + 64) + 1.5 * 128 * 128 + 4 * 128
    assert kept.tensor == pytest.approx(mla + 2 * 2 * 18432 + FP8 * 18432)


def test_keeps_less_than_megatrons_selective_and_recomputes_more():
    spec = model_spec(CONFIG)
    for kind in ("dense", "moe"):
        megatron = layer_counts(spec, kind, 4096).activations["selective"]
        ours = deepseek_activations(spec, kind)
        assert ours.sequence + ours.tensor < 0.5 * (megatron.sequence + megatron.tensor)
    job = Job(spec=spec, hw=hardware("h100"), gpus=64, global_batch=64, seq=4096, dtype="fp8")
    layout = Layout(dp=64, ep=8, recompute="selective")
    plain = layer_times(job, dataclasses.replace(layout, recompute="none"), "moe")
    deepseek = layer_times(dataclasses.replace(job, selective="deepseek"), layout, "moe")
    assert deepseek.f == plain.f and deepseek.w == plain.w
    assert plain.i < deepseek.i < plain.i + plain.f


def test_the_option_is_checked():
    with pytest.raises(LayoutError, match="deepseek"):
        plan_cluster(CONFIG, "h100", gpus=64, global_batch=64, seq=4096, selective="nope")
