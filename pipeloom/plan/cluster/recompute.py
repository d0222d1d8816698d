"""What ``recompute=selective`` keeps for the backward per token of a layer under each policy (``Job.selective``):
Megatron-Core's ``recompute_modules``, torchtitan's op-level and every-second-layer policies, DeepSeek-V3's. The
seconds each adds to a layer's backward are :func:`pipeloom.plan.cluster.layer_time.layer_times`'.

torchtitan's policies are ``op`` and ``layer`` (every second layer whole), DeepSeek-V3's ``deepseek``.
Megatron-Core's are any set of :data:`MEGATRON_MODULES` (``TransformerConfig.recompute_modules``; its default,
``core_attn``, is :mod:`counts`' ``selective``), each as its layer spec with Transformer Engine builds the layer:

- ``core_attn``: the attention core runs again in the backward (normal checkpointing): its q, k, v are the
  checkpoint's inputs and its output the output projection's input, so only its log-sum-exp per head is not kept;
  a Gated DeltaNet layer's core is not checkpointed by it (Megatron-Core reads ``core_attn`` in its attention modules
  only): it keeps everything;
- ``layernorm``: the norms Megatron-Core runs as modules of their own, the pre-MLP norm of an MoE layer (the router
  reads its output too) and the attention's norm before multi-head latent attention (two down-projections read
  it), discard their output and recompute it (output-discarding checkpointing): h elements each. A norm fused
  into the linear layer after it (Transformer Engine's ``LayerNormLinear``: standard attention's qkv, a dense MLP's
  first projection) keeps its output for the weight gradient: nothing to discard;
- ``moe_act``: the routed experts' activation discards its output (the second projection's input, I per routed
  copy) and recomputes it from the first projection's output, which is kept;
- ``mla_up_proj``: MLA's up-projections and rotary embedding discard q, k and v and recompute them from the
  latents, which are kept;
- ``mlp``: a dense layer's MLP, its norm fused into it, runs again (normal checkpointing): it keeps its input
  only (the residual stream, kept anyway), not the norm's output and statistic nor the MLP's intermediates (with
  one norm before both branches, Cohere's, the attention still keeps that norm's output);
- ``moe``: an MoE layer's MLP runs again, its all-to-alls included: it keeps its input (the pre-MLP norm's output)
  and nothing of the router, the routed copies or the shared experts;
- ``shared_experts``: the shared experts run again: their intermediates are not kept.

Not counted: the one module's activations a normal checkpoint rebuilds at a time during the backward.
"""

from __future__ import annotations

from pipeloom.plan.cluster.counts import (
    STAT_BYTES,
    Activations,
    LayerCounts,
    index_bytes,
    layer_counts,
    mlp_activations,
    moe_activations,
    mtp_activations,
    mtp_block,
    norm_stats,
)
from pipeloom.plan.cluster.model.kinds import block_kind, is_linear, is_sparse
from pipeloom.plan.cluster.model.spec import ModelSpec
from pipeloom.plan.errors import LayoutError

__all__ = ["MEGATRON_MODULES", "POLICIES", "SEARCHED", "FP8_BYTES", "module_sets", "recompute_depths",
           "megatron_modules", "layer_modules",
           "idle_modules", "megatron_activations", "kept_activations", "op_activations", "deepseek_activations",
           "separate_norms", "fp8_saved_inputs"]

MEGATRON_MODULES = ("core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts")
"""Megatron-Core's ``recompute_modules`` (module docstring), in the order :func:`megatron_modules` writes them."""
POLICIES = ("op", "layer", "deepseek")
"""The selective policies other than a set of Megatron-Core modules."""
SEARCHED = "search"
"""``selective="search"`` / ``recompute_layers="search"``: the planner tries each of :func:`module_sets` /
:func:`recompute_depths` (both: every pair, without planning each: ``api._variants``) and keeps the fastest plan."""
_CHEAPEST_FIRST = ("layernorm", "moe_act", "mla_up_proj", "shared_experts", "mlp", "core_attn", "moe")
"""Megatron-Core's modules by what their recomputation runs: elementwise kernels (the norms, the experts'
activation), GEMMs (MLA's up-projections, the shared experts, a dense MLP), the attention core (which saves only its
statistics under flash attention), the whole MoE MLP with its all-to-alls."""


def megatron_modules(selective: str) -> tuple[str, ...]:
    """The Megatron-Core modules ``selective`` names, comma-separated (``"layernorm,moe_act"``), in
    :data:`MEGATRON_MODULES`' order; () for one of :data:`POLICIES`; LayoutError for anything else."""
    if selective in POLICIES:
        return ()
    names = [name.strip() for name in str(selective).split(",")]
    unknown = [name for name in names if name not in MEGATRON_MODULES]
    if unknown or len(set(names)) != len(names):
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "a module named twice"
        raise LayoutError(f"selective={selective!r}: {what}; use Megatron-Core's recompute_modules comma-separated "
                          f"(from {', '.join(MEGATRON_MODULES)}), 'op' (torchtitan's op-level policy), 'layer' "
                          "(every second layer whole), 'deepseek' (DeepSeek-V3's) or 'search' alone (the model's "
                          "module sets tried)")
    return tuple(module for module in MEGATRON_MODULES if module in names)


def layer_modules(selective: str) -> tuple[str, ...]:
    """The Megatron-Core modules the policy ``selective`` recomputes in a layer it has no rule of its own for: its
    modules; under torchtitan's ``op`` (whose rule is a dense layer's) the attention core, as in an MoE layer."""
    return ("core_attn",) if selective == "op" else megatron_modules(selective)


def module_sets(spec: ModelSpec) -> list[tuple[str, ...]]:
    """The Megatron-Core module sets ``selective="search"`` tries on ``spec``: Megatron-Core's default
    (``core_attn``), then the modules the model has added one at a time in :data:`_CHEAPEST_FIRST`'s order, so each
    set keeps less than the one before at a higher price (each in :data:`MEGATRON_MODULES`' order)."""
    have = [module for module in _CHEAPEST_FIRST if not idle_modules(spec, (module,))]
    sets: list[tuple[str, ...]] = [("core_attn",)]
    for n in range(1, len(have) + 1):
        modules = tuple(module for module in MEGATRON_MODULES if module in have[:n])
        if modules not in sets:
            sets.append(modules)
    return sets


def recompute_depths(spec: ModelSpec) -> list[int]:
    """The :attr:`~pipeloom.plan.cluster.job.Job.recompute_layers` ``recompute_layers="search"`` tries on ``spec``:
    0 (every layer), then 1, 2, 4, ... below the model's decoder layers (a stage recomputing as many as it holds
    recomputes them all)."""
    return [0, *(2**k for k in range(spec.layers.bit_length()) if 2**k < spec.layers)]


def separate_norms(spec: ModelSpec, kind: str) -> int:
    """How many of a layer's norms Megatron-Core runs as modules of their own (``layernorm`` recomputes them):
    the pre-MLP norm of an MoE layer, the attention's norm before multi-head latent attention."""
    return int(spec.attention.latent) + int(block_kind(kind) == "moe")


def idle_modules(spec: ModelSpec, modules: tuple[str, ...]) -> list[tuple[str, str]]:
    """Of ``modules``, those that recompute nothing in ``spec``'s layers, each with why (``(module, "has no
    ...")``)."""
    ex, moe, dense = spec.experts, bool(spec.moe_layers), spec.dense_layers > 0
    idle = {"layernorm": (not spec.attention.latent and not moe,
                          "fuses every norm into the linear layer after it (no MoE layer, no latent attention)"),
            "moe_act": (not moe, "has no MoE layer"),
            "mla_up_proj": (not spec.attention.latent, "has no multi-head latent attention"),
            "mlp": (not dense, "has no dense MLP"),
            "moe": (not moe, "has no MoE layer"),
            "shared_experts": (ex is None or not ex.shared_intermediate, "has no shared experts")}
    return [(module, idle[module][1]) for module in modules if module in idle and idle[module][0]]


def megatron_activations(spec: ModelSpec, kind: str, modules: tuple[str, ...], *, width: int = 2) -> Activations:
    """Bytes per token a decoder layer of ``kind`` keeps when Megatron-Core recomputes ``modules`` (module
    docstring): its :mod:`counts` ``none`` activations, less what each module does not keep."""
    none = layer_counts(spec, kind, 1, width=width).activations["none"]
    a, h, attends, kind = spec.attention, spec.hidden, not is_linear(kind), block_kind(kind)
    sequence, tensor = none.sequence, none.tensor
    if "core_attn" in modules and attends:  # Megatron-Core's Gated DeltaNet has no core checkpoint
        tensor -= STAT_BYTES * a.heads
    if "layernorm" in modules:
        sequence -= width * h * separate_norms(spec, kind)
    if "mla_up_proj" in modules and a.latent:
        tensor -= width * (a.heads * a.qk_dim + a.kv_heads * (a.qk_dim + a.v_dim))
    if kind == "dense" and "mlp" in modules:
        if not spec.shared_norm:  # one norm before both branches: its output stays kept for the attention
            sequence -= width * h + norm_stats(spec)
        tensor -= mlp_activations(spec.intermediate, gated=spec.gated, width=width)
    if kind == "moe" and spec.experts is not None:
        ex = spec.experts
        if "moe" in modules:
            tensor -= moe_activations(spec, width=width)
        else:
            tensor -= (width * ex.top_k * ex.intermediate if "moe_act" in modules else 0.0) + (
                mlp_activations(ex.shared_intermediate, gated=True, width=width) if "shared_experts" in modules
                else 0.0)
    return Activations(sequence=sequence, tensor=tensor, replicated=none.replicated)


def kept_activations(selective: str, spec: ModelSpec, counts: LayerCounts, recompute: str, *,
                     fp8: tuple[float, bool] | None = None) -> Activations:
    """What one token keeps in a layer of ``counts`` under ``recompute``: the counts' own; under ``selective`` as
    the policy ``selective`` says: Megatron-Core's modules (:func:`megatron_activations`), every second layer
    whole (``layer``: half a layer's ``none`` and half its ``full``, on average), torchtitan's op policy in a
    dense layer (``op``: :func:`op_activations`; an MoE layer keeps the attention core's), or DeepSeek-V3's
    (``deepseek``: :func:`deepseek_activations`); a multi-token-prediction module keeps its block's under the
    policy (:func:`~pipeloom.plan.cluster.counts.mtp_activations`). ``fp8``: Transformer Engine's FP8 GEMMs
    keeping the inputs they quantized (``(bytes per element, delayed scaling)``: :func:`fp8_saved_inputs`), in a
    decoder layer without recomputation or under Megatron-Core's modules."""
    if fp8 is not None and counts.kind not in ("embedding", "head", "mtp") and (
            recompute == "none" or (recompute == "selective" and selective not in POLICIES)):
        kept = kept_activations(selective, spec, counts, recompute)
        more = fp8_saved_inputs(spec, counts.kind, megatron_modules(selective) if recompute == "selective" else (),
                                quantized=fp8[0], delayed=fp8[1])
        return Activations(sequence=kept.sequence + more.sequence, tensor=kept.tensor + more.tensor,
                           replicated=kept.replicated)
    if recompute != "selective" or counts.kind in ("embedding", "head"):
        return counts.activations[recompute]
    if selective == "layer":
        none, full = counts.activations["none"], counts.activations["full"]
        return Activations(sequence=(none.sequence + full.sequence) / 2, tensor=(none.tensor + full.tensor) / 2,
                           replicated=(none.replicated + full.replicated) / 2)
    if counts.kind == "mtp":
        return mtp_activations(spec, recompute, _block(selective, spec, mtp_block(spec)))
    return _block(selective, spec, counts.kind)


SCORE_BYTES = 5
"""Bytes one attention score keeps for the backward with the scores in HBM: the softmax output (2), the dropout
mask (1) and the dropout output (2), Korthikanti et al. 2022's ``5 a s^2 b`` (Eq. 1; Megatron-LM's core attention with
its attention dropout, as :func:`~pipeloom.plan.cluster.efficiency.materialized_attention_seconds` prices it)."""


def kept_scores(kind: str, recompute: str, selective: str, *, heads: int, queries: int, keys: int) -> float:
    """Bytes a layer of ``kind`` keeps of its materialized attention scores for one micro-batch on one GPU (``heads``
    per GPU, ``queries`` rows on it against ``keys``): :data:`SCORE_BYTES` each where its attention core is not run
    again (none under ``full`` recomputation or where ``selective`` recomputes ``core_attn``; half under ``layer``);
    none in a layer without attention (the embedding, the head, Gated DeltaNet)."""
    if block_kind(kind) not in ("dense", "moe") or is_linear(kind) or recompute == "full":
        return 0.0
    share = 1.0
    if recompute == "selective":
        share = 0.5 if selective == "layer" else 1.0 if selective in POLICIES else float(
            "core_attn" not in megatron_modules(selective))
    return share * SCORE_BYTES * heads * queries * keys


def fp8_saved_inputs(spec: ModelSpec, kind: str, modules: tuple[str, ...], *, quantized: float, delayed: bool,
                     width: int = 2) -> Activations:
    """What one token of a decoder layer of ``kind`` keeps beyond its BF16 counts (negative: less) where Transformer
    Engine's FP8 GEMMs keep, for the weight gradient, the input they quantized (``quantized`` bytes per element, its
    column-wise copy: ``transformer_engine/pytorch/module/linear.py``) in place of the BF16 input, as Megatron-Core's
    layers run them with ``modules`` recomputed. The BF16 tensor goes where nothing else keeps it: the attention norm's
    output (its fused qkv projection's input; read by the MLP's too under one norm before both), a dense MLP's norm
    output and its down projection's input, each routed copy's expert input and, unless ``moe_act`` runs again, its
    activation (under ``moe_act`` Megatron-Core has the down projection keep the BF16 input it then discards:
    ``set_save_original_input``), a shared expert's down projection input. Kept more: a shared expert's first
    projection keeps its own copy of the pre-MLP norm's output, which the router keeps in BF16 (unless ``layernorm``
    runs again: then it keeps the original). The output projection keeps the BF16 attention output the core keeps
    (``set_save_original_input``) except under ``delayed`` scaling, where it keeps its own copy: more beside the
    core's output, less where the core runs again (``core_attn``) or an output gate's product is its input. The
    attention half of a layer with multi-head latent attention or Gated DeltaNet, whose projections Megatron-Core
    sets apart, is left as counted (its MLP half is not), and so is what ``mlp`` or ``moe`` recomputes whole."""
    a, h, block = spec.attention, spec.hidden, block_kind(kind)
    if block not in ("dense", "moe"):
        return Activations(sequence=0.0, tensor=0.0)
    less = width - quantized  # per element of an input only its GEMM keeps
    standard = not a.latent and not is_linear(kind)
    readers = 2 if spec.shared_norm and "mlp" not in modules else 1  # the GEMMs reading the attention norm's output
    sequence = -(width - readers * quantized) * h if standard else 0.0
    tensor = 0.0
    if delayed and standard:
        out = a.gate or a.heads * a.v_dim
        tensor += -less * out if ("core_attn" in modules or a.gate) else quantized * out
    if block == "dense" and "mlp" not in modules:
        sequence -= 0.0 if spec.shared_norm else less * h
        tensor -= less * spec.intermediate
    ex = spec.experts
    if block == "moe" and ex is not None and "moe" not in modules:
        tensor -= less * ex.top_k * (h + (0 if "moe_act" in modules else ex.intermediate))
        if ex.shared_intermediate and "shared_experts" not in modules:
            tensor -= less * ex.shared_intermediate
            sequence += 0.0 if "layernorm" in modules else quantized * h
    return Activations(sequence=sequence, tensor=tensor)


def _block(selective: str, spec: ModelSpec, kind: str) -> Activations:
    """What one token keeps in a decoder layer of ``kind`` under the policy ``selective`` (not ``layer``); a layer
    running an indexer keeps its choice under every policy (:func:`~pipeloom.plan.cluster.counts.index_bytes`); a
    Gated DeltaNet layer under ``op`` takes the policy's MoE-layer rule (the attention core's), which recomputes
    nothing there."""
    if selective == "deepseek":  # (refused for models without multi-head latent attention: no Gated DeltaNet)
        return deepseek_activations(spec, kind)
    if selective == "op" and block_kind(kind) == "dense" and not is_linear(kind):
        kept = op_activations(spec)
        return Activations(sequence=kept.sequence, tensor=kept.tensor,
                           replicated=kept.replicated + index_bytes(spec, kind))
    return megatron_activations(spec, kind, layer_modules(selective))  # from the counts: the choice is in them


def op_activations(spec: ModelSpec, *, width: int = 2) -> Activations:
    """Bytes per token a dense layer keeps under torchtitan's op-level selective checkpointing
    (``_apply_ac_to_transformer_block``: the layer checkpointed, its policy saving the outputs of the attention
    kernel and of every matmul "except every second mm", counted per layer; everything else runs again): the
    layer's input, and of its matmuls in call order (q, k, v, o, then gate, up, down, or up, down) the first,
    third, ...: q, v, gate and down of a gated layer (k, o and up run again, as the time prices them), the flash
    kernel's output and log-sum-exp. A row-parallel matmul's output (down) is its partial sum before the
    reduce-scatter: whole on every tp rank. Un-fused projections, as torchtitan's models are written."""
    a, h = spec.attention, spec.hidden
    outputs = [("tensor", a.heads * a.qk_dim), ("tensor", a.kv_heads * a.qk_dim), ("tensor", a.kv_heads * a.v_dim),
               ("replicated", h)]
    outputs += ([("tensor", spec.intermediate)] * 2 if spec.gated else [("tensor", spec.intermediate)])
    outputs.append(("replicated", h))
    kept = {"tensor": width * a.heads * a.v_dim + STAT_BYTES * a.heads, "replicated": 0.0}  # the flash kernel's
    for where, size in outputs[::2]:
        kept[where] += width * size
    return Activations(sequence=float(width * h), tensor=kept["tensor"], replicated=kept["replicated"])


FP8_BYTES = 1 + 4 / 128
"""Bytes per element of an FP8 activation with DeepSeek-V3's fine-grained scaling (one fp32 scale per 1 x 128
tile: report sec. 3.3.2)."""
_E5M6 = 1.5
"""Bytes per element of DeepSeek-V3's 12-bit E5M6 format (report sec. 3.3.4)."""


def deepseek_activations(spec: ModelSpec, kind: str) -> Activations:
    """Bytes per token a decoder layer keeps for the backward under DeepSeek-V3's memory savings (technical
    report, arXiv:2412.19437, sec. 3.2.3 and 3.3.4): every RMSNorm and MLA's up-projections are recomputed
    in the backward (their outputs, q, k, v included, are not kept: each norm's input, the residual stream,
    and MLA's latents, ``c_q``, ``c_kv`` and the rotary key, are); the attention output (the output projection's
    input, also read by the attention backward) is kept in E5M6; the MoE SwiGLU's input is cached in FP8
    and its output recomputed; the inputs of the other linear layers (the experts' dispatched tokens, a dense
    MLP's down-projection input) are cached in FP8. Statistics: the attention's log-sum-exp per head and the
    router's fp32 scores. Only the low-rank paths of MLA and a gated MLP are described; another model is
    priced by its :mod:`counts` activations. A layer of DeepSeek's sparse attention runs its core in MLA's MQA mode
    (:func:`~pipeloom.plan.cluster.counts.sparse_core_dims`): the kernel's latent output is kept (``kv_rank`` a
    head, the value up-projection's input, which recomputes the output projection's), and its top-k indices."""
    a, h = spec.attention, spec.hidden
    sequence = 2 * (2.0 * h)  # the two norms' inputs (bf16), their outputs and 1/rms recomputed
    latents = 2.0 * (a.q_rank + a.kv_rank + a.rope_dim) if a.latent else 0.0
    output = a.kv_rank if a.latent and is_sparse(kind) else a.v_dim
    tensor = latents + _E5M6 * a.heads * output + 4.0 * a.heads
    replicated, kind = index_bytes(spec, kind), block_kind(kind)
    if kind == "moe":
        ex = spec.experts
        assert ex is not None, "moe layer of a dense model"
        # each token's top-k copies: the dispatched input and the SwiGLU input (gate, up) in FP8; the shared
        # expert's SwiGLU input likewise (its input is the recomputed norm output); the router's scores
        tensor += (FP8_BYTES * ex.top_k * (h + 2 * ex.intermediate) + FP8_BYTES * 2 * ex.shared_intermediate
                   + 4.0 * ex.count)
    else:  # a dense gated MLP: the SwiGLU input in bf16, its output (the down projection's input) in FP8
        tensor += 2.0 * 2 * spec.intermediate + FP8_BYTES * spec.intermediate
    return Activations(sequence=sequence, tensor=tensor, replicated=replicated)
