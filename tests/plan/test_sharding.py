"""The automatic sharding search (pipeloom.plan.sharding): replication where memory does not bind and
collectives dominate, tensor parallelism where memory binds, the stream-layout constraint of sequence
parallelism, and the recipe torch's styles come from. (Predicted collectives against counted ones:
tests/runtime/test_tp_plan.py.)"""

from __future__ import annotations

import dataclasses

from pipeloom.plan.recipes import recipe_styles
from pipeloom.plan.sharding import RegionModules, ShardingProblem, search_sharding
from pipeloom.plan.tensor import CollectiveFit

MODULES = RegionModules(attention_column=("layers.*.qkv",), attention_row=("layers.*.proj",),
                        mlp_column=("layers.*.up",), mlp_row=("layers.*.down",), norms=("layers.*.norm*",),
                        embedding="embed", head="head")
SLOW = CollectiveFit.from_link(1e-3, 1e8)  # a slow link: collectives dominate


def problem(**changes) -> ShardingProblem:
    base = ShardingProblem(layers=4, hidden=1024, heads=16, seq=512, vocab=32000, microbatch_size=1, microbatches=4,
                           tp=4, flops_per_second=1e12, fit=SLOW, modules=MODULES)
    return dataclasses.replace(base, **changes)


def test_replication_when_memory_does_not_bind():
    result = search_sharding(problem())
    assert result.status == "OPTIMAL"
    assert set(result.choice.values()) == {"replicate"} and result.recipe is None and not result.collectives


def test_tensor_parallel_when_memory_binds():
    whole = search_sharding(problem()).memory
    result = search_sharding(problem(memory_limit=0.6 * whole))
    assert result.status == "OPTIMAL" and result.memory <= 0.6 * whole
    assert any(option != "replicate" for option in result.choice.values())
    assert result.step_time > search_sharding(problem()).step_time  # it pays collectives to fit
    nothing = search_sharding(problem(memory_limit=1e6))
    assert nothing.status == "INFEASIBLE"


def test_fast_link_prefers_tensor_parallel_and_sp_keeps_one_stream_layout():
    fast = problem(fit=CollectiveFit.from_link(0.0, 1e15))
    result = search_sharding(fast)
    assert result.choice["attention"] != "replicate" and result.choice["mlp"] != "replicate"
    sp = search_sharding(dataclasses.replace(fast, memory_limit=0.3 * search_sharding(problem()).memory))
    assert sp.choice["attention"] == sp.choice["mlp"] == "megatron-sp"  # only sequence parallelism fits
    assert sp.choice["embedding"] == sp.choice["head"] == "vocab"
    assert sp.recipe["recipe"] == "megatron-sp" and sp.recipe["sequence"] == ["layers.*.norm*"]
    styles = recipe_styles(result.recipe)
    assert type(styles["layers.*.qkv"]).__name__ == "ColwiseParallel"
    assert type(styles["layers.*.proj"]).__name__ == "RowwiseParallel"
