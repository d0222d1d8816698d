"""NVIDIA's Hybrid-EP all-to-all (``moe_comm="hybridep"``, Megatron-Core's flex dispatcher as Megatron-Bridge's
Qwen3-30B-A3B H100 recipe runs it): each token crosses InfiniBand once to each other node holding any of its
experts and fans out over NVLink there, in bf16 both ways."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeloom.cli import main
from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.errors import LayoutError

CONFIGS = Path(__file__).parents[3] / "benchmarks/data/configs"
QWEN = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())  # 128 experts, top 8, hidden 2,048


def _job(comm: str) -> Job:
    return Job(spec=model_spec(QWEN), hw=hardware("h100"), gpus=16, global_batch=1024, seq=4096, dtype="fp8",
               moe_comm=comm)


def test_hybridep_all_to_all_by_hand():
    """ep 16 over two nodes of 8 H100s: a token's 8 experts miss the other node's 64 with probability
    C(64, 8) / C(128, 8), so it crosses the NIC 0.9965 times (the plain all-to-all sends 4 of its 8 copies
    across), and reaches 7/8 of its 8 copies' GPUs over NVLink."""
    hw = hardware("h100")
    reach = 1 - math.comb(64, 8) / math.comb(128, 8)
    token = 2048 * 2
    ib = 4096 * reach * token / (hw.scale_out_bandwidth * hw.scale_out_efficiency) + hw.scale_out_latency
    nvlink = 4096 * 8 * 7 / 8 * token / (hw.scale_up_bandwidth * hw.scale_up_efficiency) + hw.scale_up_latency
    layout = Layout(dp=16, ep=16)
    times = layer_times(_job("hybridep"), layout, "moe")
    assert times.f_comm == pytest.approx(2 * max(ib, nvlink)) and times.i_comm == times.f_comm
    plain = layer_times(_job("plain"), layout, "moe")
    assert times.f_comm < plain.f_comm / 3  # a quarter of the NIC copies, without the weights and ids
    assert (times.f - times.f_comm, times.w) == pytest.approx((plain.f - plain.f_comm, plain.w))  # compute as is


def test_inside_one_node_only_nvlink_moves_tokens():
    layout = Layout(dp=16, ep=8)
    hw = hardware("h100")
    nvlink = 4096 * 8 * 7 / 8 * 2048 * 2 / (hw.scale_up_bandwidth * hw.scale_up_efficiency) + hw.scale_up_latency
    assert layer_times(_job("hybridep"), layout, "moe").f_comm == pytest.approx(2 * nvlink)


def test_the_option_needs_experts_and_is_on_the_command(tmp_path, capsys):
    dense = json.loads((CONFIGS / "llama3-8b.json").read_text())
    with pytest.raises(LayoutError, match="hybridep"):
        plan_cluster(dense, "h100", gpus=16, global_batch=64, seq=4096, moe_comm="hybridep")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN))
    layout = "dp=16,tp=1,pp=1,vp=1,cp=1,ep=16,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "16", "--global-batch", "1024",
                 "--seq", "4096", "--dtype", "fp8", "--layout", layout, "--moe-comm", "hybridep", "--json"]) == 0
    hybrid = json.loads(capsys.readouterr().out)["best"]["step_time"]
    plain = plan_cluster(QWEN, "h100", gpus=16, global_batch=1024, seq=4096, dtype="fp8", layout=layout)
    assert hybrid < plain.best.step_time
