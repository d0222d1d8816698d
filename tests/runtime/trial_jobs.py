"""Rank jobs of tests/runtime/test_plan_trials.py: plan a tiny model, then try the best plans in the engine."""

from __future__ import annotations

import torch
from torch import nn

from pipeloom.plan.costs.parts import Piece
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.plan import load_plan
from pipeloom.plan.planner import plan_pipeline
from pipeloom.plan.race import TrialBudget
from pipeloom.profile.trials import try_plans

WIDTH, LAYERS, BATCH = 16, 4, 8


def build() -> nn.Module:
    """Four Linear+Tanh blocks, the same weights at every call."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)))


def table() -> CostTable:
    """A hand-written cost table of the model's four pieces (equal times: the plans' predictions are close)."""
    pieces = tuple(Piece(name=str(k), f=1e-4, i=1e-4, w=1e-4, activation_bytes=4.0 * WIDTH,
                         param_bytes=4.0 * WIDTH ** 2, output_bytes=4.0 * WIDTH) for k in range(LAYERS))
    return CostTable(pieces=pieces, microbatch_size=1)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def try_three(rank: int, world: int, folder: str) -> dict:
    """Plan for 2 ranks (1f1b, gpipe, zbv; 2 or 4 micro-batches), try the 3 best in 2 interleaved rounds of 2
    steps, save the plan."""
    result = plan_pipeline(table(), num_ranks=world, global_batch=BATCH, schedules=["1f1b", "gpipe", "zbv"],
                           microbatches=[2, 4])
    torch.manual_seed(1)
    inputs, target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    tried = try_plans(result, build=build, inputs=inputs, target=target, loss_fn=loss, k=3,
                      budget=TrialBudget(warmup=1, round_steps=2, steps=4, seconds=None))
    path = f"{folder}/plan{rank}.json"
    tried.save(path)
    saved = load_plan(path)
    return {"trials": list(tried.plan.trials), "schedule": tried.plan.schedule,
            "microbatches": tried.plan.microbatches, "saved_trials": list(saved.trials),
            "predicted_best": (result.plan.schedule, result.plan.microbatches)}


def build_batchnorm() -> nn.Module:
    """The four blocks with a BatchNorm each: its running statistics are updated by every training step."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh())
                           for _ in range(LAYERS)))


def try_a_refused_step(rank: int, world: int, schedules: list[str], warmup: int) -> dict | str:
    """Try ``schedules`` on a BatchNorm model: chimera's two replicas update the running statistics apart, which
    the engine refuses after the first step (in the warm-up, or with none in the first round); the race goes on
    with the others, or, where none is left, the error that says so."""
    from pipeloom.plan.errors import PlanError

    result = plan_pipeline(table(), num_ranks=world, global_batch=BATCH, schedules=schedules, microbatches=[4])
    torch.manual_seed(1)
    inputs, target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    try:
        tried = try_plans(result, build=build_batchnorm, inputs=inputs, target=target, loss_fn=loss,
                          k=len(schedules), budget=TrialBudget(warmup=warmup, round_steps=2, steps=4, seconds=None))
    except PlanError as error:
        return str(error)
    return {"trials": list(tried.plan.trials), "schedule": tried.plan.schedule}
