"""The expert dispatch and combine of one pass with node-aware kernels, which send a token across the NICs once per
node it is routed to and fan it out over NVLink there: DeepSeek-V3's (FP8 dispatch, group-limited reach) and NVIDIA's
Hybrid-EP (bf16), and what their kernels take from the compute beside them (:func:`compute_hardware`,
:func:`pair_slowdown`). The plain all-to-all is :func:`pipeloom.plan.tp.all_to_all.moe_exchanges`."""

from __future__ import annotations

import dataclasses
import math

from pipeloom.plan.cluster.efficiency import domain_ranks, hidden_cost, node_dispatch_seconds
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.recompute import FP8_BYTES

__all__ = ["deepseek_all_to_all", "hybridep_all_to_all", "compute_hardware", "compute_share", "pair_slowdown",
           "HYBRIDEP_SMS"]


def deepseek_all_to_all(job: Job, layout: Layout, local: int) -> float:
    """Seconds of one pass's dispatch and combine with DeepSeek-V3's kernels (report sec. 3.2.2, 3.3.4): the
    dispatch in FP8 (1 byte and a 4-byte scale per 128 elements), the combine in bf16; each token crosses
    InfiniBand once per node it is routed to (to the GPU of the same in-node index, which forwards it over
    NVLink), and group-limited routing caps those nodes at ``group_top_k`` groups' nodes (4 for DeepSeek-V3,
    whose 8 groups are its 8 nodes under ep = 64). Per token, the NIC carries ``reach · (D-1)/D`` copies (D
    nodes in the ep group, uniform routing) and NVLink ``top_k · (r-1)/r``; the two run at once, as in
    :func:`~pipeloom.plan.cluster.efficiency.collective_seconds`'s all-to-all."""
    ex = job.spec.experts
    assert ex is not None
    r = domain_ranks(layout.ep, 1, job.hw)
    nodes = layout.ep // r
    reach = min(ex.top_k, nodes)
    if ex.group_top_k:
        reach = min(reach, ex.group_top_k * math.ceil(nodes / ex.groups))
    return node_dispatch_seconds(job.hw, tokens=local, hidden=job.spec.hidden, top_k=ex.top_k, ranks=layout.ep,
                                 remote=reach * (nodes - 1) / nodes, widths=(FP8_BYTES, 2.0))


def hybridep_all_to_all(job: Job, layout: Layout, local: int) -> float:
    """Seconds of one pass's dispatch and combine with NVIDIA's Hybrid-EP kernels (DeepEP's ``hybrid-ep``
    branch, ``docs/Hybrid-EP_Implementation.md``; Megatron-Core's flex dispatcher with
    ``moe_flex_dispatcher_backend="hybridep"``): as DeepSeek-V3's, a token crosses InfiniBand once to each other
    node that holds any of its experts (to the GPU of its in-node index, whose RDMA buffer holds one copy per
    token and remote node) and fans out over NVLink there; both ways in bf16 (its FP8 dispatch is an option the
    recipes do not set). With uniform routing over ``E`` experts on ``D`` nodes, a token reaches each other node
    with probability ``1 - C(E - E/D, k) / C(E, k)``. The SMs its kernels hold are priced where an overlapped pair
    hides it (:func:`pair_slowdown`: the 32 Megatron-Bridge's recipes set); exposed, it runs alone."""
    ex = job.spec.experts
    assert ex is not None
    r = domain_ranks(layout.ep, 1, job.hw)
    nodes = layout.ep // r
    per_node = ex.count // nodes
    missed = math.comb(ex.count - per_node, ex.top_k) / math.comb(ex.count, ex.top_k)
    return node_dispatch_seconds(job.hw, tokens=local, hidden=job.spec.hidden, top_k=ex.top_k, ranks=layout.ep,
                                 remote=(nodes - 1) * (1 - missed), widths=(2.0, 2.0))


HYBRIDEP_SMS = 32
"""SMs NVIDIA's Hybrid-EP dispatch and combine kernels hold while they run: Megatron-Bridge's performance recipes set
``moe_hybridep_num_sms = 32`` for that backend (``src/megatron/bridge/perf_recipes/_common.py`` at v0.6.0;
Megatron-Core's ``moe_flex_dispatcher_num_sms`` otherwise leaves the count to the backend)."""


def pair_slowdown(job: Job) -> float:
    """The share of each second of expert all-to-all an overlapped pair hides that the compute beside it loses
    (:func:`~pipeloom.ir.pair_duration`'s ``slowdown``): none under DeepSeek-V3's kernels, whose SMs are taken from
    the compute all along (:func:`compute_hardware`); under Hybrid-EP's, its :data:`HYBRIDEP_SMS` SMs' share of the
    GPU's while it runs; beside an NCCL all-to-all, the slowdown any collective costs the compute beside it
    (``s / (1 + s)`` of its seconds for ``hw.overlap_slowdown`` ``s``:
    :func:`~pipeloom.plan.cluster.efficiency.hidden_cost`)."""
    if job.moe_comm == "deepseek":
        return 0.0
    if job.moe_comm == "hybridep":
        return min(1.0, HYBRIDEP_SMS / job.hw.sm_count)
    return hidden_cost(job.hw, 1.0)


_COMM_SMS = 20
"""SMs DeepSeek-V3's all-to-all kernels occupy on an H800 (report sec. 3.2.2: "only 20 SMs are sufficient to
fully utilize the bandwidths of IB and NVLink"), leaving the rest to compute."""


def compute_hardware(job: Job, layout: Layout) -> Hardware:
    """The GPU as compute kernels see it in ``layout``: with DeepSeek-V3's all-to-all kernels on an ep mesh, the
    SMs they hold all along are taken (:func:`compute_share`); otherwise ``job.hw``."""
    return compute_share(job.hw) if job.moe_comm == "deepseek" and layout.ep > 1 else job.hw


def compute_share(hw: Hardware) -> Hardware:
    """``hw`` with :data:`_COMM_SMS` SMs taken by communication: the peak rates and the SMs for wave
    quantization scale by the SMs left."""
    left = hw.sm_count - _COMM_SMS
    if left < 1:
        return hw
    share = left / hw.sm_count
    return dataclasses.replace(hw, sm_count=left, peak_flops={k: v * share for k, v in hw.peak_flops.items()})
