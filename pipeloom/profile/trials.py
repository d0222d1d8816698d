"""Choose a plan by measurement: run the K best predicted plans for a few steps in the engine, on the ranks at
hand, and keep the fastest measured (``pipeloom plan --try K``, :func:`try_plans`).

The planner's predictions can be noisier than the gaps between its best plans (issue 28: on HF LLaMA the
chosen chimera ran 31 % slower than 1F1B), so the last word goes to the engine. Every rank calls
:func:`try_plans` (a collective on the process group). Rank 0's plan search names the trials (a search cut
short by a time limit may differ between ranks), each as its plan and its re-costed schedule, and sends them to
every rank; each rank saves them in a folder of its own, builds each with ``pipeloom.pipeline(plan=...)`` from a
fresh model and runs ``warmup`` then ``steps`` steps. A step's time is the slowest rank's wall time of
``engine.step`` (the ranks start it together, after a barrier), and a trial's time the median of its steps.
The chosen plan carries every trial in :attr:`pipeloom.plan.plan.Plan.trials`.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeloom.errors import PipeloomError
from pipeloom.ir import schedule_from_json, schedule_to_json
from pipeloom.plan.plan import Plan, PlanError, plan_from_json, plan_to_json
from pipeloom.plan.planner import Candidate, PlanResult
from pipeloom.sim import simulate

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

__all__ = ["TrialPlan", "measure_plan", "trial_plans", "try_plans"]


@dataclasses.dataclass(frozen=True, slots=True)
class TrialPlan:
    """One plan to try: its label, the plan, and the re-costed schedule the planner simulated for it."""

    label: str
    """``1f1b, 8 micro-batches (dp 1)``-style name."""
    plan: Plan
    """The plan as the engine reads it (its ``predicted_step_time`` the candidate's)."""
    schedule_json: str
    """The simulated schedule (``pipeloom.schedule/1``, costs included): the order the engine must run."""


def _key(candidate: Candidate) -> tuple:
    return (candidate.schedule, tuple(sorted(candidate.schedule_options.items())), candidate.microbatches,
            candidate.data_parallel, candidate.split_points)


def trial_plans(result: PlanResult, k: int) -> list[TrialPlan]:
    """The ``k`` best fitting candidates of ``result`` (distinct schedule, options, micro-batches, replicas and
    split), as plans of ``result.plan``'s mesh and tensor parallelism; the best first."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PlanError(f"the number of plans to try must be a positive integer, got {k!r}")
    base, found, seen = result.plan, [], set()
    world = base.world_size
    for candidate in result.candidates:
        tp = getattr(candidate, "tensor_parallel", base.tensor_parallel)
        if not candidate.fits or _key(candidate) in seen or tp != base.tensor_parallel:
            continue
        seen.add(_key(candidate))
        step_time, timeline, partition = candidate.simulation()
        dp = candidate.data_parallel
        plan = dataclasses.replace(
            base, num_ranks=world // (dp * base.tensor_parallel), split_points=candidate.split_points or (),
            schedule=candidate.schedule, schedule_options=dict(candidate.schedule_options),
            microbatches=candidate.microbatches, data_parallel=dp, predicted_step_time=step_time,
            peak_memory=timeline.peak_memory, bubble_ratio=candidate.bubble_ratio,
            stage_times=partition.stage_times, sharding=base.sharding if dp > 1 else "replicate", trials=())
        label = f"{candidate.label}, {candidate.microbatches} micro-batches" + (f", dp {dp}" if dp > 1 else "")
        found.append(TrialPlan(label=label, plan=plan, schedule_json=schedule_to_json(timeline.schedule)))
        if len(found) == k:
            break
    return found


def measure_plan(trial: TrialPlan, folder: Path, *, build: Callable[[], nn.Module], inputs: Any, target: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor], steps: int, warmup: int,
                 process_group: ProcessGroup | None = None, **pipeline_options: Any) -> list[float]:
    """Seconds of each of ``steps`` steps of ``trial`` in the engine (after ``warmup`` untimed ones), each the
    slowest rank's; every rank calls it. ``PipeloomError`` where the engine refuses the plan (on every rank)."""
    import torch
    import torch.distributed as dist

    from pipeloom.runtime.build import pipeline
    from pipeloom.runtime.options import Parallelism

    path = folder / "plan.json"
    PlanResult(plan=trial.plan, timeline=simulate(schedule_from_json(trial.schedule_json)), candidates=(),
               seconds=0.0).save(path)  # with the simulated order next to it where the engine would build another
    engine = pipeline(build(), plan=str(path), loss_fn=loss_fn, parallel=Parallelism(process_group=process_group),
                      **pipeline_options)
    times = []
    for step in range(warmup + steps):
        for param in engine.parameters():
            param.grad = None
        dist.barrier(group=process_group)
        started = time.perf_counter()
        engine.step(inputs, target=target)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=process_group)  # the same on every rank
        if step >= warmup:
            times.append(float(elapsed.item()))
    return times


def _record(trial: TrialPlan, times: Sequence[float] | None, error: str = "") -> dict:
    plan = trial.plan
    record: dict[str, Any] = {
        "label": trial.label, "schedule": plan.schedule, "schedule_options": dict(plan.schedule_options),
        "microbatches": plan.microbatches, "data_parallel": plan.data_parallel,
        "split_points": list(plan.split_points), "predicted": plan.predicted_step_time,
        "measured": statistics.median(times) if times else None, "step_times": list(times or ())}
    if error:
        record["error"] = error
    return record


def try_plans(result: PlanResult, *, build: Callable[[], nn.Module], inputs: Any, target: Any,
              loss_fn: Callable[[Any, Any], torch.Tensor], k: int = 3, steps: int = 3, warmup: int = 1,
              process_group: ProcessGroup | None = None, options_for: Callable[[Plan], dict] | None = None,
              **pipeline_options: Any) -> PlanResult:
    """``result`` with the fastest measured of its ``k`` best plans (:func:`trial_plans`) as its plan, which
    carries every trial (``Plan.trials``), and that plan's simulated timeline; every rank of ``process_group``
    (default: the default group, of the plans' world size) calls it with the same ``inputs`` and ``target``
    (one step's batch) and the same ``build`` (a fresh model, the same weights on every rank, each call).
    ``pipeline_options`` go to ``pipeloom.pipeline`` (e.g. ``tracing=Tracing(...)``), with
    ``options_for(plan)``'s for each plan where given (e.g. example inputs of its micro-batch size).
    PlanError when no trial could run."""
    import torch.distributed as dist

    if steps < 1 or warmup < 0:
        raise PlanError(f"need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    world = dist.get_world_size(process_group)
    if result.plan.world_size != world:
        raise PlanError(f"the plan runs on {result.plan.world_size} ranks but {world} are at hand; try the plans "
                        f"on {result.plan.world_size} ranks (torchrun --nproc-per-node {result.plan.world_size})")
    sent = [[(t.label, plan_to_json(t.plan), t.schedule_json) for t in trial_plans(result, k)]]
    dist.broadcast_object_list(sent, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                               group=process_group)
    trials = [TrialPlan(label=label, plan=plan_from_json(text), schedule_json=schedule)
              for label, text, schedule in sent[0]]
    records = []
    with tempfile.TemporaryDirectory(prefix="pipeloom-try-") as scratch:
        for n, trial in enumerate(trials):
            folder = Path(scratch) / str(n)
            folder.mkdir()
            try:
                options = {**pipeline_options, **(options_for(trial.plan) if options_for is not None else {})}
                times = measure_plan(trial, folder, build=build, inputs=inputs, target=target, loss_fn=loss_fn,
                                     steps=steps, warmup=warmup, process_group=process_group, **options)
                records.append((trial, _record(trial, times)))
            except PipeloomError as error:  # refused by the engine, the same way on every rank
                records.append((trial, _record(trial, None, f"{type(error).__name__}: {error}")))
    ran = [(trial, record) for trial, record in records if record["measured"] is not None]
    if not ran:
        reasons = "; ".join(f"{record['label']}: {record['error']}" for _, record in records) or "no plan fits"
        raise PlanError(f"none of the {len(records)} plans tried could run: {reasons}")
    ordered = sorted(records, key=lambda pair: (pair[1]["measured"] is None, pair[1]["measured"] or 0.0))
    chosen = ordered[0][0]
    plan = dataclasses.replace(chosen.plan, trials=tuple(record for _, record in ordered))
    return dataclasses.replace(result, plan=plan, timeline=simulate(schedule_from_json(chosen.schedule_json)))
