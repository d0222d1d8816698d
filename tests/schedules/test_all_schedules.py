"""Every registry schedule over a grid of sizes and costs: valid and sane, or rejected exactly when
its documented requirement says so.

Oracles: each family's stated acceptance rule (``ACCEPTS``), the validator (ordered mode), the
per-rank work lower bound M * max_r work_r, the JSON round trip, and closed forms of docs/design.md §6:
GPipe and 1F1B take (m+p-1)(f+b+w) without communication; interleaved 1F1B (m + (p-1)/v)(f+b+w)
when p divides m; ZB-H1 takes 3m+p-1 when f=b=w=1 and m >= p.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeloom.ir import Schedule, schedule_from_json, schedule_to_json
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.stages import Costs
from pipeloom.validate import validate

RANKS = (1, 2, 3, 4, 5, 7, 8, 16)
MICROBATCHES = (1, 2, 3, 4, 7, 8, 13, 16, 31, 64)
COSTS = {
    "equal": Costs(f=1, b=1, w=1),
    "skewed": Costs(f=1, b=2.5, w=0.75, memory=2, w_memory=0.5),
    "w0": Costs(f=1, b=2, w=0),
    "comm": Costs(f=1, b=1, w=1, comm=0.3),
}
_TOLERANCE = 1e-9


def _variants() -> list[tuple[str, dict]]:
    """Each registry name with its default options, plus v=3 for schedules with stages_per_rank."""
    variants = []
    for name, info in REGISTRY.items():
        variants.append((name, {}))
        if "stages_per_rank" in info.options:
            variants.append((name, {"stages_per_rank": 3}))
    return variants


VARIANTS = _variants()
_IDS = [name + "".join(f"-v{v}" for v in options.values()) for name, options in VARIANTS]


ACCEPTS = {
    "dualpipev": lambda p, m: m >= 2 * p,
    "dualpipe": lambda p, m: p % 2 == 0 and m % 2 == 0 and m >= 2 * p,
    "chimera": lambda p, m: p % 2 == 0 and m % 2 == 0,
}
"""The (ranks, micro-batches) each family's docstring requires; every other family takes any
positive counts."""


def _accepts(name: str, ranks: int, microbatches: int) -> bool:
    return ACCEPTS.get(name, lambda p, m: True)(ranks, microbatches)


def test_acceptance_rules_name_registry_schedules():
    assert set(ACCEPTS) <= set(REGISTRY), "a rule for a schedule that is not in the registry"


def _build(name: str, ranks: int, microbatches: int, costs: Costs, options: dict) -> Schedule | None:
    """The schedule when its family accepts these counts (any error fails the test), else None
    after checking that the generator rejects them with a ValueError that says something."""
    if _accepts(name, ranks, microbatches):
        return build_schedule(name, ranks, microbatches, costs=costs, **options)
    with pytest.raises(ValueError) as error:
        build_schedule(name, ranks, microbatches, costs=costs, **options)
    assert str(error.value), f"{name} rejected p={ranks} m={microbatches} with an empty message"
    return None


def check_schedule(schedule: Schedule, name: str) -> None:
    """Valid in ordered mode, no faster than the work bound, and unchanged by a JSON round trip."""
    where = f"{name} p={schedule.num_ranks} m={schedule.num_microbatches}"
    assert schedule.name == name, f"{where}: named {schedule.name!r}"
    timeline = validate(schedule, ordered=True)
    # an overlapped F&B pair does its parts' work in max(F, B): the bound counts the time ranks are busy
    bound = max(timeline.busy)
    assert timeline.makespan >= bound - _TOLERANCE * max(1.0, bound), (
        f"{where}: makespan {timeline.makespan} beats the per-rank work bound {bound}"
    )
    assert schedule_from_json(schedule_to_json(schedule)) == schedule, f"{where}: JSON round trip"


@pytest.mark.parametrize("cost_name", list(COSTS))
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=_IDS)
def test_grid_builds_valid_schedules_or_rejects_clearly(name, options, ranks, cost_name):
    built = 0
    for microbatches in MICROBATCHES:
        schedule = _build(name, ranks, microbatches, COSTS[cost_name], options)
        if schedule is not None:
            check_schedule(schedule, name)
            built += 1
    if ranks in (2, 4) and cost_name == "equal":  # sizes every family accepts (even ranks)
        assert built > 0, f"{name} rejected every micro-batch count with {ranks} ranks"


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=_IDS)
def test_memory_limit_reaches_the_problem(name, options):
    schedule = build_schedule(name, 4, 8, memory_limit=1e6, **options)
    assert schedule.problem.memory_limit == 1e6
    assert schedule.problem.comm_latency == 0.0


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=_IDS)
@pytest.mark.parametrize(("ranks", "microbatches"), [(0, 4), (4, 0), (-1, 4), (2.5, 4), (True, 4)])
def test_bad_counts_raise_value_error(name, options, ranks, microbatches):
    with pytest.raises(ValueError):
        build_schedule(name, ranks, microbatches, **options)


@pytest.mark.parametrize(("name", "ranks", "microbatches", "options"), [
    ("1f1b", 4, 10**12, {}), ("1f1b", 10**7, 1, {}), ("interleaved-1f1b", 4, 8, {"stages_per_rank": 10**9}),
    ("zbv", 2**12, 2**12, {})])
def test_a_schedule_past_the_problem_size_is_refused_before_it_is_built(name, ranks, microbatches, options):
    """1f1b over 10**12 micro-batches had run the machine out of memory, and 4 x 10**9 interleaved stages raised a
    MemoryError after 18 s (a new user's trial, 2026-12-06): refused at once, as the command line refuses them."""
    from pipeloom.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"actions, more than the 10,000,000 a schedule may hold"):
        build_schedule(name, ranks, microbatches, **options)


def test_save_schedule_names_what_it_cannot_save(tmp_path):
    """A string given as the schedule had raised AttributeError, a missing folder FileNotFoundError."""
    from pipeloom.errors import ArgumentTypeError, ScheduleFormatError
    from pipeloom.ir import save_schedule

    with pytest.raises(ArgumentTypeError, match="schedule must be a pipeloom Schedule"):
        save_schedule("1f1b", tmp_path / "x.json")
    with pytest.raises(ScheduleFormatError, match="cannot write .*missing.*x.json"):
        save_schedule(build_schedule("1f1b", 2, 2), tmp_path / "missing" / "x.json")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("cost_name", ["equal", "skewed", "w0"])
def test_gpipe_and_1f1b_makespan_closed_form(name, cost_name):
    costs = COSTS[cost_name]
    for ranks in RANKS:
        for microbatches in MICROBATCHES:
            timeline = validate(build_schedule(name, ranks, microbatches, costs=costs))
            expected = (microbatches + ranks - 1) * (costs.f + costs.b + costs.w)
            assert timeline.makespan == pytest.approx(expected), f"p={ranks} m={microbatches}"


def test_gpipe_and_1f1b_activation_memory():
    """docs/design.md §6: GPipe holds m micro-batches, 1F1B min(p, m) (rank 0 holds the most)."""
    for ranks in RANKS:
        for microbatches in MICROBATCHES:
            gpipe = validate(build_schedule("gpipe", ranks, microbatches))
            one_f_one_b = validate(build_schedule("1f1b", ranks, microbatches))
            assert max(gpipe.peak_memory) == microbatches
            assert max(one_f_one_b.peak_memory) == min(ranks, microbatches)


@pytest.mark.parametrize("stages_per_rank", [2, 3])
@pytest.mark.parametrize("cost_name", ["equal", "skewed", "w0"])
def test_interleaved_1f1b_bubble_is_divided_by_v(stages_per_rank, cost_name):
    """docs/design.md §6: bubble (p-1)(F+B)/v with per-rank totals, so makespan (m + (p-1)/v)(f+b+w) (m % p == 0)."""
    costs = COSTS[cost_name]
    for ranks in (2, 3, 4, 8):
        for microbatches in (ranks, 2 * ranks, 4 * ranks):
            schedule = build_schedule("interleaved-1f1b", ranks, microbatches, costs=costs,
                                      stages_per_rank=stages_per_rank)
            expected = (microbatches + (ranks - 1) / stages_per_rank) * (costs.f + costs.b + costs.w)
            assert validate(schedule).makespan == pytest.approx(expected), f"p={ranks} m={microbatches}"


def test_zb_h1_makespan_closed_form():
    for ranks in RANKS:
        for microbatches in MICROBATCHES:
            if microbatches < ranks:
                continue
            timeline = validate(build_schedule("zb-h1", ranks, microbatches, costs=Costs(f=1, b=1, w=1)),
                                ordered=True)
            assert timeline.makespan == 3 * microbatches + ranks - 1, f"p={ranks} m={microbatches}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    variant=st.sampled_from(VARIANTS),
    ranks=st.integers(1, 16),
    microbatches=st.integers(1, 64),
    costs=st.builds(
        Costs,
        f=st.sampled_from([0.5, 1, 2]),
        b=st.sampled_from([0.5, 1, 3]),
        w=st.sampled_from([0, 0.5, 1]),
        comm=st.sampled_from([0, 0.1, 1]),
    ),
)
def test_any_size_builds_valid_schedules_or_rejects_clearly(variant, ranks, microbatches, costs):
    name, options = variant
    schedule = _build(name, ranks, microbatches, costs, options)
    if schedule is not None:
        check_schedule(schedule, name)
