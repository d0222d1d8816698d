"""The schedule IR (DESIGN §2): an action ``(stage, kind, microbatch)`` is written ``2F0`` and a
communication action of a lowered schedule ``1SEND_F0``; a schedule is, per rank, the ordered list
of actions it runs, with the problem it schedules; plus its text, JSON and torch-CSV forms.
"""

from pipeloom.ir.core import COMM_KINDS, Action, Comm, Schedule, format_grid, parse_action
from pipeloom.ir.files import load_schedule, save_schedule
from pipeloom.ir.json_io import FORMAT, schedule_from_json, schedule_to_json
from pipeloom.ir.torch_csv import schedule_from_csv, schedule_to_csv

__all__ = [
    "COMM_KINDS",
    "FORMAT",
    "Action",
    "Comm",
    "parse_action",
    "Schedule",
    "format_grid",
    "schedule_to_json",
    "schedule_from_json",
    "schedule_to_csv",
    "schedule_from_csv",
    "save_schedule",
    "load_schedule",
]
