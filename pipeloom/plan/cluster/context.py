"""Context parallelism's attention core on one GPU: the cp shard's blocks of the load-balanced causal split and
the K/V exchanges beside them, as Megatron-Core / Transformer Engine pass K/V around a ring (``ring``) or as
PyTorch's ``context_parallel`` all-gathers them for torchtitan (``allgather``)."""

from __future__ import annotations

from pipeloom.plan.cluster.efficiency import (
    collective_seconds,
    domain_ranks,
    memory_seconds,
    overlapped_seconds,
    p2p_seconds,
)
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.cluster.model.spec import Attention

__all__ = ["context_parallel_core"]


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
