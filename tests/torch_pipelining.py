"""torch.distributed.pipelining's schedules module for the interop tests: skipped without torch, a
failure instead when PIPELOOM_REQUIRE_TORCH=1 (set by ``make test``), so the checks cannot silently
stop running."""

from __future__ import annotations

import csv
import importlib
import io
import os
from types import ModuleType

import pytest


def import_torch_schedules() -> ModuleType:
    """torch's pipelining schedules; skip the calling module without them, fail if they are required."""
    try:
        return importlib.import_module("torch.distributed.pipelining.schedules")
    except ImportError as error:
        reason = str(error)
    if os.environ.get("PIPELOOM_REQUIRE_TORCH") == "1":
        pytest.fail(f"PIPELOOM_REQUIRE_TORCH=1 but torch's pipelining cannot be imported: {reason}",
                    pytrace=False)
    pytest.skip(f"torch is not installed ({reason}); set PIPELOOM_REQUIRE_TORCH=1 to make this a failure",
                allow_module_level=True)


def torch_order_csv(schedule_class: type, ranks: int, microbatches: int, stages_per_rank: int = 2) -> str:
    """torch's own per-rank order for a schedule class, dumped the way its ``_dump_csv`` does.

    The classes need real PipelineStage objects in ``__init__``; their order computation only
    needs these attributes, so the object is made without ``__init__``.
    """
    order = object.__new__(schedule_class)
    order.pp_group_size = ranks
    order._n_microbatches = microbatches
    order.n_local_stages = stages_per_rank
    order.number_of_rounds = max(1, microbatches // ranks)
    order.microbatches_per_round = microbatches // order.number_of_rounds
    order.num_stages = order._num_stages = ranks * stages_per_rank
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in range(ranks):
        writer.writerow(order._calculate_single_rank_operations(rank))
    return out.getvalue()
