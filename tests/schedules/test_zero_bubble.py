"""ZB-H1 and ZB-H2 against the zero-bubble paper's formulas, the makespan lower bound, 1F1B and the validator.

Oracles: Qi et al. (ICLR 2024) §2: ZB-H1 has 1F1B's memory and a bubble of (p-1)(F+I-W); ZB-H2
holds about 2p micro-batches and has no bubble inside a rank's busy span. The lower bound
m(F+I+W) + (p-1)F holds for any schedule: the last rank cannot start before (p-1)F.
Golden lists are worked by hand from the rules in the docstrings.
"""

from __future__ import annotations

import pytest

from pipeloom.errors import MemoryLimitError
from pipeloom.schedules import build_schedule
from pipeloom.schedules.one_f_one_b import one_f_one_b
from pipeloom.schedules.zero_bubble import zb_h1, zb_h2
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate

PAPER = Costs(f=18522, b=18086, w=9337, comm=601)
"""Qi et al.'s measured per-stage F, B (our I), W and communication times (p=8, m=24)."""


def work(m: int, costs: Costs) -> float:
    return m * (costs.f + costs.b + costs.w)


def lower_bound(p: int, m: int, costs: Costs) -> float:
    """Any schedule: rank p-1 starts after p-1 forwards (and hops), then runs m(F+I+W) of work."""
    return (p - 1) * (costs.f + costs.comm) + work(m, costs)


def idle_inside_span(timeline, rank: int) -> float:
    """Idle time between a rank's first start and last end (the paper's notion of bubble)."""
    return timeline.ends[rank][-1] - timeline.starts[rank][0] - timeline.busy[rank]


# ---------------------------------------------------------------------------------------- golden


def test_zb_h1_golden_text_follows_the_torch_deferred_w_rule():
    # p=3, m=4. Rank r: p-r-1 warm-up F, then F, I per step k and a W only when k >= r; rank r's
    # first r W's run at the end. Rank 1: F0 | F1 I0 | F2 I1 W0 | F3 I2 W1 | I3 W2 | W3.
    assert zb_h1(3, 4).to_text() == (
        "rank 0: 0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3\n"
        "rank 1: 1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3\n"
        "rank 2: 2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"
    )


def test_zb_h2_golden_text_gap_rule():
    # p=3, m=6: rank r leads with 2(p-r)-1 F; gaps after I_0..I_3 (k < 2p-2) hold one action, later
    # gaps two; a remaining F goes first, W's fill the rest; rank r ends with 2r+1 W's.
    assert zb_h2(3, 6).to_text() == (
        "rank 0: 0F0 0F1 0F2 0F3 0F4 0I0 0F5 0I1 0W0 0I2 0W1 0I3 0W2 0I4 0W3 0W4 0I5 0W5\n"
        "rank 1: 1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1F5 1I3 1W0 1I4 1W1 1W2 1I5 1W3 1W4 1W5\n"
        "rank 2: 2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2F5 2W0 2I5 2W1 2W2 2W3 2W4 2W5"
    )


@pytest.mark.parametrize("p, m", [(4, 8), (6, 12), (8, 24)])
def test_trailing_w_counts(p, m):
    """ZB-H1 defers r W's of rank r to the end, ZB-H2 2r+1 (m >= 2p-1)."""
    for generator, deferred in ((zb_h1, lambda r: r), (zb_h2, lambda r: 2 * r + 1)):
        for r, actions in enumerate(generator(p, m).ranks):
            last_input = max(i for i, a in enumerate(actions) if a.kind == "I")
            tail = actions[last_input + 1:]
            # ZB-H1 also runs the W of its own last I there when r < m.
            expected = deferred(r) + (1 if generator is zb_h1 else 0)
            assert [a.kind for a in tail] == ["W"] * expected, (generator.__name__, r)


# ------------------------------------------------------------------------------------------ ZB-H1


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 16])
def test_zb_h1_makespan_equal_costs(p):
    """F=I=W=1: 3m+p-1 for m >= p (the lower bound), 2m+2p-1 for m < p."""
    for m in range(1, 3 * p + 3):
        timeline = validate(zb_h1(p, m), ordered=True)
        expected = 3 * m + p - 1 if m >= p else 2 * m + 2 * p - 1
        assert timeline.makespan == expected, (p, m)
        if m >= p:
            assert timeline.makespan == lower_bound(p, m, Costs())


@pytest.mark.parametrize(
    "costs",
    [Costs(f=1, b=2, w=1), Costs(f=2, b=1, w=0.5), Costs(f=1, b=0.5, w=1), Costs(f=0.5, b=1, w=1),
     Costs(f=0.3, b=1, w=0.2), Costs(f=18522, b=18086, w=9337)],
    ids=["I>W", "F>I>W", "W>I", "F<W", "I>>F+W", "paper-no-comm"],
)
def test_zb_h1_bubble_per_rank_formula(costs):
    """Bubble per rank (p-1)*max(F+I-W, F, I); the paper's (p-1)(F+I-W) when W <= F, I."""
    bubble = max(costs.f + costs.b - costs.w, costs.f, costs.b)
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p + 1):
            timeline = simulate(zb_h1(p, m, costs=costs))
            assert timeline.makespan == pytest.approx(work(m, costs) + (p - 1) * bubble), (p, m)
            for r in range(p):
                assert timeline.makespan - timeline.busy[r] == pytest.approx((p - 1) * bubble)


@pytest.mark.parametrize("p", [1, 2, 4, 7])
def test_zb_h1_memory_equals_1f1b(p):
    for m in range(1, 2 * p + 2):
        zb = simulate(zb_h1(p, m)).peak_memory
        ofob = simulate(one_f_one_b(p, m)).peak_memory
        assert zb == ofob == tuple(float(min(p - r, m)) for r in range(p)), (p, m)


@pytest.mark.parametrize("w_memory", [0.25, 0.5, 1.0])
def test_zb_h1_memory_with_weight_memory(w_memory):
    """Rank r keeps r deferred W's of M_W each: (p-r) M + r M_W, so the maximum stays p M."""
    costs = Costs(memory=2.0, w_memory=w_memory)
    for p in (2, 4, 6):
        for m in (p, 2 * p, 5 * p):
            peaks = simulate(zb_h1(p, m, costs=costs)).peak_memory
            assert peaks == pytest.approx([(p - r) * 2.0 + r * w_memory for r in range(p)]), (p, m)
            assert max(peaks) == 2.0 * p


# ------------------------------------------------------------------------------------------ ZB-H2


@pytest.mark.parametrize(
    "costs",
    [Costs(), Costs(f=1, b=2, w=1), Costs(f=2, b=1, w=1), Costs(f=1, b=1, w=0.5), Costs(f=0.5, b=1, w=2),
     Costs(f=18522, b=18086, w=9337)],
    ids=["1-1-1", "1-2-1", "2-1-1", "1-1-0.5", "0.5-1-2", "paper-no-comm"],
)
def test_zb_h2_reaches_the_lower_bound(costs):
    """No comm, m >= 2p-1, I <= 2F and I <= 2W: makespan m(F+I+W) + (p-1)F."""
    for p in (1, 2, 3, 4, 8):
        for m in (2 * p - 1, 2 * p, 3 * p, 5 * p + 2):
            timeline = simulate(zb_h2(p, m, costs=costs))
            assert timeline.makespan == pytest.approx(lower_bound(p, m, costs)), (p, m)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 12])
def test_zb_h2_is_a_bubble_free_parallelogram(p):
    """F=I=W=1, m >= 2p-1: rank r is busy without a gap from r to 3m+r."""
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        timeline = simulate(zb_h2(p, m))
        for r in range(p):
            assert timeline.starts[r][0] == r and timeline.ends[r][-1] == 3 * m + r, (p, m, r)
            assert idle_inside_span(timeline, r) == 0, (p, m, r)
        # ZB-H1, same m: rank r idles (p-1-r) inside its span, so the paper calls ZB-H2 bubble-free.
        h1 = simulate(zb_h1(p, m))
        assert [idle_inside_span(h1, r) for r in range(p)] == [p - 1 - r for r in range(p)]


@pytest.mark.parametrize("p", [1, 2, 4, 7])
def test_zb_h2_memory(p):
    """M_W = 0: rank r peaks at min(2(p-r)-1, m) micro-batches, 2p-1 on rank 0."""
    for m in range(1, 4 * p + 2):
        peaks = simulate(zb_h2(p, m)).peak_memory
        assert peaks == tuple(float(min(2 * (p - r) - 1, m)) for r in range(p)), (p, m)


@pytest.mark.parametrize("w_memory", [0.25, 1.0])
def test_zb_h2_memory_with_weight_memory(w_memory):
    """At most (2(p-r)-1) M + (2p-1) M_W on rank r, reached when m >= 4p-2r-2."""
    costs = Costs(w_memory=w_memory)
    for p in (2, 3, 5):
        for m in range(1, 5 * p):
            peaks = simulate(zb_h2(p, m, costs=costs)).peak_memory
            for r in range(p):
                bound = min(2 * (p - r) - 1, m) + (2 * p - 1) * w_memory
                assert peaks[r] <= bound + 1e-9, (p, m, r)
                if m >= 4 * p - 2 * r - 2:
                    assert peaks[r] == pytest.approx(bound), (p, m, r)


# ------------------------------------------------------------------------------------ comparisons


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubble_ratio_order_against_1f1b(p):
    """m >= 2p. Equal costs: ZB-H2 ties ZB-H1 (both at the lower bound), both below 1F1B.
    I > W (the paper's costs, with and without comm): strictly ZB-H2 < ZB-H1 < 1F1B."""
    for m in (2 * p, 3 * p, 4 * p):
        ratios = [simulate(g(p, m)).bubble_ratio for g in (zb_h2, zb_h1, one_f_one_b)]
        assert ratios[0] == pytest.approx(ratios[1]) and ratios[1] < ratios[2], (p, m)
        for costs in (PAPER, Costs(f=PAPER.f, b=PAPER.b, w=PAPER.w), Costs(f=1, b=2, w=1)):
            ratios = [simulate(g(p, m, costs=costs)).bubble_ratio for g in (zb_h2, zb_h1, one_f_one_b)]
            assert ratios[0] < ratios[1] < ratios[2], (p, m, costs)


@pytest.mark.parametrize("comm", [0.1, 0.5, 1.0, 3.0])
def test_valid_and_ordered_with_comm_latency(comm):
    costs = Costs(comm=comm)
    for p in (1, 2, 3, 5, 8):
        for m in (1, p, 2 * p, 3 * p + 1):
            h1 = validate(zb_h1(p, m, costs=costs), ordered=True).makespan
            h2 = validate(zb_h2(p, m, costs=costs), ordered=True).makespan
            assert lower_bound(p, m, costs) <= h2 + 1e-9
            if m >= 2 * p and p > 1:
                assert h2 < h1 < simulate(one_f_one_b(p, m, costs=costs)).makespan, (p, m)


def test_paper_setting_makespans(capsys):
    """p=8, m=24 with the paper's F, B, W and comm: recorded for the ZB-V comparison.

    ZB-H1 = m(F+I+W) + (p-1)(F+I-W+4c) = 1,310,405; ZB-H2 = 1,236,632, 91 above the lower bound
    (p-1)(F+c) + m(F+I+W) = 1,236,541; 1F1B = 1,456,749.
    """
    p, m = 8, 24
    h1 = validate(zb_h1(p, m, costs=PAPER), ordered=True).makespan
    h2 = validate(zb_h2(p, m, costs=PAPER), ordered=True).makespan
    ofob = simulate(one_f_one_b(p, m, costs=PAPER)).makespan
    print(f"paper setting p=8 m=24: zb-h1 {h1:.0f}  zb-h2 {h2:.0f}  1f1b {ofob:.0f}  "
          f"lower bound {lower_bound(p, m, PAPER):.0f}")
    c = PAPER.comm
    assert h1 == pytest.approx(work(m, PAPER) + (p - 1) * (PAPER.f + PAPER.b - PAPER.w + 4 * c))
    assert h1 == 1_310_405
    assert h2 == 1_236_632 and h2 - lower_bound(p, m, PAPER) == 91
    assert ofob == 1_456_749


# ------------------------------------------------------------------------------ validity, inputs


@pytest.mark.parametrize("generator", [zb_h1, zb_h2])
def test_valid_and_ordered_for_all_small_sizes(generator):
    """Every p in 1..16 and m in 1..64: complete, deadlock-free, B/W in micro-batch order."""
    for p in range(1, 17):
        for m in range(1, 65):
            validate(generator(p, m), ordered=True)


def test_memory_limit_reaches_the_validator():
    validate(zb_h1(4, 8, memory_limit=4))
    with pytest.raises(MemoryLimitError, match="above the limit 6"):
        validate(zb_h2(4, 8, memory_limit=6))


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_registry_builds_split_backward_chain(name):
    schedule = build_schedule(name, 4, 8, costs=Costs(f=2, b=3, w=1))
    assert schedule.name == name and schedule.problem.splits_backward
    durations = {task.kind: task.duration for task in schedule.problem.tasks if task.stage == 0}
    assert durations == {"F": 2, "I": 3, "W": 1}
    assert [sorted({a.stage for a in actions}) for actions in schedule.ranks] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("generator", [zb_h1, zb_h2])
@pytest.mark.parametrize("p, m, words", [(0, 4, "ranks"), (4, 0, "micro-batches"), (True, 4, "ranks"),
                                         (4, 2.5, "micro-batches")])
def test_bad_counts_raise_value_error(generator, p, m, words):
    with pytest.raises(ValueError, match=words):
        generator(p, m)
