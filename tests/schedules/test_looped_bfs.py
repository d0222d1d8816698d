"""Looped BFS against its derived makespan formula, GPipe, interleaved 1F1B and the validator."""

from __future__ import annotations

import pytest

from pipeloom.errors import MemoryLimitError
from pipeloom.schedules import build_schedule
from pipeloom.schedules.gpipe import gpipe
from pipeloom.schedules.interleaved import interleaved_1f1b
from pipeloom.schedules.looped_bfs import looped_bfs
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate

COST_TRIPLES = [Costs(), Costs(f=1.0, b=2.0, w=1.0), Costs(f=3.0, b=1.0, w=0.0)]


def derived_makespan(p: int, m: int, v: int, costs: Costs) -> float:
    """(v max(m, p) + min(m, p) - 1)(F+B)/v: for m >= p each rank's forwards run back to back
    after r stage-forwards of lead-in; for m < p each of the v waves waits for micro-batch 0 to
    cross all p ranks; the backward pass mirrors the forward one."""
    return (v * max(m, p) + min(m, p) - 1) * (costs.f + costs.b + costs.w) / v


def test_golden_text_two_ranks_two_stages_each():
    # By hand: all forwards of local stage 0, then of local stage 1, then backwards 1 then 0.
    assert looped_bfs(2, 2, stages_per_rank=2).to_text() == (
        "rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n"
        "rank 1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"
    )


@pytest.mark.parametrize("costs", COST_TRIPLES, ids=["1-1-1", "1-2-1", "3-1-0"])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_makespan_matches_derived_formula(costs, v):
    for p in (1, 2, 3, 4, 7, 8):
        for m in (1, 2, 3, 5, 8, 9, 16, 21):
            timeline = simulate(looped_bfs(p, m, costs=costs, stages_per_rank=v))
            assert timeline.makespan == pytest.approx(derived_makespan(p, m, v, costs)), (p, m)


def test_same_bubble_as_interleaved_when_ranks_divide_microbatches():
    costs = Costs(f=1.0, b=2.0, w=1.0)
    for v in (2, 4):
        for p, m in ((2, 4), (4, 8), (4, 12), (8, 16)):
            ours = simulate(looped_bfs(p, m, costs=costs, stages_per_rank=v)).makespan
            assert ours == pytest.approx(
                simulate(interleaved_1f1b(p, m, costs=costs, stages_per_rank=v)).makespan
            )


def test_bubble_ratio_strictly_shrinks_as_stages_per_rank_grows():
    for p, m in ((2, 2), (4, 8), (8, 4)):
        ratios = [simulate(looped_bfs(p, m, stages_per_rank=v)).bubble_ratio for v in (1, 2, 4)]
        assert ratios[0] > ratios[1] > ratios[2] > 0


def test_one_stage_per_rank_is_exactly_gpipe():
    for p in (1, 2, 5):
        for m in (1, 4, 7):
            assert looped_bfs(p, m, stages_per_rank=1).ranks == gpipe(p, m).ranks


def test_every_rank_holds_all_m_microbatches():
    # m*v forwards of share 1/v each are held before any backward: m micro-batches of memory.
    costs = Costs(memory=1.5)
    for v in (1, 2, 3):
        for p in (1, 3, 4):
            for m in (1, 2, 5, 8):
                peaks = simulate(looped_bfs(p, m, costs=costs, stages_per_rank=v)).peak_memory
                assert peaks == pytest.approx([m * costs.memory] * p)


def test_valid_in_order_for_every_rank_and_microbatch_count():
    for v in (2, 3):
        for p in range(1, 17):
            for m in range(1, 65, 3):
                validate(looped_bfs(p, m, stages_per_rank=v), ordered=True)


def test_memory_limit_reaches_the_validator():
    schedule = looped_bfs(4, 8, stages_per_rank=2, memory_limit=7.0)
    assert schedule.problem.memory_limit == 7.0
    with pytest.raises(MemoryLimitError):
        validate(schedule)  # every rank holds m = 8
    validate(looped_bfs(4, 8, stages_per_rank=2, memory_limit=8.0))


@pytest.mark.parametrize("bad", [0, -2, "x", 1.5, False])
def test_rejects_bad_stages_per_rank(bad):
    with pytest.raises(ValueError, match="stages_per_rank must be an integer >= 1"):
        looped_bfs(4, 8, stages_per_rank=bad)
    with pytest.raises(ValueError, match="stages_per_rank"):
        build_schedule("looped-bfs", 4, 8, stages_per_rank=bad)


@pytest.mark.parametrize("p, m", [(0, 4), (4, 0), (True, 4)])
def test_rejects_bad_counts(p, m):
    with pytest.raises(ValueError, match="positive integer"):
        looped_bfs(p, m)


def test_registry_builds_the_same_schedule():
    direct = looped_bfs(3, 5, stages_per_rank=3)
    assert build_schedule("looped-bfs", 3, 5, stages_per_rank=3).ranks == direct.ranks
