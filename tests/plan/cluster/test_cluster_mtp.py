"""DeepSeek-V3's multi-token-prediction (MTP) module: read from ``num_nextn_predict_layers``, counted by hand,
priced on the last pipeline stage with the head, and absent with ``num_nextn_predict_layers: 0``; a DeepSeek-V3
config that leaves the field out takes transformers' default, one module (DeepSeek-V2 has none).

transformers' DeepseekV3 model does not build the MTP layers (its config carries the field, its model ignores
it), so there is no transformers reference to count against: the counts are checked against the formula of
the report's sec. 2.2 written out here (two RMSNorms, the 2h -> h projection, one MoE block, the shared
head's final norm; the head's matmul runs again for the second loss)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.plan.cluster.counts import layer_counts, mtp_activations
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.cluster.mtp import mtp_times
from pipeloom.plan.cluster.recompute import deepseek_activations
from pipeloom.plan.cluster.step import add_times
from pipeloom.plan.errors import LayoutError, ModelConfigError

H, HEADS, Q_RANK, KV_RANK, ROPE, NOPE, V, EXPERTS, TOP_K, MOE_I, VOCAB = 64, 4, 24, 16, 8, 16, 12, 4, 2, 24, 128
TINY_V3 = {"model_type": "deepseek_v3", "hidden_size": H, "intermediate_size": 96, "num_hidden_layers": 3,
           "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "vocab_size": VOCAB, "q_lora_rank": Q_RANK,
           "kv_lora_rank": KV_RANK, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE, "v_head_dim": V,
           "n_routed_experts": EXPERTS, "n_shared_experts": 1, "moe_intermediate_size": MOE_I,
           "first_k_dense_replace": 1, "num_experts_per_tok": TOP_K, "n_group": 1, "topk_group": 1,
           "num_nextn_predict_layers": 1}
WITHOUT = {**TINY_V3, "num_nextn_predict_layers": 0}
MISSING = {k: v for k, v in TINY_V3.items() if k != "num_nextn_predict_layers"}
SEQ = 16


def test_read_from_the_config_only_where_it_is():
    assert model_spec(TINY_V3).mtp == 1
    assert model_spec(WITHOUT).mtp == 0
    assert model_spec(MISSING).mtp == 1  # transformers' DeepseekV3Config default
    assert model_spec({**MISSING, "model_type": "deepseek_v2"}).mtp == 0
    with pytest.raises(ModelConfigError, match="num_nextn_predict_layers"):
        model_spec({**TINY_V3, "num_nextn_predict_layers": -1})


def test_params_and_flops_by_hand():
    spec = model_spec(TINY_V3)
    # MLA: q down (+ its norm), q up, kv down (latent + rotary key, + the latent's norm), kv up, output
    attention_mm = H * Q_RANK + Q_RANK * HEADS * (NOPE + ROPE) + H * (KV_RANK + ROPE) + KV_RANK * HEADS * (NOPE + V) \
        + HEADS * V * H
    attention = attention_mm + Q_RANK + KV_RANK
    routed = EXPERTS * 3 * H * MOE_I
    moe = H * EXPERTS + routed + 3 * H * MOE_I  # router, routed experts, one shared expert
    block = attention + moe + 2 * H  # + its two RMSNorms
    params = 2 * H * H + 3 * H + block  # eh_proj, enorm + hnorm + shared_head.norm, the block
    mtp = layer_counts(spec, "mtp", SEQ)
    assert mtp.params == params == 42088
    assert mtp.expert_params == routed
    # per token: the block's matmuls (its top-k experts), the projection, the shared head
    per_token = attention_mm + H * EXPERTS + 3 * H * MOE_I + TOP_K * 3 * H * MOE_I + 2 * H * H + H * VOCAB
    core = 2 * SEQ * SEQ * HEADS * (NOPE + ROPE + V)  # QK^T and PV over the full square
    assert mtp.f == 2 * SEQ * per_token + core
    assert mtp.i == 2 * SEQ * per_token + 2 * core
    assert mtp.w == 2 * SEQ * per_token
    assert mtp.attention_f == core


def test_activations_by_mode():
    spec = model_spec(TINY_V3)
    mtp, block, head = (layer_counts(spec, kind, SEQ) for kind in ("mtp", "moe", "head"))
    for mode in ("none", "selective"):  # two norms' inputs and outputs (bf16) and 1/rms (fp32)
        a, b = mtp.activations[mode], block.activations[mode]
        assert a.sequence == 2 * 4 * H + 2 * 4 + b.sequence + head.activations[mode].sequence
        assert a.tensor == b.tensor + 4 * VOCAB
        assert a.replicated == b.replicated
    full = mtp.activations["full"]  # the module's two inputs, the block's input, the head's
    assert full.sequence == 2 * 2 * H + 2 * H + head.activations["full"].sequence
    assert full.tensor == 4 * VOCAB


def _job(config, **options):
    return Job(spec=model_spec(config), hw=hardware("h100"), gpus=2, global_batch=8, seq=SEQ, **options)


def test_without_the_field_nothing_changes():
    layouts = [Layout(dp=2, ep=2), Layout(pp=2, schedule="1f1b", recompute="selective"),
               Layout(pp=2, schedule="zb-h1")]
    for layout in layouts:
        off = Estimator(_job(WITHOUT)).estimate(layout)
        on = Estimator(_job(TINY_V3)).estimate(layout)
        assert Estimator(_job(MISSING)).estimate(layout) == on
        assert on.step_time > off.step_time
        assert on.tokens_per_gpu_per_second < off.tokens_per_gpu_per_second


@pytest.mark.parametrize("selective", ["core_attn", "deepseek"])
def test_last_stage_holds_the_module(selective):
    dtype = "fp8" if selective == "deepseek" else "bf16"  # DeepSeek's caching is part of its FP8 training
    # sends beside the compute: the stages' times are their layers' (Megatron-Core's 1F1B would add its blocking sends)
    on, off = (Estimator(_job(config, selective=selective, dtype=dtype, blocking_1f1b=False))
               for config in (TINY_V3, WITHOUT))
    layout = Layout(pp=2, schedule="1f1b", recompute="selective")
    mtp = mtp_times(on.job, layout)
    expected = add_times(*(layer_times(on.job, layout, k) for k in ("embedding", "moe", "head")))
    assert mtp.f > expected.f and mtp.i > expected.i and mtp.w > expected.w  # + the norms and the projection
    assert mtp.f_comm == expected.f_comm
    (t_on, a_on, layers_on), (t_off, a_off, layers_off) = on.stages(layout), off.stages(layout)
    assert layers_on == layers_off
    assert t_on[0] == t_off[0] and a_on[0] == a_off[0]
    assert layers_off[1] == ("moe",)  # without the module the last stage is its layer and the head
    head = add_times(*(layer_times(on.job, layout, k) for k in ("moe", "head")))
    for stage, expected in ((t_off[1], head), (t_on[1], add_times(t_off[1], mtp))):
        assert dataclasses.astuple(stage)[:5] == pytest.approx(dataclasses.astuple(expected)[:5])  # f i w f_comm i_comm
        assert dict(stage.parts) == pytest.approx(dict(expected.parts))
    block = (deepseek_activations(on.job.spec, "moe") if selective == "deepseek"
             else layer_counts(on.job.spec, "moe", SEQ).activations["selective"])
    keep = mtp_activations(on.job.spec, "selective", block)
    assert a_on[1] - a_off[1] == pytest.approx(keep.per_gpu(tp=1, cp=1, sp=False) * SEQ)


def test_memory_and_model_flops_count_the_module():
    on, off = Estimator(_job(TINY_V3)), Estimator(_job(WITHOUT))
    layout = Layout(dp=2)
    mtp = layer_counts(on.job.spec, "mtp", SEQ)
    a, b = on.estimate(layout), off.estimate(layout)
    assert a.memory.weights - b.memory.weights == 2.0 * mtp.params
    assert a.memory.gradients - b.memory.gradients == 2.0 * mtp.params
    assert a.memory.optimizer - b.memory.optimizer == pytest.approx(12.0 * mtp.params / 2)
    assert on.model_flops - off.model_flops == pytest.approx(8 * mtp.model_flops)
    # the search's total work adds the module once
    assert on.total_work(layout) - off.total_work(layout) == pytest.approx(
        sum(dataclasses.astuple(mtp_times(on.job, layout))[:3]))


def test_layer_times_refuses_the_module():
    with pytest.raises(LayoutError, match="mtp"):
        layer_times(_job(TINY_V3), Layout(dp=2), "mtp")
