"""The expert dispatch and combine of one pass with node-aware kernels, which send a token across the NICs once per
node it is routed to and fan it out over NVLink there: DeepSeek-V3's (FP8 dispatch, group-limited reach) and NVIDIA's
Hybrid-EP (bf16). The plain all-to-all is :func:`pipeloom.plan.tp.all_to_all.moe_exchanges`."""

from __future__ import annotations

import math

from pipeloom.plan.cluster.efficiency import domain_ranks, node_dispatch_seconds
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.recompute import FP8_BYTES

__all__ = ["deepseek_all_to_all", "hybridep_all_to_all"]


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
    hides it (:func:`~pipeloom.plan.cluster.layer_time.pair_slowdown`: the 32 Megatron-Bridge's recipes set);
    exposed, it runs alone."""
    ex = job.spec.experts
    assert ex is not None
    r = domain_ranks(layout.ep, 1, job.hw)
    nodes = layout.ep // r
    per_node = ex.count // nodes
    missed = math.comb(ex.count - per_node, ex.top_k) / math.comb(ex.count, ex.top_k)
    return node_dispatch_seconds(job.hw, tokens=local, hidden=job.spec.hidden, top_k=ex.top_k, ranks=layout.ep,
                                 remote=(nodes - 1) * (1 - missed), widths=(2.0, 2.0))
