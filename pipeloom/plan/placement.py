"""The first name of :mod:`pipeloom.plan.shape` (schedule shapes and the partitioner's stage rules),
kept so that old imports work; import from :mod:`pipeloom.plan.shape`."""

from __future__ import annotations

from pipeloom.plan.shape import (
    PARTITION_PROFILES,
    PartitionPlacement,
    ScheduleShape,
    copy_memory,
    in_flight,
    library_costs,
    library_schedule,
    rank_memory,
    rank_objective,
    rank_time_objective,
    schedule_shape,
    stage_rules,
    visits_per_rank,
)

Placement = PartitionPlacement
"""The first name of :data:`pipeloom.plan.shape.PartitionPlacement`."""

__all__ = [
    "PARTITION_PROFILES",
    "Placement",
    "ScheduleShape",
    "copy_memory",
    "in_flight",
    "library_costs",
    "library_schedule",
    "rank_memory",
    "rank_objective",
    "rank_time_objective",
    "schedule_shape",
    "stage_rules",
    "visits_per_rank",
]
