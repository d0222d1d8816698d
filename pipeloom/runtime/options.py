"""The typed options of :func:`~pipeloom.runtime.build.pipeline`, grouped by what they decide: how the model is
traced into stages (:class:`Tracing`), the other mesh dimensions and how replicas hold the pieces
(:class:`Parallelism`), what fills a model built on the meta device (:class:`Weights`), and how failures end a
step (:class:`Failures`). The simple call needs none of them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.parallel.link import SimulatedLink

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from pipeloom.runtime.model.materialize import StateSource

__all__ = ["DATA_PARALLEL", "TRACERS", "Failures", "Parallelism", "Tracing", "Weights"]

TRACERS = ("auto", "fx", "export")
DATA_PARALLEL = ("replicate", "fsdp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Tracing:
    """How ``split_points`` cut the model (:func:`~pipeloom.runtime.model.split.split_model`)."""

    tracer: str = "auto"
    """``"fx"`` (torch.fx's symbolic trace), ``"export"`` (torch.export, from example inputs) or ``"auto"``
    (fx, then export when fx cannot trace the model)."""
    leaf_modules: Sequence[str] = ()
    """Module names (fnmatch patterns) kept whole, called as one node, never traced into."""
    example_inputs: object = None
    """Inputs torch.export traces with (a tuple of positional arguments, or one tensor); their sizes also
    size ``tp_plan="auto"``'s search."""

    def __post_init__(self) -> None:
        if self.tracer not in TRACERS:
            raise PipelineError(f"Tracing(tracer={self.tracer!r}): choose one of {', '.join(TRACERS)}")
        if isinstance(self.leaf_modules, str):
            raise PipelineError(f"Tracing(leaf_modules={self.leaf_modules!r}) takes a list of module names, e.g. "
                                f"[{self.leaf_modules!r}]")
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallelism:
    """Where the pipeline's ranks come from, and the mesh dimensions besides ``"pp"`` (docs/parallelism.md)."""

    mesh: DeviceMesh | None = None
    """A ``DeviceMesh`` with a ``"pp"`` dimension (the pipeline) and optionally ``"dp"`` (replicas, each running
    its share of the global batch), ``"tp"`` (tensor parallel inside each stage) and ``"ep"`` (experts shared out
    over ranks that are otherwise replicas). None: ``process_group``."""
    process_group: ProcessGroup | None = None
    """The ranks of one pipeline without a mesh (default: the whole world)."""
    data_parallel: str | None = None
    """How the ``"dp"`` replicas hold the pieces: ``"replicate"`` (whole, gradients all-reduced) or ``"fsdp"``
    (sharded with torch's ``fully_shard``; with ``"ep"`` over the dp × ep replicas, and the experts over ``"dp"``
    within their ep shard). None: replicate, or a plan's sharding."""
    tp_plan: dict | str | Any = None
    """With a ``"tp"`` dimension: torch's ``parallelize_module`` plan ({module name or pattern: ParallelStyle},
    the model's names), ``"hf"`` (a ``transformers`` model's own plan), ``"auto"`` or an
    :class:`~pipeloom.runtime.parallel.tp_auto.AutoPlan` (the plan the sharding search chooses;
    ``engine.tp_sharding`` holds it with its prediction)."""
    scatter_boundaries: bool = True
    """With ``"tp"``: a stage-boundary tensor equal on every tp rank crosses once per tp group (each sends
    1/tp of it, the receivers all-gather); False sends it whole from every tp rank."""
    experts: Sequence[str] | None = None
    """With ``"ep"``: the names (or fnmatch patterns) of the experts modules whose experts are shared out over
    ``"ep"`` (:mod:`pipeloom.runtime.parallel.ep`: the interface they follow); None finds every module of the
    model with that interface (``transformers``' MoE experts have it)."""
    capacity_factor: float | None = None
    """With ``"ep"``: each expert takes at most ``ceil(capacity_factor · T · k / E)`` of the (token, choice)
    pairs of one rank's micro-batch (``T`` tokens, top-``k`` of ``E`` experts); the pairs beyond it, in token
    order, are dropped (Switch, GShard, Megatron's ``moe_expert_capacity_factor``). None: no capacity, nothing
    dropped (exact). Every rank passes the same value."""
    overlap_pairs: bool = False
    """An overlapped pair ``(iF;jB)OVERLAP_F_B`` (DualPipe's) runs its two parts interleaved at their expert
    all-to-alls, one computing while the other's is in flight (:mod:`pipeloom.runtime.parallel.overlap`); every
    rank passes the same value."""
    simulated_link: SimulatedLink | None = None
    """A benchmark and test facility, off by default: every expert all-to-all completes no earlier than
    ``latency + bytes / bandwidth`` after it was issued, its wait sleeping (:mod:`pipeloom.runtime.parallel.link`),
    so that a pair's overlap has idle time to fill on CPU ranks; every rank passes the same value."""

    def __post_init__(self) -> None:
        if self.mesh is not None and self.process_group is not None:
            raise PipelineError("Parallelism takes mesh= or process_group=, not both")
        if self.data_parallel is not None and self.data_parallel not in DATA_PARALLEL:
            raise PipelineError(f"Parallelism(data_parallel={self.data_parallel!r}): choose 'replicate' or 'fsdp'")
        if isinstance(self.experts, str):
            raise PipelineError(f"Parallelism(experts={self.experts!r}) takes a list of module names, e.g. "
                                f"[{self.experts!r}]")
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not math.isfinite(factor) or factor <= 0):
            raise PipelineError(f"Parallelism(capacity_factor={factor!r}): give a finite number > 0 (1.0: each "
                                "expert takes its balanced share) or None for no capacity")
        if not isinstance(self.scatter_boundaries, bool) or not isinstance(self.overlap_pairs, bool):
            raise PipelineError("Parallelism(scatter_boundaries=, overlap_pairs=) are True or False")
        if self.simulated_link is not None and not isinstance(self.simulated_link, SimulatedLink):
            raise PipelineError(f"Parallelism(simulated_link={self.simulated_link!r}) takes a SimulatedLink(latency=, "
                                "bandwidth=) or None")


@dataclass(frozen=True, kw_only=True, slots=True)
class Weights:
    """What fills this rank's pieces of a model built on the meta device; other ranks' tensors are never
    allocated (:mod:`pipeloom.runtime.model.materialize`)."""

    state_dict: StateSource | None = None
    """A state dict, a ``torch.save`` file or a ``torch.distributed.checkpoint`` folder, keyed by the model's
    names."""
    init_weights: Callable[[nn.Module], object] | None = None
    """A function called on every module this rank holds, after it is allocated on the device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Failures:
    """How a failure ends a step: every rank raises within ``timeout`` (docs/design.md §5)."""

    timeout: float = 60.0
    """Seconds any wait of a step may take (a message, a collective) before the rank gives up and tells the
    others."""

    def __post_init__(self) -> None:
        timeout = self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
                or timeout <= 0:
            raise PipelineError(f"Failures(timeout={timeout!r}): a positive number of seconds")
        object.__setattr__(self, "timeout", float(timeout))
