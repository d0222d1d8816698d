"""Why a measured step differs from its prediction: what the simulator knew (the action order, each
task's median time, one communication latency) and, measured per step, what it left out (task-time
variation, time between actions, receive waits beyond the latency, the spread of the steps)."""

from __future__ import annotations

import statistics

from pipeloom.formatting import format_seconds
from pipeloom.trace.analysis import _NS, Comparison, _indices, per_step_mean

__all__ = ["explain_ratio", "rank_gaps"]

_SLOW_STEP = 1.5  # a step this many times the median is called out as an outlier


def rank_gaps(comparison: Comparison) -> list[tuple[float, float]]:
    """Per rank, means over the steps used of ``(gap, wait)`` in seconds: between the rank's first
    and last compute event of a step, the time in neither compute nor a receive wait (host work:
    launches, Python, bookkeeping), and the time in receive waits."""
    run = comparison.run
    indices = _indices(run, comparison.steps)
    result = []
    for rank in range(run.world_size):
        gap = wait = 0
        for i in indices:
            computes = run.ranks[rank][i].of_kind("compute")
            if not computes:
                continue
            first, last = computes[0].start_ns, computes[-1].end_ns
            busy = sum(e.end_ns - e.start_ns for e in computes)
            waits = sum(min(e.end_ns, last) - max(e.start_ns, first) for e in run.ranks[rank][i].of_kind("wait")
                        if e.end_ns > first and e.start_ns < last)
            gap += max(0, last - first - busy - waits)
            wait += waits
        result.append((gap * _NS / len(indices), wait * _NS / len(indices)))
    return result


def explain_ratio(comparison: Comparison) -> list[str]:
    """Lines saying what ``measured / predicted`` is made of, for the ``pipeloom trace`` report and
    picture: the first names the ratio and what the prediction used, the others what it left out,
    each measured (per step, means over the steps used), and which steps the ratio rests on."""
    run, predicted = comparison.run, comparison.predicted
    ratio = "-" if comparison.ratio is None else f"{comparison.ratio:.2f}"
    latency = predicted.schedule.problem.comm_latency
    lines = [f"measured / predicted {ratio}: the prediction replays the schedule's action order with each "
             f"task's median time and one comm latency ({format_seconds(latency)}) per cross-rank "
             "dependency; measured per step, it leaves out:"]
    busiest = max(range(run.world_size), key=lambda r: predicted.busy[r])
    measured_busy = per_step_mean(run, comparison.steps, busiest, "compute")
    expected_busy = predicted.busy[busiest]
    share = f" ({measured_busy / expected_busy - 1:+.0%})" if expected_busy > 0 else ""
    lines.append(f"- task-time variation: busiest rank {busiest} computes {format_seconds(measured_busy)} "
                 f"against {format_seconds(expected_busy)} from the medians{share}")
    gaps = rank_gaps(comparison)
    worst = max(range(run.world_size), key=lambda r: gaps[r][0])
    lines.append(f"- host time between actions (launches, Python, bookkeeping): "
                 f"{format_seconds(statistics.fmean(g for g, _ in gaps))} per rank, most on rank {worst} "
                 f"({format_seconds(gaps[worst][0])})")
    predicted_waits = [max(0.0, (ends[-1] - starts[0]) - busy) if ends else 0.0
                       for starts, ends, busy in zip(predicted.starts, predicted.ends, predicted.busy)]
    lines.append(f"- receive waits (latency and late senders): {format_seconds(statistics.fmean(w for _, w in gaps))} "
                 f"per rank measured, {format_seconds(statistics.fmean(predicted_waits))} predicted")
    lines.append(_steps_line(comparison))
    return lines


def _steps_line(comparison: Comparison) -> str:
    """Which steps the ratio rests on, their spread, and any that look like warm-up outliers."""
    times = comparison.step_times
    median = comparison.measured_step_time
    median_step = min(step for step, time in times.items() if time == median)
    left_out = [step for step in comparison.run.steps if step not in times]
    text = (f"- steps: the ratio uses step {median_step}'s time ({format_seconds(median)}), the median of "
            f"steps {_numbers(list(times))}, which took {format_seconds(min(times.values()))} to "
            f"{format_seconds(max(times.values()))}")
    if left_out:
        text += f"; left out: step{'s' if len(left_out) > 1 else ''} {_numbers(left_out)}"
    slow = [step for step, time in times.items() if time > _SLOW_STEP * median]
    if slow:
        text += (f"; {_numbers(slow)} took over {_SLOW_STEP}x the median (warm-up?): "
                 "--steps picks the steps to measure")
    return text


def _numbers(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
