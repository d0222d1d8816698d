"""The runtime's errors: cutting a model into stages (tracing, split points, values between stages), and building
and running a pipeline."""

from __future__ import annotations

from pipeloom.errors import PipeloomError

__all__ = [
    "ModelTraceError",
    "PipelineError",
    "RegionsNotFoundError",
    "ReplicaBufferError",
    "NeedsExampleError",
    "NotSplitYetError",
    "SplitError",
    "SplitOrderError",
    "StageValueError",
    "StepMismatchError",
    "TracedSizeError",
    "UnknownSplitPointError",
]


class SplitError(PipeloomError):
    """A model cannot be cut into stages as asked."""


class UnknownSplitPointError(SplitError):
    """A split point names no module that the traced model calls."""


class SplitOrderError(SplitError):
    """Split points are duplicated, out of call order, leave a stage empty or cut a kept module."""


class ModelTraceError(SplitError):
    """Neither ``torch.fx`` nor ``torch.export`` can trace the model; manual mode is the way out."""


class StageValueError(SplitError):
    """A value passed between stages is not a tensor or a tuple/list/dict of tensors."""


class PipelineError(PipeloomError, RuntimeError):
    """A pipeline cannot be built from these pieces, or a step failed on some rank."""


class NotSplitYetError(PipelineError, AttributeError):
    """An engine split at its first step was asked, before that step, for what only the split sets (its pieces,
    lowering, micro-batches...). An AttributeError too, so ``hasattr`` and ``getattr(engine, name, default)`` say the
    engine has no such attribute yet."""


class ReplicaBufferError(PipelineError):
    """After a training step of a two-replica schedule, the two replicas of a piece hold a buffer differently
    (BatchNorm's running statistics), or data-parallel replicas do: the same answer on every rank of the group, which
    stays usable for another engine (``pipeloom plan --try`` goes on with the next plan)."""


class StepMismatchError(PipelineError):
    """Ranks were given different micro-batch counts or batches (shapes, dtypes) for one step. Raised
    on every rank before anything moved: the engine stays usable."""


class TracedSizeError(PipelineError):
    """A step's inputs break a size the model's torch.export trace fixed (a loop unrolled for the example's
    length): the graph would compute something else for them. Raised before anything ran: the engine stays
    usable."""


class RegionsNotFoundError(PipelineError):
    """``tp_plan="auto"`` could not find the transformer regions it shards in the model."""


class NeedsExampleError(ModelTraceError):
    """Only torch.export can trace the model, and it needs an example batch: ``pipeline()`` without
    ``example_inputs`` then splits the model at its first step, tracing that step's batch."""
