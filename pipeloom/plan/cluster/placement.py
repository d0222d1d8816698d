"""Where a layout's layers and stages go: the even cut of the decoder layers into stages, each stage's pipeline
rank (looped or in a V), and a lower bound on any schedule's makespan from the stages' work."""

from __future__ import annotations

from itertools import accumulate

from pipeloom.plan.cluster.layer_time import PhaseTimes
from pipeloom.plan.cluster.layout import SCHEDULES, Layout

__all__ = ["stage_layers", "rank_of", "rank_stages", "work_bound"]


def stage_layers(spec_layers: tuple[str, ...], stages: int) -> list[tuple[str, ...]]:
    """The layer kinds of each of ``stages`` stages in model order: an even split, the remainder going to
    the middle stages first (the first holds the embedding, the last the head)."""
    base, extra = divmod(len(spec_layers), stages)
    order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 2 else list(range(stages))
    counts = [base] * stages
    for j in order[:extra]:
        counts[j] += 1
    out, start = [], 0
    for count in counts:
        out.append(spec_layers[start:start + count])
        start += count
    return out


def rank_of(stage: int, layout: Layout) -> int:
    """The pipeline rank of model stage ``stage``: looped (interleaved, linear) or a V."""
    if SCHEDULES[layout.schedule] == "v":
        return stage if stage < layout.pp else 2 * layout.pp - 1 - stage
    return stage % layout.pp


def work_bound(layout: Layout, m: int, times: list[PhaseTimes]) -> float:
    """A lower bound on any schedule's makespan: a rank starts after micro-batch 0's forwards through the
    model stages before its first one, then does all its own work (DualPipeV: an overlapped pair of a
    forward and a backward takes F + B less the communication each part hides, so the pairs save at most
    every F's and I's ``comm``)."""
    bound = 0.0
    before = list(accumulate((t.f for t in times), initial=0.0))  # before[j]: forwards of stages 0 .. j-1
    ranks = rank_stages(layout)
    for stages in ranks:
        busy = m * sum(times[j].f + times[j].i + times[j].w for j in stages)
        if layout.schedule == "dualpipev":
            busy -= m * sum(times[j].f_comm + times[j].i_comm for j in stages)  # each part in at most one pair
        bound = max(bound, before[min(stages)] + busy)
    if layout.schedule in ("1f1b", "interleaved-1f1b"):
        # a full backward in micro-batch order: rank p-1's last action is stage p-1's B of the last micro-batch,
        # after which that micro-batch's B still runs through stages p-2 .. 0 on the other ranks
        stages = ranks[layout.pp - 1]
        busy = m * sum(times[j].f + times[j].i + times[j].w for j in stages)
        bound = max(bound, before[layout.pp - 1] + busy + sum(times[j].i + times[j].w for j in range(layout.pp - 1)))
    return bound


def rank_stages(layout: Layout) -> list[list[int]]:
    """Per pipeline rank, its model stages in order (:func:`rank_of` inverted)."""
    if SCHEDULES[layout.schedule] == "v":
        return [[r, 2 * layout.pp - 1 - r] for r in range(layout.pp)]
    return [list(range(r, layout.stages, layout.pp)) for r in range(layout.pp)]
