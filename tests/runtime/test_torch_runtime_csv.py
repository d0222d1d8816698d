"""pipeloom's torch CSVs run in torch's own ``_PipelineScheduleRuntime``, on 2 gloo ranks with real
``PipelineStage`` objects: the compute-only file (torch lowers it) and the lowered ``compute_comms`` file (run as
written) give gradients bitwise equal to one device's. The ``compute_comms`` file had given them M times too
large under torch 2.10 and later, which divide by M only at a ``REDUCE_GRAD`` cell the file did not carry."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from ranks import run_ranks
from torch_runtime_jobs import torch_runtime_steps

from pipeloom import lower
from pipeloom.ir import schedule_to_csv
from pipeloom.schedules import build_schedule

SCHEDULES = [("1f1b", {}), ("interleaved-1f1b", {"stages_per_rank": 2}), ("zb-h1", {}), ("zbv", {}),
             ("dualpipev", {})]
MICROBATCHES = 4


@pytest.mark.timeout(300)
def test_our_csvs_run_bitwise_in_torchs_runtime():
    files = []
    for name, options in SCHEDULES:
        schedule = build_schedule(name, 2, MICROBATCHES, **options)
        files.append((f"{name} compute_only", schedule_to_csv(schedule), "compute_only"))
        files.append((f"{name} compute_comms", schedule_to_csv(lower(schedule)), "compute_comms"))
    results = run_ranks(2, torch_runtime_steps, files, MICROBATCHES, timeout=240)
    for rank in (0, 1):
        status, found = results[rank]
        assert status == "ok", found
        wrong = {label: f["ratio"] for label, f in found.items() if not f["equal"]}
        assert not wrong, f"rank {rank}: gradients not one device's (norm ratio): {wrong}"
