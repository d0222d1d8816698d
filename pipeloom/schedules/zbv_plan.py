"""The per-stage numbers zbv's schedule builders read off a V-placement Problem (the simulator's floats)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeloom.problem import Problem
from pipeloom.schedules.common import v_rank_stages, v_stage_ranks

__all__ = ["VPlan", "v_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class VPlan:
    """Per-stage durations, memory deltas and latencies read off the Problem (same floats as sim)."""

    num_ranks: int
    num_microbatches: int
    rank_stages: tuple[tuple[int, int], ...]
    """``rank_stages[r]``: rank r's (first, second) stage in the V placement."""
    owner: tuple[int, ...]
    """``owner[s]``: the rank that runs stage s."""
    duration: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
    """``duration[kind][stage]`` for kind 0 = F, 1 = I, 2 = W."""
    memory: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
    """``memory[kind][stage]``: held-memory change when the action starts."""
    latency_f: tuple[float, ...]
    """Delay between F(s-1) ending and F(s) starting (0 on the same rank)."""
    latency_i: tuple[float, ...]
    """Delay between I(s+1) ending and I(s) starting (0 on the same rank)."""
    limit: float
    """Per-rank memory cap, with a rounding tolerance below the validator's."""


def v_plan(problem: Problem, num_microbatches: int, limit: float) -> VPlan:
    """The VPlan of a V-placement ``problem`` (stage s on rank min(s, 2p-1-s)) under ``limit``."""
    p = problem.num_ranks
    stages = range(2 * p)
    f, i, w = ([problem.task((s, kind)) for s in stages] for kind in "FIW")
    comm = problem.comm_latency
    owner = v_stage_ranks(p)
    return VPlan(
        num_ranks=p,
        num_microbatches=num_microbatches,
        rank_stages=tuple(v_rank_stages(p, rank=r) for r in range(p)),
        owner=tuple(owner),
        duration=(tuple(t.duration for t in f), tuple(t.duration for t in i), tuple(t.duration for t in w)),
        memory=(tuple(t.memory for t in f), tuple(t.memory for t in i), tuple(t.memory for t in w)),
        latency_f=tuple(0.0 if s == 0 or owner[s - 1] == owner[s] else comm for s in stages),
        latency_i=tuple(0.0 if s == 2 * p - 1 or owner[s + 1] == owner[s] else comm for s in stages),
        limit=limit + 1e-12 * max(1.0, abs(limit)),
    )
