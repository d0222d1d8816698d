"""The distributed runtime: model splitting, the lowering of schedules, p2p and the engine.

Importing this package imports torch; nothing else in pipeloom does (DESIGN §4).
"""

from __future__ import annotations

from pipeloom.runtime.agree import StepMismatchError
from pipeloom.runtime.build import pipeline
from pipeloom.runtime.engine import PipelineEngine
from pipeloom.runtime.launch import init_ranks
from pipeloom.runtime.lower import PipelineError, model_pieces
from pipeloom.runtime.rng import forward_seed, reference_step
from pipeloom.runtime.scatter import Traffic
from pipeloom.runtime.split import (
    MODEL_INPUT,
    ModelTraceError,
    SplitError,
    SplitOrderError,
    StagedModel,
    StageGraph,
    StageSpec,
    StageValueError,
    UnknownSplitPointError,
    ValueRef,
    check_stage_value,
    split_model,
    stages_from_modules,
)
from pipeloom.runtime.state import LoadResult, ModelNames, model_names

__all__ = [
    "MODEL_INPUT",
    "LoadResult",
    "ModelNames",
    "ModelTraceError",
    "PipelineEngine",
    "PipelineError",
    "SplitError",
    "SplitOrderError",
    "StageGraph",
    "StageSpec",
    "StageValueError",
    "StepMismatchError",
    "StagedModel",
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
