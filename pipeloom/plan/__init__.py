"""The planner: cost tables, stage partitioning and the whole-plan search; torch-free.

Rooms: :mod:`~pipeloom.plan.costs` (the cost model), :mod:`~pipeloom.plan.partitioning` (cutting pieces into
stages), :mod:`~pipeloom.plan.tp` (tensor parallelism's costs and the sharding search), and here the plan
search (:mod:`~pipeloom.plan.planner`), re-costing, the mesh, the noise model and the plan file. The profilers
that measure cost tables with torch are :mod:`pipeloom.profile`. The DAG partitioner (CP-SAT) loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeloom.plan.costs.analytical import analytical_gpt_costs
from pipeloom.plan.costs.file import COSTS_FORMAT, load_costs, save_costs
from pipeloom.plan.costs.parts import Link, Piece, RuntimeCorrections, parse_bytes
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import CostTableError, PartitionError, PlanError
from pipeloom.plan.mesh import plan_mesh
from pipeloom.plan.partitioning.chain import SplitFront, partition_pieces
from pipeloom.plan.partitioning.partitioner import SchedulePartitioner, partition
from pipeloom.plan.partitioning.rules import MemoryRule, Partition, StageRule
from pipeloom.plan.plan import PLAN_FORMAT, Plan, load_plan, save_plan
from pipeloom.plan.planner import Candidate, PlanResult, plan_pipeline
from pipeloom.plan.recost import recost, replica_sync_time
from pipeloom.plan.tp.collectives import CollectiveFit, fit_collectives
from pipeloom.plan.tp.megatron import TensorInfo, tensor_parallel_table
from pipeloom.plan.tp.sharding import RegionModules, ShardingProblem, ShardingResult, search_sharding

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
    "search_sharding",
    "tensor_parallel_table",
]

# Loaded on first use and left out of __all__, so that ``from pipeloom.plan import *`` stays light.
_LAZY = {
    "DagPartition": "pipeloom.plan.partitioning.dag",  # imports OR-Tools
    "partition_dag": "pipeloom.plan.partitioning.dag",
}


def __getattr__(name: str) -> Any:
    """Load the DAG partitioner only when its names are used."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeloom.plan' has no attribute {name!r}")
