"""The experts' own mesh (Megatron-Core's MoE parallel folding with expert tp 1): ep consecutive ranks of a
pipeline stage share out the experts, over tp x dp x cp, and the tp x dp x cp / ep ranks holding the same experts
reduce their gradients and shard their optimizer state."""

from __future__ import annotations

import json

import pytest

from pipeloom.plan.cluster import plan_cluster
from pipeloom.plan.cluster.efficiency import collective_seconds
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.layout import Layout, enumerate_layouts
from pipeloom.plan.errors import LayoutError

MIXTRAL = {"model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2}


def _layout(**keys) -> str:
    base = dict(dp=4, tp=2, pp=1, vp=1, cp=1, ep=1, mbs=1, fsdp=0, recompute="none", schedule="1f1b")
    return ",".join(f"{k}={v}" for k, v in {**base, **keys}.items())


def test_ep_may_take_the_tensor_parallel_ranks():
    assert Layout(tp=8, ep=8).expert_replicas == 1
    assert Layout(tp=2, dp=4, ep=2).expert_replicas == 4 and Layout(tp=2, dp=2, cp=2, ep=8).expert_replicas == 1
    with pytest.raises(LayoutError, match=r"ep=8 must divide tp x dp x cp = 4 \(experts are shared out"):
        Layout(tp=2, dp=2, ep=8)


def _params(result) -> tuple[float, float]:
    """(dense, expert) parameters of the whole model (pp 1: one rank holds every layer)."""
    estimator = Estimator(result.job)
    kinds = [*estimator.kinds, "embedding", *estimator.tail]
    expert = sum(estimator.counts[k].expert_params for k in kinds)
    return sum(estimator.counts[k].params for k in kinds) - expert, expert


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_memory_by_hand(ep):
    """bf16 weights and gradients: dense / tp, experts / ep; fp32 master and moments (12 bytes) sharded over dp x cp
    (dense) and over the expert replicas tp x dp x cp / ep (experts): 12 x experts / (tp x dp x cp) per GPU
    whatever ep, the distributed optimizer sharding every expert's state over all eight ranks."""
    result = plan_cluster(MIXTRAL, "h100", gpus=8, global_batch=8, seq=1024, layout=_layout(ep=ep))
    dense, expert = _params(result)
    memory = result.best.memory
    assert memory.weights == pytest.approx(2 * dense / 2 + 2 * expert / ep)
    assert memory.gradients == pytest.approx(2 * dense / 2 + 2 * expert / ep)
    assert memory.optimizer == pytest.approx(12 * dense / 2 / 4 + 12 * expert / 8)


def test_the_expert_gradients_are_reduced_over_their_replicas():
    """With every ep rank holding different experts (ep = tp x dp x cp) nothing reduces the experts' gradients;
    with ep inside dp alone the tp ranks of a replica hold the same experts and reduce them too: the exposed
    data-parallel time grows with the expert replicas (the exchange itself priced as the estimator's)."""
    exposed = {ep: plan_cluster(MIXTRAL, "h100", gpus=8, global_batch=8, seq=1024, layout=_layout(ep=ep),
                                overlap_grad_reduce=False).best.exposed_dp for ep in (2, 8)}
    result = plan_cluster(MIXTRAL, "h100", gpus=8, global_batch=8, seq=1024, layout=_layout(ep=8),
                          overlap_grad_reduce=False)
    dense, expert = _params(result)
    hw = result.job.hw
    dense_sync = (collective_seconds(hw, "reduce_scatter", 2 * dense / 2, 4, ranks_per_domain=4)
                  + collective_seconds(hw, "all_gather", 2 * dense / 2, 4, ranks_per_domain=4))
    assert exposed[8] == pytest.approx(dense_sync)
    # ep=2: four replicas of each expert, two ranks apart (all inside one 8-GPU domain)
    expert_sync = (collective_seconds(hw, "reduce_scatter", 2 * expert / 2, 4, ranks_per_domain=4)
                   + collective_seconds(hw, "all_gather", 2 * expert / 2, 4, ranks_per_domain=4))
    assert exposed[2] == pytest.approx(dense_sync + expert_sync)


def test_the_search_folds_ep_into_tp_where_that_is_faster():
    """On one 8-GPU node with tp 8 and dp 1 given, ep can only be found inside tp: the search reaches ep 8, which
    holds an eighth of the experts and reduces none of their gradients, faster than ep 1."""
    result = plan_cluster(MIXTRAL, "h100", gpus=8, global_batch=8, seq=1024, layout="tp=8,pp=1,cp=1")
    alone = plan_cluster(MIXTRAL, "h100", gpus=8, global_batch=8, seq=1024, layout="tp=8,pp=1,cp=1,ep=1")
    assert result.best.layout.ep == 8 and result.best.step_time < alone.best.step_time
    assert result.best.memory.weights < alone.best.memory.weights


def test_the_expert_replicas_sit_ep_apart():
    """On two 8-GPU nodes with tp 2, dp 8, ep 8 the two replicas of each expert are 8 ranks apart, one per node:
    their exchange runs across the nodes (the dense replicas, 2 apart, have 4 ranks in each node)."""
    result = plan_cluster(MIXTRAL, "h100", gpus=16, global_batch=16, seq=1024, layout=_layout(dp=8, ep=8),
                          overlap_grad_reduce=False)
    dense, expert = _params(result)
    hw = result.job.hw

    def sync(params: float, group: int, per_domain: int) -> float:
        return (collective_seconds(hw, "reduce_scatter", 2 * params, group, ranks_per_domain=per_domain)
                + collective_seconds(hw, "all_gather", 2 * params, group, ranks_per_domain=per_domain))

    across = sync(dense / 2, 8, 4) + sync(expert / 8, 2, 1)
    assert result.best.exposed_dp == pytest.approx(across)
    assert across > sync(dense / 2, 8, 4) + sync(expert / 8, 2, 2)


def test_the_report_says_how_the_experts_are_laid_out(tmp_path, capsys):
    from pipeloom.cli import main

    config = tmp_path / "mixtral.json"
    config.write_text(json.dumps(MIXTRAL))
    for layout, line in ((_layout(ep=8), "experts: 1 of 8 per GPU (ep 8 consecutive GPUs within tp x dp x cp; each "
                                         "on one GPU of a stage)"),
                         (_layout(tp=1, dp=8, ep=2), "experts: 4 of 8 per GPU (ep 2 consecutive GPUs within dp x cp; "
                                                     "each held by 4 GPUs of a stage)")):
        assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "8", "--global-batch", "8",
                     "--seq", "1024", "--layout", layout]) == 0
        assert line in capsys.readouterr().out.splitlines()


def test_ep_with_tp_needs_sequence_parallelism():
    """Without sequence parallelism every tp rank holds all of a micro-batch's tokens, which experts shared out over
    those ranks would route once per rank: Megatron-Core refuses expert with tensor parallelism without it (its MoE
    README), and so does the planner; the search keeps tp 1 or ep 1 there."""
    with pytest.raises(LayoutError, match=r"ep=2 with tp=2 needs sequence parallelism.*drop --no-sequence-parallel"):
        plan_cluster(MIXTRAL, "h100", gpus=8, global_batch=8, seq=1024, layout=_layout(ep=2), sequence_parallel=False)
    result = plan_cluster(MIXTRAL, "h100", gpus=8, global_batch=8, seq=1024, sequence_parallel=False)
    layouts = list(enumerate_layouts(result.job, {}))
    assert all(layout.tp == 1 or layout.ep == 1 for layout in layouts)
    assert any(layout.tp > 1 for layout in layouts) and any(layout.ep > 1 for layout in layouts)
    with_sp = plan_cluster(MIXTRAL, "h100", gpus=8, global_batch=8, seq=1024).job
    assert any(layout.tp > 1 and layout.ep > 1 for layout in enumerate_layouts(with_sp, {}))
