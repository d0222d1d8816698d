"""Seconds of one micro-batch through one multi-token-prediction module (DeepSeek-V3, report arXiv:2412.19437
sec. 2.2) on one GPU of a layout: the next token's embedding lookup (the shared embedding), the two RMSNorms,
the projection 2h -> h, one decoder block of the last layer's kind and a second pass through the shared head
and its loss, priced with :func:`pipeloom.plan.cluster.layer_time.layer_times`' terms. DeepSeek places the
module with the head on the last pipeline stage (report sec. 3.2.1); the estimator does the same."""

from __future__ import annotations

import dataclasses

from pipeloom.plan.cluster.counts import mtp_block
from pipeloom.plan.cluster.dispatch import compute_hardware
from pipeloom.plan.cluster.efficiency import collective_seconds, domain_ranks, gemm_seconds, memory_seconds
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.step import PhaseTimes, add_times

__all__ = ["mtp_times"]


def mtp_times(job: Job, layout: Layout) -> PhaseTimes:
    """F, I and W seconds of one micro-batch through one MTP module on one GPU of ``layout``: the embedding
    and head as :func:`layer_times` prices them (a second lookup and a second head + loss), the block as a
    layer of :func:`~pipeloom.plan.cluster.counts.mtp_block`'s kind (its recomputation included), and the
    module's own entry: two RMSNorms (forward: read and write h each; backward: read 2h, write h each, on the
    sequence-parallel 1/tp of the tokens), the projection GEMM (column-parallel over tp: h / tp outputs from 2h
    inputs), and under tp > 1 the projection's input gathered over tp (sequence parallel: all-gather forward,
    reduce-scatter backward; without: an all-reduce of its input gradient). Full recomputation runs the entry's
    forward again in the backward."""
    parts = [layer_times(job, layout, "embedding"), layer_times(job, layout, mtp_block(job.spec)),
             layer_times(job, layout, "head")]
    return add_times(*parts, _entry(job, layout))


def _entry(job: Job, layout: Layout) -> PhaseTimes:
    """The two norms, the projection and its tensor-parallel exchange (:func:`mtp_times`)."""
    hw = compute_hardware(job, layout)
    h, tp, width = job.spec.hidden, layout.tp, 2
    tokens = layout.mbs * job.seq // layout.cp
    sp = tp > 1 and job.sequence_parallel
    share = tokens / (tp if sp else 1)  # tokens each tp rank normalises
    norms_f = memory_seconds(hw, 2 * 2.0 * h * width * share) + 2 * hw.kernel_overhead
    norms_b = memory_seconds(hw, 2 * 3.0 * h * width * share) + 2 * hw.kernel_overhead
    n, k = h // tp, 2 * h
    cast_f, cast_i, cast_w = job.fp8_casts()
    f = gemm_seconds(hw, tokens, n, k, dtype=job.dtype, cast=cast_f)
    i = gemm_seconds(hw, tokens, k, n, dtype=job.dtype, cast=cast_i)
    w = gemm_seconds(hw, n, k, tokens, dtype=job.dtype, cast=cast_w)
    comm = back = 0.0
    if tp > 1:
        ranks = domain_ranks(tp, 1, hw)
        gathered = 2.0 * tokens * h * width  # the concatenated 2h input
        comm = collective_seconds(hw, "all_gather", gathered, tp, ranks_per_domain=ranks) if sp else 0.0
        back = collective_seconds(hw, "reduce_scatter" if sp else "all_reduce", gathered, tp, ranks_per_domain=ranks)
    entry = PhaseTimes(f=norms_f + f + comm, i=norms_b + i + back, w=w)
    if layout.recompute == "full":
        entry = dataclasses.replace(entry, i=entry.i + entry.f)
    return entry
