"""The simulator's replay engine: a schedule's lists compiled to task slots (:class:`CompiledSchedule`)
and run as soon as possible, with per-action time factors and release times where given; composite
actions (an overlapped pair, a full ``B`` on a split stage) complete several slots (docs/semantics.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate
from operator import add

from pipeloom.errors import DeadlockError, ScheduleError
from pipeloom.ir import (
    Action,
    Overlap,
    Schedule,
    compute_parts,
    format_grid,
    part_tasks,
    task_actions,
)
from pipeloom.sim_compile import compile_lists
from pipeloom.sim_pricing import Composite, Price, Pricing

__all__ = ["CompiledSchedule", "Run", "bubble_ratio"]


@dataclass(frozen=True, slots=True)
class Run:
    """One replay of a compiled schedule's lists: per rank and position, each action's start and end and the memory
    held right after it starts; per rank, its busy time and peak memory; the makespan."""

    starts: list[list[float]]
    ends: list[list[float]]
    held: list[tuple[float, ...]]
    busy: list[float]
    peaks: list[float]
    makespan: float


def bubble_ratio(busy: Sequence[float], makespan: float) -> float:
    """``1 - sum(busy) / (ranks * makespan)`` for each rank's ``busy`` time; 0 for an empty replay."""
    if makespan <= 0:
        return 0.0
    return 1.0 - sum(busy) / (len(busy) * makespan)


@dataclass(frozen=True, slots=True)
class CompiledSchedule:
    """A schedule's rank lists as task indices and dense micro-batches, ready to replay with any costs
    (:meth:`run`); a composite action (an overlapped pair, a B on a split stage) is index ``len(tasks) + k`` for
    ``composites[k]``, its micro-batch its first part's, as a task's is its own. Build it with
    :func:`compile_schedule`."""

    schedule: Schedule
    index: dict[tuple[int, str], int]
    seq_tasks: tuple[list, ...]
    seq_mbs: tuple[list, ...]
    dense: dict[int, int]
    composites: tuple[Composite, ...]
    """The composite actions' templates: each its parts' tasks and micro-batches, the first part's counted 0 and the
    others' from it (one template for every micro-batch where the lists use every micro-batch; one per action where
    they do not, as then the dense numbers do not keep the offsets). Its ``action`` is the first action met of the
    template, and its ``slots`` and ``links`` are not any action's: the replay's are :attr:`part_slots` and
    :attr:`deps`, which the first part's micro-batch shifts."""
    deps: tuple[tuple[tuple[int, bool], ...], ...]
    """Per task, then per composite, what it waits for (:class:`_Replay`): a slot (a task's: its index times the
    micro-batches; a composite's: its parts' dependencies outside it, less its first part's micro-batch,
    :meth:`~pipeloom.sim_pricing.Composite.links`), to which the hot loop adds the micro-batch, and whether it ran
    on another set of ranks (then the latency applies)."""
    part_slots: tuple[tuple[int, ...], ...]
    """Per composite, the slots it completes, less its first part's micro-batch (as :attr:`deps`)."""
    shapes: tuple[tuple[bool, tuple[tuple[int, ...], ...]], ...]
    """The composites' distinct shapes: whether a pair, and each part's task indices (what decides their costs)."""
    shape_of: tuple[int, ...]
    """Per composite, its shape's index in :attr:`shapes`."""
    pricing: Pricing
    """The schedule's own costs (what :meth:`makespan` and :meth:`action_scales` price)."""
    prices: tuple[Price, ...]
    """Per shape, its composites' costs under :attr:`pricing`."""
    numbers: tuple[int, ...]
    """Per replay number, the schedule's micro-batch (:attr:`dense` inverted)."""

    @classmethod
    def of(cls, schedule: Schedule, overhead: float) -> CompiledSchedule:
        problem = schedule.problem
        index = {task.key: i for i, task in enumerate(problem.tasks)}
        seq_tasks, seq_mbs, dense, composites, links = compile_lists(schedule, index)
        tasks, num_mb = problem.tasks, len(dense)
        deps = tuple(tuple((index[dep] * num_mb, set(tasks[index[dep]].ranks) != set(task.ranks)) for dep in task.deps)
                     for task in tasks) + tuple(external for external, _ in links)
        shapes: dict[tuple[bool, tuple[tuple[int, ...], ...]], int] = {}
        shape_of = tuple(shapes.setdefault(c.shape, len(shapes)) for c in composites)
        pricing = Pricing.of(problem, overhead)
        return cls(schedule, index, seq_tasks, seq_mbs, dense, composites, deps,
                   tuple(slots for _, slots in links), tuple(shapes), shape_of, pricing,
                   tuple(pricing.price(shape) for shape in shapes), tuple(sorted(dense, key=dense.__getitem__)))

    def check_same_lists(self, schedule: Schedule) -> None:
        """ScheduleError unless ``schedule`` has these lists over a problem with the same tasks (keys, dependencies,
        ranks) in the same order, whatever their costs: then :meth:`run` replays it with its costs."""
        problem, compiled = schedule.problem, self.schedule
        same_lists = schedule.ranks is compiled.ranks or schedule.ranks == compiled.ranks
        if not (same_lists and schedule.num_microbatches == compiled.num_microbatches
                and problem.num_ranks == compiled.problem.num_ranks
                and len(problem.tasks) == len(compiled.problem.tasks)
                and all((new.key, new.deps, new.ranks) == (old.key, old.deps, old.ranks)
                        for new, old in zip(problem.tasks, compiled.problem.tasks))):
            raise ScheduleError(f"schedule {schedule.name!r} is not the compiled one ({compiled.name!r}) with other "
                                "costs: its lists or its tasks differ; compile it instead (compile_schedule)")

    def run(self, pricing: Pricing, static: Sequence[float] | None = None) -> Run:
        """The lists replayed with ``pricing``'s costs (compiling them again, most of a replay's time for a
        schedule of overlapped pairs, is skipped; each composite priced once per shape), ``static`` memory held
        on each rank before any action (None: nothing); DeadlockError as :func:`~pipeloom.sim.simulate`."""
        prices = [pricing.price(shape) for shape in self.shapes]
        durations = self._durations(pricing, prices)
        memory = [*pricing.memory, *(prices[k].memory for k in self.shape_of)]
        replay = self._replay(durations, pricing.latency)
        held, peaks, busy = [], [], []
        for r, seq in enumerate(self.seq_tasks):
            # accumulate/reduce add in list order, exactly like a running sum.
            rank_held = list(accumulate(map(memory.__getitem__, seq), initial=static[r] if static else 0.0))
            held.append(tuple(rank_held[1:]))
            peaks.append(max(rank_held))
            busy.append(reduce(add, map(durations.__getitem__, seq), 0.0))
        return Run(replay.starts, replay.ends, held, busy, peaks, replay.makespan)

    def scale(self, t: int, first: int, factors: list[float]) -> float:
        """The factor on composite ``t``'s duration when each (task, micro-batch) has its own factor, its first
        part's micro-batch numbered ``first`` in the replay."""
        k = t - len(self.index)
        price = self.prices[self.shape_of[k]]
        if price.duration <= 0:
            return 1.0
        num_mb, dense = len(self.dense), self.dense
        start = self.numbers[first]
        scaled = self.composites[k].scaled(price, self.pricing.durations,
                                           lambda task, mb: factors[task * num_mb + dense[start + mb]])
        return scaled / price.duration

    @property
    def num_slots(self) -> int:
        """Micro-batches the lists use (numbered 0..num_slots-1 in a replay): a per-(task, micro-batch)
        factor list holds ``num_tasks * num_slots`` entries, task-major."""
        return len(self.dense)

    def action_scales(self, factors: list[float]) -> list[list[float]]:
        """Per rank, per position: the factor on that action's duration when (task t, micro-batch slot
        k) has ``factors[t * num_slots + k]`` (a composite action: the factor its parts give it)."""
        num_tasks, num_mb = len(self.index), len(self.dense)
        return [[factors[t * num_mb + mb] if t < num_tasks else self.scale(t, mb, factors) for t, mb in zip(seq, mbs)]
                for seq, mbs in zip(self.seq_tasks, self.seq_mbs)]

    def makespan(self, scales: list | None = None, release: list | None = None) -> float:
        """The makespan of one replay with the schedule's own costs (``scales`` from :meth:`action_scales`;
        ``release``: the time each rank may begin); DeadlockError as :func:`~pipeloom.sim.simulate`."""
        return self._replay(self._durations(self.pricing, self.prices), self.pricing.latency, scales, release).makespan

    def _durations(self, pricing: Pricing, prices: Sequence[Price]) -> list[float]:
        """Per task then per composite, its duration under ``pricing`` (``prices``: its composites' per shape)."""
        return [*pricing.durations, *(prices[k].duration for k in self.shape_of)]

    def _replay(self, durations: list[float], latency: float, scales: list | None = None,
                release: list | None = None) -> _Replay:
        """The replay run to the end with ``durations`` per task then per composite; DeadlockError naming each
        stuck rank's head action when the lists cannot finish."""
        problem = self.schedule.problem
        replay = _Replay(self, durations, latency, scales, release)
        replay.run()
        stuck = [r for r in range(problem.num_ranks) if replay.pos[r] < len(self.seq_tasks[r])]
        if stuck:
            raise DeadlockError(_deadlock_message(self.schedule, replay.pos, stuck, replay.finish, self.dense,
                                                  self.index))
        return replay


class _Replay:
    """The event replay: every rank runs its list as far as it can, parking when blocked.

    A slot is ``task * num_mb + microbatch``, micro-batches numbered densely by
    :func:`~pipeloom.sim_compile.compile_lists` (``num_mb`` counts those the lists use). A rank blocked on a
    dep parks on that dep's slot; a rank blocked on a multi-rank action parks on the other rank that has not
    reached it yet.
    """

    def __init__(self, compiled: CompiledSchedule, durations: list[float], latency: float, scales=None,
                 release=None) -> None:
        tasks, num_ranks = compiled.schedule.problem.tasks, compiled.schedule.problem.num_ranks
        self.scales = scales  # per rank, per position: a factor on that single-rank action's duration
        self.num_mb, self.latency = len(compiled.dense), latency
        self.seq_tasks, self.seq_mbs = compiled.seq_tasks, compiled.seq_mbs
        self.durations = durations  # per task, then per composite
        self.rank_sets = [task.ranks for task in tasks]
        self.num_tasks = len(tasks)
        self.single = [len(task.ranks) == 1 for task in tasks] + [False] * len(compiled.composites)
        self.deps = compiled.deps
        self.part_slots = compiled.part_slots
        self.finish: list[float | None] = [None] * (len(compiled.deps) * self.num_mb)
        self.waiters: list[list[int] | None] = [None] * len(self.finish)
        self.starts = [[0.0] * len(seq) for seq in self.seq_tasks]
        self.ends = [[0.0] * len(seq) for seq in self.seq_tasks]
        self.pos = [0] * num_ranks
        self.free = list(release) if release is not None else [0.0] * num_ranks
        self.waiting_on_rank: list[list[int]] = [[] for _ in range(num_ranks)]
        self.todo = list(range(num_ranks))

    @property
    def makespan(self) -> float:
        """The latest end over the ranks' lists (each rank's last action ends last)."""
        return max((e[-1] for e in self.ends if e), default=0.0)

    def run(self) -> None:
        """Advance ranks until none can move (the hot loop: locals only, no per-action objects)."""
        num_mb, deps, finish, waiters = self.num_mb, self.deps, self.finish, self.waiters
        durations, single, todo, latency = self.durations, self.single, self.todo, self.latency
        while todo:
            r = todo.pop()
            seq, mbs, i, n = self.seq_tasks[r], self.seq_mbs[r], self.pos[r], len(self.seq_tasks[r])
            rank_starts, rank_ends = self.starts[r], self.ends[r]
            scale = self.scales[r] if self.scales is not None else None
            now = self.free[r]
            while i < n:
                t, mb = seq[i], mbs[i]
                start, blocked = now, -1
                for base, cross in deps[t]:
                    done = finish[base + mb]
                    if done is None:
                        blocked = base + mb
                        break
                    if cross:
                        done += latency
                    if done > start:  # noqa: PLR1730 - a call to max() costs more here
                        start = done
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
                    end = self._composite(t, mb, start, None if scale is None else scale[i])
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

    def _composite(self, t: int, mb: int, start: float, factor: float | None) -> float:
        """The end of composite action ``t`` of first micro-batch ``mb`` started at ``start`` (its duration times
        ``factor`` when given): every part's slot ends with it, and the ranks waiting on them may move."""
        end = start + (self.durations[t] if factor is None else self.durations[t] * factor)
        waiters = self.waiters
        for base in self.part_slots[t - self.num_tasks]:
            slot = base + mb
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

    ``dense`` maps a micro-batch to its replay number (see :func:`~pipeloom.sim_compile.compile_lists`).
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
