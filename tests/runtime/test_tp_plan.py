"""Planned tensor parallelism on gloo ranks: the sharding search's predicted collectives (kind and bytes)
against those torch's CommDebugMode and pipeloom's counter count when its recipe runs under
``parallelize_module`` on 2 ranks, and a saved plan with ``tensor_parallel`` 2 run by
``pipeline(model, plan=...)`` on a (pp 2, tp 2) mesh of 4 ranks."""

from __future__ import annotations

from ranks import run_ranks
from tp_plan_jobs import HIDDEN, SEQ, VOCAB, count_job, plan_job

from pipeloom.plan.plan import Plan, save_plan
from pipeloom.plan.tp.sharding import RegionModules, ShardingProblem, recipe_for, region_costs

MODULES = RegionModules(attention_column=("layers.*.q", "layers.*.k", "layers.*.v"), attention_row=("layers.*.out",),
                        mlp_column=("layers.*.up",), mlp_row=("layers.*.down",), embedding="embed", head="head")
CHOICES = [{"embedding": "vocab", "attention": "megatron", "mlp": "megatron", "head": "vocab"},
           {"embedding": "vocab", "attention": "megatron", "mlp": "replicate", "head": "replicate"}]
BATCH = 2


def _ok(results: dict) -> dict:
    bad = {rank: value for rank, value in results.items() if value[0] != "ok"}
    assert not bad, bad
    return {rank: value for rank, (_, value) in results.items()}


def _predicted(choice: dict) -> dict:
    problem = ShardingProblem(layers=2, hidden=HIDDEN, heads=4, seq=SEQ, vocab=VOCAB, microbatch_size=BATCH,
                              bytes_per_element=8, tp=2, flops_per_second=1e9, modules=MODULES)
    found = {"F": [], "B": []}
    for region, option in choice.items():
        for c in region_costs(problem, region, option).collectives:
            found["F" if c.phase == "F" else "B"].append((c.kind, int(c.bytes)))
    return {phase: sorted(records) for phase, records in found.items()}


def test_counted_collectives_equal_predicted():
    counted = _ok(run_ranks(2, count_job, [recipe_for(c, MODULES) for c in CHOICES], BATCH, timeout=90))
    for k, choice in enumerate(CHOICES):
        predicted = _predicted(choice)
        for rank in (0, 1):
            for phase in ("F", "B"):
                assert counted[rank][k][phase]["records"] == predicted[phase], (choice, rank, phase)
                assert counted[rank][k][phase]["torch"] == len(predicted[phase]), (choice, rank, phase)


def test_saved_tp_plan_runs_through_pipeline(tmp_path):
    recipe = recipe_for(CHOICES[0], MODULES)
    plan = Plan(num_ranks=2, split_points=("layers.2",), schedule="1f1b", microbatches=2, global_batch=8,
                predicted_step_time=1.0, tensor_parallel=2, tp_plan=recipe)
    save_plan(plan, tmp_path / "plan.json")
    results = _ok(run_ranks(4, plan_job, str(tmp_path / "plan.json"), 2, timeout=150))
    losses = {tuple(r["losses"]) for r in results.values()}
    assert len(losses) == 1  # the same loss on every rank
    assert all(not r["missing"] for r in results.values())
    assert all(r["sharded"] > 0 for r in results.values())  # the recipe's styles sharded this rank's stages
