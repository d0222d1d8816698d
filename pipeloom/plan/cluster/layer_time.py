"""Seconds of one micro-batch through one layer of each kind on one GPU of a layout: its GEMMs at their
sharded shapes, the flash-attention core, bandwidth-bound elementwise work, and the tensor-, context- and
expert-parallel communication on the critical path, split into F, I (input gradient, plus what
recomputation adds) and W (weight gradient)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeloom.plan.cluster.counts import layer_counts, sparse_core_dims
from pipeloom.plan.cluster.dispatch import compute_hardware, deepseek_all_to_all, hybridep_all_to_all
from pipeloom.plan.cluster.efficiency import (
    attention_seconds,
    collective_seconds,
    domain_ranks,
    gemm_seconds,
    materialized_attention_seconds,
    memory_seconds,
    overlapped_seconds,
)
from pipeloom.plan.cluster.elementwise import DROPOUT_BYTES, layer_elementwise
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.mixers import (
    absorbed_gemms,
    context_parallel_core,
    gdn_core_seconds,
    gdn_exchange_seconds,
    indexer_gemms,
    indexer_score_seconds,
    latent_exchange_seconds,
)
from pipeloom.plan.cluster.model.kinds import attended_window, block_kind, has_indexer, is_linear, is_nope, is_sparse
from pipeloom.plan.cluster.model.spec import ModelSpec
from pipeloom.plan.cluster.recompute import layer_modules, separate_norms
from pipeloom.plan.cluster.step import PhaseTimes, add_times, named_work
from pipeloom.plan.errors import LayoutError
from pipeloom.plan.tp.all_to_all import moe_exchanges

__all__ = ["layer_times"]


def _gemms(spec: ModelSpec, tp: int, *, absorbed: bool = False, linear: bool = False) -> list[tuple[int, int]]:
    """``(n, k)`` of the tensor-parallel shards of one layer's attention GEMMs (column-parallel: n / tp,
    row-parallel: k / tp; MLA's low-rank down-projections replicated; ``absorbed``: MLA's MQA mode, without the kv
    up-projection of every key, :func:`~pipeloom.plan.cluster.mixers.absorbed_gemms` in its place; an output gate's
    columns in the q projection; ``linear``: Gated DeltaNet's input and output projections instead)."""
    a, h = spec.attention, spec.hidden
    if linear:
        g = spec.linear
        assert g is not None, "a linear-attention layer of a model without Gated DeltaNet"
        return [((g.mixed + g.values + 2 * g.value_heads) // tp, h), (h, g.values // tp)]
    if a.latent:
        q = [(a.q_rank, h), (a.heads * a.qk_dim // tp, a.q_rank)] if a.q_rank else [(a.heads * a.qk_dim // tp, h)]
        kv = [(a.kv_rank + a.rope_dim, h)]
        if not absorbed:
            kv.append((a.heads * (a.qk_dim - a.rope_dim + a.v_dim) // tp, a.kv_rank))
        return q + kv + [(h, a.heads * a.v_dim // tp)]
    qkv = a.heads * a.qk_dim + a.kv_heads * (a.qk_dim + a.v_dim) + a.gate
    return [(qkv // tp, h), (h, a.heads * a.v_dim // tp)]


def _mlp(spec: ModelSpec, intermediate: int, tp: int, *, gated: bool) -> list[tuple[int, int]]:
    """``(n, k)`` of an MLP's up (column-parallel) and down (row-parallel) GEMM shards."""
    up = (2 if gated else 1) * intermediate // tp
    return [(up, spec.hidden), (spec.hidden, intermediate // tp)]


_GEMMS: dict[tuple[Any, ...], float] = {}
""":func:`gemm_seconds` by everything it reads (the GPU's fields as values, the dtype, the shape and the casts): a
search prices the same GEMMs for many layouts (DeepSeek-V3 on 1,024 GPUs: 812 distinct shapes in 221,400 calls)."""


def _price(job: Job, gemms: list[tuple[int, int]], m: int, count: int = 1) -> PhaseTimes:
    """F, I, W of GEMMs ``(m x k) @ (k x n)`` on ``job``'s GPU in its dtype: dX is ``(m x n) @ (n x k)``, dW
    ``(n x m) @ (m x k)``."""
    if m == 0:
        return PhaseTimes(f=0.0, i=0.0, w=0.0)

    f, i, w = job.fp8_casts()
    hw = job.hw
    gpu = (hw.peak_flops.get(job.dtype), hw.gemm_ceiling(job.dtype), hw.gemm_half_dim, hw.sm_count,
           hw.memory_bandwidth, hw.memory_efficiency, hw.kernel_overhead, job.dtype)

    def seconds(rows: int, cols: int, inner: int, cast: tuple[float, float]) -> float:
        key = (*gpu, rows, cols, inner, cast)
        if key not in _GEMMS:
            if len(_GEMMS) >= 1 << 16:  # a long-lived process (pipeloom serve) plans many GPUs and models
                _GEMMS.clear()
            _GEMMS[key] = gemm_seconds(hw, rows, cols, inner, dtype=job.dtype, cast=cast)
        return _GEMMS[key]

    return PhaseTimes(f=count * sum(seconds(m, n, k, f) for n, k in gemms),
                      i=count * sum(seconds(m, k, n, i) for n, k in gemms),
                      w=count * sum(seconds(n, k, m, w) for n, k in gemms))


def _softcap(job: Job, logits: float) -> tuple[float, float]:
    """Forward and backward seconds of softcapping ``logits`` bytes (0 without :attr:`ModelSpec.logit_softcap`): divide,
    tanh and multiply each read and write them (fused: one kernel), backward too, the tanh reading its kept output
    (fused: 3 passes), less the 2 passes of that output the head's ``elementwise`` prices with every kept byte."""
    if not job.spec.logit_softcap:
        return 0.0, 0.0
    hw, fused = job.hw, job.kernels == "fused"
    overhead = 0.0 if fused else 2 * hw.kernel_overhead  # three kernels: memory_seconds counts one overhead
    forward, backward = (2, 1) if fused else (6, 5)
    return memory_seconds(hw, forward * logits) + overhead, memory_seconds(hw, backward * logits) + overhead


def layer_times(job: Job, layout: Layout, kind: str) -> PhaseTimes:
    """F, I and W seconds of one micro-batch through one layer of ``kind`` on one GPU of ``layout`` (a
    multi-token-prediction module, kind ``mtp``: :func:`pipeloom.plan.cluster.mtp.mtp_times`; a
    :data:`~pipeloom.plan.cluster.model.kinds.WINDOWED` kind's flash attention skips what its sliding window or chunks
    leave out, the materialized scores do not, as a sparse kind's skips the keys its indexer leaves out; a
    :data:`~pipeloom.plan.cluster.model.kinds.SPARSE` kind runs its indexer first, :mod:`pipeloom.plan.cluster.mixers`;
    a :data:`~pipeloom.plan.cluster.model.kinds.NOPE` kind runs no rotary; a
    :data:`~pipeloom.plan.cluster.model.kinds.LINEAR` kind runs Gated DeltaNet in its attention's place)."""
    if block_kind(kind) not in ("embedding", "head", "dense", "moe"):
        raise LayoutError(f"layer_times prices embedding, dense, moe (or windowed, sparse, NoPE, Gated DeltaNet) and "
                          f"head layers, not {kind!r}")
    job = dataclasses.replace(job, hw=compute_hardware(job, layout))
    spec, hw, tp, cp = job.spec, job.hw, layout.tp, layout.cp
    tokens = layout.mbs * job.seq // cp  # tokens of the micro-batch on this GPU's cp shard
    width = 2  # bf16 activations
    sp = tp > 1 and job.sequence_parallel
    act = layer_counts(spec, kind, job.seq).activations["none"].per_gpu(tp=tp, cp=1, sp=sp)
    elementwise = memory_seconds(hw, 2.0 * act * tokens)  # write what is kept, read the inputs again
    tp_ranks = domain_ranks(tp, 1, hw)
    hidden_bytes = tokens * spec.hidden * width  # a full (all-gathered) hidden-state tensor
    if kind == "embedding":
        comm = collective_seconds(hw, "reduce_scatter" if sp else "all_reduce", hidden_bytes, tp,
                                  ranks_per_domain=tp_ranks) if tp > 1 else 0.0
        # its dropout (a config that trains with one), a kernel of its own each way
        dropout = memory_seconds(hw, DROPOUT_BYTES * tokens * spec.hidden) if spec.embedding_dropout else 0.0
        f, w = memory_seconds(hw, hidden_bytes) + comm + dropout, memory_seconds(hw, 2 * hidden_bytes) + dropout
        return PhaseTimes(f=f, i=0.0, w=w, parts=named_work(elementwise=f + w - comm, tp=comm))
    if kind == "head":
        gemm = _price(job, [(spec.vocab // tp, spec.hidden)], tokens)
        # sequence parallel: all-gather the tokens before the head, reduce-scatter the gradient after; without:
        # the tokens are whole on every tp rank and the input gradient is all-reduced
        comm = collective_seconds(hw, "all_gather", hidden_bytes, tp, ranks_per_domain=tp_ranks) if sp else 0.0
        back = comm if sp else (collective_seconds(hw, "all_reduce", hidden_bytes, tp, ranks_per_domain=tp_ranks)
                                if tp > 1 else 0.0)
        loss = memory_seconds(hw, 3.0 * 4 * tokens * spec.vocab / tp)  # fp32 logits: softmax, its gradient
        cap_f, cap_b = _softcap(job, tokens * spec.vocab / tp * width)
        work = named_work(GEMMs=gemm.f + gemm.i + gemm.w, elementwise=loss + elementwise + cap_f + cap_b,
                          tp=comm + back)
        return PhaseTimes(f=gemm.f + comm + loss + cap_f, i=gemm.i + back + elementwise + cap_b, w=gemm.w, parts=work)
    attention, core_f, core_b, beside_f, beside_b = _attention(job, layout, kind, tokens)
    linear = is_linear(kind)
    rotary, kind = not (is_nope(kind) or linear), block_kind(kind)
    # memory-bound kernels counted one by one (norms, residual adds, rotary, activation, MoE permutes)
    ew = layer_elementwise(spec, kind, tp=tp, sp=sp, kernels=job.kernels, rotary=rotary, linear=linear)
    ew_f = memory_seconds(hw, ew.f_bytes * tokens) + (ew.f_kernels - 1) * hw.kernel_overhead
    ew_b = memory_seconds(hw, ew.b_bytes * tokens) + (ew.b_kernels - 1) * hw.kernel_overhead
    tp_f, tp_i = _tp_time(job, layout, tokens, kind, hidden_bytes, linear=linear)
    mlp = (_price(job, _mlp(spec, spec.intermediate, tp, gated=spec.gated), tokens) if kind == "dense"
           else _moe_times(job, layout, tokens))
    gemm = add_times(attention, mlp)
    f = gemm.f + core_f + ew_f + tp_f + beside_f
    forward = PhaseTimes(f=f, i=0.0, w=0.0, f_comm=gemm.f_comm)
    # Megatron-Core checkpoints no part of a Gated DeltaNet layer but as a whole (full recomputation)
    extra, extra_comm = _recompute(job, layout, tokens, kind, forward, core_f=0.0 if linear else core_f, tp_f=tp_f,
                                   ew_f=ew_f, mlp=mlp, linear=linear)
    a2a = dict(mlp.parts).get("expert all-to-all", 0.0)
    work = named_work(GEMMs=gemm.f + gemm.i + gemm.w - a2a, attention=core_f + core_b + beside_f + beside_b,
                  elementwise=ew_f + ew_b, tp=tp_f + tp_i, a2a=a2a, recomputation=extra)
    return PhaseTimes(f=f, i=gemm.i + core_b + ew_b + tp_i + extra + beside_b, w=gemm.w, f_comm=gemm.f_comm,
                      i_comm=gemm.i_comm + extra_comm, parts=work)


def _attention(job: Job, layout: Layout, kind: str, tokens: int) -> tuple[PhaseTimes, float, float, float, float]:
    """The attention of one layer of ``kind`` on ``tokens`` (the micro-batch's on this GPU's cp shard): its GEMMs,
    its core's forward and backward seconds (with the cp exchanges beside it), and what else runs in F and in I:
    under DeepSeek's sparse attention the indexer (F only) and, under cp, the latent keys' gather (no ring). A sparse
    core runs MLA in its MQA mode (:func:`~pipeloom.plan.cluster.counts.sparse_core_dims`), its latent absorbed per
    head (:func:`~pipeloom.plan.cluster.mixers.absorbed_gemms`) in place of the keys' up-projection. A
    :data:`~pipeloom.plan.cluster.model.kinds.LINEAR` kind's Gated DeltaNet in its place: the input and output
    projections, the chunked kernel (:func:`~pipeloom.plan.cluster.mixers.gdn_core_seconds`) and under cp the
    all-to-alls each pass runs (:func:`~pipeloom.plan.cluster.mixers.gdn_exchange_seconds`)."""
    spec, a, tp, cp = job.spec, job.spec.attention, layout.tp, layout.cp
    if is_linear(kind):  # Gated DeltaNet: its projections, its chunked kernel, and under cp its all-to-alls
        exchange = gdn_exchange_seconds(job, layout, tokens) if cp > 1 else 0.0
        return (_price(job, _gemms(spec, tp, linear=True), tokens), *gdn_core_seconds(job, layout), exchange,
                exchange)
    absorbed = a.latent and is_sparse(kind)
    gemms = _price(job, _gemms(spec, tp, absorbed=absorbed), tokens)
    dims = sparse_core_dims(spec) if absorbed else (a.qk_dim, a.v_dim)
    window = attended_window(spec, kind)
    ring = cp > 1 and job.cp_rotate == "ring" and not absorbed  # MLA's sparse core all-gathers its latent keys
    core_f, core_b = (_attention_core(job, layout, window, dims, backward=backward, ring=ring)
                      for backward in (False, True))
    beside_f = (_price(job, indexer_gemms(spec), tokens).f + indexer_score_seconds(job, layout)
                if has_indexer(kind) else 0.0)
    beside_b = 0.0
    if absorbed:
        gemms = add_times(gemms, _price(job, absorbed_gemms(spec), tokens, count=max(1, a.heads // tp)))
        gather_f, beside_b = latent_exchange_seconds(job, layout, tokens) if cp > 1 else (0.0, 0.0)
        beside_f += gather_f
    elif cp > 1:
        core_f, core_b = context_parallel_core(job.hw, a, rotate=job.cp_rotate, tp=tp, cp=cp, tokens=tokens,
                                               core_f=core_f, core_b=core_b)
    return gemms, core_f, core_b, beside_f, beside_b


def _recompute(job: Job, layout: Layout, tokens: int, kind: str, forward: PhaseTimes, *, core_f: float,
               tp_f: float, ew_f: float, mlp: PhaseTimes, linear: bool = False) -> tuple[float, float]:
    """Seconds ``layout.recompute`` adds to a layer's backward, and of them the all-to-alls' (``forward``: the
    layer's F and its all-to-alls; the other keywords its parts, as :func:`_megatron_recompute` takes them): the
    forward again under ``full``; under ``selective``, ``job.selective``'s policy (a Gated DeltaNet layer,
    ``linear``, passes no ``core_f``: its core is never checkpointed alone, and ``op`` takes its MoE-layer rule there,
    the attention core's: :func:`~pipeloom.plan.cluster.recompute.kept_activations`)."""
    if layout.recompute == "full":  # the forward again, its all-to-alls included
        return forward.f, forward.f_comm
    if layout.recompute != "selective":
        return 0.0, 0.0
    if job.selective == "layer":  # every second layer checkpointed whole: half a forward per layer on average
        return forward.f / 2, forward.f_comm / 2
    if job.selective == "deepseek":  # (refused for models without multi-head latent attention: no Gated DeltaNet)
        return _deepseek_recompute(job, tokens, layout.tp, kind), 0.0
    if job.selective == "op" and kind == "dense" and not linear:
        return _op_recompute(job, tokens, layout.tp) + ew_f, 0.0
    return _megatron_recompute(job, layout, tokens, kind, layer_modules(job.selective), core_f=core_f, tp_f=tp_f,
                               mlp=mlp)


def _attention_core(job: Job, layout: Layout, window: int, dims: tuple[int, int], *, backward: bool,
                    ring: bool = False) -> float:
    """Seconds of one layer's attention core on one GPU of ``layout``, forward or backward, in ``job.attention``'s
    kernels (``window``: the layer's sliding window, chunk or top-k, 0 for none; scores in HBM compute the masked
    square whole; ``dims``: the query-key and value dimensions per head):
    the cp shard's queries attend to the whole sequence (or window), 1/cp of the causal triangle or band
    (load-balanced halves). Over a K/V ``ring`` (Megatron-Core's, Transformer Engine's ring attention) that work
    runs as cp kernel calls of equal work, one per ring step, on blocks of the 2 cp load-balanced chunks of
    seq / (2 cp) tokens: the diagonal step's queries and keys are the rank's two chunks, and of the others half
    take one chunk of keys, half one chunk of queries against two chunks of keys; each call at the rate of the keys
    it loops over."""
    hw, a = job.hw, job.spec.attention
    heads, head_dim = max(1, a.heads // layout.tp), sum(dims) // 2
    if job.attention == "materialized":
        return materialized_attention_seconds(hw, batch=layout.mbs, heads=heads, seq=job.seq, head_dim=head_dim,
                                              backward=backward) / layout.cp
    if job.attention == "flash2":  # FA2's kernels: the best kernel's rates over the measured ratio
        slow = hw.flash2_slowdown
        hw = dataclasses.replace(hw, attention_efficiency=hw.attention_efficiency / slow,
                                 attention_backward_efficiency=hw.attention_backward_efficiency / slow)
    def seconds(keys: int) -> float:
        return attention_seconds(hw, batch=layout.mbs, heads=heads, seq=job.seq, head_dim=head_dim, window=window,
                                 chunked=job.spec.chunked, backward=backward, calls_of=keys) / layout.cp
    if not ring:
        return seconds(0)
    cp, chunk = layout.cp, max(1, job.seq // (2 * layout.cp))
    two = seconds(2 * chunk)
    return (two + (cp - 1) / 2 * (seconds(chunk) + two)) / cp


def _op_recompute(job: Job, tokens: int, tp: int) -> float:
    """Seconds of the matmuls torchtitan's op-level selective checkpointing recomputes in a dense layer: its policy
    saves every matmul's output "except every second mm" counted per layer (torchtitan
    ``_apply_ac_to_transformer_block``), and a Llama layer calls wq, wk, wv, wo, w1, w3, w2: wk, wo and w3 run
    again (un-fused projections, as torchtitan's Llama is written). Other families are priced the same way."""
    spec, a = job.spec, job.spec.attention
    k_proj = (a.kv_heads * a.qk_dim // tp, spec.hidden)
    o_proj = (spec.hidden, a.heads * a.v_dim // tp)
    up = (spec.intermediate // tp, spec.hidden) if spec.gated else (0, spec.hidden)
    return _price(job, [k_proj, o_proj, up], tokens).f


def _moe_times(job: Job, layout: Layout, tokens: int) -> PhaseTimes:
    """The MoE MLP: router and shared experts on this GPU's tokens, routed experts (not tensor-parallel:
    each tp rank routes its sequence-parallel share of the tokens) on the tokens the all-to-all brings,
    and the dispatch and combine all-to-alls over the ep ranks in both passes
    (:func:`pipeloom.plan.tp.all_to_all.moe_exchanges`: rows, routing weights, ids and counts; their seconds
    also as ``f_comm`` / ``i_comm``: what an overlapped pair may hide, all but Hybrid-EP's host synchronization)."""
    spec, hw, tp, ep = job.spec, job.hw, layout.tp, layout.ep
    ex = spec.experts
    assert ex is not None
    local = max(1, tokens // tp)  # tokens this GPU routes
    parts = [_price(job, [(ex.count, spec.hidden)], local)]
    if ex.shared_intermediate:
        parts.append(_price(job, _mlp(spec, ex.shared_intermediate, tp, gated=True), tokens))
    experts_here = ex.count // ep
    per_expert = local * ex.top_k // experts_here  # balanced routing: each local expert's tokens
    parts.append(_price(job, _mlp(spec, ex.intermediate, 1, gated=True), per_expert, count=experts_here))
    a2a, held = {"F": 0.0, "I": 0.0}, 0.0  # held: of each pass's, what no compute beside it hides
    if ep > 1 and job.moe_comm == "deepseek":
        a2a["F"] = a2a["I"] = deepseek_all_to_all(job, layout, local)
    elif ep > 1 and job.moe_comm.startswith("hybridep"):
        a2a["F"], held = hybridep_all_to_all(job, layout, local)
        a2a["I"] = a2a["F"]
    elif ep > 1:  # the runtime's all-to-alls of this GPU's tokens (16-bit rows and weights)
        exchanges = moe_exchanges(tokens=local, hidden=spec.hidden, top_k=ex.top_k, ep=ep, dtype_bytes=2,
                                  experts=ex.count)
        per_domain = domain_ranks(ep, 1, hw)  # ep consecutive ranks (Layout.ep)
        a2a = {phase: sum(collective_seconds(hw, "all_to_all", e.bytes, ep, ranks_per_domain=per_domain)
                          for e in exchanges if e.phase == phase) for phase in ("F", "I")}
    times = add_times(*parts)
    return PhaseTimes(f=times.f + a2a["F"], i=times.i + a2a["I"], w=times.w, f_comm=a2a["F"] - held,
                      i_comm=a2a["I"] - held, parts=named_work(a2a=a2a["F"] + a2a["I"]))


def _deepseek_recompute(job: Job, tokens: int, tp: int, kind: str) -> float:
    """Seconds DeepSeek-V3's recomputation adds to a layer's backward
    (:func:`~pipeloom.plan.cluster.recompute.deepseek_activations`): the two RMSNorms (read h, write h, bf16),
    MLA's q and kv up-projection GEMMs and, in an MoE layer, the routed and shared experts' SwiGLU (read gate
    and up, write the product: 6 bytes per intermediate element)."""
    spec, hw, a = job.spec, job.hw, job.spec.attention
    norms = memory_seconds(hw, 2 * 4.0 * spec.hidden * tokens) + hw.kernel_overhead
    up = [(a.heads * a.qk_dim // tp, a.q_rank)] if a.q_rank else []
    if a.latent:
        up.append((a.heads * (a.qk_dim - a.rope_dim + a.v_dim) // tp, a.kv_rank))
    seconds = norms + _price(job, up, tokens).f
    if kind == "moe" and spec.experts is not None:
        ex = spec.experts
        # routed: this rank's tokens / tp, top-k copies each; shared: all tokens, sharded by tp
        seconds += memory_seconds(hw, 6.0 * (ex.top_k * ex.intermediate + ex.shared_intermediate) * tokens / tp)
    return seconds


def _megatron_recompute(job: Job, layout: Layout, tokens: int, kind: str, modules: tuple[str, ...], *,
                        core_f: float, tp_f: float, mlp: PhaseTimes) -> tuple[float, float]:
    """Seconds Megatron-Core's ``recompute_modules`` (:mod:`pipeloom.plan.cluster.recompute`) add to a layer's
    backward, and of them the all-to-alls' (an overlapped pair may hide them): each module's forward again, on
    the layer's F prices (``core_f`` the attention core, ``tp_f`` the layer's tp exchanges, ``mlp`` its MLP's
    GEMMs, all-to-alls included): ``core_attn`` the attention core; ``layernorm`` the separate norms (read h,
    write h); ``moe_act`` the routed experts' activation (read gate and up, write the product: 6 bytes per
    intermediate element); ``mla_up_proj`` MLA's q and kv up-projection GEMMs; ``mlp`` a dense MLP's GEMMs, its
    activation, its fused norm and half the layer's tp exchanges; ``moe`` the MoE MLP's GEMMs and all-to-alls
    and its experts' activations; ``shared_experts`` their GEMMs and activation. Not priced: the rotary
    embedding under ``mla_up_proj``, the token permutations under ``moe``."""
    spec, hw, tp, a = job.spec, job.hw, layout.tp, job.spec.attention
    sp = tp if tp > 1 and job.sequence_parallel else 1
    act = 6.0 if spec.gated else 4.0  # bytes per intermediate element of the activation: read 2 (1), write 1
    norm = memory_seconds(hw, 2 * 2.0 * spec.hidden * tokens / sp)  # one norm again: read h, write h (bf16)
    seconds, comm = core_f if "core_attn" in modules else 0.0, 0.0
    if "layernorm" in modules:
        seconds += separate_norms(spec, kind) * (norm + hw.kernel_overhead)
    if "mla_up_proj" in modules and a.latent:
        up = [(a.heads * a.qk_dim // tp, a.q_rank)] if a.q_rank else []
        seconds += _price(job, [*up, (a.heads * (a.qk_dim - a.rope_dim + a.v_dim) // tp, a.kv_rank)], tokens).f
    if kind == "dense" and "mlp" in modules:
        seconds += mlp.f + memory_seconds(hw, act * spec.intermediate * tokens / tp) + norm + tp_f / 2
    ex = spec.experts
    if kind == "moe" and ex is not None:
        routed = memory_seconds(hw, 6.0 * ex.top_k * ex.intermediate * max(1, tokens // tp))  # routed copies' act
        shared = memory_seconds(hw, 6.0 * ex.shared_intermediate * tokens / tp)  # the shared experts' activation
        if "moe" in modules:  # the MoE MLP's GEMMs and all-to-alls (``mlp``), and its experts' activations
            seconds, comm = seconds + mlp.f + routed + shared, comm + mlp.f_comm
        else:
            if "moe_act" in modules:
                seconds += routed
            if "shared_experts" in modules and ex.shared_intermediate:
                seconds += _price(job, _mlp(spec, ex.shared_intermediate, tp, gated=True), tokens).f + shared
    return seconds, comm


def _tp_time(job: Job, layout: Layout, tokens: int, kind: str, hidden_bytes: float, *,
             linear: bool = False) -> tuple[float, float]:
    """Seconds one layer's tensor-parallel exchanges add to its F and to its I: :func:`_tp_exchanges` run between
    the GEMMs, or with ``job.tp_overlap`` under sequence parallelism each exchange beside its GEMM, adding what
    :func:`overlapped_seconds` adds to it: the all-gather before the attention's first projection and the
    reduce-scatter after its output projection (a dense MLP's up and down projections likewise; a MoE layer's
    are exposed: they wrap the routed experts), in the input-gradient backward the reduce-scatter after the first
    projection's and the all-gather before the last one's input gradient."""
    hw, tp = job.hw, layout.tp
    sp = tp > 1 and job.sequence_parallel
    exposed = _tp_exchanges(hw, hidden_bytes, tp, sp=sp)
    if not (job.tp_overlap and sp):
        return exposed, exposed
    ranks = domain_ranks(tp, 1, hw)
    gather = collective_seconds(hw, "all_gather", hidden_bytes, tp, ranks_per_domain=ranks)
    scatter = collective_seconds(hw, "reduce_scatter", hidden_bytes, tp, ranks_per_domain=ranks)
    first, *_, last = _gemms(job.spec, tp, linear=linear)
    # (GEMM, the exchange beside it in F, the one beside its input gradient in I)
    pairs = [(first, gather, scatter), (last, scatter, gather)]
    if kind == "dense":
        up, down = _mlp(job.spec, job.spec.intermediate, tp, gated=job.spec.gated)
        pairs += [(up, gather, scatter), (down, scatter, gather)]
    f = i = exposed - (gather + scatter) * len(pairs) / 2  # a MoE block's exchanges stay exposed
    for gemm, forward, backward in pairs:
        times = _price(job, [gemm], tokens)
        f += overlapped_seconds(hw, times.f, forward) - times.f
        i += overlapped_seconds(hw, times.i, backward) - times.i
    return f, i


def _tp_exchanges(hw: Hardware, hidden_bytes: float, tp: int, *, sp: bool) -> float:
    """Seconds of one layer's tensor-parallel exchanges in one pass: under sequence parallelism an all-gather
    before and a reduce-scatter after attention and the MLP; without it an all-reduce after each (forward) or
    before each (the input gradient's backward)."""
    if tp == 1:
        return 0.0
    ranks = domain_ranks(tp, 1, hw)
    if sp:
        return 2 * (collective_seconds(hw, "all_gather", hidden_bytes, tp, ranks_per_domain=ranks)
                    + collective_seconds(hw, "reduce_scatter", hidden_bytes, tp, ranks_per_domain=ranks))
    return 2 * collective_seconds(hw, "all_reduce", hidden_bytes, tp, ranks_per_domain=ranks)
