"""Composite actions in the simulator's replay: an overlapped pair, or a full backward ``B`` on a
split stage, as one action that completes several (task, micro-batch) slots (docs/semantics.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipeloom.ir import Action, Overlap, action_duration, action_memory, compute_parts, part_tasks
from pipeloom.problem import Problem

__all__ = ["Composite", "composite_of"]


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
    """Time added to an overlapped pair's longer part."""
    duration: float
    """The time it occupies its rank."""
    memory: float
    """The sum of its tasks' memory changes (applied when it starts)."""

    def scaled(self, durations: list[float], factor: Callable[[int, int], float]) -> float:
        """Its duration with each task's time multiplied by ``factor(task index, micro-batch)``."""
        times = [sum(durations[t] * factor(t, mb) for t, mb in unit) for unit in self.units]
        return max(times) + self.overhead if self.overlapped else sum(times)

    def slots(self, num_mb: int, dense: Mapping[int, int]) -> tuple[int, ...]:
        """The replay slots (task x micro-batch) it completes."""
        return tuple(t * num_mb + dense[mb] for unit in self.units for t, mb in unit)

    def external_deps(self, deps: list, num_mb: int, dense: Mapping[int, int]) -> tuple[tuple[int, float], ...]:
        """``(slot, latency)`` of every dependency of its tasks outside its own part (a W waits for the
        I of its own B; a pair's parts do not wait for each other: one that depends on the other never
        starts, the validator reports it as a deadlock)."""
        found: dict[int, float] = {}
        for unit in self.units:
            inside = {t * num_mb + dense[mb] for t, mb in unit}
            for t, mb in unit:
                for base, lat in deps[t]:
                    slot = base + dense[mb]
                    if slot not in inside:
                        found[slot] = max(lat, found.get(slot, lat))
        return tuple(found.items())


def composite_of(problem: Problem, index: Mapping[tuple[int, str], int], action: Action | Overlap,
                 overhead: float) -> Composite | None:
    """``action`` as a composite of ``problem``, or None when one of its parts names no task."""
    units = []
    for part in compute_parts(action):
        tasks = part_tasks(problem, part)
        ids = [index.get(task.task) for task in tasks]
        if None in ids:
            return None
        units.append(tuple((i, task.microbatch) for i, task in zip(ids, tasks)))
    overlapped = type(action) is Overlap
    return Composite(action=action, units=tuple(units), overlapped=overlapped, overhead=overhead if overlapped else 0.0,
                     duration=action_duration(problem, action, overlap_overhead=overhead),
                     memory=action_memory(problem, action))
