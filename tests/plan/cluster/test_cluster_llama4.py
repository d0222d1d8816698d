"""Llama 4 in the cluster planner: chunked attention on its rotary layers, NoPE layers, weightless q/k norms and a
top-k MoE (the counts per layer kind against transformers are in test_params, test_flops and test_activations)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tests.plan.cluster.tiny import TINY, local_layers

from pipeloom.cli import main
from pipeloom.plan.cluster import ModelConfigError, model_spec
from pipeloom.plan.cluster.counts import attended_fraction, layer_counts, model_params
from pipeloom.plan.cluster.efficiency import attention_seconds
from pipeloom.plan.cluster.elementwise import layer_elementwise
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.kinds import layer_kinds

# Llama 4 Maverick's language model: Scout's (transformers' defaults) with 128 experts on every second layer and no
# q/k norm (meta-llama/Llama-4-Maverick-17B-128E's text_config)
MAVERICK = dict(model_type="llama4_text", num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False)


def _tiny_model(**overrides):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("llama4_text", **{**TINY["llama4_text"], **overrides})
    torch.manual_seed(0)
    return config, transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("overrides", [{}, dict(no_rope_layer_interval=3, moe_layers=None,
                                                interleave_moe_layer_step=2),
                                       dict(no_rope_layers=[1, 1, 0, 1]), dict(attention_chunk_size=None)])
def test_chunked_and_nope_layers_are_transformers_own(overrides):
    config, model = _tiny_model(**overrides)
    chunked = local_layers(model)
    nope = tuple(n for n, layer in enumerate(model.model.layers) if not layer.self_attn.use_rope)
    moe = tuple(n for n, layer in enumerate(model.model.layers) if layer.is_moe_layer)
    assert nope  # every case has NoPE layers
    for source in (config, config.to_dict(), dict(TINY["llama4_text"], model_type="llama4_text", **overrides)):
        spec = model_spec(source)
        assert (spec.window_layers, spec.nope_layers, spec.moe_layers) == (chunked, nope, moe), type(source)
        assert spec.chunked == bool(chunked) and spec.window == (8 if chunked else 0)
    assert model_params(spec) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("seq, chunk", [(16, 4), (16, 5), (16, 16), (16, 40), (64, 1), (33, 7)])
def test_chunked_fraction_is_the_mask_less_half_its_diagonal(seq, chunk):
    """transformers' chunked causal mask keeps each chunk's triangle with its diagonal, ``c²/2 + c/2`` pairs per whole
    chunk: the fraction is that count less half the diagonal's ``s`` pairs, as for the triangle and the band."""
    torch = pytest.importorskip("torch")
    masking = pytest.importorskip("transformers.masking_utils")
    allowed = masking.chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long))
    q, k = (torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1))
    kept = int(allowed(torch.tensor(0), torch.tensor(0), q, k).sum())
    assert attended_fraction(seq, chunk, chunked=True) * seq * seq == pytest.approx(kept - seq / 2)
    assert attended_fraction(seq, chunk, chunked=True) <= attended_fraction(seq, chunk)  # a chunk sees fewer keys


def test_published_sizes_are_the_language_models():
    """Scout (transformers' defaults) and Maverick: 107.77 B and 400.71 B parameters, the language models of
    transformers' classes (built on the meta device), 17.2 B of them active per token (Meta's model cards: 17 B
    active, 109 B and 400 B in all, the 109 B counting Scout's vision encoder too)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for fields, total in ((dict(model_type="llama4_text"), 107_769_861_120), (MAVERICK, 400_711_848_960)):
        spec = model_spec({"model_type": "llama4", "text_config": fields})
        assert spec.text_of == "llama4" and model_params(spec) == total
        with torch.device("meta"):
            config = transformers.Llama4TextConfig(**{k: v for k, v in fields.items() if k != "model_type"})
            model = transformers.Llama4ForCausalLM(config)
        assert sum(p.numel() for p in model.parameters()) == total
        ex = spec.experts
        active = total - len(spec.moe_layers) * (ex.count - ex.top_k) * 3 * spec.hidden * ex.intermediate
        assert active == pytest.approx(17.2e9, rel=0.01)


def test_chunks_are_priced_on_their_triangles():
    hw = hardware("h100")
    shape = dict(batch=1, heads=40, seq=32768, head_dim=128)
    full, chunks = attention_seconds(hw, **shape), attention_seconds(hw, **shape, window=8192, chunked=True)
    band = attention_seconds(hw, **shape, window=8192)
    assert full / chunks == pytest.approx(attended_fraction(32768) / attended_fraction(32768, 8192, chunked=True)
                                          * (8192 / (8192 + hw.attention_half_seq))
                                          / (32768 / (32768 + hw.attention_half_seq)), rel=1e-3)
    assert chunks < band < full
    assert attention_seconds(hw, **shape, window=32768, chunked=True) == full


def test_layer_kinds_price_their_attention_rotary_and_norms():
    spec = model_spec({"model_type": "llama4", "text_config": {"model_type": "llama4_text"}})  # Scout
    kinds = layer_kinds(spec)
    assert kinds[:4] == ("moe-window",) * 3 + ("moe-nope",) and len(set(kinds)) == 2
    job = Job(spec=spec, hw=hardware("h100"), gpus=64, global_batch=64, seq=32768)
    layout = Layout(dp=8, tp=8, mbs=1, recompute="selective", schedule="1f1b")
    chunked, nope = layer_times(job, layout, "moe-window"), layer_times(job, layout, "moe-nope")
    assert chunked.f < nope.f and chunked.i < nope.i and chunked.w == nope.w  # chunks of 8K against all 32K keys
    counts = {kind: layer_counts(spec, kind, 4096) for kind in kinds}
    a = spec.attention
    norms = (a.heads + a.kv_heads) * (2 * a.qk_dim + 4)  # the q/k norms' inputs (bf16) and 1/rms per head
    assert counts["moe-window"].activations["none"].tensor - counts["moe-nope"].activations["none"].tensor == norms
    assert counts["moe-window"].params == counts["moe-nope"].params  # the norms are weightless
    assert counts["moe-window"].attended_f == counts["moe-nope"].attended_f  # 4K tokens: one chunk
    long = {kind: layer_counts(spec, kind, 16384) for kind in kinds}  # two chunks of 8K: half the triangle
    assert long["moe-window"].attended_f * 2 == long["moe-nope"].attended_f == long["moe-nope"].attention_f / 2
    rotary, none = (layer_elementwise(spec, "moe", rotary=r) for r in (True, False))
    assert rotary.f_bytes - none.f_bytes == 2 * 2 * (a.heads + a.kv_heads) * a.qk_dim  # q and k read and written
    without = dataclasses.replace(spec, attention=dataclasses.replace(a, qk_norm=False))  # Maverick's attention
    assert layer_counts(without, "moe-window", 4096).activations == counts["moe-nope"].activations


def test_bad_llama4_configs():
    with pytest.raises(ModelConfigError, match="no_rope_layers must give 1 .* for each of the 48 layers"):
        model_spec(dict(model_type="llama4_text", no_rope_layers=[1, 0]))
    with pytest.raises(ModelConfigError, match="attention_chunk_size must be a positive number"):
        model_spec(dict(model_type="llama4_text", attention_chunk_size=0, layer_types=["chunked_attention"] * 48))
    with pytest.raises(ModelConfigError, match=r"MoE layers \[1, 48\] are not all among the 48 layers"):
        model_spec(dict(model_type="llama4_text", moe_layers=[1, 48]))
    with pytest.raises(ModelConfigError, match="no_rope_layer_interval must be a positive whole number"):
        model_spec(dict(model_type="smollm3", no_rope_layer_interval=0))


def test_the_command_plans_a_llama4_checkpoint(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama4", "text_config": MAVERICK}))
    assert main(["plan", "--model", str(path), "--hardware", "h100", "--gpus", "256", "--global-batch", "256",
                 "--seq", "8192", "--layout", "tp=8,pp=4,ep=8,cp=1,mbs=1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "llama4_text" in header and "attention in chunks of 8,192 tokens on 36 of 48 layers" in header
    assert main(["plan", "--model", str(path), "--hardware", "h100", "--gpus", "256", "--global-batch", "256",
                 "--seq", "8192", "--layout", "tp=8,pp=4,ep=8,cp=1,mbs=1", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["chunked_attention"] and model["nope_layers"] == list(range(3, 48, 4))
    assert model["params"] == 400_711_848_960 and model["experts"] == 128


def test_smollm3_nope_layers_are_transformers_own():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(TINY["smollm3"], num_hidden_layers=4, no_rope_layer_interval=2)
    config = transformers.AutoConfig.for_model("smollm3", **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    nope = tuple(n for n, layer in enumerate(model.model.layers) if not layer.self_attn.use_rope)
    assert nope == (1, 3)
    for source in (config, dict(fields, model_type="smollm3")):
        spec = model_spec(source)
        assert spec.nope_layers == nope and layer_kinds(spec) == ("dense", "dense-nope") * 2


def test_a_saved_plan_keeps_llama4_experts_whole(tmp_path, capsys):
    """transformers' Llama 4 has no top-k experts interface for the runtime's ep to dispatch to: a plan with ep is
    refused with the fix, and the plan without says the runtime computes every expert on every token."""
    path, plan = tmp_path / "config.json", tmp_path / "plan.json"
    path.write_text(json.dumps({"model_type": "llama4", "text_config": {"model_type": "llama4_text"}}))
    job = ["plan", "--model", str(path), "--hardware", "h200", "--gpus", "256", "--global-batch", "512", "--seq",
           "8192", "--save", str(plan)]
    assert main([*job, "--layout", "tp=1,cp=1,recompute=none,ep=8"]) == 2
    assert "ep=8 on llama4_text (transformers' model runs every expert on every token" in capsys.readouterr().err
    assert not plan.exists()
    assert main([*job, "--layout", "tp=1,cp=1,pp=16,recompute=none,ep=1,fsdp=1"]) == 0
    out = capsys.readouterr().out
    assert "transformers' llama4_text runs every expert on every token, 16x" in out
    assert f"wrote plan {plan} (pipeline(model, plan=...) runs it, not as planned: see the notes)" in out
    assert json.loads(plan.read_text())["split_points"][0].startswith("model.layers.")
