"""Chimera against the paper's bubble ratio, its unit grid, our closed forms, the grid order and 1F1B."""

from __future__ import annotations

import pytest

from pipeloom.errors import ArgumentError
from pipeloom.schedules import build_schedule, schedule_info
from pipeloom.schedules.chimera import chimera, chimera_caps, chimera_list_order, chimera_slots
from pipeloom.schedules.one_f_one_b import one_f_one_b
from pipeloom.sim import simulate
from pipeloom.stages import Costs
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
@pytest.mark.parametrize("order", ["best", "list"])
def test_chimera_is_valid_and_ordered(p, m, costs, order):
    schedule = chimera(p, m, costs=costs, order=order)
    validate(schedule, ordered=True)
    assert schedule.num_microbatches == m // 2  # one IR micro-batch = one real micro-batch per direction
    assert not schedule.problem.splits_backward


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: chimera(3, 8), "even number of ranks"),
        (lambda: chimera(1, 8), "even number of ranks"),
        (lambda: chimera(4, 7), "must be even, got 7; use 6 or 8$"),
        (lambda: chimera(4, 1), "must be even, got 1; use 2$"),  # never the invalid 0
        (lambda: chimera(4, 0), "positive integer"),
        (lambda: chimera(0, 4), "positive integer"),
        (lambda: chimera(4, 8, order="fast"), "'best', 'grid' or 'list'"),
    ],
)
def test_bad_inputs_raise_value_errors_that_say_what_is_needed(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_registry_passes_the_documented_order_option():
    """build_schedule("chimera", ..., order=...) had been refused ("takes no extra options") though documented."""
    grid = build_schedule("chimera", 4, 16, order="grid")
    assert grid.ranks == chimera(4, 16, order="grid").ranks != build_schedule("chimera", 4, 16, order="list").ranks
    with pytest.raises(ArgumentError, match="order must be 'best', 'grid' or 'list'"):
        build_schedule("chimera", 4, 16, order="x")


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
    timeline = simulate(chimera(p, p * units, costs=Costs(f=f, b=b, w=w), order="grid"))
    expected = (p - 2) * (max(F, B) + (units - 1) * abs(B - F))
    assert [timeline.makespan - busy for busy in timeline.busy] == pytest.approx([expected] * p)


def test_paper_ratio_does_not_hold_when_backward_is_twice_forward():
    # B = 2F: each seam between units leaves (p-2)F idle, so the ratio is above the paper's.
    ratio = validate(chimera(8, 32, costs=Costs(f=1, b=1, w=1), order="grid")).bubble_ratio
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
    timeline = simulate(chimera(p, m, costs=Costs(memory=2.0), order="grid"))
    expected = [2.0 * (p // 2 + 1 + min(r, p - 1 - r)) for r in range(p)]
    assert list(timeline.peak_memory) == pytest.approx(expected)


def test_fewer_microbatches_than_ranks_hold_less():
    timeline = simulate(chimera(8, 2))
    assert max(timeline.peak_memory) == pytest.approx(2.0)  # one pair: one F per replica


B_TWICE_F = Costs(f=1, b=1, w=1)  # B = b + w = 2F, the library's default costs


@pytest.mark.parametrize("p", [4, 8, 16])
@pytest.mark.parametrize("units", [2, 4, 8])
def test_backward_twice_forward_beats_one_f_one_b(p, units):
    # 1F1B: makespan (m+p-1)(F+B). Chimera's list order removes the grid's seams and gets below it.
    m = p * units
    ours = validate(chimera(p, m, costs=B_TWICE_F), ordered=True)
    one_f_one_b_makespan = (m + p - 1) * 3
    assert validate(one_f_one_b(p, m, costs=B_TWICE_F)).makespan == one_f_one_b_makespan
    assert ours.makespan < one_f_one_b_makespan - (p - 1)  # at least (p-1)F shorter
    assert ours.bubble_ratio < validate(one_f_one_b(p, m, costs=B_TWICE_F)).bubble_ratio


@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 2, 2), (0.5, 0.25, 0.75)])
@pytest.mark.parametrize("p", [4, 6, 8, 16])
@pytest.mark.parametrize("units", [2, 3, 8])
def test_list_order_bubble_is_the_units_bubble_without_seams(p, units, f, b, w):
    # B = 2F or 4F: (p-2)B idle per rank for any number of units, the grid's first unit alone.
    F, B = f, b + w
    timeline = simulate(chimera(p, p * units, costs=Costs(f=f, b=b, w=w), order="list"))
    assert [timeline.makespan - busy for busy in timeline.busy] == pytest.approx([(p - 2) * B] * p)
    assert timeline.makespan == pytest.approx(p * units * (F + B) + (p - 2) * B)


@pytest.mark.parametrize("costs", COSTS + [Costs(f=3, b=1, w=0)], ids=str)
@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m > p])
def test_default_is_never_slower_than_direct_concatenation(p, m, costs):
    best, grid = simulate(chimera(p, m, costs=costs)), simulate(chimera(p, m, costs=costs, order="grid"))
    assert best.makespan <= grid.makespan


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_paper_unit_is_kept_up_to_p_microbatches(p):
    for m in range(2, p + 1, 2):
        assert chimera(p, m).ranks == chimera(p, m, order="grid").ranks


def test_default_switches_to_the_list_order_when_it_is_shorter():
    assert chimera(8, 64).ranks == chimera(8, 64, order="list").ranks  # B = 2F: list is shorter
    same = Costs(f=2, b=1, w=1)  # F = B: the grid is optimal and wins the tie
    assert chimera(8, 64, costs=same).ranks == chimera(8, 64, costs=same, order="grid").ranks


@pytest.mark.parametrize("p", [2, 4, 6, 8, 16])
def test_caps_sum_to_p_and_admit_a_forward_of_each_direction(p):
    caps = [chimera_caps(p, r) for r in range(p)]
    assert all(down + up == p and down >= 1 and up >= 1 for down, up in caps)
    assert caps == [(up, down) for down, up in reversed(caps)]  # mirror-symmetric


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("p,m", [(2, 64), (4, 6), (4, 64), (8, 18), (8, 64), (16, 50), (16, 64)])
def test_list_order_holds_at_most_p_microbatches_per_rank(p, m, costs):
    # Per rank at most chimera_caps' sum = p forwards in flight, 1F1B's peak (rank 0).
    timeline = simulate(chimera(p, m, costs=costs, order="list"))
    assert max(timeline.peak_memory) <= p * costs.memory + 1e-9
    assert max(simulate(chimera(p, m, costs=costs)).peak_memory) <= p * costs.memory + 1e-9


def test_list_order_keeps_each_stage_in_microbatch_order():
    for rank, actions in enumerate(chimera_list_order(6, 20)):
        for stage in (rank, 11 - rank):
            for kind in "FB":
                microbatches = [a.microbatch for a in actions if a.stage == stage and a.kind == kind]
                assert microbatches == list(range(20))


@pytest.mark.parametrize("costs", [Costs(), Costs(f=1, b=1, w=1, comm=0.3)], ids=str)
@pytest.mark.parametrize("p", range(2, 17, 2))
def test_every_even_size_up_to_64_is_valid_and_ordered(p, costs):
    for m in range(2, 65, 2):
        validate(chimera(p, m, costs=costs), ordered=True)
