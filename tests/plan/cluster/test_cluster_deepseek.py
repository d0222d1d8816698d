"""DeepSeek-V3's own selective recomputation (``selective="deepseek"``): the bytes a layer keeps, counted by
hand from the technical report (arXiv:2412.19437, sec. 3.2.3 and 3.3.4), and what the recomputation costs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.cluster.counts import layer_counts
from pipeloom.plan.cluster.dispatch import compute_share
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.hardware import load_hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.cluster.recompute import deepseek_activations
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


def test_group_limited_routing_is_read_from_the_config():
    ex = model_spec(CONFIG).experts
    assert ex is not None and (ex.groups, ex.group_top_k) == (8, 4)
    plain = model_spec(dict(CONFIG, n_group=1)).experts
    assert plain is not None and plain.group_top_k == 0


def test_deepseek_all_to_all_by_hand():
    """ep = 64 over 8 nodes of 8 H800s: each token crosses InfiniBand to 4 of the 8 nodes (3.5 others on average)
    and fans out to its 8 experts over NVLink; dispatch in FP8 with its scales, combine in bf16."""
    hw = load_hardware(Path(__file__).parents[3] / "benchmarks/data/hardware/h800.json")
    spec = model_spec(CONFIG)
    job = Job(spec=spec, hw=hw, gpus=2048, global_batch=15360, seq=4096, dtype="fp8", moe_comm="deepseek")
    layout = Layout(dp=128, pp=16, vp=2, ep=64, schedule="dualpipev")
    expected = 0.0
    for width in (FP8, 2):
        ib = 4096 * 3.5 * 7168 * width / (50e9 * 0.8) + 5e-6
        nvlink = 4096 * 8 * 7 / 8 * 7168 * width / (200e9 * 0.8) + 1e-6
        expected += max(ib, nvlink)
    times = layer_times(job, layout, "moe")
    assert times.f_comm == pytest.approx(expected) and times.i_comm == pytest.approx(expected)
    plain = layer_times(dataclasses.replace(job, moe_comm="plain"), layout, "moe")
    assert times.f_comm < plain.f_comm / 2


def test_communication_sms_slow_the_compute():
    """20 of the 132 SMs run the all-to-all: every GEMM of the layer runs on the other 112."""
    hw = load_hardware(Path(__file__).parents[3] / "benchmarks/data/hardware/h800.json")
    job = Job(spec=model_spec(CONFIG), hw=hw, gpus=2048, global_batch=15360, seq=4096, dtype="fp8")
    layout = Layout(dp=128, pp=16, vp=2, ep=64, schedule="dualpipev")
    plain = layer_times(job, layout, "dense")
    reserved = layer_times(dataclasses.replace(job, moe_comm="deepseek"), layout, "dense")
    assert reserved.f > plain.f and reserved.w > plain.w
    share = compute_share(hw)
    assert share.sm_count == 112 and share.peak("fp8") == pytest.approx(hw.peak("fp8") * 112 / 132)
    assert share.memory_bandwidth == hw.memory_bandwidth and share.scale_out_bandwidth == hw.scale_out_bandwidth
    assert layer_times(dataclasses.replace(job, moe_comm="deepseek"), dataclasses.replace(layout, ep=1, dp=128),
                       "dense") == layer_times(job, dataclasses.replace(layout, ep=1, dp=128), "dense")


def test_the_report_names_the_multi_token_prediction_modules(capsys):
    """They are priced beside the layers (not among the parameters named: 671 B are the main model's); the first line
    had said only "61 layers"."""
    from pipeloom.cli import main

    layout = "tp=1,pp=16,vp=2,cp=1,ep=64,dp=64,mbs=1,fsdp=0,recompute=none,schedule=dualpipev"
    config = Path(__file__).parents[3] / "benchmarks/data/configs/deepseek-v3.json"
    assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "1024",
                 "--global-batch", "4096", "--seq", "4096", "--layout", layout]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("deepseek_v3 (61 layers + 1 multi-token-prediction module, 671.03B parameters"), first
