"""What each rank runs in the torch-runtime tests: pipeloom's torch CSV of a schedule loaded into torch's own
``_PipelineScheduleRuntime`` with real ``PipelineStage`` objects of a small model, one step each, its gradients
against one device's (the micro-batches' gradients summed in order, then divided by their count, as torch does)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from pipeloom.ir import schedule_from_csv


def _model(num_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(num_stages)))


def torch_runtime_steps(rank: int, world: int, files: list[tuple[str, str, str]], microbatches: int) -> dict:
    """For each ``(label, csv text, format)``: whether every gradient of this rank's stages is bitwise one
    device's after one step of torch's runtime, and the largest ratio of their norms."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    found = {}
    for label, text, form in files:
        problem = schedule_from_csv(text).problem
        num_stages = problem.num_stages
        mine = sorted({task.stage for task in problem.tasks if task.ranks[0] == rank})
        model, reference = _model(num_stages), _model(num_stages)
        torch.manual_seed(1)
        x, y = torch.randn(2 * microbatches, 8), torch.randn(2 * microbatches, 8)
        stages = [PipelineStage(model[s], s, num_stages, torch.device("cpu")) for s in mine]
        runtime = _PipelineScheduleRuntime(stages, microbatches, loss_fn=F.mse_loss)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "schedule.csv")
            with open(path, "w") as file:
                file.write(text)
            runtime._load_csv(path, format=form)
        kwargs = {"target": y} if num_stages - 1 in mine else {}
        runtime.step(*([x] if 0 in mine else []), **kwargs)
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            F.mse_loss(reference(xm), ym).backward()
        pairs = [(p.grad, q.grad / microbatches) for s in mine
                 for p, q in zip(model[s].parameters(), reference[s].parameters())]
        found[label] = {"equal": all(a is not None and torch.equal(a, b) for a, b in pairs),
                        "ratio": max(float(a.norm() / b.norm()) for a, b in pairs if a is not None)}
    return found
