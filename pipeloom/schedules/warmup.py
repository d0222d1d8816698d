"""The forwards each rank of a fixed-order schedule runs before its first backward, per stage, read from the
builders' own rules without building the schedule.

A forward holds its stage's activations until its backward, so a rank's warm-up is one point of its
held-activation curve: a lower bound on its peak that costs nothing to compute (the cluster planner rules out
layouts with it before building their schedules). Schedules whose order depends on the costs or the memory
limit (zbv, the searched ones) have no such rule.
"""

from __future__ import annotations

from itertools import takewhile

from pipeloom.schedules.common import check_counts, v_rank_stages
from pipeloom.schedules.dualpipe import Step, check_dualpipe, dualpipe_program, dualpipe_rank_program
from pipeloom.schedules.interleaved import group_sizes, interleaved_warmup

__all__ = ["WARMUP_SCHEDULES", "RankWarmup", "warmup_forwards"]

WARMUP_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "dualpipe", "dualpipev")
"""The schedules :func:`warmup_forwards` knows."""

RankWarmup = tuple[tuple[int, int], ...]
"""One rank's warm-up: ``(stage, forwards)`` pairs, stages in increasing order."""


def warmup_forwards(name: str, num_ranks: int, num_microbatches: int, *,
                    stages_per_rank: int = 1) -> tuple[RankWarmup, ...]:
    """Per rank of ``name``'s schedule for these counts, the forwards of each stage it runs before its first
    backward (B, I or an overlapped pair), as its builder orders them. ValueError for a schedule not in
    :data:`WARMUP_SCHEDULES` or counts its builder refuses."""
    p, m = num_ranks, num_microbatches
    check_counts(name, p, m)
    if name == "gpipe":  # every forward first
        return tuple(((r, m),) for r in range(p))
    if name in ("1f1b", "zb-h1"):  # p-r-1 warm-up forwards and one more before the first B (zb-h1: lead p-r)
        return tuple(((r, min(p - r, m)),) for r in range(p))
    if name == "zb-h2":  # 2(p-r)-1 forwards before the first I
        return tuple(((r, min(2 * (p - r) - 1, m)),) for r in range(p))
    if name == "interleaved-1f1b":
        return _interleaved(p, m, stages_per_rank)
    if name == "dualpipev":  # dualpipev's check, then its rank r runs the program with h = r
        check_counts(name, p, m, min_microbatches=2 * p)
        return tuple(_leading(dualpipe_program(p, half_rank=r, num_microbatches=m), v_rank_stages(p, rank=r))
                     for r in range(p))
    if name == "dualpipe":
        check_dualpipe(p, m)
        return tuple(_leading(*dualpipe_rank_program(p, m, rank=r)) for r in range(p))
    raise ValueError(f"warmup_forwards knows {', '.join(WARMUP_SCHEDULES)}, not {name!r} (its order depends on "
                     "its costs: build it and read its held activations)")


def _interleaved(p: int, m: int, v: int) -> tuple[RankWarmup, ...]:
    """Interleaved 1F1B: the first ``warmup + 1`` forwards of the grouped order (each group through local stages
    0..v-1 in turn), local stage c of rank r being stage c p + r."""
    sizes = group_sizes(p, m)
    out = []
    for r in range(p):
        left = min(interleaved_warmup(p, v, sizes[0], r) + 1, m * v)
        counts = [0] * v
        for size in sizes:
            for c in range(v):
                take = min(size, left)
                counts[c] += take
                left -= take
        out.append(tuple((c * p + r, n) for c, n in enumerate(counts) if n))
    return tuple(out)


def _leading(program: list[Step], stages: tuple[int, int]) -> RankWarmup:
    """A DualPipe(V) rank: the leading forwards of its program, phase k running ``stages[k]``."""
    counts = [0, 0]
    for _, phase in takewhile(lambda step: step[0] == "F", program):
        counts[phase] += 1
    return tuple(sorted((stages[phase], n) for phase, n in enumerate(counts) if n))
