"""Parameter counts of the cluster planner's model spec against transformers' own tiny instances."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from tests.plan.cluster.tiny import TINY, tiny_config, tiny_model

from pipeloom.plan.cluster import ModelConfigError, model_params, model_spec
from pipeloom.plan.cluster.model.reader import TEXT_TYPES
from pipeloom.plan.cluster.model.source import FAMILY_DEFAULTS
from pipeloom.plan.cluster.step import optimizer_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", sorted(TINY))
def test_params_equal_transformers(family):
    config = tiny_config(family)
    torch.manual_seed(0)
    model = tiny_model(config)
    expected = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter: counted once
    assert model_params(model_spec(config)) == expected
    assert model_params(model_spec(config.to_dict())) == expected


_VL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000)
_VL_VISION = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64)


@pytest.mark.parametrize("name, text, vision, tie", [
    ("Qwen2VL", {}, {}, False),
    ("Qwen2_5_VL", {}, {}, True),  # Qwen2.5-VL-3B ties its head, at the top level
    ("Qwen3VL", {"head_dim": 16}, {"deepstack_visual_indexes": []}, False),
    ("Qwen3VLMoe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
     {"deepstack_visual_indexes": []}, False),
])
def test_qwen_vl_language_models_count_as_transformers_builds_them(name, text, vision, tie):
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's language models are read as the Qwen2, Qwen3 and Qwen3-MoE layers they
    are (``STAND_INS``): the parameters of the whole model's language model and head, its vision tower left out, as
    transformers builds them, from the config object and its config.json alike; the text config alone reads the same."""
    config = getattr(transformers, f"{name}Config")(text_config=dict(_VL_TEXT, **text),
                                                     vision_config=dict(_VL_VISION, **vision), tie_word_embeddings=tie)
    with torch.device("meta"):
        model = getattr(transformers, f"{name}ForConditionalGeneration")(config)
    expected = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual"))
    spec = model_spec(config.to_dict())
    assert model_params(spec) == expected and spec.text_of == config.model_type
    assert spec.family == {"Qwen2VL": "qwen2", "Qwen2_5_VL": "qwen2", "Qwen3VL": "qwen3"}.get(name, "qwen3_moe")
    assert model_params(model_spec(config)) == expected
    alone = dict(config.text_config.to_dict(), tie_word_embeddings=tie)
    assert model_params(model_spec(alone)) == expected and model_spec(alone).text_of == ""
    if name in ("Qwen2VL", "Qwen2_5_VL"):  # the hub's config.json: the language model's fields at the top level
        flat = {"model_type": config.model_type, "tie_word_embeddings": tie, **_VL_TEXT, **text}
        assert getattr(transformers, f"{name}Config")(**flat).text_config.hidden_size == _VL_TEXT["hidden_size"]
        assert model_params(model_spec(flat)) == expected
        # a pre-v5 save's tie inside text_config ties the whole model too (transformers forwards it)
        old = {"model_type": config.model_type, "text_config": dict(alone, tie_word_embeddings=True)}
        with torch.device("meta"):
            tied = getattr(transformers, f"{name}ForConditionalGeneration")(getattr(transformers, f"{name}Config")(
                text_config=dict(_VL_TEXT, tie_word_embeddings=True), vision_config=_VL_VISION))
        assert model_params(model_spec(old)) == sum(p.numel() for n, p in tied.named_parameters()
                                                    if not n.startswith("model.visual"))


def test_a_cohere2_head_dim_the_file_gives_is_the_models():
    """Cohere 2's config object derives head_dim = hidden / heads only where the file leaves it out."""
    data = dict(TINY["cohere2"], model_type="cohere2", head_dim=32)
    config = transformers.AutoConfig.for_model(**data)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model_spec(data).attention.qk_dim == config.head_dim == 32
    assert model_params(model_spec(data)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family, fields", [
    ("qwen3_moe", dict(shared_expert_intermediate_size=48)),  # Qwen3-MoE builds no shared expert: had been counted
    ("qwen2_moe", dict(shared_expert_intermediate_size=0)),  # its shared expert's gate stays: had been left out
    ("gpt_neox", dict(head_dim=24)),  # GPT-NeoX's heads are hidden / heads whatever head_dim says: had been read
    ("phi", dict(head_dim=24)),  # Phi's attention reads head_dim: had been left out
])
def test_fields_a_family_reads_or_ignores_count_as_transformers_builds_them(family, fields):
    """Found by a new user's trial (2026-12-06): the planner's count had followed a field the family's model
    ignores, or ignored one it reads."""
    data = dict(TINY[family], model_type=family, **fields)
    config = transformers.AutoConfig.for_model(**data)
    torch.manual_seed(0)
    model = tiny_model(config)
    assert model_params(model_spec(data)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("variant", [
    dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True),  # Falcon 7B: one norm, one kv head
    dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False),  # sequential, every head its kv
    dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1, bias=False),  # the new layout under one norm
], ids=["7b", "sequential", "new-one-norm"])
def test_falcon_layouts_count_as_transformers_builds_them(variant):
    """Parameters and norms as transformers builds each layout, and its keys and values: their share of the fused
    q/k/v projection's output."""
    data = dict(TINY["falcon"], model_type="falcon", **variant)
    config = transformers.AutoConfig.for_model(**data)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    spec = model_spec(data)
    assert model_params(spec) == sum(p.numel() for p in model.parameters())
    assert spec.layer_norms == len([m for m in model.transformer.h[0].modules() if isinstance(m, torch.nn.LayerNorm)])
    a = spec.attention
    fused = model.transformer.h[0].self_attention.query_key_value.weight.shape[0]
    assert fused == (a.heads + 2 * a.kv_heads) * a.qk_dim


def test_a_falcon_with_alibi_is_refused_with_the_fix():
    with pytest.raises(ModelConfigError, match="alibi=true is not modelled.*alibi false"):
        model_spec(dict(TINY["falcon"], model_type="falcon", alibi=True))


def test_reads_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY["llama"], model_type="llama")))
    assert model_spec(path).attention.kv_heads == 2
    assert model_spec(str(path)).hidden == 64


@pytest.mark.parametrize("family", ["mistral", "qwen2", "phi", "glm4_moe"])
def test_heads_that_leave_a_remainder_are_counted_as_transformers_builds_them(family):
    """Only some transformers classes refuse a hidden size the heads do not divide (those above); the others build
    heads of hidden // heads, and so does the planner (a review of 2026-12-06 found GLM-4.5's default 4096 / 96 and
    GLM-4.7-Flash's MLA refused by a check for every family)."""
    import torch
    import transformers

    fields = dict(TINY[family], hidden_size=60, num_attention_heads=7)
    fields.pop("head_dim", None)
    if "num_key_value_heads" in fields:
        fields["num_key_value_heads"] = 7
    config = transformers.AutoConfig.for_model(family, **fields)
    with torch.device("meta"):
        model = tiny_model(config)
    assert model_params(model_spec(config)) == sum(p.numel() for p in model.parameters())
    model_spec({"model_type": "glm4_moe_lite"})  # MLA: no head of hidden // heads at all


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "persimmon"}, r"not modelled; supported: .*copy its config.json with \"model_type\" set to it "
                                  r"\(e.g. \"llama\"\)"),
    ({"model_type": "exaone_moe", "num_experts": 16}, r"not modelled.*\"qwen3_moe\".*\"mixtral\".*not a dense"),
    # the stand-in follows the layer's shape (a trial, 2026-12-06: DBRX's experts in ffn_config, Nemotron's ReLU² MLP
    # and StarCoder's GELU one of two projections, MiniCPM3's latent attention had all been told "llama")
    ({"model_type": "dbrx", "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}, r"\(e.g. \"qwen3_moe\""),
    ({"model_type": "nemotron", "hidden_act": "relu2"}, r"\(e.g. \"arcee\": its MLP is two projections around ReLU²"),
    ({"model_type": "gpt_bigcode", "activation_function": "gelu_pytorch_tanh"},
     r"\(e.g. \"starcoder2\" if its MLP is two projections .*\"llama\" if it is gated"),
    ({"model_type": "minicpm3", "kv_lora_rank": 256, "q_lora_rank": 768}, r"\(e.g. \"deepseek_v2\" for its multi-head "
                                                                          r"latent attention"),
    ({"model_type": "longcat_flash", "kv_lora_rank": 512, "n_routed_experts": 512}, r"\(e.g. \"deepseek_v3\""),
    # the stand-in advice names the fields the family reads; a field under another family's name is named as such
    ({"model_type": "persimmon"}, r"under that family's field names \(hidden_size, num_hidden_layers, "),
    (dict(TINY["llama"], model_type="llama", num_attention_heads=None, n_head=4),
     r"has no num_attention_heads \(it gives n_head, a name llama configs do not read: rename it num_attention_heads"),
    # ALiBi attention: no stand-in, as Falcon's alibi=true
    ({"model_type": "bloom", "n_head": 8}, r"'bloom' is not modelled: its attention adds ALiBi biases .*bloom always"),
    ({"model_type": "mpt", "d_model": 64, "attn_config": {"alibi": True}}, r"ALiBi biases"),
    # a multimodal config without its language model's config; a layer_types list of another length than the layers
    ({"model_type": "gemma3", "vision_config": {}}, r"'gemma3' is a multimodal config .*text_config.* is missing"),
    ({"model_type": "gemma3", "vision_config": {}, "text_config": "gemma3_text"}, r"is a str, not an object"),
    (dict(TINY["gemma2"], model_type="gemma2", sliding_window=16,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
     r"layer_types gives 3 entries for num_hidden_layers \d+: give one per layer"),
    (dict(TINY["hunyuan_v1_moe"], model_type="hunyuan_v1_moe", moe_topk=[2, 1]),
     r"num_experts_per_tok / moe_topk must be one positive whole number, or the same one for every layer"),
    # layers that are not attention, in families not read: no stand-in offered (MiniMax-01's lightning attention,
    # Nemotron-H's Mamba)
    ({"model_type": "minimax", "layer_types": ["linear_attention", "full_attention"]},
     r"'minimax' is not modelled: its layers are not all attention \(its config gives layers of kind "
     r"linear_attention.*no supported family stands in for it; supported: llama"),
    ({"model_type": "nemotron_h", "mamba_num_heads": 8, "layers_block_type": ["mamba", "attention"]},
     r"not all attention \(its config gives the fields layers_block_type, mamba_num_heads"),
    ({"model_type": "kimi_linear", "linear_num_heads": 32},
     r"'kimi_linear' is not modelled: its layers are not all attention \(its config gives the fields "
     r"linear_num_heads"),
    # Qwen3.5's Gated DeltaNet hybrids are read: a layer that is neither kind is refused
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 2,
                                               "layer_types": ["linear_attention", "mamba"]}},
     r"qwen3_5_text's layer_types must give \"linear_attention\" or \"full_attention\" for each of its 2 layers"),
    # layers not of one shape (Gemma 4's wider global layers and per-layer embeddings, Gemma 3n's shared kv layers
    # and residual streams): no stand-in offered
    ({"model_type": "gemma4_text", "hidden_size_per_layer_input": 256, "per_layer_config": {"5": {"head_dim": 512}},
      "layer_types": ["sliding_attention", "full_attention"]},
     r"'gemma4_text' is not modelled: its layers are not of one shape \(its config gives per_layer_config, "
     r"hidden_size_per_layer_input:.*no supported family stands in for it; supported: llama"),
    ({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "num_kv_shared_layers": 10}},
     r"'gemma4' is a multimodal config whose language model \(gemma4_text\) is not modelled: its layers are not of "
     r"one shape \(its config gives num_kv_shared_layers"),
    ({"model_type": "gemma3n_text", "altup_num_inputs": 4, "hidden_size_per_layer_input": 256},
     r"not of one shape \(its config gives hidden_size_per_layer_input, altup_num_inputs"),
    ({"model_type": "gemma4_text", "hidden_size_per_layer_input": 0},
     r"not modelled; supported: .*\(e.g. \"llama\"\)"),
    # DeepSeek-V4's compressed sparse attention and residual streams: DeepSeek-V3.2 stands in, saying what it leaves out
    ({"model_type": "deepseek_v4", "index_topk": 512, "compress_rates": {"compressed_sparse_attention": 4},
      "hc_mult": 4},
     r"'deepseek_v4' is not modelled: its attention reads compressed keys.*as \"deepseek_v32\".*without the "
     r"compression"),
    # DeepSeek's sparse attention that cannot be built
    (dict(TINY["deepseek_v32"], model_type="deepseek_v32", q_lora_rank=None), r"needs multi-head latent attention "
                                                                              r"with q_lora_rank set"),
    (dict(TINY["glm_moe_dsa"], model_type="glm_moe_dsa", indexer_types=["shared", "full", "full"]),
     r"first layer .* must run an indexer"),
    (dict(TINY["glm_moe_dsa"], model_type="glm_moe_dsa", indexer_types=["full", "sparse", "full"]),
     r"indexer_types must give \"full\" or \"shared\" for each of the 3 layers"),
    (dict(TINY["deepseek_v32"], model_type="deepseek_v32", index_topk=0), "index_topk must be positive, got 0"),
    (42, "config.json path"),
    (dict(TINY["gemma3_text"], model_type="gemma3_text", use_bidirectional_attention=True), "causal decoders"),
    # GPT-2 as an encoder-decoder's decoder: a cross-attention block per layer (it had been counted without)
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "add_cross_attention": True},
     "gpt2 with add_cross_attention adds a cross-attention block to every layer .* set add_cross_attention to false"),
    # encoders, encoder-decoders and vision models are told so, with no decoder to stand in
    ({"model_type": "bert", "hidden_size": 768}, r"'bert' is not modelled: it is an encoder \(bert\), and the planner "
                                                 r"plans decoder-only language models"),
    ({"model_type": "t5"}, r"it is an encoder-decoder model \(t5\)"),
    ({"model_type": "my_seq2seq", "is_encoder_decoder": True},
     r"it is an encoder-decoder model \(is_encoder_decoder\)"),
    ({"model_type": "my_vit", "image_size": 224, "patch_size": 16}, "it is a vision model"),
    ({"model_type": "my_encoder", "architectures": ["MyEncoderForMaskedLM"]},
     r"it is an encoder \(its architectures name MyEncoderForMaskedLM\)"),
    ({"model_type": "qwen2_5_vl", "text_config": {"model_type": "glm4v_text"}},
     r"multimodal config whose language model \(glm4v_text\) is not modelled"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, 'no model_type .*Qwen3MoeForCausalLM.*add "model_type": "qwen3_moe"'),
    ({"architectures": ["GPT2LMHeadModel"]}, 'add "model_type": "gpt2"'),
    ({"architectures": ["Gemma3ForCausalLM"]}, 'add "model_type": "gemma3_text"'),
    ({"hidden_size": 64}, "no model_type: add the model_type transformers writes"),
    # a size or switch of the wrong type is named before anything reads it (these had crashed or been read wrong)
    ({"model_type": "llama", "hidden_size": "4096"}, "hidden_size must be a whole number >= 1, got '4096': fix the "
                                                     "config's \"hidden_size\""),
    ({"model_type": "llama", "hidden_size": [4096]}, r"hidden_size must be a whole number >= 1, got \[4096\]"),
    ({"model_type": "llama", "num_hidden_layers": True}, "num_hidden_layers must be a whole number >= 1, got True"),
    ({"model_type": "llama", "num_hidden_layers": 32.0}, "num_hidden_layers must be a whole number >= 1, got 32.0"),
    ({"model_type": "llama", "num_attention_heads": 0}, "num_attention_heads must be a whole number >= 1, got 0"),
    ({"model_type": "llama", "num_key_value_heads": 0}, "num_key_value_heads must be a whole number >= 1, got 0"),
    ({"model_type": "llama", "head_dim": 0}, "head_dim must be a whole number >= 1, got 0"),
    ({"model_type": "llama", "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, got 'yes'"),
    ({"model_type": "llama", "rope_scaling": "yarn"}, "rope_scaling must be an object such as .* or null, got 'yarn'"),
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 16},
     "each token is routed to 16 of 8 experts: the config's num_experts_per_tok must be between 1 and"),
    ({"model_type": "gemma3_text", "sliding_window_pattern": 0},
     "sliding_window_pattern must be a positive whole number of layers, got 0; give the config's layer_types"),
    ({"model_type": "llama", "hidden_size": 7680, "num_attention_heads": 60, "num_key_value_heads": 8},
     "60 query heads are not a multiple of 8 key/value heads .*check num_key_value_heads, e.g. 6, which divides 60"),
    # a new user's config (2026-12-06) had been planned with heads of 2048 // 15 = 136, which transformers refuses
    ({"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 15, "num_key_value_heads": 5},
     r"the hidden size 2048 is not a multiple of 15 attention heads, and the config gives no head_dim .*e\.g\. 8 or "
     "16, which divide 2048, or give head_dim"),
    ({"model_type": "gpt2", "n_embd": 100, "n_head": 3},
     r"the hidden size 100 is not a multiple of 3 attention heads \(transformers refuses it too\).*e\.g\. 2 or 4, "
     "which divide 100$"),
])
def test_bad_configs(bad, match):
    with pytest.raises(ModelConfigError, match=match):
        model_spec(bad)


def test_add_cross_attention_is_refused_only_where_transformers_builds_it():
    """GPT-2 builds a cross-attention block per layer under the flag (refused above); LLaMA's class ignores it, and so
    does the reader (it had been refused for every family)."""
    llama = dict(TINY["llama"], model_type="llama")
    spec = model_spec({**llama, "add_cross_attention": True})
    assert spec == model_spec(llama)
    model = tiny_model(transformers.AutoConfig.for_model("llama", **TINY["llama"], add_cross_attention=True))
    assert model_params(spec) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family, fields, masks, embedding", [
    ("gpt2", {}, 2, True),  # transformers' defaults: resid_pdrop and embd_pdrop 0.1
    ("gpt2", {"resid_pdrop": 0.0, "embd_pdrop": 0.0}, 0, False),
    ("gpt_neox", {"hidden_dropout": 0.1}, 2, True),  # after both branches and on the embedding
    ("starcoder2", {"residual_dropout": 0.1}, 2, False),
    ("starcoder2", {"embedding_dropout": 0.1}, 0, True),
    ("phi3", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}, 2, False),  # transformers applies no embd_pdrop
    ("phi", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}, 2, True),  # on each branch and on the embedding
    ("phi", {}, 0, False),  # transformers' defaults 0.0 (Phi-2's config.json sets resid_pdrop 0.1)
    ("gptj", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}, 2, True),
    ("seed_oss", {}, 2, False),  # transformers' default residual_dropout 0.1
    ("falcon", {"hidden_dropout": 0.1, "attention_dropout": 0.1}, 1, False),  # parallel: one on the branches' sum
    ("falcon", {"parallel_attn": False, "hidden_dropout": 0.1, "attention_dropout": 0.1}, 2, False),
    ("falcon", {"parallel_attn": False, "attention_dropout": 0.1}, 1, False),
    ("llama", {"attention_dropout": 0.1}, 0, False),  # inside flash attention: no mask kept
])
def test_dropouts_that_keep_masks_are_read_per_family(family, fields, masks, embedding):
    spec = model_spec({"model_type": family, **fields})
    assert (spec.residual_dropouts, spec.embedding_dropout) == (masks, embedding)


def test_phimoe_routes_to_two_experts_only():
    """Its sparsemixer picks exactly two experts whatever num_experts_per_tok says; another value is refused."""
    assert model_spec(dict(TINY["phimoe"], model_type="phimoe")).experts.top_k == 2
    with pytest.raises(ModelConfigError, match="phimoe routes each token to 2 experts.*set it to 2"):
        model_spec(dict(TINY["phimoe"], model_type="phimoe", num_experts_per_tok=4))
    with pytest.raises(ModelConfigError, match=r"input_jitter_noise must be a noise magnitude in \[0, 1\), got -0.1"):
        model_spec(dict(TINY["phimoe"], model_type="phimoe", input_jitter_noise=-0.1))


def test_a_dropout_that_is_no_probability_is_refused():
    with pytest.raises(ModelConfigError, match=r"resid_pdrop must be a dropout probability in \[0, 1\), got 1.5"):
        model_spec({"model_type": "gpt2", "resid_pdrop": 1.5})


def test_gemma3_text_has_four_norms_qk_norms_and_windows():
    text = dict(TINY["gemma3_text"], model_type="gemma3_text")
    spec = model_spec(text)
    assert spec.post_norms and spec.attention.qk_norm and spec.tied and spec.window_layers == (0,)


def test_missing_file():
    with pytest.raises(ModelConfigError, match="cannot read"):
        model_spec("/nonexistent/config.json")


def test_optimizer_state():
    assert optimizer_bytes(10) == (20, 20, 120)
    assert optimizer_bytes(10, shards=4) == (20, 20, 30)
    assert optimizer_bytes(10, shards=4, fsdp=True) == (5, 5, 30)
    # Megatron-Core's precision-aware optimizer with bf16 moments: the fp32 master and two 2-byte moments
    assert optimizer_bytes(10, moment_bytes=2) == (20, 20, 80)
    assert optimizer_bytes(10, shards=4, fsdp=True, moment_bytes=2) == (5, 5, 20)


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_family_defaults_are_transformers_own(family):
    """A field a config.json leaves out takes the installed transformers' default (the configuration class's, or its
    default object's where the class computes it), not the reader's generic fallback."""
    default = transformers.AutoConfig.for_model(family)
    for field, value in FAMILY_DEFAULTS[family].items():
        declared = getattr(type(default), field, None)  # the class's default (Qwen's window before post-init)
        assert (declared if declared is not None else getattr(default, field)) == value, (family, field)


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_bare_config_reads_as_its_config_object(family):
    """The tiny configs as bare config.json fields read as the config objects transformers builds from them: every
    field they leave out (GLM-4.5's and DeepSeek-V3's multi-token prediction, Mistral's window) takes
    transformers' default."""
    assert model_spec(dict(TINY[family], model_type=family)) == model_spec(tiny_config(family))


def test_an_moe_counts_the_parameters_a_token_activates_as_its_makers_do():
    """Of the routed experts a token runs its top-k: the activated parameters the model cards give (Mixtral 8x7B
    12.9 B of 46.7 B, Qwen3-30B-A3B 3.3 B, Qwen3-235B-A22B 22 B, DeepSeek-V3 37 B, Llama 4 Scout 17 B; each counting
    the embedding, as DeepSeek's 37 B does: OpenAI's 5.1 B for gpt-oss-120b leaves its 0.58 B out); a dense model's
    are all of them."""
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
               "num_experts_per_tok": 2}
    configs = f"{Path(__file__).parents[3] / 'benchmarks' / 'data' / 'configs'}/"
    for config, published in ((mixtral, 12.9), (configs + "qwen3-30b-a3b.json", 3.3),
                              (configs + "qwen3-235b-a22b.json", 22), (configs + "deepseek-v3.json", 37),
                              (configs + "llama4-scout.json", 17)):
        spec = model_spec(config)
        active = model_params(spec, active=True)
        assert abs(active / 1e9 / published - 1) < 0.02, (config, active)  # the cards round: 3.35 B is "3.3B"
    dense = model_spec(dict(TINY["llama"], model_type="llama"))
    assert model_params(dense, active=True) == model_params(dense)


def test_a_multimodal_config_is_planned_as_its_language_model():
    """google/gemma-3-4b-it's config.json (model_type gemma3, the language model's six fields in text_config): read
    as its text_config, marked as the language model of a gemma3 config (the command's report:
    tests/plan/cluster/test_model_source.py)."""
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
            "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    whole = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
             "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
    spec = model_spec(whole)
    assert spec == dataclasses.replace(model_spec(text), text_of="gemma3") and model_spec(text).text_of == ""
    assert model_params(spec) == model_params(model_spec(text))


@pytest.mark.parametrize("family", sorted(TEXT_TYPES))
def test_a_text_config_without_its_model_type_is_told_the_one_transformers_reads(family):
    """A multimodal config's text_config naming no model_type (transformers takes its configuration class's) is refused
    with the type to add, the one transformers' class gives it (it had been "language model (None) is not modelled")."""
    assert transformers.AutoConfig.for_model(family, text_config={}).text_config.model_type == TEXT_TYPES[family]
    with pytest.raises(ModelConfigError, match=re.escape(f"text_config gives no model_type: add \"model_type\": "
                                                         f"\"{TEXT_TYPES[family]}\" (transformers reads it so)")):
        model_spec({"model_type": family, "text_config": {"hidden_size": 256}, "vision_config": {}})


def test_a_text_config_takes_transformers_defaults_for_what_it_leaves_out():
    """google/gemma-3-4b-it's text_config gives six fields (transformers' defaults fill the rest): read as the config
    object transformers builds from them. A field no default gives is named."""
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
            "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    expected = model_spec(transformers.AutoConfig.for_model("gemma3_text", **{k: v for k, v in text.items()
                                                                               if k != "model_type"}))
    assert model_spec(text) == expected and expected.attention.heads == 8 and expected.vocab == 262208
    with pytest.raises(ModelConfigError, match="has no num_experts_per_tok"):
        model_spec({"model_type": "deepseek_v2", "kv_lora_rank": 16})


@pytest.mark.parametrize("family", ["ministral", "ministral3", "helium", "arcee", "hunyuan_v1_dense", "hunyuan_v1_moe",
                                    "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
                                    "olmo_hybrid"])
def test_a_bare_model_type_counts_as_transformers_default_model(family):
    """A config.json that gives only its model_type (and Ministral's and Hunyuan's head_dims: transformers' classes
    fail on the None their configurations default it to, so their checkpoints give it) reads as transformers'
    default configuration of the family (:data:`FAMILY_DEFAULTS`), and counts the parameters of that model built on
    the meta device (Ministral 3's default is its 8B base model's language model: 34 layers of hidden 4,096;
    DeepSeek-V3.2's is the 671.88 B model with an indexer in every layer, GLM-5's 743.91 B; Qwen3-Next's the 79.67 B
    of Qwen3-Next-80B-A3B, Qwen3.5's 8.95 B (Qwen3.5-9B's language model) and Qwen3.5-MoE's 34.66 B (Qwen3.5-35B-A3B's),
    Gated DeltaNet on three layers of four; OLMo hybrid's 7.43 B, Olmo-Hybrid-7B's, its Gated DeltaNet's sizes
    derived from the attention's)."""
    given = {"head_dim": 128} if family in ("ministral", "hunyuan_v1_dense", "hunyuan_v1_moe") else {}
    config = transformers.AutoConfig.for_model(family, **given)
    with torch.device("meta"):
        model = tiny_model(config)
    expected = sum(p.numel() for p in model.parameters())
    assert model_params(model_spec({"model_type": family, **given})) == model_params(model_spec(config)) == expected


def test_hunyuan_a13b_counts_80_b_with_13_b_active():
    """Tencent's Hunyuan-A13B config.json (its sizes and per-layer lists of one value each as a third party's test
    copies them in the public code index; the file itself was not read here): 64 experts
    of 3,072 with the top 8 per token and one shared MLP in each of 32 layers, a tied head: 80.39 B parameters, 13 B
    active (Tencent's model card: 80 B in all, 13 B active)."""
    data = {"model_type": "hunyuan_v1_moe", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 128167,
            "num_experts": 64, "moe_intermediate_size": [3072] * 32, "moe_topk": [8] * 32,
            "num_shared_expert": [1] * 32, "tie_word_embeddings": True}
    spec = model_spec(data)
    total = model_params(spec)
    routed = spec.layers * spec.experts.count * 3 * spec.hidden * spec.experts.intermediate
    active = total - routed * (1 - spec.experts.top_k / spec.experts.count)
    assert round(total / 1e9, 2) == 80.39 and round(active / 1e9) == 13
    with torch.device("meta"):
        model = tiny_model(transformers.AutoConfig.for_model(**data))
    assert total == sum(p.numel() for p in model.parameters())


def test_olmo_1_norms_hold_no_parameters_and_clip_qkv_is_refused():
    """OLMo 1's LayerNorms have neither weight nor bias (OLMo-7B's 6.89 B, transformers' count); its clip_qkv clamps
    q, k and v in place, which keeps q and k before the rotary for the backward, uncounted: refused, naming that."""
    seven_b = {"model_type": "olmo", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
               "num_attention_heads": 32, "vocab_size": 50304}
    assert model_params(model_spec(seven_b)) == 6_888_095_744
    with pytest.raises(ModelConfigError, match=r"clip_qkv=8\.0 clamps q, k and v in place.*set clip_qkv to null"):
        model_spec({**seven_b, "clip_qkv": 8.0})
