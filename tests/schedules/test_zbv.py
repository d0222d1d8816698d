"""ZB-V: V placement, validity, the memory limit, and how it compares with ZB-H1.

Oracles: the validator (ordered mode, memory limit); the V placement of the zero-bubble paper
(rank r holds stages r and 2p-1-r, each with half of a rank's costs); the lower bound
(p-1)(f/2 + comm) + m(f+b+w) (rank p-1 cannot start earlier and then has m(f+b+w) of work);
ZB-H1's closed form m(f+b+w) + (p-1)(f+b-w) (DESIGN §6) and ZB-H1 itself (zero_bubble.zb_h1).
"""

from __future__ import annotations

import pytest

import pipeloom.schedules.zbv as zbv_module
from pipeloom.errors import MemoryLimitError, PipeloomError
from pipeloom.ir import Schedule
from pipeloom.problem import Costs
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.schedules.zbv import zbv
from pipeloom.schedules.zero_bubble import zb_h1
from pipeloom.sim import simulate
from pipeloom.validate import validate

PAPER = Costs(f=18522, b=18086, w=9337, comm=601)
"""The zero-bubble paper's profiled setting (p=8, m=24)."""
COSTS = {
    "equal": Costs(f=1, b=1, w=1),
    "paper": PAPER,
    "comm": Costs(f=1, b=2, w=0.5, comm=0.3),
    "w_memory": Costs(f=2, b=1, w=1, memory=2, w_memory=0.5, comm=0.1),
    "zero-f-w": Costs(f=0, b=1, w=0, comm=1),
}
SIZES = [(1, 1), (1, 5), (2, 1), (2, 3), (3, 7), (4, 4), (5, 13), (7, 2), (8, 24), (9, 64),
         (12, 30), (16, 1), (16, 17), (16, 64)]


def _lower_bound(p: int, m: int, costs: Costs) -> float:
    return (p - 1) * (costs.f / 2 + costs.comm) + m * (costs.f + costs.b + costs.w)


@pytest.mark.parametrize("cost_name", list(COSTS))
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_valid_in_ordered_mode_within_the_default_limit(p, m, cost_name):
    costs = COSTS[cost_name]
    schedule = zbv(p, m, costs=costs)
    timeline = validate(schedule, ordered=True)  # raises on deadlock, memory or order errors
    assert schedule.problem.memory_limit == min(p, m) * costs.memory  # 1F1B's peak
    assert max(timeline.peak_memory) <= schedule.problem.memory_limit + 1e-9
    assert timeline.makespan >= _lower_bound(p, m, costs) * (1 - 1e-12)


def test_v_placement_and_half_share_costs():
    p, costs = 4, Costs(f=2, b=3, w=1, memory=2, w_memory=0.5)
    problem = zbv(p, 8, costs=costs).problem
    for stage in range(2 * p):
        rank = stage if stage < p else 2 * p - 1 - stage
        half = costs.stage(rank, share=0.5)
        f, i, w = (problem.task((stage, kind)) for kind in "FIW")
        assert f.ranks == i.ranks == w.ranks == (rank,)
        assert (f.duration, i.duration, w.duration) == (half.f, half.b, half.w)
        assert (f.memory, i.memory, w.memory) == (half.memory, -(half.memory - half.w_memory),
                                                  -half.w_memory)
    assert problem.comm_latency == 0.0
    assert REGISTRY["zbv"].splits_backward


@pytest.mark.parametrize("factor", [1.0, 1.5, 2.5, 4.0, 100.0])
@pytest.mark.parametrize("cost_name", ["equal", "paper", "w_memory"])
def test_every_limit_at_or_above_one_microbatch_is_honoured(factor, cost_name):
    costs = COSTS[cost_name]
    for p, m in [(1, 6), (3, 9), (6, 20), (8, 24)]:
        limit = factor * costs.memory
        schedule = zbv(p, m, costs=costs, memory_limit=limit)
        assert schedule.problem.memory_limit == limit
        timeline = validate(schedule, ordered=True)
        assert max(timeline.peak_memory) <= limit + 1e-9, f"p={p} m={m} limit={limit}"


def test_the_validator_would_reject_the_schedule_under_a_tighter_limit():
    """The limit is binding (so honouring it is not trivial): 1F1B's peak p is reached."""
    schedule = zbv(4, 16)
    assert max(validate(schedule).peak_memory) == 4
    tighter = Schedule(name="zbv", problem=zbv(4, 16, memory_limit=3).problem,
                       num_microbatches=16, ranks=schedule.ranks)
    with pytest.raises(MemoryLimitError):
        validate(tighter)


@pytest.mark.parametrize(("memory", "limit"), [(1.0, 0.99), (1.0, 0.0), (2.0, 1.5)])
def test_a_limit_below_one_microbatch_names_the_smallest_workable_one(memory, limit):
    with pytest.raises(ValueError, match=f"smallest workable limit is {memory:g}"):
        zbv(4, 8, costs=Costs(memory=memory), memory_limit=limit)


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="memory_limit must be >= 0"):
        zbv(4, 8, memory_limit=-1.0)


def test_bad_counts_raise_value_error():
    for p, m in [(0, 4), (4, 0), (2.5, 4), (True, 4)]:
        with pytest.raises(ValueError):
            zbv(p, m)


def test_every_policy_deadlocking_is_a_pipeloom_error_naming_the_inputs(monkeypatch):
    """No known input makes every policy deadlock, so force it: the error must name the inputs."""
    monkeypatch.setattr(zbv_module, "_list_schedule", lambda plan, policy: None)
    with pytest.raises(PipeloomError, match=r"p=3, m=5, memory_limit=3.*please report it"):
        zbv(3, 5)


def test_the_registry_builds_the_same_schedule():
    assert build_schedule("zbv", 5, 11, costs=PAPER) == zbv(5, 11, costs=PAPER)


def test_small_schedule_snapshot():
    """Golden text for p=2, m=4, f=b=w=1: 2p-1 warm-up forwards on rank 0, W only in gaps/at the end."""
    assert zbv(2, 4).to_text() == (
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3F1 3I1 0I0 0F3 3F2 3I2 0I1 3W0 3F3 3I3 0I2 3W1 0I3 "
        "0W0 3W2 0W1 3W3 0W2 0W3\n"
        "rank 1: 1F0 2F0 1F1 2F1 2I0 1I0 1F2 2F2 2I1 1I1 1F3 2F3 2I2 1I2 2I3 1I3 2W0 1W0 "
        "2W1 1W1 2W2 1W2 2W3 1W3"
    )


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 13, 16])
def test_equal_costs_reach_the_lower_bound(p):
    """f=b=w=1, no latency: makespan = 3m + (p-1)/2 exactly, a bubble constant in m."""
    for m in range(p, 65, 3):
        timeline = simulate(zbv(p, m))
        assert timeline.makespan == 3 * m + (p - 1) / 2, f"p={p} m={m}"


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32), (16, 32), (16, 64)])
def test_equal_costs_bubble_below_zb_h1(p, m):
    costs = Costs(f=1, b=1, w=1)
    ours = validate(zbv(p, m, costs=costs), ordered=True)
    closed_form_h1 = 1 - 3 * m / (3 * m + p - 1)  # ZB-H1: makespan 3m + p - 1
    assert ours.bubble_ratio < closed_form_h1
    theirs = validate(zb_h1(p, m, costs=costs), ordered=True)
    assert ours.bubble_ratio < theirs.bubble_ratio
    assert max(ours.peak_memory) <= max(theirs.peak_memory)


def test_beats_zb_h1_on_the_paper_setting():
    p, m = 8, 24
    ours = validate(zbv(p, m, costs=PAPER), ordered=True)
    assert max(ours.peak_memory) <= p * PAPER.memory  # 1F1B's peak, the default limit
    h1_closed_form = m * (PAPER.f + PAPER.b + PAPER.w) + (p - 1) * (PAPER.f + PAPER.b - PAPER.w)
    assert ours.makespan < h1_closed_form  # ZB-H1 without latency; latency only adds to it
    assert ours.makespan <= 1.01 * _lower_bound(p, m, PAPER)  # within 1% of the bound
    theirs = validate(zb_h1(p, m, costs=PAPER), ordered=True)
    assert ours.makespan < theirs.makespan


def test_costs_change_the_order():
    """Cost-aware: a large latency or a cheap W gives a different order than equal costs."""
    equal = zbv(6, 18).ranks
    assert zbv(6, 18, costs=Costs(comm=2.0)).ranks != equal
    assert zbv(6, 18, costs=PAPER).ranks != equal
