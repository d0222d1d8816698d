"""Exact counts per layer kind (embedding, dense layer, MoE layer, head with loss) of a :class:`ModelSpec`:
parameters, matmul FLOPs of the forward (F), the input-gradient backward (I) and the weight-gradient backward
(W), and the activation bytes kept for the backward under each recomputation mode.

FLOPs count matrix multiplications only (2 per multiply-add), as ``torch.utils.flop_counter`` does: every
linear layer, the router, the lm head, and the attention core's two products (QK^T and PV) over the full
s x s square (a causal kernel skips about half of it: :func:`attention_flops` says both); in a Gated DeltaNet layer
the chunked gated delta rule's products and its depthwise convolution instead
(:mod:`~pipeloom.plan.cluster.model.deltanet`). Norms, activations,
softmax, rotary embeddings and the loss are not counted (they are memory-bound: the estimator prices them by
bytes). I is every linear's dX plus the attention core's backward (dQ, dK, dP, dV); W is every weight's dW.

Activations follow Megatron-LM with fused kernels and flash attention (Korthikanti et al. 2022, section 4,
with flash attention keeping q, k, v, the output and the softmax statistics instead of the s x s scores):
what each layer keeps per token, split into the part sequence parallelism divides by tp (norm inputs and
outputs, the residual stream) and the part tensor parallelism always divides (q, k, v, attention output,
MLP intermediates). Context parallelism divides everything by cp.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from pipeloom.plan.cluster.model.deltanet import linear_activations, linear_flops, linear_weights
from pipeloom.plan.cluster.model.kinds import (
    attended_window,
    block_kind,
    has_indexer,
    is_linear,
    is_nope,
    is_sparse,
    layer_kinds,
)
from pipeloom.plan.cluster.model.spec import ModelSpec

__all__ = ["Recompute", "RECOMPUTE_MODES", "LayerCounts", "Activations", "layer_counts", "attention_flops",
           "attended_fraction", "indexer_weights", "model_params", "mtp_block", "mtp_activations",
           "index_bytes", "sparse_core_dims", "STAT_BYTES", "MASK_BYTES", "mlp_activations", "moe_activations",
           "norm_stats"]

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
STAT_BYTES = 4
"""Bytes of one fp32 statistic (a norm's 1/rms or mean, the softmax's log-sum-exp, a routing probability)."""
MASK_BYTES = 1
"""Bytes of one element of a dropout's mask (PyTorch keeps a bool per element, Megatron's bias-dropout-add a uint8)."""
_INDEX = 8  # bytes of one int64 index (a token's top-k expert choice, a routed copy's place in the permutation)
_KEY_INDEX = 4  # bytes of one int32 index of a key that DeepSeek's sparse attention reads


def index_bytes(spec: ModelSpec, kind: str) -> float:
    """Bytes per token a layer of ``kind`` keeps of its indexer's choice for the sparse attention's backward: the
    ``topk`` int32 key indices (padded, as the sparse kernels take them; whole on every tp rank), in the layer that
    runs the indexer (a reusing layer reads the same tensor)."""
    return float(_KEY_INDEX * spec.indexer.topk) if spec.indexer is not None and has_indexer(kind) else 0.0


def attended_fraction(seq: int, window: int = 0, *, chunked: bool = False) -> float:
    """The fraction of the ``seq x seq`` score square a causal kernel computes: the lower triangle (1/2), or under a
    sliding ``window`` shorter than ``seq`` the band ``(w·s - w²/2) / s²``, or in ``chunked`` attention (chunks of
    ``window`` tokens) each chunk's triangle, ``(n·w² + r²) / (2 s²)`` for n whole chunks and r tokens left. All
    leave out the diagonal's half (``min(s, w) / 2`` score pairs), as ``s²/2`` does for the triangle, so they agree
    at ``w = s``."""
    if window <= 0 or window >= seq:
        return 0.5
    if chunked:
        whole, left = divmod(seq, window)
        return (whole * window * window + left * left) / (2 * seq * seq)
    return (window * seq - window * window / 2) / (seq * seq)


@dataclass(frozen=True, kw_only=True, slots=True)
class Activations:
    """Bytes one token keeps for the backward in one layer, by how tensor parallelism divides them."""

    sequence: float
    """Divided by tp only under sequence parallelism (norm inputs/outputs, residual stream)."""
    tensor: float
    """Divided by tp always (q, k, v, attention output, MLP intermediates, per-head statistics)."""
    replicated: float = 0.0
    """Never divided by tp: MLA's low-rank latents, computed on every tp rank (its down-projections replicated)."""

    def per_gpu(self, *, tp: int, cp: int, sp: bool) -> float:
        """Bytes per token of the micro-batch on one GPU of a tp x cp group."""
        return (self.sequence / (tp if sp else 1) + self.tensor / tp + self.replicated) / cp


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCounts:
    """One layer kind's counts for one sequence of ``seq`` tokens."""

    kind: str
    """``embedding``, ``dense``, ``moe``, ``head`` or ``mtp`` (one multi-token-prediction module)."""
    params: int
    """Parameters (for ``moe``: all experts)."""
    expert_params: int
    """Of ``params``, those of the routed experts (sharded over ep)."""
    f: float
    """Forward matmul FLOPs for one sequence."""
    i: float
    """Input-gradient matmul FLOPs for one sequence."""
    w: float
    """Weight-gradient matmul FLOPs for one sequence."""
    attention_f: float
    """Of ``f``, the attention core's (full s x s square)."""
    attended_f: float
    """What a causal kernel computes of ``attention_f``: the lower triangle, or a sliding window's band
    (:func:`attended_fraction`)."""
    activations: dict[str, Activations]
    """Per recomputation mode, what one token keeps (the head: its logits' gradient input)."""
    index_f: float = 0.0
    """Of ``f``, the indexer's score products (DeepSeek's sparse attention: each query head's dot product with every
    key, then the heads' weighted sum) over the full s x s square; a causal kernel computes the triangle. The indexer
    runs forward only (no gradient), so I and W hold none of it."""

    @property
    def model_flops(self) -> float:
        """The layer's model FLOPs for one sequence: every matmul once (no recomputation) and the attention core's
        forward and backward over what a causal kernel computes (``attended_f``: the triangle, as the Llama 3 and
        DeepSeek reports count, a sliding window's band, or a sparse attention's top-k keys, at MLA's per-head
        products: the MQA mode's extra FLOPs, like recomputation's, are priced but not counted), where F and I hold
        the full square once and twice; an indexer's scores over their causal triangle, forward only."""
        return self.f + self.i + self.w - 3 * (self.attention_f - self.attended_f) - self.index_f / 2


def _norm(spec: ModelSpec) -> int:
    """Parameters of one norm over h: its weight, and a LayerNorm's bias (none without weights: OLMo 1)."""
    return 0 if not spec.norm_weights else 2 * spec.hidden if spec.layer_norm and spec.norm_bias else spec.hidden


def norm_stats(spec: ModelSpec) -> int:
    """Bytes of the fp32 statistics one norm keeps per token (over h, or per head for a q/k norm): LayerNorm's mean
    and 1/std, RMSNorm's 1/rms (Apex's and Transformer Engine's fused kernels keep the same as PyTorch's)."""
    return 2 * STAT_BYTES if spec.layer_norm else STAT_BYTES


def _qk_norm(spec: ModelSpec, kind: str) -> bool:
    """Whether a layer of ``kind`` normalises its q and k (not a NoPE layer's where the norm follows the rotary)."""
    a = spec.attention
    return a.qk_norm and not (a.qk_norm_with_rope and is_nope(kind))


def _attention_weights(spec: ModelSpec, kind: str = "dense") -> tuple[int, int]:
    """``(matmul weight elements, other parameters)`` of the attention of one layer of ``kind``."""
    a, h = spec.attention, spec.hidden
    if a.latent:
        q = h * a.q_rank + a.q_rank * a.heads * a.qk_dim if a.q_rank else h * a.heads * a.qk_dim
        kv = h * (a.kv_rank + a.rope_dim) + a.kv_rank * a.heads * (a.qk_dim - a.rope_dim + a.v_dim)
        out = a.heads * a.v_dim * h
        norms = (a.q_rank if a.q_rank else 0) + a.kv_rank
        bias = (a.q_rank + a.kv_rank + a.rope_dim + h) if a.qkv_bias else 0  # q_a, kv_a and o biases
        return q + kv + out, norms + bias
    if is_linear(kind):
        return linear_weights(spec)
    q, k, v = a.heads * a.qk_dim + a.gate, a.kv_heads * a.qk_dim, a.kv_heads * a.v_dim  # q: its gate's columns too
    o = a.heads * a.v_dim
    qk_norms = (0 if a.qk_norm_weightless else a.heads * a.qk_dim + k if a.qk_norm_full or a.qk_norm_head_weights
                else 2 * a.qk_dim) if _qk_norm(spec, kind) else 0
    other = (q + k + v if a.qkv_bias else 0) + (h if a.o_bias else 0) + qk_norms + (a.heads if a.sinks else 0)
    return h * (q + k + v) + o * h, other


def _mlp_weights(spec: ModelSpec, intermediate: int, *, gated: bool, bias: bool) -> tuple[int, int]:
    """``(matmul weight elements, bias parameters)`` of one MLP of ``intermediate`` width."""
    h = spec.hidden
    if gated:
        return 3 * h * intermediate, (2 * intermediate + h) if bias else 0
    return 2 * h * intermediate, (intermediate + h) if bias else 0


def indexer_weights(spec: ModelSpec) -> tuple[int, int]:
    """``(matmul weight elements, other parameters)`` of one layer's indexer (DeepSeek-V3.2's ``Indexer``): its query
    projection from MLA's query latent (``wq_b``: q_rank -> heads x dim), its one key head (``wk``: h -> dim) and
    the heads' weights (``weights_proj``: h -> heads), no biases; the key's LayerNorm (weight and bias)."""
    ix, a, h = spec.indexer, spec.attention, spec.hidden
    assert ix is not None, "an indexer of a model without DeepSeek's sparse attention"
    return a.q_rank * ix.heads * ix.dim + h * ix.dim + h * ix.heads, 2 * ix.dim


def _indexer_counts(spec: ModelSpec, kind: str, seq: int) -> tuple[int, int, float]:
    """``(parameters, matmul weight elements, score FLOPs over the square)`` of the indexer a layer of ``kind`` runs
    (zeros without one): its weights (:func:`indexer_weights`) and, forward only (it takes no gradient), each query
    head's dot product with every key and the heads' weighted sum, ``2 s^2 heads (dim + 1)``."""
    ix = spec.indexer
    if ix is None or not has_indexer(kind):
        return 0, 0, 0.0
    matmuls, other = indexer_weights(spec)
    return matmuls + other, matmuls, 2.0 * seq * seq * ix.heads * (ix.dim + 1)


def attention_flops(spec: ModelSpec, seq: int, *, causal: bool = False, window: int = 0) -> float:
    """Forward FLOPs of one layer's attention core on one sequence: QK^T and PV, ``2 s^2 heads (qk + v)``;
    ``causal`` counts only what a causal flash kernel computes: the lower triangle (half the square), or the band
    of a sliding ``window`` (:func:`attended_fraction`)."""
    a = spec.attention
    full = 2.0 * seq * seq * a.heads * (a.qk_dim + a.v_dim)
    return full * attended_fraction(seq, window) if causal else full


def _attention_activations(spec: ModelSpec, width: int, kind: str = "dense") -> tuple[float, float, float]:
    """``(sequence, tensor, replicated)`` bytes per token of the attention half of a layer (flash attention,
    ``width`` bytes per element): the norm's input and output (+ 1/rms) and q, k, v, the output (also the output
    projection's input) and the log-sum-exp per head; Qwen3's q/k norms keep their inputs (+ 1/rms per head, or
    one each for q and k where they span the whole projection: OLMo 2 and 3; Cohere's LayerNorms per head their
    mean and 1/std);
    MLA's two low-rank norms (q and kv latents) keep their inputs and outputs (+ 1/rms), on every tp rank. A layer of
    ``kind`` without the q/k norms (:func:`_qk_norm`) keeps neither."""
    a, h = spec.attention, spec.hidden
    sequence = width * (2 * h) + norm_stats(spec)
    qkv = a.heads * a.qk_dim + a.kv_heads * (a.qk_dim + a.v_dim)
    stats = a.heads
    replicated = 0.0
    if _qk_norm(spec, kind):
        qkv += (a.heads + a.kv_heads) * a.qk_dim
        if a.qk_norm_full:  # one 1/rms for q and one for k, over all heads: on every tp rank
            replicated += 2 * STAT_BYTES
        else:
            stats += (a.heads + a.kv_heads) * norm_stats(spec) // STAT_BYTES
    if a.latent:  # the latents' norms: input and output each, the up-projections' input being the output
        replicated += width * 2 * (a.q_rank + a.kv_rank) + STAT_BYTES * ((1 if a.q_rank else 0) + 1)
    if a.latent and is_sparse(kind):  # MLA's MQA mode (sparse_core_dims): the absorbed queries and the kernel's
        qk, v = sparse_core_dims(spec)  # latent output, the no-rope queries (the absorption's input) and the output
        # projection's input per head; the one latent key (the kv norm's output with the rotated rope part: rope more)
        return sequence, width * a.heads * (qk + v + a.qk_dim - a.rope_dim + a.v_dim) + STAT_BYTES * stats, \
            replicated + width * a.rope_dim
    # with an output gate: the gate, and the gated output the projection reads
    tensor = width * (qkv + a.heads * a.v_dim + 2 * a.gate) + STAT_BYTES * stats
    return sequence, tensor, replicated


def sparse_core_dims(spec: ModelSpec) -> tuple[int, int]:
    """``(qk, v)`` per-head dimensions of DeepSeek's sparse attention core, which runs MLA in its MQA mode
    (DeepSeek-V3.2 report, arXiv:2512.02556, sec. 2.1: each latent key-value entry shared by every query head, for
    the kernels' sake): the queries absorbed into the latent (``kv_rank + rope``) against the one latent key head,
    and the latent values (``kv_rank``), each head's output up-projected to ``v_dim`` after the kernel."""
    a = spec.attention
    return a.kv_rank + a.rope_dim, a.kv_rank


def mlp_activations(intermediate: int, *, gated: bool, width: int) -> float:
    """Bytes per token kept by one MLP of ``intermediate`` width: the up-projection's output (gate and up:
    2I, or I before GELU) and the activation's output, the down projection's input (I)."""
    return float(width * (3 * intermediate if gated else 2 * intermediate))


def mtp_block(spec: ModelSpec) -> str:
    """The kind of a multi-token-prediction module's decoder block: the last layer's (DeepSeek-V3: ``moe``)."""
    return layer_kinds(spec)[-1]


def mtp_activations(spec: ModelSpec, mode: str, block: Activations, *, width: int = 2) -> Activations:
    """Bytes per token one MTP module keeps under recomputation ``mode``, its block keeping ``block``: the two
    RMSNorms' inputs (the last hidden state, the next token's embedding) and outputs (whose concatenation is
    the projection's input) with their 1/rms, or under ``full`` only the two inputs; the block's; and its
    pass through the shared head (its own final norm's input and output, the fp32 logits of the second loss)."""
    h = spec.hidden
    head = layer_counts(spec, "head", 1, width=width).activations[mode]
    entry = width * 2 * h if mode == "full" else width * 4 * h + 2 * norm_stats(spec)
    return Activations(sequence=entry + block.sequence + head.sequence, tensor=block.tensor + head.tensor,
                       replicated=block.replicated)


def _mtp_counts(spec: ModelSpec, seq: int, width: int) -> LayerCounts:
    """One multi-token-prediction module (DeepSeek-V3 report sec. 2.2): two norms (hidden state, next token's
    embedding), the projection 2h -> h (no bias), one block of the last layer's kind and the shared head's
    final norm (the checkpoint's ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``); the embedding and the
    head's matrix are the main model's (no parameters here) but the head's matmul runs again on the module's
    tokens, for the second loss."""
    h = spec.hidden
    block = layer_counts(spec, mtp_block(spec), seq, width=width)
    head = layer_counts(spec, "head", seq, width=width)
    proj = 2.0 * seq * (2 * h) * h
    return LayerCounts(kind="mtp", params=2 * h * h + 3 * _norm(spec) + block.params,
                       expert_params=block.expert_params, f=block.f + proj + head.f, i=block.i + proj + head.i,
                       w=block.w + proj + head.w, attention_f=block.attention_f, attended_f=block.attended_f,
                       activations={m: mtp_activations(spec, m, a, width=width) for m, a in block.activations.items()},
                       index_f=block.index_f)


def _moe_mlp(spec: ModelSpec, width: int) -> tuple[int, int, int, int, float]:
    """``(matmul weight elements, other parameters, routed expert parameters, routed matmul weights per token,
    kept bytes per token)`` of a layer's MoE MLP: the router, the shared expert(s) and their gate, the routed
    experts (with their biases and the router's, gpt-oss)."""
    ex, h = spec.experts, spec.hidden
    assert ex is not None, "moe layer of a dense model"
    shared_mm, shared_bias = _mlp_weights(spec, ex.shared_intermediate, gated=True,
                                          bias=ex.shared_bias and ex.shared_intermediate > 0)
    expert_params = ex.count * (3 * h * ex.intermediate + ((2 * ex.intermediate + h) if ex.bias else 0))
    routed_mm = ex.top_k * 3 * h * ex.intermediate  # per token: its top-k experts
    mlp_mm = h * ex.count + shared_mm + (h if ex.shared_gate else 0)  # router, shared expert(s), their gate
    # the routed experts, the router's bias and its choice's correction bias, the shared expert(s)' biases
    mlp_other = expert_params + (ex.count if ex.bias else 0) + (ex.count if ex.router_correction else 0) + shared_bias
    return mlp_mm, mlp_other, expert_params, routed_mm, moe_activations(spec, width=width)


def moe_activations(spec: ModelSpec, *, width: int = 2) -> float:
    """Bytes per token a layer's MoE MLP keeps: each token's k routed copies (the expert's input h, gate+up 2I,
    activation I, and its output h, which the probability-weighted combine keeps for the probability's gradient;
    the copy's fp32 probability and int64 place in the permutation), the router's fp32 probabilities (over the
    experts, or over the top k when its softmax follows the choice; Phi-3.5-MoE's sparsemixer a second softmax over
    the experts and its two chosen probabilities) and the int64 top-k choice; the shared expert(s) like a dense
    MLP, and where a sigmoid gates their output (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE) that output and the gate, which
    their product keeps; Phi-3.5-MoE's input jitter its two noise tensors."""
    ex, h = spec.experts, spec.hidden
    assert ex is not None, "moe layer of a dense model"
    copy = width * (2 * h + 3 * ex.intermediate) + STAT_BYTES + _INDEX
    router = STAT_BYTES * (ex.top_k if ex.softmax_after_top_k else ex.count) + _INDEX * ex.top_k
    if ex.sparsemixer:
        router += STAT_BYTES * (ex.count + 2)
    jitter = 2 * width * h if ex.input_jitter else 0
    gate = width * (h + 1) if ex.shared_gate else 0
    return ex.top_k * copy + router + jitter + gate + mlp_activations(ex.shared_intermediate, gated=True, width=width)


def layer_counts(spec: ModelSpec, kind: str, seq: int, *, width: int = 2) -> LayerCounts:
    """The counts of one layer of ``kind`` (embedding, dense, moe and their :mod:`~pipeloom.plan.cluster.model.kinds`,
    head, mtp) for one sequence of ``seq`` tokens; ``width``: bytes of one activation element (2: bf16; statistics are
    fp32 whatever it is). A windowed kind counts as its block kind but for ``attended_f``; a NoPE kind but for a q/k
    norm that follows the rotary (:attr:`~pipeloom.plan.cluster.model.spec.Attention.qk_norm_with_rope`); a sparse kind
    (:mod:`~pipeloom.plan.cluster.model.kinds`) attends to its top-k keys, and one that runs an indexer adds the
    indexer's weights, forward and kept choice; a linear kind runs Gated DeltaNet in the attention's place (its
    weights, FLOPs and kept bytes: :mod:`~pipeloom.plan.cluster.model.deltanet`)."""
    h = spec.hidden
    window = attended_window(spec, kind)
    layer, kind = kind, block_kind(kind)
    if kind == "mtp":
        return _mtp_counts(spec, seq, width)
    if kind == "embedding":
        params = spec.vocab * h + spec.positions * h
        mask = Activations(sequence=float(MASK_BYTES * h if spec.embedding_dropout else 0), tensor=0.0)
        return LayerCounts(kind=kind, params=params, expert_params=0, f=0.0, i=0.0, w=0.0, attention_f=0.0,
                           attended_f=0.0, activations={m: mask for m in RECOMPUTE_MODES})  # its dropout's mask
    if kind == "head":
        params = _norm(spec) + (0 if spec.tied else spec.vocab * h) + (spec.vocab if spec.head_bias else 0)
        mm = 2.0 * seq * h * spec.vocab
        # the final norm's input and output (+ 1/rms); the fp32 logits the loss keeps (vocab split by tp), and the
        # tanh's output where the logits are softcapped
        keep = Activations(sequence=width * 2 * h + norm_stats(spec),
                           tensor=4.0 * spec.vocab + (width * spec.vocab if spec.logit_softcap else 0))
        return LayerCounts(kind=kind, params=params, expert_params=0, f=mm, i=mm, w=mm, attention_f=0.0,
                           attended_f=0.0, activations={m: keep for m in ("none", "selective", "full")})
    attn_mm, attn_other = _attention_weights(spec, layer)
    if kind == "dense":
        mlp_mm, mlp_other = _mlp_weights(spec, spec.intermediate, gated=spec.gated, bias=spec.mlp_bias)
        expert_params, routed_mm = 0, 0
        mlp_keep = mlp_activations(spec.intermediate, gated=spec.gated, width=width)
    elif kind == "moe":
        mlp_mm, mlp_other, expert_params, routed_mm, mlp_keep = _moe_mlp(spec, width)
    else:
        raise ValueError(f"unknown layer kind {kind!r}; one of embedding, dense, moe, head, mtp")
    params = attn_mm + attn_other + mlp_mm + mlp_other + spec.layer_norms * _norm(spec)
    mixer = linear_flops(spec, seq) if is_linear(layer) else (0.0, 0.0, 0.0)  # Gated DeltaNet's core and conv
    core = 0.0 if is_linear(layer) else attention_flops(spec, seq)
    linear = 2.0 * seq * (attn_mm + mlp_mm + routed_mm)
    index_params, index_mm, index_f = _indexer_counts(spec, layer, seq)
    none, selective = _kept(spec, layer, width, mlp_keep)
    full = Activations(sequence=float(width * h), tensor=0.0)  # only the layer's input
    return LayerCounts(kind=layer, params=params + index_params, expert_params=expert_params,
                       f=linear + core + 2.0 * seq * index_mm + index_f + mixer[0], i=linear + 2 * core + mixer[1],
                       w=linear + mixer[2],
                       attention_f=core, attended_f=core * attended_fraction(seq, window, chunked=spec.chunked),
                       activations={"none": none, "selective": selective, "full": full}, index_f=index_f)


def _kept(spec: ModelSpec, layer: str, width: int, mlp_keep: float) -> tuple[Activations, Activations]:
    """What one token of a decoder layer of kind ``layer`` keeps without recomputation and under ``selective`` (the
    attention core's), its MLP keeping ``mlp_keep``."""
    h, stat = spec.hidden, norm_stats(spec)
    if is_linear(layer):
        seq_a, tensor_a = linear_activations(spec, width, stat)
        latent, statistics = 0.0, 0.0  # Megatron-Core recomputes no part of it under selective (core_attn)
    else:
        seq_a, tensor_a, latent = _attention_activations(spec, width, layer)
        statistics = STAT_BYTES * spec.attention.heads  # flash attention's log-sum-exp
    # + the MLP norm's input and output (+ 1/rms; its input is the attention norm's under a parallel residual,
    # and with one norm before both branches the attention half's counts hold it); a norm after a branch keeps
    # its input (+ 1/rms), its output going into the residual add
    sequence = seq_a
    if not spec.shared_norm:
        mlp_norm = width * (1 if spec.parallel_residual else 2) * h + stat
        sequence += mlp_norm + (spec.layer_norms - 2) * (width * h + stat)
    sequence += MASK_BYTES * h * spec.residual_dropouts  # the residual dropouts' masks
    latent += index_bytes(spec, layer)  # the indexer's choice, read again by the sparse attention's backward
    none = Activations(sequence=sequence, tensor=tensor_a + mlp_keep, replicated=latent)
    # selective: the attention core runs again in the backward, so only its softmax statistics are not kept:
    # its inputs q, k, v are the recomputation's inputs, its output the output projection's input
    # (with flash attention there are no s x s scores to save: Megatron's selective recompute saves little)
    return none, Activations(sequence=sequence, tensor=tensor_a + mlp_keep - statistics, replicated=latent)


def model_params(spec: ModelSpec, *, active: bool = False) -> int:
    """Parameters of the whole model (an untied head counted once; not its multi-token-prediction modules, which
    DeepSeek-V3's 671 B leaves out too: ``spec.mtp * layer_counts(spec, "mtp", 1).params`` more); ``active``: of the
    routed experts only the top-k a token runs (an MoE's activated parameters)."""
    idle = 1 - spec.experts.top_k / spec.experts.count if active and spec.experts else 0.0
    kinds = (*Counter(layer_kinds(spec)).items(), ("embedding", 1), ("head", 1))
    counted = [(n, layer_counts(spec, kind, 1)) for kind, n in kinds]
    return sum(n * (c.params - round(idle * c.expert_params)) for n, c in counted)
