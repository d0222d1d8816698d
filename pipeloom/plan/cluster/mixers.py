"""What the token mixers other than dense attention cost beyond their GEMMs.

DeepSeek's sparse attention (DeepSeek-V3.2, GLM-5) beside its top-k core: the lightning indexer a
:data:`~pipeloom.plan.cluster.model.kinds.SPARSE` layer runs first, forward only (its KL training loss is not priced),
MLA's absorption into the MQA mode the core runs in, and the latent keys' exchange under context parallelism.

Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid: :data:`~pipeloom.plan.cluster.model.kinds.LINEAR` layers): the
chunked gated delta rule's kernels (:func:`gdn_core_seconds`) and, under context parallelism, Megatron-Core's
all-to-alls between the sequence split and the head split (:func:`gdn_exchange_seconds`)."""

from __future__ import annotations

from pipeloom.plan.cluster.counts import attended_fraction, sparse_core_dims
from pipeloom.plan.cluster.efficiency import attention_seconds, collective_seconds, domain_ranks, memory_seconds
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.deltanet import gdn_core_flops
from pipeloom.plan.cluster.model.spec import ModelSpec

__all__ = ["indexer_gemms", "indexer_score_seconds", "absorbed_gemms", "latent_exchange_seconds", "GDN_EFFICIENCY",
           "GDN_BACKWARD_EFFICIENCY", "gdn_core_seconds", "gdn_exchange_seconds"]

_SCORE_BYTES = 4 * 2
"""Bytes per query and key of the indexer's fp32 scores: written by the score kernel, read by the top-k."""


def indexer_gemms(spec: ModelSpec) -> list[tuple[int, int]]:
    """``(n, k)`` of the indexer's projections, on every token of the micro-batch's cp shard and whole on every tp
    rank (the top-k needs every head's score): queries from MLA's query latent (``heads x dim``), its one key head
    and its weight per head from the layer's input; priced as GEMMs in the job's dtype."""
    ix, a = spec.indexer, spec.attention
    assert ix is not None, "an indexer of a model without DeepSeek's sparse attention"
    return [(ix.heads * ix.dim, a.q_rank), (ix.dim, spec.hidden), (ix.heads, spec.hidden)]


def indexer_score_seconds(job: Job, layout: Layout) -> float:
    """Seconds of one layer's indexer scores and top-k pass for one micro-batch on one GPU of ``layout``: each query
    against every earlier key, ``sum_j w_j · relu(q_j · k)`` (DeepSeek-V3.2 report, arXiv:2512.02556, sec. 2.1), over
    the cp shard's queries, 1/cp of the causal triangle (DeepGEMM's ``fp8_mqa_logits`` takes each query's key range).
    Priced as a flash kernel's ``Q K^T`` alone, its heads at half its head dimension having the same FLOPs (``2 ·
    heads · dim`` a query and key), in BF16 (DeepSeek's kernel runs FP8: priced slower than that); then the fp32
    scores written and read back once by the top-k, as the reference code and transformers materialise them. Left
    out: the indexer keys' exchange under context parallelism (``dim`` elements a token), the top-k's arithmetic
    beyond that pass, and the indexer's LayerNorm, rotary and ReLU."""
    ix = job.spec.indexer
    assert ix is not None, "an indexer of a model without DeepSeek's sparse attention"
    hw, seq = job.hw, job.seq
    scores = attention_seconds(hw, batch=layout.mbs, heads=ix.heads, seq=seq, head_dim=max(1, ix.dim // 2))
    pairs = layout.mbs * seq * seq * attended_fraction(seq) / layout.cp
    return scores / layout.cp + memory_seconds(hw, _SCORE_BYTES * pairs)


def absorbed_gemms(spec: ModelSpec) -> list[tuple[int, int]]:
    """``(n, k)`` of one head's absorption GEMMs in MLA's MQA mode, run per head (batched over a tp rank's heads): its
    no-rope query into the latent (``W_UK``: ``qk_dim - rope -> kv_rank``) and the kernel's latent output up to its
    value (``W_UV``: ``kv_rank -> v_dim``). They take the place of the kv up-projection of every key, with the same
    FLOPs; the weights are the kv up-projection's."""
    a = spec.attention
    return [(a.kv_rank, a.qk_dim - a.rope_dim), (a.v_dim, a.kv_rank)]


def latent_exchange_seconds(job: Job, layout: Layout, tokens: int) -> tuple[float, float]:
    """Forward and backward seconds of a sparse layer's key exchange under context parallelism (``layout.cp > 1``),
    as Megatron-Core's DSA runs it (all-gather only): every cp rank gathers the whole sequence's latent keys (``kv_rank
    + rope``, the MQA mode's one key head; whole on every tp rank) and the indexer's keys (``dim``), bf16, before its
    kernels, exposed; the backward reduce-scatters the latent keys' gradients (the indexer takes none). ``tokens``:
    the micro-batch's tokens on this GPU's cp shard."""
    ix = job.spec.indexer
    assert ix is not None, "a key exchange of a model without DeepSeek's sparse attention"
    qk, _ = sparse_core_dims(job.spec)
    per_domain = domain_ranks(layout.cp, layout.tp, job.hw)
    whole = 2.0 * tokens * layout.cp
    forward = collective_seconds(job.hw, "all_gather", whole * (qk + ix.dim), layout.cp, ranks_per_domain=per_domain)
    backward = collective_seconds(job.hw, "reduce_scatter", whole * qk, layout.cp, ranks_per_domain=per_domain)
    return forward, backward


GDN_EFFICIENCY = 0.0391
"""Fraction of the GPU's BF16 dense peak flash-linear-attention's chunked gated delta rule forward runs at: the
largest run with Qwen3-Next's head dimension in fla's README benchmark table (fla-org/flash-linear-attention, README
"Benchmarks", measured at commit 0a48470 on one GB200, CUDA 12.9, PyTorch 2.9, bf16, median ``do_bench`` time):
``chunk_gdn`` at batch 4, 4,096 tokens, 64 heads of 128, forward 1.581 ms, 1.546e11 FLOPs as
:func:`~pipeloom.plan.cluster.model.deltanet.gdn_core_flops` counts them: 97.8 TFLOP/s of the GB200's 2,500. Its other
large runs at head dimension 128 are priced 6 and 23 % faster than measured, the one at 256 44 % slower
(docs/cluster-plan.md); its small ones take a fixed ~0.6 ms more, the benchmark's launches, which a training step's
queue hides. Measured on the GB200 only: every GPU takes the same fraction of its own peak."""
GDN_BACKWARD_EFFICIENCY = 0.0282
"""The same for the backward (the same run's forward + backward, 5.964 ms, less its forward: 4.383 ms for the twice
the forward's FLOPs :func:`~pipeloom.plan.cluster.counts.layer_counts` gives the backward: 70.5 TFLOP/s)."""
_GDN_KERNELS = (6, 9)
"""Kernels of fla's chunked gated delta rule, forward and backward (the chunk cumsum, the fused kkt and triangular
solve, w and u, the states, the output; in the backward w, u and the states again, then dv, dh, dq/dk/dw/dg, the WY
backward and the reverse cumsum)."""


def gdn_core_seconds(job: Job, layout: Layout) -> tuple[float, float]:
    """Forward and backward seconds of one layer's chunked gated delta rule for one micro-batch on one GPU of
    ``layout``: its FLOPs (:func:`~pipeloom.plan.cluster.model.deltanet.gdn_core_flops`, the backward twice the
    forward's) over the value heads a GPU holds, ``1 / (tp x cp)`` of them (under context parallelism each cp rank
    runs the whole sequence of its heads), at :data:`GDN_EFFICIENCY` and :data:`GDN_BACKWARD_EFFICIENCY` of the BF16
    peak (the kernel runs BF16 whatever the GEMMs' dtype), plus a kernel overhead per kernel."""
    hw = job.hw
    flops = gdn_core_flops(job.spec, job.seq) * layout.mbs / (layout.tp * layout.cp)
    peak = hw.peak("bf16")
    forward = _GDN_KERNELS[0] * hw.kernel_overhead + flops / (peak * GDN_EFFICIENCY)
    backward = _GDN_KERNELS[1] * hw.kernel_overhead + 2 * flops / (peak * GDN_BACKWARD_EFFICIENCY)
    return forward, backward


def gdn_exchange_seconds(job: Job, layout: Layout, tokens: int) -> float:
    """Seconds of a Gated DeltaNet layer's exchanges in one pass under context parallelism (``layout.cp > 1``), as
    Megatron-Core runs them (``megatron/core/ssm/gated_delta_net``: ``a2a_cp_to_hp`` and ``a2a_hp_to_cp``): the input
    projection's output, a tp rank's share of the queries, keys, values, output gate and the value heads' two scalars
    of the cp shard's ``tokens``, all-to-all from the sequence split to the head split before the convolution, and
    the gated norm's output (the values' width) back after it; the backward runs the two the other way. Exposed (no
    compute runs beside them), bf16."""
    g = job.spec.linear
    assert g is not None, "a Gated DeltaNet exchange of a model without it"
    per_domain = domain_ranks(layout.cp, layout.tp, job.hw)
    into = 2.0 * tokens * (g.mixed + g.values + 2 * g.value_heads) / layout.tp
    back = 2.0 * tokens * g.values / layout.tp
    return sum(collective_seconds(job.hw, "all_to_all", size, layout.cp, ranks_per_domain=per_domain)
               for size in (into, back))
