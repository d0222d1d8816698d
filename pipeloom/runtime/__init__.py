"""The distributed runtime on torch: ``pipeline()`` and its options, the engine, and its rooms: cutting the model
(``model``), per-rank programs (``program``), mesh dimensions (``parallel``), communication and failures (``comm``),
one step (``step``) and training-loop state (``state``).

Importing it imports torch; so do :mod:`pipeloom.profile` and the CLI commands that run models. The layers
below it (the IR, schedules, simulator, search, planner) never do (docs/design.md §4).
"""

from __future__ import annotations

from pipeloom.runtime.build import pipeline
from pipeloom.runtime.engine import PipelineEngine
from pipeloom.runtime.errors import (
    ModelTraceError,
    PipelineError,
    SplitError,
    SplitOrderError,
    StageValueError,
    StepMismatchError,
    TracedSizeError,
    UnknownSplitPointError,
)
from pipeloom.runtime.launch import init_ranks
from pipeloom.runtime.model.split import (
    StagedModel,
    StageGraph,
    StageSpec,
    ValueRef,
    check_stage_value,
    split_model,
    stages_from_modules,
)
from pipeloom.runtime.options import Failures, Parallelism, Tracing, Weights
from pipeloom.runtime.parallel.link import SimulatedLink
from pipeloom.runtime.parallel.scatter import Traffic
from pipeloom.runtime.program import MODEL_INPUT, model_pieces
from pipeloom.runtime.state.state_dict import LoadResult, ModelNames, model_names
from pipeloom.runtime.step.rng import forward_seed, reference_step

__all__ = [
    "Failures",
    "Parallelism",
    "Tracing",
    "Weights",
    "MODEL_INPUT",
    "LoadResult",
    "ModelNames",
    "ModelTraceError",
    "PipelineEngine",
    "PipelineError",
    "SimulatedLink",
    "SplitError",
    "SplitOrderError",
    "StageGraph",
    "StageSpec",
    "StageValueError",
    "StepMismatchError",
    "StagedModel",
    "TracedSizeError",
    "Traffic",
    "UnknownSplitPointError",
    "ValueRef",
    "check_stage_value",
    "forward_seed",
    "init_ranks",
    "model_names",
    "model_pieces",
    "pipeline",
    "reference_step",
    "split_model",
    "stages_from_modules",
]
