"""The problem model: per-micro-batch tasks on ranks (docs/design.md §1; the stage-graph builder is
:mod:`pipeloom.stages`).

Every micro-batch runs the same small DAG of tasks. A ``Problem`` holds that DAG plus the
machine facts a schedule is judged against (ranks, communication latency, memory limit).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pipeloom import graph
from pipeloom.errors import ProblemError

__all__ = [
    "KINDS",
    "Kind",
    "TaskKey",
    "Task",
    "Problem",
    "task_name",
    "parse_task_name",
]

Kind = Literal["F", "B", "I", "W"]
KINDS: tuple[str, ...] = ("F", "B", "I", "W")
TaskKey = tuple[int, str]
"""A task is named by (stage, kind); its text form is ``f"{stage}{kind}"``, e.g. ``2F``."""

_TASK_NAME = re.compile(r"^(\d+)([FBIW])$")
MAX_INTERVALS = 10_000_000
"""The most (task, micro-batch) intervals (= actions of the schedule) a problem is expanded to:
:func:`pipeloom.search.search` refuses more before building anything, and ``pipeloom show`` and
``compare`` refuse to build a larger schedule (one that size already takes gigabytes to
hold and simulate). Kept here, not with the search, so the CLI reads it without loading OR-Tools."""

_MAX_DIGITS = 18
"""Digits of a stage index at most, as in action text (a larger one is a typo)."""
MAX_STAGES = 1 << 20
"""Stages a problem may hold (stage numbers 0 .. MAX_STAGES - 1): 16 stages for each of the most ranks a schedule has,
and a bound on what stage-indexed tables cost (a one-task file at stage 10,000,000 had taken 2 GB to search)."""


def task_name(key: TaskKey) -> str:
    """Text form of a task key: ``(2, "F") -> "2F"``."""
    return f"{key[0]}{key[1]}"


def parse_task_name(text: str) -> TaskKey:
    """Inverse of :func:`task_name`; raises ProblemError on anything else."""
    match = _TASK_NAME.match(text.strip()) if isinstance(text, str) else None
    if match is None or len(match.group(1)) > _MAX_DIGITS:  # int() refuses over 4300 digits
        raise ProblemError(
            f"bad task name {text!r:.60}: expected STAGE (at most {_MAX_DIGITS} digits) then a kind letter "
            "F, B, I or W, e.g. '2F'"
        )
    return int(match.group(1)), match.group(2)


def _check_number(what: str, value: object, *, minimum: float | None = 0.0, hint: str = "") -> float:
    """``value`` as a float; ProblemError unless it is a finite number >= ``minimum`` (if given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
            shown = f"an integer of {len(str(abs(value)))} digits"
        else:
            shown = repr(value)
        raise ProblemError(f"{what} must be a finite number, got {shown}")
    if minimum is not None and value < minimum:
        raise ProblemError(f"{what} must be >= {minimum:g}{hint}, got {value!r}")
    return float(value)


def _finite(value: float) -> bool:
    """``math.isfinite`` that answers False for an int too large for a float (no OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_index(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProblemError(f"{what} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """One piece of compute of one stage, run once per micro-batch."""

    stage: int
    """Index of the model fragment this task belongs to."""
    kind: str
    """``F`` forward, ``B`` full backward, ``I`` input-gradient backward, ``W`` weight-gradient backward."""
    ranks: tuple[int, ...]
    """Ranks the task occupies at once (more than one: e.g. a tensor-parallel block)."""
    duration: float
    """Time the task takes, any unit, >= 0."""
    memory: float = 0.0
    """Signed change of the memory held on each of its ranks when the task starts."""
    deps: tuple[TaskKey, ...] = ()
    """Tasks of the same micro-batch that must finish first."""
    comm: float = 0.0
    """Part of ``duration`` its rank spends waiting on communication inside the task (e.g. an MoE all-to-all),
    which an overlapped pair can hide under the other part's compute (0 <= comm <= duration)."""

    def __post_init__(self) -> None:
        _check_index("task stage", self.stage)
        if self.stage >= MAX_STAGES:
            raise ProblemError(f"task stage {self.stage} is above the {MAX_STAGES - 1:,} a problem may hold "
                               "(pipeloom.problem.MAX_STAGES); number the stages from 0")
        if self.kind not in KINDS:
            raise ProblemError(f"task {self.stage}{self.kind}: kind must be one of F, B, I, W")
        name = f"{self.stage}{self.kind}"
        ranks = tuple(self.ranks)
        if not ranks:
            raise ProblemError(f"task {name} has no ranks; give it at least one rank")
        for rank in ranks:
            _check_index(f"task {name} rank", rank)
        if len(set(ranks)) != len(ranks):
            raise ProblemError(f"task {name} lists a rank twice: {list(ranks)}")
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "duration", _check_number(f"task {name} duration", self.duration))
        object.__setattr__(
            self, "memory", _check_number(f"task {name} memory", self.memory, minimum=None)
        )
        object.__setattr__(self, "comm", _check_number(f"task {name} comm", self.comm))
        if self.comm > self.duration:
            raise ProblemError(f"task {name} comm {self.comm:g} exceeds its duration {self.duration:g}; "
                               "comm is the part of the duration spent communicating")
        deps = tuple(self.deps)
        for dep in deps:
            if (
                not isinstance(dep, tuple)
                or len(dep) != 2
                or dep[1] not in KINDS
                or isinstance(dep[0], bool)
                or not isinstance(dep[0], int)
            ):
                raise ProblemError(f"task {name}: dependency {dep!r} is not a (stage, kind) pair")
        if len(set(deps)) != len(deps):
            raise ProblemError(f"task {name} lists a dependency twice")
        object.__setattr__(self, "deps", deps)

    @property
    def key(self) -> TaskKey:
        """``(stage, kind)``, the task's identity inside a micro-batch."""
        return (self.stage, self.kind)

    @property
    def name(self) -> str:
        """Text form, e.g. ``2F``."""
        return f"{self.stage}{self.kind}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """The per-micro-batch task DAG and the machine it runs on."""

    num_ranks: int
    """Number of devices (ranks 0 .. num_ranks-1)."""
    tasks: tuple[Task, ...]
    """Every task of one micro-batch; (stage, kind) is unique."""
    comm_latency: float = 0.0
    """Delay between a dep finishing and a task starting when they run on different rank sets."""
    memory_limit: float | None = None
    """Per-rank cap on held memory; None means unlimited."""
    static_memory: tuple[float, ...] | None = None
    """Memory each rank holds before any action (e.g. weights); None means 0 everywhere."""
    overlap_overhead: float = 0.0
    """Time added to every overlapped forward + backward pair (>= 0; see docs/semantics.md)."""
    overlap_fraction: float = 0.0
    """Share of a pair's shorter part whose compute runs under the longer one (0..1): 0, the default, runs
    the two parts' compute one after the other (F + B less the communication each hides under the other's
    compute); 1 prices the pair as ``max(F, B)``, which one device reaches only if it really runs two
    micro-batches' compute at once (docs/semantics.md, "Composite actions")."""
    pair_time: float | None = None
    """A measured time of one overlapped pair, used for every pair instead of the formula; None: not measured."""
    _index: Mapping[TaskKey, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ProblemError(f"num_ranks must be a positive integer, got {self.num_ranks!r}")
        tasks = tuple(self.tasks)
        if not tasks:
            raise ProblemError("the problem has no tasks; give at least one task")
        object.__setattr__(self, "tasks", tasks)
        index: dict[TaskKey, int] = {}
        for i, task in enumerate(tasks):
            if not isinstance(task, Task):
                raise ProblemError(f"tasks[{i}] is {type(task).__name__}, expected a Task")
            if task.key in index:
                raise ProblemError(f"task {task.name} is defined twice; (stage, kind) must be unique")
            index[task.key] = i
            for rank in task.ranks:
                if rank >= self.num_ranks:
                    raise ProblemError(
                        f"task {task.name} runs on rank {rank}, but there are only "
                        f"{self.num_ranks} ranks (0..{self.num_ranks - 1}); raise num_ranks or fix the task"
                    )
        object.__setattr__(self, "_index", index)
        for task in tasks:
            for dep in task.deps:
                if dep not in index:
                    raise ProblemError(
                        f"task {task.name} depends on {task_name(dep)}, which is not a task of the problem"
                    )
        self._check_acyclic()
        object.__setattr__(
            self, "comm_latency", _check_number("comm_latency", self.comm_latency)
        )
        object.__setattr__(
            self, "overlap_overhead", _check_number("overlap_overhead", self.overlap_overhead)
        )
        fraction = _check_number("overlap_fraction", self.overlap_fraction)
        if fraction > 1:
            raise ProblemError(f"overlap_fraction must be between 0 and 1, got {fraction!r}")
        object.__setattr__(self, "overlap_fraction", fraction)
        if self.pair_time is not None:
            object.__setattr__(self, "pair_time", _check_number("pair_time", self.pair_time,
                                                                hint=" (or None: priced from its parts)"))
        if self.memory_limit is not None:
            limit = _check_number("memory_limit", self.memory_limit, hint=" (or None for no limit)")
            object.__setattr__(self, "memory_limit", limit)
        if self.static_memory is not None:
            static = tuple(
                _check_number(f"static_memory[{r}]", v, minimum=None)
                for r, v in enumerate(self.static_memory)
            )
            if len(static) != self.num_ranks:
                raise ProblemError(
                    f"static_memory has {len(static)} entries; give one per rank ({self.num_ranks})"
                )
            object.__setattr__(self, "static_memory", static)

    def _check_acyclic(self) -> None:
        """Kahn's algorithm over the dependency edges (:func:`pipeloom.graph.topological_order`); a
        task it leaves out lies on a cycle or after one, and the error names one cycle in dependency
        order from its smallest task (the same text however found)."""
        preds = [[self._index[dep] for dep in task.deps] for task in self.tasks]
        placed = graph.topological_order(preds, order="depth")
        if len(placed) != len(self.tasks):
            found = graph.find_cycle(preds, placed, key=lambda i: self.tasks[i].key)
            cycle = [self.tasks[i].key for i in found]
            raise ProblemError(
                f"the task dependencies form a cycle: {' -> '.join(map(task_name, cycle))}; remove one of "
                "those edges"
            )

    def task(self, key: TaskKey) -> Task:
        """The task named ``key``; ProblemError if there is none."""
        try:
            return self.tasks[self._index[key]]
        except KeyError:
            raise ProblemError(f"no task {task_name(key)} in the problem") from None

    def has_task(self, key: TaskKey) -> bool:
        """Whether a task named ``key`` exists."""
        return key in self._index

    def index(self, key: TaskKey) -> int:
        """Position of the task named ``key`` in :attr:`tasks`."""
        return self._index[key]

    @property
    def num_stages(self) -> int:
        """One more than the largest stage index."""
        return 1 + max(task.stage for task in self.tasks)

    def tasks_on(self, rank: int) -> tuple[Task, ...]:
        """Tasks that occupy ``rank``."""
        return tuple(task for task in self.tasks if rank in task.ranks)

    def work_per_microbatch(self) -> tuple[float, ...]:
        """Busy time each rank spends on one micro-batch (sum of its tasks' durations)."""
        work = [0.0] * self.num_ranks
        for task in self.tasks:
            for rank in task.ranks:
                work[rank] += task.duration
        return tuple(work)

    def waits_for(self) -> dict[TaskKey, int]:
        """Per task, every task it waits for, directly or through others, as a bitset over the task
        keys in sorted order (bit i: the i-th smallest key; :meth:`keys_in` lists them). An edge implied by
        a path adds nothing, and the order of :attr:`tasks` does not matter: two problems of the same
        tasks with equal ``waits_for`` admit the same orders."""
        keys = sorted(self._index)
        position = {key: i for i, key in enumerate(keys)}
        preds = [[position[dep] for dep in self.task(key).deps] for key in keys]
        bits = graph.ancestors(preds, graph.topological_order(preds))
        return dict(zip(keys, bits))

    def keys_in(self, bits: int) -> list[TaskKey]:
        """The task keys of a :meth:`waits_for` bitset, in sorted order."""
        keys = sorted(self._index)
        return [keys[i] for i in graph.members(bits)]

    @property
    def splits_backward(self) -> bool:
        """True when the backward is split into I and W tasks."""
        return any(task.kind in ("I", "W") for task in self.tasks)
