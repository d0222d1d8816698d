"""DualPipe and DualPipeV against the DeepSeek reference's program, closed forms and 1F1B."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pipeloom.errors import MemoryLimitError
from pipeloom.ir import Overlap
from pipeloom.schedules import build_schedule, schedule_info
from pipeloom.schedules.dualpipe import dualpipe, dualpipe_program, dualpipev
from pipeloom.schedules.one_f_one_b import one_f_one_b
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate

COSTS = [
    Costs(),
    Costs(f=1, b=2, w=1),
    Costs(f=2, b=3, w=1, memory=2, w_memory=0.5),
    Costs(f=1, b=1, w=1, comm=0.3),
    Costs(f=1.5, b=1, w=0.5, comm=1.0),
]
V_SIZES = [(p, m) for p in range(1, 17) for m in sorted({2 * p, 2 * p + 1, 3 * p + 2, 64}) if m <= 64]
DUAL_SIZES = [(p, m) for p in range(2, 17, 2) for m in sorted({2 * p, 2 * p + 2, 3 * p + 2, 64}) if m <= 64]


def _bubble(schedule) -> float:
    """Idle time of the idlest rank (the middle rank runs its first F&B pair not overlapped, so it is
    busier than the others)."""
    timeline = simulate(schedule)
    return timeline.makespan - min(timeline.busy)


# ------------------------------------------------------------------------ validity and inputs


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("p,m", V_SIZES)
def test_dualpipev_is_valid_and_ordered(p, m, costs):
    schedule = dualpipev(p, m, costs=costs)
    validate(schedule, ordered=True)
    assert schedule.num_microbatches == m
    assert schedule.problem.num_stages == 2 * p


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("p,m", DUAL_SIZES)
def test_dualpipe_is_valid_and_ordered_with_pairs_as_microbatches(p, m, costs):
    schedule = dualpipe(p, m, costs=costs)
    validate(schedule, ordered=True)
    assert schedule.num_microbatches == m // 2  # one IR micro-batch = one real micro-batch per direction
    assert schedule.problem.num_stages == 2 * p


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: dualpipev(4, 7), "at least 8 micro-batches .*; use 8 or more$"),
        (lambda: dualpipev(0, 8), "positive integer"),
        (lambda: dualpipe(3, 12), "even number of ranks.*such as 4$"),
        # The suggestion is always a valid count: even and >= 2p.
        (lambda: dualpipe(4, 9), "even number of micro-batches.*got 9; use 8 or 10$"),
        (lambda: dualpipe(4, 3), "at least 2p = 8 .*got 3; use 8$"),
        (lambda: dualpipe(4, 1), "got 1; use 8$"),
        (lambda: dualpipe(4, 6), "at least 2p = 8 .*got 6; use 8$"),
        (lambda: dualpipe(4, 0), "positive integer"),
        (lambda: dualpipe_program(2, half_rank=2, num_microbatches=8), "half_rank < num_half_ranks"),
        (lambda: dualpipe_program(4, half_rank=0, num_microbatches=7),
         "num_half_ranks <= num_microbatches / 2"),
    ],
)
def test_bad_inputs_raise_value_errors_that_say_what_is_needed(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("generator", [dualpipe, dualpipev])
def test_suggested_microbatch_counts_are_accepted(generator):
    """Every count a rejection suggests ("use 8", "use 10 or 12", "use 8 or more") builds."""
    for p in (2, 4, 6):
        for m in range(1, 3 * p + 2):
            try:
                generator(p, m)
            except ValueError as error:
                suggested = re.search(r"; use (\d+)(?: or (\d+))?", str(error))
                assert suggested, f"p={p} m={m}: no suggestion in {error}"
                for count in filter(None, suggested.groups()):
                    validate(generator(p, int(count)), ordered=True)


def test_registry_builds_both_with_split_backward():
    for name in ("dualpipe", "dualpipev"):
        assert schedule_info(name).splits_backward
        schedule = build_schedule(name, 4, 16)
        assert schedule.problem.splits_backward
        validate(schedule, ordered=True)


def test_memory_limit_reaches_the_problem_and_the_validator():
    costs = Costs(memory=2.0)
    validate(dualpipe(4, 16, costs=costs, memory_limit=10.0))  # peak (p+1) x 2 = 10
    with pytest.raises(MemoryLimitError):
        validate(dualpipe(4, 16, costs=costs, memory_limit=9.5))


# ---------------------------------------------------------------------- the reference's program


def test_dualpipev_golden_text_follows_the_reference_phases():
    # Hand-traced from the reference's step() with 2 ranks and 4 micro-batches (its "chunks"):
    # overlapped pairs as torch writes them, full backwards as B (the last rank's first F0&B1 is not
    # overlapped, as in the reference).
    assert dualpipev(2, 4).to_text() == (
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B (3F2;0B0)OVERLAP_F_B 3B2 "
        "(3F3;0B1)OVERLAP_F_B 3B3 0I2 0W2 0I3 0W3\n"
        "rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B (2F3;1B1)OVERLAP_F_B "
        "2B2 1B2 2I3 1I3 2W3 1W3"
    )


@pytest.mark.parametrize("P,M", [(1, 2), (2, 4), (3, 7), (4, 8), (8, 20)])
def test_program_counts_match_the_reference_loops(P, M):
    for h in range(P):
        program = dualpipe_program(P, half_rank=h, num_microbatches=M)
        for phase in (0, 1):  # a pair ("FB", k) is a forward of phase k and a full backward of 1 - k
            assert program.count(("F", phase)) + program.count(("FB", phase)) == M
            backwards = program.count(("B", phase)) + program.count(("Z", phase)) + program.count(("FB", 1 - phase))
            assert backwards == M
        # Phase 4's pairs: all overlapped but the middle rank's first one.
        assert program.count(("FB", 0)) == M - 2 * P + h + 1 - (h == P - 1)
        # Zero-bubble backwards: P-h-1 in phase 3, h+1 in phase 6, P-h-1 in phase 7.
        zero_bubble = sum(op == "Z" for op, _ in program)
        assert zero_bubble == 2 * (P - h - 1) + (h + 1)
        assert program.count(("W", -1)) == zero_bubble


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (2, 7), (3, 7), (4, 8), (4, 13), (5, 13), (8, 16)])
def test_dualpipev_is_torch_dualpipev_cell_for_cell(p, m):
    """torch 2.13's ScheduleDualPipeV order (its per-rank ``_calculate_single_rank_operations``, the
    ``pipeline_order`` it builds) is ours, overlapped pairs and full backwards included."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    order = object.__new__(torch_schedules.ScheduleDualPipeV)
    order.pp_group_size, order._n_microbatches = p, m
    ours = dualpipev(p, m)
    for rank in range(p):
        theirs = [str(action) for action in order._calculate_single_rank_operations(rank)]
        assert theirs == [str(action) for action in ours.ranks[rank]], f"rank {rank}"


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 13), (8, 16)])
def test_dualpipev_ranks_end_with_their_deferred_weight_gradients(p, m):
    # Phase 8 of the reference: rank r runs its last r+1 deferred W, after the last I (phase 6/7).
    for r, actions in enumerate(dualpipev(p, m).ranks):
        assert [a.kind for a in actions[-(r + 2):]] == ["I"] + ["W"] * (r + 1)


def test_dualpipe_halves_mirror_each_other():
    p = 8
    schedule = dualpipe(p, 24)
    def mirror(action):  # down stage s <-> up stage s + p
        if type(action) is Overlap:
            return Overlap(mirror(action.forward), mirror(action.backward))
        return action._replace(stage=(action.stage + p) % (2 * p))

    for r in range(p):
        assert [mirror(a) for a in schedule.ranks[r]] == list(schedule.ranks[p - 1 - r])


@pytest.mark.parametrize("costs", COSTS[:3], ids=str)
@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_dualpipe_bubble_equals_dualpipev_on_half_the_ranks(P, costs):
    # DualPipe is DualPipeV's program on each half: with per-stage costs equal (V stages are half a
    # rank share, so double the V costs) both schedules idle exactly as long.
    doubled = Costs(f=2 * costs.f, b=2 * costs.b, w=2 * costs.w)
    m = 4 * P + 2
    expected = _bubble(dualpipev(P, m, costs=doubled))
    assert _bubble(dualpipe(2 * P, 2 * m, costs=costs)) == pytest.approx(expected)


# ----------------------------------------------------------------------- bubble and memory


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
def test_dualpipev_bubble_with_equal_costs_is_p_minus_1_stage_forwards(p):
    # the reference's count, whose pairs take max(F, B): overlap 1
    assert _bubble(dualpipev(p, 4 * p, costs=Costs(f=2, b=2, w=2, overlap=1))) == pytest.approx((p - 1) * 1.0)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_dualpipe_bubble_with_equal_costs_is_half_p_minus_1_forwards(p):
    costs = Costs(f=1.5, b=1.5, w=1.5, overlap=1)
    assert _bubble(dualpipe(p, 4 * p, costs=costs)) == pytest.approx((p // 2 - 1) * 1.5)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_at_the_default_pair_cost_the_bubbles_are_twice_the_overlapped_ones(p):
    # a pair priced F + B (the default): the docstrings' second figures, (p-1)f and (p-2)f for f = b = w
    assert _bubble(dualpipev(p, 4 * p, costs=Costs(f=2, b=2, w=2))) == pytest.approx((p - 1) * 2.0)
    assert _bubble(dualpipe(p, 4 * p, costs=Costs(f=1.5, b=1.5, w=1.5))) == pytest.approx((p - 2) * 1.5)


@pytest.mark.parametrize(
    "f,b,w", [(1, 1, 1), (1, 2, 1), (2, 3, 1), (1, 3, 0.25), (2, 2, 2), (2, 1, 1), (1, 1, 0.5)]
)
@pytest.mark.parametrize("P", [2, 3, 4, 6])
def test_bubble_within_the_reference_formula_with_overlapped_pairs(P, f, b, w):
    # DeepSeek-V3: (P-1)(F&B + B - 3W), F&B = max(F, B) (an overlapped pair, overhead 0) and B = I + W;
    # it holds where F <= I (the pairs written F then B instead, as before, exceed it: 2 > 1 at P = 2).
    # The reference's F&B is the pair fully overlapped: overlap 1 (the default prices F + B).
    if f > b:
        pytest.skip("the reference's count assumes a forward no longer than the input-gradient backward")
    fb = max(f, b + w)
    bound = (P - 1) * (fb + (b + w) - 3 * w)
    assert _bubble(dualpipe(2 * P, 8 * P, costs=Costs(f=f, b=b, w=w, overlap=1))) <= bound + 1e-9


@pytest.mark.parametrize("overhead", [0.0, 0.5, 2.0])
def test_bubble_with_overlap_overhead_follows_the_pair_time(overhead):
    # Every pair takes F + B + overhead (by default): each rank's busy time grows by the
    # overhead once per pair, and the simulator takes the overhead from the problem or the call.
    schedule = dualpipev(4, 16)
    plain = simulate(schedule)
    timeline = simulate(schedule, overlap_overhead=overhead)
    pairs = [sum(type(a) is Overlap for a in actions) for actions in schedule.ranks]
    assert timeline.busy == pytest.approx([b + overhead * n for b, n in zip(plain.busy, pairs)])
    carried = dataclasses.replace(schedule, problem=dataclasses.replace(schedule.problem, overlap_overhead=overhead))
    assert simulate(carried).makespan == timeline.makespan


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_dualpipev_bubble_ratio_below_one_f_one_b_with_equal_costs(p):
    for m in (2 * p, 4 * p):
        assert validate(dualpipev(p, m)).bubble_ratio < validate(one_f_one_b(p, m)).bubble_ratio


@pytest.mark.parametrize("w_memory", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_dualpipev_peak_memory_is_p_plus_half_on_the_middle_rank(p, w_memory):
    # The reference's 2p+1 stage forwards (p + 1/2 rank shares) on the last rank, whose first F&B pair
    # runs its forward before its backward; p elsewhere: a pair takes its forward's activations and
    # frees its backward's at once (a pair's memory effect is the sum of its parts).
    timeline = simulate(dualpipev(p, 3 * p + 1, costs=Costs(memory=1.0, w_memory=w_memory)))
    assert timeline.peak_memory == pytest.approx([p] * (p - 1) + [p + 0.5])


@pytest.mark.parametrize("w_memory", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_dualpipe_peak_memory_is_p_plus_1_on_the_middle_ranks(p, w_memory):
    # As DualPipeV on each half: p + 1 forwards on the two middle ranks, p on the others.
    timeline = simulate(dualpipe(p, 3 * p + 2, costs=Costs(memory=2.0, w_memory=w_memory)))
    middle = {p // 2 - 1, p // 2}
    assert timeline.peak_memory == pytest.approx([2.0 * (p + 1 if r in middle else p) for r in range(p)])
