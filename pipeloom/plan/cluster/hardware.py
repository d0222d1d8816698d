"""One GPU type as the cluster planner sees it (:class:`Hardware`: peak rates, memory, the scale-up and
scale-out links, the efficiency model's parameters, and where every number comes from), the built-in
descriptions by name, and the ``pipeloom.hardware/1`` JSON file format for any other GPU."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeloom.formatting import format_bytes
from pipeloom.ir.jsonfields import DuplicateKeyError, json_failure, unique_keys
from pipeloom.plan.errors import HardwareError

__all__ = ["ATTENTION_HALF_SEQ", "DTYPES", "FORMAT", "PRIORED", "Hardware", "hardware_from_dict", "load_hardware",
           "save_hardware"]

FORMAT = "pipeloom.hardware/1"
"""The ``format`` tag of a hardware JSON file."""

DTYPES = ("bf16", "fp8")
"""Matrix-multiply data types a peak rate may be given for (dense, no 2:4 sparsity)."""
ATTENTION_HALF_SEQ = 256.0
"""The prior half-rate sequence length of attention (:attr:`Hardware.attention_half_seq`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One GPU type and the links around it; rates are per GPU, bandwidths one direction, in bytes/s.

    The efficiency fields are the parameters of :mod:`pipeloom.plan.cluster.efficiency`; the defaults are round
    priors near Hopper's. A file or dict read by :func:`~pipeloom.plan.cluster.gpus.hardware` (the CLI's
    ``--hardware``) takes the built-in H100's measured values for the GEMM and attention fields it leaves out
    (:func:`hardware_from_dict`). One description per GPU type: nothing here is tuned to a model or a run."""

    name: str
    """Short name (``"h100"``)."""
    peak_flops: Mapping[str, float]
    """Dense tensor-core FLOP/s by dtype (``"bf16"``, ``"fp8"``); a dtype the GPU lacks is absent."""
    memory_bytes: int
    """HBM capacity in bytes (GPU memory is sold in binary gigabytes: an "80 GB" H100 holds 80 GiB)."""
    memory_bandwidth: float
    """HBM bandwidth, bytes/s (datasheet peak)."""
    scale_up_size: int
    """GPUs in one scale-up (NVLink / Infinity Fabric) domain: 8 in an HGX node, 72 in an NVL72 rack."""
    scale_up_bandwidth: float
    """Scale-up bandwidth per GPU, one direction, bytes/s (half the datasheet's bidirectional figure)."""
    scale_out_bandwidth: float
    """Scale-out (NIC) bandwidth per GPU, one direction, bytes/s (the node's NIC line rate / its GPUs)."""
    scale_up_latency: float
    """Seconds one step of a collective takes inside the scale-up domain, whatever its size."""
    scale_out_latency: float
    """Seconds one step of a collective takes across domains (through the NICs and switches)."""
    gemm_efficiency: float = 0.80
    """Fraction of peak a large, well-shaped GEMM reaches (the maximum achievable matmul FLOPS / peak)."""
    fp8_gemm_efficiency: float | None = None
    """The same fraction of the FP8 peak for FP8 GEMMs (per-tensor scaled); None: ``gemm_efficiency``'s, for a
    GPU without an FP8 measurement."""
    mxfp8: bool = False
    """Tensor cores that multiply FP8 scaled per block of 32 elements (MXFP8: Blackwell, SM 10.0 and later), at the
    FP8 rate: what ``fp8_cast="mxfp8"`` (Transformer Engine's ``MXFP8BlockScaling``) needs."""
    fp8_any_layout: bool = False
    """FP8 GEMMs that take either operand layout (Blackwell), so a per-tensor scaled FP8 copy serves the weight
    gradient's GEMM too and no transposed copy is written (Hopper's and Ada's take only "TN")."""
    gemm_half_dim: float = 128.0
    """A GEMM dimension at which that dimension alone halves the rate: each of m, n, k scales the rate
    by ``d / (d + gemm_half_dim)`` (tile and wave quantization, fixed per-tile costs)."""
    attention_efficiency: float = 0.70
    """Fraction of peak a long-sequence flash-attention forward reaches."""
    attention_backward_efficiency: float = 0.55
    """Fraction of peak a long-sequence flash-attention backward reaches."""
    flash2_slowdown: float = 1.7
    """How much slower FlashAttention-2's kernels (PyTorch SDPA's first-priority backend) run than the GPU's best
    attention kernel that ``attention_efficiency`` describes (FA3 / cuDNN on Hopper); 1 where FA2 is the best."""
    attention_half_seq: float = ATTENTION_HALF_SEQ
    """A sequence length at which attention runs at half its long-sequence rate: ``s / (s + half)``."""
    memory_efficiency: float = 0.85
    """Fraction of HBM bandwidth an elementwise (bandwidth-bound) kernel reaches."""
    scale_up_efficiency: float = 0.80
    """Fraction of the scale-up bandwidth a large collective or send reaches (NCCL bus bandwidth / link)."""
    scale_out_efficiency: float = 0.80
    """Fraction of the NIC bandwidth a large collective or send reaches."""
    sm_count: int = 132
    """Streaming multiprocessors (compute units) that run GEMM tiles at once: wave quantization (H100 SXM: 132)."""
    kernel_overhead: float = 2e-6
    """Seconds every kernel costs whatever its size (launch and tail), the floor of a tiny GEMM."""
    overlap_slowdown: float = 0.189
    """How much longer compute takes while a collective runs beside it (the collective's kernels hold SMs and
    HBM bandwidth): 0.189 = 18.9 % longer (:func:`pipeloom.plan.cluster.efficiency.overlapped_seconds`)."""
    scale_up_placed: int | None = None
    """GPUs of one job placed in each scale-up domain where fewer than it holds; None: all of them. An NVL72 rack's
    18 trays of 4 GPUs are given to large jobs in segments of 16 trays, 64 GPUs (NVIDIA's Slurm block-scheduling
    guidance for GB200 NVL72), so that the power-of-two groups of a layout fill whole domains."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each field's number comes from (field name -> datasheet, paper or benchmark)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise HardwareError(f"hardware name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "peak_flops", _peaks(self))
        for name in ("memory_bytes", "memory_bandwidth", "scale_up_bandwidth", "scale_out_bandwidth",
                     "gemm_half_dim", "attention_half_seq"):
            _positive(self.name, name, getattr(self, name))
        if not _number(self.overlap_slowdown) or self.overlap_slowdown < 0:
            raise HardwareError(f"hardware {self.name!r}: overlap_slowdown is a fraction >= 0 (0.189: compute 18.9 % "
                                f"slower beside a collective), got {self.overlap_slowdown!r}")
        if not _number(self.flash2_slowdown) or self.flash2_slowdown < 1:
            raise HardwareError(f"hardware {self.name!r}: flash2_slowdown is a ratio >= 1, "
                                f"got {self.flash2_slowdown!r}")
        for name in ("scale_up_latency", "scale_out_latency", "kernel_overhead"):
            value = getattr(self, name)
            if not _number(value) or value < 0:
                raise HardwareError(f"hardware {self.name!r}: {name} must be seconds >= 0, got {value!r}")
        for name in ("gemm_efficiency", "attention_efficiency", "attention_backward_efficiency",
                     "memory_efficiency", "scale_up_efficiency", "scale_out_efficiency"):
            value = getattr(self, name)
            if not _number(value) or not 0 < value <= 1:
                raise HardwareError(f"hardware {self.name!r}: {name} is a fraction of peak in (0, 1], "
                                    f"got {value!r}")
        if not isinstance(self.sm_count, int) or isinstance(self.sm_count, bool) or self.sm_count < 1:
            raise HardwareError(f"hardware {self.name!r}: sm_count must be a whole number of SMs >= 1, "
                                f"got {self.sm_count!r}")
        if not isinstance(self.scale_up_size, int) or isinstance(self.scale_up_size, bool) or self.scale_up_size < 1:
            raise HardwareError(f"hardware {self.name!r}: scale_up_size must be a whole number of GPUs >= 1, "
                                f"got {self.scale_up_size!r}")
        placed = self.scale_up_placed
        if placed is not None and (not isinstance(placed, int) or isinstance(placed, bool)
                                   or not 1 <= placed <= self.scale_up_size):
            raise HardwareError(f"hardware {self.name!r}: scale_up_placed is the GPUs of one job in each scale-up "
                                f"domain, a whole number from 1 to scale_up_size ({self.scale_up_size}), or null for "
                                f"all of them; got {placed!r}")
        _flags(self)
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool):
            raise HardwareError(f"hardware {self.name!r}: memory_bytes must be a whole number of bytes, "
                                f"got {self.memory_bytes!r}")
        if self.fp8_gemm_efficiency is not None and (not _number(self.fp8_gemm_efficiency)
                                                     or not 0 < self.fp8_gemm_efficiency <= 1):
            raise HardwareError(f"hardware {self.name!r}: fp8_gemm_efficiency is a fraction of the FP8 peak in "
                                f"(0, 1], or null to use gemm_efficiency, got {self.fp8_gemm_efficiency!r}")
        if self.fp8_gemm_efficiency is not None and "fp8" not in self.peak_flops:
            raise HardwareError(f"hardware {self.name!r}: fp8_gemm_efficiency is given but peak_flops has no 'fp8' "
                                "rate: add the dense FP8 FLOP/s, or drop fp8_gemm_efficiency")
        sources = dict(self.sources)
        known = {f.name for f in fields(self)}
        for key, text in sources.items():
            if key not in known or not isinstance(text, str):
                raise HardwareError(f"hardware {self.name!r}: sources maps a field name to a string; "
                                    f"{key!r}: {text!r} is not one (fields: {', '.join(sorted(known))})")
        object.__setattr__(self, "sources", sources)

    @property
    def domain_gpus(self) -> int:
        """GPUs of one job that share a scale-up domain (:attr:`scale_up_placed`, else the whole domain)."""
        return self.scale_up_placed or self.scale_up_size

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; names the dtypes this GPU has when it lacks that one."""
        rate = self.peak_flops.get(dtype)
        if rate is None:
            have = " or ".join(self.peak_flops)
            raise HardwareError(f"{self.name} has no {dtype!r} tensor-core rate; use --dtype {have} (dtype="
                                f"{have!r} in Python), or describe the GPU in a pipeloom.hardware/1 file whose "
                                f"peak_flops gives {dtype}")
        return rate

    def gemm_ceiling(self, dtype: str) -> float:
        """The fraction of ``dtype``'s peak a large GEMM reaches (``fp8_gemm_efficiency`` for FP8 where given)."""
        if dtype == "fp8" and self.fp8_gemm_efficiency is not None:
            return self.fp8_gemm_efficiency
        return self.gemm_efficiency

    def to_dict(self) -> dict:
        """The JSON form (``format`` tag first); :func:`load_hardware` reads it back."""
        out: dict = {"format": FORMAT}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = dict(value) if isinstance(value, Mapping) else value
        return out


def _peaks(hw: Hardware) -> dict[str, float]:
    """``hw``'s dense peak FLOP/s per dtype, checked (known dtypes, a bf16 rate, an FP8 rate not below it), once
    ``peak_flops`` and ``sources`` are found to be mappings."""
    for name in ("peak_flops", "sources"):
        if not isinstance(getattr(hw, name), Mapping):
            raise HardwareError(f"hardware {hw.name!r}: {name} must be a mapping ({_MAPPINGS[name]}), got "
                                f"{getattr(hw, name)!r}")
    peaks = dict(hw.peak_flops)
    for dtype, rate in peaks.items():
        if dtype not in DTYPES:
            raise HardwareError(f"hardware {hw.name!r}: peak_flops has unknown dtype {dtype!r}; use "
                                f"{', '.join(DTYPES)}")
        _positive(hw.name, f"peak_flops[{dtype!r}]", rate)
    if "bf16" not in peaks:
        raise HardwareError(f"hardware {hw.name!r}: peak_flops needs a 'bf16' rate (dense FLOP/s)")
    if peaks.get("fp8", peaks["bf16"]) < peaks["bf16"]:
        raise HardwareError(f"hardware {hw.name!r}: peak_flops['fp8'] ({peaks['fp8']:g}) is below the bf16 rate "
                            f"({peaks['bf16']:g}); FP8 tensor cores run at least BF16's dense rate: give the "
                            "datasheet's dense FP8 FLOP/s, or leave fp8 out")
    return peaks


def _flags(hw: Hardware) -> None:
    """HardwareError unless the true-or-false capabilities are booleans."""
    for name, what in (("mxfp8", "whether the tensor cores scale FP8 per block of 32 elements"),
                       ("fp8_any_layout", "whether FP8 GEMMs take either operand layout")):
        if not isinstance(getattr(hw, name), bool):
            raise HardwareError(f"hardware {hw.name!r}: {name} is true or false ({what}), got {getattr(hw, name)!r}")
    if hw.mxfp8 and "fp8" not in hw.peak_flops:
        raise HardwareError(f"hardware {hw.name!r}: mxfp8 is true but peak_flops has no 'fp8' rate: add the dense FP8 "
                            "FLOP/s (MXFP8 GEMMs run at it), or set mxfp8 to false")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(name: str, what: str, value) -> None:
    if not _number(value) or value <= 0:
        raise HardwareError(f"hardware {name!r}: {what} must be a number > 0, got {value!r}")


def load_hardware(path: str | Path, *, priors: Hardware | None = None) -> Hardware:
    """Read a ``pipeloom.hardware/1`` JSON file (``priors``: as :func:`hardware_from_dict`); every problem is a
    :class:`HardwareError` naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"),  # a byte-order mark, as some editors write
                          object_pairs_hook=unique_keys)
    except OSError as err:
        raise HardwareError(f"cannot read hardware file {str(path)!r}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise HardwareError(f"hardware file {str(path)!r} is not JSON: {err.msg} at line {err.lineno}") from None
    except DuplicateKeyError as err:
        raise HardwareError(f"hardware file {str(path)!r} gives {err.args[0]!r} twice; keep one") from None
    except UnicodeDecodeError:
        raise HardwareError(f"hardware file {str(path)!r} is not UTF-8 text; a pipeloom.hardware/1 file is "
                            "JSON") from None
    except (ValueError, RecursionError) as err:  # a number past Python's digits, nesting past its depth
        raise HardwareError(f"hardware file {str(path)!r} is not JSON: {json_failure(err)}") from None
    return hardware_from_dict(data, where=str(path), priors=priors)


PRIORED = ("gemm_efficiency", "fp8_gemm_efficiency", "attention_efficiency", "attention_backward_efficiency",
           "attention_half_seq")
"""The efficiency fields a description left without takes from ``priors`` (:func:`hardware_from_dict`)."""


def hardware_from_dict(data, *, where: str = "hardware description", priors: Hardware | None = None) -> Hardware:
    """A :class:`Hardware` from the JSON form (``format`` tag, required spec fields, optional efficiency
    fields and sources); unknown or missing keys name the fix. With ``priors`` (a measured GPU: the CLI's and
    :func:`~pipeloom.plan.cluster.gpus.hardware`'s H100), the :data:`PRIORED` fields left out are its, the FP8
    GEMM ceiling scaled from the BF16 one as on it, each said in ``sources``; without, the dataclass's round
    defaults."""
    if not isinstance(data, dict):
        raise HardwareError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise HardwareError(f"{where}: 'format' must be {FORMAT!r}, got {data.get('format')!r}")
    allowed = {f.name: f for f in fields(Hardware)}
    unknown = sorted(set(data) - set(allowed) - {"format"})
    if unknown:
        close = [f"{match[0]!r} for {key!r}" for key in unknown
                 if (match := difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.8))]
        meant = f" (did you mean {', '.join(close)}?)" if close else ""
        raise HardwareError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}{meant}; the keys are "
                            f"{', '.join(allowed)}")
    required = [name for name, f in allowed.items() if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise HardwareError(f"{where}: missing key(s) {', '.join(map(repr, missing))} (bandwidths in bytes/s one "
                            f"direction, latencies in seconds, memory_bytes in bytes)")
    values: dict[str, Any] = {k: int(v) if k in _WHOLE and isinstance(v, float) and v.is_integer() else v
              for k, v in data.items() if k != "format"}  # 6.4e10 bytes, as some JSON writers put a count
    for key in ("peak_flops", "sources"):
        if key in values and not isinstance(values[key], dict):
            raise HardwareError(f"{where}: {key!r} must be a JSON object, got {values[key]!r}")
    if priors is not None:
        values = _with_priors(values, priors)
    try:
        hw = Hardware(**values)
    except HardwareError as err:
        raise HardwareError(f"{where}: {err}") from None
    _plausible(hw, where)
    return hw


def _with_priors(values: dict[str, Any], priors: Hardware) -> dict[str, Any]:
    """``values`` with the :data:`PRIORED` fields it leaves out taken from ``priors`` and said in its sources. The
    FP8 ceiling, where the file gives an FP8 peak, is the BF16 ceiling times ``priors``' FP8 / BF16 ratio (an H100's
    FP8 GEMMs reach 0.709 of their peak where BF16's reach 0.803): a made-up GPU had been priced FP8 GEMMs at its
    BF16 fraction, about 13 % faster than measured on Hopper."""
    out, sources = dict(values), dict(values.get("sources", {}))
    for name in PRIORED:
        if name in values:
            continue
        if name == "fp8_gemm_efficiency":
            if "fp8" not in values["peak_flops"] or priors.fp8_gemm_efficiency is None:
                continue
            ratio = priors.fp8_gemm_efficiency / priors.gemm_efficiency
            bf16 = out["gemm_efficiency"]  # not a number: the Hardware's own check names it
            out[name] = min(1.0, bf16 * ratio) if _number(bf16) else bf16
            sources.setdefault(name, f"not given: gemm_efficiency x {ratio:.3f}, the built-in {priors.name}'s FP8 / "
                                     "BF16 GEMM ceilings")
        else:
            out[name] = getattr(priors, name)
            sources.setdefault(name, f"not given: the built-in {priors.name}'s")
    out["sources"] = sources
    return out


_RANGES = {
    "peak_flops": (1e12, 1e18, "dense FLOP/s (an H100's BF16: 9.894e14)"),
    "memory_bytes": (2**30, 2**44, "bytes (an H100's 79.6 GiB: 85520809984)"),
    "memory_bandwidth": (1e9, 1e15, "bytes/s (an H100's HBM3: 3.35e12)"),
    "scale_up_bandwidth": (1e6, 1e14, "bytes/s one direction (an H100's NVLink: 4.5e11)"),
    "scale_out_bandwidth": (1e6, 1e14, "bytes/s one direction per GPU (a 400 Gb/s NIC: 5e10)"),
    "scale_up_latency": (0.0, 1e-2, "seconds (NVLink: 1e-6)"),
    "scale_out_latency": (0.0, 1e-2, "seconds (InfiniBand: 5e-6)"),
    "kernel_overhead": (0.0, 1e-3, "seconds (a kernel launch: 2e-6)"),
    "scale_up_size": (1, 2**16, "GPUs (an HGX node: 8, an NVL72 rack: 72)"),
    "sm_count": (1, 2**14, "SMs or compute units (an H100: 132)"),
    "gemm_half_dim": (1.0, 2**16, "elements of a GEMM dimension (128)"),
    "attention_half_seq": (1.0, 2**20, "tokens (an H100: 1136)"),
    "flash2_slowdown": (1.0, 10.0, "times as long (Hopper: 1.7)"),
    "overlap_slowdown": (0.0, 10.0, "as a fraction (0.189: 18.9 % slower)"),
}
"""What a file's numbers may be: orders of magnitude around every GPU and link described here, so that a value in
the wrong unit (GiB for bytes, Gb/s for bytes/s, microseconds for seconds) or a typo (a GEMM half-rate dimension of
1e12, which priced a step at 2.6e24 s) is refused rather than planned with.
A :class:`Hardware` made in Python is not held to them (a what-if with links of no cost)."""


def _plausible(hw: Hardware, where: str) -> None:
    """HardwareError naming the first of ``hw``'s numbers outside :data:`_RANGES`."""
    for name, (low, high, unit) in _RANGES.items():
        values = hw.peak_flops.items() if name == "peak_flops" else [(None, getattr(hw, name))]
        for dtype, value in values:
            if not low <= value <= high:
                label = f"{name}[{dtype!r}]" if dtype else name
                span = (f"{format_bytes(low)} to {format_bytes(high)}: {unit}" if name == "memory_bytes"
                        else f"{low:g} to {high:g} {unit}")  # 1 GiB, not 1.07374e+09 bytes
                raise HardwareError(f"{where}: {label} {value:g} is outside what any GPU has ({span}); check its unit "
                                    "and digits")


_WHOLE = ("memory_bytes", "scale_up_size", "scale_up_placed", "sm_count")
"""The counts of a description: a JSON number that is whole (``6.4e10``) is read as one."""
_MAPPINGS = {"peak_flops": "dtype -> dense FLOP/s", "sources": "field name -> where its number comes from"}


def save_hardware(hw: Hardware, path: str | Path) -> None:
    """Write ``hw`` as a ``pipeloom.hardware/1`` JSON file (:func:`load_hardware` reads it back equal); HardwareError,
    writing nothing, for a number outside the ranges a file may hold (a what-if made in Python)."""
    if not isinstance(hw, Hardware):
        raise HardwareError(f"save_hardware takes a Hardware (pipeloom.plan.cluster.gpus.hardware('h100') gives a "
                            f"built-in's), got {type(hw).__name__}")
    try:
        _plausible(hw, f"cannot save {str(path)!r}")
    except HardwareError as err:  # a what-if of Python's that no file may hold: load_hardware would refuse it
        raise HardwareError(f"{err}; a file holds only what load_hardware reads back (a what-if this far from any "
                            "GPU stays in Python)") from None
    Path(path).write_text(json.dumps(hw.to_dict(), indent=2) + "\n")
