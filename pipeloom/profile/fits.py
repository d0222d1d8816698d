"""What :class:`~pipeloom.profile.engine.EngineProfiler` fits from its traced profiling steps: the
link latency and per-step cost, the runtime's cost inside one action, the start skew, the time spread and
the replica-exchange latency (no torch: each reads a :class:`~pipeloom.trace.format.RunTrace`)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from itertools import pairwise

from pipeloom.ir import Action, Schedule
from pipeloom.plan.costs.parts import Link
from pipeloom.plan.noise import starting_ranks
from pipeloom.plan.recost import exchange_time
from pipeloom.trace.analysis import comm_latency_estimate, step_times
from pipeloom.trace.format import RunTrace

__all__ = ["exchange_latency", "fit_run", "fitted_action_cost", "fitted_replica_link", "start_skew", "time_spread"]

logger = logging.getLogger(__name__)

_NS = 1e-9


def fit_run(run: RunTrace, steps: list[int]) -> tuple[float, float]:
    """``(latency, step overhead)`` of a profiling run: the mean time from a message's producer
    ending to its consumer starting, where the consumer's rank was waiting for it (latency under
    load: :func:`~pipeloom.trace.comm_latency_estimate` with ``mean=True``), and the median of
    each step's ``engine.step`` time minus its span."""
    spans = step_times(run, steps=steps)
    outside = [max(0.0, _engine_step_seconds(run, i) - spans[run.steps[i]]) for i in range(len(run.steps))
               if run.steps[i] in spans]
    return comm_latency_estimate(run, steps=steps, mean=True), statistics.median(outside)


def fitted_action_cost(raw: Callable[[int, str], float], bounds: list[int], whole: dict) -> float:
    """The runtime's seconds inside one action: runs of pieces timed whole (``whole``: the two-replica
    pipeline, run k as stage k and ``len(bounds) - 1 + k``) against their pieces timed apart (``raw``)."""
    runs = len(bounds) - 1
    samples = [
        (sum(raw(piece, kind) for piece in range(a, b)) - whole[(stage, kind)]) / (b - a - 1)
        for k, (a, b) in enumerate(pairwise(bounds)) if b - a > 1
        for stage in (k, runs + k) for kind in ("F", "B")
    ]
    return max(0.0, statistics.median(samples)) if samples else 0.0


def start_skew(run: RunTrace, steps: list[int]) -> float:
    """The mean start delay of ranks that start a step at once (:func:`pipeloom.plan.noise.starting_ranks`),
    as :func:`pipeloom.plan.noise.expected_makespan` draws it: exponential delays of mean m give k such
    ranks a mean gap of ``m * (1 + 1/2 + ... + 1/(k-1))`` between the first and the last to begin, so
    m is the measured mean gap over that sum (0 where fewer than two ranks start at once)."""
    starting = starting_ranks(run.schedule)
    if len(starting) < 2:
        return 0.0
    wanted = set(steps)
    gaps = []
    for i, step in enumerate(run.steps):
        if step in wanted:
            firsts = [run.ranks[r][i].of_kind("compute")[0].start_ns for r in starting]
            gaps.append((max(firsts) - min(firsts)) * 1e-9)
    harmonic = sum(1 / k for k in range(1, len(starting)))
    return statistics.fmean(gaps) / harmonic if gaps else 0.0


def time_spread(runs: list[tuple[RunTrace, dict]], steps: list[int]) -> float:
    """How much one piece's action time varies around the piece's median: a coefficient of variation.

    The speed of the whole machine drifts from step to step, which moves every action of a step
    alike and costs a schedule nothing beyond the mean; so each step's actions are first divided by
    that step's drift (the median of their ratios to their piece's median). Of the relative
    deviations left, the time-weighted median absolute one, times 1.4826 (a normal spread's ratio of
    standard to median absolute deviation): robust to the rare long stall, and tiny pieces, whose
    relative noise is large but costs nothing, weigh little.
    """
    deviations: list[tuple[float, float]] = []
    for run, medians in runs:
        position = {step: i for i, step in enumerate(run.steps)}
        for step in steps:
            samples = [
                ((event.end_ns - event.start_ns) * _NS, medians[action.task])
                for rank in range(run.world_size)
                for action, event in zip(run.schedule.ranks[rank], run.ranks[rank][position[step]].of_kind("compute"))
                if type(action) is Action and medians.get(action.task, 0) > 0  # composites time no one task
            ]
            if samples:
                drift = statistics.median(t / m for t, m in samples)
                deviations += [(abs(t / drift / m - 1), m) for t, m in samples]
    if not deviations:
        return 0.0
    deviations.sort()
    half, seen = sum(m for _, m in deviations) / 2, 0.0
    for deviation, weight in deviations:
        seen += weight
        if seen >= half:
            return 1.4826 * deviation
    return 1.4826 * deviations[-1][0]


def exchange_latency(seconds: float, stage_params: list[float], schedule: Schedule, bandwidth: float | None) -> float:
    """The per-message latency at which :func:`exchange_time` of ``schedule`` is ``seconds`` (0 where
    the bytes alone take longer): it grows with the latency, so bisect."""
    def priced(latency: float) -> float:
        return exchange_time(stage_params, schedule, Link(latency=latency, bandwidth=bandwidth))

    low, high = 0.0, max(seconds, 1e-9)
    if priced(low) >= seconds or priced(high) == priced(low):  # no message to price (no parameters)
        return 0.0
    while priced(high) < seconds:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if priced(middle) < seconds else (low, middle)
    return (low + high) / 2


def _engine_step_seconds(run: RunTrace, index: int) -> float:
    """The longest ``engine.step`` call of step ``index`` over the ranks."""
    return max(rank[index].end_ns - rank[index].start_ns for rank in run.ranks) * _NS


def fitted_replica_link(exchange: RunTrace, steps: list[int], outside: float, params: list[float], link: Link, *,
                        speak: bool) -> Link:
    """The link that prices the two-replica run's gradient exchange (of ``params`` bytes per rank's run of pieces):
    the per-message latency of its seconds beyond the one-replica step's ``outside``; where those are not above zero
    (noise), the stage ``link``, said (``speak``) once: it had been fitted as free, and chimera then won."""
    exchanged = fit_run(exchange, steps)[1] - outside
    if exchanged > 0:
        return Link(latency=exchange_latency(exchanged, params, exchange.schedule, link.bandwidth),
                    bandwidth=link.bandwidth)
    if speak:
        logger.warning("the two-replica run's gradient exchange measured no longer than the one-replica step "
                       "(%.2f ms: noise); it is priced with the stage link (%.2f ms a message); profile with more "
                       "--repeats to measure it", exchanged * 1e3, link.latency * 1e3)
    return link
