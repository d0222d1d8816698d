"""The price of DeepSeek's sparse attention beyond its top-k attention core (DeepSeek-V3.2, GLM-5): the lightning
indexer each :data:`~pipeloom.plan.cluster.kinds.SPARSE` layer runs before its attention, forward only (transformers
runs it under ``no_grad``; the indexer's own training loss, DeepSeek's KL term against the attention's scores, is not
priced).

The indexer (DeepSeek-V3.2 report, arXiv:2512.02556, sec. 2.1; transformers' ``DeepseekV32Indexer``) projects MLA's
query latent to ``heads`` query heads of ``dim`` and the layer's input to one key head of ``dim`` and to a weight per
head, scores each query against every earlier key, ``sum_j w_j · relu(q_j · k)``, and keeps each query's ``topk``
best keys. On one GPU of a layout:

- its projections run on every token of the micro-batch's cp shard and are whole on every tp rank (the top-k needs
  every head's score), priced as GEMMs in the job's dtype (:func:`indexer_gemms`);
- its scores cover the causal triangle of the shard's queries against the whole sequence (DeepGEMM's
  ``fp8_mqa_logits`` takes each query's key range), priced as a flash kernel's ``Q K^T`` alone: its heads at half
  its head dimension have the same FLOPs (``2 · heads · dim`` per query and key), in BF16 (DeepSeek's kernel runs
  FP8: priced slower than that);
- the fp32 scores are written and read back once by the top-k (the reference code and transformers' materialise
  them): 8 bytes per query and key of the triangle.

Left out: the keys' exchange under context parallelism (``dim`` elements a token, against MLA's ``kv_rank + rope``),
the top-k's own arithmetic beyond that pass, and the indexer's LayerNorm, rotary and ReLU (folded into its kernels).
"""

from __future__ import annotations

from pipeloom.plan.cluster.counts import attended_fraction
from pipeloom.plan.cluster.efficiency import attention_seconds, memory_seconds
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.spec import ModelSpec

__all__ = ["indexer_gemms", "indexer_score_seconds"]

_SCORE_BYTES = 4 * 2
"""Bytes per query and key of the indexer's fp32 scores: written by the score kernel, read by the top-k."""


def indexer_gemms(spec: ModelSpec) -> list[tuple[int, int]]:
    """``(n, k)`` of the indexer's projections, whole on every tp rank: queries from MLA's query latent
    (``heads x dim``), its one key head and its weight per head from the layer's input."""
    ix, a = spec.indexer, spec.attention
    assert ix is not None, "an indexer of a model without DeepSeek's sparse attention"
    return [(ix.heads * ix.dim, a.q_rank), (ix.dim, spec.hidden), (ix.heads, spec.hidden)]


def indexer_score_seconds(job: Job, layout: Layout) -> float:
    """Seconds of one layer's indexer scores and top-k pass for one micro-batch on one GPU of ``layout``
    (module docstring): the cp shard's queries against the whole causal prefix, 1/cp of the triangle."""
    ix = job.spec.indexer
    assert ix is not None, "an indexer of a model without DeepSeek's sparse attention"
    hw, seq = job.hw, job.seq
    scores = attention_seconds(hw, batch=layout.mbs, heads=ix.heads, seq=seq, head_dim=max(1, ix.dim // 2))
    pairs = layout.mbs * seq * seq * attended_fraction(seq) / layout.cp
    return scores / layout.cp + memory_seconds(hw, _SCORE_BYTES * pairs)
