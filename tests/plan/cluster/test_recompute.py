"""Megatron-Core's ``recompute_modules`` as the selective policy (:mod:`pipeloom.plan.cluster.recompute`): the
names it takes, the modules it refuses where they recompute nothing, the seconds each adds to a layer's backward
and what the plan then keeps; the command's ``--selective``. What each keeps is checked against the tensors
autograd saves in ``test_activations.py``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeloom.cli import main
from pipeloom.plan.cluster.config import model_spec
from pipeloom.plan.cluster.efficiency import gemm_seconds, memory_seconds
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.errors import LayoutError

CONFIGS = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "configs"
MOE = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
DENSE = json.loads((CONFIGS / "llama3-8b.json").read_text())
MLA = json.loads((CONFIGS / "deepseek-v3.json").read_text())


def _job(config, **options) -> Job:
    return Job(spec=model_spec(config), hw=hardware("h100"), gpus=16, global_batch=64, seq=4096, **options)


def test_modules_are_written_in_megatron_order_and_checked():
    assert _job(MOE, selective="moe_act, layernorm").selective == "layernorm,moe_act"
    for bad, what in (("core_attention", "unknown 'core_attention'"), ("mlp,mlp", "a module named twice"),
                      ("", "unknown ''")):
        with pytest.raises(LayoutError, match=what):
            _job(DENSE, selective=bad)


@pytest.mark.parametrize(("config", "modules", "why"), [
    (DENSE, "moe_act", "moe_act recomputes nothing in the llama model, which has no MoE layer"),
    (DENSE, "layernorm", "fuses every norm into the linear layer after it"),
    (MOE, "mla_up_proj,shared_experts", "has no multi-head latent attention; shared_experts .* no shared experts"),
    (MOE, "mlp", "has no dense MLP: leave it out"),
])
def test_a_module_that_recomputes_nothing_is_refused(config, modules, why):
    with pytest.raises(LayoutError, match=why):
        _job(config, selective=modules)


def _times(job: Job, kind: str, recompute: str = "selective", **layout):
    """One layer's F, I, W on one GPU of the job's 16 (dp the rest of tp)."""
    return layer_times(job, Layout(dp=16 // layout.get("tp", 1), recompute=recompute, **layout), kind)


def test_each_module_adds_its_forward_to_the_backward():
    job = _job(MOE)
    none = _times(job, "moe", "none", ep=8)
    added = {modules: _times(dataclasses.replace(job, selective=modules), "moe", ep=8).i - none.i
             for modules in ("core_attn", "layernorm", "moe_act", "moe", "core_attn,layernorm,moe_act")}
    spec = job.spec
    # the pre-MLP norm: read h, write h on the micro-batch's 4096 tokens, one kernel
    assert added["layernorm"] == pytest.approx(memory_seconds(job.hw, 4.0 * spec.hidden * 4096)
                                               + job.hw.kernel_overhead)
    assert added["moe_act"] == pytest.approx(memory_seconds(job.hw, 6.0 * 8 * spec.experts.intermediate * 4096))
    assert added["core_attn,layernorm,moe_act"] == pytest.approx(
        added["core_attn"] + added["layernorm"] + added["moe_act"])
    # the MoE MLP again, its all-to-alls included: more than its activation alone, and the all-to-alls are
    # what an overlapped pair may hide
    moe = _times(dataclasses.replace(job, selective="moe"), "moe", ep=8)
    assert added["moe"] > added["moe_act"] and none.f_comm > 0
    assert moe.i_comm == pytest.approx(none.i_comm + none.f_comm)
    assert all(_times(dataclasses.replace(job, selective=m), "moe", ep=8).f == none.f for m in added)


def test_dense_mlp_and_mla_up_projections_rerun_their_gemms():
    dense = _job(DENSE)
    none = _times(dense, "dense", "none", tp=2)
    mlp = _times(dataclasses.replace(dense, selective="mlp"), "dense", tp=2)
    h, inter = dense.spec.hidden, dense.spec.intermediate // 2  # the MLP's GEMMs on a tp rank: gate, up, down
    gemms = 2 * gemm_seconds(dense.hw, 4096, inter, h) + gemm_seconds(dense.hw, 4096, h, inter)
    assert gemms < mlp.i - none.i < none.f
    mla = _job(MLA, dtype="fp8")
    base = _times(mla, "dense", "none", tp=2)
    up = _times(dataclasses.replace(mla, selective="mla_up_proj"), "dense", tp=2)
    assert 0 < up.i - base.i < base.f / 4


def test_more_modules_keep_less_and_cost_more():
    job = _job(MOE)
    layout = Layout(dp=16, ep=8, recompute="selective")
    plans = {m: Estimator(dataclasses.replace(job, selective=m)).estimate(layout)
             for m in ("core_attn", "core_attn,layernorm,moe_act", "core_attn,layernorm,moe")}
    none = Estimator(job).estimate(dataclasses.replace(layout, recompute="none"))
    order = [none, *plans.values()]
    assert all(a.memory.activations > b.memory.activations for a, b in zip(order, order[1:]))
    assert all(a.step_time < b.step_time for a, b in zip(order, order[1:]))


def test_the_command_takes_megatron_modules(tmp_path, capsys):
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(MOE))
    layout = "dp=16,tp=1,pp=1,vp=1,cp=1,ep=8,mbs=1,fsdp=0,recompute=selective,schedule=1f1b"
    common = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "16", "--global-batch", "64", "--seq",
              "4096", "--layout", layout]
    assert main([*common, "--selective", "layernorm,moe_act", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["best"]
    assert main([*common, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)["best"]
    assert ours["memory_per_gpu"]["activations"] < default["memory_per_gpu"]["activations"]
    assert main([*common, "--selective", "moe_act,layernorm"]) == 0
    assert "selective recomputation: layernorm,moe_act (--selective)" in capsys.readouterr().out
    assert main([*common, "--selective", "mla_up_proj"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no multi-head latent attention" in err, err
