"""What the estimator predicts for one layout: :class:`Estimate` (step time, its parts, throughput, MFU) and
:class:`Memory` (bytes per GPU of the busiest pipeline rank)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipeloom.plan.cluster.layout import Layout

__all__ = ["Memory", "Estimate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    """Bytes per GPU (the busiest pipeline rank)."""

    weights: float
    """Model weights held (bf16)."""
    gradients: float
    """Gradients held (whole ones in the reduce's dtype: :func:`~pipeloom.plan.cluster.layout.optimizer_bytes`)."""
    optimizer: float
    """fp32 master weights and Adam's two moments held."""
    activations: float
    """Peak of activations held for the backward (from the schedule's replay)."""
    buffers: float
    """Workspaces: :data:`WORKSPACE_BYTES`, FSDP's gathered layers, a fully recomputed layer's activations."""

    @property
    def total(self) -> float:
        """All of it."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        """The breakdown and the total, in bytes."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "total": self.total}


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """The predicted step of one layout."""

    layout: Layout
    """The layout."""
    stage_layers: tuple[int, ...]
    """Decoder layers of each model stage, in model order (the embedding rides with the first, the head with the
    last)."""
    step_time: float
    """Seconds per step."""
    pipeline_time: float
    """Of it, the schedule's makespan (compute, tp/ep/cp communication, pipeline sends, bubbles)."""
    exposed_dp: float
    """Of it, the data-parallel / FSDP communication the computation does not hide."""
    optimizer_time: float
    """Of it, the optimizer step (bandwidth-bound)."""
    bubble: float
    """Idle fraction of the pipeline ranks during the makespan."""
    memory: Memory
    """Bytes per GPU."""
    tokens_per_gpu_per_second: float
    """Throughput per GPU."""
    mfu: float
    """Model FLOPs (matmuls, causal attention) per second over the GPUs' dense peak in the job's dtype."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (seconds and bytes)."""
        return {"layout": self.layout.as_dict(), "stage_layers": list(self.stage_layers), "step_time": self.step_time,
                "pipeline_time": self.pipeline_time,
                "exposed_dp_time": self.exposed_dp, "optimizer_time": self.optimizer_time, "bubble": self.bubble,
                "tokens_per_gpu_per_second": self.tokens_per_gpu_per_second, "mfu": self.mfu,
                "memory_per_gpu": self.memory.as_dict()}
