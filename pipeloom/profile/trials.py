"""Choose a plan by measurement: run the K best predicted plans in the engine, on the ranks at hand, and keep
the fastest measured (``pipeloom plan --try K``, :func:`try_plans`).

The planner's predictions can be noisier than the gaps between its best plans (issue 28: on HF LLaMA the
chosen chimera ran 31 % slower than 1F1B), so the last word goes to the engine. Every rank calls
:func:`try_plans` (a collective on the process group). Rank 0's plan search names the trials (a search cut
short by a time limit may differ between ranks), each as its plan and its re-costed schedule, and sends them to
every rank; each rank saves them in a folder of its own and builds each with ``pipeloom.pipeline(plan=...)``
from a fresh model, then runs its warm-up steps. The timed steps follow in interleaved rounds with successive
elimination (:class:`pipeloom.plan.race.TrialRace`): the engines of the plans still in the race live
together, so memory must hold K of them at once. A step's time is the slowest rank's seconds in
``engine.step`` (the ranks start it together, after a barrier; nothing else is timed), and a plan's time the
median of its timed steps. The chosen plan carries every trial in :attr:`pipeloom.plan.plan.Plan.trials`.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeloom.errors import PipeloomError
from pipeloom.ir import schedule_from_json, schedule_to_json
from pipeloom.plan.plan import Plan, PlanError, plan_from_json, plan_to_json
from pipeloom.plan.planner import PlanResult
from pipeloom.plan.race import SPREAD, TrialBudget, TrialRace, entrants
from pipeloom.sim import simulate

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

__all__ = ["TrialPlan", "check_world", "trial_plans", "try_plans"]


@dataclasses.dataclass(frozen=True, slots=True)
class TrialPlan:
    """One plan to try: its label, the plan, and the re-costed schedule the planner simulated for it."""

    label: str
    """``1f1b, 8 micro-batches (dp 1)``-style name."""
    plan: Plan
    """The plan as the engine reads it (its ``predicted_step_time`` the candidate's)."""
    schedule_json: str
    """The simulated schedule (``pipeloom.schedule/1``, costs included): the order the engine must run."""


def trial_plans(result: PlanResult, k: int, *, spread: float = SPREAD) -> list[TrialPlan]:
    """``k`` of the best fitting candidates of ``result`` as plans of ``result.plan``'s mesh and tensor
    parallelism, the best predicted first: distinct in what they run (schedules that coincide, such as gpipe
    and 1f1b at one micro-batch, count once), and spread over shapes (micro-batches, stages per rank) where a
    shape's best is predicted within ``spread`` (a fraction) of the best plan (:func:`pipeloom.plan.race.entrants`)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PlanError(f"the number of plans to try must be a positive integer, got {k!r}")
    if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not 0 <= spread < float("inf"):
        raise PlanError(f"the trials' spread must be a fraction of at least 0, got {spread!r}")
    base = result.plan
    world = base.world_size
    fitting = [c for c in result.candidates
               if c.fits and getattr(c, "tensor_parallel", base.tensor_parallel) == base.tensor_parallel]
    found = []
    for candidate in entrants(fitting, k, spread):
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
    return found


def _engine(trial: TrialPlan, folder: Path, build: Callable[[], nn.Module], loss_fn: Callable[[Any, Any], Any],
            process_group: ProcessGroup | None, options: dict):
    """``trial``'s engine, built from a fresh model; ``PipeloomError`` where the engine refuses the plan (the
    same way on every rank)."""
    from pipeloom.runtime.build import pipeline
    from pipeloom.runtime.options import Parallelism

    folder.mkdir()
    path = folder / "plan.json"
    PlanResult(plan=trial.plan, timeline=simulate(schedule_from_json(trial.schedule_json)), candidates=(),
               seconds=0.0).save(path)  # with the simulated order next to it where the engine would build another
    return pipeline(build(), plan=str(path), loss_fn=loss_fn, parallel=Parallelism(process_group=process_group),
                    **options)


def _steps(engine, count: int, inputs: Any, target: Any, process_group: ProcessGroup | None) -> list[float]:
    """Seconds of each of ``count`` steps, the slowest rank's: only ``engine.step`` is timed, every rank
    starting it after a barrier (one all-reduce at the end, so the same on every rank)."""
    import torch
    import torch.distributed as dist

    if count == 0:
        return []
    local = []
    for _ in range(count):
        for param in engine.parameters():
            param.grad = None  # as after optimizer.zero_grad(set_to_none=True)
        dist.barrier(group=process_group)
        started = time.perf_counter()
        engine.step(inputs, target=target)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        local.append(time.perf_counter() - started)
    slowest = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=process_group)
    return [float(t) for t in slowest.tolist()]


def _record(trial: TrialPlan, race: TrialRace, n: int, error: str = "") -> dict:
    plan = trial.plan
    record: dict[str, Any] = {
        "label": trial.label, "schedule": plan.schedule, "schedule_options": dict(plan.schedule_options),
        "microbatches": plan.microbatches, "data_parallel": plan.data_parallel,
        "split_points": list(plan.split_points), "predicted": plan.predicted_step_time,
        "measured": race.median(n), "step_times": [t for round_ in race.times[n] for t in round_],
        "rounds": len(race.times[n])}
    if n in race.dropped:
        record["dropped_after"] = race.dropped[n]
    if error:
        record["error"] = error
    return record


def _shared_trials(result: PlanResult, k: int, spread: float, process_group: ProcessGroup | None) -> list[TrialPlan]:
    """Rank 0's :func:`trial_plans`, on every rank."""
    import torch.distributed as dist

    sent = [[(t.label, plan_to_json(t.plan), t.schedule_json) for t in trial_plans(result, k, spread=spread)]]
    dist.broadcast_object_list(sent, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                               group=process_group)
    return [TrialPlan(label=label, plan=plan_from_json(text), schedule_json=schedule)
            for label, text, schedule in sent[0]]


class _Entrants:
    """The engines of the plans in a race, each one's steps, and why a plan left it refused."""

    def __init__(self, race: TrialRace, inputs: Any, target: Any, process_group: ProcessGroup | None) -> None:
        self.race, self.inputs, self.target, self.process_group = race, inputs, target, process_group
        self.engines: dict[int, Any] = {}
        self.errors: dict[int, str] = {}

    def refuse(self, n: int, error: PipeloomError) -> None:
        """Plan ``n`` out of the race with ``error`` (the engine refused it, the same way on every rank)."""
        self.errors[n] = f"{type(error).__name__}: {error}"
        self.race.refuse(n)
        engine = self.engines.pop(n, None)
        if engine is not None:
            engine.close()

    def steps(self, n: int, count: int) -> list[float] | None:
        """``count`` timed steps of plan ``n``; None where its engine refused a step by a check every rank makes
        alike after it (the two replicas' buffers: :class:`~pipeloom.runtime.errors.ReplicaBufferError`), the plan
        then out of the race. Any other failure of a step ends the race: its ranks may have parted mid-step."""
        from pipeloom.runtime.errors import ReplicaBufferError

        try:
            return _steps(self.engines[n], count, self.inputs, self.target, self.process_group)
        except PipeloomError as error:
            if not isinstance(error, ReplicaBufferError) and not isinstance(error.__cause__, ReplicaBufferError):
                raise
            self.refuse(n, error)
            return None


def check_world(result: PlanResult, world: int) -> None:
    """PlanError where the ranks at hand are not the plans' (every rank says it alike, so a launcher can check the
    ranks it starts before they join a group: one rank leaving early had crashed the others' rendezvous)."""
    if result.plan.world_size != world:
        raise PlanError(f"the plan runs on {result.plan.world_size} ranks but {world} are at hand; try the plans "
                        f"on {result.plan.world_size} ranks (torchrun --nproc-per-node {result.plan.world_size})")


def try_plans(result: PlanResult, *, build: Callable[[], nn.Module], inputs: Any, target: Any,
              loss_fn: Callable[[Any, Any], torch.Tensor], k: int = 3, spread: float = SPREAD,
              budget: TrialBudget | None = None,
              process_group: ProcessGroup | None = None, options_for: Callable[[Plan], dict] | None = None,
              **pipeline_options: Any) -> PlanResult:
    """``result`` with the fastest measured of its ``k`` best plans (:func:`trial_plans` with ``spread``) as its
    plan, which carries every trial (``Plan.trials``, the chosen first), and that plan's simulated timeline. ``budget``
    (default ``TrialBudget()``) sets the warm-up, the steps per round and when to stop
    (:mod:`pipeloom.plan.race`). Every rank of ``process_group`` (default: the default group, of the plans'
    world size) calls it with the same ``inputs`` and ``target`` (one step's batch) and the same ``build`` (a
    fresh model, the same weights on every rank, each call). ``pipeline_options`` go to ``pipeloom.pipeline``
    (e.g. ``tracing=Tracing(...)``), with ``options_for(plan)``'s for each plan where given (e.g. example
    inputs of its micro-batch size). PlanError when no trial could run."""
    import torch.distributed as dist

    budget = TrialBudget() if budget is None else budget
    check_world(result, dist.get_world_size(process_group))
    trials = _shared_trials(result, k, spread, process_group)
    race = TrialRace(len(trials), budget)
    entrants = _Entrants(race, inputs, target, process_group)
    with tempfile.TemporaryDirectory(prefix="pipeloom-try-") as scratch:
        for n, trial in enumerate(trials):
            options = {**pipeline_options, **(options_for(trial.plan) if options_for is not None else {})}
            try:
                entrants.engines[n] = _engine(trial, Path(scratch) / str(n), build, loss_fn, process_group, options)
            except PipeloomError as error:  # refused by the engine, the same way on every rank
                entrants.refuse(n, error)
                continue
            race.spend(sum(entrants.steps(n, budget.warmup) or ()))
        while not race.done():
            for n in race.order():  # settling steps first: the first after another engine's find cold caches
                settled = entrants.steps(n, budget.settle)
                timed = entrants.steps(n, budget.round_steps) if settled is not None else None
                race.spend(sum(settled or ()))
                if timed is not None:
                    race.record(n, timed)
            if not race.alive:  # every plan left the race refused in this round
                break
            for n in race.end_round():
                del entrants.engines[n]  # memory back as soon as a plan leaves the race
    errors = entrants.errors
    records = [_record(trials[n], race, n, errors.get(n, "")) for n in race.ranking()]
    if not race.alive:
        reasons = "; ".join(f"{record['label']}: {record['error']}" for record in records) or "no plan fits"
        raise PlanError(f"none of the {len(records)} plans tried could run: {reasons}")
    chosen = trials[race.ranking()[0]]
    plan = dataclasses.replace(chosen.plan, trials=tuple(records))
    return dataclasses.replace(result, plan=plan, timeline=simulate(schedule_from_json(chosen.schedule_json)))
