"""How an overlapped forward + backward pair (DualPipe's F&B) is priced: F + B by default (one device runs
one compute at a time), less the communication each part hides under the other's compute, less an overlap
fraction the user gives, or a measured pair time; and what ``pipeloom compare`` says about it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeloom.cli import main
from pipeloom.errors import ProblemError, ScheduleFormatError
from pipeloom.ir import Overlap, pair_duration, schedule_from_json, schedule_to_json, without_overlap
from pipeloom.problem import Task
from pipeloom.schedules import build_schedule
from pipeloom.sim import simulate
from pipeloom.stages import Costs, Stage

PAPER = Costs(f=18522, b=18086, w=9337, comm=601)
"""The zero-bubble paper's costs (``pipeloom demo``)."""


def _rank_compute(costs: Costs, m: int) -> float:
    """What one rank must compute per step in any schedule: m micro-batches of F, I and W of its share."""
    return m * (costs.f + costs.b + costs.w)


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize("costs", [PAPER, Costs(), Costs(f=1, b=2, w=1, comm=0.5), Costs(f=3, b=1, w=0.25)],
                         ids=str)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_a_dualpipe_makespan_is_never_below_a_ranks_compute_by_default(name, costs, p):
    m = 3 * p if name == "dualpipev" else 4 * p
    timeline = simulate(build_schedule(name, p, m, costs=costs))
    # dualpipe's micro-batch is a pair of real ones (one per direction), each rank holding two shares
    assert timeline.makespan >= _rank_compute(costs, m) - 1e-6
    assert max(timeline.busy) == pytest.approx(_rank_compute(costs, m))


def test_the_demo_costs_dualpipev_beats_a_ranks_compute_only_with_the_overlap_given():
    plain = simulate(build_schedule("dualpipev", 8, 24, costs=PAPER)).makespan
    overlapped = simulate(build_schedule("dualpipev", 8, 24, costs=dataclasses.replace(PAPER, overlap=1))).makespan
    assert plain >= _rank_compute(PAPER, 24) == 1_102_680
    assert overlapped == 943_491.5 < _rank_compute(PAPER, 24)  # the old max(F, B) pricing
    half = simulate(build_schedule("dualpipev", 8, 24, costs=dataclasses.replace(PAPER, overlap=0.5))).makespan
    assert overlapped < half < plain


@pytest.mark.parametrize(("times", "comms", "fraction", "expected"), [
    ((1.0, 3.0), (0.0, 0.0), 0.0, 4.0),  # one device: F then B
    ((1.0, 3.0), (0.0, 0.0), 1.0, 3.0),  # all of the shorter part at once: max(F, B)
    ((1.0, 3.0), (0.0, 0.0), 0.5, 3.5),
    ((2.0, 3.0), (1.0, 0.0), 0.0, 4.0),  # F's 1 of all-to-all runs under B's compute
    ((2.0, 3.0), (1.0, 2.0), 0.0, 3.0),  # B's 2 of all-to-all hides under F's compute of 1 only: 5 - 1 - 1
    ((2.0, 3.0), (2.0, 3.0), 0.0, 5.0),  # only communication: nothing to hide it under
    ((2.0, 3.0), (1.0, 0.0), 1.0, 3.0),  # never below the longer part
])
def test_pair_duration(times, comms, fraction, expected):
    assert pair_duration(times, comms, fraction=fraction) == pytest.approx(expected)
    assert pair_duration(times, comms, fraction=fraction, overhead=0.25) == pytest.approx(expected + 0.25)


def test_a_pair_slowed_beside_its_hidden_communication():
    """``slowdown``: each hidden second costs the compute beside it that share of a second. F 2 (1 of all-to-all)
    with B 3 (2 of all-to-all) hides 1 + 1 seconds: 3 at no slowdown, 3.5 at a quarter, F + B at all of it; never
    below the longer part; nothing hidden, nothing lost."""
    assert pair_duration((2.0, 3.0), (1.0, 2.0), slowdown=0.25) == pytest.approx(3.5)
    assert pair_duration((2.0, 3.0), (1.0, 2.0), slowdown=1.0) == pytest.approx(5.0)
    assert pair_duration((2.0, 3.0), (0.0, 0.0), fraction=1.0, slowdown=0.5) == pytest.approx(3.0)


def test_communication_inside_tasks_is_credited_to_pairs_only():
    comm = dataclasses.replace(PAPER, f_comm=4000, b_comm=4000)
    with_comm = simulate(build_schedule("dualpipev", 8, 24, costs=comm))
    plain = simulate(build_schedule("dualpipev", 8, 24, costs=PAPER))
    assert with_comm.makespan < plain.makespan
    # a pair of V stages (half shares) hides min(f_comm, I+W - b_comm) + min(b_comm, F - f_comm) of the half costs
    assert plain.busy[0] - with_comm.busy[0] == pytest.approx(sum(
        2000 + 2000 for action in with_comm.schedule.ranks[0] if type(action) is Overlap))
    # a schedule without pairs gains nothing from it
    assert simulate(build_schedule("zbv", 8, 24, costs=comm)).makespan == \
        simulate(build_schedule("zbv", 8, 24, costs=PAPER)).makespan


def test_a_measured_pair_time_prices_every_pair():
    costs = dataclasses.replace(PAPER, pair_time=20_000)
    schedule = build_schedule("dualpipev", 4, 8, costs=costs)
    timeline = simulate(schedule)
    pairs = [(end - start) for rank in range(4) for action, start, end in timeline.events(rank)
             if type(action) is Overlap]
    assert pairs and all(duration == 20_000 for duration in pairs)
    assert without_overlap(schedule.problem).pair_time is None


def test_the_pricing_round_trips_through_json():
    costs = dataclasses.replace(PAPER, f_comm=100, b_comm=50, overlap=0.25, pair_time=30_000)
    schedule = build_schedule("dualpipev", 2, 4, costs=costs)
    back = schedule_from_json(schedule_to_json(schedule))
    assert back == schedule and back.problem.overlap_fraction == 0.25 and back.problem.pair_time == 30_000
    assert {task.comm for task in back.problem.tasks} == {0.0, 50.0, 25.0}  # F half of 100, I half of 50, W 0
    plain = json.loads(schedule_to_json(build_schedule("dualpipev", 2, 4)))
    assert not {"overlap_fraction", "pair_time"} & set(plain)
    assert not any("comm" in task for task in plain["tasks"])
    document = json.loads(schedule_to_json(schedule))
    document["overlap_fraction"] = 2
    with pytest.raises(ScheduleFormatError, match="overlap_fraction must be between 0 and 1"):
        schedule_from_json(json.dumps(document))


def test_bad_pricing_is_refused():
    with pytest.raises(ProblemError, match="comm 2 exceeds its duration 1"):
        Task(stage=0, kind="F", ranks=(0,), duration=1, comm=2)
    with pytest.raises(ProblemError, match="f_comm 2 exceeds f 1"):
        Stage(ranks=0, f=1, f_comm=2)
    with pytest.raises(ProblemError, match="overlap must be between 0 and 1"):
        Costs(overlap=1.5)
    with pytest.raises(ProblemError, match="pair_time must be a finite number"):
        Costs(pair_time=float("nan"))


def _compare(capsys, *flags: str) -> dict:
    code = main(["compare", "1f1b", "zbv", "dualpipev", "--ranks", "8", "--microbatches", "24", "--f", "18522",
                 "--b", "18086", "--w", "9337", "--comm", "601", "--json", *flags])
    assert code == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)["schedules"]}


def test_compare_says_when_a_rows_lead_depends_on_overlap(capsys):
    plain = _compare(capsys)
    assert plain["zbv"]["makespan"] < plain["dualpipev"]["makespan"]
    assert not any("note" in row for row in plain.values())
    overlapped = _compare(capsys, "--overlap", "1")
    row = overlapped["dualpipev"]
    assert row["makespan"] == 943_491.5 and row["makespan_without_overlap"] == plain["dualpipev"]["makespan"]
    assert row["note"].endswith("ahead of zbv only through it")
    assert "note" not in overlapped["zbv"]
    code = main(["compare", "zbv", "dualpipev", "-p", "8", "-m", "24", "--f", "2", "--f-comm", "3"])
    assert code == 2 and "f_comm 3 exceeds f 2" in capsys.readouterr().err
