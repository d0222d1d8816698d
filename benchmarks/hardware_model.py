"""The efficiency model's predictions beside public measurements, with the ratio, and its figures per GPU.

    python benchmarks/hardware_model.py

Torch-free and instant. Each reference row names its source; a row whose reference also supplied the
parameter it checks says so (it is then a consistency check, not an independent one). Recorded in
docs/cluster-plan.md ('Hardware').
"""

from __future__ import annotations

from pipeloom.plan.cluster.dispatch import HYBRIDEP_MEASURED, hybridep_bytes, hybridep_generic_seconds
from pipeloom.plan.cluster.efficiency import (
    DYNAMIC_CAST_BYTES,
    attention_flops,
    attention_seconds,
    collective_seconds,
    domain_ranks,
    gemm_efficiency,
    gemm_seconds,
)
from pipeloom.plan.cluster.gpus import hardware, hardware_names
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.mixers import gdn_core_seconds
from pipeloom.plan.cluster.model.reader import model_spec

__all__ = ["REFERENCES", "main"]

_MAMF = "Bekman, ml-engineering, maximum achievable matmul FLOPS table at 744d01e (best shape)"
_FA3 = "FlashAttention-3 paper (arXiv:2407.08608): BF16 forward up to 740 TFLOP/s at head dim 256, seq 16k"
_SDPA = "NVIDIA cudnn-frontend SDPA training benchmark, cuDNN 9.13.1 (128 heads of 128, causal)"
_SDPA_917 = "NVIDIA cudnn-frontend SDPA training benchmark at b372d39, cuDNN 9.17.0 (128 heads of 128, causal)"
_SDPA_919 = ("NVIDIA cudnn-frontend SDPA training benchmark at fb682ce, cuDNN 9.19.1, results/*_919_only_cudnn "
             "(64 heads of 128)")
_NCCL8 = "nccl-tests busbw at large sizes (docs.alayanew.com nccl-tests guide)"
_NCCL16 = "nccl-tests busbw, 2+ nodes NVLink + NDR IB (saturncloud.io NCCL validation guide)"
_FLA = "fla README 'Benchmarks' (chunk_gdn, one GB200, bf16, do_bench median; measured at fla 0a48470)"
_TORCHAO = ("torchao, torchao/float8/README.md 'Performance' at 0cf1281 (Float8Linear forward + backward against bf16 "
            "nn.Linear, dynamic tensor-wise scaling, torch.compile, one H100)")
_HEP = ("DeepEP hybrid-ep branch, docs/README_Hybrid-EP.md at 17cfb81 (torch API, 4,096 tokens of 7,168, top 8 of 8 "
        "experts a rank, bf16)")


def _gemm(name: str, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    return 2 * m * n * k / gemm_seconds(hardware(name), m, n, k, dtype=dtype) / 1e12


def _matmul(name: str, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    """The GEMM's compute rate alone (no FP8 scaling casts: the table times pre-cast inputs)."""
    hw = hardware(name)
    return gemm_efficiency(hw, m, n, k, dtype=dtype) * hw.peak(dtype) / 1e12


def _float8_linear_speedup(name: str, m: int, k: int, n: int) -> float:
    """A linear's forward and backward (y = x w, dx = dy wᵀ, dw = xᵀ dy, input m x k, weight k x n) in BF16 over
    the same in FP8 with per-tensor dynamic casts of both inputs of every GEMM (torchao's tensor-wise recipe)."""
    hw, cast = hardware(name), (DYNAMIC_CAST_BYTES, DYNAMIC_CAST_BYTES)
    shapes = ((m, n, k), (m, k, n), (k, n, m))  # (rows, columns, reduced) of y, dx and dw
    bf16 = sum(gemm_seconds(hw, *shape) for shape in shapes)
    return bf16 / sum(gemm_seconds(hw, *shape, dtype="fp8", cast=cast) for shape in shapes)


def _attention(name: str, head_dim: int) -> float:
    shape = {"batch": 1, "heads": 16384 // head_dim // 8, "seq": 16384, "head_dim": head_dim, "causal": False}
    return attention_flops(**shape) / attention_seconds(hardware(name), **shape) / 1e12


def _attention_causal(name: str, backward: bool, seq: int = 32768, heads: int = 128, causal: bool = True) -> float:
    shape = {"batch": 1, "heads": heads, "seq": seq, "head_dim": 128, "causal": causal}
    return (attention_flops(**shape, backward=backward)
            / attention_seconds(hardware(name), **shape, backward=backward) / 1e12)


def _gdn(batch: int, seq: int, heads: int, dim: int, backward: bool = False) -> float:
    """Milliseconds of the chunked gated delta rule as the planner prices it on a GB200 (forward, or forward and
    backward), at the shape of fla's benchmark (as many key as value heads, no tensor parallelism)."""
    spec = model_spec({"model_type": "qwen3_next", "linear_num_key_heads": heads, "linear_num_value_heads": heads,
                       "linear_key_head_dim": dim, "linear_value_head_dim": dim})
    job = Job(spec=spec, hw=hardware("gb200"), gpus=1, global_batch=batch, seq=seq)
    forward, back = gdn_core_seconds(job, Layout(dp=1, mbs=batch, recompute="none", schedule="1f1b"))
    return 1e3 * (forward + back if backward else forward)


def _busbw(name: str, ranks: int, per_domain: int) -> float:
    nbytes = 2**33  # 8 GiB, the large end of nccl-tests sweeps
    return 2 * (ranks - 1) / ranks * nbytes / collective_seconds(hardware(name), "all_reduce", nbytes, ranks,
                                                                    ranks_per_domain=per_domain) / 1e9


def _hybridep(name: str, ranks: int, measured: bool) -> float:
    """Milliseconds of one Hybrid-EP dispatch and combine at its benchmark's shape on ``ranks`` GPUs: as measured
    through its torch API (``measured``), or as the generic node-aware exchange prices it (what the planner uses where
    nothing was measured: :func:`~pipeloom.plan.cluster.dispatch.hybridep_all_to_all`)."""
    hw = hardware(name)
    if not measured:
        return 1e3 * hybridep_generic_seconds(hw, tokens=4096, hidden=7168, top_k=8, experts=8 * ranks, ranks=ranks)
    nodes = ranks // domain_ranks(ranks, 1, hw)
    run = next(run for run in HYBRIDEP_MEASURED[name][1] if run.ranks == ranks)
    nbytes = hybridep_bytes(4096, 7168, 8, 8 * ranks, ranks, nodes)
    return 1e3 * (nbytes / (run.dispatch_api * 1e9) + nbytes / (run.combine_api * 1e9))


REFERENCES = [
    # (what, unit, predicted, (low, high) measured, source, independent?)
    ("A100 SXM GEMM 1024x10240x5120", "TFLOP/s", lambda: _matmul("a100-80gb", 1024, 10240, 5120), (271.2, 271.2),
     _MAMF, "no: sets the ceiling E"),
    ("H100 SXM GEMM 2048x2048x13312", "TFLOP/s", lambda: _matmul("h100", 2048, 2048, 13312), (794.5, 794.5), _MAMF,
     "no: sets the ceiling E"),
    ("H100 SXM FP8 GEMM 1024x9216x14336", "TFLOP/s", lambda: _matmul("h100", 1024, 9216, 14336, "fp8"),
     (1402.6, 1402.6), _MAMF, "no: sets the FP8 ceiling"),
    ("H200 SXM FP8 GEMM 1280x4096x12032", "TFLOP/s", lambda: _matmul("h200", 1280, 4096, 12032, "fp8"),
     (1453.4, 1453.4), _MAMF, "no: sets the FP8 ceiling"),
    ("B200 SXM GEMM 1792x16128x3072", "TFLOP/s", lambda: _matmul("b200", 1792, 16128, 3072), (1745.0, 1745.0),
     _MAMF, "no: sets the ceiling E"),
    ("B200 SXM FP8 GEMM 15360x4096x3072", "TFLOP/s", lambda: _matmul("b200", 15360, 4096, 3072, "fp8"),
     (3432.5, 3432.5), _MAMF, "no: sets the FP8 ceiling"),
    ("GB200 GEMM 4096x9728x2048", "TFLOP/s", lambda: _matmul("gb200", 4096, 9728, 2048), (1822.0, 1822.0), _MAMF,
     "no: sets the ceiling E"),
    ("MI300X GEMM 10240x15360x8192", "TFLOP/s", lambda: _matmul("mi300x", 10240, 15360, 8192), (668.4, 668.4), _MAMF,
     "no: sets the ceiling E"),
    ("H100 FP8 linear speedup, 1024x2048x1024", "x", lambda: _float8_linear_speedup("h100", 1024, 2048, 1024),
     (0.80, 0.80), _TORCHAO, "yes (small: the casts' launches and bytes weigh most)"),
    ("H100 FP8 linear speedup, 4096x8192x16384", "x", lambda: _float8_linear_speedup("h100", 4096, 8192, 16384),
     (1.39, 1.39), _TORCHAO, "yes"),
    ("H100 attention forward, head dim 256, s=16k", "TFLOP/s", lambda: _attention("h100", 256), (740.0, 740.0), _FA3,
     "yes (FlashAttention-3, not cuDNN; head dim 256, priced as 128's)"),
    ("H200 causal attention forward, s=4k", "TFLOP/s", lambda: _attention_causal("h200", False, 4096, 64),
     (591.0, 591.0), _SDPA_919, "no: in the fit of the Hopper efficiencies"),
    ("H200 causal attention backward, s=4k", "TFLOP/s", lambda: _attention_causal("h200", True, 4096, 64),
     (474.0, 474.0), _SDPA_919, "no: in the fit of the Hopper efficiencies"),
    ("H200 attention forward, no mask, s=8k", "TFLOP/s", lambda: _attention_causal("h200", False, 8192, 64, False),
     (691.0, 691.0), _SDPA_919, "yes (the fit is causal)"),
    ("GB200 causal attention forward, s=2k", "TFLOP/s", lambda: _attention_causal("gb200", False, 2048, 64),
     (1042.0, 1042.0), _SDPA_919, "no: in the fit of the GB200 efficiencies"),
    ("GB200 causal attention forward, s=4k", "TFLOP/s", lambda: _attention_causal("gb200", False, 4096),
     (1386.0, 1386.0), _SDPA_917, "yes (cuDNN 9.17, 128 heads; the fit is 9.19's)"),
    ("GB200 causal attention backward, s=4k", "TFLOP/s", lambda: _attention_causal("gb200", True, 4096),
     (1054.0, 1054.0), _SDPA_917, "yes (cuDNN 9.17, 128 heads; the fit is 9.19's)"),
    ("GB300 causal attention forward, s=8k", "TFLOP/s", lambda: _attention_causal("gb300", False, 8192),
     (1899.0, 1899.0), _SDPA_917, "yes (cuDNN 9.17, 128 heads; the fit is 9.19's)"),
    ("B200 causal attention forward, s=32k", "TFLOP/s", lambda: _attention_causal("b200", False),
     (1419.0, 1419.0), _SDPA, "no: sets attention_efficiency"),
    ("B200 causal attention backward, s=32k", "TFLOP/s", lambda: _attention_causal("b200", True),
     (1108.7, 1108.7), _SDPA, "no: sets attention_backward_efficiency"),
    ("GB200 GDN fwd 4x4096 tok, 64 heads of 128", "ms", lambda: _gdn(4, 4096, 64, 128), (1.581, 1.581), _FLA,
     "no: sets GDN_EFFICIENCY"),
    ("GB200 GDN fwd+bwd 4x4096 tok, 64 heads of 128", "ms", lambda: _gdn(4, 4096, 64, 128, True), (5.964, 5.964),
     _FLA, "no: sets GDN_BACKWARD_EFFICIENCY"),
    ("GB200 GDN fwd 1x8192 tok, 96 heads of 128", "ms", lambda: _gdn(1, 8192, 96, 128), (1.265, 1.265), _FLA, "yes"),
    ("GB200 GDN fwd+bwd 1x8192 tok, 96 heads of 128", "ms", lambda: _gdn(1, 8192, 96, 128, True), (4.738, 4.738),
     _FLA, "yes"),
    ("GB200 GDN fwd 2x16384 tok, 16 heads of 128", "ms", lambda: _gdn(2, 16384, 16, 128), (1.029, 1.029), _FLA,
     "yes"),
    ("GB200 GDN fwd+bwd 2x16384 tok, 16 heads of 128", "ms", lambda: _gdn(2, 16384, 16, 128, True), (3.616, 3.616),
     _FLA, "yes"),
    ("GB200 GDN fwd 8x2048 tok, 32 heads of 256", "ms", lambda: _gdn(8, 2048, 32, 256), (1.831, 1.831), _FLA,
     "yes (head dim 256; the rate is head dim 128's)"),
    ("GB200 GDN fwd 4x2048 tok, 16 heads of 128", "ms", lambda: _gdn(4, 2048, 16, 128), (0.753, 0.753), _FLA,
     "yes (small: the benchmark's ~0.6 ms launch cost, not priced)"),
    *((f"{name.upper()} x{ranks} Hybrid-EP, the generic exchange", "ms", lambda name=name, ranks=ranks: _hybridep(
        name, ranks, False), (round(_hybridep(name, ranks, True), 3),) * 2, _HEP,
       "yes (the planner prices these GPUs from the measurement itself)")
      for name, ranks in (("h100", 16), ("h100", 32), ("h100", 64), ("b200", 8), ("gb200", 8), ("gb200", 16),
                          ("gb200", 32))),
    ("8x A100 all-reduce in one node", "GB/s busbw", lambda: _busbw("a100-80gb", 8, 8), (230.0, 250.0), _NCCL8,
     "no: sets scale_up_efficiency"),
    ("8x H100 all-reduce in one node", "GB/s busbw", lambda: _busbw("h100", 8, 8), (460.0, 480.0), _NCCL8,
     "yes (NCCL uses NVLink SHARP there, not modelled)"),
    ("16x H100 all-reduce over 2 nodes", "GB/s busbw", lambda: _busbw("h100", 16, 8), (400.0, 450.0), _NCCL16,
     "yes"),
]
"""Public measurements the model is compared with."""


def main() -> None:
    print(f"{'check':<46} {'unit':<11} {'predicted':>10} {'measured':>13} {'ratio':>6}  independent  source")
    for what, unit, predict, (low, high), source, independent in REFERENCES:
        value = predict()
        measured = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        ratio = value / ((low + high) / 2)
        digits = {"ms": 3, "x": 2}.get(unit, 1)
        print(f"{what:<46} {unit:<11} {value:>10.{digits}f} {measured:>13} {ratio:>6.2f}  {independent}  [{source}]")
    print()
    print("Per GPU (priors unless calibrated): cube GEMM TFLOP/s at 1k / 4k / 8k (FP8 at 8k, scaling casts "
          "included); causal attention forward "
          "TFLOP/s at s = 4k (32 heads of 128); all-reduce busbw GB/s of 8 GiB on 8 GPUs of one domain and "
          "on 1,024 GPUs, 8 per domain")
    for name in hardware_names():
        hw = hardware(name)
        cubes = " / ".join(f"{_gemm(name, d, d, d):,.0f}" for d in (1024, 4096, 8192))
        fp8 = f"{_gemm(name, 8192, 8192, 8192, 'fp8'):,.0f}" if "fp8" in hw.peak_flops else "-"
        shape = {"batch": 1, "heads": 32, "seq": 4096, "head_dim": 128}
        attention = attention_flops(**shape) / attention_seconds(hw, **shape) / 1e12
        per_domain = min(8, hw.scale_up_size)
        print(f"  {name:<10} GEMM {cubes:>22}   FP8 {fp8:>6}   attention {attention:>7,.0f}   all-reduce "
              f"{_busbw(name, per_domain, per_domain):>5.0f} / {_busbw(name, 1024, per_domain):>5.0f}")


if __name__ == "__main__":
    main()
