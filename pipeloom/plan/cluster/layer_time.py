"""Seconds of one micro-batch through one layer of each kind on one GPU of a layout: its GEMMs at their
sharded shapes, the flash-attention core, bandwidth-bound elementwise work, and the tensor-, context- and
expert-parallel communication on the critical path, split into F, I (input gradient, plus what
recomputation adds) and W (weight gradient)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipeloom.plan.cluster.config import ModelSpec
from pipeloom.plan.cluster.counts import layer_counts
from pipeloom.plan.cluster.efficiency import (
    attention_seconds,
    collective_seconds,
    gemm_seconds,
    memory_seconds,
    p2p_seconds,
)
from pipeloom.plan.cluster.elementwise import layer_elementwise
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.materialized import materialized_attention_seconds
from pipeloom.plan.tp.all_to_all import moe_exchanges

__all__ = ["Job", "PhaseTimes", "layer_times", "domain_ranks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """What is trained where: the model, the GPU type and the step's size."""

    spec: ModelSpec
    """The model."""
    hw: Hardware
    """The GPU type."""
    gpus: int
    """GPUs of the job."""
    global_batch: int
    """Sequences per step."""
    seq: int
    """Tokens per sequence."""
    dtype: str = "bf16"
    """GEMM precision (bf16 or fp8; attention runs in bf16 either way)."""
    kernels: str = "fused"
    """Elementwise kernels: ``fused`` (Megatron, Transformer Engine, torch.compile) or ``eager`` (PyTorch op by
    op): :mod:`pipeloom.plan.cluster.elementwise`."""
    attention: str = "flash"
    """Attention core: ``flash`` (the GPU's best kernel), ``flash2`` (FlashAttention-2) or ``materialized`` scores
    (Megatron-LM 2021): :mod:`.materialized`."""
    selective: str = "attention"
    """What ``recompute=selective`` recomputes: ``attention`` (Megatron's: the attention core) or ``op``
    (torchtitan's op-level policy: every op but the matmuls and the attention kernel, and every second matmul of
    a layer: :func:`_op_recompute`) or ``layer`` (torchtitan's ``selective_ac_option = "2"``: every second
    layer recomputed whole)."""
    overlap_grad_reduce: bool = True
    """The data-parallel gradient exchange overlaps the backward bucket by bucket (Megatron-Core's
    ``--overlap-grad-reduce``, FSDP, DDP); False: one all-reduce after the last backward (Megatron-LM 2021)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseTimes:
    """Seconds of one micro-batch through one layer (or the embedding / head) on one GPU."""

    f: float
    """Forward."""
    i: float
    """Input-gradient backward (with recomputation)."""
    w: float
    """Weight-gradient backward."""


def domain_ranks(group: int, stride: int, hw: Hardware) -> int:
    """Ranks of a group of ``group`` ranks ``stride`` apart that share one scale-up domain (Megatron's rank
    order tp, cp, dp, pp: a group's members are consecutive multiples of its stride)."""
    return math.gcd(group, max(1, hw.scale_up_size // stride))


def _gemms(spec: ModelSpec, tp: int) -> list[tuple[int, int]]:
    """``(n, k)`` of the tensor-parallel shards of one layer's attention GEMMs (column-parallel: n / tp,
    row-parallel: k / tp; MLA's low-rank down-projections replicated)."""
    a, h = spec.attention, spec.hidden
    if a.latent:
        q = [(a.q_rank, h), (a.heads * a.qk_dim // tp, a.q_rank)] if a.q_rank else [(a.heads * a.qk_dim // tp, h)]
        kv = [(a.kv_rank + a.rope_dim, h), (a.heads * (a.qk_dim - a.rope_dim + a.v_dim) // tp, a.kv_rank)]
        return q + kv + [(h, a.heads * a.v_dim // tp)]
    qkv = a.heads * a.qk_dim + a.kv_heads * (a.qk_dim + a.v_dim)
    return [(qkv // tp, h), (h, a.heads * a.v_dim // tp)]


def _mlp(spec: ModelSpec, intermediate: int, tp: int, *, gated: bool) -> list[tuple[int, int]]:
    """``(n, k)`` of an MLP's up (column-parallel) and down (row-parallel) GEMM shards."""
    up = (2 if gated else 1) * intermediate // tp
    return [(up, spec.hidden), (spec.hidden, intermediate // tp)]


def _price(hw: Hardware, gemms: list[tuple[int, int]], m: int, dtype: str, count: int = 1) -> PhaseTimes:
    """F, I, W of GEMMs ``(m x k) @ (k x n)``: dX is ``(m x n) @ (n x k)``, dW ``(n x m) @ (m x k)``."""
    if m == 0:
        return PhaseTimes(f=0.0, i=0.0, w=0.0)
    return PhaseTimes(f=count * sum(gemm_seconds(hw, m, n, k, dtype=dtype) for n, k in gemms),
                      i=count * sum(gemm_seconds(hw, m, k, n, dtype=dtype) for n, k in gemms),
                      w=count * sum(gemm_seconds(hw, n, k, m, dtype=dtype) for n, k in gemms))


def _add(*parts: PhaseTimes) -> PhaseTimes:
    return PhaseTimes(f=sum(p.f for p in parts), i=sum(p.i for p in parts), w=sum(p.w for p in parts))


def layer_times(job: Job, layout: Layout, kind: str) -> PhaseTimes:
    """F, I and W seconds of one micro-batch through one layer of ``kind`` on one GPU of ``layout``."""
    spec, hw, tp, cp = job.spec, job.hw, layout.tp, layout.cp
    tokens = layout.mbs * job.seq // cp  # tokens of the micro-batch on this GPU's cp shard
    width = 2  # bf16 activations
    sp = tp > 1
    act = layer_counts(spec, kind, job.seq).activations["none"].per_gpu(tp=tp, cp=1, sp=sp)
    elementwise = memory_seconds(hw, 2.0 * act * tokens)  # write what is kept, read the inputs again
    tp_ranks = domain_ranks(tp, 1, hw)
    hidden_bytes = tokens * spec.hidden * width  # a full (all-gathered) hidden-state tensor
    if kind == "embedding":
        comm = collective_seconds(hw, "reduce_scatter", hidden_bytes, tp, ranks_per_domain=tp_ranks) if sp else 0.0
        return PhaseTimes(f=memory_seconds(hw, hidden_bytes) + comm, i=0.0, w=memory_seconds(hw, 2 * hidden_bytes))
    if kind == "head":
        gemm = _price(hw, [(spec.vocab // tp, spec.hidden)], tokens, job.dtype)
        comm = collective_seconds(hw, "all_gather", hidden_bytes, tp, ranks_per_domain=tp_ranks) if sp else 0.0
        loss = memory_seconds(hw, 3.0 * 4 * tokens * spec.vocab / tp)  # fp32 logits: softmax, its gradient
        return PhaseTimes(f=gemm.f + comm + loss, i=gemm.i + comm + elementwise, w=gemm.w)
    a = spec.attention
    # memory-bound kernels counted one by one (norms, residual adds, rotary, activation, MoE permutes)
    ew = layer_elementwise(spec, kind, tp=tp, sp=sp, kernels=job.kernels)
    ew_f = memory_seconds(hw, ew.f_bytes * tokens) + (ew.f_kernels - 1) * hw.kernel_overhead
    ew_b = memory_seconds(hw, ew.b_bytes * tokens) + (ew.b_kernels - 1) * hw.kernel_overhead
    parts = [_price(hw, _gemms(spec, tp), tokens, job.dtype)]
    head_dim = (a.qk_dim + a.v_dim) // 2
    # the cp shard's queries attend to the whole sequence: 1/cp of the causal square (load-balanced halves)
    core = _materialized if job.attention == "materialized" else attention_seconds
    if job.attention == "flash2":  # FA2's kernels: the best kernel's rates over the measured ratio
        slow = hw.flash2_slowdown
        hw = dataclasses.replace(hw, attention_efficiency=hw.attention_efficiency / slow,
                                 attention_backward_efficiency=hw.attention_backward_efficiency / slow)
    core_f = core(hw, batch=layout.mbs, heads=max(1, a.heads // tp), seq=job.seq, head_dim=head_dim) / cp
    core_b = core(hw, batch=layout.mbs, heads=max(1, a.heads // tp), seq=job.seq, head_dim=head_dim,
                  backward=True) / cp
    if cp > 1:  # ring attention: K/V blocks pass around the cp ring beside the block computations
        kv = tokens * a.kv_heads * (a.qk_dim + a.v_dim) * width / tp
        ring = (cp - 1) * p2p_seconds(hw, kv, same_domain=domain_ranks(cp, tp, hw) == cp)
        core_f, core_b = max(core_f, ring), max(core_b, 2 * ring)
    # sequence parallelism: all-gather before and reduce-scatter after attention and the MLP, both passes
    tp_comm = 2 * (collective_seconds(hw, "all_gather", hidden_bytes, tp, ranks_per_domain=tp_ranks)
                   + collective_seconds(hw, "reduce_scatter", hidden_bytes, tp, ranks_per_domain=tp_ranks)) if sp else 0
    if kind == "dense":
        parts.append(_price(hw, _mlp(spec, spec.intermediate, tp, gated=spec.gated), tokens, job.dtype))
    else:
        parts.append(_moe_times(job, layout, tokens))
    gemm = _add(*parts)
    f = gemm.f + core_f + ew_f + tp_comm
    i = gemm.i + core_b + ew_b + tp_comm
    if layout.recompute == "selective":
        if job.selective == "layer":  # every second layer checkpointed whole: half a forward per layer on average
            i += f / 2
        else:
            i += _op_recompute(job, tokens, tp) + ew_f if job.selective == "op" and kind == "dense" else core_f
    elif layout.recompute == "full":
        i += f
    return PhaseTimes(f=f, i=i, w=gemm.w)


def _op_recompute(job: Job, tokens: int, tp: int) -> float:
    """Seconds of the matmuls torchtitan's op-level selective checkpointing recomputes in a dense layer: its policy
    saves every matmul's output "except every second mm" counted per layer (torchtitan
    ``_apply_ac_to_transformer_block``), and a Llama layer calls wq, wk, wv, wo, w1, w3, w2: wk, wo and w3 run
    again (un-fused projections, as torchtitan's Llama is written). Other families are priced the same way."""
    spec, a = job.spec, job.spec.attention
    k_proj = (a.kv_heads * a.qk_dim // tp, spec.hidden)
    o_proj = (spec.hidden, a.heads * a.v_dim // tp)
    up = (spec.intermediate // tp, spec.hidden) if spec.gated else (0, spec.hidden)
    return _price(job.hw, [k_proj, o_proj, up], tokens, job.dtype).f


def _materialized(hw: Hardware, *, batch: int, heads: int, seq: int, head_dim: int, backward: bool = False) -> float:
    """The scores-in-HBM attention core in 16-bit (its GEMMs at the BF16 rate; FP8 recipes keep attention 16-bit)."""
    return materialized_attention_seconds(hw, batch=batch, heads=heads, seq=seq, head_dim=head_dim,
                                          backward=backward)


def _moe_times(job: Job, layout: Layout, tokens: int) -> PhaseTimes:
    """The MoE MLP: router and shared experts on this GPU's tokens, routed experts (not tensor-parallel:
    each tp rank routes its sequence-parallel share of the tokens) on the tokens the all-to-all brings,
    and the dispatch and combine all-to-alls over the ep ranks in both passes
    (:func:`pipeloom.plan.tp.all_to_all.moe_exchanges`: rows, routing weights, ids and counts)."""
    spec, hw, tp, ep = job.spec, job.hw, layout.tp, layout.ep
    ex = spec.experts
    assert ex is not None
    local = max(1, tokens // tp)  # tokens this GPU routes
    parts = [_price(hw, [(ex.count, spec.hidden)], local, job.dtype)]
    if ex.shared_intermediate:
        parts.append(_price(hw, _mlp(spec, ex.shared_intermediate, tp, gated=True), tokens, job.dtype))
    experts_here = ex.count // ep
    per_expert = local * ex.top_k // experts_here  # balanced routing: each local expert's tokens
    parts.append(_price(hw, _mlp(spec, ex.intermediate, 1, gated=True), per_expert, job.dtype, count=experts_here))
    # the runtime's all-to-alls of this GPU's tokens (16-bit rows and weights): pipeloom.plan.tp.all_to_all
    exchanges = moe_exchanges(tokens=local, hidden=spec.hidden, top_k=ex.top_k, ep=ep, dtype_bytes=2,
                              experts=ex.count)
    a2a = {phase: sum(collective_seconds(hw, "all_to_all", e.bytes, ep, ranks_per_domain=domain_ranks(ep, tp, hw))
                      for e in exchanges if e.phase == phase) for phase in ("F", "I")}
    times = _add(*parts)
    return PhaseTimes(f=times.f + a2a["F"], i=times.i + a2a["I"], w=times.w)
