"""Tensor parallelism in the cost model and the plan search (pipeloom.plan.tp.megatron, plan_mesh's tp sizes):
Megatron's formulas as closed-form oracles, a latency-bandwidth fit recovering known parameters, the
optional JSON fields, and the search choosing tp where memory binds."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeloom.plan import analytical_gpt_costs
from pipeloom.plan.costs.file import costs_from_json, costs_to_json
from pipeloom.plan.costs.parts import Link
from pipeloom.plan.errors import PlanError, TensorParallelError
from pipeloom.plan.mesh import plan_mesh
from pipeloom.plan.plan import Plan, plan_from_json, plan_to_json
from pipeloom.plan.tp.collectives import CollectiveFit, fit_collectives
from pipeloom.plan.tp.megatron import TensorInfo, tensor_parallel_table

LINK = Link(latency=1e-5, bandwidth=1e11)


def gpt(layers: int = 8) -> object:
    table = analytical_gpt_costs(layers=layers, hidden=4096, heads=32, seq=2048, vocab=50257, microbatch_size=1,
                                 flops_per_second=4e14, bytes_per_second=2e12, link=LINK)
    info = TensorInfo(heads=32, layers=tuple(n for n in table.names if n.startswith("blocks.")),
                      column=("attn.qkv", "mlp.0"), row=("attn.proj", "mlp.2"))
    return dataclasses.replace(table, tensor=info)


def test_megatron_layer_formulas():
    table = gpt()
    sharded = tensor_parallel_table(table, 4)
    a, b = table.pieces[1], sharded.pieces[1]
    ring = 2 * 3 * LINK.latency + 2 * 3 / 4 * a.output_bytes / LINK.bandwidth  # one all-reduce on 4 ranks
    assert b.f == pytest.approx(a.f / 4 + 2 * ring)  # 2 forward all-reduces per layer
    assert b.i == pytest.approx(a.i / 4 + 2 * ring)  # 2 backward ones, in the input gradient
    assert b.w == pytest.approx(a.w / 4)
    assert b.param_bytes == pytest.approx(a.param_bytes / 4)
    assert b.activation_bytes == pytest.approx(a.activation_bytes * (10 + 24 / 4) / 34)  # Korthikanti
    assert sharded.pieces[0] == table.pieces[0] and sharded.pieces[-1] == table.pieces[-1]  # left whole
    assert tensor_parallel_table(table, 1) is table


def test_fit_recovers_latency_bandwidth_and_overhead():
    truth = CollectiveFit(latency={"all_reduce": 2e-5}, bandwidth={"all_reduce": 5e9}, overhead={"all_reduce": 1e-4})
    samples = [("all_reduce", n, s, truth.seconds("all_reduce", s, n)) for n in (2, 4, 8) for s in (1e3, 1e6, 1e7)]
    fit = fit_collectives(samples)
    assert fit.latency["all_reduce"] == pytest.approx(2e-5, rel=1e-6)
    assert fit.bandwidth["all_reduce"] == pytest.approx(5e9, rel=1e-6)
    assert fit.overhead["all_reduce"] == pytest.approx(1e-4, rel=1e-6)


def test_tensor_field_and_tp_plan_round_trip():
    fit = CollectiveFit(latency={"all_reduce": 1e-5}, bandwidth={"all_reduce": 1e10}, overhead={"all_reduce": 3e-5})
    table = dataclasses.replace(gpt(2), tensor=dataclasses.replace(gpt(2).tensor, fit=fit))
    assert costs_from_json(costs_to_json(table)) == table
    assert "tensor" not in costs_to_json(analytical_gpt_costs(layers=1, hidden=64, heads=4, seq=8, vocab=32,
                                                              microbatch_size=1, flops_per_second=1e12,
                                                              bytes_per_second=1e12))
    plan = Plan(num_ranks=2, split_points=("blocks.1",), schedule="1f1b", microbatches=2, global_batch=4,
                predicted_step_time=1.0, tensor_parallel=2, tp_plan=table.tensor.recipe())
    assert plan_from_json(plan_to_json(plan)) == plan and plan.world_size == 4
    with pytest.raises(PlanError, match="needs a tp_plan"):
        Plan(num_ranks=2, split_points=("blocks.1",), schedule="1f1b", microbatches=2, global_batch=4,
             predicted_step_time=1.0, tensor_parallel=2)


def test_plan_mesh_chooses_tp_when_memory_binds():
    table = gpt()
    free = plan_mesh(table, num_ranks=8, global_batch=16, tensor_parallel=None, microbatches=[8, 16])
    assert free.plan.tensor_parallel == 1  # nothing binds: pipelining and replicas beat the all-reduces
    tight = plan_mesh(table, num_ranks=8, global_batch=16, tensor_parallel=None, microbatches=[8, 16],
                      memory_limit=12e9)
    plan = tight.plan
    assert plan.tensor_parallel > 1 and plan.world_size == 8 and max(plan.peak_memory) <= 12e9
    assert plan.tp_plan["recipe"] == "megatron" and "blocks.0.attn.qkv" in plan.tp_plan["column"]
    assert all(c.schedule not in ("dualpipe", "chimera") for c in tight.candidates if c.tensor_parallel > 1)
    with pytest.raises(PlanError, match="does not divide the model's 32 heads"):
        plan_mesh(table, num_ranks=6, global_batch=6, tensor_parallel=[3])


def test_head_norms_reach_the_file_and_the_recipe(tmp_path, capsys):
    """``tensor.head_norm`` (Qwen3's per-head q/k norms): written only when given, read back, listed in the saved
    plan's recipe under ``head_norm`` per layer; ``pipeloom plan --tp-head-norm`` sets it."""
    from pipeloom.cli import main

    table = gpt(2)
    assert "head_norm" not in json.loads(costs_to_json(table))["tensor"] and "head_norm" not in table.tensor.recipe()
    normed = dataclasses.replace(table, tensor=dataclasses.replace(table.tensor, head_norm=("attn.q_norm",)))
    assert costs_from_json(costs_to_json(normed)) == normed
    assert normed.tensor.recipe()["head_norm"] == [f"{layer}.attn.q_norm" for layer in normed.tensor.layers]
    with pytest.raises(TensorParallelError, match="head_norm must be a list of names"):
        TensorInfo(heads=32, head_norm=("",))
    path = tmp_path / "gpt.json"
    path.write_text(costs_to_json(analytical_gpt_costs(
        layers=4, hidden=1024, heads=16, seq=512, vocab=1000, microbatch_size=1, flops_per_second=4e14,
        bytes_per_second=2e12, link=LINK)))
    saved = tmp_path / "plan.json"
    code = main(["plan", "--costs", str(path), "--ranks", "4", "--global-batch", "8", "--tp", "2", "--heads", "16",
                 "--tp-head-norm", "attn.q_norm,attn.k_norm", "--save", str(saved)])
    assert code == 0, capsys.readouterr()
    plan = plan_from_json(saved.read_text())
    assert plan.tensor_parallel == 2
    assert plan.tp_plan["head_norm"] == [f"blocks.{k}.{m}" for k in range(4) for m in ("attn.q_norm", "attn.k_norm")]
