"""A decoder's shape (:class:`~pipeloom.plan.cluster.model.spec.ModelSpec`) read from a transformers config (a
config.json path, a model folder, a Hugging Face model id in the local cache, a dict or a ``PretrainedConfig``:
:func:`~pipeloom.plan.cluster.model.source.read_config`), without importing transformers: dense decoders (LLaMA,
Mistral, Ministral, Ministral 3, Qwen2/3, Gemma 1/2/3, Granite, Phi-3, OLMo 2/3, SmolLM3, StarCoder2, Cohere's
Command R / R7B / A, ERNIE 4.5, GLM-4, Seed-OSS, EXAONE 4, Helium, Arcee, Hunyuan dense, GPT-NeoX; Falcon, GPT-2,
GPT-J and Phi-1/2: :mod:`~pipeloom.plan.cluster.model.gpt_lineage`) and
mixture-of-experts decoders (Mixtral, Phi-3.5-MoE, Granite MoE, Hunyuan MoE, OLMoE, MiniMax-M2, Qwen2-MoE, Qwen3-MoE,
ERNIE 4.5 MoE, DeepSeek-V2/V3, GLM-4.7-Flash and Mistral 4 with multi-head latent attention, DeepSeek-V3.2 and GLM-5
with DeepSeek's sparse attention beside it, GLM-4.5, dots.llm1,
gpt-oss with attention sinks and biased experts, Llama 4 with chunked attention and NoPE layers:
:mod:`~pipeloom.plan.cluster.model.moe`) and decoders mixing Gated DeltaNet and attention layers (Qwen3-Next,
Qwen3.5 dense and MoE, OLMo hybrid), a field left out taking transformers' default for the family
(:data:`~pipeloom.plan.cluster.model.source.FAMILY_DEFAULTS`), with sliding-window attention on the layers
transformers gives it (:func:`_windows`)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from pipeloom.plan.cluster.model.deltanet import gated_deltanet_spec
from pipeloom.plan.cluster.model.fields import check_fields, get_field, head_size, nope_layers, rate_on
from pipeloom.plan.cluster.model.gpt_lineage import falcon_spec, gpt2_spec, gptj_spec, phi_spec
from pipeloom.plan.cluster.model.moe import deepseek_spec, every_layer_sparse, gpt_oss_spec, llama4_spec, phimoe_spec
from pipeloom.plan.cluster.model.refusal import guess, unmodelled
from pipeloom.plan.cluster.model.source import FAMILY_DEFAULTS, read_config
from pipeloom.plan.cluster.model.spec import Attention, Experts, ModelSpec
from pipeloom.plan.errors import ModelConfigError

__all__ = ["model_spec", "SUPPORTED_FAMILIES"]

_DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "phi3", "olmo", "olmo2",
          "olmo3", "smollm3", "starcoder2", "cohere", "cohere2", "ernie4_5", "glm", "glm4", "seed_oss", "exaone4",
          "falcon", "gpt2", "gpt_neox", "phi", "gptj", "ministral", "ministral3", "helium", "arcee", "hunyuan_v1_dense")
_UNGATED = ("arcee",)
"""Families of the LLaMA layout whose MLP is two projections around one activation (Arcee's ReLU²)."""
_OLMO = ("olmo2", "olmo3", "olmoe")
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", "exaone4", "minimax_m2", "hunyuan_v1_dense", "hunyuan_v1_moe",
            *_OLMO)
"""Families of the generic reading with q and k norms (per head, or over the whole projections: ``qk_norm_full``)."""
_MOE = ("mixtral", "phimoe", "granitemoe", "granitemoeshared", "olmoe", "minimax_m2", "qwen2_moe", "qwen3_moe",
        "ernie4_5_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1", "mistral4", "gpt_oss",
        "llama4_text", "hunyuan_v1_moe", "deepseek_v32", "glm_moe_dsa")
_HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")
"""Families whose layers mix Gated DeltaNet and attention
(:func:`~pipeloom.plan.cluster.model.deltanet.gated_deltanet_spec`)."""
SUPPORTED_FAMILIES: tuple[str, ...] = _DENSE + _MOE + _HYBRID
"""The ``model_type`` values :func:`model_spec` reads."""
STAND_INS = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
             "qwen3_vl_moe_text": "qwen3_moe"}
"""Language models of multimodal configs whose decoder layers are, parameter for parameter, a supported family's
(Qwen2-VL's and Qwen2.5-VL's Qwen2 layers with their multimodal rotary sections, which hold no parameters; Qwen3-VL's
Qwen3 and Qwen3-MoE layers): read as that family, with their own configuration class's defaults
(:data:`FAMILY_DEFAULTS`) and the tied head the whole model's config sets (transformers ties at the top level;
Qwen2-VL's and Qwen2.5-VL's also where a pre-v5 text_config said so)."""
TEXT_TYPES = {"gemma3": "gemma3_text", "mistral3": "mistral", "llava": "llama", "llava_next": "llama",
              "llama4": "llama4_text", "paligemma": "gemma", "idefics3": "llama", "smolvlm": "llama",
              "internvl": "qwen2", "aya_vision": "cohere2", "qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe":
              "qwen3_vl_moe_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
"""The language model's ``model_type`` transformers gives a multimodal config's ``text_config`` that names none (its
configuration class's default), for the multimodal models most trained."""
_FLAT = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text"}
"""Multimodal configs whose hub config.json gives the language model's fields at the top level, no text_config
(transformers moves them into its text_config)."""


def model_spec(config: object) -> ModelSpec:
    """The :class:`ModelSpec` of a transformers config (path, model folder, Hugging Face id, dict or
    ``PretrainedConfig``)."""
    if isinstance(config, ModelSpec):
        return config
    data = read_config(config)
    family = str(data.get("model_type", ""))
    text = data.get("text_config")
    if not family:
        fix = guess(data.get("architectures"), SUPPORTED_FAMILIES)
        raise ModelConfigError(f"the model config has no model_type{fix}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    if family in STAND_INS:  # the language model's config alone
        return model_spec(_stand_in(data, bool(data.get("tie_word_embeddings",
                                                         FAMILY_DEFAULTS[family].get("tie_word_embeddings", False)))))
    if family in _FLAT and not isinstance(text, Mapping):
        text = {**{key: value for key, value in data.items() if key != "vision_config"}, "model_type": _FLAT[family]}
    if family not in SUPPORTED_FAMILIES and "vision_config" in data and not isinstance(text, Mapping):
        raise ModelConfigError(f"model_type {family!r} is a multimodal config (it has a vision_config), and its "
                               f"text_config, the language model's config the planner plans, is {_shown(text)}: give "
                               "the text_config object as the model's own config.json has it")
    if family not in SUPPORTED_FAMILIES and isinstance(text, Mapping):
        inner = text.get("model_type")
        if not inner:  # transformers takes its configuration class's; the planner does not guess it
            meant = (f"\"{TEXT_TYPES[family]}\" (transformers reads it so)" if family in TEXT_TYPES else
                     "the language model's model_type")
            raise ModelConfigError(f"model_type {family!r} is a multimodal config whose text_config gives no "
                                   f"model_type: add \"model_type\": {meant} to the text_config")
        if inner in STAND_INS:
            tie = bool(data.get("tie_word_embeddings")) or (family in _FLAT and bool(text.get("tie_word_embeddings")))
            text, inner = _stand_in(text, tie), STAND_INS[inner]
        if inner in SUPPORTED_FAMILIES:  # a multimodal model: its language model is what is planned
            return dataclasses.replace(model_spec(dict(text)), text_of=family)
        raise ModelConfigError(unmodelled(f"model_type {family!r} is a multimodal config whose language model "
                                          f"({inner})", text, SUPPORTED_FAMILIES, _HYBRID, stand_in=False))
    if family not in SUPPORTED_FAMILIES:
        raise ModelConfigError(unmodelled(f"model_type {family!r}", data, SUPPORTED_FAMILIES, _HYBRID))
    if family == "gpt2" and data.get("add_cross_attention"):  # the other families' classes ignore the flag
        raise ModelConfigError("gpt2 with add_cross_attention adds a cross-attention block to every layer (the "
                               "decoder of an encoder-decoder); the planner plans decoder-only models: set "
                               "add_cross_attention to false")
    if data.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{family} with use_bidirectional_attention is an encoder; the planner plans causal "
                               "decoders: set use_bidirectional_attention to false")
    left_out = {key: value for key, value in FAMILY_DEFAULTS.get(family, {}).items()
                if not any(name in data for name in _ALIASES.get(key, (key,)))}
    kv_left = _kv_left(data, family, left_out)  # the class's default: the query heads
    heads = {kv_left: data.get("num_attention_heads", left_out.get("num_attention_heads"))} if kv_left else {}
    _misspelled(data, family, {**left_out, **heads})
    data = {**left_out, **data}  # transformers' defaults for the fields left out
    check_fields(data)
    _check_layer_types(data)
    spec = _family_spec(data, family)
    context = data.get("max_position_embeddings")
    left_out |= {kv_left: spec.attention.heads} if kv_left else {}
    spec = dataclasses.replace(spec, defaulted=tuple((key, value) for key, value in left_out.items() if key in _SIZES),
                               context=context if isinstance(context, int) and not spec.positions else 0)
    spec = dataclasses.replace(spec, **_dropouts(data, family, spec.parallel_residual),
                               logit_softcap=_softcapped(data, family))
    window, layers = _windows(data, family, spec.layers)
    return dataclasses.replace(spec, window=window, window_layers=layers) if layers else spec


def _softcapped(data: Mapping[str, Any], family: str) -> bool:
    """Whether Gemma 2's or Gemma 3's ``final_logit_softcapping`` caps the logits (a positive number; null: off)."""
    cap = data.get("final_logit_softcapping")
    if family not in ("gemma2", "gemma3_text") or cap is None:
        return False
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ModelConfigError(f"final_logit_softcapping must be a positive number or null, got {cap!r}: fix the "
                               "config's \"final_logit_softcapping\"")
    return True


def _shown(value: object) -> str:
    """``value`` as an error names it: missing, null, or its type."""
    return "missing or null" if value is None else f"a {type(value).__name__}, not an object"


def _check_layer_types(data: Mapping[str, Any]) -> None:
    """ModelConfigError where the config's ``layer_types`` is not one entry per layer (transformers refuses it: the
    planner would read the windows of the layers it lists alone)."""
    types, layers = data.get("layer_types"), data.get("num_hidden_layers", data.get("n_layer"))
    if isinstance(types, (list, tuple)) and isinstance(layers, int) and len(types) != layers:
        raise ModelConfigError(f"layer_types gives {len(types)} entries for num_hidden_layers {layers}: give one per "
                               "layer (\"full_attention\", \"sliding_attention\", ...), or leave layer_types out for "
                               "the family's own pattern")


_KV_UNREAD = ("gpt2", "gptj", "gpt_neox")
"""The families whose configs have no key/value head count (Falcon's is ``num_kv_heads``, in its new architecture)."""
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "num_kv_heads",
          "head_dim", "vocab_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
          "num_local_experts", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "kv_lora_rank",
          "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "n_embd",
          "n_layer", "n_head", "n_inner", "moe_num_experts", "moe_k", "moe_topk", "intermediate_size_mlp",
          "linear_num_key_heads", "linear_num_value_heads")
"""The fields that size a model: one left out is named where the plan is reported (:attr:`ModelSpec.defaulted`)."""


def _kv_left(data: Mapping[str, Any], family: str, left_out: Mapping[str, Any]) -> str | None:
    """The field of the key/value head count where the config leaves it out and the class sets it to the query heads
    (``num_key_value_heads``; Falcon's new architecture's ``num_kv_heads``), to be said as defaulted; else None."""
    if family in _KV_UNREAD or (family == "falcon" and not data.get("new_decoder_architecture")):
        return None  # no such field (Falcon's old architecture: multi_query)
    key = "num_kv_heads" if family == "falcon" else "num_key_value_heads"
    return None if key in data or key in left_out else key


def _misspelled(data: Mapping[str, Any], family: str, left_out: Mapping[str, Any]) -> None:
    """ModelConfigError for a key of the config that no family knows and that is one or two letters from a field
    the config leaves out (``num_hidden_layer``): transformers would keep it as an unused attribute and plan the
    field's default, another model."""
    for key in data:
        if key in _KNOWN or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, list(left_out), n=1, cutoff=0.9)
        if close:
            raise ModelConfigError(f"the config's {key!r} is no {family} field; did you mean {close[0]!r}? That field "
                                   f"is left out, so transformers' default ({close[0]} = {left_out[close[0]]!r}) would "
                                   "be planned: rename the key")


def _stand_in(text: Mapping[str, Any], tie: bool) -> dict[str, Any]:
    """A :data:`STAND_INS` language model's config as its stand-in family's: the fields it leaves out filled with its
    own class's defaults, the head tied or not as ``tie`` says (:func:`model_spec`: as transformers decides)."""
    inner = str(text["model_type"])
    defaults = {key: value for key, value in FAMILY_DEFAULTS[inner].items()
                if not any(name in text for name in _ALIASES.get(key, (key,)))}
    return {**defaults, **text, "model_type": STAND_INS[inner], "tie_word_embeddings": tie}


_ALIASES = {name: group for group in (("num_experts", "num_local_experts"), ("n_embd", "hidden_size"),
                                      ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"),
                                      ("n_positions", "max_position_embeddings"))
            for name in group}
"""Fields the reader takes under either name (a config's ``to_dict()`` may write the other): a default for one is
not taken where the config gives the other."""
_KNOWN = frozenset(key for defaults in FAMILY_DEFAULTS.values() for key in defaults) | frozenset(_ALIASES)
"""Every field some family's defaults name: never taken for a misspelling."""


def _dropouts(data: Mapping[str, Any], family: str, parallel: bool) -> dict[str, Any]:
    """The dropouts that keep masks, as transformers' models apply them in training: GPT-2's ``resid_pdrop`` on
    each branch's output and ``embd_pdrop`` on the embedding; GPT-NeoX's ``hidden_dropout`` on both and on the
    embedding; StarCoder2's ``residual_dropout`` and ``embedding_dropout``; Phi-3's ``resid_pdrop`` (its
    ``embd_pdrop`` is not applied); Phi's and GPT-J's ``resid_pdrop`` on each branch and ``embd_pdrop``; Seed-OSS's
    ``residual_dropout``; Falcon's one ``hidden_dropout`` on the sum of its ``parallel`` branches, or in its
    sequential layout ``attention_dropout`` on the attention's output and ``hidden_dropout`` on the MLP's. Attention
    dropout inside a flash kernel keeps no mask (it draws again from its seed in the backward)."""
    residual = {"gpt2": "resid_pdrop", "gpt_neox": "hidden_dropout", "starcoder2": "residual_dropout",
                "phi3": "resid_pdrop", "seed_oss": "residual_dropout", "phi": "resid_pdrop", "gptj": "resid_pdrop"}
    embedding = {"gpt2": "embd_pdrop", "gpt_neox": "hidden_dropout", "starcoder2": "embedding_dropout",
                 "phi": "embd_pdrop", "gptj": "embd_pdrop"}
    if family == "falcon":
        masks = (int(rate_on(data, "hidden_dropout")) if parallel else
                 int(rate_on(data, "attention_dropout")) + int(rate_on(data, "hidden_dropout")))
        return dict(residual_dropouts=masks)
    return dict(residual_dropouts=2 if family in residual and rate_on(data, residual[family]) else 0,
                embedding_dropout=family in embedding and rate_on(data, embedding[family]))


_LAYER_TYPES_WINDOW = frozenset({"cohere2", "dots1", "exaone4", "gemma2", "gemma3_text", "gpt_oss", "ministral",
                                 "olmo3", "qwen2", "qwen2_moe", "qwen3", "smollm3"})
"""The families whose transformers model windows the layers its config's ``layer_types`` name (the others ignore
the field: a Llama config carrying it runs full attention on every layer)."""


def _windows(data: Mapping[str, Any], family: str, layers: int) -> tuple[int, tuple[int, ...]]:
    """``(window, layers)`` of sliding-window attention as transformers builds the model: the config's ``layer_types``
    where it has them in a family that reads them (``"sliding_attention"`` layers); otherwise Mistral, Ministral,
    Ministral 3, Mixtral, Phi-3, Phi-3.5-MoE and StarCoder2 window every layer when ``sliding_window`` is set, OLMo 3
    three layers of every four (its default ``layer_types``), Gemma 2 and gpt-oss every second layer from the first,
    Gemma 3, Cohere 2 and EXAONE 4 all but every ``sliding_window_pattern``-th (6, 4 and 4), Qwen3-MoE every layer
    with ``use_sliding_window``, Qwen2 and Qwen3 the layers from ``max_window_layers`` on, Qwen2-MoE every second
    layer below it; the other families never."""
    size = data.get("sliding_window")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return 0, ()
    types = data.get("layer_types")
    if isinstance(types, (list, tuple)) and family in _LAYER_TYPES_WINDOW:
        return size, tuple(n for n, kind in enumerate(types[:layers]) if kind == "sliding_attention")
    if family in ("mistral", "mixtral", "phimoe", "phi3", "starcoder2", "ministral", "ministral3"):
        return size, tuple(range(layers))
    if family in ("gemma2", "gpt_oss"):
        return size, tuple(n for n in range(layers) if (n + 1) % 2)
    if family == "olmo3":
        return size, tuple(n for n in range(layers) if (n + 1) % 4)
    if family in ("gemma3_text", "cohere2", "exaone4"):
        pattern = data.get("sliding_window_pattern")
        pattern = (6 if family == "gemma3_text" else 4) if pattern is None else pattern
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelConfigError(f"sliding_window_pattern must be a positive whole number of layers, got "
                                   f"{pattern!r}; give the config's layer_types instead (\"sliding_attention\" or "
                                   "\"full_attention\" per layer)")
        return size, tuple(n for n in range(layers) if (n + 1) % pattern)
    if not data.get("use_sliding_window"):
        return 0, ()
    last = int(data["max_window_layers"]) if data.get("max_window_layers") is not None else 28  # transformers' default
    if family == "qwen3_moe":
        return size, tuple(range(layers))
    if family in ("qwen2", "qwen3"):
        return size, tuple(range(last, layers))
    if family == "qwen2_moe":
        return size, tuple(n for n in range(min(last, layers)) if (n + 1) % 2)
    return 0, ()


def _family_spec(data: Mapping[str, Any], family: str) -> ModelSpec:
    """The spec of ``family``'s config, without sliding windows."""
    lineage = {"gpt2": gpt2_spec, "falcon": falcon_spec, "phi": phi_spec, "gptj": gptj_spec}
    if family in lineage:
        return lineage[family](data)
    hidden = int(get_field(data, "hidden_size"))
    heads = int(get_field(data, "num_attention_heads"))
    layers = int(get_field(data, "num_hidden_layers"))
    head_dim = head_size(data, hidden, heads, family, field=family != "gpt_neox")  # GPT-NeoX's are hidden / heads
    common: dict[str, Any] = dict(family=family, hidden=hidden, layers=layers, vocab=int(get_field(data, "vocab_size")),
                  tied=bool(data.get("tie_word_embeddings", False)))
    if family == "gpt_neox":
        bias = bool(data.get("attention_bias", True))
        attention = Attention(heads=heads, kv_heads=heads, qk_dim=head_dim, v_dim=head_dim, qkv_bias=bias, o_bias=bias)
        return ModelSpec(**common, attention=attention, intermediate=int(get_field(data, "intermediate_size")),
                         gated=False, mlp_bias=True, layer_norm=True,
                         parallel_residual=bool(data.get("use_parallel_residual", True)))
    if family == "starcoder2":  # LayerNorm, grouped-query attention, a GELU MLP, biases on every projection
        bias = bool(data.get("use_bias", True))
        attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                              v_dim=head_dim, qkv_bias=bias, o_bias=bias)
        return ModelSpec(**common, attention=attention, intermediate=int(get_field(data, "intermediate_size")),
                         gated=False, mlp_bias=bias, layer_norm=True)
    if family == "olmo":
        return _olmo(data, common, heads, head_dim)
    if family in ("cohere", "cohere2"):
        return _cohere(data, common, heads, head_dim)
    if family.startswith("ernie"):
        return _ernie(data, common, heads, head_dim)
    if family.startswith(("deepseek", "glm4_moe")) or family in ("dots1", "mistral4", "glm_moe_dsa"):
        return deepseek_spec(data, common, heads, head_dim)
    readers = {"gpt_oss": gpt_oss_spec, "phimoe": phimoe_spec, "llama4_text": llama4_spec,
               **dict.fromkeys(_HYBRID, gated_deltanet_spec)}  # families with a reader of their own
    if family in readers:
        return readers[family](data, common, heads, head_dim)
    kv_heads = int(data.get("num_key_value_heads") or heads)
    bias = bool(data.get("attention_bias", False))
    qkv_bias = family == "qwen2" or (family == "qwen2_moe" and bool(data.get("qkv_bias", True))) or bias
    attention = Attention(heads=heads, kv_heads=kv_heads, qk_dim=head_dim, v_dim=head_dim, qkv_bias=qkv_bias,
                          o_bias=(bool(data.get("attention_out_bias", False)) if family == "seed_oss" else
                                  bias and family not in ("qwen2", "qwen2_moe", "glm", "glm4", "helium")),
                          qk_norm=family in _QK_NORM,
                          qk_norm_full=family in (*_OLMO, "minimax_m2"))
    dense: dict[str, Any] = dict(**common, attention=attention, mlp_bias=bool(data.get("mlp_bias", False)),
                                 post_norms=family in ("gemma2", "gemma3_text", "glm4"),
                                 nope_layers=nope_layers(data, layers) if family == "smollm3" else ())
    if family in _DENSE:
        return ModelSpec(**dense, intermediate=int(get_field(data, "intermediate_size")), gated=family not in _UNGATED)
    if family in ("mixtral", "olmoe", "minimax_m2", "granitemoe", "granitemoeshared", "hunyuan_v1_moe"):
        return every_layer_sparse(data, family, dense)
    experts = Experts(count=int(get_field(data, "num_experts", "num_local_experts")),
                      top_k=int(get_field(data, "num_experts_per_tok")),
                      intermediate=int(get_field(data, "moe_intermediate_size")),
                      shared_intermediate=int(data.get("shared_expert_intermediate_size") or 0)  # Qwen3-MoE: none,
                      if family == "qwen2_moe" else 0, shared_gate=family == "qwen2_moe")  # a gate even at width 0
    step = int(data.get("decoder_sparse_step") or 1)
    dense_only = set(data.get("mlp_only_layers") or ())
    moe = tuple(i for i in range(layers) if i not in dense_only and experts.count > 0 and (i + 1) % step == 0)
    return ModelSpec(**dense, intermediate=int(get_field(data, "intermediate_size")), experts=experts, moe_layers=moe)


def _olmo(data: Mapping[str, Any], common: dict[str, Any], heads: int, head_dim: int) -> ModelSpec:
    """AI2's OLMo 1 (``olmo``): LLaMA's layer, grouped-query attention and a gated MLP, with LayerNorms that hold no
    weight or bias, and biases on the four attention projections under ``attention_bias``. Its ``clip_qkv`` (each of
    q, k and v clamped in place, which keeps a copy of q and k before the rotary for the backward) is refused."""
    if data.get("clip_qkv") is not None:
        raise ModelConfigError(f"olmo with clip_qkv={data['clip_qkv']!r} clamps q, k and v in place, which keeps q "
                               "and k before the rotary embedding for the backward: the planner does not count them; "
                               "set clip_qkv to null to plan the model without it")
    bias = bool(data.get("attention_bias", False))
    attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                          v_dim=head_dim, qkv_bias=bias, o_bias=bias)
    return ModelSpec(**common, attention=attention, intermediate=int(get_field(data, "intermediate_size")),
                     layer_norm=True, norm_bias=False, norm_weights=False)


def _cohere(data: Mapping[str, Any], common: dict[str, Any], heads: int, head_dim: int) -> ModelSpec:
    """Cohere's Command R (``cohere``) and R7B / A (``cohere2``, sliding windows on three layers of four): one
    LayerNorm without a bias before attention and the gated MLP side by side, whose outputs one add sums into the
    residual stream; grouped-query attention, with Command R's ``use_qk_norm`` a LayerNorm per head with weights of
    its own; a tied head (its ``logit_scale`` is one multiply of the logits, no parameter)."""
    bias = bool(data.get("attention_bias", False))
    qk_norm = common["family"] == "cohere" and bool(data.get("use_qk_norm", False))
    attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                          v_dim=head_dim, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm, qk_norm_head_weights=qk_norm)
    return ModelSpec(**common, attention=attention, intermediate=int(get_field(data, "intermediate_size")),
                     layer_norm=True, norm_bias=False, parallel_residual=True, shared_norm=True)


def _ernie(data: Mapping[str, Any], common: dict[str, Any], heads: int, head_dim: int) -> ModelSpec:
    """Baidu's ERNIE 4.5: LLaMA's layer with biases on every projection under ``use_bias``; the MoE models
    (``ernie4_5_moe``) with ``moe_num_shared_experts`` shared experts (one gated MLP of that many times
    ``moe_intermediate_size``), the layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` (-1: the
    last) every ``moe_layer_interval``-th sparse, a softmax router over every expert whose top-``moe_k`` choice
    adds an untrained per-expert bias, the chosen probabilities renormalised, a bias on the head under
    ``use_bias`` (the dense model's head has none); and ``num_nextn_predict_layers`` multi-token-prediction
    modules (transformers builds none and skips the checkpoints' ``mtp`` weights when loading)."""
    bias = bool(data.get("use_bias", False))
    attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                          v_dim=head_dim, qkv_bias=bias, o_bias=bias)
    dense: dict[str, Any] = dict(**common, attention=attention, intermediate=int(get_field(data, "intermediate_size")),
                                 mlp_bias=bias)
    if common["family"] == "ernie4_5":
        return ModelSpec(**dense)
    count = int(get_field(data, "moe_num_experts", "num_experts", default=0))
    intermediate = int(get_field(data, "moe_intermediate_size"))
    experts = Experts(count=count, top_k=int(get_field(data, "moe_k", "num_experts_per_tok")),
                      intermediate=intermediate,
                      shared_intermediate=intermediate * int(data.get("moe_num_shared_experts") or 0),
                      shared_bias=bias, router_correction=True)
    layers = common["layers"]
    start, end = int(data.get("moe_layer_start_index") or 0), int(get_field(data, "moe_layer_end_index", default=-1))
    end = layers - 1 if end == -1 else end
    interval = int(data.get("moe_layer_interval") or 1)
    moe = tuple(i for i in range(layers) if count and start <= i <= end and (i + 1) % interval == 0)
    return ModelSpec(**dense, experts=experts if moe else None, moe_layers=moe, head_bias=bias,
                     mtp=int(data.get("num_nextn_predict_layers") or 0))
