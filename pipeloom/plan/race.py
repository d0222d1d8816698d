"""The measuring rule of ``pipeloom plan --try K`` (no torch): which plans enter (:func:`entrants`), then plans
timed in interleaved rounds, those clearly slower than the leader dropped, the rest stopped by a budget of steps
and seconds, the lowest median kept.

Each round runs every plan still in the race for ``round_steps`` timed steps, in an order rotated by one plan
per round (A B C, B C A, C A B, ...), so a drifting machine speed hits every plan alike and no plan always runs
first. After each round a plan is dropped when it is *clearly slower* than the leader (the plan still in the
race with the lowest median step): over the rounds both ran, the ratios of its round median to the leader's
round median have a one-sided lower confidence bound above 1 (a sign test: distribution-free, and paired by
round, so the machine's drift between rounds cancels). A new round starts while more than one plan is left,
each has fewer than ``steps`` timed steps, and the steps so far took less than ``seconds``. The chosen plan is
the one left with the lowest median step, ties going to the better predicted (the lower index).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeloom.plan.plan import PlanError

if TYPE_CHECKING:
    from pipeloom.plan.planner import Candidate

__all__ = ["SPREAD", "TrialBudget", "TrialRace", "entrants", "median_ratio_lower_bound", "run_key", "shape_key"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrialBudget:
    """How long ``try_plans`` measures: warm-up, steps per round, and when it stops."""

    warmup: int = 3
    """Untimed steps of each plan right after it is built (first-step costs: allocation, caches)."""
    settle: int = 1
    """Untimed steps of each plan at the start of each of its rounds: the first steps after another plan's
    engine ran find cold caches, which a training run of one plan never sees (judging rounds discard them too)."""
    round_steps: int = 3
    """Timed steps of each plan in each round; the round's median is what rounds compare."""
    steps: int = 60
    """At most this many timed steps per plan (``ceil(steps / round_steps)`` rounds)."""
    seconds: float | None = 120.0
    """No new round once the trial steps (warm-up and settling included, the slowest rank's time) took this long;
    None: no limit. The first round always runs, so that every plan has a measurement."""
    confidence: float = 0.95
    """One-sided confidence of the bound that drops a plan (at 0.95: five rounds in a row slower, or 9 of 10)."""

    def __post_init__(self) -> None:
        for name in ("round_steps", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"trial budget {name} must be a positive integer, got {value!r}")
        for name in ("warmup", "settle"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"trial budget {name} must be an integer >= 0, got {value!r}")
        if self.seconds is not None and not self.seconds > 0:
            raise PlanError(f"trial budget seconds must be more than 0 (or None: no limit), got {self.seconds!r}")
        if not 0.5 < self.confidence < 1:
            raise PlanError(f"trial budget confidence must lie between 0.5 and 1, e.g. 0.95; got {self.confidence!r}")

    @property
    def rounds(self) -> int:
        """The most rounds the budget of steps allows."""
        return -(-self.steps // self.round_steps)


def median_ratio_lower_bound(ratios: Sequence[float], confidence: float) -> float | None:
    """A one-sided lower confidence bound of the median of ``ratios`` (distribution-free: the k-th smallest,
    for the largest k with ``P(Binomial(n, 1/2) <= k - 1) <= 1 - confidence``); None when there are too few
    ratios for any bound at that confidence (fewer than 5 at 0.95)."""
    n = len(ratios)
    alpha, tail, k = 1.0 - confidence, 0.0, 0
    while k < n:
        tail += math.comb(n, k) / 2.0 ** n  # P(B <= k)
        if tail > alpha:
            break
        k += 1
    return sorted(ratios)[k - 1] if k else None


class TrialRace:
    """The state of one race between ``count`` plans, numbered in predicted order (0 the best predicted)."""

    def __init__(self, count: int, budget: TrialBudget) -> None:
        if count < 1:
            raise PlanError(f"a race needs at least one plan, got {count}")
        self.budget = budget
        self.rounds = 0
        """Rounds completed."""
        self.seconds = 0.0
        """Seconds of trial steps so far (warm-up included)."""
        self.alive = list(range(count))
        """Plans still in the race, in predicted order."""
        self.dropped: dict[int, int] = {}
        """Plan -> the round after which it was dropped as clearly slower."""
        self.refused: set[int] = set()
        """Plans the engine refused, when it was built or at a step (out of the race from then on)."""
        self.times: list[list[list[float]]] = [[] for _ in range(count)]
        """Per plan, per round it ran (rounds 0, 1, ... in order), its timed steps' seconds."""

    def refuse(self, plan: int) -> None:
        """``plan`` cannot run (the engine refused it): out of the race."""
        self.alive.remove(plan)
        self.refused.add(plan)

    def spend(self, seconds: float) -> None:
        """Count ``seconds`` of trial steps (warm-up or timed) against the budget."""
        self.seconds += seconds

    def order(self) -> list[int]:
        """The plans to run in the coming round: those left, rotated by one per round."""
        shift = self.rounds % len(self.alive) if self.alive else 0
        return self.alive[shift:] + self.alive[:shift]

    def done(self) -> bool:
        """Whether no round is to start: no plan left, or after the first round (which always runs) one plan
        left, the steps used up or the seconds."""
        if not self.alive or self.rounds == 0:
            return not self.alive
        limit = self.budget.seconds
        return (len(self.alive) == 1 or self.rounds >= self.budget.rounds
                or (limit is not None and self.seconds >= limit))

    def record(self, plan: int, times: Sequence[float]) -> None:
        """The timed steps of ``plan`` in the current round."""
        if plan not in self.alive or len(self.times[plan]) != self.rounds or not times:
            raise PlanError(f"plan {plan} has no slot in round {self.rounds}: run only the plans of order()")
        self.times[plan].append([float(t) for t in times])
        self.spend(sum(times))

    def end_round(self) -> list[int]:
        """Close the round (every plan left must have recorded it) and drop the plans clearly slower than the
        leader; returns those dropped."""
        if any(len(self.times[plan]) != self.rounds + 1 for plan in self.alive):
            raise PlanError(f"round {self.rounds}: not every plan left was measured")
        self.rounds += 1
        leader = self.leader()
        dropped = [plan for plan in self.alive if plan != leader and self.clearly_slower(plan, leader)]
        for plan in dropped:
            self.alive.remove(plan)
            self.dropped[plan] = self.rounds
        return dropped

    def median(self, plan: int) -> float | None:
        """The median of every timed step of ``plan`` (None before it ran)."""
        steps = [t for round_ in self.times[plan] for t in round_]
        return statistics.median(steps) if steps else None

    def leader(self) -> int:
        """The plan left with the lowest median step; the better predicted on a tie."""
        return min(self.alive, key=lambda plan: (self.median(plan), plan))

    def ratios(self, plan: int, other: int) -> list[float]:
        """``plan``'s round median over ``other``'s, for each round both ran."""
        return [statistics.median(a) / statistics.median(b) for a, b in zip(self.times[plan], self.times[other])]

    def clearly_slower(self, plan: int, other: int) -> bool:
        """Whether the lower confidence bound of ``plan``'s median round ratio to ``other`` is above 1."""
        bound = median_ratio_lower_bound(self.ratios(plan, other), self.budget.confidence)
        return bound is not None and bound > 1.0

    def ranking(self) -> list[int]:
        """Every plan, the chosen first: those left by median (ties: the better predicted), then those dropped,
        the last dropped first, then those refused."""
        left = sorted(self.alive, key=lambda plan: (self.median(plan), plan))
        dropped = sorted(self.dropped, key=lambda plan: (-self.dropped[plan], self.median(plan), plan))
        return left + dropped + sorted(self.refused)


SPREAD = 0.15
"""How far above the best prediction a plan of another shape (:func:`shape_key`) may be and still take a trial
slot ahead of better predicted plans: the accuracy the planner is held to on held-out models (measured / predicted
within 15 %, ``benchmarks/plan_models.py``; docs/plan-models.md)."""


def run_key(candidate: Candidate) -> tuple:
    """What the engine would execute: replicas, split, micro-batches, and each rank's actions in order with
    each task's rank. Two schedules that coincide here (gpipe and 1f1b at one micro-batch) are one plan."""
    _, timeline, _ = candidate.simulation()
    schedule = timeline.schedule
    placement = tuple(sorted((task.key, task.ranks) for task in schedule.problem.tasks))
    return (candidate.data_parallel, candidate.split_points, candidate.microbatches, placement,
            tuple(tuple(map(str, actions)) for actions in schedule.ranks))


def shape_key(candidate: Candidate) -> tuple[int, int, int]:
    """``(replicas, micro-batches, stages per rank)``: what sets a plan's messages and profiled micro-batch size,
    the terms the prediction's errors follow."""
    problem = candidate.simulation()[1].schedule.problem
    stages = 1 + max(task.stage for task in problem.tasks)
    return (candidate.data_parallel, candidate.microbatches, max(1, stages // problem.num_ranks))


def entrants(fitting: Sequence[Candidate], k: int, spread: float = SPREAD) -> list[Candidate]:
    """Up to ``k`` of ``fitting`` (best predicted first), none running what an earlier pick runs: the best;
    then, while slots remain, the best of each shape (:func:`shape_key`: micro-batches, stages per rank,
    replicas) not yet picked whose prediction is within ``spread`` of the best; then the rest by prediction.

    Plans of one shape share their errors: one profile prices every plan of a micro-batch size, and the
    per-message cost multiplies the same message count. On GPT-2 in docs/plan-models.md (2026-11-26) the
    one-stage-per-rank plans ran 4-9 % faster than predicted, the two-stages-per-rank ones 4 % faster to 4 %
    slower, and the three best predicted were often of one shape while the fastest measured was another."""
    distinct, seen = [], set()
    for candidate in fitting:
        key = run_key(candidate)
        if key not in seen:
            seen.add(key)
            distinct.append(candidate)
    if not distinct:
        return []
    best = distinct[0].simulation()[0]
    chosen, shapes = {0}, {shape_key(distinct[0])}
    for n, candidate in enumerate(distinct):
        if len(chosen) < k and shape_key(candidate) not in shapes \
                and candidate.simulation()[0] <= best * (1 + spread):
            shapes.add(shape_key(candidate))
            chosen.add(n)
    for n in range(len(distinct)):
        if len(chosen) < k:
            chosen.add(n)
    return [distinct[n] for n in sorted(chosen)]
