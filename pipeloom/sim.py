"""Event simulation of a schedule with the time and memory semantics of docs/design.md §3.

``simulate(schedule)`` replays every rank's list in order and returns a :class:`Timeline`:
start/end of each action, per-rank memory held, makespan, bubble ratio, busy time and peaks.
A lowered schedule's communication takes its own time (:mod:`pipeloom.lowering.replay`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import import_module

from pipeloom.errors import ProblemError, require_type
from pipeloom.ir import Action, Comm, Overlap, Schedule
from pipeloom.lowering import replay_lowered
from pipeloom.sim_pricing import Pricing
from pipeloom.sim_replay import CompiledSchedule, bubble_ratio

__all__ = ["Timeline", "compile_schedule", "simulate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """What happens when a schedule runs: times and memory per rank, aligned with its lists."""

    schedule: Schedule
    """The schedule that was simulated."""
    starts: tuple[tuple[float, ...], ...]
    """``starts[r][i]``: start time of ``schedule.ranks[r][i]``."""
    ends: tuple[tuple[float, ...], ...]
    """``ends[r][i]``: end time of ``schedule.ranks[r][i]``."""
    memory: tuple[tuple[float, ...], ...]
    """``memory[r][i]``: memory held on rank r right after ``schedule.ranks[r][i]`` starts."""
    makespan: float
    """Latest finish over all actions."""
    busy: tuple[float, ...]
    """Per-rank sum of compute action durations (communication is not work)."""
    peak_memory: tuple[float, ...]
    """Per-rank maximum held memory (static memory included)."""

    @property
    def num_ranks(self) -> int:
        """Number of ranks."""
        return len(self.starts)

    @property
    def bubble_ratio(self) -> float:
        """``1 - sum(busy) / (num_ranks * makespan)``; 0 for an empty timeline."""
        return bubble_ratio(self.busy, self.makespan)

    def events(self, rank: int) -> Iterator[tuple[Action | Overlap | Comm, float, float]]:
        """``(action, start, end)`` of every action of ``rank``, in order."""
        return zip(self.schedule.ranks[rank], self.starts[rank], self.ends[rank])

    def action_times(self) -> dict[Action | Overlap | Comm, tuple[float, float]]:
        """``{action: (start, end)}`` over all ranks (a multi-rank action appears once)."""
        times: dict[Action | Overlap | Comm, tuple[float, float]] = {}
        for rank in range(self.num_ranks):
            for action, start, end in self.events(rank):
                times[action] = (start, end)
        return times

    def _repr_html_(self) -> str:
        """The interactive timeline a notebook shows (:func:`pipeloom.viz.html.notebook_html`), looked
        up by name on first use: viz sits above sim (docs/architecture.md, "Looked up on use")."""
        return import_module("pipeloom.viz.html").notebook_html(self)

    def memory_curve(self, rank: int) -> list[tuple[float, float]]:
        """Step curve ``[(time, held), ...]`` of rank's memory, starting at ``(0, static)``."""
        static = self.schedule.problem.static_memory
        curve = [(0.0, static[rank] if static else 0.0)]
        curve.extend(zip(self.starts[rank], self.memory[rank]))
        return curve


def simulate(schedule: Schedule, *, overlap_overhead: float | None = None,
             compiled: CompiledSchedule | None = None) -> Timeline:
    """Replay ``schedule``: each rank runs its list in order, one action at a time.

    An action starts at the latest of its ranks becoming free and each dep's finish (plus the
    communication latency when the dep ran on another set of ranks). In a lowered schedule the
    receives carry that latency instead (see :mod:`pipeloom.lowering.replay`). An overlapped pair
    (and a full ``B`` on a split stage) is one action: it starts when every part's deps are met and
    takes ``max(forward, backward) + overlap_overhead`` (I + W); ``overlap_overhead`` None: the
    problem's (docs/semantics.md). Raises DeadlockError when the lists cannot run to the end; use
    :func:`pipeloom.validate.validate` for full checks. ``compiled``: :func:`compile_schedule` of a schedule with
    the same lists and tasks and any costs, reused with ``schedule``'s costs instead of compiling the lists again
    (ScheduleError when they differ).
    """
    require_type("schedule", schedule, Schedule, "a pipeloom Schedule (e.g. build_schedule('1f1b', 4, 8) or "
                 "load_schedule(path))")
    overhead = _overhead(schedule, overlap_overhead)
    if schedule.lowered:
        lowered = replay_lowered(schedule, overlap_overhead=overhead)
        _check_finite(schedule, lowered.makespan, lowered.busy, lowered.peak_memory)
        return Timeline(schedule=schedule, starts=lowered.starts, ends=lowered.ends, memory=lowered.memory,
                        makespan=lowered.makespan, busy=lowered.busy, peak_memory=lowered.peak_memory)
    problem = schedule.problem
    if compiled is None:
        compiled = CompiledSchedule.of(schedule, overhead)
    else:
        compiled.check_same_lists(schedule)
    run = compiled.run(Pricing.of(problem, overhead), problem.static_memory)
    _check_finite(schedule, run.makespan, run.busy, run.peaks)
    return Timeline(
        schedule=schedule,
        starts=tuple(map(tuple, run.starts)),
        ends=tuple(map(tuple, run.ends)),
        memory=tuple(run.held),
        makespan=run.makespan,
        busy=tuple(run.busy),
        peak_memory=tuple(run.peaks),
    )


def _check_finite(schedule: Schedule, makespan: float, busy: Sequence[float], peaks: Sequence[float]) -> None:
    """ProblemError when the replay's sums left the float range (durations or memory near 1e308)."""
    if math.isfinite(makespan) and all(map(math.isfinite, busy)) and all(map(math.isfinite, peaks)):
        return
    times = not (math.isfinite(makespan) and all(map(math.isfinite, busy)))
    problem = schedule.problem
    if times:  # name the largest value that fed the sum, so the user knows what to scale
        values = [(f"task {task.name} duration", task.duration) for task in problem.tasks]
        values += [("comm_latency", problem.comm_latency), ("overlap_overhead", problem.overlap_overhead)]
    else:
        values = [(f"task {task.name} memory", abs(task.memory)) for task in problem.tasks]
        values += [(f"static_memory[{r}]", abs(v)) for r, v in enumerate(problem.static_memory or ())]
    field, value = max(values, key=lambda item: item[1])
    raise ProblemError(f"schedule {schedule.name!r}: its {'times' if times else 'memory'} overflow the float range "
                       f"when added up over {schedule.num_microbatches} micro-batches (largest: {field} {value:g}); "
                       "scale the durations and memory down (e.g. seconds to milliseconds, bytes to MiB) so that "
                       "a rank's total stays finite")


def _overhead(schedule: Schedule, overlap_overhead: float | None) -> float:
    """The overlapped pairs' overhead: the problem's, or a finite number >= 0 given."""
    if overlap_overhead is None:
        return schedule.problem.overlap_overhead
    if not _nonnegative(overlap_overhead):
        raise ValueError(f"overlap_overhead must be a finite number >= 0, got {overlap_overhead!r}")
    return float(overlap_overhead)


def _nonnegative(value: object) -> bool:
    """A finite int or float >= 0 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def compile_schedule(schedule: Schedule) -> CompiledSchedule:
    """``schedule`` ready to replay many times with varying action times
    (:meth:`CompiledSchedule.makespan`), e.g. by the planner's noise model (:mod:`pipeloom.plan.noise`)."""
    require_type("schedule", schedule, Schedule, "a pipeloom Schedule")
    return CompiledSchedule.of(schedule, schedule.problem.overlap_overhead)

