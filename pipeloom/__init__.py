"""pipeloom: pipeline-parallel schedules for PyTorch, built, searched, simulated, drawn and run."""

from importlib import metadata as _metadata

from pipeloom.errors import (
    CommError,
    DeadlockError,
    LoweringError,
    MemoryLimitError,
    OrderError,
    PipeloomError,
    ProblemError,
    ScheduleError,
    ScheduleFormatError,
)
from pipeloom.ir import Action, Comm, Schedule, load_schedule, save_schedule
from pipeloom.lowering import lower
from pipeloom.problem import Problem, Task
from pipeloom.schedules import build_schedule, schedule_names
from pipeloom.sim import Timeline, simulate
from pipeloom.stages import Costs, Stage, stage_graph
from pipeloom.validate import validate

__all__ = [
    "Action",
    "Comm",
    "CommError",
    "Costs",
    "DeadlockError",
    "LoweringError",
    "MemoryLimitError",
    "OrderError",
    "PipeloomError",
    "Problem",
    "ProblemError",
    "Schedule",
    "ScheduleError",
    "ScheduleFormatError",
    "Stage",
    "Task",
    "Timeline",
    "build_schedule",
    "load_schedule",
    "lower",
    "save_schedule",
    "schedule_names",
    "simulate",
    "stage_graph",
    "validate",
]

try:  # the one version source is pyproject.toml; an installed (or editable) package carries it
    __version__ = _metadata.version("pipeloom")
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> object:
    """``pipeloom.pipeline`` and ``pipeloom.PipelineError`` load the torch runtime on first use."""
    if name in ("pipeline", "PipelineEngine", "PipelineError"):
        import pipeloom.runtime  # noqa: PLC0415 (torch is imported only when the runtime is used)

        return getattr(pipeloom.runtime, name)
    raise AttributeError(f"module 'pipeloom' has no attribute {name!r}")
