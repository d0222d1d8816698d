"""Activations a pipeline schedule holds: per rank, how many micro-batches of each of its stages are held
after each of its actions (in units of one stage forward's memory), kept only where no other point holds as
much of every stage. The schedule's peak for any per-stage activation bytes is then a maximum of a few dot
products, the same number the simulator's replay reaches (its running sum in rank order)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from pipeloom.ir import Schedule
from pipeloom.sim import compile_schedule

__all__ = ["RankHeld", "held_profile", "peak_held"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankHeld:
    """One rank's held activations: its stages and the non-dominated held counts."""

    stages: tuple[int, ...]
    """The model stages the rank runs, in increasing order."""
    points: tuple[tuple[float, ...], ...]
    """Held units per stage of :attr:`stages` after an action, for the actions no other one dominates."""

    def peak(self, acts: list[float] | tuple[float, ...]) -> float:
        """The rank's peak (>= 0: nothing held before the first action) for ``acts[j]`` bytes per unit of
        stage ``j``."""
        weights = [acts[j] for j in self.stages]
        best = 0.0
        for point in self.points:
            total = 0.0
            for count, weight in zip(point, weights):
                total += count * weight
            if total > best:
                best = total
        return best


def held_profile(schedule: Schedule) -> tuple[RankHeld, ...]:
    """Per rank of ``schedule`` (not lowered), the held units after each action: each task's memory over its
    stage's forward memory, summed over an action's tasks (an overlapped pair or a split B counts at once, as
    the simulator applies it); points after an action that frees only are dominated by the one before it."""
    compiled = compile_schedule(schedule)
    tasks = schedule.problem.tasks
    unit = {task.stage: task.memory for task in tasks if task.kind == "F"}

    def parts(index: int) -> tuple[int, ...]:
        if index < len(tasks):
            return (index,)
        return tuple(t for part in compiled.composites[index - len(tasks)].units for t, _ in part)

    out = []
    for seq in compiled.seq_tasks:
        steps = {index: parts(index) for index in set(seq)}
        stages = sorted({tasks[t].stage for found in steps.values() for t in found})
        position = {stage: k for k, stage in enumerate(stages)}
        deltas: dict[int, list[tuple[int, float]]] = {}
        for index, found in steps.items():
            deltas[index] = [(position[tasks[t].stage], tasks[t].memory / unit[tasks[t].stage])
                             for t in found if unit[tasks[t].stage]]
        points: set[tuple[float, ...]]
        if len(stages) == 1:  # one stage: the running sum's maximum
            step = {index: sum(d for _, d in change) for index, change in deltas.items()}
            points = {(max(accumulate(map(step.__getitem__, seq), initial=0.0)),)}
        else:
            held, points = [0.0] * len(stages), set()
            for index in seq:
                change = deltas[index]
                for k, d in change:
                    held[k] += d
                if any(d > 0 for _, d in change):
                    points.add(tuple(held))
        out.append(RankHeld(stages=tuple(stages), points=_frontier(points)))
    return tuple(out)


def _frontier(points: set[tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """The points not dominated (<= in every coordinate) by another one."""
    kept: list[tuple[float, ...]] = []
    for point in sorted(points, key=sum, reverse=True):  # a dominating point has the larger sum: seen first
        if not any(all(a <= b for a, b in zip(point, other)) for other in kept):
            kept.append(point)
    return tuple(kept)


def peak_held(profile: tuple[RankHeld, ...], acts: list[float] | tuple[float, ...]) -> float:
    """The busiest rank's peak of held activations for ``acts[j]`` bytes per micro-batch of stage ``j``."""
    return max(rank.peak(acts) for rank in profile)
