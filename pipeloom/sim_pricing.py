"""What the simulator's replay prices a compiled schedule with: per task its duration, communication and memory
(:class:`Pricing`), and composite actions (an overlapped pair, a full ``B`` on a split stage: :class:`Composite`),
each priced once per shape (:class:`Price`; docs/semantics.md, "Composite actions"). The replay itself:
:mod:`pipeloom.sim_replay`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pipeloom.ir import Action, Overlap, compute_parts, pair_duration, part_tasks
from pipeloom.problem import Problem

__all__ = ["Composite", "Price", "Pricing", "composite_of"]


@dataclass(frozen=True, slots=True)
class Price:
    """What a composite action costs: the fields its problem's costs decide, shared by every composite of one
    shape (the same parts' tasks, whatever their micro-batches)."""

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
    slowdown: float = 0.0
    """The share of each hidden second of communication the compute beside it loses (a pair only:
    :attr:`Pricing.slowdown`)."""
    measured: bool = False
    """Whether it is a pair of the problem's measured ``pair_time`` (``duration``)."""


@dataclass(frozen=True, slots=True)
class Composite:
    """One composite action: its parts as task indices and micro-batches (its costs: :class:`Price`)."""

    action: Action | Overlap
    """The action as the schedule writes it."""
    units: tuple[tuple[tuple[int, int], ...], ...]
    """Per part (forward, backward), the ``(task index, micro-batch)`` it completes, in order."""
    overlapped: bool
    """Whether the parts run overlapped (a pair: the longer one counts) or one after the other."""

    @property
    def shape(self) -> tuple[bool, tuple[tuple[int, ...], ...]]:
        """What decides its costs: whether a pair, and each part's task indices."""
        return self.overlapped, tuple(tuple(t for t, _ in unit) for unit in self.units)

    def scaled(self, price: Price, durations: Sequence[float], factor: Callable[[int, int], float]) -> float:
        """Its duration at ``price`` with each task's time multiplied by ``factor(task index, micro-batch)``; a
        pair of measured time scales that time as its parts' sum, its communication as its part."""
        base = [sum(durations[t] for t, _ in unit) for unit in self.units]
        times = [sum(durations[t] * factor(t, mb) for t, mb in unit) for unit in self.units]
        if not self.overlapped:
            return sum(times)
        ratios = [time / b if b > 0 else 1.0 for time, b in zip(times, base, strict=True)]
        if price.measured:
            return price.duration * (sum(times) / sum(base) if sum(base) > 0 else 1.0)
        comms = (price.comms[0] * ratios[0], price.comms[1] * ratios[1])
        return pair_duration((times[0], times[1]), comms, fraction=price.fraction, overhead=price.overhead,
                             slowdown=price.slowdown)

    def slots(self, num_mb: int, dense: Mapping[int, int]) -> tuple[int, ...]:
        """The replay slots (task x micro-batch) it completes."""
        return tuple(t * num_mb + dense[mb] for unit in self.units for t, mb in unit)

    def links(self, problem: Problem, index: Mapping[tuple[int, str], int], num_mb: int,
              dense: Mapping[int, int]) -> tuple[tuple[tuple[int, bool], ...], tuple[int, ...]]:
        """What a replay needs of it besides its costs: every dependency of its tasks outside its own part (a W
        waits for the I of its own B; a pair's parts do not wait for each other: one that depends on the other
        never starts, the validator reports it as a deadlock), as its slot less the first part's micro-batch (the
        replay's hot loop adds the micro-batch) and whether it ran on other ranks (then the problem's latency
        applies); and the slots it completes."""
        tasks = problem.tasks
        first = dense[self.units[0][0][1]]
        found: dict[int, bool] = {}
        for unit in self.units:
            inside = {t * num_mb + dense[mb] for t, mb in unit}
            for t, mb in unit:
                for dep in tasks[t].deps:
                    slot = index[dep] * num_mb + dense[mb]
                    if slot not in inside:
                        found[slot] = found.get(slot, False) or set(tasks[index[dep]].ranks) != set(tasks[t].ranks)
        return tuple((slot - first, cross) for slot, cross in found.items()), self.slots(num_mb, dense)


def composite_of(problem: Problem, index: Mapping[tuple[int, str], int], action: Action | Overlap) -> Composite | None:
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
    return Composite(action, tuple(units), type(action) is Overlap)


@dataclass(frozen=True, slots=True)
class Pricing:
    """The costs a replay prices a compiled schedule's lists with: per task of its problem, in the problem's order,
    the duration, the communication inside it and the memory change; the latency between rank sets; and how
    overlapped pairs are priced (docs/semantics.md, "Composite actions")."""

    durations: Sequence[float]
    comms: Sequence[float]
    memory: Sequence[float]
    latency: float = 0.0
    overhead: float = 0.0
    """Time added to every overlapped pair."""
    fraction: float = 0.0
    """The share of a pair's shorter part that runs under the longer one (``Problem.overlap_fraction``)."""
    pair_time: float | None = None
    """A measured time of every pair (``Problem.pair_time``); None: priced from its parts."""
    slowdown: float = 0.0
    """The share of each second of communication a pair hides that the compute beside it loses
    (:func:`~pipeloom.ir.pair_duration`): a caller's pricing (the cluster planner's expert all-to-alls), not a
    problem's."""

    @classmethod
    def of(cls, problem: Problem, overhead: float) -> Pricing:
        """``problem``'s own costs, ``overhead`` added to every overlapped pair."""
        tasks = problem.tasks
        return cls([task.duration for task in tasks], [task.comm for task in tasks], [task.memory for task in tasks],
                   problem.comm_latency, overhead, problem.overlap_fraction, problem.pair_time)

    def price(self, shape: tuple[bool, tuple[tuple[int, ...], ...]]) -> Price:
        """The :class:`Price` of a composite of ``shape`` (whether a pair, its parts' task indices): the parts'
        durations summed (a pair's as :func:`~pipeloom.ir.action_duration` prices it), their communication and
        memory changes."""
        overlapped, parts = shape
        durations, task_comms = self.durations, self.comms
        times = tuple(sum(durations[t] for t in part) for part in parts)
        comms = tuple(sum(task_comms[t] for t in part) for part in parts)
        memory = sum(self.memory[t] for part in parts for t in part)
        if not overlapped:
            return Price(0.0, sum(times), memory, comms)
        measured, overhead = self.pair_time, self.overhead
        duration = measured if measured is not None else pair_duration(
            (times[0], times[1]), (comms[0], comms[1]), fraction=self.fraction, overhead=overhead,
            slowdown=self.slowdown)
        return Price(overhead, duration, memory, comms, self.fraction, self.slowdown, measured is not None)
