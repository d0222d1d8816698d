"""V-Half and V-Min: validity, and peak memory against the documented 1/2 and 1/3 of 1F1B's.

Oracles: the validator (ordered mode, memory limit); the memories of "Pipeline Parallelism with
Controllable Memory" (Qi et al., 2024): (p+2)//2 and (p+4)//3 micro-batches against 1F1B's p, and
its bubbles p/(2m) and 2p/(3m) at f = b = w; the simulator's peak; zbv's lower bound
(p-1)(f/2 + comm) + m(f+b+w); the building block's own arithmetic (one pass per slot modulo 6).
"""

from __future__ import annotations

import pytest

from pipeloom.schedules.common import make_schedule, v_problem
from pipeloom.schedules.v_block import BLOCK_PERIOD, block_offsets, block_order
from pipeloom.schedules.v_memory import v_half, v_half_memory, v_min, v_min_memory
from pipeloom.schedules.zbv import zbv
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate

COSTS = [Costs(), Costs(f=18522, b=18086, w=9337, comm=601), Costs(f=1, b=2, w=0.5, comm=0.1, w_memory=0.43)]


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize(("build", "documented", "fraction"),
                         [(v_half, v_half_memory, 1 / 2), (v_min, v_min_memory, 1 / 3)])
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 4), (4, 8), (6, 12), (8, 24), (12, 30), (16, 64)])
def test_valid_with_the_documented_memory(build, documented, fraction, p, m, costs):
    schedule = build(p, m, costs=costs)
    timeline = validate(schedule, ordered=True)  # raises on deadlock, order or memory-limit errors
    limit = documented(p, costs=costs)
    assert schedule.problem.memory_limit == limit
    assert max(timeline.peak_memory) <= limit + 1e-9
    # the documented fraction of 1F1B's peak p (rounded up to whole micro-batches as in the paper)
    assert limit <= (fraction * p + 2) * costs.memory
    bound = (p - 1) * (costs.f / 2 + costs.comm) + m * (costs.f + costs.b + costs.w)
    assert timeline.makespan >= bound * (1 - 1e-12)


def test_memory_is_half_and_a_third_of_one_f_one_b_at_scale():
    p = 24
    half, third = v_half(p, 48), v_min(p, 48)
    assert max(simulate(half).peak_memory) == 13 and max(simulate(third).peak_memory) == 9  # 1F1B: 24
    assert half.name == "v-half" and third.name == "v-min"


def test_bubble_at_equal_costs_is_near_the_documented_one():
    """f = b = w: V-Half about p/(2m), V-Min about 2p/(3m) (measured here: at or below both at p=8, m=32)."""
    p, m = 8, 32
    for build, documented in ((v_half, p / (2 * m)), (v_min, 2 * p / (3 * m))):
        timeline = simulate(build(p, m))
        assert 1 - 3 * m / timeline.makespan <= documented + 1e-9


def test_a_limit_above_the_documented_memory_keeps_the_documented_order():
    schedule = v_half(4, 8, memory_limit=7)
    assert schedule.problem.memory_limit == 7  # the caller's limit, checked by the validator
    assert schedule.ranks == v_half(4, 8).ranks  # the order stays at the documented memory, 3
    assert max(simulate(schedule).peak_memory) <= 3
    assert max(simulate(v_min(8, 16, memory_limit=3)).peak_memory) <= 3


@pytest.mark.parametrize("variant", ["half", "min"])
@pytest.mark.parametrize("p", range(1, 25))
def test_the_building_block_is_a_steady_state(variant, p):
    """Per rank the four F/I slots differ modulo 6 (two slots left for W), and each pass comes after
    the pass before it on the V: F down from rank r-1, F up from r+1, I up from r-1, I down from r+1."""
    offsets = block_offsets(p, variant)
    for r, (f_down, f_up, i_up, i_down) in enumerate(offsets):
        assert len({slot % BLOCK_PERIOD for slot in (f_down, f_up, i_up, i_down)}) == 4
        assert f_down < f_up < i_up < i_down
        if r > 0:
            assert f_down > offsets[r - 1][0] and i_up > offsets[r - 1][2]
        if r < p - 1:
            assert f_up > offsets[r + 1][1] and i_down > offsets[r + 1][3]
    # the lifespans (F to I of both stages) sum to 4p (V-Min) and 6p (V-Half) slots, plus the gap
    spans = {sum(i_down - f_down + i_up - f_up for f_down, f_up, i_up, i_down in [o]) for o in offsets}
    assert len(spans) == 1
    assert spans.pop() in ((4 * p, 4 * p + 4) if variant == "min" else (6 * p - 1, 6 * p + 5))


@pytest.mark.parametrize(("variant", "documented"), [("half", v_half_memory), ("min", v_min_memory)])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (3, 2), (5, 4), (6, 6), (7, 20), (9, 27), (12, 13)])
def test_the_block_order_holds_the_documented_memory_when_w_frees_it_all(variant, documented, p, m):
    """With W freeing all of F's memory (the paper's memory model) the block order stays within
    (p+2)//2 or (p+4)//3 micro-batches on every rank, and it is valid and ordered."""
    costs = Costs(w_memory=1.0)
    problem = v_problem(p, costs=costs, memory_limit=documented(p, costs=costs))
    schedule = make_schedule("v", problem=problem, num_microbatches=m, ranks=block_order(p, m, variant))
    timeline = validate(schedule, ordered=True)
    assert max(timeline.peak_memory) <= documented(p, costs=costs)


def test_v_min_meets_the_papers_bubble_at_p16_m64():
    """2p/(3m) = 0.167 at p=16, m=64, f = b = w (the zbv list order under the same memory: 0.227)."""
    p, m = 16, 64
    schedule = v_min(p, m)
    timeline = simulate(schedule)
    assert timeline.bubble_ratio <= 2 * p / (3 * m)
    assert timeline.bubble_ratio < 0.14  # measured 0.133
    assert schedule.ranks == tuple(tuple(rank) for rank in block_order(p, m, "min"))
    listed = simulate(zbv(p, m, memory_limit=v_min_memory(p)))
    assert listed.bubble_ratio > 0.2  # the order this replaced


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize(("build", "variant", "documented"),
                         [(v_half, "half", v_half_memory), (v_min, "min", v_min_memory)])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 32), (16, 32)])
def test_never_slower_than_the_block_or_the_list_order(build, variant, documented, p, m, costs):
    """The schedule is the shorter of the building block and zbv's list order at the same memory."""
    timeline = simulate(build(p, m, costs=costs))
    listed = simulate(zbv(p, m, costs=costs, memory_limit=documented(p, costs=costs)))
    block = make_schedule("v", problem=v_problem(p, costs=costs, memory_limit=None), num_microbatches=m,
                          ranks=block_order(p, m, variant))
    assert timeline.makespan <= min(listed.makespan, simulate(block).makespan) * (1 + 1e-12)


def test_an_unknown_block_is_refused():
    with pytest.raises(ValueError, match="'half' or 'min'"):
        block_offsets(4, "third")
