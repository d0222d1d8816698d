"""Attention that materializes the ``s x s`` scores in HBM, as Megatron-LM's core attention did before flash
attention (Narayanan et al. 2021, sec. 4.2: batched GEMMs for ``QKᵀ`` and ``PV`` around a fused
scale-mask-softmax kernel; attention dropout after the softmax, Megatron's default ``attention_dropout`` 0.1).

Per head and sequence, with ``e = s²`` score elements in 16-bit:

- forward: ``QKᵀ`` (an ``s x s x d`` GEMM over the full square: causality is a mask), the fused softmax (read
  the scores, write the probabilities: 4 bytes per element), dropout (read 2, write 2 and a 1-byte mask: 5),
  ``PV`` (``s x d x s``);
- backward: ``dV = Pᵀ dO`` and ``dP = dO Vᵀ``, dropout's backward (read the gradient and the mask, write:
  5), the softmax's (read the probabilities and their gradient, write the scores' gradient: 6), ``dQ = dS K``
  and ``dK = dSᵀ Q``.

GEMMs are priced by :func:`pipeloom.plan.cluster.efficiency.gemm_seconds` as one batched kernel over the
``batch x heads`` products, the elementwise passes by :func:`~pipeloom.plan.cluster.efficiency.memory_seconds`.
"""

from __future__ import annotations

from pipeloom.plan.cluster.efficiency import gemm_seconds, memory_seconds
from pipeloom.plan.cluster.hardware import Hardware

__all__ = ["ATTENTION_KINDS", "materialized_attention_seconds"]

ATTENTION_KINDS = ("flash", "flash2", "materialized")
"""Attention implementations: the GPU's best flash-attention kernel (FA3 / cuDNN on Hopper), FlashAttention-2
(PyTorch SDPA's first-priority backend, ``Hardware.flash2_slowdown`` slower), or scores materialized
(Megatron-LM 2021)."""

_SOFTMAX_F, _DROPOUT_F = 4, 5  # bytes per score element (module docstring)
_DROPOUT_B, _SOFTMAX_B = 5, 6


def materialized_attention_seconds(hw: Hardware, *, batch: int, heads: int, seq: int, head_dim: int,
                                   dtype: str = "bf16", backward: bool = False) -> float:
    """Seconds of the attention core with materialized scores, forward or backward (module docstring)."""
    count = batch * heads
    if count == 0 or seq == 0:
        return 0.0
    scores = float(count) * seq * seq
    if not backward:
        gemms = gemm_seconds(hw, seq, seq, head_dim, dtype=dtype, count=count) + gemm_seconds(
            hw, seq, head_dim, seq, dtype=dtype, count=count)
        return gemms + memory_seconds(hw, _SOFTMAX_F * scores) + memory_seconds(hw, _DROPOUT_F * scores)
    gemms = (3 * gemm_seconds(hw, seq, head_dim, seq, dtype=dtype, count=count)  # dV, dQ, dK
             + gemm_seconds(hw, seq, seq, head_dim, dtype=dtype, count=count))  # dP
    return gemms + memory_seconds(hw, _DROPOUT_B * scores) + memory_seconds(hw, _SOFTMAX_B * scores)
