"""A run's comparison as one JSON-ready summary: what ``pipeloom trace --json`` prints and its
tables show (step times, the ratio, per-task medians, per-rank busy, idle, wait and send time)."""

from __future__ import annotations

import statistics
from typing import Any

from pipeloom.trace.analysis import _NS, Comparison, _duration_samples, _indices, per_step_idle, per_step_mean
from pipeloom.trace.explain import explain_ratio

__all__ = ["trace_summary"]


def trace_summary(comparison: Comparison) -> dict[str, Any]:
    """The comparison as a JSON-ready dict (seconds): step times, their ratio, the estimated comm
    latency, per-task medians and per rank the compute (busy), wait and send time per step (means
    over the steps) and idle = step time - busy (mean over the steps too); ``explanation``: what the
    prediction knew and left out (:func:`explain_ratio`), also appended to ``notes``."""
    run, predicted, steps = comparison.run, comparison.predicted, comparison.steps
    samples = _duration_samples(run, steps)
    explanation = explain_ratio(comparison)
    brackets = [max(r[i].end_ns for r in run.ranks) - min(r[i].start_ns for r in run.ranks)
                for i in _indices(run, steps)]
    return {
        "schedule": run.schedule.name,
        "num_ranks": run.world_size,
        "num_microbatches": run.schedule.num_microbatches,
        "unit": "seconds",
        "steps_recorded": list(run.steps),
        "steps_used": list(steps),
        "step_shown": comparison.step,
        "measured_step_time": comparison.measured_step_time,
        "predicted_step_time": predicted.makespan,
        "ratio": comparison.ratio,
        "step_times": [{"step": step, "time": time} for step, time in comparison.step_times.items()],
        "wall_step_time": statistics.median(brackets) * _NS,
        "comm_latency": predicted.schedule.problem.comm_latency,
        "tasks": [{"stage": task.stage, "kind": task.kind, "median": task.duration,
                   "count": len(samples[task.key])} for task in predicted.schedule.problem.tasks],
        "ranks": [{"rank": rank,
                   "busy": per_step_mean(run, steps, rank, "compute"),
                   "idle": per_step_idle(run, steps, rank),
                   "wait": per_step_mean(run, steps, rank, "wait"),
                   "send": per_step_mean(run, steps, rank, "send"),
                   "predicted_busy": predicted.busy[rank],
                   "predicted_idle": max(0.0, predicted.makespan - predicted.busy[rank])}
                  for rank in range(run.world_size)],
        "explanation": explanation,
        "notes": [*run.notes, *explanation],
    }
