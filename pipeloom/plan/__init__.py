"""The planner: cost tables (profiled or analytical), stage partitioning and the whole-plan search.

Nothing here imports torch except :mod:`pipeloom.plan.profile` and :mod:`pipeloom.plan.inplace`
(profiling inside the runtime); the DAG partitioner (:mod:`pipeloom.plan.dag`, CP-SAT) and the
profilers load on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeloom.plan.analytical import analytical_gpt_costs
from pipeloom.plan.costs import (
    COSTS_FORMAT,
    CostTable,
    CostTableError,
    Link,
    Piece,
    RuntimeCorrections,
    format_bytes,
    load_costs,
    parse_bytes,
    save_costs,
)
from pipeloom.plan.mesh import plan_mesh
from pipeloom.plan.partition import (
    MemoryRule,
    Partition,
    PartitionError,
    SplitFront,
    StageRule,
    partition_pieces,
)
from pipeloom.plan.partitioner import SchedulePartitioner, partition
from pipeloom.plan.plan import PLAN_FORMAT, Plan, PlanError, load_plan, save_plan
from pipeloom.plan.recipes import recipe_styles
from pipeloom.plan.search import Candidate, PlanResult, plan_pipeline, recost, replica_sync_time
from pipeloom.plan.sharding import RegionModules, ShardingProblem, ShardingResult, search_sharding
from pipeloom.plan.tensor import CollectiveFit, TensorInfo, fit_collectives, tensor_parallel_table

__all__ = [
    "COSTS_FORMAT",
    "PLAN_FORMAT",
    "Candidate",
    "CollectiveFit",
    "CostTable",
    "CostTableError",
    "Link",
    "MemoryRule",
    "Partition",
    "PartitionError",
    "Piece",
    "Plan",
    "PlanError",
    "PlanResult",
    "RegionModules",
    "RuntimeCorrections",
    "SchedulePartitioner",
    "ShardingProblem",
    "ShardingResult",
    "SplitFront",
    "StageRule",
    "TensorInfo",
    "analytical_gpt_costs",
    "fit_collectives",
    "format_bytes",
    "load_costs",
    "load_plan",
    "parse_bytes",
    "partition",
    "partition_pieces",
    "plan_mesh",
    "plan_pipeline",
    "recipe_styles",
    "recost",
    "replica_sync_time",
    "save_costs",
    "save_plan",
    "search_sharding",
    "tensor_parallel_table",
]

# Loaded on first use and left out of __all__, so that ``from pipeloom.plan import *`` stays light.
_LAZY = {
    "DagPartition": "pipeloom.plan.dag",  # imports OR-Tools
    "partition_dag": "pipeloom.plan.dag",
    "profile_model": "pipeloom.plan.profile",  # imports torch
    "EngineProfiler": "pipeloom.plan.inplace",  # imports torch and the runtime
    "profile_in_engine": "pipeloom.plan.inplace",
    "CollectiveCounter": "pipeloom.plan.collectives",  # imports torch
    "time_collectives": "pipeloom.plan.collectives",
}


def __getattr__(name: str) -> Any:
    """Load the DAG partitioner and the profiler only when their names are used."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeloom.plan' has no attribute {name!r}")
