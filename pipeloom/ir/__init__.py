"""The schedule IR (DESIGN §2): an action ``(stage, kind, microbatch)`` is written ``2F0``; a
schedule is, per rank, the ordered list of actions it runs, with the problem it schedules; plus
its text, JSON and torch-CSV forms.
"""

from pipeloom.ir.core import Action, Schedule, format_grid
from pipeloom.ir.files import load_schedule, save_schedule
from pipeloom.ir.json_io import FORMAT, schedule_from_json, schedule_to_json
from pipeloom.ir.torch_csv import schedule_from_csv, schedule_to_csv

__all__ = [
    "FORMAT",
    "Action",
    "Schedule",
    "format_grid",
    "schedule_to_json",
    "schedule_from_json",
    "schedule_to_csv",
    "schedule_from_csv",
    "save_schedule",
    "load_schedule",
]
