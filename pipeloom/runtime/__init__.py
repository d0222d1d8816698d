"""The distributed runtime: model splitting, the lowering of schedules, p2p and the engine.

Importing this package imports torch; nothing else in pipeloom does (DESIGN §4).
"""

from __future__ import annotations

from pipeloom.runtime.engine import PipelineEngine, pipeline
from pipeloom.runtime.lower import PipelineError, model_pieces
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

__all__ = [
    "MODEL_INPUT",
    "ModelTraceError",
    "PipelineEngine",
    "PipelineError",
    "SplitError",
    "SplitOrderError",
    "StageGraph",
    "StageSpec",
    "StageValueError",
    "StagedModel",
    "UnknownSplitPointError",
    "ValueRef",
    "check_stage_value",
    "model_pieces",
    "pipeline",
    "split_model",
    "stages_from_modules",
]
