"""The schedule IR (docs/design.md §2): an action ``(stage, kind, microbatch)`` is written ``2F0``, an
overlapped forward + backward pair ``(0F7;7B3)OVERLAP_F_B`` and a communication action of a lowered schedule
``1SEND_F0``; a schedule is, per rank, the ordered list of actions it runs, with the problem it schedules;
plus its text, JSON and torch-CSV forms.
"""

from pipeloom.ir.composite import (
    action_duration,
    action_memory,
    has_pairs,
    is_split_full_backward,
    pair_duration,
    paired_forward_backward,
    part_tasks,
    priced_overlap,
    sequential_pairs,
    task_actions,
    without_overlap,
)
from pipeloom.ir.core import (
    COMM_KINDS,
    OVERLAP_F_B,
    Action,
    Comm,
    Overlap,
    Schedule,
    compute_parts,
    format_grid,
    parse_action,
)
from pipeloom.ir.files import load_schedule, save_schedule
from pipeloom.ir.json_io import FORMAT, check_totals, schedule_from_json, schedule_to_json
from pipeloom.ir.torch_csv import schedule_from_csv, schedule_to_csv

__all__ = [
    "COMM_KINDS",
    "FORMAT",
    "OVERLAP_F_B",
    "Action",
    "Comm",
    "Overlap",
    "parse_action",
    "compute_parts",
    "task_actions",
    "part_tasks",
    "is_split_full_backward",
    "action_duration",
    "pair_duration",
    "priced_overlap",
    "has_pairs",
    "without_overlap",
    "paired_forward_backward",
    "sequential_pairs",
    "action_memory",
    "Schedule",
    "format_grid",
    "schedule_to_json",
    "schedule_from_json",
    "check_totals",
    "schedule_to_csv",
    "schedule_from_csv",
    "save_schedule",
    "load_schedule",
]
