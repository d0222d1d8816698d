"""Event simulation of a schedule with the time and memory semantics of DESIGN §3.

``simulate(schedule)`` replays every rank's list in order and returns a :class:`Timeline`:
start/end of each action, per-rank memory held, makespan, bubble ratio, busy time and peaks.
A lowered schedule's communication takes its own time (:mod:`pipeloom.lowering.replay`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import reduce
from importlib import import_module
from itertools import accumulate
from operator import add, itemgetter
from typing import Any

from pipeloom.errors import DeadlockError, ProblemError, ScheduleError, require_type
from pipeloom.ir import Action, Comm, Overlap, Schedule, compute_parts, format_grid, part_tasks, task_actions
from pipeloom.lowering import replay_lowered
from pipeloom.problem import Problem
from pipeloom.sim_composite import Composite, composite_of

__all__ = ["CompiledSchedule", "Timeline", "compile_schedule", "simulate"]

# Applied to plain actions only (Action or Comm tuples: ``_compile`` rules out an Overlap first).
_TASK_KEY: Callable[[Any], tuple[int, str]] = itemgetter(0, 1)
_MICROBATCH: Callable[[Any], int] = itemgetter(2)


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
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_ranks * self.makespan)

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


def simulate(schedule: Schedule, *, overlap_overhead: float | None = None) -> Timeline:
    """Replay ``schedule``: each rank runs its list in order, one action at a time.

    An action starts at the latest of its ranks becoming free and each dep's finish (plus the
    communication latency when the dep ran on another set of ranks). In a lowered schedule the
    receives carry that latency instead (see :mod:`pipeloom.lowering.replay`). An overlapped pair
    (and a full ``B`` on a split stage) is one action: it starts when every part's deps are met and
    takes ``max(forward, backward) + overlap_overhead`` (I + W); ``overlap_overhead`` None: the
    problem's (docs/semantics.md). Raises DeadlockError when the lists cannot run to the end; use
    :func:`pipeloom.validate.validate` for full checks.
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
    compiled = CompiledSchedule.of(schedule, overhead)
    seq_tasks = compiled.seq_tasks
    replay = compiled.replay()
    starts, ends = replay.starts, replay.ends
    static = problem.static_memory or (0.0,) * problem.num_ranks
    memory_delta = [task.memory for task in problem.tasks] + [c.memory for c in compiled.composites]
    durations = [task.duration for task in problem.tasks] + [c.duration for c in compiled.composites]
    held_lists, peaks, busy = [], [], []
    for r, seq in enumerate(seq_tasks):
        # accumulate/reduce add in list order, exactly like a running sum.
        held = list(accumulate(map(memory_delta.__getitem__, seq), initial=static[r]))
        held_lists.append(tuple(held[1:]))
        peaks.append(max(held))
        busy.append(reduce(add, map(durations.__getitem__, seq), 0.0))
    makespan = replay.makespan
    _check_finite(schedule, makespan, busy, peaks)
    return Timeline(
        schedule=schedule,
        starts=tuple(map(tuple, starts)),
        ends=tuple(map(tuple, ends)),
        memory=tuple(held_lists),
        makespan=makespan,
        busy=tuple(busy),
        peak_memory=tuple(peaks),
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


@dataclass(frozen=True, slots=True)
class CompiledSchedule:
    """A schedule's rank lists as task indices and dense micro-batches, ready to replay; a composite
    action (an overlapped pair, a B on a split stage) is index ``len(tasks) + k`` for ``composites[k]``.
    Build it with :func:`compile_schedule`."""

    schedule: Schedule
    index: dict[tuple[int, str], int]
    seq_tasks: tuple[list, ...]
    seq_mbs: tuple[list, ...]
    dense: dict[int, int]
    composites: tuple[Composite, ...]

    @classmethod
    def of(cls, schedule: Schedule, overhead: float) -> CompiledSchedule:
        problem = schedule.problem
        index = {task.key: i for i, task in enumerate(problem.tasks)}
        found: dict = {}
        seq_tasks, seq_mbs = zip(*(_compile(schedule, r, index, overhead, found) for r in range(problem.num_ranks)))
        composites = tuple(composite for _, composite in found.values())
        extra = {mb for c in composites for unit in c.units for _, mb in unit}
        seq_mbs, dense = _densify(seq_mbs, schedule.num_microbatches, extra)
        return cls(schedule, index, seq_tasks, seq_mbs, dense, composites)

    def scale(self, t: int, factors: list[float]) -> float:
        """The factor on composite ``t``'s duration when each (task, micro-batch) has its own factor."""
        composite = self.composites[t - len(self.index)]
        if composite.duration <= 0:
            return 1.0
        num_mb, durations = len(self.dense), [task.duration for task in self.schedule.problem.tasks]
        scaled = composite.scaled(durations, lambda task, mb: factors[task * num_mb + self.dense[mb]])
        return scaled / composite.duration

    @property
    def num_slots(self) -> int:
        """Micro-batches the lists use (numbered 0..num_slots-1 in a replay): a per-(task, micro-batch)
        factor list holds ``num_tasks * num_slots`` entries, task-major."""
        return len(self.dense)

    def action_scales(self, factors: list[float]) -> list[list[float]]:
        """Per rank, per position: the factor on that action's duration when (task t, micro-batch slot
        k) has ``factors[t * num_slots + k]`` (a composite action: the factor its parts give it)."""
        num_tasks, num_mb = len(self.index), len(self.dense)
        return [[factors[t * num_mb + mb] if t < num_tasks else self.scale(t, factors) for t, mb in zip(seq, mbs)]
                for seq, mbs in zip(self.seq_tasks, self.seq_mbs)]

    def makespan(self, scales: list | None = None, release: list | None = None) -> float:
        """The makespan of one replay (``scales`` from :meth:`action_scales`; ``release``: the time each
        rank may begin); DeadlockError as :func:`simulate`."""
        return self.replay(scales, release).makespan

    def replay(self, scales: list | None = None, release: list | None = None) -> _Replay:
        """The replay run to the end (``scales``: a factor per single-rank action; ``release``: the
        time each rank may begin); DeadlockError naming each stuck rank's head action when the lists
        cannot finish."""
        problem = self.schedule.problem
        replay = _Replay(problem, len(self.dense), self.seq_tasks, self.seq_mbs, scales, release)
        replay.add_composites(self.composites, self.dense)
        replay.run()
        stuck = [r for r in range(problem.num_ranks) if replay.pos[r] < len(self.seq_tasks[r])]
        if stuck:
            raise DeadlockError(_deadlock_message(self.schedule, replay.pos, stuck, replay.finish, self.dense,
                                                  self.index))
        return replay


def _compile(schedule: Schedule, rank: int, index: dict[tuple[int, str], int], overhead: float,
             found: dict) -> tuple[list, list]:
    """Task indices and micro-batches of ``rank``'s list (C-level maps: no per-action Python code,
    unless the list holds composite actions, which get indices after the tasks' in ``found``)."""
    actions = schedule.ranks[rank]
    tasks: list[int | None]
    mbs: list[int]
    if Overlap in set(map(type, actions)):
        tasks, mbs = [None] * len(actions), [0] * len(actions)
    else:
        tasks = list(map(index.get, map(_TASK_KEY, actions)))
        mbs = list(map(_MICROBATCH, actions))
    if None in tasks:
        for i, action in enumerate(actions):
            if tasks[i] is None:
                tasks[i], mbs[i] = _composite_index(schedule, index, action, overhead, found)
    if None in tasks or (mbs and (min(mbs) < 0 or max(mbs) >= schedule.num_microbatches)):
        step = next(
            i for i, (t, mb) in enumerate(zip(tasks, mbs))
            if t is None or not 0 <= mb < schedule.num_microbatches
        )
        raise ScheduleError(
            f"rank {rank} step {step}: {actions[step]} is not a task of this schedule's problem "
            "(run the validator for details)"
        )
    return tasks, mbs


def _composite_index(schedule: Schedule, index: dict, action, overhead: float, found: dict) -> tuple[int | None, int]:
    """``(index, micro-batch)`` of a composite action (the first part's micro-batch; its parts' are
    checked), or ``(None, 0)`` when ``action`` is none of the problem's."""
    if action in found:
        k, composite = found[action]
        return len(index) + k, _first_mb(composite)
    if type(action) not in (Action, Overlap):
        return None, 0
    composite = composite_of(schedule.problem, index, action, overhead)
    if composite is None:
        return None, 0
    if not all(0 <= mb < schedule.num_microbatches for unit in composite.units for _, mb in unit):
        return None, -1
    found[action] = (len(found), composite)
    return len(index) + len(found) - 1, _first_mb(composite)


def _first_mb(composite: Composite) -> int:
    return composite.units[0][0][1]


def _densify(seq_mbs: tuple[list[int], ...], num_mb: int,
             extra: Iterable[int] = frozenset()) -> tuple[tuple[list[int], ...], dict[int, int]]:
    """Renumber the micro-batches the lists use (and ``extra``: composite parts') as 0..K-1
    (K <= actions) and return that map.

    The replay keeps one slot per (task, micro-batch); a micro-batch no action names has no slot
    anyone waits on, so a schedule claiming M = 10**12 costs memory by its actions, not by M.
    """
    used = sorted(set(extra).union(*map(set, seq_mbs)))
    if len(used) == num_mb:  # every micro-batch appears (a complete schedule): keep the numbers
        return seq_mbs, dict(zip(used, used))
    dense = {mb: i for i, mb in enumerate(used)}
    return tuple(list(map(dense.__getitem__, mbs)) for mbs in seq_mbs), dense


class _Replay:
    """The event replay: every rank runs its list as far as it can, parking when blocked.

    A slot is ``task * num_mb + microbatch``, micro-batches numbered densely by :func:`_densify`
    (``num_mb`` counts those the lists use). A rank blocked on a dep parks on that dep's slot; a
    rank blocked on a multi-rank action parks on the other rank that has not reached it yet.
    """

    def __init__(self, problem: Problem, num_mb: int, seq_tasks, seq_mbs, scales=None, release=None) -> None:
        tasks = problem.tasks
        self.scales = scales  # per rank, per position: a factor on that single-rank action's duration
        index = {task.key: i for i, task in enumerate(tasks)}
        self.num_mb = num_mb
        self.seq_tasks, self.seq_mbs = seq_tasks, seq_mbs
        self.durations = [task.duration for task in tasks]
        self.rank_sets = [task.ranks for task in tasks]
        self.single = [len(task.ranks) == 1 for task in tasks]
        # (dep slot base, latency): latency only when the dep ran on another set of ranks.
        self.deps = [
            tuple(
                (index[dep] * num_mb,
                 0.0 if set(tasks[index[dep]].ranks) == set(task.ranks) else problem.comm_latency)
                for dep in task.deps
            )
            for task in tasks
        ]
        self.finish: list[float | None] = [None] * (len(tasks) * num_mb)
        self.waiters: list[list[int] | None] = [None] * len(self.finish)
        self.starts = [[0.0] * len(seq) for seq in seq_tasks]
        self.ends = [[0.0] * len(seq) for seq in seq_tasks]
        self.pos = [0] * problem.num_ranks
        self.free = list(release) if release is not None else [0.0] * problem.num_ranks
        self.waiting_on_rank: list[list[int]] = [[] for _ in range(problem.num_ranks)]
        self.todo = list(range(problem.num_ranks))
        self.num_tasks = len(tasks)
        self.part_slots: list[tuple[int, ...]] = []

    def add_composites(self, composites: tuple[Composite, ...], dense: dict[int, int]) -> None:
        """Index ``num_tasks + k`` runs ``composites[k]``: its deps are those of its parts outside it
        (stored against its first part's micro-batch, as the hot loop reads them), its own slot is
        a placeholder, and finishing it finishes every part's slot."""
        num_mb = self.num_mb
        for composite in composites:
            first = dense[composite.units[0][0][1]]
            external = composite.external_deps(self.deps, num_mb, dense)
            self.deps.append(tuple((slot - first, lat) for slot, lat in external))
            self.durations.append(composite.duration)
            self.single.append(False)
            self.rank_sets.append(())
            self.part_slots.append(composite.slots(num_mb, dense))
        self.finish.extend([None] * (len(composites) * num_mb))
        self.waiters.extend([None] * (len(composites) * num_mb))

    @property
    def makespan(self) -> float:
        """The latest end over the ranks' lists (each rank's last action ends last)."""
        return max((e[-1] for e in self.ends if e), default=0.0)

    def run(self) -> None:
        """Advance ranks until none can move (the hot loop: locals only, no per-action objects)."""
        num_mb, deps, finish, waiters = self.num_mb, self.deps, self.finish, self.waiters
        durations, single, todo = self.durations, self.single, self.todo
        while todo:
            r = todo.pop()
            seq, mbs, i, n = self.seq_tasks[r], self.seq_mbs[r], self.pos[r], len(self.seq_tasks[r])
            rank_starts, rank_ends = self.starts[r], self.ends[r]
            scale = self.scales[r] if self.scales is not None else None
            now = self.free[r]
            while i < n:
                t, mb = seq[i], mbs[i]
                start, blocked = now, -1
                for base, lat in deps[t]:
                    done = finish[base + mb]
                    if done is None:
                        blocked = base + mb
                        break
                    if done + lat > start:  # noqa: PLR1730 - a call to max() costs more here
                        start = done + lat
                if blocked >= 0:
                    waiting = waiters[blocked]
                    if waiting is None:
                        waiters[blocked] = [r]
                    else:
                        waiting.append(r)
                    break
                slot = t * num_mb + mb
                if single[t]:
                    end = start + (durations[t] if scale is None else durations[t] * scale[i])
                elif t >= self.num_tasks:
                    end = self._composite(t, start, None if scale is None else scale[i])
                else:
                    joined = self._join(r, t, slot, start)
                    if joined is None:
                        break
                    start, end = joined
                rank_starts[i], rank_ends[i] = start, end
                now = end
                i += 1
                finish[slot] = end
                if waiters[slot] is not None:
                    todo.extend(waiters[slot])
                    waiters[slot] = None
            if i != self.pos[r]:
                self.pos[r], self.free[r] = i, now
                self._wake(r)

    def _composite(self, t: int, start: float, factor: float | None) -> float:
        """The end of composite action ``t`` started at ``start`` (its duration times ``factor`` when
        given): every part's slot ends with it, and the ranks waiting on them may move."""
        end = start + (self.durations[t] if factor is None else self.durations[t] * factor)
        waiters = self.waiters
        for slot in self.part_slots[t - self.num_tasks]:
            self.finish[slot] = end
            waiting = waiters[slot]
            if waiting is not None:
                self.todo.extend(waiting)
                waiters[slot] = None
        return end

    def _join(self, r: int, t: int, slot: int, start: float) -> tuple[float, float] | None:
        """Run multi-rank action ``slot`` on all its ranks if each has it at its head, else None."""
        pos, ranks = self.pos, self.rank_sets[t]
        for q in ranks:
            if q != r and (pos[q] >= len(self.seq_tasks[q])
                           or self.seq_tasks[q][pos[q]] * self.num_mb + self.seq_mbs[q][pos[q]] != slot):
                self.waiting_on_rank[q].append(r)
                return None
        for q in ranks:
            if q != r and self.free[q] > start:
                start = self.free[q]
        end = start + self.durations[t]
        for q in ranks:
            if q != r:
                self.starts[q][pos[q]], self.ends[q][pos[q]] = start, end
                pos[q] += 1
                self.free[q] = end
                self.todo.append(q)
                self._wake(q)
        return start, end

    def _wake(self, q: int) -> None:
        """Ranks parked on rank ``q`` (waiting for it to reach a shared action) may move again."""
        if self.waiting_on_rank[q]:
            self.todo.extend(self.waiting_on_rank[q])
            self.waiting_on_rank[q].clear()


def _deadlock_message(
    schedule: Schedule,
    pos: list[int],
    stuck: list[int],
    finish: list[float | None],
    dense: dict[int, int],
    index: dict[tuple[int, str], int],
) -> str:
    """Name each stuck rank's head action and what it waits for, then show the grid.

    ``dense`` maps a micro-batch to its replay number (see :func:`_densify`).
    """
    problem = schedule.problem
    reasons = []
    for r in stuck:
        action = schedule.ranks[r][pos[r]]
        parts = task_actions(problem, action)
        missing: list[str] = []
        ranks: set[int] = set()
        for whole in compute_parts(action):
            own = part_tasks(problem, whole)  # a B on a split stage: its W waits for its own I
            for part in own:
                task = problem.tasks[index[part.task]]
                ranks.update(task.ranks)
                missing += [f"{dep[0]}{dep[1]}{part.microbatch}" for dep in task.deps
                            if Action(dep[0], dep[1], part.microbatch) not in own
                            and finish[index[dep] * len(dense) + dense[part.microbatch]] is None]
        if missing:
            why = "waits for " + ", ".join(dict.fromkeys(missing)) + ", which never runs first"
            if type(action) is Overlap and set(missing) & {str(p) for p in parts}:
                why += " (the parts of an overlapped pair run at once: neither may depend on the other)"
        else:
            why = "waits for ranks " + ", ".join(str(q) for q in sorted(ranks) if q != r) + " to reach it too"
        reasons.append(f"rank {r} step {pos[r]}: {action} {why}")
    first = stuck[0]
    return (
        f"deadlock in schedule {schedule.name!r}: "
        + "; ".join(reasons[:4])
        + ("; ..." if len(reasons) > 4 else "")
        + "\n"
        + format_grid(schedule.ranks, mark=(first, pos[first]))
    )


def __getattr__(name: str) -> object:
    """``pipeloom.sim.expected_makespan`` and ``starting_ranks``, which moved to
    :mod:`pipeloom.plan.noise`, still import from here (looked up by name on first use: the planner
    sits above the simulator)."""
    if name in ("expected_makespan", "starting_ranks"):
        return getattr(import_module("pipeloom.plan.noise"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
