"""A run's trace analysed: step times, per-task times and the runtime's own costs measured from the
events, the schedule re-costed with them and simulated (the prediction), and the measured step as a
timeline, side by side in a :class:`Comparison`. Times are seconds; 0 is the start of a step
(measured) or of the simulation.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipeloom.ir import Action, Comm, Overlap, Schedule, action_duration, action_memory, task_actions
from pipeloom.problem import Problem, TaskKey
from pipeloom.sim import Timeline, simulate
from pipeloom.trace.errors import StepSelectionError
from pipeloom.trace.format import RunTrace, StepTrace

__all__ = [
    "MESSAGE_KINDS",
    "Comparison",
    "Steps",
    "comm_latency_estimate",
    "compare_run",
    "measured_step_time",
    "measured_timeline",
    "message_cost",
    "per_step_idle",
    "per_step_mean",
    "predicted_timeline",
    "recosted_schedule",
    "selected_steps",
    "step_times",
    "task_durations",
    "typical_step",
]

Steps = str | Sequence[int]
"""Which recorded steps to measure: ``"warm"`` (all but the first when there are two or more: the
first step warms up caches, allocators and kernels), ``"all"``, or a list of step numbers."""

_NS = 1e-9  # seconds per nanosecond
_COMM_KINDS = ("compute", "wait", "send")  # the events a step's measured span covers


# ---------------------------------------------------------------------------------- measuring


def selected_steps(run: RunTrace, steps: Steps = "warm") -> tuple[int, ...]:
    """The step numbers ``steps`` selects from ``run.steps`` (see :data:`Steps`)."""
    if steps == "warm":
        return run.steps[1:] if len(run.steps) >= 2 else run.steps
    if steps == "all":
        return run.steps
    if not isinstance(steps, Sequence) or isinstance(steps, str):
        raise StepSelectionError(f"steps {steps!r}: use 'warm', 'all' or a list of step numbers")
    unknown = [step for step in steps if step not in run.steps]
    if not steps or unknown:
        raise StepSelectionError(f"steps {unknown or '[]'} are not in the trace; recorded steps: "
                                 f"{_step_list(run.steps)}")
    return tuple(sorted(set(steps)))


def _step_list(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")


def _indices(run: RunTrace, steps: Steps) -> list[int]:
    """Positions in ``run.steps`` of the selected steps."""
    position = {step: i for i, step in enumerate(run.steps)}
    return [position[step] for step in selected_steps(run, steps)]


def _span_ns(run: RunTrace, i: int) -> tuple[int, int]:
    """``(earliest start, latest end)`` over the compute, wait and send events of step index ``i``."""
    events = [e for record in run.ranks for e in record[i].events if e.kind in _COMM_KINDS]
    return min(e.start_ns for e in events), max(e.end_ns for e in events)


def step_times(run: RunTrace, *, steps: Steps = "warm") -> dict[int, float]:
    """``{step: seconds}``: latest end minus earliest start of the compute, wait and send events of
    each selected step over all ranks (the part of ``engine.step`` that the schedule describes)."""
    times = {}
    for i in _indices(run, steps):
        start, end = _span_ns(run, i)
        times[run.steps[i]] = (end - start) * _NS
    return times


def measured_step_time(run: RunTrace, *, steps: Steps = "warm") -> float:
    """The median over the selected steps of :func:`step_times`, in seconds: the lower of the two
    middle ones for an even count, so it is the time of a real step (:func:`typical_step`'s) rather
    than an average that a slow warm-up step can pull up."""
    return statistics.median_low(step_times(run, steps=steps).values())


def _compute_events(run: RunTrace, rank: int, i: int):
    """``(action, event)`` pairs of ``rank`` in step index ``i`` (the loader checked they align)."""
    return zip(run.schedule.ranks[rank], run.ranks[rank][i].of_kind("compute"))


MESSAGE_KINDS = ("send", "post")
"""Events of the runtime's own work for one message inside an action: posting a send, or the
receive of a unit ahead of the action that needs it."""


def _messages_inside(record: StepTrace) -> list[list[int]]:
    """Per compute event of one rank's step, in order: the nanoseconds of each send or post event
    inside it (one pass over both, sorted by start)."""
    computes = record.of_kind("compute")
    messages = sorted((e for e in record.events if e.kind in MESSAGE_KINDS), key=lambda e: e.start_ns)
    inside: list[list[int]] = [[] for _ in computes]
    k = 0
    for event in messages:
        while k < len(computes) and computes[k].end_ns < event.start_ns:
            k += 1
        if k < len(computes) and computes[k].start_ns <= event.start_ns and event.end_ns <= computes[k].end_ns:
            inside[k].append(event.end_ns - event.start_ns)
    return inside


def _duration_samples(run: RunTrace, steps: Steps, *, messages: bool = True) -> dict[TaskKey, list[int]]:
    """Nanosecond durations of every (stage, kind), over ranks, micro-batches and selected steps;
    ``messages=False`` leaves out the send and post events inside each action."""
    samples: dict[TaskKey, list[int]] = {task.key: [] for task in run.schedule.problem.tasks}
    for i in _indices(run, steps):
        for rank in range(run.world_size):
            inside = _messages_inside(run.ranks[rank][i]) if not messages else None
            for k, (action, event) in enumerate(_compute_events(run, rank, i)):
                own = sum(inside[k]) if inside is not None else 0
                for key, ns in _shares(run.schedule.problem, action, event.end_ns - event.start_ns - own):
                    samples[key].append(ns)
    return samples


def _shares(problem: Problem, action: Action | Overlap | Comm, ns: int) -> list[tuple[TaskKey, int]]:
    """The measured time of ``action`` per task it completes. A plain action is its task's sample. A
    composite one (an overlapped pair, a B standing for a split stage's I and W) is shared in the
    proportion of the model's own durations, scaled so that re-simulating the composite gives the
    measured time back: each task's model duration times ``ns / model``, the model being I + W, or
    a pair's priced time (F + B by default; its measured time is all the parts' own: no overlap overhead is
    fitted)."""
    assert type(action) is not Comm, action  # the loader matched each compute event to a compute action
    tasks = task_actions(problem, action)
    if len(tasks) == 1 and tasks[0] == action:
        return [(action.task, ns)]
    model = action_duration(problem, action, overlap_overhead=0.0)
    if model <= 0:
        return [(task.task, ns // len(tasks)) for task in tasks]
    scale = ns / model
    return [(task.task, round(problem.task(task.task).duration * scale)) for task in tasks]


def task_durations(run: RunTrace, *, steps: Steps = "warm", messages: bool = True) -> dict[TaskKey, float]:
    """``{(stage, kind): seconds}``: median duration of each task over ranks, micro-batches and
    the selected steps; a task with no event (none in a complete schedule) keeps 0.
    ``messages=False``: each action less the sends and receive posts it made (``send`` and
    ``post`` events inside it), its compute and own bookkeeping only."""
    return {key: statistics.median(ns) * _NS if ns else 0.0
            for key, ns in _duration_samples(run, steps, messages=messages).items()}


def message_cost(run: RunTrace, *, steps: Steps = "warm") -> float:
    """Mean seconds of the ``send`` and ``post`` events of the selected steps inside actions: what an
    action spends per message it sends or whose receive it posts (0 where there is none)."""
    durations = [ns for i in _indices(run, steps) for rank in range(run.world_size)
                 for inside in _messages_inside(run.ranks[rank][i]) for ns in inside]
    return statistics.fmean(durations) * _NS if durations else 0.0


def comm_latency_estimate(run: RunTrace, *, steps: Steps = "warm", mean: bool = False) -> float:
    """The communication latency, in seconds, that the simulator's model fits to the measured run.

    The simulator starts an action at ``max(rank free, dep end + latency)`` for a dep on another rank
    set. Where a single-rank action's cross-rank deps finished after its rank became free, the rank
    was waiting for them, so ``start - latest such dep end`` samples the latency (send, transfer,
    receive and launch overhead together). Returns the median sample (``mean=True``: the mean, which
    keeps the long waits a loaded machine adds now and then), clipped at 0; 0 without samples.
    """
    problem = run.schedule.problem
    cross = {task.key: [dep for dep in task.deps if set(problem.task(dep).ranks) != set(task.ranks)]
             for task in problem.tasks if len(task.ranks) == 1}
    samples = []
    for i in _indices(run, steps):
        ends: dict[Action, int] = {}
        for rank in range(run.world_size):
            for action, event in _compute_events(run, rank, i):
                for part in task_actions(problem, action):
                    ends[part] = max(ends.get(part, event.end_ns), event.end_ns)
        for rank in range(run.world_size):
            free = None
            for action, event in _compute_events(run, rank, i):
                deps = cross.get(action.task) if type(action) is Action else None  # composites: not sampled
                if deps:
                    arrived = max(ends[Action(stage, kind, action.microbatch)] for stage, kind in deps)
                    if free is None or arrived > free:
                        samples.append(event.start_ns - arrived)
                free = event.end_ns
    if not samples:
        return 0.0
    return max(0.0, (statistics.fmean(samples) if mean else statistics.median(samples)) * _NS)


# --------------------------------------------------------------------------------- timelines


def recosted_schedule(run: RunTrace, *, steps: Steps = "warm", comm_latency: float | None = None,
                      name: str | None = None) -> Schedule:
    """The run's schedule (same action lists, deps, memory and ranks) with each task's duration the
    measured median (seconds) and the comm latency :func:`comm_latency_estimate` unless given."""
    schedule = run.schedule
    durations = task_durations(run, steps=steps)
    latency = comm_latency_estimate(run, steps=steps) if comm_latency is None else comm_latency
    tasks = tuple(dataclasses.replace(task, duration=durations[task.key]) for task in schedule.problem.tasks)
    problem = dataclasses.replace(schedule.problem, tasks=tasks, comm_latency=latency)
    return dataclasses.replace(schedule, problem=problem, name=name or schedule.name)


def predicted_timeline(run: RunTrace, *, steps: Steps = "warm", comm_latency: float | None = None) -> Timeline:
    """:func:`pipeloom.simulate` of :func:`recosted_schedule`: the step the simulator predicts from
    the measured task times (its makespan is the predicted step time)."""
    name = f"{run.schedule.name} predicted"
    return simulate(recosted_schedule(run, steps=steps, comm_latency=comm_latency, name=name))


def typical_step(run: RunTrace, *, steps: Steps = "warm") -> int:
    """The selected step whose step time is the median (the lower of the two middle ones)."""
    times = step_times(run, steps=steps)
    ordered = sorted(times, key=lambda step: (times[step], step))
    return ordered[(len(ordered) - 1) // 2]


def measured_timeline(run: RunTrace, *, step: int | None = None, steps: Steps = "warm") -> Timeline:
    """The measured times of one step as a :class:`~pipeloom.Timeline` (seconds, 0 = the step's
    earliest compute, wait or send event), so every timeline view draws it.

    ``step`` defaults to :func:`typical_step`. Its schedule is :func:`recosted_schedule`; memory
    follows the action order exactly as in the simulator.
    """
    step = typical_step(run, steps=steps) if step is None else step
    return _measured_timeline(run, step, recosted_schedule(run, steps=steps))


def _measured_timeline(run: RunTrace, step: int, recosted: Schedule) -> Timeline:
    """:func:`measured_timeline` of ``step`` with ``recosted`` (:func:`recosted_schedule`)."""
    if step not in run.steps:
        raise StepSelectionError(f"step {step!r} is not in the trace; recorded steps: {_step_list(run.steps)}")
    i = run.steps.index(step)
    origin, _ = _span_ns(run, i)
    schedule = dataclasses.replace(recosted, name=f"{run.schedule.name} measured (step {step})")
    problem = schedule.problem
    starts, ends, memory, peaks = [], [], [], []
    for rank in range(run.world_size):
        events = [event for _, event in _compute_events(run, rank, i)]
        starts.append(tuple((e.start_ns - origin) * _NS for e in events))
        ends.append(tuple((e.end_ns - origin) * _NS for e in events))
        static = problem.static_memory[rank] if problem.static_memory else 0.0
        held = list(accumulate((action_memory(problem, a) for a in schedule.ranks[rank]), initial=static))
        memory.append(tuple(held[1:]))
        peaks.append(max(held))
    return Timeline(
        schedule=schedule, starts=tuple(starts), ends=tuple(ends), memory=tuple(memory),
        makespan=max((e[-1] for e in ends if e), default=0.0),
        busy=tuple(sum(e - s for s, e in zip(*pair)) for pair in zip(starts, ends)),
        peak_memory=tuple(peaks),
    )


# -------------------------------------------------------------------------------- comparison


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """A run's measured step next to the simulator's prediction from its measured task times."""

    run: RunTrace
    """The trace."""
    steps: tuple[int, ...]
    """The steps measured (medians and step time are over these)."""
    step: int
    """The step :attr:`measured` shows."""
    measured: Timeline
    """:func:`measured_timeline` of :attr:`step`."""
    predicted: Timeline
    """:func:`predicted_timeline`."""
    step_times: dict[int, float]
    """:func:`step_times` of :attr:`steps`."""

    @property
    def measured_step_time(self) -> float:
        """Median of :attr:`step_times` (the lower middle one: a real step's time), seconds."""
        return statistics.median_low(self.step_times.values())

    @property
    def ratio(self) -> float | None:
        """Measured / predicted step time; None when the prediction is 0."""
        predicted = self.predicted.makespan
        return self.measured_step_time / predicted if predicted > 0 else None

    @property
    def origin_ns(self) -> int:
        """The clock value that is time 0 of :attr:`measured`."""
        return _span_ns(self.run, self.run.steps.index(self.step))[0]


def compare_run(run: RunTrace, *, steps: Steps = "warm", step: int | None = None,
                comm_latency: float | None = None) -> Comparison:
    """Measure ``run`` over ``steps`` and predict its step; ``step`` picks the measured step shown."""
    selected = selected_steps(run, steps)
    times = step_times(run, steps=selected)
    step = typical_step(run, steps=selected) if step is None else step
    recosted = recosted_schedule(run, steps=selected, comm_latency=comm_latency)
    return Comparison(
        run=run, steps=selected, step=step, step_times=times,
        measured=_measured_timeline(run, step, recosted),
        predicted=simulate(dataclasses.replace(recosted, name=f"{run.schedule.name} predicted")),
    )


def per_step_idle(run: RunTrace, steps: Sequence[int], rank: int) -> float:
    """Mean over ``steps`` of the step time less ``rank``'s compute in that step (seconds): the same
    statistic as the busy, wait and send columns, so a rank's receive wait never exceeds its idle."""
    indices = _indices(run, steps)
    total = 0
    for i in indices:
        start, end = _span_ns(run, i)
        total += max(0, end - start - sum(e.end_ns - e.start_ns for e in run.ranks[rank][i].of_kind("compute")))
    return total * _NS / len(indices)


def per_step_mean(run: RunTrace, steps: Sequence[int], rank: int, kind: str) -> float:
    """Mean over ``steps`` of the seconds ``rank`` spent in events of ``kind`` per step."""
    indices = _indices(run, steps)
    total = sum(e.end_ns - e.start_ns for i in indices for e in run.ranks[rank][i].of_kind(kind))
    return total * _NS / len(indices)
