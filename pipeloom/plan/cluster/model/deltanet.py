"""The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, OLMo hybrid): reading one from its config
(:func:`gated_deltanet_spec`) and what one of its Gated DeltaNet layers counts in attention's place (weights, FLOPs,
kept bytes), which :func:`pipeloom.plan.cluster.counts.layer_counts` adds to the layer's MLP and norms."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeloom.plan.cluster.model.fields import get_field
from pipeloom.plan.cluster.model.spec import GDN_CHUNK, Attention, Experts, LinearAttention, ModelSpec
from pipeloom.plan.errors import ModelConfigError

__all__ = ["gated_deltanet_spec", "linear_weights", "gdn_core_flops", "linear_flops", "linear_activations"]

_FP32 = 4  # bytes of one fp32 statistic (counts.STAT_BYTES)


def gated_deltanet_spec(data: Mapping[str, Any], common: dict[str, Any], heads: int, head_dim: int) -> ModelSpec:
    """Qwen3-Next (``qwen3_next``), Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``) and OLMo hybrid (``olmo_hybrid``):
    Gated DeltaNet on the layers ``layer_types`` marks ``"linear_attention"`` (by default three of every
    ``full_attention_interval``, 4; OLMo hybrid's every fourth, and its last where it has fewer than four layers),
    attention on the others. Qwen's attention is grouped-query attention with q/k norms per head and an output gate
    from a q projection twice as wide, biases on every projection under ``attention_bias``; its MLP a mixture of
    experts with a shared expert gated by a sigmoid (hidden -> 1) on every layer (Qwen3.5-MoE) or on Qwen2-MoE's
    layers (``decoder_sparse_step``, ``mlp_only_layers``: Qwen3-Next), or dense (Qwen3.5). Rotary embeddings turn a
    quarter of each head (``partial_rotary_factor``), which changes nothing counted. OLMo hybrid's attention is OLMo
    3's (q and k norms over the whole projections, no output gate), its MLP dense, its linear layers' sizes derived
    as transformers derives them where left out (the attention's heads; a key head of three quarters of the hidden
    size over them, a value head twice that), its write strength doubled (``linear_allow_neg_eigval``, on by
    default); its attention layers normalise each branch's output and its linear layers each branch's input, two
    norms a layer either way."""
    layers, family = common["layers"], common["family"]
    olmo = family == "olmo_hybrid"
    types = data.get("layer_types")
    if types is None:
        interval = int(data.get("full_attention_interval") or 4)
        types = ["linear_attention" if (n + 1) % interval else "full_attention" for n in range(layers)]
        if olmo and "full_attention" not in types:
            types[-1] = "full_attention"
    if not isinstance(types, list) or len(types) < layers or any(
            kind not in ("linear_attention", "full_attention") for kind in types[:layers]):
        raise ModelConfigError(f"{family}'s layer_types must give \"linear_attention\" or \"full_attention\" for each "
                               f"of its {layers} layers, got {types!r}")
    bias = bool(data.get("attention_bias", False))
    attention = Attention(heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads), qk_dim=head_dim,
                          v_dim=head_dim, qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_full=olmo,
                          output_gate=not olmo)
    linear = _deltanet_sizes(data, family, heads, common["hidden"])
    hybrid: dict[str, Any] = dict(**common, attention=attention, linear=linear,
                                  linear_layers=tuple(n for n in range(layers) if types[n] == "linear_attention"))
    if family in ("qwen3_5_text", "olmo_hybrid"):
        return ModelSpec(**hybrid, intermediate=int(get_field(data, "intermediate_size")))
    experts = Experts(count=int(get_field(data, "num_experts")), top_k=int(get_field(data, "num_experts_per_tok")),
                      intermediate=int(get_field(data, "moe_intermediate_size")),
                      shared_intermediate=int(data.get("shared_expert_intermediate_size") or 0), shared_gate=True)
    if family == "qwen3_5_moe_text":  # every layer's MLP is the experts' (no dense MLP: its width is never read)
        return ModelSpec(**hybrid, intermediate=experts.intermediate, experts=experts, moe_layers=tuple(range(layers)))
    step, dense_only = int(data.get("decoder_sparse_step") or 1), set(data.get("mlp_only_layers") or ())
    moe = tuple(n for n in range(layers) if n not in dense_only and experts.count > 0 and (n + 1) % step == 0)
    return ModelSpec(**hybrid, intermediate=int(get_field(data, "intermediate_size")), experts=experts,
                     moe_layers=moe)


def _deltanet_sizes(data: Mapping[str, Any], family: str, heads: int, hidden: int) -> LinearAttention:
    """The Gated DeltaNet of a hybrid's config: Qwen's sizes as given; OLMo hybrid's, where left out, as
    ``OlmoHybridConfig`` derives them (key and value heads the attention's, a key head ``int(0.75 hidden / key
    heads)``, a value head twice that)."""
    if family != "olmo_hybrid":
        return LinearAttention(key_heads=int(get_field(data, "linear_num_key_heads")),
                               value_heads=int(get_field(data, "linear_num_value_heads")),
                               key_dim=int(get_field(data, "linear_key_head_dim")),
                               value_dim=int(get_field(data, "linear_value_head_dim")),
                               conv_kernel=int(get_field(data, "linear_conv_kernel_dim")))
    key_heads = int(data.get("linear_num_key_heads") or heads)
    key_dim = int(data.get("linear_key_head_dim") or int(0.75 * hidden / key_heads))
    return LinearAttention(key_heads=key_heads, value_heads=int(data.get("linear_num_value_heads") or heads),
                           key_dim=key_dim, value_dim=int(data.get("linear_value_head_dim") or 2 * key_dim),
                           conv_kernel=int(get_field(data, "linear_conv_kernel_dim")),
                           negative_eigenvalues=bool(data.get("linear_allow_neg_eigval", True)))


def _deltanet(spec: ModelSpec) -> LinearAttention:
    assert spec.linear is not None, "a linear-attention layer of a model without Gated DeltaNet"
    return spec.linear


def linear_weights(spec: ModelSpec) -> tuple[int, int]:
    """``(matmul weight elements, other parameters)`` of one layer's Gated DeltaNet (transformers'
    ``GatedDeltaNet``): the input projection to the queries, keys, values, output gate and each value head's two
    scalars (Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, Qwen3.5's four projections, OLMo hybrid's six: the
    same matmuls), the
    output projection, no biases; the depthwise convolution's taps, each value head's ``dt_bias`` and ``A_log``, the
    gated RMSNorm's weight over a value head."""
    g, h = _deltanet(spec), spec.hidden
    return (h * (2 * g.keys + 2 * g.values + 2 * g.value_heads) + g.values * h,
            g.mixed * g.conv_kernel + 2 * g.value_heads + g.value_dim)


def gdn_core_flops(spec: ModelSpec, seq: int) -> float:
    """Forward matmul FLOPs of one layer's gated delta rule on one sequence, chunk by chunk as transformers'
    ``torch_chunk_gated_delta_rule`` and flash-linear-attention's ``chunk_gated_delta_rule`` run it (the sequence
    padded to whole chunks of ``C`` = :data:`~pipeloom.plan.cluster.model.spec.GDN_CHUNK`), per value head and chunk:
    the keys' and the queries' products with the chunk's keys (``2 C² dk`` each), the values' with the chunk's
    attention (``2 C² dv``), and the reads and the update of the ``dk x dv`` state (``2 C dk dv`` each, three);
    ``2 Hv Lp (2 C dk + C dv + 3 dk dv)`` in all. The triangular solve each chunk makes is not a matmul (the counter
    does not count it either)."""
    g = _deltanet(spec)
    padded = -(-seq // GDN_CHUNK) * GDN_CHUNK
    c, dk, dv = GDN_CHUNK, g.key_dim, g.value_dim
    return 2.0 * g.value_heads * padded * (2 * c * dk + c * dv + 3 * dk * dv)


def linear_flops(spec: ModelSpec, seq: int) -> tuple[float, float, float]:
    """F, I and W FLOPs of one layer's Gated DeltaNet beyond its projections, on one sequence: the gated delta rule
    (:func:`gdn_core_flops`; its backward the two gradient products of each of its matmuls, in I), and the causal
    depthwise convolution, ``2 C L K`` over its ``C`` channels and ``K`` taps in each of F, I (the input's gradient)
    and W (the taps')."""
    g = _deltanet(spec)
    core, conv = gdn_core_flops(spec, seq), 2.0 * g.mixed * seq * g.conv_kernel
    return core + conv, 2 * core + conv, conv


def linear_activations(spec: ModelSpec, width: int, stat: int) -> tuple[float, float]:
    """``(sequence, tensor)`` bytes per token of a Gated DeltaNet layer's mixer half as Megatron-Core's
    ``GatedDeltaNet`` keeps them (``megatron/core/ssm/gated_delta_net``, with the causal-conv1d and
    flash-linear-attention kernels; ``stat``: the bytes of its norm's statistics): the norm's input and output
    (+ 1/rms: the norm is fused into the input projection, which keeps its output for the weight gradient); the
    convolution's input, the queries, keys and values (the fused convolution and SiLU recompute the rest from it); the
    L2 norm's normalised queries and keys with an fp32 1/norm per key head; the decay's input and the write strength (a
    scalar each per value head); what the chunked kernel keeps (``ChunkGatedDeltaRuleFunction``'s
    ``save_for_backward``, fla-org/flash-linear-attention v0.5.1): the queries and keys repeated to every value head,
    the values, the chunked cumulative decay in fp32 and each chunk's solved ``(I + A)^{-1}``,
    :data:`~pipeloom.plan.cluster.model.spec.GDN_CHUNK` elements per value head; the kernel's output and the gated
    RMSNorm's 1/rms per value head, its output and the output gate (the product's inputs); the output projection's
    input. Under :attr:`~pipeloom.plan.cluster.model.spec.LinearAttention.negative_eigenvalues` the kernel is handed
    the write strength doubled, a copy kept beside the sigmoid's output."""
    g, h = _deltanet(spec), spec.hidden
    heads = g.value_heads
    elements = (g.mixed + 2 * g.keys + 2 * heads  # the convolution's input; the L2 norm's output; decay input, beta
                + 2 * heads * g.key_dim + g.values + GDN_CHUNK * heads  # the kernel's queries, keys, values and A
                + 4 * g.values  # the kernel's output, the norm's output, the gate, the output projection's input
                + (heads if g.negative_eigenvalues else 0))  # the kernel's doubled write strength
    return width * (2 * h) + stat, width * elements + _FP32 * (2 * g.key_heads + 2 * heads)  # 1/norms, decay, 1/rms
