"""V-Half and V-Min: validity, and peak memory against the documented 1/2 and 1/3 of 1F1B's.

Oracles: the validator (ordered mode, memory limit); the memories of "Pipeline Parallelism with
Controllable Memory" (Qi et al., 2024): (p+2)//2 and (p+4)//3 micro-batches against 1F1B's p;
the simulator's peak; zbv's lower bound (p-1)(f/2 + comm) + m(f+b+w).
"""

from __future__ import annotations

import pytest

from pipeloom.problem import Costs
from pipeloom.schedules.v_memory import v_half, v_half_memory, v_min, v_min_memory
from pipeloom.sim import simulate
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
