"""A pipeline schedule at a layout's stage costs. Activations held: per rank, how many micro-batches of each of
its stages are held after each of its actions (in units of one stage forward's memory), kept only where no other
point holds as much of every stage; the schedule's peak for any per-stage activation bytes is then a maximum of
a few dot products, the same number the simulator's replay reaches (its running sum in rank order). The replay
itself (:func:`replay_stages`): the schedule compiled once, each layout's costs put on its tasks. Before any
schedule is built, the warm-up its builder fixes bounds the peak from below (:func:`warmup_peak`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from pipeloom.ir import Overlap, Schedule, task_actions
from pipeloom.plan.cluster.step import PhaseTimes
from pipeloom.schedules.warmup import WARMUP_SCHEDULES, RankWarmup, warmup_forwards
from pipeloom.schedules.zbv import warmup_floor
from pipeloom.sim_pricing import Pricing
from pipeloom.sim_replay import CompiledSchedule, bubble_ratio

__all__ = ["RankHeld", "held_profile", "peak_held", "profiled_microbatches", "replay_stages", "warmup_peak"]


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
    problem = schedule.problem
    tasks = {task.key: task for task in problem.tasks}
    unit = {task.stage: task.memory for task in problem.tasks if task.kind == "F"}
    changes: dict[Any, tuple[tuple[int, float], ...]] = {}  # per (stage, kind) of an action, or of a pair's parts
    out = []
    for actions in schedule.ranks:
        signatures = []
        for action in actions:  # (stage, kind), or an overlapped pair's two
            signature = (action.forward[:2], action.backward[:2]) if type(action) is Overlap else action[:2]
            if signature not in changes:  # its tasks do not depend on the micro-batch
                found = [tasks[part.task] for part in task_actions(problem, action)]
                changes[signature] = tuple((t.stage, t.memory / unit[t.stage]) for t in found if unit[t.stage])
            signatures.append(signature)
        stages = sorted({stage for signature in set(signatures) for stage, _ in changes[signature]})
        points: set[tuple[float, ...]]
        if len(stages) == 1:  # one stage: the running sum's maximum
            step = {signature: sum(d for _, d in changes[signature]) for signature in set(signatures)}
            points = {(max(accumulate(map(step.__getitem__, signatures), initial=0.0)),)}
        else:
            position = {stage: k for k, stage in enumerate(stages)}
            moves = {signature: (tuple((position[stage], d) for stage, d in changes[signature]),
                                 any(d > 0 for _, d in changes[signature])) for signature in set(signatures)}
            held, points = [0.0] * len(stages), set()
            for signature in signatures:
                change, rises = moves[signature]
                for k, d in change:
                    held[k] += d
                if rises:
                    points.add(tuple(held))
        out.append(RankHeld(stages=tuple(stages), points=_frontier(points)))
    return tuple(out)


def _frontier(points: set[tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """The points not dominated (<= in every coordinate) by another one."""
    if len(next(iter(points), ())) == 2:  # a V's or DualPipe's two stages: one sweep
        return _frontier_2d(points)
    kept: list[tuple[float, ...]] = []
    for point in sorted(points, key=sum, reverse=True):  # a dominating point has the larger sum: seen first
        if not any(all(a <= b for a, b in zip(point, other)) for other in kept):
            kept.append(point)
    return tuple(kept)


def _frontier_2d(points: set[tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """:func:`_frontier` of distinct points in two coordinates: by the first descending (ties: the second
    descending), a point is dominated exactly when an earlier one has at least its second coordinate."""
    kept: list[tuple[float, ...]] = []
    top = float("-inf")
    for point in sorted(points, reverse=True):
        if point[1] > top:
            kept.append(point)
            top = point[1]
    return tuple(kept)


def peak_held(profile: tuple[RankHeld, ...], acts: list[float] | tuple[float, ...]) -> float:
    """The busiest rank's peak of held activations for ``acts[j]`` bytes per micro-batch of stage ``j``."""
    return max(rank.peak(acts) for rank in profile)


def replay_stages(compiled: CompiledSchedule, times: Sequence[PhaseTimes], acts: Sequence[float],
                  latency: float, slowdown: float = 0.0) -> tuple[float, float, float]:
    """``(makespan, bubble, peak held bytes)`` of the compiled schedule with each task priced by its stage:
    ``times`` (an F, I, W its phase's seconds, a B I + W; the all-to-all inside F and I as the tasks' ``comm``,
    which DualPipe(V)'s overlapped pairs hide under the other part's compute, losing ``slowdown`` of each hidden
    second to it: :func:`pipeloom.ir.pair_duration`), ``acts`` bytes per micro-batch for the schedule's memory
    units, ``latency`` between stages."""
    schedule = compiled.schedule
    taken = {t.stage: t.memory for t in schedule.problem.tasks if t.kind == "F"}
    durations, comms, memory = [], [], []
    for task in schedule.problem.tasks:
        t, kind = times[task.stage], task.kind
        durations.append(t.f if kind == "F" else t.i + t.w if kind == "B" else t.i if kind == "I" else t.w)
        comms.append(t.f_comm if kind == "F" else t.i_comm if kind in ("B", "I") else 0.0)
        memory.append(task.memory * (acts[task.stage] / taken[task.stage] if taken[task.stage] else 0.0))
    run = compiled.run(Pricing(durations, comms, memory, latency, slowdown=slowdown))
    return run.makespan, bubble_ratio(run.busy, run.makespan), max(run.peaks)


def profiled_microbatches(pp: int, m: int) -> int:
    """The micro-batches of the schedule whose held activations stand for ``m``'s on ``pp`` ranks: at most 3 pp,
    the estimator's longest replay (past it the peak is the warm-up's)."""
    return m if m <= 3 * pp else 3 * pp


def warmup_peak(schedule: str, pp: int, vp: int, m: int, acts: Sequence[float]) -> float:
    """A lower bound on the peak of held activations of ``schedule`` over ``pp`` ranks (``vp`` stages each) for
    ``m`` micro-batches, without building it: the busiest rank's at the end of its warm-up, every forward of which
    is still held (:func:`~pipeloom.schedules.warmup.warmup_forwards`, for the :func:`profiled_microbatches`
    schedule the peak is read from). zbv, whose order depends on its costs: the ``min(pp - r, m)`` forwards of its
    first stage each rank r holds before its first backward there, as 1F1B's
    (:func:`~pipeloom.schedules.zbv.warmup_floor`, which the estimator checks on every zbv it builds)."""
    if pp > 1 and schedule == "zbv":
        return max(n * acts[r] for r, n in enumerate(warmup_floor(pp, m)))
    if pp == 1 or schedule not in WARMUP_SCHEDULES:
        return 0.0
    ranks = _warmups(schedule, pp, vp, profiled_microbatches(pp, m))
    return max((sum(n * acts[j] for j, n in rank) for rank in ranks), default=0.0)


@functools.lru_cache(maxsize=1024)
def _warmups(schedule: str, pp: int, vp: int, m: int) -> tuple[RankWarmup, ...]:
    try:
        return warmup_forwards(schedule, pp, m, stages_per_rank=vp)
    except ValueError:  # counts the schedule refuses: no bound (its exact memory says why)
        return ()
