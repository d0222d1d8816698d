"""Seconds of the operations of a training step on one GPU type (:class:`~pipeloom.plan.cluster.hardware.Hardware`):
GEMMs and flash attention at a shape-dependent fraction of peak, bandwidth-bound elementwise work,
collectives over the scale-up / scale-out topology, and point-to-point sends between pipeline stages.

**GEMM** (``m x k`` times ``k x n``, ``2mnk`` FLOPs)::

    t = overhead + max(2mnk / (peak · E · f(m)·f(n)·f(k)),  bytes / (HBM · e_mem)),   f(d) = d / (d + d½)

``E`` is the large-shape efficiency (maximum achievable matmul FLOPS / peak) of the GEMM's dtype (FP8's
own where the GPU has a measurement: :meth:`~pipeloom.plan.cluster.hardware.Hardware.gemm_ceiling`), ``d½``
the half-rate dimension; ``bytes`` reads both inputs at the dtype's width and writes the output in BF16. The rate
``2mnk / t`` never exceeds ``E · peak``. On top of the smooth ``f`` (fixed per-tile prologue and epilogue
costs), **wave quantization** (NVIDIA, "Matrix Multiplication Background User's Guide", sections on tile and
wave quantization): the output is cut into ``tm x tn`` tiles, one per SM at a time, so the GEMM takes
``⌈tiles / SMs⌉`` waves where ``m·n / (tm·tn·SMs)`` would do (an edge tile runs whole); the factor is their ratio,
for the better of the tiles cuBLAS/CUTLASS use for large BF16/FP8 GEMMs, 128x128 and 256x128 (``count`` GEMMs of a
grouped kernel share the waves; below one wave split-K fills the GPU). **FP8** GEMMs cast their inputs beside the
GEMM (one kernel overhead for the casts), memory-bound: ``cast`` gives the bytes moved per element of each input,
5 for per-tensor dynamic scaling (:data:`DYNAMIC_CAST_BYTES`: read for the absolute maximum, then read again and
write the FP8 copy, 2 + 2 + 1), 4 where the amax is taken in the cast kernel, which writes the copy and its transpose
(:data:`FUSED_CAST_BYTES`: Transformer Engine's delayed scaling), 6 where an amax pass comes first
(:data:`CURRENT_CAST_BYTES`: Transformer Engine's current scaling), 4 and a sixteenth for MXFP8's two block-scaled
copies (:data:`MXFP8_CAST_BYTES`), 0 for an input whose FP8 copy is reused. Not modelled: layouts, power caps.

**Attention** (flash attention: no ``s x s`` matrix in HBM): the forward is ``4·b·h·s²·d`` FLOPs (``QKᵀ``
and ``PV``), half of it when causal (a sliding window of ``w < s`` tokens: the band, ``(w·s - w²/2) / s²`` of
the square); the backward ``2.5x`` that (five matmuls, one of them the recomputed ``QKᵀ``). Rate
``peak · A · L / (L + s½)`` with ``A`` the forward's or the backward's efficiency and ``L`` the keys a query
attends to, ``s`` (``min(s, w)`` under a window: a query tile loops over that many keys), in a roofline with
reading and writing ``q, k, v, o`` (and their gradients). Grouped-query attention is priced like multi-head
attention with ``heads`` query heads (its smaller K/V traffic is not modelled).

**Attention with its scores in HBM** (:func:`materialized_attention_seconds`), as Megatron-LM's core attention
ran before flash attention (Narayanan et al. 2021, sec. 4.2: batched GEMMs for ``QKᵀ`` and ``PV`` around a fused
scale-mask-softmax kernel; attention dropout after the softmax, Megatron's default ``attention_dropout`` 0.1).

Per head and sequence, with ``e = s²`` score elements in 16-bit:

- forward: ``QKᵀ`` (an ``s x s x d`` GEMM over the full square: causality is a mask), the fused softmax (read
  the scores, write the probabilities: 4 bytes per element), dropout (read 2, write 2 and a 1-byte mask: 5),
  ``PV`` (``s x d x s``);
- backward: ``dV = Pᵀ dO`` and ``dP = dO Vᵀ``, dropout's backward (read the gradient and the mask, write:
  5), the softmax's (read the probabilities and their gradient, write the scores' gradient: 6), ``dQ = dS K``
  and ``dK = dSᵀ Q``.

GEMMs are priced by :func:`gemm_seconds` as one batched kernel over the ``batch x heads`` products, the
elementwise passes by :func:`memory_seconds`.

**Collectives** (``nbytes`` = the whole tensor: an all-gather's output, a reduce-scatter's input, an
all-reduce's buffer; for an all-to-all each rank's buffer). ``ranks = r · D`` with ``r`` ranks in each of
``D`` scale-up domains, hierarchical as NCCL's topology-aware paths behave at scale:

- all-reduce: reduce-scatter inside the domain, all-reduce of the ``1/r`` shard across domains
  (``r`` parallel rings, one NIC each), all-gather inside the domain;
- all-gather: all-gather of the ``1/r`` shard across domains, then inside; reduce-scatter the reverse;
- all-to-all: each rank sends ``(r-1)/n`` of its buffer over the scale-up link and ``(n-r)/n`` over its
  NIC, the two at once (the slower one counts; each part priced by
  :func:`pipeloom.plan.tp.all_to_all.all_to_all_seconds`).

Each ring level moves ``share · S`` at ``B · e`` (the ring algebra of
:meth:`pipeloom.plan.tp.collectives.CollectiveFit.seconds`: ``2(n-1)/n`` of the bytes for an all-reduce,
``(n-1)/n`` otherwise). NCCL pipelines chunks through every hop, so the levels overlap: the collective
takes the slower level's transfer time plus every level's latency (ring steps inside a domain; across
domains NCCL's trees and PAT bound the steps by ``2·⌈log₂ D⌉`` for an all-reduce, ``⌈log₂ D⌉``
otherwise). Checked against public nccl-tests bus bandwidths: 8 A100s in one node 240 GB/s predicted
(230-250 measured; the link efficiency comes from that figure), 16 H100s over two nodes 384 GB/s
predicted (400-450 reported for NVLink + NDR InfiniBand). NVLink SHARP (in-switch reduction) and SHARP
on InfiniBand are not modelled (they make all-reduces faster than this).

**What overlaps what** (guidance for the step estimator; these functions price each operation alone):

- Data-parallel gradient reduce-scatter / all-reduce overlaps the backward of earlier layers, bucket by
  bucket; only the last bucket's and whatever exceeds the backward's length is exposed. The
  distributed optimizer's parameter all-gather overlaps the next step's forward the same way.
- FSDP: the all-gather of layer ``i+1``'s weights is prefetched during layer ``i``'s forward (and
  backward); the gradient reduce-scatter overlaps the backward. Exposed: the first gather, the last
  reduce-scatter, and any collective longer than the layer computing beside it.
- Tensor-parallel all-gather / reduce-scatter (sequence parallel) or all-reduce sit on the critical path
  between GEMMs unless a framework overlaps them (Megatron's TP comm overlap, async TP): count them.
- Context-parallel ring attention sends K/V blocks to the next rank while computing the current block:
  exposed only where a block's send outlasts its attention.
- Expert-parallel all-to-all (dispatch and combine) is on the critical path, except where a schedule
  pairs one micro-batch's all-to-all with another's compute (DualPipe's overlapped F&B pairs).
- Pipeline sends between stages overlap the receiving stage's other work in the schedule; the
  simulator places them.
- Compute kernels do not overlap each other; a collective running beside compute slows that compute
  (its kernels hold SMs and HBM bandwidth): :func:`overlapped_seconds` prices the two together.
"""

from __future__ import annotations

import math

from pipeloom.plan.cluster.counts import attended_fraction
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.errors import HardwareError
from pipeloom.plan.tp.all_to_all import all_to_all_seconds
from pipeloom.plan.tp.collectives import CollectiveFit

__all__ = ["ATTENTION_KINDS", "COLLECTIVE_KINDS", "CURRENT_CAST_BYTES", "DYNAMIC_CAST_BYTES", "FUSED_CAST_BYTES",
           "MXFP8_CAST_BYTES",
           "attention_flops", "attention_seconds", "collective_seconds", "domain_ranks", "dtype_bytes",
           "gemm_efficiency", "gemm_seconds", "hidden_cost", "materialized_attention_seconds", "memory_seconds",
           "node_dispatch_seconds", "overlapped_seconds", "p2p_seconds", "wave_efficiency"]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Collective kinds :func:`collective_seconds` prices."""

_BYTES = {"bf16": 2, "fp8": 1}
_BACKWARD = 2.5
"""Flash attention's backward FLOPs per forward FLOP (FlashAttention-2 paper, sec. 4: five matmuls to two)."""


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of a GEMM input in ``dtype``."""
    if dtype not in _BYTES:
        raise HardwareError(f"unknown dtype {dtype!r}; use {' or '.join(map(repr, _BYTES))}")
    return _BYTES[dtype]


def _dims(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise HardwareError(f"{name} must be a whole number >= 0, got {value!r}")


def _sizes(**sizes: float) -> None:
    """Shape sizes may be averages (tokens per expert of a mixture of experts): any finite number >= 0."""
    for name, value in sizes.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise HardwareError(f"{name} must be a number >= 0, got {value!r}")


_TILES = ((128, 128), (256, 128))
"""Output tiles (rows x columns) of the large-GEMM kernels (CUTLASS/cuBLAS on Ampere and Hopper)."""
DYNAMIC_CAST_BYTES = 5
"""Bytes per input element of an FP8 cast under per-tensor dynamic scaling (torchao's tensor-wise recipe): read
for the absolute maximum (2), then read and write the FP8 copy (2 + 1)."""
FUSED_CAST_BYTES = 4
"""Bytes per input element of an FP8 cast that takes the amax in the cast kernel (Transformer Engine's delayed
scaling, whose scale comes from earlier steps' amax history): read (2) and write the FP8 copy and its transpose
(1 + 1: Hopper's FP8 GEMMs take only the "TN" layout, both operands K-major (cuBLASLt's FP8 matmul), so the
weight gradient's GEMM needs the transposed copies: Transformer Engine's fused cast-transpose)."""
CURRENT_CAST_BYTES = 6
"""Bytes per input element of Transformer Engine's current-scaling cast (``Float8CurrentScaling``, Megatron-Bridge's
FP8-CS): an amax pass over the input first (2: ``Float8CurrentScalingQuantizer::quantize_impl`` runs
``nvte_compute_amax`` before the quantize kernel), then the fused cast-transpose of :data:`FUSED_CAST_BYTES` (4)."""
MXFP8_CAST_BYTES = 2 + 2 * (1 + 1 / 32)
"""Bytes per input element of Transformer Engine's MXFP8 cast (``MXFP8BlockScaling``, Blackwell): read (2) and write
two FP8 copies, one scaled per 32 elements along each row and one per 32 along each column, each with its one-byte
E8M0 scale per block (1 + 1/32 each). The block scales need no amax pass, and the two copies are quantized apart
from the full-precision input, not transposed from each other (Transformer Engine's MXFP8 documentation,
``docs/features/low_precision_training/mxfp8``: "rowwise and columnwise MXFP8 tensors are numerically different"),
in one pass over it (``common/cast/mxfp8/quantize_mxfp8.cuh``: one kernel takes both scales of each 128 x 128
chunk)."""


def fp8_weight_copy_bytes(cast: str, *, any_layout: bool) -> float:
    """Bytes per weight element of the FP8 copies Transformer Engine keeps through a step (each made at the first
    micro-batch, ``is_first_microbatch``): ``cached``, ``current``: the copy and, where FP8 GEMMs take one layout only
    (Hopper), its transpose; ``mxfp8``: the two block-scaled copies with their scales; 0 for torchao's ``dynamic``."""
    one = 1.0 if any_layout else 2.0  # the copy, and its transpose where FP8 GEMMs take one layout only
    return {"cached": one, "current": one, "mxfp8": 2 * (1 + 1 / 32), "dynamic": 0.0}[cast]


def wave_efficiency(hw: Hardware, m: float, n: float, count: int = 1) -> float:
    """Used fraction of the waves of ``count`` GEMMs with an ``m x n`` output on ``hw.sm_count`` SMs: the output's
    ``count·m·n / (tm·tn)`` tiles' worth of work over ``⌈tiles / SMs⌉`` waves of whole tiles, the better of
    :data:`_TILES` (a partial row of tiles that completed a wave had counted as work: 4,097 rows priced 3 % faster
    than 4,096). A dimension under one tile counts as one (its short tiles are the smooth ``f``'s cost); below one
    wave split-K fills the SMs, so the factor is 1 there."""
    best = 0.0
    for tm, tn in _TILES:
        tiles = count * math.ceil(m / tm) * math.ceil(n / tn)
        if tiles <= hw.sm_count:
            return 1.0
        work = count * max(m, tm) * max(n, tn) / (tm * tn)
        best = max(best, work / (hw.sm_count * math.ceil(tiles / hw.sm_count)))
    return best


def gemm_efficiency(hw: Hardware, m: float, n: float, k: float, count: int = 1, *, dtype: str = "bf16") -> float:
    """Fraction of ``dtype``'s peak the GEMM's compute runs at: ``E · Π d / (d + d½)`` over ``m, n, k``
    (``E`` the GPU's ceiling for that dtype, :meth:`Hardware.gemm_ceiling`), times :func:`wave_efficiency`."""
    half = hw.gemm_half_dim
    smooth = hw.gemm_ceiling(dtype) * (m / (m + half)) * (n / (n + half)) * (k / (k + half))
    return smooth * wave_efficiency(hw, m, n, count)


def gemm_seconds(hw: Hardware, m: float, n: float, k: float, *, dtype: str = "bf16", count: int = 1,
                 cast: tuple[float, float] = (DYNAMIC_CAST_BYTES, DYNAMIC_CAST_BYTES)) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` GEMM (module docstring: roofline with a size-dependent
    efficiency, plus the kernel overhead); 0 when any dimension is 0. ``count`` same-shape GEMMs run as one
    grouped kernel (the experts of a mixture of experts): one overhead, ``count`` times the work, each at
    its own shape's efficiency. ``m`` may be an average (tokens per expert). ``cast``: in FP8, the bytes moved
    per element to cast the ``m x k`` and the ``k x n`` input (module docstring)."""
    _sizes(m=m, n=n, k=k)
    _dims(count=count)
    if not isinstance(cast, tuple) or len(cast) != 2:
        raise HardwareError(f"cast must be two byte counts (per element of each input), got {cast!r}")
    _sizes(cast_first=cast[0], cast_second=cast[1])
    peak, width = hw.peak(dtype), dtype_bytes(dtype)
    if m == 0 or n == 0 or k == 0 or count == 0:
        return 0.0
    compute = 2.0 * m * n * k / (peak * gemm_efficiency(hw, m, n, k, count, dtype=dtype))
    traffic = (m * k + k * n) * width + m * n * 2
    bandwidth = hw.memory_bandwidth * hw.memory_efficiency
    seconds = hw.kernel_overhead + count * max(compute, traffic / bandwidth)
    moved = cast[0] * m * k + cast[1] * k * n
    if dtype == "fp8" and moved:  # the inputs' casts, memory-bound
        seconds += hw.kernel_overhead + count * moved / bandwidth
    return seconds


def attention_flops(*, batch: float, heads: int, seq: int, head_dim: int, causal: bool = True, window: int = 0,
                    chunked: bool = False, backward: bool = False) -> float:
    """FLOPs of the flash-attention core: ``4·b·h·s²·d`` forward (half when causal; a causal sliding ``window``'s
    band, or ``chunked`` in chunks of ``window`` tokens each chunk's triangle:
    :func:`~pipeloom.plan.cluster.counts.attended_fraction`), 2.5x that backward."""
    _sizes(batch=batch)
    _dims(heads=heads, seq=seq, head_dim=head_dim)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise HardwareError(f"window must be a number of tokens >= 0 (0: none), got {window!r}")
    forward = 4.0 * batch * heads * seq * seq * head_dim * (attended_fraction(seq, window, chunked=chunked)
                                                           if causal else 1.0)
    return forward * (_BACKWARD if backward else 1.0)


def attention_seconds(hw: Hardware, *, batch: float, heads: int, seq: int, head_dim: int, causal: bool = True,
                      window: int = 0, chunked: bool = False, dtype: str = "bf16", backward: bool = False,
                      calls_of: int = 0) -> float:
    """Seconds of the flash-attention core, forward or backward (module docstring), with a causal sliding
    ``window`` of that many tokens (0: none), or ``chunked`` in chunks of ``window`` tokens. Megatron's and
    Transformer Engine's FP8 recipes keep attention in BF16: pass ``dtype="bf16"`` for them. ``calls_of``: the work
    run as kernel calls over blocks of that many keys (a context-parallel ring's), at those calls' rate."""
    flops = attention_flops(batch=batch, heads=heads, seq=seq, head_dim=head_dim, causal=causal, window=window,
                            chunked=chunked, backward=backward)
    peak, width = hw.peak(dtype), dtype_bytes(dtype)
    if flops == 0:
        return 0.0
    share = hw.attention_backward_efficiency if backward else hw.attention_efficiency
    keys = min(seq, window) if causal and window else seq  # keys each query's tile loops over (at most a chunk's)
    keys = min(keys, calls_of) if calls_of else keys
    compute = flops / (peak * share * keys / (keys + hw.attention_half_seq))
    # Forward reads q, k, v and writes o; backward reads those and do, writes dq, dk, dv.
    traffic = (8 if backward else 4) * batch * heads * seq * head_dim * width
    return hw.kernel_overhead + max(compute, traffic / (hw.memory_bandwidth * hw.memory_efficiency))


def memory_seconds(hw: Hardware, nbytes: float) -> float:
    """Seconds of bandwidth-bound elementwise work moving ``nbytes`` (reads plus writes) through HBM."""
    if not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise HardwareError(f"nbytes must be a number of bytes >= 0, got {nbytes!r}")
    if nbytes == 0:
        return 0.0
    return hw.kernel_overhead + nbytes / (hw.memory_bandwidth * hw.memory_efficiency)


def _bandwidth(hw: Hardware, *, same_domain: bool) -> float:
    if same_domain:
        return hw.scale_up_bandwidth * hw.scale_up_efficiency
    return hw.scale_out_bandwidth * hw.scale_out_efficiency


def _ring(kind: str, nbytes: float, size: int, bandwidth: float) -> float:
    """Bandwidth term of one ring level (the shared ring algebra, no latency)."""
    return CollectiveFit.from_link(0.0, bandwidth).seconds(kind, nbytes, size)


def _steps(kind: str, size: int, *, tree: bool) -> int:
    if size <= 1:
        return 0
    twice = 2 if kind == "all_reduce" else 1
    ring = twice * (size - 1)
    return min(ring, twice * math.ceil(math.log2(size))) if tree else ring


def collective_seconds(hw: Hardware, kind: str, nbytes: float, ranks: int, *, ranks_per_domain: int) -> float:
    """Seconds of one collective of ``nbytes`` (the whole tensor) over ``ranks`` ranks of which
    ``ranks_per_domain`` share each scale-up domain (hierarchical algorithm, module docstring)."""
    if kind not in COLLECTIVE_KINDS:
        raise HardwareError(f"collective kind {kind!r} is not one of {', '.join(COLLECTIVE_KINDS)}")
    _dims(ranks=ranks, ranks_per_domain=ranks_per_domain)
    if ranks < 1 or ranks_per_domain < 1 or ranks % ranks_per_domain:
        raise HardwareError(f"ranks_per_domain ({ranks_per_domain}) must be >= 1 and divide ranks ({ranks})")
    if ranks_per_domain > hw.scale_up_size:
        raise HardwareError(f"ranks_per_domain {ranks_per_domain} exceeds {hw.name}'s scale-up domain of "
                            f"{hw.scale_up_size} GPUs; place at most {hw.scale_up_size} of the group's ranks in "
                            f"one domain")
    memory_seconds(hw, nbytes)  # validates nbytes
    if ranks == 1 or nbytes == 0:
        return 0.0
    # the transfer never faster than with as many of the ranks in each domain as it holds (the NIC is the slower
    # link; the levels alone would move two domains of 8 faster than one of 16, whose ring moves 15/16 of the bytes
    # against 7/8); the latency is the algorithm's for this placement
    most = next(r for r in range(min(ranks, hw.scale_up_size), 0, -1) if ranks % r == 0)
    transfer, latency = _levels(hw, kind, nbytes, ranks, ranks_per_domain)
    if most != ranks_per_domain:
        transfer = max(transfer, _levels(hw, kind, nbytes, ranks, most)[0])
    return transfer + latency


def _levels(hw: Hardware, kind: str, nbytes: float, ranks: int, r: int) -> tuple[float, float]:
    """``(transfer, latency)`` seconds of :func:`collective_seconds` by the hierarchical algorithm, ``r`` ranks in
    each domain."""
    domains = ranks // r
    up, out = _bandwidth(hw, same_domain=True), _bandwidth(hw, same_domain=False)
    if kind == "all_to_all":
        inside = all_to_all_seconds(nbytes, ranks, peers=r - 1, latency=hw.scale_up_latency, bandwidth=up)
        across = all_to_all_seconds(nbytes, ranks, peers=ranks - r, latency=hw.scale_out_latency, bandwidth=out)
        return max(inside, across), 0.0
    inner = "reduce_scatter" if kind == "all_reduce" else kind
    twice = 2 if kind == "all_reduce" else 1  # an all-reduce passes the domain twice: reduce-scatter, all-gather
    inside = twice * _ring(inner, nbytes, r, up)
    across = _ring(kind, nbytes / r, domains, out)
    # NCCL pipelines chunks through every hop, so the levels' transfers overlap: the slower one counts.
    latency = (twice * _steps(inner, r, tree=False) * hw.scale_up_latency
               + _steps(kind, domains, tree=True) * hw.scale_out_latency)
    if kind != "all_reduce" and r > 1 and domains > 1:
        # NCCL's log-depth all-gather / reduce-scatter (PAT) takes one GPU per node; with more it runs its ring, whose
        # ranks - 1 steps each wait for the last: domains - 1 of them across (src/graph/tuning.cc)
        latency = (ranks - domains) * hw.scale_up_latency + (domains - 1) * hw.scale_out_latency
    return max(inside, across), latency


def node_dispatch_seconds(hw: Hardware, *, tokens: float, hidden: int, top_k: int, ranks: int, remote: float,
                          widths: tuple[float, float]) -> float:
    """Seconds of an expert dispatch and combine (bytes per element ``widths``) over ``ranks`` expert-parallel
    GPUs that send each of ``tokens`` tokens ``remote`` times over the NIC (once per other scale-up domain it is
    routed to, to the GPU of its in-domain index) and ``top_k · (r-1)/r`` times over the scale-up link (its
    copies to the domain's other GPUs); the two run at once, as in :func:`collective_seconds`'s all-to-all."""
    r = domain_ranks(ranks, 1, hw)
    nodes = ranks // r
    up = hw.scale_up_bandwidth * hw.scale_up_efficiency
    out = hw.scale_out_bandwidth * hw.scale_out_efficiency
    seconds = 0.0
    for width in widths:  # dispatch, combine
        token = hidden * width
        across = tokens * remote * token / out + (hw.scale_out_latency if nodes > 1 else 0.0)
        inside = tokens * top_k * (r - 1) / r * token / up + (hw.scale_up_latency if r > 1 else 0.0)
        seconds += max(across, inside)
    return seconds


def p2p_seconds(hw: Hardware, nbytes: float, *, same_domain: bool) -> float:
    """Seconds of one send of ``nbytes`` between two GPUs, inside one scale-up domain or across."""
    memory_seconds(hw, nbytes)  # validates nbytes
    if nbytes == 0:
        return 0.0
    latency = hw.scale_up_latency if same_domain else hw.scale_out_latency
    return latency + nbytes / _bandwidth(hw, same_domain=same_domain)


def overlapped_seconds(hw: Hardware, compute: float, comm: float) -> float:
    """Seconds of ``compute`` seconds of kernels (alone) with a ``comm``-second collective or send running beside
    them. While both run, compute goes ``1 + hw.overlap_slowdown`` times slower; a collective longer than the
    slowed compute is the whole time: ``max(comm, compute + comm · s / (1 + s))``. With ``s = 0`` it is
    ``max(compute, comm)``."""
    if compute < 0 or comm < 0:
        raise HardwareError(f"seconds must be >= 0, got compute {compute!r} and comm {comm!r}")
    return max(comm, compute + hidden_cost(hw, comm))


def hidden_cost(hw: Hardware, comm: float) -> float:
    """Seconds a ``comm``-second collective that compute hides entirely still adds to that compute: what the
    compute loses while sharing the GPU with it, ``comm · s / (1 + s)`` (:func:`overlapped_seconds`)."""
    s = hw.overlap_slowdown
    return comm * s / (1.0 + s)


def domain_ranks(group: int, stride: int, hw: Hardware) -> int:
    """Ranks of a group of ``group`` ranks ``stride`` apart that share one scale-up domain (Megatron's rank
    order tp, cp, dp, pp: a group's members are consecutive multiples of its stride; the job's ranks fill
    :attr:`~Hardware.domain_gpus` GPUs of each domain in order)."""
    return math.gcd(group, max(1, hw.domain_gpus // stride))


ATTENTION_KINDS = ("flash", "flash2", "materialized")
"""Attention implementations: the GPU's best flash-attention kernel (FA3 / cuDNN on Hopper), FlashAttention-2
(PyTorch SDPA's first-priority backend, ``Hardware.flash2_slowdown`` slower), or scores materialized
(Megatron-LM 2021)."""

_SOFTMAX_F, _DROPOUT_F = 4, 5  # bytes per score element (module docstring: attention with its scores in HBM)
_DROPOUT_B, _SOFTMAX_B = 5, 6


def materialized_attention_seconds(hw: Hardware, *, batch: int, heads: int, seq: int, head_dim: int,
                                   dtype: str = "bf16", backward: bool = False) -> float:
    """Seconds of the attention core with its scores in HBM, forward or backward (module docstring)."""
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
