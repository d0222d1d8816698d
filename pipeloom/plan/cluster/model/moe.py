"""The mixture-of-experts families whose layers differ from LLaMA's beyond the MLP (read by
:func:`pipeloom.plan.cluster.model.reader.model_spec`): Mixtral-like models with every layer sparse, DeepSeek's
(MLA, shared experts, group-limited routing), gpt-oss (sinks, biased experts), Phi-3.5-MoE (the sparsemixer) and
Llama 4 (chunked attention, NoPE layers, a sigmoid router over the top-k logits)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeloom.plan.cluster.model.fields import get_field, nope_layers, rate_on, same_per_layer
from pipeloom.plan.cluster.model.spec import Attention, Experts, Indexer, ModelSpec
from pipeloom.plan.errors import ModelConfigError

__all__ = ["every_layer_sparse", "deepseek_spec", "gpt_oss_spec", "phimoe_spec", "llama4_spec"]


def every_layer_sparse(data: Mapping[str, Any], family: str, dense: dict[str, Any]) -> ModelSpec:
    """Mixtral, OLMoE, MiniMax-M2, Granite MoE and Hunyuan MoE: every layer an MoE of ``intermediate_size`` gated
    experts (the layer's attention and norms in ``dense``); Granite MoE's router a softmax over the top-k logits, and
    its shared MLP (``shared_intermediate_size``, 0: none); Hunyuan's ``num_experts`` experts, its ``moe_topk`` per
    token (each given once or per layer, the same for every layer) and one shared MLP of ``intermediate_size``, as
    transformers builds it (the checkpoints' ``moe_intermediate_size`` and ``num_shared_expert`` lists are not
    read by transformers' model either)."""
    granite, hunyuan = family.startswith("granitemoe"), family == "hunyuan_v1_moe"
    intermediate = int(get_field(data, "intermediate_size"))
    shared = intermediate if hunyuan else int(data.get("shared_intermediate_size") or 0) if granite else 0
    experts = Experts(count=same_per_layer(data, "num_local_experts", "num_experts"),
                      top_k=same_per_layer(data, "num_experts_per_tok", "moe_topk"),
                      intermediate=intermediate, softmax_after_top_k=granite, shared_intermediate=shared)
    return ModelSpec(**dense, intermediate=experts.intermediate, experts=experts,
                     moe_layers=tuple(range(dense["layers"])))


def deepseek_spec(data: Mapping[str, Any], common: dict[str, Any], heads: int, head_dim: int) -> ModelSpec:
    """DeepSeek-V2/V3, DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) with DeepSeek's sparse attention
    (:class:`~pipeloom.plan.cluster.model.spec.Indexer`; their dense layers those ``mlp_layer_types`` calls ``"dense"``,
    by default the first ``first_k_dense_replace``), GLM-4.7-Flash (``glm4_moe_lite``) and Mistral 4 (``mistral4``:
    DeepSeek-V3's layers under DeepSeek-V2's softmax router, a position-dependent scale on the queries, no multi-token
    prediction) with MLA attention, and GLM-4.5 (``glm4_moe``) and dots.llm1 (``dots1``) with grouped-query attention of
    ``head_dim``, q/k norms per head (GLM-4.5's with ``use_qk_norm``): shared experts, the first
    ``first_k_dense_replace`` layers dense (GLM-4.7-Flash: the layers its ``mlp_layer_types`` calls ``"dense"``, by
    default the first), group-limited routing, and ``num_nextn_predict_layers`` multi-token-prediction modules (the
    family's default where the config leaves the field out: one for DeepSeek-V3 and GLM-4.5, none for DeepSeek-V2,
    GLM-4.7-Flash and Mistral 4, whose transformers configs have no such field)."""
    if common["family"] in ("glm4_moe", "dots1"):
        attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                              v_dim=head_dim, qkv_bias=bool(data.get("attention_bias", False)),
                              qk_norm=common["family"] == "dots1" or bool(data.get("use_qk_norm", False)))
    else:
        nope, rope = int(get_field(data, "qk_nope_head_dim")), int(get_field(data, "qk_rope_head_dim"))
        attention = Attention(heads=heads, kv_heads=heads, qk_dim=nope + rope, v_dim=int(get_field(data, "v_head_dim")),
                              qkv_bias=bool(data.get("attention_bias", False)), latent=True,
                              q_rank=int(data.get("q_lora_rank") or 0), kv_rank=int(get_field(data, "kv_lora_rank")),
                              rope_dim=rope)
    routed = int(get_field(data, "n_routed_experts", default=0))
    moe_intermediate = int(get_field(data, "moe_intermediate_size"))
    experts = Experts(count=routed, top_k=int(get_field(data, "num_experts_per_tok")), intermediate=moe_intermediate,
                      shared_intermediate=moe_intermediate * int(data.get("n_shared_experts") or 0),
                      groups=int(data.get("n_group") or 1),
                      group_top_k=int(data.get("topk_group") or 0) if int(data.get("n_group") or 1) > 1 else 0)
    first_dense = int(data.get("first_k_dense_replace") or 0)
    freq = int(data.get("moe_layer_freq") or 1)
    layers = common["layers"]
    moe = tuple(i for i in range(layers) if routed and i >= first_dense and i % freq == 0)
    if common["family"] in ("glm4_moe_lite", *_SPARSE_ATTENTION):  # "dense" / "sparse" per layer
        types = data.get("mlp_layer_types") or (["dense"] + ["sparse"] * (layers - 1)  # GLM-4.7-Flash's default
                                                if common["family"] == "glm4_moe_lite" else
                                                ["dense" if i < first_dense else "sparse" for i in range(layers)])
        moe = tuple(i for i, kind in enumerate(types[:layers]) if routed and kind == "sparse")
    sparse: dict[str, Any] = {}
    if common["family"] in _SPARSE_ATTENTION:
        indexer = Indexer(heads=int(get_field(data, "index_n_heads")), dim=int(get_field(data, "index_head_dim")),
                          topk=int(get_field(data, "index_topk")))
        sparse = dict(indexer=indexer, indexer_layers=_indexer_layers(data, common["family"], layers))
    return ModelSpec(**common, attention=attention, intermediate=int(get_field(data, "intermediate_size")),
                     experts=experts if routed else None, moe_layers=moe if routed else (),
                     mtp=int(data.get("num_nextn_predict_layers") or 0), **sparse)


_SPARSE_ATTENTION = ("deepseek_v32", "glm_moe_dsa")
"""The families with DeepSeek's sparse attention (an indexer and top-k attention on every layer)."""


def _indexer_layers(data: Mapping[str, Any], family: str, layers: int) -> tuple[int, ...]:
    """The layers that run an indexer of their own, as transformers builds DeepSeek-V3.2 (every layer) and GLM-5
    (``glm_moe_dsa``: the ``"full"`` entries of ``indexer_types``, else of ``index_topk_pattern``, ``"F"`` or
    ``"S"`` per layer, else every ``index_topk_freq``-th layer counted from ``index_skip_topk_offset - 1``, the
    layers before it all full; the others ``"shared"``, reusing the last full layer's top-k)."""
    if family != "glm_moe_dsa":
        return tuple(range(layers))
    types = data.get("indexer_types")
    if types is None and data.get("index_topk_pattern") is not None:
        pattern = data["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        offset = data.get("index_skip_topk_offset")
        freq, offset = max(int(data.get("index_topk_freq") or 1), 1), 2 if offset is None else int(offset)
        return tuple(i for i in range(layers) if max(i - offset + 1, 0) % freq == 0)
    if not isinstance(types, (list, tuple)) or any(kind not in ("full", "shared") for kind in types[:layers]) \
            or len(types) < layers:
        raise ModelConfigError(f"indexer_types must give \"full\" or \"shared\" for each of the {layers} layers, "
                               f"got {types!r}")
    return tuple(i for i, kind in enumerate(types[:layers]) if kind == "full")


def gpt_oss_spec(data: Mapping[str, Any], common: dict[str, Any], heads: int, head_dim: int) -> ModelSpec:
    """gpt-oss: grouped-query attention with biased projections and a sink logit per head, every layer an MoE
    of biased SwiGLU experts (``intermediate_size`` each) under a biased router that takes the top-k logits
    before its softmax; no shared expert."""
    bias = bool(data.get("attention_bias", True))
    attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                          v_dim=head_dim, qkv_bias=bias, o_bias=bias, sinks=True)
    experts = Experts(count=int(get_field(data, "num_local_experts", "num_experts")),
                      top_k=int(get_field(data, "num_experts_per_tok")),
                      intermediate=int(get_field(data, "intermediate_size")),
                      bias=True, softmax_after_top_k=True)
    return ModelSpec(**common, attention=attention, intermediate=experts.intermediate, experts=experts,
                     moe_layers=tuple(range(common["layers"])))


def phimoe_spec(data: Mapping[str, Any], common: dict[str, Any], heads: int, head_dim: int) -> ModelSpec:
    """Phi-3.5-MoE: Mixtral's layer under LayerNorms with biases, q/k/v/o biases under ``attention_bias``, a head
    bias under ``lm_head_bias``, every layer an MoE of ``intermediate_size`` gated experts whose router is the
    sparsemixer (always the top 2: ``num_experts_per_tok`` must say so), with ``input_jitter_noise`` in training."""
    top_k = int(get_field(data, "num_experts_per_tok"))
    if top_k != 2:
        raise ModelConfigError(f"phimoe routes each token to 2 experts (its sparsemixer picks exactly two), but "
                               f"num_experts_per_tok is {top_k}: set it to 2")
    bias = bool(data.get("attention_bias", False))
    attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                          v_dim=head_dim, qkv_bias=bias, o_bias=bias)
    experts = Experts(count=int(get_field(data, "num_local_experts", "num_experts")), top_k=top_k,
                      intermediate=int(get_field(data, "intermediate_size")), sparsemixer=True,
                      input_jitter=rate_on(data, "input_jitter_noise", "a noise magnitude"))
    return ModelSpec(**common, attention=attention, intermediate=experts.intermediate, experts=experts,
                     moe_layers=tuple(range(common["layers"])), layer_norm=True,
                     head_bias=bool(data.get("lm_head_bias", False)))


def llama4_spec(data: Mapping[str, Any], common: dict[str, Any], heads: int, head_dim: int) -> ModelSpec:
    """Llama 4's language model (``llama4_text``; a ``llama4`` checkpoint's ``text_config``): grouped-query attention
    (q/k/v/o biases under ``attention_bias``); rotary embeddings on the layers ``no_rope_layers`` marks 1 (by default
    all but every ``no_rope_layer_interval``-th), each followed by a weightless L2 norm of q and k per head under
    ``use_qk_norm``, and attending in chunks of ``attention_chunk_size`` tokens (the ``"chunked_attention"`` layers
    of ``layer_types``); the NoPE layers attend to the whole causal prefix. The MoE layers (``moe_layers``, by default
    every ``interleave_moe_layer_step``-th) hold ``num_local_experts`` gated experts of ``intermediate_size`` under a
    router taking each token's top-``num_experts_per_tok`` logits through a sigmoid, and a shared expert of the same
    size; the dense layers an MLP of ``intermediate_size_mlp``. transformers runs every expert on every token (a
    reference implementation); the planner counts what training frameworks run, each token's top-k. The NoPE layers'
    query temperature (``attn_temperature_tuning``: one fp32 factor per position) is folded into a kernel and not
    counted."""
    layers = common["layers"]
    nope = nope_layers(data, layers, empty_is_default=True)
    chunk = data.get("attention_chunk_size")
    types = data.get("layer_types") or ["chunked_attention" if n not in nope and chunk else "full_attention"
                                        for n in range(layers)]
    chunked = tuple(n for n, kind in enumerate(types[:layers]) if kind == "chunked_attention")
    size = chunk if isinstance(chunk, int) and not isinstance(chunk, bool) else 0
    if chunked and size <= 0:
        raise ModelConfigError(f"attention_chunk_size must be a positive number of tokens for the chunked_attention "
                               f"layers, got {chunk!r}")
    bias = bool(data.get("attention_bias", False))
    qk_norm = bool(data.get("use_qk_norm", True))
    attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                          v_dim=head_dim, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm, qk_norm_weightless=qk_norm,
                          qk_norm_with_rope=qk_norm)
    intermediate = int(get_field(data, "intermediate_size"))
    experts = Experts(count=int(get_field(data, "num_local_experts", "num_experts")),
                      top_k=int(get_field(data, "num_experts_per_tok")), intermediate=intermediate,
                      shared_intermediate=intermediate, softmax_after_top_k=True)
    step = int(data.get("interleave_moe_layer_step") or 1)
    given = data.get("moe_layers")
    moe = tuple(sorted(set(given))) if given is not None else tuple(range(step - 1, layers, step))
    return ModelSpec(**common, attention=attention, intermediate=int(get_field(data, "intermediate_size_mlp")),
                     experts=experts if moe else None, moe_layers=moe, window=size if chunked else 0,
                     window_layers=chunked, chunked=bool(chunked), nope_layers=nope)
