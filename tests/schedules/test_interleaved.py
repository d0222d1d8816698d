"""Interleaved 1F1B against the Megatron bubble formula, its stated memory formula, 1F1B and the validator."""

from __future__ import annotations

import pytest

from pipeloom.errors import MemoryLimitError
from pipeloom.schedules import build_schedule
from pipeloom.schedules.interleaved import group_sizes, interleaved_1f1b
from pipeloom.schedules.looped_bfs import looped_bfs
from pipeloom.schedules.one_f_one_b import one_f_one_b
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate

COST_TRIPLES = [Costs(), Costs(f=1.0, b=2.0, w=1.0), Costs(f=3.0, b=1.0, w=0.5)]


def megatron_makespan(p: int, m: int, v: int, costs: Costs) -> float:
    """Narayanan et al. 2021: m(F+B) of work plus a bubble of (p-1)(F+B)/v, F and B per rank."""
    per_microbatch = costs.f + costs.b + costs.w
    return m * per_microbatch + (p - 1) * per_microbatch / v


def stated_peak(p: int, m: int, v: int, rank: int, costs: Costs) -> float:
    """The docstring's memory formula: min(w_r + 1, m v)/v micro-batches of a rank's share."""
    if v == 1:
        warmup = p - rank - 1
    else:
        warmup = (v - 1) * group_sizes(p, m)[0] + 2 * (p - rank - 1)
    return min(warmup + 1, m * v) / v * costs.memory


def test_golden_text_two_ranks_two_stages_each():
    # Worked by hand: groups [0,1] and [2,3]; rank 0 warms up with (v-1)p + 2(p-1) = 4 forwards,
    # rank 1 with (v-1)p = 2; local stages 0, 1 forward and 1, 0 backward within each group.
    schedule = interleaved_1f1b(2, 4, stages_per_rank=2)
    assert schedule.to_text() == (
        "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )


@pytest.mark.parametrize("costs", COST_TRIPLES, ids=["1-1-1", "1-2-1", "3-1-0.5"])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_makespan_matches_megatron_formula_when_ranks_divide_microbatches(costs, v):
    for p in (1, 2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            timeline = simulate(interleaved_1f1b(p, m, costs=costs, stages_per_rank=v))
            assert timeline.makespan == pytest.approx(megatron_makespan(p, m, v, costs)), (p, m)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_bubble_ratio_strictly_shrinks_as_stages_per_rank_grows(p, m):
    ratios = [simulate(interleaved_1f1b(p, m, stages_per_rank=v)).bubble_ratio for v in (1, 2, 4)]
    assert ratios[0] > ratios[1] > ratios[2] > 0
    # The ratio itself is bubble / (work + bubble) with bubble (p-1)(F+B)/v.
    for v, ratio in zip((1, 2, 4), ratios, strict=True):
        assert ratio == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))


def test_one_stage_per_rank_is_exactly_one_f_one_b():
    # v = 1 puts stage r on rank r with 1F1B's warm-up, so the lists, makespan and memory agree.
    costs = Costs(f=1.0, b=2.0, w=0.5)
    for p in (1, 2, 3, 5, 8):
        for m in (1, 2, 3, 7, 8, 13):
            ours = interleaved_1f1b(p, m, costs=costs, stages_per_rank=1)
            reference = one_f_one_b(p, m, costs=costs)
            assert ours.ranks == reference.ranks
            ours_t, reference_t = simulate(ours), simulate(reference)
            assert ours_t.makespan == pytest.approx(reference_t.makespan)
            assert ours_t.peak_memory == pytest.approx(reference_t.peak_memory)


def test_peak_memory_matches_stated_formula():
    costs = Costs(memory=2.0)
    for v in (1, 2, 3):
        for p in (1, 2, 3, 4, 6):
            for m in (1, 2, 3, 5, 6, 7, 12, 13):
                peaks = simulate(interleaved_1f1b(p, m, costs=costs, stages_per_rank=v)).peak_memory
                expected = [stated_peak(p, m, v, r, costs) for r in range(p)]
                assert peaks == pytest.approx(expected), (v, p, m)


def test_rank_zero_holds_more_than_one_f_one_b():
    # Docstring: p + (p-1)/v on rank 0 when p divides m and m is large; 1F1B holds p.
    peaks = simulate(interleaved_1f1b(4, 16, stages_per_rank=2)).peak_memory
    assert peaks[0] == pytest.approx(4 + 3 / 2)
    assert peaks[0] > max(simulate(one_f_one_b(4, 16)).peak_memory)


def test_group_sizes_are_balanced_non_increasing_and_at_least_p():
    for p in range(1, 17):
        for m in range(1, 65):
            sizes = group_sizes(p, m)
            assert sum(sizes) == m
            assert len(sizes) == max(1, m // p)
            assert sizes == sorted(sizes, reverse=True)
            assert max(sizes) - min(sizes) <= 1
            assert min(sizes) >= min(p, m)
            if m % p == 0:
                assert sizes == [p] * (m // p)


@pytest.mark.parametrize("v, m_step", [(2, 1), (3, 4), (4, 7)])
def test_valid_in_order_for_every_rank_and_microbatch_count(v, m_step):
    # Deadlock freedom for m not a multiple of p is what the grouping rule has to get right
    # (v = 2: every p in 1..16 and m in 1..64; v = 3, 4: every 4th and 7th m).
    for p in range(1, 17):
        for m in range(1, 65, m_step):
            validate(interleaved_1f1b(p, m, stages_per_rank=v), ordered=True)


@pytest.mark.parametrize("generator", [interleaved_1f1b, looped_bfs])
def test_valid_with_communication_latency(generator):
    """Both looped-layout schedules (this module's placement) stay valid with latency, and latency
    costs at least one hop: the same action lists without latency (whose makespan the formula
    tests check) end later than any one rank's work, so every critical path of theirs crosses
    ranks at least once and gets at least ``comm`` longer.
    """
    costs = Costs(f=1.0, b=2.0, w=1.0, comm=0.5)
    no_latency = Costs(f=1.0, b=2.0, w=1.0)
    for v in (1, 2, 3):
        for p in (2, 3, 4, 7):
            for m in (1, 3, 4, 9, 16):
                schedule = generator(p, m, costs=costs, stages_per_rank=v)
                reference = generator(p, m, costs=no_latency, stages_per_rank=v)
                assert schedule.ranks == reference.ranks, "the order does not depend on costs"
                without = simulate(reference)
                assert without.makespan > max(reference.problem.work_per_microbatch()) * m
                with_latency = validate(schedule, ordered=True).makespan
                assert with_latency >= without.makespan + costs.comm - 1e-9, (v, p, m)


def test_memory_limit_reaches_the_validator():
    schedule = interleaved_1f1b(4, 8, stages_per_rank=2, memory_limit=5.0)
    assert schedule.problem.memory_limit == 5.0
    with pytest.raises(MemoryLimitError, match="rank 0"):
        validate(schedule)  # rank 0 holds 4 + 3/2
    validate(interleaved_1f1b(4, 8, stages_per_rank=2, memory_limit=5.5))


@pytest.mark.parametrize("bad", [0, -1, "x", 2.0, True, None])
def test_rejects_bad_stages_per_rank(bad):
    with pytest.raises(ValueError, match="stages_per_rank must be an integer >= 1"):
        interleaved_1f1b(4, 8, stages_per_rank=bad)
    with pytest.raises(ValueError, match="stages_per_rank"):
        build_schedule("interleaved-1f1b", 4, 8, stages_per_rank=bad)


@pytest.mark.parametrize("p, m", [(0, 4), (4, 0), (-1, 4), (4, 2.5)])
def test_rejects_bad_counts(p, m):
    with pytest.raises(ValueError, match="positive integer"):
        interleaved_1f1b(p, m)


def test_registry_builds_the_same_schedule():
    direct = interleaved_1f1b(4, 10, stages_per_rank=3)
    assert build_schedule("interleaved-1f1b", 4, 10, stages_per_rank=3).ranks == direct.ranks
