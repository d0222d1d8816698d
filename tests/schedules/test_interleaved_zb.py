"""Interleaved zero bubble: validity, its stated memory caps and bubble, torch's order and CSV, the runtime.

Oracles: the validator (ordered mode, memory limit); the docstring's closed forms (caps
min(vm, (v-1)g + p - r) stage forwards on rank r; makespan 3m + (p-1)/v at unit costs when p | m;
the lower bound (p-1)(f/v + comm) + m(f+b+w)); ZB-H1 for v = 1; torch's own
``ScheduleInterleavedZeroBubble`` order simulated by pipeloom (skipped without torch or the class);
torch's CSV parser and validator; the single-device reference gradients of the runtime.
"""

from __future__ import annotations

import csv
import importlib
import io
from pathlib import Path

import pytest

import pipeloom.schedules.interleaved_zb as interleaved_zb_module
from pipeloom.errors import MemoryLimitError, PipeloomError
from pipeloom.ir import Schedule, schedule_from_csv, schedule_to_csv
from pipeloom.schedules.interleaved import group_sizes
from pipeloom.schedules.interleaved_zb import interleaved_zb
from pipeloom.schedules.zero_bubble import zb_h1
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate
from torch_pipelining import import_torch_schedules, torch_order_csv

COSTS = {
    "unit": Costs(f=1, b=1, w=1),
    "paper": Costs(f=18522, b=18086, w=9337, comm=601),
    "latency": Costs(f=1, b=2, w=0.5, comm=0.1),
    "w_memory": Costs(f=2, b=1, w=1, memory=2, w_memory=0.5, comm=0.1),
    "zero-f-w": Costs(f=0, b=1, w=0, comm=1),
}
SIZES = [(1, 1), (1, 6), (2, 1), (2, 3), (2, 8), (3, 5), (3, 7), (4, 4), (4, 10), (5, 13), (8, 8), (8, 12)]


def _stated_cap(p: int, m: int, v: int, rank: int, costs: Costs) -> float:
    """The docstring's default cap on rank r (forwards plus deferred W's)."""
    forwards = min(v * m, (v - 1) * group_sizes(p, m)[0] + p - rank)
    return forwards * costs.memory / v + min(rank, v * m) * costs.w_memory / v


def _lower_bound(p: int, m: int, v: int, costs: Costs) -> float:
    return (p - 1) * (costs.f / v + costs.comm) + m * (costs.f + costs.b + costs.w)


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("cost_name", list(COSTS))
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_valid_in_ordered_mode_within_the_stated_caps(p, m, v, cost_name):
    costs = COSTS[cost_name]
    schedule = interleaved_zb(p, m, costs=costs, stages_per_rank=v)
    timeline = validate(schedule, ordered=True)  # raises on deadlock, memory or order errors
    caps = [_stated_cap(p, m, v, r, costs) for r in range(p)]
    assert schedule.problem.memory_limit == pytest.approx(max(caps))
    for rank, (peak, cap) in enumerate(zip(timeline.peak_memory, caps)):
        assert peak <= cap + 1e-9, f"rank {rank}: peak {peak} over the stated cap {cap}"
    assert timeline.makespan >= _lower_bound(p, m, v, costs) * (1 - 1e-12)


def test_looped_placement_with_split_backward_and_shared_costs():
    p, v, costs = 3, 2, Costs(f=2, b=3, w=1, memory=2, w_memory=0.5)
    problem = interleaved_zb(p, 6, costs=costs, stages_per_rank=v).problem
    for stage in range(p * v):
        share = costs.stage(stage % p, share=1 / v)
        f, i, w = (problem.task((stage, kind)) for kind in "FIW")
        assert f.ranks == i.ranks == w.ranks == (stage % p,)
        assert (f.duration, i.duration, w.duration) == (share.f, share.b, share.w)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 16), (8, 24)])
def test_unit_costs_meet_the_lower_bound_when_p_divides_m(p, m, v):
    """Docstring: 3m + (p-1)/v, which is also the lower bound (so nothing is faster)."""
    timeline = validate(interleaved_zb(p, m, stages_per_rank=v), ordered=True)
    assert timeline.makespan == pytest.approx(3 * m + (p - 1) / v)
    assert timeline.makespan == pytest.approx(_lower_bound(p, m, v, Costs()))


@pytest.mark.parametrize("cost_name", ["unit", "paper", "latency"])
def test_one_stage_per_rank_is_never_slower_than_zb_h1(cost_name):
    costs = COSTS[cost_name]
    for p, m in [(2, 4), (4, 8), (4, 9), (6, 12)]:
        ours = simulate(interleaved_zb(p, m, costs=costs, stages_per_rank=1))
        assert ours.makespan <= simulate(zb_h1(p, m, costs=costs)).makespan * (1 + 1e-12)
        assert max(ours.peak_memory) <= p * costs.memory + 1e-9


@pytest.mark.parametrize("factor", [1.0, 1.5, 2.0, 3.0, 100.0])
@pytest.mark.parametrize("v", [2, 3])
def test_every_limit_at_or_above_one_microbatch_is_honoured(factor, v):
    costs = COSTS["w_memory"]
    for p, m in [(1, 5), (3, 9), (4, 8), (6, 12)]:
        limit = factor * costs.memory
        schedule = interleaved_zb(p, m, costs=costs, memory_limit=limit, stages_per_rank=v)
        assert schedule.problem.memory_limit == limit
        timeline = validate(schedule, ordered=True)
        assert max(timeline.peak_memory) <= limit + 1e-9, f"p={p} m={m} limit={limit}"


def test_the_default_caps_are_binding():
    """Rank 0 reaches 1F1B's p, so a tighter limit makes the validator reject the default schedule."""
    schedule = interleaved_zb(4, 16)
    assert max(validate(schedule).peak_memory) == 4
    tighter = Schedule(name="interleaved-zb", problem=interleaved_zb(4, 16, memory_limit=3).problem,
                       num_microbatches=16, ranks=schedule.ranks)
    with pytest.raises(MemoryLimitError):
        validate(tighter)


@pytest.mark.parametrize(("memory", "limit"), [(1.0, 0.99), (1.0, 0.5), (2.0, 1.5)])
def test_a_limit_below_one_microbatch_names_the_smallest_workable_one(memory, limit):
    with pytest.raises(ValueError, match=f"smallest workable limit is {memory:g}"):
        interleaved_zb(4, 8, costs=Costs(memory=memory), memory_limit=limit)


def test_bad_inputs_raise_value_error():
    for p, m, v in [(0, 4, 2), (4, 0, 2), (2.5, 4, 2), (True, 4, 2), (4, 8, 0), (4, 8, 1.5)]:
        with pytest.raises(ValueError):
            interleaved_zb(p, m, stages_per_rank=v)


def test_every_candidate_failing_is_a_pipeloom_error_naming_the_inputs(monkeypatch):
    """No known input makes every candidate fail, so force it: the error must name the inputs."""
    monkeypatch.setattr(interleaved_zb_module, "_evaluate", lambda schedule, caps: None)
    with pytest.raises(PipeloomError, match=r"p=3, m=5, v=2.*larger memory_limit"):
        interleaved_zb(3, 5)


def test_our_csv_round_trips():
    costs = COSTS["paper"]
    for p, m, v in [(2, 8, 2), (4, 8, 2), (3, 7, 3), (4, 12, 2)]:
        schedule = interleaved_zb(p, m, costs=costs, stages_per_rank=v)
        loaded = schedule_from_csv(schedule_to_csv(schedule), costs=costs)
        assert loaded.ranks == schedule.ranks
        assert loaded.problem.tasks == schedule.problem.tasks
        assert simulate(loaded).makespan == simulate(schedule).makespan


def _torch_schedules():
    """torch's pipelining schedules module (skipped without torch; required under ``make test``)."""
    return import_torch_schedules()


def test_torch_parses_and_accepts_our_csv():
    torch_schedules = _torch_schedules()
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 7, 3), (4, 12, 2)]:
        schedule = interleaved_zb(p, m, costs=COSTS["paper"], stages_per_rank=v)
        rows = csv.reader(io.StringIO(schedule_to_csv(schedule)))  # what torch's _load_csv does
        actions = {r: [torch_schedules._Action.from_str(cell) for cell in row] for r, row in enumerate(rows)}
        for rank, row in actions.items():
            assert [repr(action) for action in row] == [str(a) for a in schedule.ranks[rank]]
        torch_schedules._validate_schedule(actions, p, p * v, m)


def _torch_interleaved_zb(p: int, m: int, v: int) -> str:
    """torch's ScheduleInterleavedZeroBubble order as CSV, computed without PipelineStage objects."""
    schedule_class = getattr(_torch_schedules(), "ScheduleInterleavedZeroBubble", None)
    if schedule_class is None:
        pytest.skip("this torch has no ScheduleInterleavedZeroBubble")
    return torch_order_csv(schedule_class, p, m, v)


@pytest.mark.parametrize("cost_name", ["unit", "paper", "latency"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 12), (8, 16)])
def test_never_slower_than_torch_and_never_more_memory_on_any_rank(p, m, cost_name):
    costs = COSTS[cost_name]
    theirs = validate(schedule_from_csv(_torch_interleaved_zb(p, m, 2), costs=costs), ordered=True)
    ours = validate(interleaved_zb(p, m, costs=costs), ordered=True)
    assert ours.makespan <= theirs.makespan * (1 + 1e-12)
    for mine, torch_peak in zip(ours.peak_memory, theirs.peak_memory):
        assert mine <= torch_peak + 1e-9


def test_strictly_faster_than_torch_at_paper_costs():
    """The comparison above can fail the other way too: at p=4, m=16 we are measurably faster."""
    costs = COSTS["paper"]
    theirs = simulate(schedule_from_csv(_torch_interleaved_zb(4, 16, 2), costs=costs)).makespan
    assert simulate(interleaved_zb(4, 16, costs=costs)).makespan < 0.99 * theirs


@pytest.mark.parametrize("v", [2, 4])
def test_the_runtime_runs_it_bitwise_exactly_on_one_rank(v, monkeypatch):
    """The engine's one-process exactness check (tests/runtime/models.py's ``train_one_rank``): v pieces."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "runtime"))
    train_one_rank = importlib.import_module("models").train_one_rank
    problems, losses = train_one_rank("residual", interleaved_zb(1, 8, stages_per_rank=v), v)
    assert problems == []
    assert all(losses)
