"""What the ranks run in the tests of the test launcher itself (``ranks.run_ranks``, test_launch.py)."""

from __future__ import annotations

import os
import time

import torch
from ranks import _model_key, traces_before_fork
from torch import nn


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))


def _trace(width: int) -> bool:
    """Trace a small model ``width`` wide with torch.export; whether this process had its program already."""
    from pipeloom.runtime.model import tracing

    model, example = _model(width), (torch.randn(3, width),)
    remembered = _model_key(model, example, []) in tracing.exported_program.programs
    tracing.trace_model(model, tracer="export", example_inputs=example)
    return remembered


def traced(rank: int, world: int, width: int) -> bool:
    return _trace(width)


@traces_before_fork(_trace)
def traced_before_fork(rank: int, world: int, width: int) -> bool:
    return _trace(width)


def sleep(rank: int, world: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def exit_on_rank_1(rank: int, world: int, code: int) -> int:
    if rank == 1:
        os._exit(code)
    return rank
