"""The planner's noise and start-skew model: the mean makespan of a schedule whose action times
vary around their tasks' (lognormal factors) and whose first ranks start a step a little apart
(exponential delays). It replays with the simulator's semantics (docs/design.md §3,
:func:`pipeloom.sim.compile_schedule`); the fitted spreads and skew come from
``CostTable.runtime`` (:func:`pipeloom.profile.in_engine.profile_in_engine`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from pipeloom.errors import ScheduleError
from pipeloom.ir import Schedule, task_actions
from pipeloom.sim import compile_schedule

__all__ = ["expected_makespan", "starting_ranks"]


def starting_ranks(schedule: Schedule) -> list[int]:
    """Ranks whose first action needs no other action: they all start a step at once (one rank in
    a one-replica pipeline, the first stage of each replica in a two-replica one)."""
    problem = schedule.problem
    return [r for r, actions in enumerate(schedule.ranks)
            if actions and not any(problem.task(task.task).deps for task in task_actions(problem, actions[0]))]


def expected_makespan(schedule: Schedule, spread: float | Sequence[float], *, start_skew: float = 0.0,
                      samples: int | None = None, seed: int = 0) -> float:
    """The mean makespan of ``schedule`` when each action's time varies around its task's.

    Real actions of one task differ from one micro-batch and step to the next; where a rank waits
    for the later of two paths, that variation costs time on average, which a replay with every
    action at its task's time misses. Each of ``samples`` replays (seeded: the result is
    reproducible, and the same draws for every order of one task graph) draws an independent factor
    for every single-rank action, lognormal with mean 1 and coefficient of variation ``spread`` (one
    number, or one per stage); the mean of their
    makespans is returned. ``start_skew`` (seconds): where several ranks start a step at once
    (:func:`starting_ranks`), each also begins after its own delay, drawn exponential with that mean,
    less the earliest one's (the step starts with the first rank that moves): two such ranks start
    ``start_skew`` apart on average. A spread of 0 everywhere and no skew give :func:`~pipeloom.simulate`'s
    makespan. ``samples`` None: 32, fewer for long schedules (at least 4; about 50,000 actions in
    all), whose many actions already average their variation out. DeadlockError as :func:`~pipeloom.simulate`.
    """
    if schedule.lowered:
        raise ScheduleError(f"expected_makespan replays compute-only schedules and {schedule.name!r} is "
                            "lowered; pass the schedule before lower()")
    problem = schedule.problem
    spreads = [spread] * problem.num_stages if isinstance(spread, (int, float)) else list(spread)
    if len(spreads) != problem.num_stages:
        raise ValueError(f"give one spread, or one per stage ({problem.num_stages}), not {len(spreads)}")
    for value in spreads:
        if not _nonnegative(value):
            raise ValueError(f"a spread must be a finite number >= 0, got {value!r}")
    if samples is None:
        samples = max(4, min(32, 50_000 // max(1, sum(map(len, schedule.ranks)))))
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    if not _nonnegative(start_skew):
        raise ValueError(f"start_skew must be a finite number of seconds >= 0, got {start_skew!r}")
    compiled = compile_schedule(schedule)
    starting = starting_ranks(schedule) if start_skew else []
    if not any(spreads) and len(starting) < 2:
        return compiled.makespan()  # every replay checks that the lists run to the end
    sigmas = [math.sqrt(math.log1p(value * value)) for value in spreads]
    task_sigmas = [sigmas[task.stage] for task in problem.tasks]
    num_mb = compiled.num_slots
    draws = random.Random(seed)
    total = 0.0
    for _ in range(samples):
        scales = None
        if any(spreads):
            # one factor per (task, micro-batch), drawn in that order: two orders of one task graph see
            # the same draws, so comparing them is not decided by which position drew what
            factors = [draws.lognormvariate(-sigma * sigma / 2, sigma) if sigma else 1.0
                       for sigma in task_sigmas for _ in range(num_mb)]
            scales = compiled.action_scales(factors)
        release = None
        if len(starting) > 1:
            delays = [draws.expovariate(1 / start_skew) for _ in starting]
            release = [0.0] * problem.num_ranks
            for r, delay in zip(starting, delays):
                release[r] = delay - min(delays)
        total += compiled.makespan(scales, release)
    return total / samples


def _nonnegative(value: object) -> bool:
    """A finite int or float >= 0 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
