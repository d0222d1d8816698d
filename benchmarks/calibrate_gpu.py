"""Measure this GPU's GEMM, flash-attention and HBM efficiency and write a ``pipeloom.hardware/1`` file.

Times GEMMs over a grid of shapes, causal scaled-dot-product attention (forward and backward) over
sequence lengths, and a large copy; fits the efficiency model of ``pipeloom.plan.cluster.efficiency``
(``gemm_efficiency``, ``gemm_half_dim``, ``kernel_overhead``, ``attention_efficiency``,
``attention_backward_efficiency``, ``attention_half_seq``, ``memory_efficiency``) by least squares on log
time over a parameter grid; keeps the base description's datasheet fields (peak, memory, links); prints
measured against fitted time per shape; writes the file. Under 5 minutes on one GPU (``--budget``).

    python benchmarks/calibrate_gpu.py --base h100 --out h100-measured.json          # on the GPU
    python benchmarks/calibrate_gpu.py --base h100 --device cpu --grid tiny --out /tmp/cpu.json  # a smoke run

Where the base GPU has an FP8 peak, the same GEMM grid also runs in FP8 (``torch._scaled_mm``, e4m3 inputs
with per-tensor scales, BF16 output: the GEMM alone, as the maximum achievable matmul table measures it) and
``fp8_gemm_efficiency`` is fitted with the BF16 fit's half dimension and overhead.

On CPU the shapes are tiny, the dtype float32 and the peak the base's (so the fitted efficiencies are
tiny fractions): that checks the script, not a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeloom.plan.cluster.efficiency import attention_flops  # noqa: E402
from pipeloom.plan.cluster.gpus import hardware  # noqa: E402
from pipeloom.plan.cluster.hardware import Hardware, save_hardware  # noqa: E402

__all__ = ["GRIDS", "Fit", "edge_warnings", "fit_attention", "fit_fp8_gemm", "fit_gemm", "main", "model_attention",
           "model_gemm"]

GRIDS = {
    "full": {"gemm": (256, 512, 1024, 2048, 4096, 8192), "seq": (256, 512, 1024, 2048, 4096, 8192),
             "heads": 16, "head_dim": 128, "copy_bytes": 2**30},
    "tiny": {"gemm": (16, 64, 256), "seq": (32, 64, 128), "heads": 2, "head_dim": 32, "copy_bytes": 2**24},
}
"""Shape grids: GEMM dimensions (every m, n, k combination), attention sequence lengths (batch 1)."""

# Fractions of peak: 0.005 steps above 0.1, a log scale below (a CPU smoke run measures ~1e-4 of a GPU's peak).
_EFFICIENCIES = sorted({i / 200 for i in range(20, 201)} | {10 ** (-5 + 4 * i / 80) for i in range(80)})
_HALVES = [2 ** (i / 4) for i in range(0, 53)]  # 1 .. 8192
_OVERHEADS = [0.0] + [1e-7 * 2 ** (i / 2) for i in range(0, 24)]  # 0, 0.1 us .. 0.3 ms


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """Fitted parameters and the root-mean-square error of log(time)."""

    values: dict
    """Parameter name -> fitted value."""
    rms_log_error: float
    """sqrt(mean((log fitted - log measured)²)) over the samples."""


def model_gemm(m: int, n: int, k: int, *, peak: float, bandwidth: float, efficiency: float, half: float,
               overhead: float, width: int = 2) -> float:
    """The efficiency module's GEMM formula with explicit parameters (for fitting)."""
    compute = 2.0 * m * n * k / (peak * efficiency * m / (m + half) * n / (n + half) * k / (k + half))
    return overhead + max(compute, ((m * k + k * n) * width + m * n * 2) / bandwidth)


def model_attention(flops: float, seq: int, traffic: float, *, peak: float, bandwidth: float, efficiency: float,
                    half: float, overhead: float) -> float:
    """The efficiency module's attention formula with explicit parameters (for fitting)."""
    return overhead + max(flops / (peak * efficiency * seq / (seq + half)), traffic / bandwidth)


def fit_gemm(samples: Sequence[tuple[int, int, int, float]], *, peak: float, bandwidth: float) -> Fit:
    """Grid search of (efficiency, half dimension, overhead) minimizing the log-time error of
    ``(m, n, k, seconds)`` samples; ``bandwidth`` is the achieved HBM bandwidth (bytes/s). The rate is
    a max() of two terms, so not linear in any parameter: every grid point is scored (numpy, ~1 s)."""
    import numpy as np

    m, n, k, t = (np.array([s[i] for s in samples], dtype=float) for i in range(4))
    traffic = ((m * k + k * n) * 2 + m * n * 2) / bandwidth
    efficiencies = np.array(_EFFICIENCIES)[:, None]
    best: tuple[float, dict] = (math.inf, {})
    for half in _HALVES:
        compute = 2.0 * m * n * k / (peak * (m / (m + half)) * (n / (n + half)) * (k / (k + half)))
        for overhead in _OVERHEADS:
            fitted = overhead + np.maximum(compute[None, :] / efficiencies, traffic[None, :])
            errors = np.sqrt(np.mean((np.log(fitted) - np.log(t)[None, :]) ** 2, axis=1))
            index = int(np.argmin(errors))
            if errors[index] < best[0]:
                best = (float(errors[index]), {"gemm_efficiency": _EFFICIENCIES[index], "gemm_half_dim": half,
                                               "kernel_overhead": overhead})
    return Fit(values=best[1], rms_log_error=best[0])


def fit_fp8_gemm(samples: Sequence[tuple[int, int, int, float]], *, peak: float, bandwidth: float, half: float,
                 overhead: float) -> Fit:
    """The FP8 ceiling (``fp8_gemm_efficiency``) minimizing the log-time error of FP8 ``(m, n, k, seconds)``
    samples (one-byte inputs, ``peak`` the FP8 peak), the half dimension and overhead fixed to the BF16 fit's."""
    scored = min((math.sqrt(sum((math.log(model_gemm(m, n, k, peak=peak, bandwidth=bandwidth, efficiency=e,
                                                     half=half, overhead=overhead, width=1)) - math.log(t)) ** 2
                                for m, n, k, t in samples) / len(samples)), e) for e in _EFFICIENCIES)
    return Fit(values={"fp8_gemm_efficiency": scored[1]}, rms_log_error=scored[0])


def fit_attention(samples: Sequence[tuple[float, int, float, float, bool]], *, peak: float, bandwidth: float,
                  overhead: float) -> Fit:
    """Grid search of (forward efficiency, backward efficiency, half sequence) over ``(flops, seq, traffic,
    seconds, backward)`` samples, the kernel overhead fixed to the GEMM fit's."""
    best: tuple[float, dict] = (math.inf, {})
    for half in _HALVES:
        values = {"attention_half_seq": half}
        errors = []
        for backward in (False, True):
            group = [s for s in samples if s[4] is backward]
            scored = min((sum((math.log(model_attention(f, s, tr, peak=peak, bandwidth=bandwidth, efficiency=e,
                                                        half=half, overhead=overhead)) - math.log(t)) ** 2
                              for f, s, tr, t, _ in group), e) for e in _EFFICIENCIES)
            values["attention_backward_efficiency" if backward else "attention_efficiency"] = scored[1]
            errors.append(scored[0])
        error = math.sqrt(sum(errors) / len(samples))
        if error < best[0]:
            best = (error, values)
    return Fit(values=best[1], rms_log_error=best[0])


def edge_warnings(hw: Hardware) -> list[str]:
    """A line for each fitted value at the edge of the grid searched for it: the measurements lie outside what the
    efficiency model describes there (a CPU run, a throttled or shared GPU), and the value is the grid's, not the
    GPU's."""
    grids = {"gemm_efficiency": _EFFICIENCIES, "fp8_gemm_efficiency": _EFFICIENCIES,
             "attention_efficiency": _EFFICIENCIES, "attention_backward_efficiency": _EFFICIENCIES,
             "gemm_half_dim": _HALVES, "attention_half_seq": _HALVES, "kernel_overhead": _OVERHEADS}
    lines = []
    for key, grid in grids.items():
        value = getattr(hw, key)
        edges = [edge for edge, at in (("smallest", grid[0]), ("largest", grid[-1])) if value == at
                 and not (key.endswith("efficiency") and at == 1.0) and not (key == "kernel_overhead" and at == 0.0)]
        if edges:
            lines.append(f"warning: {key} = {value:.3g} is the {edges[0]} value searched: the measurements are outside "
                         "what the efficiency model describes; check the fitted/measured column before planning with "
                         "this file")
    return lines


def _timer(device: str) -> Callable[[Callable[[], object], int], float]:
    import torch

    def run(fn: Callable[[], object], repeats: int) -> float:
        fn()  # warm-up (kernel selection, caches)
        times = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return run


def measure(device: str, grid: dict, *, budget: float, repeats: int, log: Callable[[str], None],
            fp8: bool = False) -> dict:
    """Median seconds of a large copy, every GEMM of the grid (and, with ``fp8``, every FP8 GEMM) and
    attention forward/backward per sequence."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    width = 2 if dtype == torch.bfloat16 else 4
    timed = _timer(device)
    deadline = time.monotonic() + budget
    copy_src = torch.empty(grid["copy_bytes"] // width, dtype=dtype, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy = timed(lambda: copy_dst.copy_(copy_src), repeats)
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "width": width, "copy": (2 * grid["copy_bytes"], copy),
                 "gemm": [], "gemm_fp8": [], "attention": []}
    log(f"copy of {grid['copy_bytes'] / 2**20:.0f} MiB: {2 * grid['copy_bytes'] / copy / 1e9:.1f} GB/s (read+write)")
    for m, n, k in itertools.product(grid["gemm"], repeat=3):
        if time.monotonic() > deadline:
            log("GEMM grid cut short by --budget")
            break
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        out["gemm"].append((m, n, k, timed(lambda a=a, b=b: a @ b, repeats)))
    if fp8:
        one = torch.ones((), device=device)
        for m, n, k in itertools.product(grid["gemm"], repeat=3):
            if time.monotonic() > deadline:
                log("FP8 GEMM grid cut short by --budget")
                break
            a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it
            out["gemm_fp8"].append((m, n, k, timed(lambda a=a, b=b: torch._scaled_mm(
                a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), repeats)))
    heads, head_dim = grid["heads"], grid["head_dim"]
    for seq in grid["seq"]:
        if time.monotonic() > deadline:
            log("attention grid cut short by --budget")
            break
        q, k_, v = (torch.randn(1, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
                    for _ in range(3))
        forward = timed(lambda q=q, k_=k_, v=v: F.scaled_dot_product_attention(q, k_, v, is_causal=True), repeats)
        o = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
        grad = torch.randn_like(o)
        inputs = (q, k_, v)
        backward = timed(lambda o=o, grad=grad, inputs=inputs: torch.autograd.grad(o, inputs, grad, retain_graph=True),
                         repeats)  # the backward alone: the forward's graph is kept
        out["attention"].append((seq, forward, backward))
    return out


def _attention_samples(measured: dict, grid: dict) -> list[tuple[float, int, float, float, bool]]:
    samples = []
    heads, head_dim, width = grid["heads"], grid["head_dim"], measured["width"]
    for seq, forward, backward in measured["attention"]:
        shape = {"batch": 1, "heads": heads, "seq": seq, "head_dim": head_dim}
        io = heads * seq * head_dim * width
        samples.append((attention_flops(**shape), seq, 4 * io, forward, False))
        samples.append((attention_flops(**shape, backward=True), seq, 8 * io, backward, True))
    return samples


def calibrate(base: Hardware, measured: dict, grid: dict, *, device_name: str, name: str,
              log: Callable[[str], None]) -> Hardware:
    """The base description with the fitted efficiencies and their provenance in ``sources``."""
    moved, copy = measured["copy"]
    memory_efficiency = min(1.0, moved / copy / base.memory_bandwidth)
    bandwidth = base.memory_bandwidth * memory_efficiency
    peak = base.peak("bf16")
    gemm = fit_gemm(measured["gemm"], peak=peak, bandwidth=bandwidth)
    attention = fit_attention(_attention_samples(measured, grid), peak=peak, bandwidth=bandwidth,
                              overhead=gemm.values["kernel_overhead"])
    where = (f"measured by benchmarks/calibrate_gpu.py on {device_name} ({measured['dtype']}), "
             f"{time.strftime('%Y-%m-%d', time.gmtime())}")
    sources = dict(base.sources)
    sources["memory_efficiency"] = f"{where}: copy of {grid['copy_bytes']} bytes"
    for key in gemm.values:
        sources[key] = f"{where}: {len(measured['gemm'])} GEMM shapes, rms log-time error {gemm.rms_log_error:.3f}"
    fp8 = {}
    if measured["gemm_fp8"]:
        fit = fit_fp8_gemm(measured["gemm_fp8"], peak=base.peak("fp8"), bandwidth=bandwidth,
                           half=gemm.values["gemm_half_dim"], overhead=gemm.values["kernel_overhead"])
        fp8 = fit.values
        sources["fp8_gemm_efficiency"] = (f"{where}: {len(measured['gemm_fp8'])} FP8 GEMM shapes (torch._scaled_mm), "
                                          f"rms log-time error {fit.rms_log_error:.3f}")
    for key in attention.values:
        sources[key] = (f"{where}: causal SDPA at {len(measured['attention'])} sequence lengths, rms log-time error "
                        f"{attention.rms_log_error:.3f}")
    _print_fit(measured, gemm, peak, bandwidth, log)
    return dataclasses.replace(base, name=name, memory_efficiency=memory_efficiency, **gemm.values, **fp8,
                               **attention.values, sources=sources)


def _print_fit(measured: dict, gemm: Fit, peak: float, bandwidth: float, log: Callable[[str], None]) -> None:
    log(f"{'m':>6} {'n':>6} {'k':>6} {'measured s':>12} {'fitted s':>12} {'fitted/measured':>16}")
    for m, n, k, t in measured["gemm"]:
        fitted = model_gemm(m, n, k, peak=peak, bandwidth=bandwidth, efficiency=gemm.values["gemm_efficiency"],
                            half=gemm.values["gemm_half_dim"], overhead=gemm.values["kernel_overhead"])
        log(f"{m:>6} {n:>6} {k:>6} {t:>12.3e} {fitted:>12.3e} {fitted / t:>16.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="h100", help="built-in name or hardware file for the datasheet fields")
    parser.add_argument("--out", required=True, help="hardware JSON file to write")
    parser.add_argument("--name", help="the written description's name (default: BASE-measured; on a CPU "
                        "BASE-measured-on-cpu)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--grid", choices=tuple(GRIDS), default=None, help="default: full on cuda, tiny on cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds of measuring at most")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    grid = GRIDS[args.grid or ("full" if device == "cuda" else "tiny")]
    base = hardware(args.base)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    start = time.monotonic()
    fp8 = "fp8" in base.peak_flops and hasattr(torch, "float8_e4m3fn")
    measured = measure(device, grid, budget=args.budget, repeats=args.repeats, log=print, fp8=fp8)
    default = f"{base.name}-measured" + ("-on-cpu" if device == "cpu" else "")
    hw = calibrate(base, measured, grid, device_name=device_name, name=args.name or default, log=print)
    save_hardware(hw, args.out)
    for line in edge_warnings(hw):
        print(line, file=sys.stderr)
    print(f"gemm_efficiency {hw.gemm_efficiency:.3g} (fp8 {hw.gemm_ceiling('fp8'):.3g}), gemm_half_dim "
          f"{hw.gemm_half_dim:.0f}, kernel_overhead "
          f"{hw.kernel_overhead * 1e6:.1f} us, attention {hw.attention_efficiency:.3g} / "
          f"{hw.attention_backward_efficiency:.3g} (half at s={hw.attention_half_seq:.0f}), memory "
          f"{hw.memory_efficiency:.3g}; wrote {args.out} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
