"""The automatic sharding search (pipeloom.plan.tp.sharding): replication where memory does not bind and
collectives dominate, tensor parallelism where memory binds, the stream-layout constraint of sequence
parallelism, and the recipe torch's styles come from. (Predicted collectives against counted ones:
tests/runtime/test_tp_plan.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.plan.tp.collectives import CollectiveFit
from pipeloom.plan.tp.sharding import (
    LOSS_PARALLEL_REDUCTIONS,
    OPTIONS,
    RegionModules,
    ShardingProblem,
    recipe_for,
    region_costs,
    search_sharding,
)
from pipeloom.runtime.parallel.tp import recipe_styles

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


def _kinds(cost, phase: str) -> dict:
    found: dict = {}
    for c in cost.collectives:
        if c.phase == phase:
            found[c.kind] = found.get(c.kind, 0) + 1
    return found


def test_sequence_parallel_gathers_once_per_region_with_its_own_module():
    """megatron-sp on attention with one fused column: once per column module without a region module; with
    q, k, v and the attention module prepared (PrepareModuleInput), one all-gather (F) and one reduce-scatter
    (I) for the region, not three; Megatron all-reduces each column's input gradient."""
    three = dataclasses.replace(MODULES, attention_column=("layers.*.q", "layers.*.k", "layers.*.v"))
    assert _kinds(region_costs(problem(layers=1, modules=three), "attention", "megatron-sp"), "F") == {
        "all_gather": 3, "reduce_scatter": 1}
    prepared = dataclasses.replace(three, attention_module="layers.*.attn")
    cost = region_costs(problem(layers=1, modules=prepared), "attention", "megatron-sp")
    assert _kinds(cost, "F") == {"all_gather": 1, "reduce_scatter": 1}
    assert _kinds(cost, "I") == {"reduce_scatter": 1, "all_gather": 1}
    assert _kinds(region_costs(problem(layers=1, modules=prepared), "attention", "megatron"), "I") == {"all_reduce": 3}
    assert recipe_for({"attention": "megatron-sp", "mlp": "megatron-sp"}, prepared)["gather"] == ["layers.*.attn"]


def test_stream_layout_of_the_embedding_and_head():
    """With SP the vocabulary-parallel embedding reduce-scatters into the sharded stream (its gradient
    all-gathered back) and the head all-gathers its input; the loss-parallel head keeps 1/tp of the logits and
    runs loss_parallel's per-token all-reduces instead of gathering them."""
    p = problem()
    assert _kinds(region_costs(p, "embedding", "vocab", sequence_parallel=True), "F") == {"reduce_scatter": 1}
    assert _kinds(region_costs(p, "embedding", "vocab"), "F") == {"all_reduce": 1}
    vocab = region_costs(p, "head", "vocab", sequence_parallel=True)
    assert _kinds(vocab, "F") == {"all_gather": 2} and _kinds(vocab, "I") == {"reduce_scatter": 1}
    loss = region_costs(p, "head", "vocab-loss")
    assert _kinds(loss, "F") == {"all_reduce": LOSS_PARALLEL_REDUCTIONS} and loss.memory < vocab.memory


def test_options_the_problem_does_not_allow_are_never_chosen():
    """Sequence parallelism needs the embedding and the head regions and the user's consent; the loss-parallel
    head needs loss_parallel; ``candidates`` (DTensor's rules) narrow the rest."""
    fast = problem(fit=CollectiveFit.from_link(0.0, 1e15))
    tight = 0.3 * search_sharding(problem()).memory
    assert search_sharding(dataclasses.replace(fast, memory_limit=tight)).choice["attention"] == "megatron-sp"
    no_sp = search_sharding(dataclasses.replace(fast, memory_limit=tight, sequence_parallel=False))
    assert no_sp.choice and "megatron-sp" not in no_sp.choice.values()
    headless = dataclasses.replace(MODULES, head=None)
    assert not problem(modules=headless).allows("attention", "megatron-sp")
    assert not problem().allows("head", "vocab-loss") and problem(loss_parallel=True).allows("head", "vocab-loss")
    narrowed = search_sharding(dataclasses.replace(fast, candidates={"attention": ("replicate",),
                                                                     "mlp": OPTIONS["mlp"]}))
    assert narrowed.choice["attention"] == "replicate" and narrowed.choice["mlp"] != "replicate"
    assert narrowed.choice["embedding"] == narrowed.choice["head"] == "replicate"  # not offered: replicate only


def test_a_recipe_may_name_head_norms():
    """``head_norm`` is optional (a recipe without it reads as before, with an empty list), keeps its modules'
    parameters whole (a recipe of head norms alone shards nothing), and names each module once."""
    from pipeloom.plan.errors import RecipeError
    from pipeloom.plan.tp.recipes import check_recipe

    old = {"recipe": "megatron", "column": ["layers.*.q"], "row": ["layers.*.out"]}
    assert check_recipe(old)["head_norm"] == []
    found = check_recipe({**old, "head_norm": ["layers.*.q_norm"]})
    assert found["head_norm"] == ["layers.*.q_norm"] and found["column"] == ["layers.*.q"]
    with pytest.raises(RecipeError, match="shards no module"):
        check_recipe({"recipe": "megatron", "head_norm": ["layers.*.q_norm"]})
    with pytest.raises(RecipeError, match="twice"):
        check_recipe({**old, "head_norm": ["layers.*.q"]})
    with pytest.raises(RecipeError, match="head_norm must be a list"):
        check_recipe({**old, "head_norm": "layers.*.q_norm"})
