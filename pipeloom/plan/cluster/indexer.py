"""What DeepSeek's sparse attention (DeepSeek-V3.2, GLM-5) costs beside its top-k core: the lightning indexer a
:data:`~pipeloom.plan.cluster.model.kinds.SPARSE` layer runs first, forward only (its KL training loss is not priced),
MLA's absorption into the MQA mode the core runs in, and the latent keys' exchange under context parallelism."""

from __future__ import annotations

from pipeloom.plan.cluster.counts import attended_fraction, sparse_core_dims
from pipeloom.plan.cluster.efficiency import attention_seconds, collective_seconds, domain_ranks, memory_seconds
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.spec import ModelSpec

__all__ = ["indexer_gemms", "indexer_score_seconds", "absorbed_gemms", "latent_exchange_seconds"]

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
