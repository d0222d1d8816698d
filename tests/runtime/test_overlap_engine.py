"""The engine runs overlapped F&B pairs (forward part, then backward part) and full backwards on split
stages bitwise exactly: torch 2.13's own DualPipeV order loaded from its CSV, in one process and on two
gloo ranks, against the single-device reference."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from models import train_one_rank
from rank_jobs import exactness
from ranks import run_ranks

from pipeloom.ir import Overlap, compute_parts, schedule_from_csv
from pipeloom.lowering import lower
from pipeloom.runtime.step import run as step_module
from pipeloom.validate import validate
from torch_pipelining import import_torch_schedules, torch_order_csv


def _torch_dualpipev(ranks: int, microbatches: int):
    """torch's ScheduleDualPipeV order (its pipeline_order, per rank), written as its CSV and loaded."""
    text = torch_order_csv(import_torch_schedules().ScheduleDualPipeV, ranks, microbatches)
    return schedule_from_csv(text, name="torch-dualpipev")


def test_torch_dualpipev_csv_runs_bitwise_in_one_process(monkeypatch):
    schedule = _torch_dualpipev(1, 8)
    validate(schedule, ordered=True)
    assert any(type(a) is Overlap for a in schedule.ranks[0])
    order: list[str] = []
    for name in ("forward", "backward"):
        original = getattr(step_module.StepRun, name)

        def spy(self, step, *args, _original=original, **kwargs):
            order.append(str(step.action))
            return _original(self, step, *args, **kwargs)

        monkeypatch.setattr(step_module.StepRun, name, spy)
    problems, losses = train_one_rank("residual", schedule, 2, steps=2)
    assert problems == [] and all(losses)
    # each pair ran its forward part, then its backward part, where the pair stands
    parts = [str(p) for a in schedule.ranks[0] for p in compute_parts(a) if p.kind != "W"]
    assert order[:len(parts)] == parts


def test_full_backward_on_a_split_stage_runs_bitwise():
    # one rank, two stages, split backward; stage 1's backwards are full B, stage 0's I then W apart
    text = ",".join(["0F0", "1F0", "0F1", "1B0", "1F1", "0I0", "1B1", "0I1", "0W0", "0W1"]
                    + [f"{s}{k}{m}" for m in range(2, 8) for s, k in (("0", "F"), ("1", "F"), ("1", "B"),
                                                                       ("0", "I"), ("0", "W"))])
    schedule = schedule_from_csv(text + "\n")
    assert schedule.problem.splits_backward
    validate(schedule, ordered=True)
    problems, losses = train_one_rank("residual", schedule, 2, steps=2)
    assert problems == [] and all(losses)


@pytest.mark.timeout(300)
def test_torch_dualpipev_and_its_lowering_run_bitwise_on_two_ranks():
    schedule = _torch_dualpipev(2, 8)
    lowered = dataclasses.replace(lower(schedule), name="torch-dualpipev-lowered")  # reports are keyed by name
    cases = [("residual", schedule, 4, None), ("residual", lowered, 4, None)]
    results = run_ranks(2, exactness, cases, timeout=240)
    failures = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    assert not failures, failures
    for rank, (_, report) in results.items():
        assert len(report) == 2
        for key, outcome in report.items():
            assert outcome["mismatches"] == [], (rank, key, outcome)
            assert outcome["losses_equal"], (rank, key)
