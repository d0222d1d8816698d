"""ZB-V: V placement, validity, the memory limit, and how it compares with ZB-H1.

Oracles: the validator (ordered mode, memory limit); the V placement of the zero-bubble paper
(rank r holds stages r and 2p-1-r, each with half of a rank's costs); the lower bound
(p-1)(f/2 + comm) + m(f+b+w) (rank p-1 cannot start earlier and then has m(f+b+w) of work);
ZB-H1's closed form m(f+b+w) + (p-1)(f+b-w) (docs/design.md §6) and ZB-H1 itself (zero_bubble.zb_h1);
the zero-bubble authors' ZB-V generator's makespans recorded in benchmarks/data/zbv_reference.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pipeloom.schedules.zbv as zbv_module
from pipeloom.errors import MemoryLimitError, PipeloomError
from pipeloom.ir import Schedule
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.schedules.common import make_schedule, v_problem
from pipeloom.schedules.zbv import zbv
from pipeloom.schedules.zbv_plan import v_plan
from pipeloom.schedules.zbv_rounds import round_candidates
from pipeloom.schedules.zero_bubble import zb_h1
from pipeloom.sim import simulate
from pipeloom.stages import Costs
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


REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "zbv_reference.json"
"""The authors' generator's makespans (benchmarks/zbv_reference_data.py); 324 cells, p up to 16."""


def _reference_cells(max_p: int, max_m: int) -> list[dict]:
    cells = json.loads(REFERENCE.read_text())["cells"]
    return [c for c in cells if c["makespan"] is not None and c["p"] <= max_p and c["m"] <= max_m]


@pytest.mark.parametrize("cell", _reference_cells(8, 24),
                         ids=lambda c: f"{c['costs']}-p{c['p']}-m{c['m']}-L{c['memory_limit']:g}-wm{c['w_memory']:g}")
def test_never_slower_than_the_authors_generator(cell):
    """Against the recorded cells with p <= 8, m <= 24 (108 of 324; the benchmark runs all)."""
    costs = Costs(f=cell["f"], b=cell["b"], w=cell["w"], comm=cell["comm"], w_memory=cell["w_memory"])
    schedule = zbv(cell["p"], cell["m"], costs=costs, memory_limit=cell["memory_limit"])
    timeline = validate(schedule, ordered=True)
    assert timeline.makespan <= cell["makespan"] * (1 + 1e-9)


def test_the_former_worst_cell_matches_the_generator():
    """f 1 b 2 w 0.5 comm 0.1, p 8, m 16, limit 8: the list scheduler alone gives 71.95, the generator 66.5."""
    costs = Costs(f=1, b=2, w=0.5, comm=0.1)
    problem = v_problem(8, costs=costs, memory_limit=8)
    plan = v_plan(problem, 16, 8)
    list_only = min(zbv_module._list_schedule(plan, policy)[1] for policy in zbv_module._VARIANTS)
    assert list_only == pytest.approx(71.95)
    assert simulate(zbv(8, 16, costs=costs, memory_limit=8)).makespan == pytest.approx(66.5)


@pytest.mark.parametrize(("p", "m", "cost_name", "factor"),
                         [(1, 3, "comm", 1), (2, 4, "equal", 1), (4, 16, "equal", 1), (5, 13, "paper", 1.5),
                          (8, 16, "comm", 1), (6, 20, "w_memory", 2), (3, 2, "comm", 1)])
def test_round_candidates_are_valid_and_timed_like_the_simulator(p, m, cost_name, factor):
    """Every candidate the round construction returns passes the validator (ordered mode, the limit)
    and its own clock gives the simulator's makespan."""
    costs = COSTS[cost_name]
    limit = factor * min(p, m) * costs.memory
    problem = v_problem(p, costs=costs, memory_limit=limit)
    for estimate, ranks in round_candidates(v_plan(problem, m, limit)):
        timeline = validate(make_schedule("zbv", problem=problem, num_microbatches=m, ranks=ranks), ordered=True)
        assert timeline.makespan == pytest.approx(estimate, rel=1e-12)


@pytest.mark.parametrize(("p", "m"), [(4, 16), (8, 24)])
def test_round_warm_up_fills_rank_r_with_2_p_minus_r_minus_1_first_stage_forwards(p, m):
    """Equal costs, default limit: rank r runs 2(p-r)-1 first-stage forwards before anything else."""
    problem = v_problem(p, costs=Costs(), memory_limit=p)
    _, ranks = round_candidates(v_plan(problem, m, p))[0]
    for r, order in enumerate(ranks):
        depth = next(i for i, action in enumerate(order) if action.kind != "F" or action.stage >= p)
        assert depth == 2 * (p - r) - 1, f"rank {r}"


def test_a_round_candidate_is_used_only_if_valid_and_shorter(monkeypatch):
    """Candidates claiming makespan 0 that break the order, or are valid but slower, are dropped."""
    costs = Costs(f=1, b=2, w=0.5, comm=0.1)
    monkeypatch.setattr(zbv_module, "round_candidates", lambda plan: [])
    list_only = zbv(4, 8, costs=costs)
    bad = [list(reversed(order)) for order in list_only.ranks]
    monkeypatch.setattr(zbv_module, "round_candidates", lambda plan: [(0.0, bad)])
    assert zbv(4, 8, costs=costs) == list_only
    slower = zbv(4, 8, costs=costs, memory_limit=1).ranks  # valid under the larger limit too
    assert simulate(zbv(4, 8, costs=costs, memory_limit=1)).makespan > simulate(list_only).makespan
    monkeypatch.setattr(zbv_module, "round_candidates", lambda plan: [(0.0, slower)])
    assert zbv(4, 8, costs=costs) == list_only  # valid but not shorter by the simulator


@pytest.mark.parametrize("cost_name", list(COSTS))
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 5), (4, 8), (5, 13), (8, 24)])
def test_stopping_at_the_makespan_floor_builds_the_same_order(monkeypatch, p, m, cost_name):
    """The floor is below every order built (every policy, every round candidate), and zbv with the stop
    gives the order it gives without it (the floor patched to 0: every try runs)."""
    costs = COSTS[cost_name]
    for limit in (None, max(costs.memory, 0.5 * p * costs.memory)):
        stopped = zbv(p, m, costs=costs, memory_limit=limit)
        problem = stopped.problem
        plan = v_plan(problem, m, problem.memory_limit)
        floor = zbv_module._makespan_floor(problem, plan)
        built = [result[1] for policy in zbv_module._VARIANTS
                 if (result := zbv_module._list_schedule(plan, policy)) is not None]
        built += [makespan for makespan, _ in round_candidates(plan)]
        assert min(built) >= floor * (1 - 1e-12), (limit, min(built), floor)
        with monkeypatch.context() as patch:
            patch.setattr(zbv_module, "_makespan_floor", lambda problem, plan: 0.0)
            assert zbv(p, m, costs=costs, memory_limit=limit) == stopped, limit


def test_an_order_at_the_floor_ends_the_tries(monkeypatch):
    """Equal costs: the default policy reaches the floor, so no other policy and no round runs."""
    calls = []
    real = zbv_module._list_schedule
    monkeypatch.setattr(zbv_module, "_list_schedule", lambda plan, policy: calls.append(policy) or real(plan, policy))
    monkeypatch.setattr(zbv_module, "round_candidates", lambda plan: pytest.fail("rounds ran"))
    schedule = zbv(8, 24, costs=Costs(f=1, b=1, w=1, w_memory=0.5))
    assert calls == [zbv_module._DEFAULT]
    assert simulate(schedule).makespan == 3 * 24 + 7 / 2


@pytest.mark.parametrize("p", [2, 3, 5, 8, 12])
def test_every_rank_warms_up_at_least_as_deep_as_1f1b(p):
    """Under the default memory limit rank r runs at least min(p - r, m) forwards of its first stage before its first
    backward there, as 1F1B's rank r (the cluster planner's memory bound counts them before it builds a zbv),
    whatever the costs; measured, min(max(2 (p - r) - 2, p - 1), m)."""
    from pipeloom.schedules.zbv import first_stage_warmups

    for m in sorted({1, p - 1, p, p + 1, 2 * p, 3 * p} - {0}):
        # the planner's grid: I / F in steps of 0.5, W / F of 0.25, W holding any fraction of F's memory
        for b, w, held in ((1.0, 1.0, 0.0), (1.15, 0.45, 0.5), (2.0, 0.25, 0.0), (0.75, 1.0, 0.5), (0.5, 0.25, 0.9),
                           (3.0, 1.5, 0.1), (0.5, 1.5, 0.9), (3.0, 0.25, 0.1)):
            built = build_schedule("zbv", p, m, costs=Costs(f=1.0, b=b, w=w, memory=1.0, w_memory=held))
            depths = first_stage_warmups(built)
            assert all(n >= min(max(2 * (p - r) - 2, p - 1), m) for r, n in enumerate(depths)), (p, m, b, w, held)
