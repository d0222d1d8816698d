"""NVIDIA's Hybrid-EP all-to-all (``moe_comm="hybridep"``, Megatron-Core's flex dispatcher as Megatron-Bridge's
Qwen3-30B-A3B H100 recipe runs it): each token crosses InfiniBand once to each other node holding any of its
experts and fans out over NVLink there, in bf16 both ways."""

from __future__ import annotations

import dataclasses
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
    """ep 16 over two nodes of 8 H100s, priced as Hybrid-EP's benchmark measured it there (README_Hybrid-EP.md, 16
    ranks, 16 SMs): the bytes its benchmark counts (a token once to each node holding any of its experts, its own
    included: 2 x 0.9965 copies of 2,048 x 2 bytes) at the kernels' rate, plus what a call through the torch API
    added to the kernel at the benchmark's shape (4,096 tokens of 7,168, top 8 of 128: the same reach), which no
    compute beside it hides."""
    reach = 1 - math.comb(64, 8) / math.comb(128, 8)
    ours, calls = 4096 * 2 * reach * 2048 * 2, 4096 * 2 * reach * 7168 * 2
    kernel = ours / 71.71e9 + ours / 62.95e9  # dispatch, combine: GB/s of the kernels alone
    synchronized = (calls / 54.47e9 - calls / 71.71e9) + (calls / 53.35e9 - calls / 62.95e9)
    layout = Layout(dp=16, ep=16)
    times = layer_times(_job("hybridep"), layout, "moe")
    plain = layer_times(_job("plain"), layout, "moe")
    assert times.f_comm == pytest.approx(kernel) and times.i_comm == times.f_comm
    assert times.f - plain.f + plain.f_comm == pytest.approx(kernel + synchronized)  # compute as is
    assert times.w == plain.w
    free = layer_times(_job("hybridep-sync-free"), layout, "moe")  # buffers sized ahead: no host synchronization
    assert free.f_comm == pytest.approx(kernel) and free.f == pytest.approx(times.f - synchronized)


def test_the_measured_run_of_the_same_topology_and_nearest_size_prices_it():
    """GB200s inside the NVL72 at ep 64 take the 36-rank run (the largest measured), at ep 8 the 8-rank one; a GB300
    NVL72 takes the GB200's; H200s the H100's (across nodes); a GPU or topology never measured (H100s inside one node,
    A100s) the generic node-aware exchange."""
    from pipeloom.plan.cluster.dispatch import _hybridep_measured

    assert _hybridep_measured("gb200", 64, 1).ranks == 36 and _hybridep_measured("gb200", 8, 1).ranks == 8
    assert _hybridep_measured("gb300", 18, 1).ranks == 16 and _hybridep_measured("gb200", 144, 2) is None
    assert _hybridep_measured("h200", 40, 5).ranks == 32 and _hybridep_measured("h100", 8, 1) is None
    assert _hybridep_measured("a100-80gb", 16, 2) is None and _hybridep_measured("b200", 8, 1).ranks == 8
    gb200 = dataclasses.replace(_job("hybridep"), hw=hardware("gb200"))
    gb300 = dataclasses.replace(_job("hybridep"), hw=hardware("gb300"))
    layout = Layout(dp=16, ep=16)
    assert layer_times(gb300, layout, "moe").f_comm == pytest.approx(layer_times(gb200, layout, "moe").f_comm)


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
    assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "16", "--global-batch", "1024",
                 "--seq", "4096", "--dtype", "fp8", "--layout", layout, "--moe-comm", "hybridep-sync-free"]) == 0
    out = capsys.readouterr().out
    free = float(out.split("step time: ")[1].split(" s")[0])
    assert free < hybrid and "hybridep-sync-free expert all-to-all (--moe-comm)" in out


def test_every_topology_of_a_measured_gpu_pays_its_calls_synchronization():
    """B200s across nodes were not measured: the generic exchange prices the bytes, and each call still waits for
    the host as Hybrid-EP's B200 run measured (the sync-free mode drops it); GPUs Hybrid-EP does not run on are
    refused."""
    job = dataclasses.replace(_job("hybridep"), hw=hardware("b200"), dtype="bf16")
    layout = Layout(dp=16, ep=16)  # two nodes of 8
    times = layer_times(job, layout, "moe")
    free = layer_times(dataclasses.replace(job, moe_comm="hybridep-sync-free"), layout, "moe")
    calls = 8 * 4096 * (1 - math.comb(56, 8) / math.comb(64, 8)) * 7168 * 2  # the 8-GPU run's bytes a rank
    synchronized = (calls / 535.94e9 - calls / 734.95e9) + (calls / 530.86e9 - calls / 673.84e9)
    assert times.f - free.f == pytest.approx(synchronized) and times.f_comm == pytest.approx(free.f_comm)
    with pytest.raises(LayoutError, match="Hybrid-EP.s kernels need NVIDIA Hopper or Blackwell GPUs .* not mi300x"):
        plan_cluster(QWEN, "mi300x", gpus=16, global_batch=64, seq=4096, moe_comm="hybridep")
