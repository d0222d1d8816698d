"""The job options of what a framework does (attention kernel, gradient overlap): attention with its scores in
HBM (:func:`pipeloom.plan.cluster.efficiency.materialized_attention_seconds`) against its closed form,
FlashAttention-2, an exposed gradient all-reduce."""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.cluster.counts import model_params
from pipeloom.plan.cluster.efficiency import (
    attention_seconds,
    collective_seconds,
    gemm_seconds,
    materialized_attention_seconds,
    memory_seconds,
)
from pipeloom.plan.cluster.elementwise import layer_elementwise
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.errors import LayoutError

GPT = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 2048}


def test_closed_form_forward_and_backward():
    hw = hardware("a100-80gb")
    b, heads, s, d = 2, 4, 2048, 64
    e = b * heads * s * s
    qk = gemm_seconds(hw, s, s, d, count=b * heads)
    pv = gemm_seconds(hw, s, d, s, count=b * heads)
    forward = qk + pv + memory_seconds(hw, 4 * e) + memory_seconds(hw, 5 * e)
    backward = qk + 3 * pv + memory_seconds(hw, 5 * e) + memory_seconds(hw, 6 * e)
    assert materialized_attention_seconds(hw, batch=b, heads=heads, seq=s, head_dim=d) == pytest.approx(forward)
    assert materialized_attention_seconds(hw, batch=b, heads=heads, seq=s, head_dim=d,
                                          backward=True) == pytest.approx(backward)
    assert materialized_attention_seconds(hw, batch=0, heads=heads, seq=s, head_dim=d) == 0.0


def test_slower_than_flash_attention_at_long_sequences():
    hw = hardware("h100")
    for backward in (False, True):
        flash = attention_seconds(hw, batch=1, heads=32, seq=8192, head_dim=128, backward=backward)
        assert materialized_attention_seconds(hw, batch=1, heads=32, seq=8192, head_dim=128,
                                              backward=backward) > 2 * flash


def test_layer_times_use_it_and_the_api_names_bad_values():
    job = Job(spec=model_spec(GPT), hw=hardware("a100-80gb"), gpus=8, global_batch=8, seq=2048)
    layout = Layout(dp=8, mbs=1, recompute="none", schedule="1f1b")
    flash = layer_times(job, layout, "dense")
    scores = layer_times(dataclasses.replace(job, attention="materialized"), layout, "dense")
    assert scores.f > flash.f and scores.i > flash.i and scores.w == flash.w
    with pytest.raises(LayoutError, match="flash"):
        plan_cluster(GPT, "a100-80gb", gpus=8, global_batch=8, seq=2048, attention="unfused")
    with pytest.raises(LayoutError, match="eager"):
        plan_cluster(GPT, "a100-80gb", gpus=8, global_batch=8, seq=2048, kernels="compiled")


@pytest.mark.parametrize(("tp", "cp", "mbs"), [(1, 1, 1), (2, 1, 2), (1, 2, 1)])
def test_the_scores_the_backward_reads_are_held_unless_the_core_runs_again(tp, cp, mbs):
    """Oracle: Korthikanti et al. 2022's 5 a s^2 b bytes per layer with the scores in HBM (softmax output, dropout
    mask and output), a / tp heads and s / cp query rows on a GPU; none kept under full recomputation or with the
    attention core recomputed (selective), where one layer's are held while it runs again (buffers). A new user's
    plan at 8,192 tokens had fit in 75 GiB without them (they come to 320 GiB there)."""
    job = Job(spec=model_spec(GPT), hw=hardware("a100-80gb"), gpus=8, global_batch=8, seq=2048)
    scores = 5 * (4 // tp) * (2048 // cp) * mbs * 2048
    held = {}
    for attention in ("flash", "materialized"):
        estimator = Estimator(dataclasses.replace(job, attention=attention))
        for recompute in ("none", "selective", "full"):
            layout = Layout(dp=8 // (tp * cp), tp=tp, cp=cp, mbs=mbs, recompute=recompute, schedule="1f1b")
            memory = estimator.estimate(layout).memory
            held[attention, recompute] = (estimator.activation(layout, "dense"), memory.buffers)
    assert held["materialized", "none"][0] - held["flash", "none"][0] == scores
    assert held["materialized", "selective"][0] == held["flash", "selective"][0]
    assert held["materialized", "full"][0] == held["flash", "full"][0]
    assert held["materialized", "selective"][1] - held["flash", "selective"][1] == pytest.approx(
        held["materialized", "none"][0] - held["materialized", "selective"][0])  # one layer's, rebuilt
    assert held["materialized", "full"][1] - held["flash", "full"][1] == scores  # one layer's "none", scores with it


def test_flash2_runs_the_attention_core_slower_by_the_gpus_ratio():
    spec = model_spec({"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 4, "intermediate_size": 1024, "vocab_size": 100})
    layout = Layout(dp=8, mbs=1, recompute="none", schedule="1f1b")
    for name, ratio in (("h100", 1.7), ("a100-80gb", 1.0)):
        hw = hardware(name)
        assert hw.flash2_slowdown == ratio and "flash2_slowdown" in hw.sources
        job = Job(spec=spec, hw=hw, gpus=8, global_batch=8, seq=8192)
        best, fa2 = layer_times(job, layout, "dense"), layer_times(dataclasses.replace(job, attention="flash2"),
                                                                    layout, "dense")
        kw = {"batch": 1, "heads": 4, "seq": 8192, "head_dim": 128}
        slow = dataclasses.replace(hw, attention_efficiency=hw.attention_efficiency / ratio,
                                   attention_backward_efficiency=hw.attention_backward_efficiency / ratio)
        assert fa2.f - best.f == pytest.approx(attention_seconds(slow, **kw) - attention_seconds(hw, **kw))
        assert fa2.i - best.i == pytest.approx(attention_seconds(slow, backward=True, **kw)
                                               - attention_seconds(hw, backward=True, **kw))


def test_gradient_all_reduce_after_the_backward_is_exposed_whole():
    spec = model_spec({"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
                       "num_key_value_heads": 8, "intermediate_size": 4096, "vocab_size": 1000})
    job = Job(spec=spec, hw=hardware("a100-80gb"), gpus=64, global_batch=64, seq=2048)
    layout = Layout(dp=64, mbs=1, recompute="none", schedule="1f1b")
    overlapped = Estimator(job).estimate(layout)
    after = Estimator(dataclasses.replace(job, overlap_grad_reduce=False)).estimate(layout)
    # the whole reduce-scatter + all-gather (a ring all-reduce) of the bf16 gradients over the 64 ranks
    params = model_params(spec)
    rs = collective_seconds(job.hw, "reduce_scatter", 2.0 * params, 64, ranks_per_domain=8)
    ag = collective_seconds(job.hw, "all_gather", 2.0 * params, 64, ranks_per_domain=8)
    assert after.exposed_dp == pytest.approx(rs + ag)
    assert after.exposed_dp > overlapped.exposed_dp
    assert after.pipeline_time == overlapped.pipeline_time


def test_torchtitan_op_policy_recomputes_every_second_matmul_and_the_elementwise_ops():
    spec = model_spec({"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
                       "num_key_value_heads": 2, "intermediate_size": 4096, "vocab_size": 100})
    hw = hardware("h100")
    job = Job(spec=spec, hw=hw, gpus=8, global_batch=8, seq=4096, selective="op")
    none = layer_times(job, Layout(dp=8, mbs=1, recompute="none", schedule="1f1b"), "dense")
    op = layer_times(job, Layout(dp=8, mbs=1, recompute="selective", schedule="1f1b"), "dense")
    # wk (1024 -> 2 x 128), wo (1024 -> 1024), w3 (1024 -> 4096) again on the 4096 tokens, plus the forward's
    # elementwise kernels; the attention core is saved (not recomputed)
    again = sum(gemm_seconds(hw, 4096, n, k) for n, k in ((256, 1024), (1024, 1024), (4096, 1024)))
    ew = layer_elementwise(spec, "dense")
    ew_f = memory_seconds(hw, ew.f_bytes * 4096) + (ew.f_kernels - 1) * hw.kernel_overhead
    assert op.i - none.i == pytest.approx(again + ew_f)
    assert op.f == none.f and op.w == none.w
    layer = layer_times(dataclasses.replace(job, selective="layer"),
                        Layout(dp=8, mbs=1, recompute="selective", schedule="1f1b"), "dense")
    assert layer.i - none.i == pytest.approx(none.f / 2)  # every second layer's forward again, on average
    with pytest.raises(LayoutError, match="torchtitan"):
        plan_cluster(GPT, "a100-80gb", gpus=8, global_batch=8, seq=2048, selective="layers")


def test_without_sequence_parallelism_every_tp_rank_runs_the_norms_on_all_tokens():
    """Megatron-LM before sequence parallelism: the residual stream's elementwise work is not divided by tp, the
    activations of the norms are kept whole, and the tp exchanges are all-reduces of the same hidden bytes."""
    spec = model_spec(GPT)
    hw = hardware("a100-80gb")
    layout = Layout(dp=1, tp=4, mbs=2)
    sp_job = Job(spec=spec, hw=hw, gpus=4, global_batch=2, seq=2048)
    plain = dataclasses.replace(sp_job, sequence_parallel=False)
    tokens, hidden = 2 * 2048, 2 * 2048 * 256 * 2
    split, whole = (layer_elementwise(spec, "dense", tp=4, sp=sp) for sp in (True, False))
    assert whole.f_bytes > split.f_bytes and whole.b_bytes > split.b_bytes
    a, b = layer_times(sp_job, layout, "dense"), layer_times(plain, layout, "dense")
    sp_comm = 2 * (collective_seconds(hw, "all_gather", hidden, 4, ranks_per_domain=4)
                   + collective_seconds(hw, "reduce_scatter", hidden, 4, ranks_per_domain=4))
    ar_comm = 2 * collective_seconds(hw, "all_reduce", hidden, 4, ranks_per_domain=4)
    extra_f = memory_seconds(hw, whole.f_bytes * tokens) - memory_seconds(hw, split.f_bytes * tokens)
    assert b.f - a.f == pytest.approx(extra_f + ar_comm - sp_comm, rel=1e-9)
    assert b.w == a.w
    assert Estimator(plain).activation(layout, "dense") > Estimator(sp_job).activation(layout, "dense")
    no_tp = dataclasses.replace(layout, tp=1, dp=4)
    assert layer_times(sp_job, no_tp, "dense") == layer_times(plain, no_tp, "dense")  # nothing to shard without tp
