"""Chimera against the paper's bubble ratio, its unit grid, our closed forms and 1F1B."""

from __future__ import annotations


import pytest

from pipeloom.problem import Costs
from pipeloom.schedules import build_schedule, schedule_info
from pipeloom.schedules.chimera import chimera, chimera_slots
from pipeloom.schedules.one_f_one_b import one_f_one_b
from pipeloom.sim import simulate
from pipeloom.validate import validate

COSTS = [
    Costs(),
    Costs(f=1, b=1, w=0),
    Costs(f=2, b=3, w=1, memory=2),
    Costs(f=1, b=1, w=1, comm=0.3),
    Costs(f=1.5, b=0.5, w=0.5, comm=1.0),
]
SIZES = [(p, m) for p in range(2, 17, 2) for m in sorted({2, p, p + 2, 2 * p, 3 * p + 2, 64}) if m % 2 == 0]


def _paper_ratio(p: int, m: int) -> float:
    """Li & Hoefler, SC'21, Table 2: Chimera's bubble ratio with D = p stages and N = m micro-batches."""
    return (p - 2) / (2 * m + p - 2)


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("p,m", SIZES)
def test_chimera_is_valid_and_ordered(p, m, costs):
    schedule = chimera(p, m, costs=costs)
    validate(schedule, ordered=True)
    assert schedule.num_microbatches == m // 2  # one IR micro-batch = one real micro-batch per direction
    assert not schedule.problem.splits_backward


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: chimera(3, 8), "even number of ranks"),
        (lambda: chimera(1, 8), "even number of ranks"),
        (lambda: chimera(4, 7), "must be even"),
        (lambda: chimera(4, 0), "positive integer"),
        (lambda: chimera(0, 4), "positive integer"),
    ],
)
def test_bad_inputs_raise_value_errors_that_say_what_is_needed(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_registry_builds_chimera_with_full_backward():
    assert not schedule_info("chimera").splits_backward
    validate(build_schedule("chimera", 4, 8), ordered=True)


def test_unit_golden_text():
    # The paper's unit for D = 4: each pipeline runs 1F1B on its 2 micro-batches, the down
    # forwards and up backwards on one slot parity, the up forwards and down backwards on the other.
    assert chimera(4, 4).to_text() == (
        "rank 0: 0F0 0F1 7F0 7B0 7F1 7B1 0B0 0B1\n"
        "rank 1: 1F0 6F0 1F1 6F1 6B0 1B0 6B1 1B1\n"
        "rank 2: 5F0 2F0 5F1 2F1 2B0 5B0 2B1 5B1\n"
        "rank 3: 4F0 4F1 3F0 3B0 3F1 3B1 4B0 4B1"
    )


@pytest.mark.parametrize("p,pairs", [(2, 3), (4, 5), (8, 16), (16, 9)])
def test_slot_grid_is_a_timed_schedule(p, pairs):
    # With every action one slot long, each action's slot is free on its rank and comes after its deps.
    slot = {}
    for r in range(p):
        for s, action in chimera_slots(p, r, pairs):
            assert (r, s) not in slot.values(), f"rank {r} slot {s} used twice"
            slot[action] = (r, s)
    problem = chimera(p, 2 * pairs).problem
    for (stage, kind, mb), (_, s) in slot.items():
        for dep in problem.task((stage, kind)).deps:
            assert slot[(dep[0], dep[1], mb)][1] < s


@pytest.mark.parametrize("p", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("units", [1, 2, 4])
@pytest.mark.parametrize("costs", [Costs(f=2, b=1, w=1), Costs(f=1, b=1, w=0)], ids=str)
def test_bubble_ratio_matches_the_paper_when_forward_equals_backward(p, units, costs):
    m = p * units
    assert validate(chimera(p, m, costs=costs)).bubble_ratio == pytest.approx(_paper_ratio(p, m), abs=1e-12)


@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 0.5, 0), (2, 1, 0), (1, 3, 1), (3, 1, 0)])
@pytest.mark.parametrize("p", [4, 6, 8])
@pytest.mark.parametrize("units", [1, 2, 3])
def test_bubble_per_rank_closed_form(p, units, f, b, w):
    # (p-2)(max(F, B) + (m/p - 1)|B - F|): the unit's bubble plus one (p-2)|B-F| per seam.
    F, B = f, b + w
    timeline = simulate(chimera(p, p * units, costs=Costs(f=f, b=b, w=w)))
    expected = (p - 2) * (max(F, B) + (units - 1) * abs(B - F))
    assert [timeline.makespan - busy for busy in timeline.busy] == pytest.approx([expected] * p)


def test_paper_ratio_does_not_hold_when_backward_is_twice_forward():
    # B = 2F: each seam between units leaves (p-2)F idle, so the ratio is above the paper's.
    ratio = validate(chimera(8, 32, costs=Costs(f=1, b=1, w=1))).bubble_ratio
    assert ratio > _paper_ratio(8, 32) + 0.1


@pytest.mark.parametrize("p", [4, 8, 16])
def test_bubble_ratio_below_one_f_one_b_when_forward_equals_backward(p):
    costs = Costs(f=2, b=1, w=1)
    for m in (p, 4 * p):
        ours = validate(chimera(p, m, costs=costs)).bubble_ratio
        assert ours < validate(one_f_one_b(p, m, costs=costs)).bubble_ratio


@pytest.mark.parametrize("p", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("extra", [0, 2, 2 * 8 + 4])
def test_peak_memory_from_half_p_plus_1_at_the_ends_to_p_in_the_middle(p, extra):
    m = p + extra
    timeline = simulate(chimera(p, m, costs=Costs(memory=2.0)))
    expected = [2.0 * (p // 2 + 1 + min(r, p - 1 - r)) for r in range(p)]
    assert list(timeline.peak_memory) == pytest.approx(expected)


def test_fewer_microbatches_than_ranks_hold_less():
    timeline = simulate(chimera(8, 2))
    assert max(timeline.peak_memory) == pytest.approx(2.0)  # one pair: one F per replica
