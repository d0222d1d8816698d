"""The library's schedules as candidates of a search: each registry entry whose task structure is the
problem's, built at its size with a few cost sets and caps, re-targeted to the problem's durations,
memory and limit, and validated (:func:`builtin_candidates`)."""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterator

from pipeloom.ir import Schedule
from pipeloom.problem import Problem
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.search.budget import Budget
from pipeloom.sim import Timeline
from pipeloom.stages import Costs
from pipeloom.validate import validate

__all__ = ["PROBE_SIZES", "builtin_candidates"]

def _structure(problem: Problem) -> dict:
    """What a schedule's validity depends on: each task's rank set and everything it transitively
    waits for (so an edge implied by a path does not matter; durations and memory do not either)."""
    before = problem.waits_for()
    return {task.key: (frozenset(task.ranks), before[task.key]) for task in problem.tasks}


def _costs_like(problem: Problem, stages_per_rank: int) -> Costs | None:
    """Per-rank-share costs whose stage 0 matches ``problem``'s (a built-in's order may use them)."""
    try:
        v = stages_per_rank
        forward = problem.task((0, "F"))
        if problem.splits_backward:
            i, w = problem.task((0, "I")), problem.task((0, "W"))
            return Costs(f=forward.duration * v, b=i.duration * v, w=w.duration * v,
                         comm=problem.comm_latency, memory=forward.memory * v, w_memory=-w.memory * v)
        back = problem.task((0, "B"))
        return Costs(f=forward.duration * v, b=back.duration * v, w=0.0, comm=problem.comm_latency,
                     memory=forward.memory * v)
    except ValueError:  # no such task, or negative costs: default costs only
        return None


def builtin_candidates(problem: Problem, num_microbatches: int, *, deadline: float | None = None,
                       budget: Budget | None = None, enough: float | None = None,
                       names: Collection[str] | None = None,
                       skipped: set[str] | None = None) -> Iterator[tuple[str, Timeline]]:
    """``(name, timeline)`` of every built-in schedule whose task structure (rank sets and
    transitive deps, see :func:`_structure`) is ``problem``'s,
    re-targeted to ``problem`` (its durations, memory and limit) and valid in ordered mode.

    Each registry entry is first built at a few micro-batches (:func:`_probe`) to compare its
    structure, which does not depend on M; only a matching entry is built at ``num_microbatches``,
    with default costs and with costs read off ``problem``'s stage 0, each with and without the
    memory limit (memory-aware generators adapt to it); the fastest valid variant represents the
    entry, and no further variant is built once one reaches ``enough`` (e.g. the lower bound).
    Entries and variants not started by ``deadline`` (a :func:`time.perf_counter` value), or
    whose estimated build-and-validate time does not fit ``budget``, are skipped; the estimate is
    learnt from the matching probe's own build and validation. ``names`` restricts the entries;
    ``skipped``, when given, collects the entries not started, or left with variants unbuilt, for
    time (to try again when time is left, see :func:`pipeloom.search.api.search`).
    """
    if budget is None:
        budget = Budget(deadline=math.inf if deadline is None else deadline)
    elif deadline is not None:
        budget = Budget(deadline=min(deadline, budget.deadline), seconds_per_action=budget.seconds_per_action)
    kinds = ("F", "I", "W") if problem.splits_backward else ("F", "B")
    if {task.key for task in problem.tasks} != {(s, kind) for s in range(problem.num_stages) for kind in kinds}:
        return  # every built-in has these tasks and no others: none fits, and none is built to find out
    wanted = _structure(problem)
    stages_per_rank, extra = divmod(problem.num_stages, problem.num_ranks)
    actions = len(problem.tasks) * num_microbatches
    out_of_time = False
    for info in REGISTRY.values():
        if info.splits_backward != problem.splits_backward or (names is not None and info.name not in names):
            continue
        options = {}
        if "stages_per_rank" in info.options:
            if extra or stages_per_rank < 1:
                continue
            options["stages_per_rank"] = stages_per_rank
        if info.num_pieces(problem.num_ranks, options) * info.replicas != problem.num_stages:
            continue  # another stage count: not this structure, and nothing built to find out
        out_of_time = out_of_time or budget.expired()
        if out_of_time:  # not started: a later call with more time may build it
            if skipped is None:
                return
            skipped.add(info.name)
            continue
        if not _probe(info.name, problem, num_microbatches, wanted, options, budget):
            continue
        valid = [t for t in _variants(info.name, problem, num_microbatches, wanted, options, budget, enough,
                                      skipped) if t is not None]
        if valid:
            yield info.name, min(valid, key=lambda timeline: timeline.makespan)
        out_of_time = not budget.fits(actions)


def _variants(name: str, problem: Problem, num_microbatches: int, wanted: dict, options: dict,
              budget: Budget, enough: float | None, skipped: set[str] | None) -> Iterator[Timeline | None]:
    """Built-in ``name`` at full size with each cost set and cap (see :func:`builtin_candidates`),
    re-targeted; stops at another structure, at ``enough``, or when the next one does not fit (then
    adding ``name`` to ``skipped``)."""
    actions = len(problem.tasks) * num_microbatches
    costs_options = [Costs(), _costs_like(problem, (problem.num_stages // problem.num_ranks) or 1)]
    for costs in dict.fromkeys(c for c in costs_options if c is not None):
        for cap in dict.fromkeys((None, problem.memory_limit)):
            if not budget.fits(actions):
                if skipped is not None:
                    skipped.add(name)
                return  # out of time: keep the variants built so far
            began = time.perf_counter()
            built = _build(name, problem, num_microbatches, costs, cap, options)
            if built is not None and _structure(built.problem) != wanted:
                return  # another placement: no cost or limit changes that
            timeline = _retarget(built, problem) if built is not None else None
            budget.observe(actions, time.perf_counter() - began)
            yield timeline
            if timeline is not None and enough is not None and timeline.makespan <= enough * (1 + 1e-9):
                return


PROBE_SIZES = (2, 4)
"""A probe builds a built-in at these multiples of the ranks' count of micro-batches (at most the problem's)."""


def _probe(name: str, problem: Problem, num_microbatches: int, wanted: dict, options: dict,
           budget: Budget) -> bool:
    """Whether built-in ``name`` may fit ``problem``: built at ``2p`` then ``4p`` micro-batches (at
    most ``num_microbatches``), its structure must be ``wanted``. True when neither size builds
    (the family may only accept the full count; the full build decides). A matching probe is also
    re-targeted, teaching ``budget`` what this entry's build and validation cost per action here."""
    p = problem.num_ranks
    for small in dict.fromkeys(min(num_microbatches, k * p) for k in PROBE_SIZES):
        began = time.perf_counter()
        built = _build(name, problem, small, Costs(), None, options)
        if built is None:
            continue
        if _structure(built.problem) != wanted:
            return False
        if _retarget(built, problem) is not None:  # a pass cut short by the limit would teach too little
            budget.observe(len(problem.tasks) * small, time.perf_counter() - began)
        return True
    return True


def _build(name: str, problem: Problem, num_microbatches: int, costs: Costs, cap: float | None,
           options: dict) -> Schedule | None:
    """Built-in ``name`` for ``problem``'s shape; None when the family refuses it."""
    try:
        built = build_schedule(name, problem.num_ranks, num_microbatches, costs=costs,
                               memory_limit=cap, **options)
    except (ValueError, ImportError):  # the family refuses this shape or limit
        return None
    if built.num_microbatches != num_microbatches or built.num_ranks != problem.num_ranks:
        return None  # two-replica schedules count micro-batch pairs
    return built


def _retarget(built: Schedule, problem: Problem) -> Timeline | None:
    """``built``'s lists run on ``problem`` (its durations, memory, limit), validated in ordered
    mode; None when they break a rule there (e.g. the memory limit)."""
    name, num_microbatches = built.name, built.num_microbatches
    schedule = Schedule(name=name, problem=problem, num_microbatches=num_microbatches, ranks=built.ranks)
    try:
        return validate(schedule, ordered=True)
    except ValueError:  # over the limit (or another order rule) on this problem's costs
        return None
