"""The expert-parallel all-to-all formula (pipeloom.plan.tp.all_to_all) against closed forms worked by hand, and
the cluster planner's ep pricing against it (one formula in both places)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.plan.cluster.efficiency import collective_seconds, domain_ranks
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.errors import TensorParallelError
from pipeloom.plan.tp.all_to_all import all_to_all_seconds, expert_capacity, moe_exchanges, routed_pairs

MOE = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 160, "num_local_experts": 8, "num_experts_per_tok": 2,
       "vocab_size": 100}


def test_exchanges_of_one_layer_by_hand():
    # 12 tokens, top-2, hidden 32, fp32, ep 2: 24 pairs; a row is 32 * 4 = 128 bytes
    found = {(e.phase, e.what): e.bytes for e in moe_exchanges(tokens=12, hidden=32, top_k=2, ep=2, dtype_bytes=4)}
    assert found == {("F", "counts"): 16.0, ("F", "rows"): 3072.0, ("F", "weights"): 96.0, ("F", "ids"): 192.0,
                     ("F", "combine"): 3072.0, ("I", "combine"): 3072.0, ("I", "rows"): 3072.0,
                     ("I", "weights"): 96.0}
    assert moe_exchanges(tokens=12, hidden=32, top_k=2, ep=1, dtype_bytes=4) == ()
    bf16 = moe_exchanges(tokens=12, hidden=32, top_k=2, ep=4, dtype_bytes=2, weight_bytes=4)
    assert {(e.phase, e.what): e.bytes for e in bf16}[("F", "weights")] == 96.0  # fp32 weights, bf16 rows
    assert {(e.phase, e.what): e.bytes for e in bf16}[("F", "counts")] == 32.0  # 4 ranks' counts


def test_capacity_bounds_the_pairs():
    # 10 tokens, top-2, 4 experts: balanced 5 pairs each; factor 0.5 -> capacity ceil(2.5) = 3, 12 pairs sent
    assert expert_capacity(0.5, tokens=10, top_k=2, experts=4) == 3
    assert routed_pairs(tokens=10, top_k=2, experts=4, capacity_factor=0.5) == 12.0
    assert routed_pairs(tokens=10, top_k=2, experts=4, capacity_factor=1.0) == 20.0  # capacity 5: nothing dropped
    assert routed_pairs(tokens=10, top_k=2, experts=4, capacity_factor=4.0) == 20.0
    assert routed_pairs(tokens=10, top_k=2, experts=4) == 20.0
    rows = {e.what: e.bytes for e in moe_exchanges(tokens=10, hidden=8, top_k=2, ep=2, dtype_bytes=2, experts=4,
                                                   capacity_factor=0.5) if e.phase == "F"}
    assert rows["rows"] == 12 * 8 * 2 and rows["ids"] == 12 * 8
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(TensorParallelError, match="capacity factor"):
            expert_capacity(bad, tokens=10, top_k=2, experts=4)


def test_time_over_a_link():
    assert all_to_all_seconds(1000.0, 4, latency=1e-5, bandwidth=1e6) == pytest.approx(1e-5 + 0.75 * 1000 / 1e6)
    assert all_to_all_seconds(1000.0, 4, peers=2, latency=0.0, bandwidth=1e6) == pytest.approx(0.5 * 1000 / 1e6)
    assert all_to_all_seconds(1000.0, 1, latency=1.0, bandwidth=1e6) == 0.0
    assert all_to_all_seconds(1000.0, 4, latency=1e-5, bandwidth=None) == 1e-5
    with pytest.raises(TensorParallelError, match="peers"):
        all_to_all_seconds(1000.0, 4, peers=4, latency=0.0, bandwidth=1e6)
    hw = hardware("h100")  # 8 GPUs per NVLink domain: 8 ranks in one domain are one link's worth
    up = hw.scale_up_bandwidth * hw.scale_up_efficiency
    assert collective_seconds(hw, "all_to_all", 1e6, 8, ranks_per_domain=8) == pytest.approx(
        all_to_all_seconds(1e6, 8, latency=hw.scale_up_latency, bandwidth=up))


def test_the_cluster_planner_prices_ep_with_the_formula():
    """A MoE layer's F and I at ep 2 less the same on links that cost nothing: exactly the formula's exchanges
    priced as all-to-alls (F: counts, rows, weights, ids, combine; I: the three reversed)."""
    spec, hw = model_spec(MOE), hardware("h100")
    free = dataclasses.replace(hw, scale_up_bandwidth=1e30, scale_out_bandwidth=1e30, scale_up_latency=0.0,
                               scale_out_latency=0.0)
    layout = Layout(dp=2, ep=2, tp=1, pp=1, mbs=2)
    priced, unpriced = (layer_times(Job(spec=spec, hw=h, gpus=2, global_batch=4, seq=256), layout, "moe")
                        for h in (hw, free))
    exchanges = moe_exchanges(tokens=2 * 256, hidden=64, top_k=2, ep=2, dtype_bytes=2, experts=8)
    expected = {phase: sum(collective_seconds(hw, "all_to_all", e.bytes, 2, ranks_per_domain=domain_ranks(2, 1, hw))
                           for e in exchanges if e.phase == phase) for phase in ("F", "I")}
    assert priced.f - unpriced.f == pytest.approx(expected["F"], rel=1e-9)
    assert priced.i - unpriced.i == pytest.approx(expected["I"], rel=1e-9)
    assert priced.w == unpriced.w and expected["F"] > 0
