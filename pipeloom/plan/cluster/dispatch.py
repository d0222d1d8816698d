"""The expert dispatch and combine of one pass with node-aware kernels, which send a token across the NICs once per
node it is routed to and fan it out over NVLink there: DeepSeek-V3's (FP8 dispatch, group-limited reach) and NVIDIA's
Hybrid-EP (bf16; as its published benchmark measured it, where it did), and what their kernels take from the compute
beside them (:func:`compute_hardware`, :func:`pair_slowdown`). The plain all-to-all is
:func:`pipeloom.plan.tp.all_to_all.moe_exchanges`."""

from __future__ import annotations

import dataclasses
import math

from pipeloom.plan.cluster.efficiency import domain_ranks, hidden_cost, node_dispatch_seconds
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.recompute import FP8_BYTES

__all__ = ["deepseek_all_to_all", "hybridep_all_to_all", "hybridep_bytes", "hybridep_generic_seconds",
           "compute_hardware", "compute_share", "pair_slowdown", "HybridEPRun", "HYBRIDEP_MEASURED", "HYBRIDEP_SMS"]


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


def hybridep_all_to_all(job: Job, layout: Layout, local: int) -> tuple[float, float]:
    """Seconds of one pass's dispatch and combine with NVIDIA's Hybrid-EP kernels, and of them the calls' host
    synchronization, which no compute beside them hides (the stream drains at it) (DeepSeek's DeepEP, ``hybrid-ep``
    branch, ``docs/Hybrid-EP_Implementation.md``; Megatron-Core's flex dispatcher with
    ``moe_flex_dispatcher_backend="hybridep"``): as DeepSeek-V3's, a token crosses InfiniBand once to each other
    node that holds any of its experts (to the GPU of its in-node index, whose RDMA buffer holds one copy per
    token and remote node) and fans out over NVLink there, once to each GPU holding any of its experts; both ways in
    bf16 (its FP8 dispatch is an option the recipes do not set). Where the kernels were measured on the GPU type
    and topology (:data:`HYBRIDEP_MEASURED`), each call is priced as measured: the kernel's rate on the bytes the
    benchmark counts (:func:`hybridep_bytes`) plus what a call through its torch API adds to the kernel (the
    measured difference, a constant per call; not under ``hybridep-sync-free``, whose buffers are sized ahead and whose
    calls wait for no host: Megatron-Core's sync-free experts); elsewhere the generic node-aware exchange
    (:func:`~pipeloom.plan.cluster.efficiency.node_dispatch_seconds`), the token reaching each other node with
    probability ``1 - C(E - E/D, k) / C(E, k)`` under uniform routing over ``E`` experts on ``D`` nodes, with the
    synchronization measured on the GPU type's other topology (none for a type never measured). The SMs
    its kernels hold are priced where an overlapped pair hides it (:func:`pair_slowdown`: the 32 Megatron-Bridge's
    recipes set); exposed, it runs alone."""
    ex = job.spec.experts
    assert ex is not None
    r = domain_ranks(layout.ep, 1, job.hw)
    nodes = layout.ep // r
    nearest, across = _nearest_run(job.hw.name, layout.ep)  # on either topology
    synchronized = 0.0
    if nearest is not None and job.moe_comm != "hybridep-sync-free":  # each call's host synchronization
        calls = hybridep_bytes(_BENCH_TOKENS, _BENCH_HIDDEN, _BENCH_TOP_K, _BENCH_LOCAL * nearest.ranks,
                               nearest.ranks, nearest.ranks // _BENCH_NODE if across else 1)
        synchronized = sum(calls / (api * 1e9) - calls / (kernel * 1e9) for kernel, api in (
            (nearest.dispatch_kernel, nearest.dispatch_api), (nearest.combine_kernel, nearest.combine_api)))
    measured = _hybridep_measured(job.hw.name, layout.ep, nodes)
    if measured is not None:  # measured on this topology: the kernels' rate
        ours = hybridep_bytes(local, job.spec.hidden, ex.top_k, ex.count, layout.ep, nodes)
        kernels = ours / (measured.dispatch_kernel * 1e9) + ours / (measured.combine_kernel * 1e9)
    else:
        kernels = hybridep_generic_seconds(job.hw, tokens=local, hidden=job.spec.hidden, top_k=ex.top_k,
                                           experts=ex.count, ranks=layout.ep)
    return kernels + synchronized, synchronized


def hybridep_generic_seconds(hw: Hardware, *, tokens: float, hidden: int, top_k: int, experts: int,
                             ranks: int) -> float:
    """Seconds of one Hybrid-EP dispatch and combine where it was not measured: the generic node-aware exchange
    (:func:`~pipeloom.plan.cluster.efficiency.node_dispatch_seconds`), a token reaching each other node holding any
    of its ``top_k`` of ``experts`` (uniform routing), in bf16 both ways."""
    nodes = ranks // domain_ranks(ranks, 1, hw)
    return node_dispatch_seconds(hw, tokens=tokens, hidden=hidden, top_k=top_k, ranks=ranks,
                                 remote=(nodes - 1) * _reach(experts, experts // nodes, top_k), widths=(2.0, 2.0))


@dataclasses.dataclass(frozen=True, slots=True)
class HybridEPRun:
    """One row of the Hybrid-EP benchmark (:data:`HYBRIDEP_MEASURED`): GB/s as the benchmark counts bytes
    (:func:`hybridep_bytes`), of the kernels alone (profiler kernel time) and through the torch API (each call's
    time, with its device synchronization and flag updates), bf16 both ways."""

    ranks: int
    dispatch_kernel: float
    combine_kernel: float
    dispatch_api: float
    combine_api: float


HYBRIDEP_MEASURED: dict[str, tuple[bool, tuple[HybridEPRun, ...]]] = {
    "h100": (True, (HybridEPRun(16, 71.71, 62.95, 54.47, 53.35), HybridEPRun(32, 57.69, 57.46, 47.36, 52.53),
                    HybridEPRun(64, 49.97, 49.77, 41.24, 46.57))),
    "b200": (False, (HybridEPRun(8, 734.95, 673.84, 535.94, 530.86),)),
    "gb200": (False, (HybridEPRun(8, 764.03, 737.13, 545.71, 568.94), HybridEPRun(16, 706.95, 666.26, 523.48, 521.55),
                      HybridEPRun(24, 665.97, 639.80, 507.32, 483.76), HybridEPRun(32, 642.23, 605.15, 484.22, 464.54),
                      HybridEPRun(36, 632.31, 596.99, 479.02, 447.89))),
}
"""Hybrid-EP's published benchmark (DeepEP ``hybrid-ep`` branch, ``docs/README_Hybrid-EP.md`` at 17cfb81, May 2026,
"Performance Results"; ``tests/test_hybrid_ep.py``) by GPU type: whether its ranks were across nodes, and its runs.
4,096 tokens a rank of hidden 7,168, top 8 of 8 experts a rank, uniform random routing, bf16. H100: across 2, 4 and
8 nodes of 8 (InfiniBand; 16 SMs, the most measured); B200: 8 GPUs in one node (NVLink; 16 SMs, the only count
given for Hybrid-EP); GB200: 8 to 36 GPUs of an NVL72 (multi-node NVLink; 32 SMs, as Megatron-Bridge's recipes set)."""
_BENCH_TOKENS, _BENCH_HIDDEN, _BENCH_TOP_K, _BENCH_LOCAL, _BENCH_NODE = 4096, 7168, 8, 8, 8
_HYBRIDEP_SAME = {"h200": "h100", "gb300": "gb200"}
"""GPU types priced with another's measurement: the H200 has the H100's NVLink and the same NICs in its HGX nodes; the
GB300 NVL72 the GB200's NVLink domain."""


def _nearest_run(gpu: str, ep: int) -> tuple[HybridEPRun | None, bool]:
    """The run measured on ``gpu``'s type closest to ``ep`` ranks in log scale (None where the type was never
    measured), and whether its type was measured across nodes."""
    across, runs = HYBRIDEP_MEASURED.get(_HYBRIDEP_SAME.get(gpu, gpu), (False, ()))
    return min(runs, key=lambda run: abs(math.log(run.ranks / ep)), default=None), across


def _hybridep_measured(gpu: str, ep: int, nodes: int) -> HybridEPRun | None:
    """:func:`_nearest_run` where it was measured on the same topology (across nodes where ``nodes > 1``, inside one
    scale-up domain otherwise); None where it was not."""
    run, across = _nearest_run(gpu, ep)
    return run if across == (nodes > 1) else None


def hybridep_bytes(tokens: float, hidden: int, top_k: int, experts: int, ranks: int, nodes: int) -> float:
    """Bytes one rank's Hybrid-EP call moves as its benchmark counts them (bf16): across ``nodes`` nodes, its tokens
    once to every node holding any of their experts, its own included (``count_rdma_send_from_routing_map``);
    inside one domain (``nodes`` 1), the tokens it receives, once per token and rank holding any of its experts
    (the dispatched tensor); under uniform routing."""
    if nodes > 1:
        return tokens * nodes * _reach(experts, experts // nodes, top_k) * hidden * 2.0
    return ranks * tokens * _reach(experts, experts // ranks, top_k) * hidden * 2.0


def _reach(experts: int, held: int, top_k: int) -> float:
    """The chance that a token's ``top_k`` of ``experts`` (uniform, without repeats) include one of ``held``."""
    return 1.0 - math.comb(experts - held, top_k) / math.comb(experts, top_k)


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
    if job.moe_comm.startswith("hybridep"):
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
