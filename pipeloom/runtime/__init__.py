"""The distributed runtime: model splitting, the lowering of schedules, p2p and the engine.

Importing this package imports torch, as importing :mod:`pipeloom.profile` does; the rest of pipeloom does
not (the command line only inside the commands that need it; docs/design.md §4, §7).
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
from pipeloom.runtime.parallel.scatter import Traffic
from pipeloom.runtime.program import MODEL_INPUT, model_pieces
from pipeloom.runtime.state.state_dict import LoadResult, ModelNames, model_names
from pipeloom.runtime.step.rng import forward_seed, reference_step

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
