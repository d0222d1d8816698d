"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE, OLMo hybrid) in the cluster planner: which layers are
linear attention, what such a layer counts and costs (its chunked kernel, its all-to-alls under context
parallelism), the heads tensor and context parallelism must split, the output gate of the attention layers, and what
the command says and saves. Parameters, FLOPs and saved tensors against transformers are in test_params, test_flops and
test_activations (their tiny instances)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tests.plan.cluster.tiny import TINY

from pipeloom.cli import main
from pipeloom.plan.cluster import model_spec
from pipeloom.plan.cluster.counts import layer_counts
from pipeloom.plan.cluster.efficiency import collective_seconds, domain_ranks
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.mixers import GDN_BACKWARD_EFFICIENCY, GDN_EFFICIENCY, gdn_core_seconds
from pipeloom.plan.cluster.model.deltanet import gdn_core_flops
from pipeloom.plan.cluster.model.kinds import LINEAR, block_kind, is_linear, layer_kinds
from pipeloom.plan.errors import LayoutError, ModelConfigError

NEXT = {"model_type": "qwen3_next"}  # transformers' defaults: Qwen3-Next-80B-A3B's sizes
LAYOUT = Layout(dp=8, mbs=1, recompute="none", schedule="1f1b")


def test_the_linear_layers_are_those_layer_types_marks():
    """Three of every ``full_attention_interval`` (4) layers by default, as transformers' configurations derive them,
    or as ``layer_types`` gives them; Qwen3-Next's MLP by Qwen2-MoE's rules, Qwen3.5-MoE's on every layer, Qwen3.5's
    dense; a multimodal Qwen3.5 config plans its language model."""
    spec = model_spec(NEXT)
    assert spec.linear_layers == tuple(n for n in range(48) if n % 4 != 3)
    assert layer_kinds(spec)[:4] == ("moe" + LINEAR, "moe" + LINEAR, "moe" + LINEAR, "moe")
    assert model_spec(dict(NEXT, full_attention_interval=2)).linear_layers == tuple(range(0, 48, 2))
    given = model_spec(dict(TINY["qwen3_next"], model_type="qwen3_next"))
    assert given.linear_layers == (0, 2) and given.moe_layers == (0, 2, 3)  # mlp_only_layers [1]
    assert layer_kinds(given) == ("moe" + LINEAR, "dense", "moe" + LINEAR, "moe")
    dense = model_spec({"model_type": "qwen3_5_text"})
    assert dense.experts is None and set(map(block_kind, layer_kinds(dense))) == {"dense"}
    moe = model_spec({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}})
    assert moe.text_of == "qwen3_5_moe" and moe.moe_layers == tuple(range(40)) and len(moe.linear_layers) == 30


def test_olmo_hybrid_reads_as_transformers_derives_it():
    """OLMo hybrid: attention on every fourth layer (the last where there are fewer than four), OLMo 3's (q and k
    norms over the whole projections, no output gate) with a dense MLP; its Gated DeltaNet's sizes, where left out,
    derived from the attention's heads as ``OlmoHybridConfig`` derives them (Olmo-Hybrid-7B: 30 heads of 96 / 192);
    its write strength doubled unless ``linear_allow_neg_eigval`` is false, which keeps one more scalar per value
    head and token (the kernel's doubled copy beside the sigmoid's output) and changes nothing else."""
    spec = model_spec({"model_type": "olmo_hybrid"})
    g, a = spec.linear, spec.attention
    assert (g.key_heads, g.value_heads, g.key_dim, g.value_dim, g.conv_kernel) == (30, 30, 96, 192, 4)
    assert g.negative_eigenvalues and spec.experts is None and spec.linear_layers == tuple(
        n for n in range(32) if n % 4 != 3)
    assert a.qk_norm_full and not a.output_gate and (a.heads, a.kv_heads, a.qk_dim) == (30, 30, 128)
    assert model_spec({"model_type": "olmo_hybrid", "num_hidden_layers": 2}).linear_layers == (0,)
    assert model_spec({"model_type": "olmo_hybrid", "hidden_size": 2048, "num_attention_heads": 16,
                       "linear_num_key_heads": 8}).linear == dataclasses.replace(g, key_heads=8, value_heads=16,
                                                                                  key_dim=192, value_dim=384)
    plain = model_spec({"model_type": "olmo_hybrid", "linear_allow_neg_eigval": False})
    assert plain == dataclasses.replace(spec, linear=dataclasses.replace(g, negative_eigenvalues=False))
    doubled, single = (layer_counts(s, "dense" + LINEAR, 4096, width=2) for s in (spec, plain))
    for mode in ("none", "selective"):
        kept = [c.activations[mode].per_gpu(tp=1, cp=1, sp=False) for c in (doubled, single)]
        assert kept[0] - kept[1] == 2 * g.value_heads
    assert doubled.activations["full"] == single.activations["full"]
    assert (doubled.f, doubled.i, doubled.w, doubled.params) == (single.f, single.i, single.w, single.params)


@pytest.mark.parametrize(("fields", "match"), [
    ({"layer_types": ["linear_attention", "sliding_attention"] * 24}, "layer_types must give"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types gives 3 entries for num_hidden_layers"),
    ({"linear_num_value_heads": 24}, "multiple of linear_num_key_heads"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim must be positive"),
])
def test_a_bad_gated_deltanet_config_is_refused(fields, match):
    with pytest.raises(ModelConfigError, match=match):
        model_spec(dict(NEXT, **fields))


def test_a_linear_layer_counts_its_mixer_in_place_of_attention():
    """Against the same layer with attention: its own projections and convolution in the parameters, the chunked
    rule's FLOPs (the backward twice the forward's) and the convolution's in F, I and W, none of the attention
    core's; its kept bytes its own, the same under selective (Megatron-Core checkpoints no part of it), only the
    layer's input under full."""
    spec = model_spec(NEXT)
    g, seq = spec.linear, 4096
    linear, attention = layer_counts(spec, "moe" + LINEAR, seq), layer_counts(spec, "moe", seq)
    assert linear.attention_f == linear.attended_f == 0 and attention.attention_f > 0
    a, h = spec.attention, spec.hidden
    mixer = h * (2 * g.keys + 2 * g.values + 2 * g.value_heads) + g.values * h
    attn = h * (2 * a.heads * a.qk_dim + 2 * a.kv_heads * a.qk_dim) + a.heads * a.v_dim * h  # q and its gate, k, v, o
    conv = 2.0 * g.mixed * seq * g.conv_kernel
    assert linear.w - attention.w == 2.0 * seq * (mixer - attn) + conv
    assert linear.params - attention.params == (mixer - attn) + g.mixed * g.conv_kernel + 2 * g.value_heads \
        + g.value_dim - 2 * a.qk_dim  # the convolution, dt_bias, A_log, the gated norm; no q/k norms
    core = gdn_core_flops(spec, seq)
    assert core == 2.0 * 32 * seq * (2 * 64 * 128 + 64 * 128 + 3 * 128 * 128)
    assert linear.f - linear.w == pytest.approx(core)
    assert linear.i - linear.w == pytest.approx(2 * core)
    none, selective, full = (linear.activations[m] for m in ("none", "selective", "full"))
    assert none == selective and full.per_gpu(tp=1, cp=1, sp=False) == 2 * spec.hidden
    assert none.per_gpu(tp=2, cp=2, sp=True) == pytest.approx(none.per_gpu(tp=1, cp=1, sp=False) / 4)
    assert gdn_core_flops(spec, 100) == gdn_core_flops(spec, 128)  # whole chunks of 64


def test_the_attention_layers_output_gate_widens_the_q_projection():
    spec = model_spec(NEXT)
    plain = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, output_gate=False))
    a = spec.attention
    gated, ungated = layer_counts(spec, "moe", 4096), layer_counts(plain, "moe", 4096)
    assert gated.params - ungated.params == spec.hidden * a.heads * a.v_dim
    assert gated.w - ungated.w == 2.0 * 4096 * spec.hidden * a.heads * a.v_dim
    kept = gated.activations["none"].tensor - ungated.activations["none"].tensor
    assert kept == 2 * 2 * a.heads * a.v_dim  # the gate, and the gated output the projection reads


def test_the_chunked_kernel_runs_at_the_measured_rate():
    """fla's benchmark run the rates come from (GB200: 4 x 4,096 tokens, 64 heads of 128: forward 1.581 ms, forward
    and backward 5.964 ms) priced back within 1.5 % (the kernels' launch overheads beside); on an H100 the same
    fraction of its peak."""
    spec = dataclasses.replace(model_spec(NEXT), linear=dataclasses.replace(model_spec(NEXT).linear, key_heads=64,
                                                                             value_heads=64))
    job = Job(spec=spec, hw=hardware("gb200"), gpus=8, global_batch=32, seq=4096)
    forward, backward = gdn_core_seconds(job, Layout(dp=8, mbs=4, recompute="none", schedule="1f1b"))
    assert forward == pytest.approx(1.581e-3, rel=0.015) and forward + backward == pytest.approx(5.964e-3, rel=0.015)
    h100 = gdn_core_seconds(dataclasses.replace(job, hw=hardware("h100")), Layout(dp=8, mbs=4, recompute="none",
                                                                                   schedule="1f1b"))
    assert h100[0] == pytest.approx(forward * 2.5e15 / 989.4e12, rel=0.02)
    assert 0 < GDN_BACKWARD_EFFICIENCY < GDN_EFFICIENCY < 0.1


def test_a_linear_layer_is_cheaper_than_attention_at_long_sequences(monkeypatch):
    """No s² term: at 4K tokens a Gated DeltaNet layer of Qwen3-Next costs about what its attention layer does, at
    128K far less; tensor and context parallelism divide its kernel's work, context parallelism adds its all-to-alls
    (both passes) where Megatron-Core's ring passes K/V for attention."""
    spec = model_spec(NEXT)
    for seq, ratio in ((4096, 2.0), (131072, 0.25)):
        job = Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=8, seq=seq)
        linear, attention = (layer_times(job, LAYOUT, kind) for kind in ("moe" + LINEAR, "moe"))
        assert linear.f + linear.i < ratio * (attention.f + attention.i), seq
    job = Job(spec=spec, hw=hardware("h100"), gpus=16, global_batch=16, seq=32768)
    one, two = (Layout(dp=16 // cp, cp=cp, mbs=1, recompute="none", schedule="1f1b") for cp in (1, 2))
    assert gdn_core_seconds(job, two)[0] == pytest.approx(gdn_core_seconds(job, one)[0] / 2, rel=0.01)
    g, tokens = spec.linear, 32768 // 2
    exchange = sum(collective_seconds(job.hw, "all_to_all", 2.0 * tokens * width, 2,
                                      ranks_per_domain=domain_ranks(2, 1, job.hw))
                   for width in (g.mixed + g.values + 2 * g.value_heads, g.values))
    split = layer_times(job, two, "moe" + LINEAR)
    monkeypatch.setattr("pipeloom.plan.cluster.layer_time.gdn_exchange_seconds", lambda *args: 0.0)
    without = layer_times(job, two, "moe" + LINEAR)
    assert exchange > 0 and split.f - without.f == pytest.approx(exchange)
    assert split.i - without.i == pytest.approx(exchange)  # the two the other way in the backward


def test_tensor_and_context_parallelism_split_whole_key_heads():
    """Megatron-Core gives each tp x cp rank whole Gated DeltaNet heads (16 key heads in Qwen3-Next): tp 2 x cp 16 is
    refused with why, and the search never tries it."""
    spec = model_spec(dict(NEXT, num_key_value_heads=32, num_attention_heads=32))
    job = Job(spec=spec, hw=hardware("h100"), gpus=64, global_batch=64, seq=8192)
    with pytest.raises(LayoutError, match="does not split Gated DeltaNet's 16 key heads"):
        Layout(dp=2, tp=2, cp=16, mbs=1, recompute="none", schedule="1f1b").check(job)
    Layout(dp=4, tp=2, cp=8, mbs=1, recompute="none", schedule="1f1b").check(job)


def test_the_command_says_which_layers_are_gated_deltanet(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(NEXT, num_hidden_layers=8, num_experts=64)))
    argv = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "16", "--global-batch", "32", "--seq",
            "4096"]
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("Gated DeltaNet on 6 of 8 layers (16 key and 32 value heads of 128 / 128), attention on "
                           "the others")
    assert main([*argv, "--json", "--layout", "cp=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["linear_attention"] == {"kind": "gated_deltanet", "key_heads": 16, "value_heads": 32,
                                                "key_dim": 128, "value_dim": 128, "conv_kernel": 4,
                                                "negative_eigenvalues": False, "layers": [0, 1, 2, 4, 5, 6]}
    assert out["best"]["layout"]["cp"] == 2
    path.write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["linear_attention"] is None


def test_every_layer_kind_of_the_hybrids_is_priced():
    for family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        spec = model_spec({"model_type": family})
        job = Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=8, seq=4096)
        for kind in set(layer_kinds(spec)):
            times = layer_times(job, LAYOUT, kind)
            assert times.f > 0 and times.i > 0 and times.w > 0 and is_linear(kind) == kind.endswith(LINEAR)


def test_a_saved_plan_says_which_lengths_the_runtime_runs(tmp_path, capsys):
    """pipeloom's runtime runs these models bitwise (tests/runtime/test_hf_models.py), its trace holding for the chunk
    count it traced at (tests/runtime/test_sizes.py): --save writes the plan and says so."""
    path, saved = tmp_path / "config.json", tmp_path / "plan.json"
    path.write_text(json.dumps(dict(NEXT, num_hidden_layers=8, num_experts=64)))
    argv = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "16", "--global-batch", "32", "--seq",
            "4096", "--layout", "cp=1", "--save", str(saved)]
    assert main(argv) == 0 and saved.exists()
    said = capsys.readouterr()
    assert ("note: transformers' gated delta rule loops over the sequence's 64-token chunks in Python: the runtime's "
            "trace holds for the chunk count of the batch it traces (64 at 4,096 tokens) and refuses other lengths "
            "(TracedSizeError)") in said.out + said.err


def test_torchtitans_op_policy_recomputes_the_attention_core_of_moe_layers_and_nothing_of_a_linear_one():
    """Under ``op`` (its rule is a dense layer's) an MoE layer recomputes its attention core, as ``core_attn`` does;
    a Gated DeltaNet layer, whose core is never checkpointed alone, recomputes nothing (Qwen3-Next's kinds)."""
    spec = model_spec(NEXT)
    selective = Layout(dp=8, mbs=1, recompute="selective", schedule="1f1b")
    times = {policy: {kind: layer_times(Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=8, seq=4096,
                                            selective=policy), selective, kind) for kind in ("moe", "moe" + LINEAR)}
             for policy in ("op", "core_attn")}
    plain = {kind: layer_times(Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=8, seq=4096), LAYOUT, kind)
             for kind in ("moe", "moe" + LINEAR)}
    assert times["op"]["moe"] == times["core_attn"]["moe"] and times["op"]["moe"].i > plain["moe"].i
    assert times["op"]["moe" + LINEAR].i == plain["moe" + LINEAR].i
