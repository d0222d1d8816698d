"""Errors of the planner: cost tables, partitions, tensor parallelism, plans."""

from __future__ import annotations

from pipeloom.errors import ArgumentError, PipeloomError

__all__ = [
    "CostTableError",
    "HardwareError",
    "LayoutError",
    "MemoryTooSmall",
    "ModelConfigError",
    "NoLayoutFits",
    "NoPlanFits",
    "PartitionError",
    "PlanArgumentError",
    "PlanError",
    "RecipeError",
    "SolverMissingError",
    "TensorParallelError",
    "TensorParallelSizeError",
]


class PlanError(PipeloomError):
    """A plan cannot be made or read (no plan fits the memory, too many stages, malformed file...)."""


class PlanArgumentError(PlanError, ArgumentError):
    """Planning arguments that disagree: a micro-batch count that does not divide the global batch, a data- or
    tensor-parallel size that does not divide the ranks, the batch or the heads (the command line's usage error)."""


class PartitionError(PlanError):
    """No partition meets the request (bad graph, more stages than pieces, memory too small...)."""


class TensorParallelError(PipeloomError):
    """A tensor-parallel size or description that does not fit the model (heads, layers, fits)."""


class TensorParallelSizeError(PlanArgumentError, TensorParallelError):
    """A tensor-parallel size that does not divide the ranks or the model's heads: a planning argument (the command
    line's usage error) and a tensor-parallel error alike."""


class SolverMissingError(TensorParallelError):
    """The search needs OR-Tools' CP-SAT, which cannot be imported."""


class CostTableError(PipeloomError):
    """A cost table or its file is malformed (unknown key, bad number, unknown piece name...)."""


class MemoryTooSmall(PartitionError):
    """No split fits the memory limit; ``smallest_limit`` is a per-rank limit that would."""

    def __init__(self, message: str, *, smallest_limit: float) -> None:
        super().__init__(message)
        self.smallest_limit = smallest_limit


class NoPlanFits(PlanError):
    """No candidate fits the request; ``smallest_limit`` is a per-rank limit under which one does
    (None when nothing could be built at all)."""

    def __init__(self, message: str, *, smallest_limit: float | None) -> None:
        super().__init__(message)
        self.smallest_limit = smallest_limit


class RecipeError(PipeloomError):
    """A saved tensor-parallel plan that is not a known recipe over lists of module names."""


class HardwareError(PipeloomError):
    """An unknown GPU name, or a hardware file or description that cannot be used (names the fix)."""


class ModelConfigError(PipeloomError):
    """A model config that cannot be read or describes a model the cluster planner does not model."""


class NoLayoutFits(PipeloomError):
    """No layout of the job runs, or none fits the memory limit; then ``smallest_limit`` is the least memory per
    GPU of any layout (bytes: planning again with it finds ``smallest_layout``, with less finds none; None when
    no layout runs at all)."""

    def __init__(self, message: str, *, smallest_limit: float | None = None,
                 smallest_layout: str | None = None) -> None:
        super().__init__(message)
        self.smallest_limit = smallest_limit
        self.smallest_layout = smallest_layout


class LayoutError(PipeloomError):
    """A layout that cannot run: sizes that do not multiply out, a schedule without its placement, ...; ``counts``
    is the GPU count or global batch that would let it run where the job's counts are the cause (a global batch
    dp x mbs divides, ...), else None."""

    def __init__(self, message: str, *, counts: str | None = None) -> None:
        super().__init__(message)
        self.counts = counts
