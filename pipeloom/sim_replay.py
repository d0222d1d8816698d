"""The simulator's replay engine: a schedule's lists compiled to task slots (:class:`CompiledSchedule`)
and run as soon as possible, with per-action time factors and release times where given; composite
actions (an overlapped pair, a full ``B`` on a split stage) complete several slots (docs/semantics.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Any

from pipeloom.errors import DeadlockError, ScheduleError
from pipeloom.ir import (
    Action,
    Overlap,
    Schedule,
    compute_parts,
    format_grid,
    pair_duration,
    part_tasks,
    task_actions,
)
from pipeloom.problem import Problem

__all__ = ["CompiledSchedule", "Composite", "composite_of"]

# Applied to plain actions only (Action or Comm tuples: ``_compile`` rules out an Overlap first).
_TASK_KEY: Callable[[Any], tuple[int, str]] = itemgetter(0, 1)
_MICROBATCH: Callable[[Any], int] = itemgetter(2)


@dataclass(frozen=True, slots=True)
class Composite:
    """One composite action: its parts as task indices and micro-batches, its time and memory."""

    action: Action | Overlap
    """The action as the schedule writes it."""
    units: tuple[tuple[tuple[int, int], ...], ...]
    """Per part (forward, backward), the ``(task index, micro-batch)`` it completes, in order."""
    overlapped: bool
    """Whether the parts run overlapped (a pair: the longer one counts) or one after the other."""
    overhead: float
    """Time added to an overlapped pair (see :func:`~pipeloom.ir.pair_duration`)."""
    duration: float
    """The time it occupies its rank."""
    memory: float
    """The sum of its tasks' memory changes (applied when it starts)."""
    comms: tuple[float, ...] = ()
    """Per part, the communication inside its tasks' durations (a pair may hide it)."""
    fraction: float = 0.0
    """The problem's ``overlap_fraction`` (a pair only)."""
    measured: bool = False
    """Whether it is a pair of the problem's measured ``pair_time`` (``duration``)."""

    def scaled(self, durations: list[float], factor: Callable[[int, int], float]) -> float:
        """Its duration with each task's time multiplied by ``factor(task index, micro-batch)``; a pair
        of measured time scales that time as its parts' sum, its communication as its part."""
        base = [sum(durations[t] for t, _ in unit) for unit in self.units]
        times = [sum(durations[t] * factor(t, mb) for t, mb in unit) for unit in self.units]
        if not self.overlapped:
            return sum(times)
        ratios = [time / b if b > 0 else 1.0 for time, b in zip(times, base, strict=True)]
        if self.measured:
            return self.duration * (sum(times) / sum(base) if sum(base) > 0 else 1.0)
        comms = (self.comms[0] * ratios[0], self.comms[1] * ratios[1])
        return pair_duration((times[0], times[1]), comms, fraction=self.fraction, overhead=self.overhead)

    def slots(self, num_mb: int, dense: Mapping[int, int]) -> tuple[int, ...]:
        """The replay slots (task x micro-batch) it completes."""
        return tuple(t * num_mb + dense[mb] for unit in self.units for t, mb in unit)


def composite_of(problem: Problem, index: Mapping[tuple[int, str], int], action: Action | Overlap,
                 overhead: float) -> Composite | None:
    """``action`` as a composite of ``problem``, or None when one of its parts names no task."""
    units: list[tuple[tuple[int, int], ...]] = []
    for part in compute_parts(action):
        unit: list[tuple[int, int]] = []
        for task in part_tasks(problem, part):
            i = index.get(task.task)
            if i is None:
                return None
            unit.append((i, task.microbatch))
        units.append(tuple(unit))
    overlapped = type(action) is Overlap
    parts = [[t for t, _ in unit] for unit in units]
    return Composite(action, tuple(units), overlapped, *_prices(parts, overlapped, problem, overhead))


def _prices(parts: Sequence[Sequence[int]], overlapped: bool, problem: Problem,
            overhead: float) -> tuple[float, float, float, tuple[float, ...], float, bool]:
    """A composite's fields that ``problem``'s costs decide (``overhead`` through ``measured``, in field order)
    from its parts' task indices (not their micro-batches): the parts' durations summed (a pair's as
    :func:`~pipeloom.ir.action_duration` prices it), their communication and memory changes."""
    tasks = problem.tasks
    times = tuple(sum(tasks[t].duration for t in part) for part in parts)
    comms = tuple(sum(tasks[t].comm for t in part) for part in parts)
    memory = sum(tasks[t].memory for part in parts for t in part)
    if not overlapped:
        return 0.0, sum(times), memory, comms, 0.0, False
    measured = problem.pair_time
    duration = measured if measured is not None else pair_duration(
        (times[0], times[1]), (comms[0], comms[1]), fraction=problem.overlap_fraction, overhead=overhead)
    return overhead, duration, memory, comms, problem.overlap_fraction, measured is not None


def _links(problem: Problem, index: Mapping[tuple[int, str], int], composite: Composite, num_mb: int,
           dense: Mapping[int, int]) -> tuple[tuple[tuple[int, bool], ...], tuple[int, ...]]:
    """What a replay needs of ``composite`` besides its costs: every dependency of its tasks outside its own part
    (a W waits for the I of its own B; a pair's parts do not wait for each other: one that depends on the other
    never starts, the validator reports it as a deadlock), as its slot less the composite's first part's
    micro-batch (the hot loop adds the micro-batch) and whether it ran on other ranks (then the problem's
    latency applies); and the slots it completes."""
    tasks = problem.tasks
    first = dense[composite.units[0][0][1]]
    found: dict[int, bool] = {}
    for unit in composite.units:
        inside = {t * num_mb + dense[mb] for t, mb in unit}
        for t, mb in unit:
            for dep in tasks[t].deps:
                slot = index[dep] * num_mb + dense[mb]
                if slot not in inside:
                    found[slot] = found.get(slot, False) or set(tasks[index[dep]].ranks) != set(tasks[t].ranks)
    return tuple((slot - first, cross) for slot, cross in found.items()), composite.slots(num_mb, dense)


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
    links: tuple[tuple[tuple[tuple[int, bool], ...], tuple[int, ...]], ...]
    """Per composite, its dependencies outside it and the slots it completes (:func:`_links`)."""
    shapes: tuple[tuple[bool, tuple[tuple[int, ...], ...]], ...]
    """The composites' distinct shapes: whether a pair, and each part's task indices (what decides their costs)."""
    shape_of: tuple[int, ...]
    """Per composite, its shape's index in :attr:`shapes`."""

    @classmethod
    def of(cls, schedule: Schedule, overhead: float) -> CompiledSchedule:
        problem = schedule.problem
        index = {task.key: i for i, task in enumerate(problem.tasks)}
        found: dict = {}
        seq_tasks, seq_mbs = zip(*(_compile(schedule, r, index, overhead, found) for r in range(problem.num_ranks)))
        composites = tuple(composite for _, composite in found.values())
        extra = {mb for c in composites for unit in c.units for _, mb in unit}
        seq_mbs, dense = _densify(seq_mbs, schedule.num_microbatches, extra)
        links = tuple(_links(problem, index, c, len(dense), dense) for c in composites)
        shapes: dict[tuple[bool, tuple[tuple[int, ...], ...]], int] = {}
        shape_of = tuple(shapes.setdefault((c.overlapped, tuple(tuple(t for t, _ in unit) for unit in c.units)),
                                           len(shapes)) for c in composites)
        return cls(schedule, index, seq_tasks, seq_mbs, dense, composites, links, tuple(shapes), shape_of)

    def repriced(self, schedule: Schedule, overhead: float) -> CompiledSchedule:
        """This compilation for ``schedule``: the same lists over a problem with the same tasks (keys,
        dependencies, ranks) in the same order, its costs (durations, communication, memory, how pairs are
        priced) replacing these; compiling the lists again, most of a replay's time for a schedule of overlapped
        pairs, is skipped. ScheduleError when the lists or the tasks differ."""
        problem, compiled = schedule.problem, self.schedule
        same_lists = schedule.ranks is compiled.ranks or schedule.ranks == compiled.ranks
        if not (same_lists and schedule.num_microbatches == compiled.num_microbatches
                and len(problem.tasks) == len(compiled.problem.tasks)
                and all((new.key, new.deps, new.ranks) == (old.key, old.deps, old.ranks)
                        for new, old in zip(problem.tasks, compiled.problem.tasks))):
            raise ScheduleError(f"schedule {schedule.name!r} is not the compiled one ({compiled.name!r}) with other "
                                "costs: its lists or its tasks differ; compile it instead (compile_schedule)")
        prices = [_prices(parts, overlapped, problem, overhead if overlapped else 0.0)
                  for overlapped, parts in self.shapes]
        composites = tuple(Composite(c.action, c.units, c.overlapped, *prices[k])
                           for c, k in zip(self.composites, self.shape_of))
        return replace(self, schedule=schedule, composites=composites)

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
        replay.add_composites(self.composites, self.links)
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
        self.num_mb, self.latency = num_mb, problem.comm_latency
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

    def add_composites(self, composites: tuple[Composite, ...],
                       links: tuple[tuple[tuple[tuple[int, bool], ...], tuple[int, ...]], ...]) -> None:
        """Index ``num_tasks + k`` runs ``composites[k]``: its deps are those of its parts outside it
        (``links[k]``, stored against its first part's micro-batch, as the hot loop reads them), its own slot
        is a placeholder, and finishing it finishes every part's slot."""
        latency = self.latency
        for composite, (external, slots) in zip(composites, links, strict=True):
            self.deps.append(tuple((slot, latency if cross else 0.0) for slot, cross in external))
            self.durations.append(composite.duration)
            self.single.append(False)
            self.rank_sets.append(())
            self.part_slots.append(slots)
        self.finish.extend([None] * (len(composites) * self.num_mb))
        self.waiters.extend([None] * (len(composites) * self.num_mb))

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
