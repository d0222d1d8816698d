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
    format_bytes,
    load_costs,
    parse_bytes,
    save_costs,
)
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
from pipeloom.plan.search import Candidate, PlanResult, plan_pipeline, recost, replica_sync_time
from pipeloom.plan.mesh import plan_mesh

__all__ = [
    "COSTS_FORMAT",
    "PLAN_FORMAT",
    "Candidate",
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
    "SchedulePartitioner",
    "SplitFront",
    "StageRule",
    "analytical_gpt_costs",
    "format_bytes",
    "load_costs",
    "load_plan",
    "parse_bytes",
    "partition",
    "partition_pieces",
    "plan_mesh",
    "plan_pipeline",
    "recost",
    "replica_sync_time",
    "save_costs",
    "save_plan",
]

# Loaded on first use and left out of __all__, so that ``from pipeloom.plan import *`` stays light.
_LAZY = {
    "DagPartition": "pipeloom.plan.dag",  # imports OR-Tools
    "partition_dag": "pipeloom.plan.dag",
    "profile_model": "pipeloom.plan.profile",  # imports torch
    "EngineProfiler": "pipeloom.plan.inplace",  # imports torch and the runtime
    "profile_in_engine": "pipeloom.plan.inplace",
}


def __getattr__(name: str) -> Any:
    """Load the DAG partitioner and the profiler only when their names are used."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeloom.plan' has no attribute {name!r}")
