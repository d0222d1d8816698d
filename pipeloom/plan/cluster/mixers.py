"""What the token mixers other than dense attention cost beyond their GEMMs.

DeepSeek's sparse attention (DeepSeek-V3.2, GLM-5) beside its top-k core: the lightning indexer a
:data:`~pipeloom.plan.cluster.model.kinds.SPARSE` layer runs first, forward only (its KL training loss is not priced),
MLA's absorption into the MQA mode the core runs in, and the latent keys' exchange under context parallelism.

Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid: :data:`~pipeloom.plan.cluster.model.kinds.LINEAR` layers): the
chunked gated delta rule's kernels (:func:`gdn_core_seconds`) and, under context parallelism, Megatron-Core's
all-to-alls between the sequence split and the head split (:func:`gdn_exchange_seconds`).

Dense attention under context parallelism (:func:`context_parallel_core`): the cp shard's blocks of the load-balanced
causal split and the K/V exchanges beside them, as Megatron-Core / Transformer Engine pass K/V around a ring
(``ring``) or as PyTorch's ``context_parallel`` all-gathers them for torchtitan (``allgather``)."""

from __future__ import annotations

from pipeloom.plan.cluster.counts import attended_fraction, sparse_core_dims
from pipeloom.plan.cluster.efficiency import (
    attention_seconds,
    collective_seconds,
    domain_ranks,
    memory_seconds,
    overlapped_seconds,
    p2p_seconds,
)
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.deltanet import gdn_core_flops
from pipeloom.plan.cluster.model.spec import Attention, ModelSpec

__all__ = ["indexer_gemms", "indexer_score_seconds", "absorbed_gemms", "latent_exchange_seconds", "GDN_EFFICIENCY",
           "GDN_BACKWARD_EFFICIENCY", "gdn_core_seconds", "gdn_exchange_seconds", "context_parallel_core"]

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


def context_parallel_core(hw: Hardware, a: Attention, *, rotate: str, tp: int, cp: int, tokens: int, core_f: float,
                          core_b: float) -> tuple[float, float]:
    """Forward and backward seconds of the attention core of ``tokens`` (the cp shard's) on one GPU of a cp group of
    ``cp`` ranks ``tp`` apart, from the core's seconds without the exchanges (``core_f``, ``core_b``: the GPU's
    1/cp of the causal square). ``ring``: each block's K/V (the kv heads, bf16) go to the next rank beside the
    current block's compute, ``cp - 1`` sends per pass (twice in the backward: K/V and their gradients), the
    compute slowed while they run (:func:`overlapped_seconds`). ``allgather``: :func:`_allgather`."""
    if rotate == "allgather":
        return _allgather(hw, a, tp=tp, cp=cp, tokens=tokens, core_f=core_f, core_b=core_b)
    kv = tokens * a.kv_heads * (a.qk_dim + a.v_dim) * 2 / tp
    ring = (cp - 1) * p2p_seconds(hw, kv, same_domain=domain_ranks(cp, tp, hw) == cp)
    return overlapped_seconds(hw, core_f, ring), overlapped_seconds(hw, core_b, 2 * ring)


def _allgather(hw: Hardware, a: Attention, *, tp: int, cp: int, tokens: int, core_f: float,
               core_b: float) -> tuple[float, float]:
    """Forward and backward seconds of the attention core under PyTorch's ``context_parallel`` with its default
    ``allgather`` rotation, as torchtitan ran it (``torch.distributed.tensor.experimental._attention``:
    ``_templated_ring_attention`` and its backward; torchtitan's ``context_parallel_rotate_method`` default;
    its Llama repeats K/V to the query heads before SDPA, so the K/V exchanged have ``heads`` heads).

    The cp blocks of the load-balanced causal split do equal work (``core / cp`` each). Forward: the K/V are
    all-gathered once, started after the first block is issued and waited for before the second, so the gather hides
    only under the first block (slowing it: :func:`overlapped_seconds`); every later block's output is merged into
    an fp32 accumulator with the log-sum-exp rule (cast 6 bytes per output element, merge 38: ``out - sigmoid(lse_b
    - lse) * (out - block_out)`` in three eager kernels) and cast back (6); K and V are concatenated for the
    exchange every step (4 bytes per K/V element). Backward: the K/V all-gather again under the first block; dK and
    dV accumulate in fp32 and travel to the next rank every step by an all-to-all permutation (fp32: twice the bf16
    bytes), each send hidden under the next block's compute, the last exposed; per step the gradients' fp32
    accumulation (10 bytes per q, k and v element: read fp32 and the bf16 block, write fp32) and the concatenations
    for the sends (8 + 4 bytes per K/V element)."""
    heads = max(1, a.heads // tp)
    q_elems = tokens * heads * a.qk_dim
    kv_elems = tokens * heads * (a.qk_dim + a.v_dim)
    out_elems = tokens * heads * a.v_dim
    same = domain_ranks(cp, tp, hw)
    gather = collective_seconds(hw, "all_gather", 2.0 * kv_elems * cp, cp, ranks_per_domain=same)
    send = p2p_seconds(hw, 4.0 * kv_elems, same_domain=same == cp)
    block_f, block_b = core_f / cp, core_b / cp
    merge = memory_seconds(hw, (12 + 38 * (cp - 1)) * out_elems + 4 * (cp - 1) * kv_elems)
    forward = overlapped_seconds(hw, block_f, gather) + (cp - 1) * block_f + merge + (cp - 1) * 3 * hw.kernel_overhead
    accumulate = memory_seconds(hw, cp * (10 * (q_elems + kv_elems) + 12 * kv_elems))
    backward = (overlapped_seconds(hw, block_b, gather) + (cp - 1) * overlapped_seconds(hw, block_b, send) + send
                + accumulate)
    return forward, backward
