"""The built-in GPU descriptions (:data:`BUILTIN`), one per GPU type, each number with its source.

Peak rates are the datasheets' dense figures (NVIDIA quotes tensor-core rates "with sparsity": the dense
rate is half). Bandwidths are one direction per GPU: NVIDIA's NVLink figure (600/900/1,800 GB/s) is both
directions, so half of it; a node's NIC line rate divided by its GPUs for scale-out. Memory capacities are
what nvidia-smi (rocminfo) reports where public logs of the GPU show it (the driver keeps the rest: an "80 GB" H100
shows 81,559 MiB, 79.6 GiB; H200 143,771 MiB; B200 183,359 MiB; MI300X 201,310,208 KB; an A100's 80 and 40 GB are
81,920 and 40,960 MiB, its datasheet's figure in GiB), otherwise the datasheet's figure in GiB. Efficiencies are
public microbenchmarks where one was found, otherwise the prior named in the source text
(``benchmarks/calibrate_gpu.py`` replaces them with a measured fit on the GPU at hand). Nothing here was fitted to a
training run."""

from __future__ import annotations

import math
from pathlib import Path

from pipeloom.plan.cluster.hardware import FORMAT, Hardware, hardware_from_dict, load_hardware
from pipeloom.plan.errors import HardwareError

__all__ = ["BUILTIN", "hardware", "hardware_names"]

GiB = 2**30
MiB = 2**20

_MAMF = ("maximum achievable matmul FLOPS (best shape, mean of 100 runs) / peak, Bekman, ml-engineering, "
         "compute/accelerator/README.md 'Maximum Achievable Matmul FLOPS comparison table' at commit 744d01e "
         "(https://github.com/stas00/ml-engineering/tree/master/compute/accelerator)")
_MAMF_FP8 = _MAMF.replace("comparison table'", "comparison table', FP8 (float8_e4m3fn, torch._scaled_mm)")


def _mamf(row: str, measured: float, peak: float, note: str, *, fp8: bool = False) -> tuple[float, str]:
    """A GEMM ceiling from the maximum achievable matmul table: its ``row``'s ``measured`` TFLOP/s over the
    ``peak`` the table divides by (rounded to 3 digits, as the table's percentages), and its source text."""
    source = (_MAMF_FP8 + ":" if fp8 else _MAMF + ": BF16,") + f" {row} {measured:,} of {peak:,} TFLOPS ({note})"
    return round(measured / peak, 3), source
_FA2 = ("FlashAttention-2 (Dao 2023, arXiv:2307.08691, sec. 4.1): 50-73 % of A100 peak, forward up to 73 %, "
        "backward lower; the long-sequence, head-dim-128 end of that range")
_FA2_HOPPER = ("FA3 paper (arXiv:2407.08608): FA3 forward 1.5-2.0x FA2 on H100; huggingface/transformers PR "
               "#48163: cuDNN attention 1.7-2.3x FA2 for training shapes on H100 -> 1.7, where both ranges meet")
_FA2_BEST = "FlashAttention-2 is this GPU's best attention kernel (cuDNN slower on A100: transformers PR #48163)"
_CUDNN_SDPA = ("NVIDIA cudnn-frontend, benchmark/sdpa_benchmark_training/artifacts (causal BF16 SDPA, batch 1, 128 "
               "query and 8 key-value heads, head dim 128, sequence 32,768; rate / (peak x s / (s + half)))")
_SDPA_SEQ = 32768
_SDPA_RESULTS = ("NVIDIA cudnn-frontend at commit fb682ce (Apr 2026), benchmark/sdpa_benchmark_training/results/"
                 "{folder}: cuDNN 9.19.1 on one {gpu}, causal (top_left) BF16, batch 1, 64 query and 8 key-value heads "
                 "of 128")
_SDPA_SWEEPS: dict[str, tuple[str, dict[int, tuple[float, float]]]] = {
    "gb200": (_SDPA_RESULTS.format(gpu="GB200", folder="gb200_919_only_cudnn/llama3.1_20260226_174648.csv"),
              {2048: (1042.0, 836.0), 4096: (1335.0, 1132.0), 8192: (1598.0, 1311.0), 16384: (1687.0, 1402.0),
               32768: (1720.0, 1473.0)}),
    "gb300": (_SDPA_RESULTS.format(gpu="GB300", folder="gb300_919_only_cudnn/llama3.1_20260226_185510.csv"),
              {2048: (1266.0, 906.0), 4096: (1672.0, 1195.0), 8192: (1887.0, 1385.0), 16384: (1968.0, 1490.0),
               32768: (2014.0, 1549.0)}),
    "hopper": (_SDPA_RESULTS.format(gpu="H200", folder="h200_919_only_cudnn/llama3.1_20260227_034703.csv"),
               {2048: (484.0, 370.0), 4096: (591.0, 474.0), 8192: (644.0, 541.0), 16384: (673.0, 579.0),
                32768: (688.0, 581.0)}),
}
"""NVIDIA's published sweeps of its training attention kernel over the sequence length (forward, backward TFLOP/s,
the causal half counted), from which :func:`_sdpa_fit` takes a GPU's attention efficiencies and half-rate sequence."""


def _sdpa_fit(peak: float, sweep: dict[int, tuple[float, float]]) -> tuple[float, float, float]:
    """``(forward efficiency, backward efficiency, half-rate sequence)`` of the model's ``peak · A · s / (s + half)``
    closest to ``sweep`` (TFLOP/s by sequence length) in log terms: for each ``half`` on a grid of 8 tokens up to
    8,192, each ``A`` the geometric mean that fits it, the ``half`` of least squared error kept. A fit to a
    microbenchmark of the kernel, not to any training run."""
    best: tuple[float, float, float, float] | None = None
    for half in range(0, 8193, 8):
        error, fits = 0.0, []
        for part in (0, 1):
            logs = [math.log(rates[part] * 1e12 / (peak * s / (s + half))) for s, rates in sweep.items()]
            mean = sum(logs) / len(logs)
            fits.append(math.exp(mean))
            error += sum((x - mean) ** 2 for x in logs)
        if best is None or error < best[0]:
            best = (error, fits[0], fits[1], float(half))
    assert best is not None
    return round(best[1], 3), round(best[2], 3), best[3]


def _sweep_source(key: str, what: str) -> str:
    """The source text of a value :func:`_sdpa_fit` takes from ``_SDPA_SWEEPS[key]``."""
    text, sweep = _SDPA_SWEEPS[key]
    points = ", ".join(f"{s // 1024}K {f:,.0f}/{b:,.0f}" for s, (f, b) in sweep.items())
    return (f"{what}, fitted (pipeloom.plan.cluster.gpus._sdpa_fit: peak x A x s / (s + half), least squares in log "
            f"terms) to {text}; forward/backward TFLOP/s by sequence: {points}")
_PRIOR = {
    "gemm_half_dim": ("prior, not a measurement: a 1024-cube GEMM at ~70 % of the large-shape rate, the "
                      "shape of cuBLAS rate-vs-size curves; calibrate_gpu.py fits it"),
    "attention_half_seq": "prior: attention at half its long-sequence rate at s = 256; calibrate_gpu.py fits it",
    "memory_efficiency": ("prior: copy kernels reach 85-92 % of HBM peak in public STREAM-style tests; "
                          "calibrate_gpu.py measures it"),
    "scale_up_latency": ("order of magnitude: nccl-tests small-message all_reduce on 8 GPUs takes ~10-20 us "
                         "over 14 ring steps; it matters only for small messages"),
    "scale_out_latency": "order of magnitude: InfiniBand/RoCE one-way latency 2-3 us plus NCCL's proxy",
    "kernel_overhead": "prior: the GPU-side gap and tail between back-to-back kernels, 1-3 us in profiler traces",
    "overlap_slowdown": ("S. Lee, J. Oh, J. Kim, S. Go, J. Park, D. Mahajan, 'Characterizing Compute-Communication "
                         "Overlap in GPU-Accelerated Distributed Deep Learning: Performance and Power Implications' "
                         "(arXiv:2507.03114, 2025), abstract: compute overlapped with communication ran 18.9 % "
                         "slower on average (at most 40 %) over GPT and LLaMA training on 4 A100s, H100s, MI250s "
                         "and MI210s; the one average for every GPU, no per-GPU figure"),
}
_NVLINK_EFF = ("nccl-tests all_reduce bus bandwidth at large sizes (ring, no NVLS): 8x A100 230-250 GB/s of "
               "300 (https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests)")
_NIC_EFF = ("prior: NCCL reaches ~80 % of a 400 Gb/s NIC's line rate in large cross-node transfers (framing, "
            "PCIe); calibrate with nccl-tests on the cluster")


def _describe(name: str, sources: dict[str, str], **values) -> Hardware:
    return Hardware(name=name, sources={**_PRIOR, **sources}, **values)


_SMI = ("; nvidia-smi's total, what the driver gives CUDA (as public nvidia-smi logs of the GPU show it): "
        "{mib:,} MiB")


def _a100(name: str, memory_gib: int, bandwidth: float, bandwidth_source: str) -> Hardware:
    sheet = "NVIDIA A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/): "
    gemm, gemm_source = _mamf("A100 SXM", 271.2, 312, "torch 2.6.0+cu126")
    return _describe(
        name, {
            "peak_flops": sheet + "BF16 tensor core 312 TFLOPS dense; no FP8",
            "memory_bytes": sheet + f"{memory_gib} GB" + _SMI.format(mib=memory_gib * 1024) + " (the same)",
            "memory_bandwidth": sheet + bandwidth_source,
            "scale_up_size": "HGX/DGX A100: 8 GPUs on NVSwitch",
            "scale_up_bandwidth": sheet + "NVLink 600 GB/s (both directions) -> 300 GB/s",
            "scale_out_bandwidth": "DGX A100 datasheet: 8x 200 Gb/s HDR InfiniBand (ConnectX-6) -> 25 GB/s per GPU",
            "gemm_efficiency": gemm_source,
            "attention_efficiency": _FA2, "attention_backward_efficiency": _FA2,
            "scale_up_efficiency": _NVLINK_EFF, "scale_out_efficiency": _NIC_EFF,
            "sm_count": "NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs in the A100",
            "flash2_slowdown": _FA2_BEST,
        },
        sm_count=108, flash2_slowdown=1.0,
        peak_flops={"bf16": 312e12}, memory_bytes=memory_gib * GiB, memory_bandwidth=bandwidth,
        scale_up_size=8, scale_up_bandwidth=300e9, scale_out_bandwidth=25e9,
        scale_up_latency=1e-6, scale_out_latency=5e-6, gemm_efficiency=gemm,
        attention_efficiency=0.70, attention_backward_efficiency=0.60,
    )


def _hopper(name: str, memory_gib: int, bandwidth: float, sheet: str, bf16: tuple[float, str],
            fp8: tuple[float, str], smi_mib: int) -> Hardware:
    """``bf16``, ``fp8``: the GEMM ceilings and their sources (:func:`_mamf`); ``smi_mib``: the memory nvidia-smi
    reports."""
    return _describe(
        name, {
            "peak_flops": sheet + ("BF16 1,979 / FP8 3,958 TFLOPS with sparsity -> 989.4 / 1,978.9 dense "
                                   "(132 SMs at 1.83 GHz)"),
            "memory_bytes": sheet + f"{memory_gib} GB" + _SMI.format(mib=smi_mib),
            "memory_bandwidth": sheet + f"{bandwidth / 1e12:g} TB/s",
            "scale_up_size": "HGX/DGX H100 and H200: 8 GPUs on NVSwitch",
            "scale_up_bandwidth": sheet + "NVLink 900 GB/s (both directions) -> 450 GB/s",
            "scale_out_bandwidth": "DGX H100/H200 datasheet: 8x 400 Gb/s ConnectX-7 -> 50 GB/s per GPU",
            "gemm_efficiency": bf16[1], "fp8_gemm_efficiency": fp8[1],
            "attention_efficiency": _sweep_source("hopper", "forward A") + _HOPPER_SWEEP_NOTE,
            "attention_backward_efficiency": _sweep_source("hopper", "backward A") + _HOPPER_SWEEP_NOTE,
            "attention_half_seq": _sweep_source("hopper", "half-rate sequence") + _HOPPER_SWEEP_NOTE,
            "scale_up_efficiency": _NVLINK_EFF + "; H100 ring similar (NVLS reaches more, not modelled)",
            "scale_out_efficiency": _NIC_EFF,
            "sm_count": "NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs (SXM5; H200 the same)",
            "flash2_slowdown": _FA2_HOPPER,
        },
        sm_count=132,
        peak_flops={"bf16": 989.4e12, "fp8": 1978.9e12}, memory_bytes=smi_mib * MiB, memory_bandwidth=bandwidth,
        scale_up_size=8, scale_up_bandwidth=450e9, scale_out_bandwidth=50e9,
        scale_up_latency=1e-6, scale_out_latency=5e-6, gemm_efficiency=bf16[0], fp8_gemm_efficiency=fp8[0],
        attention_efficiency=_HOPPER_SDPA[0], attention_backward_efficiency=_HOPPER_SDPA[1],
        attention_half_seq=_HOPPER_SDPA[2],
    )


_HOPPER_SDPA = _sdpa_fit(989.4e12, _SDPA_SWEEPS["hopper"][1])
_HOPPER_SWEEP_NOTE = ("; the H100 takes the H200's (the same GPU die, SMs and clocks: attention runs compute-bound). "
                      "Until 2026-12-05 the FlashAttention-3 paper's figures read off its plots (0.65 / 0.52) and the "
                      "prior half-rate sequence 256")


_NVL72_SEGMENT = 64
_NVL72_SEGMENT_SOURCE = (
    "NVIDIA Technical Blog, 'Unlock Exascale Performance on NVIDIA GB200 NVL72 with Slurm Topology-Aware Job "
    "Scheduling' and 'Achieving Peak System and Workload Efficiency on NVIDIA GB200 NVL72 with Slurm Block "
    "Scheduling' (developer.nvidia.com/blog, read through public summaries): large jobs take segments of 16 of a "
    "rack's 18 compute trays (--segment=16), 64 GPUs per NVLink domain, the other 2 trays left for small jobs and "
    "failed nodes")


_MXFP8_SOURCE = ("Transformer Engine's MXFP8 documentation (docs/features/low_precision_training/mxfp8): MXFP8 "
                 "'leverages native hardware acceleration on Blackwell GPUs (SM 10.0+)'; its GEMMs are priced at the "
                 "FP8 peak and ceiling, measured with per-tensor scaled FP8 (no block-scaled GEMM measurement was "
                 "found)")


_ANY_LAYOUT_SOURCE = ("Transformer Engine's FP8 current scaling documentation (docs/features/low_precision_training/"
                      "fp8_current_scaling, 'Transpose handling'): Blackwell's GEMMs take several layouts natively, so "
                      "its row-wise and column-wise FP8 tensors share one memory layout; Ada and Hopper need a "
                      "transposed copy for the backward")


def _blackwell(name: str, *, bf16: float, memory_gib: int, domain: int, nic: float, sheet: str,
               peak_source: str, memory_source: str, domain_source: str, nic_source: str, sms: int,
               sms_source: str, gemm: tuple[tuple[float, str], tuple[float, str]],
               attention: tuple[float, float, float, float], attention_source: str,
               sweep: str, smi_mib: int | None = None) -> Hardware:
    """``gemm``: the BF16 and FP8 GEMM ceilings and their sources (:func:`_mamf`); ``smi_mib``: the memory nvidia-smi
    reports where a public log of the GPU was found (else the datasheet's, in GiB). ``attention``: TFLOP/s of
    NVIDIA's causal BF16 SDPA benchmark at sequence 32,768 (``_CUDNN_SDPA``): cuDNN
    forward, backward, then PyTorch's FlashAttention-2 backend forward, backward. ``sweep``: the
    ``_SDPA_SWEEPS`` entry whose fit (:func:`_sdpa_fit`) gives the half-rate sequence, and the efficiencies too where
    it is this GPU's own; else they are the 32,768-token rates over the model's at that half."""
    fwd, bwd, fa2_fwd, fa2_bwd = attention
    fit_fwd, fit_bwd, half = _sdpa_fit(bf16, _SDPA_SWEEPS[sweep][1])
    at = bf16 / 1e12 * _SDPA_SEQ / (_SDPA_SEQ + half)  # the model's rate at that length, per unit A
    own = sweep == name
    measured = (_sweep_source(sweep, "A") if own else
                _CUDNN_SDPA + attention_source + f", with {sweep}'s half-rate sequence ({half:,.0f})")
    half_source = _sweep_source(sweep, "half-rate sequence") + ("" if own else
                                                                f" ({sweep}'s, the same Blackwell GPU: no sweep of "
                                                                f"{name}'s own kernel was found)")
    return _describe(
        name, {
            "peak_flops": sheet + peak_source,
            "memory_bytes": sheet + memory_source + (_SMI.format(mib=smi_mib) if smi_mib else ""),
            "memory_bandwidth": sheet + "HBM3e 8 TB/s per GPU",
            "scale_up_size": sheet + domain_source,
            **({"scale_up_placed": _NVL72_SEGMENT_SOURCE} if domain == 72 else {}),
            "scale_up_bandwidth": sheet + "fifth-generation NVLink 1.8 TB/s per GPU (both directions) -> 900 GB/s",
            "scale_out_bandwidth": sheet + nic_source,
            "gemm_efficiency": gemm[0][1], "fp8_gemm_efficiency": gemm[1][1],
            "attention_efficiency": measured + ("" if own else f": cuDNN forward {fwd:,} TFLOP/s"),
            "attention_backward_efficiency": measured + ("" if own else f": cuDNN backward {bwd:,} TFLOP/s"),
            "attention_half_seq": half_source,
            "scale_up_efficiency": _NVLINK_EFF, "scale_out_efficiency": _NIC_EFF, "sm_count": sms_source,
            "mxfp8": _MXFP8_SOURCE, "fp8_any_layout": _ANY_LAYOUT_SOURCE,
            "flash2_slowdown": measured + (f": cuDNN / FlashAttention-2 forward {fwd:,} / {fa2_fwd:,}, backward "
                                           f"{bwd:,} / {fa2_bwd:,} TFLOP/s; the smaller ratio"),
        },
        sm_count=sms, mxfp8=True, fp8_any_layout=True,
        peak_flops={"bf16": bf16, "fp8": 2 * bf16}, memory_bytes=smi_mib * MiB if smi_mib else memory_gib * GiB,
        memory_bandwidth=8e12,
        scale_up_size=domain, scale_up_placed=_NVL72_SEGMENT if domain == 72 else None,
        scale_up_bandwidth=900e9, scale_out_bandwidth=nic,
        scale_up_latency=1e-6, scale_out_latency=5e-6, gemm_efficiency=gemm[0][0], fp8_gemm_efficiency=gemm[1][0],
        attention_efficiency=fit_fwd if own else round(fwd / at, 3),
        attention_backward_efficiency=fit_bwd if own else round(bwd / at, 3), attention_half_seq=half,
        flash2_slowdown=round(min(fwd / fa2_fwd, bwd / fa2_bwd), 2),
    )


def _mi300x() -> Hardware:
    sheet = "AMD Instinct MI300X datasheet (https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html): "
    gemm, gemm_source = _mamf("MI300X", 668.4, 1300, "torch 2.5.1, ROCm 6.3, TunableOp")
    hopper = _H100_BF16[0]
    scaled = ("no public flash-attention figure used: H100's fraction x (MI300X / H100 maximum achievable matmul "
              f"efficiency, {gemm} / {hopper})")
    return _describe(
        "mi300x", {
            "peak_flops": sheet + "BF16 1,307.4 / FP8 2,614.9 TFLOPS dense",
            "memory_bytes": sheet + "192 GB HBM3; what the driver gives HIP, as public logs of the GPU show it: "
                            "rocminfo's pool of 201,310,208 KB (ROCm/legacy-rocm-build#4414), rocm-smi's "
                            "206,141,652,992 B (#4750)",
            "memory_bandwidth": sheet + "5.3 TB/s",
            "scale_up_size": "MI300X platform: 8 GPUs fully connected by Infinity Fabric",
            "scale_up_bandwidth": sheet + "Infinity Fabric 896 GB/s aggregate (7 links, both directions) -> 448 GB/s",
            "scale_out_bandwidth": "MI300X platforms (e.g. Azure ND MI300X v5): 8x 400 Gb/s NICs -> 50 GB/s per GPU",
            "gemm_efficiency": gemm_source + "; the table's FP8 row is empty, so FP8 GEMMs take this fraction",
            "attention_efficiency": scaled, "attention_backward_efficiency": scaled,
            "scale_up_efficiency": ("prior: a ring over the fully connected fabric reaches less of the aggregate "
                                    "than NVSwitch does; 0.70 assumed, not measured"),
            "scale_out_efficiency": _NIC_EFF,
            "sm_count": sheet + "304 compute units",
            "flash2_slowdown": "no separate measurement: its attention figures are already scaled, taken as FA2's",
        },
        sm_count=304, flash2_slowdown=1.0,
        peak_flops={"bf16": 1307.4e12, "fp8": 2614.9e12}, memory_bytes=201_310_208 * 1024, memory_bandwidth=5.3e12,
        scale_up_size=8, scale_up_bandwidth=448e9, scale_out_bandwidth=50e9,
        scale_up_latency=1e-6, scale_out_latency=5e-6, gemm_efficiency=gemm,
        attention_efficiency=round(_HOPPER_SDPA[0] * gemm / hopper, 3),
        attention_backward_efficiency=round(_HOPPER_SDPA[1] * gemm / hopper, 3),
        scale_up_efficiency=0.70,
    )


_H100_BF16 = _mamf("H100 SXM", 794.5, 989, "torch 2.7.0+cu126")
_H100_SHEET = "NVIDIA H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/), SXM: "
_H200_SHEET = "NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/), SXM: "
_B200_SHEET = "NVIDIA DGX B200 datasheet (https://www.nvidia.com/en-us/data-center/dgx-b200/), per GPU: "
_GB200_SHEET = "NVIDIA GB200 NVL72 specifications (https://www.nvidia.com/en-us/data-center/gb200-nvl72/), per GPU: "
_GB300_SHEET = "NVIDIA GB300 NVL72 specifications (https://www.nvidia.com/en-us/data-center/gb300-nvl72/), per GPU: "

BUILTIN: dict[str, Hardware] = {
    "a100-40gb": _a100("a100-40gb", 40, 1555e9, "HBM2 1,555 GB/s"),
    "a100-80gb": _a100("a100-80gb", 80, 2039e9, "HBM2e 2,039 GB/s"),
    "h100": _hopper("h100", 80, 3.35e12, _H100_SHEET, _H100_BF16,
                    _mamf("H100 SXM", 1402.6, 1979, "torch 2.7.0+cu126; row dated 2025-01-05, commit 37acbf2",
                          fp8=True), smi_mib=81559),
    "h200": _hopper("h200", 141, 4.8e12, _H200_SHEET,
                    (_H100_BF16[0], _H100_BF16[1] + ", the table noting 'H200 is the same'"),
                    _mamf("H200 SXM", 1453.4, 1979, "torch 2.7.1+cu128", fp8=True), smi_mib=143771),
    "b200": _blackwell("b200", bf16=2.25e15, memory_gib=180, domain=8, nic=50e9, sheet=_B200_SHEET,
                       peak_source=("FP8 72 PFLOPS per 8 GPUs with sparsity -> 4.5 dense; BF16 half that, 2.25 (the "
                                    "HGX B200 table at glennklockwood.com/garden/processors/B200 agrees)"),
                       memory_source="1,440 GB per 8 GPUs -> 180 GB",
                       domain_source="8 GPUs on NVLink switches",
                       nic_source="8x 400 Gb/s ConnectX-7 -> 50 GB/s", sms=148,
                       gemm=(_mamf("B200 SXM", 1745.0, 2250, "torch 2.7.1+cu128"),
                             _mamf("B200 SXM", 3432.5, 4500, "torch 2.7.1+cu128", fp8=True)),
                       attention=(1419.0, 1108.7, 403.7, 330.8), sweep="gb200",
                       attention_source=" at commit 0b1577c (cuDNN 9.13.1, Oct 2025), NVIDIA B200",
                       sms_source=("Chips and Cheese, 'Nvidia's B200: Keeping the CUDA Juggernaut Rolling' (2025): 74 "
                                   "SMs enabled on each of its two dies, 148 per GPU"), smi_mib=183359),
    "gb200": _blackwell("gb200", bf16=2.5e15, memory_gib=186, domain=72, nic=50e9, sheet=_GB200_SHEET,
                        peak_source=("FP16/BF16 360 / FP8 720 PFLOPS per 72 GPUs with sparsity -> 2.5 / 5 dense "
                                     "(glennklockwood.com/garden/processors/B200, GB200 at 1,200 W, agrees)"),
                        memory_source="13.4 TB HBM3e per 72 GPUs -> 186 GB",
                        domain_source="72 GPUs in one NVLink domain (NVL72)",
                        nic_source="one 400 Gb/s ConnectX-7 per GPU -> 50 GB/s", sms=148,
                        gemm=(_mamf("GB200 SXM", 1822.0, 2500, "torch 2.10.0.dev, cu130"),
                              _mamf("GB200 SXM", 3615.6, 5000, "torch 2.10.0.dev, cu130", fp8=True)),
                        attention=(1681.0, 1348.0, 438.0, 360.0), sweep="gb200",
                        attention_source=" at commit b372d39 (cuDNN 9.17.0, Dec 2025), NVIDIA GB200",
                        sms_source=("the B200 GPU (148 SMs, as b200: Chips and Cheese) in a Grace-Blackwell superchip; "
                                    "no separate GB200 count was found")),
    "gb300": _blackwell("gb300", bf16=2.5e15, memory_gib=288, domain=72, nic=100e9, sheet=_GB300_SHEET,
                        peak_source=("FP16/BF16 360 / FP8 720 PFLOPS per 72 GPUs with sparsity -> 2.5 / 5 dense "
                                     "(verda.com/blog/gb300-nvl72-architecture per-GPU table agrees)"),
                        memory_source="288 GB HBM3e per GPU (8 stacks of 12-high HBM3e)",
                        domain_source="72 GPUs in one NVLink domain (NVL72)",
                        nic_source=("one 800 Gb/s ConnectX-8 per GPU (NVIDIA NVL72 enterprise reference "
                                    "architecture: 4 ConnectX-8 per 4-GPU compute tray) -> 100 GB/s"),
                        gemm=(_mamf("B300 SXM (the GPU of a GB300 superchip; no GB300 row)", 1769.0, 2250,
                                    "torch 2.9.1+cu130"),
                              _mamf("B300 SXM", 3353.3, 4500, "torch 2.9.1+cu130", fp8=True)),
                        attention=(2007.0, 1438.0, 441.0, 365.0), sweep="gb300",
                        attention_source=" at commit b372d39 (cuDNN 9.17.0, Dec 2025), NVIDIA GB300",
                        sms=160, sms_source=("NVIDIA technical blog 'Inside NVIDIA Blackwell Ultra' (Aug 2025) "
                                             "and its Hot Chips 2025 talk (reported by TweakTown): 160 SMs of 128 "
                                             "CUDA cores")),
    "mi300x": _mi300x(),
}
"""Built-in GPU descriptions by name."""


def hardware_names() -> list[str]:
    """The built-in GPU names, as :func:`hardware` accepts them."""
    return list(BUILTIN)


def hardware(name_or_path: str | Path | Hardware | dict) -> Hardware:
    """A built-in GPU by name (``"h100"``, case-insensitive; see :func:`hardware_names`), a ``pipeloom.hardware/1``
    JSON file by path or its JSON object as a dict (the efficiency fields it leaves out: the built-in H100's,
    :func:`~pipeloom.plan.cluster.hardware.hardware_from_dict`); a :class:`Hardware` is returned as it is."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    if isinstance(name_or_path, dict):
        return hardware_from_dict(name_or_path, priors=BUILTIN["h100"])
    if not isinstance(name_or_path, (str, Path)):
        raise HardwareError(f"hardware must be a GPU name, a JSON file path, its JSON object (a dict) or a Hardware, "
                            f"got {type(name_or_path).__name__}")
    text = str(name_or_path)
    if not text.strip():
        raise HardwareError(f"hardware is empty: use a built-in name ({', '.join(BUILTIN)}) or a {FORMAT} JSON file")
    if text.lower() in BUILTIN:
        return BUILTIN[text.lower()]
    if Path(text).is_file():
        return load_hardware(text, priors=BUILTIN["h100"])
    hint = (" (a folder, not a file)" if Path(text).is_dir() else
            " (no such file)" if text.endswith(".json") or "/" in text else "")
    raise HardwareError(f"unknown hardware {text!r}{hint}: use a built-in name ({', '.join(BUILTIN)}) or a "
                        f"{FORMAT} JSON file (pipeloom.plan.cluster.hardware.save_hardware writes one)")
