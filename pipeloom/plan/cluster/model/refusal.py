"""Why a transformers config the planner does not read is refused (:func:`unmodelled`): layers that are not all
attention, layers not of one shape, DeepSeek-V4's compressed sparse attention, a model that is no decoder-only language
model (an encoder, an encoder-decoder, a vision or speech model), and otherwise the supported family a decoder of
the same layer shapes can be planned as; :func:`guess` names the ``model_type`` a config without one should carry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["unmodelled", "guess"]

_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention", "attention", "indexed_attention")
"""``layer_types`` entries of attention layers (any other entry names a layer of another kind)."""
_UNEVEN_LAYERS = ("per_layer_config", "hidden_size_per_layer_input", "num_kv_shared_layers", "altup_num_inputs")
"""Config fields (when set) of decoders whose layers are not of one shape (Gemma 3n, Gemma 4): layers of other head
sizes or key/value heads (``per_layer_config``), a per-layer input embedding beside the main one
(``hidden_size_per_layer_input``), layers that reuse an earlier layer's keys and values (``num_kv_shared_layers``),
several residual streams (``altup_num_inputs``)."""
_OTHER_MIXERS = ("linear_", "mamba", "ssm_", "layers_block_type", "block_types", "attn_layer_period",
                 "attn_layer_indices", "conv_l_cache", "state_size", "conv_kernel")
"""Config fields (prefixes) of layers that mix tokens without attention, in families the planner does not read:
linear attention (Kimi Linear, MiniMax-01; the Gated DeltaNet of Qwen3-Next, Qwen3.5 and OLMo hybrid it reads),
state-space (Mamba, Jamba, Nemotron-H, Falcon-H1, Granite 4 hybrid, Zamba), short convolutions (LFM2) and the
patterns that place them."""


def unmodelled(subject: str, data: Mapping[str, Any], supported_families: Sequence[str], hybrids: Sequence[str], *,
               stand_in: bool = True) -> str:
    """Why the config ``data`` (of the model ``subject`` names) is refused, naming the ``supported_families`` (of them
    ``hybrids`` mix Gated DeltaNet and attention), and the stand-in a user can take where one is close (with
    ``stand_in``): DeepSeek-V3 for DeepSeek's sparse attention; none for models with layers that are
    not attention (pricing them as attention would be wrong in kind) or whose layers are not of one shape
    (:data:`_UNEVEN_LAYERS`: LLaMA's layers would leave out, among others, a per-layer embedding table larger than
    the main one); LLaMA's or a mixture of experts' layer otherwise."""
    supported = f"supported: {', '.join(supported_families)}"
    if "index_topk" in data:
        return (f"{subject} is not modelled: its attention reads compressed keys (compress_rates) through "
                "DeepSeek's sparse attention, beside several residual streams (hc_mult), which the planner does not "
                "price; the sparse attention of DeepSeek-V3.2 (\"deepseek_v32\") and GLM-5 (\"glm_moe_dsa\") it does"
                + (", and as \"deepseek_v32\" (copy its config.json with that model_type) it plans layers of the same "
                   "sizes without the compression" if stand_in else "") + f"; {supported}")
    types = data.get("layer_types")
    other = sorted({str(kind) for kind in types if kind not in _ATTENTION_LAYERS}) if isinstance(types, list) else []
    fields = sorted(key for key in data if key.lower().startswith(_OTHER_MIXERS))
    if other or fields:
        what = f"layers of kind {', '.join(other)}" if other else f"the fields {', '.join(fields[:3])}"
        return (f"{subject} is not modelled: its layers are not all attention (its config gives {what}: linear "
                "attention, state-space or convolution layers), and the planner prices a decoder layer's token mixer "
                f"as attention or as Qwen3-Next's Gated DeltaNet ({', '.join(hybrids)}), so no supported family "
                f"stands in for it; {supported}")
    uneven = [key for key in _UNEVEN_LAYERS if data.get(key)]
    if uneven:
        return (f"{subject} is not modelled: its layers are not of one shape (its config gives {', '.join(uneven)}: "
                "layers of other head sizes, per-layer input embeddings, layers that reuse another's keys and values "
                "or several residual streams), and the planner prices every decoder layer of a kind alike, so no "
                f"supported family stands in for it; {supported}")
    alibi = _alibi(data)
    if alibi:
        return (f"{subject} is not modelled: its attention adds ALiBi biases to the scores ({alibi}), which the "
                "planner's flash-attention pricing does not cover, so no supported family stands in for it (a Falcon "
                f"config with alibi=true is refused alike); {supported}")
    kind = _not_a_decoder(data)
    if kind:
        return (f"{subject} is not modelled: it is {kind}, and the planner plans decoder-only language models (causal "
                f"attention, a language-model head), so no supported family stands in for it; {supported}")
    if not stand_in:
        return f"{subject} is not modelled; {supported}"
    return (f"{subject} is not modelled; {supported}. A decoder whose layers have one of these shapes (most "
            "LLaMA-like models) plans as that family: copy its config.json with \"model_type\" set to it "
            f"({_like(data)}) and its sizes under that family's field names (hidden_size, num_hidden_layers, "
            "num_attention_heads, num_key_value_heads, intermediate_size, vocab_size)")


def _alibi(data: Mapping[str, Any]) -> str:
    """Where the config says its attention takes ALiBi biases (BLOOM and MPT always; ``alibi``, an ALiBi
    ``position_embedding_type`` or MPT's ``attn_config``), else ''."""
    family = str(data.get("model_type", ""))
    if family in ("bloom", "mpt"):
        return f"{family} always does"
    attn = data.get("attn_config")
    if data.get("alibi") or (isinstance(attn, Mapping) and attn.get("alibi")):
        return "its config sets alibi"
    if str(data.get("position_embedding_type", "")).lower() == "alibi":
        return "its position_embedding_type is alibi"
    return ""


_NOT_DECODER_HEADS = {"ForMaskedLM": "an encoder", "ForSequenceClassification": "an encoder",
                      "ForTokenClassification": "an encoder", "ForQuestionAnswering": "an encoder",
                      "ForImageClassification": "a vision model", "ForCTC": "a speech encoder"}
"""Heads of transformers' ``architectures`` only encoders carry (a decoder language model's is ``...ForCausalLM``)."""


_NOT_DECODERS = {**dict.fromkeys(("bert", "roberta", "xlm-roberta", "deberta", "deberta-v2", "distilbert", "albert",
                                   "electra", "modernbert"), "an encoder"),
                 **dict.fromkeys(("t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian", "whisper"),
                                 "an encoder-decoder model"),
                 **dict.fromkeys(("vit", "clip", "siglip", "dinov2", "swin", "convnext"), "a vision model"),
                 **dict.fromkeys(("wav2vec2", "hubert"), "a speech encoder")}
"""Well-known transformers families that are no decoder-only language model, by ``model_type``."""


def _not_a_decoder(data: Mapping[str, Any]) -> str:
    """What the config describes where it is no decoder-only language model (a well-known encoder, encoder-decoder,
    vision or speech family; an encoder-decoder or vision config by its fields; an encoder by its architectures'
    heads); '' otherwise, or where the config says it is a decoder (``is_decoder``)."""
    if data.get("is_decoder"):
        return ""
    family = str(data.get("model_type", ""))
    if family in _NOT_DECODERS:
        return f"{_NOT_DECODERS[family]} ({family})"
    if data.get("is_encoder_decoder"):
        return "an encoder-decoder model (is_encoder_decoder)"
    if any(key in data for key in ("image_size", "patch_size")):
        return "a vision model (its config gives image_size or patch_size)"
    for name in data.get("architectures") or ():
        for head, kind in _NOT_DECODER_HEADS.items():
            if str(name).endswith(head):
                return f"{kind} (its architectures name {name})"
    return ""


def _like(data: Mapping[str, Any]) -> str:
    """An example family for an unmodelled config to stand in as, from what its layers hold: a mixture of experts'
    (its routed experts would be planned as one dense MLP under LLaMA's; experts a sub-config holds, as DBRX's
    ``ffn_config``, count), DeepSeek's for multi-head latent attention (``kv_lora_rank``), an MLP of two projections
    for a ReLU² or GELU activation (LLaMA's gated MLP has three: Nemotron planned as LLaMA had 26 % more parameters,
    StarCoder 39 %), else LLaMA's."""
    parts = [data, *(value for value in data.values() if isinstance(value, Mapping))]
    latent = any(part.get("kv_lora_rank") for part in parts)
    if any(part.get(name) for part in parts for name in _EXPERT_FIELDS):
        if latent:
            return ("e.g. \"deepseek_v3\": multi-head latent attention (q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                    "qk_rope_head_dim, v_head_dim) and routed experts (n_routed_experts, num_experts_per_tok, "
                    "moe_intermediate_size)")
        return ("e.g. \"qwen3_moe\": num_experts, num_experts_per_tok and moe_intermediate_size per expert, or "
                "\"mixtral\": num_local_experts, num_experts_per_tok and intermediate_size per expert; it has experts, "
                "so not a dense family")
    if latent:
        return ("e.g. \"deepseek_v2\" for its multi-head latent attention (q_lora_rank, kv_lora_rank, "
                "qk_nope_head_dim, qk_rope_head_dim, v_head_dim); for dense layers alone, first_k_dense_replace = "
                "num_hidden_layers (n_routed_experts and num_experts_per_tok 1 then hold no layer)")
    keys = ("hidden_act", "activation_function", "hidden_activation", "ffn_act_fn")
    act = str(next((part[key] for part in parts for key in keys if part.get(key)), "")).lower()
    if act in ("relu2", "relu_squared", "squared_relu"):
        return "e.g. \"arcee\": its MLP is two projections around ReLU², where \"llama\"'s is gated, of three"
    if act == "relu" or act.startswith("gelu"):
        return ("e.g. \"starcoder2\" if its MLP is two projections around the activation (use_bias for their biases), "
                "\"llama\" if it is gated, of three (gate, up, down)")
    return "e.g. \"llama\""


def guess(architectures: object, supported_families: Sequence[str]) -> str:
    """The fix for a config without ``model_type`` whose ``architectures`` name the class of one of the
    ``supported_families`` (transformers names them ``<Family>ForCausalLM``), or nothing."""
    names = architectures if isinstance(architectures, list) else []
    by_class = {family.replace("_", ""): family for family in supported_families}
    by_class["gemma3"] = "gemma3_text"  # Gemma3ForCausalLM is the text-only model of a gemma3_text config
    by_class["hunyuandensev1"] = "hunyuan_v1_dense"  # HunYuanDenseV1ForCausalLM
    by_class["hunyuanmoev1"] = "hunyuan_v1_moe"  # HunYuanMoEV1ForCausalLM
    for name in names:
        family = by_class.get(str(name).lower().removesuffix("forcausallm").removesuffix("lmheadmodel"))
        if family:
            return f" (its architectures say {name}): add \"model_type\": \"{family}\""
    return ": add the model_type transformers writes in config.json"
