"""A pipeline plan: where to cut the model, which schedule to run with how many micro-batches, and
what the simulator predicts; its ``pipeloom.plan/1`` JSON form, which the runtime reads (``pipeloom.plan/2``
for a plan with expert parallelism, the one key ``/1`` lacks; every ``/1`` file reads as before)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeloom.errors import PipeloomError, shown
from pipeloom.ir.jsonfields import check_keys, integer, number, parse_object, read_json_file, string, strings
from pipeloom.plan.errors import PlanError
from pipeloom.schedules import REGISTRY

__all__ = ["PLAN_FORMAT", "PLAN_FORMAT_EP", "Plan", "load_plan", "model_stage_count", "plan_from_json", "plan_to_json",
           "save_plan"]

PLAN_FORMAT = "pipeloom.plan/1"
PLAN_FORMAT_EP = "pipeloom.plan/2"
"""A plan with ``expert_parallel`` or ``context_parallel`` above 1 is written in this version (``/1`` plus those keys),
so that a pipeloom that cannot run it says so by the format; every other plan is still written and read as ``/1``."""

_SCHEDULE_FILE_SUFFIXES = (".json", ".csv")


def model_stage_count(schedule: str, num_ranks: int, options: dict | None = None) -> int | None:
    """How many pieces the model is cut into for the built-in ``schedule`` on ``num_ranks`` ranks.

    p for one stage per rank (gpipe, 1f1b, zb-h1, zb-h2) and for the two-replica schedules (dualpipe,
    chimera: each rank holds a piece of each replica); p*v for the looped ones (interleaved-1f1b,
    looped-bfs, v = ``stages_per_rank``, default 2); 2p for the V ones (zbv, dualpipev). None for a
    name that is not built in (a saved schedule file).
    """
    if schedule not in REGISTRY:
        return None
    return REGISTRY[schedule].num_pieces(num_ranks, options)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Everything the runtime needs to run a planned pipeline, and what the planner predicted."""

    num_ranks: int
    """Ranks (pipeline devices)."""
    split_points: tuple[str, ...]
    """Module names where model stages 1.. start (``pipeloom.runtime.split_model``)."""
    schedule: str
    """A built-in schedule name, or the path of a saved ``.json``/``.csv`` schedule."""
    schedule_options: dict = field(default_factory=dict)
    """Options of the built-in schedule, e.g. ``{"stages_per_rank": 2}``."""
    microbatches: int
    """Micro-batches per step (real ones: two-replica schedules pair them)."""
    global_batch: int
    """Samples per step; each micro-batch holds ``global_batch / microbatches``."""
    predicted_step_time: float
    """Simulated seconds per step (one pass of the schedule)."""
    peak_memory: tuple[float, ...] = ()
    """Simulated peak bytes per rank: weights, gradients, optimizer state and activations."""
    memory_limit: float | None = None
    """The per-rank byte limit the plan was made for."""
    bubble_ratio: float | None = None
    """Simulated idle share of the step."""
    stage_times: tuple[float, ...] = ()
    """Seconds per micro-batch of each model stage (F + I + W and the send of its output)."""
    device: str = ""
    """Where the costs were measured (the cost table's device)."""
    data_parallel: int = 1
    """Replicas of the pipeline: the job runs on ``num_ranks * data_parallel`` ranks, a ``("dp", "pp")``
    mesh, each replica taking ``global_batch / data_parallel`` samples in ``microbatches`` micro-batches."""
    sharding: str = "replicate"
    """How the replicas hold the weights: ``"replicate"`` or ``"fsdp"`` (``pipeline(..., data_parallel=)``)."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks per pipeline stage: the job runs on ``world_size`` ranks, a ``("dp", "pp", "tp")``
    mesh (``"dp"`` left out when 1)."""
    expert_parallel: int = 1
    """Ranks of one pipeline stage each MoE layer's experts are shared out over: the ``data_parallel`` replicas
    are ``data_parallel / expert_parallel`` groups of that many, a ``("dp", "pp", "ep")`` mesh (``"dp"`` left
    out when 1; docs/parallelism.md, expert parallelism)."""
    context_parallel: int = 1
    """Ranks each sequence is cut over (a layout exported for torchtitan, which runs it: ``pipeloom plan --save
    --export torchtitan``); pipeloom's runtime has no context parallelism and refuses a plan with it above 1. The
    job runs on ``world_size`` ranks."""
    tp_plan: dict | None = None
    """With ``tensor_parallel`` > 1: the tensor-parallel plan as JSON, a built-in recipe and its module names
    (:mod:`pipeloom.plan.tp.recipes`), turned into torch's ``ParallelStyle`` dict by ``pipeline(plan=)``."""
    sequence_length: int | None = None
    """Tokens per sample the plan was priced for (a cluster plan's ``--seq``), which its predicted step time and
    memory hold for; None where the plan does not say (a plan from a measured cost table)."""
    model: dict | None = None
    """The model the plan was made for, where it says: a cluster plan's ``{"model_type", "num_hidden_layers",
    "hidden_size"}`` from the config it read (``pipeline(model, plan=)`` warns where a transformers model's config
    differs); None where the plan does not say."""
    trials: tuple[dict, ...] = ()
    """The plans measured in the engine before this one was chosen (``pipeloom plan --try K``), the chosen
    first, then the others left in the race by median step, then those dropped (the last dropped first), then
    those refused: each ``{"label", "schedule", "schedule_options", "microbatches", "data_parallel",
    "split_points", "predicted", "measured", "step_times", "rounds"}`` and ``"dropped_after"`` (the round) for a
    plan dropped as clearly slower (seconds; ``measured`` the median timed step, null with an ``"error"`` where
    the plan could not run); empty when the plan was chosen by prediction alone."""

    def __post_init__(self) -> None:
        for name in ("num_ranks", "microbatches", "global_batch", "data_parallel", "tensor_parallel",
                     "expert_parallel", "context_parallel", "sequence_length"):
            value = getattr(self, name)
            if value is None and name == "sequence_length":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"plan {name} must be a positive integer, got {shown(value)}")
        if self.model is not None and (not isinstance(self.model, dict) or not all(
                isinstance(key, str) and isinstance(value, (str, int)) and not isinstance(value, bool)
                for key, value in self.model.items())):
            raise PlanError(f"plan model must be an object of names and counts, e.g. {{\"model_type\": \"llama\", "
                            f"\"num_hidden_layers\": 32}}, got {shown(self.model)}")
        if self.sharding not in ("replicate", "fsdp"):
            raise PlanError(f"plan sharding must be 'replicate' or 'fsdp', got {shown(self.sharding)}")
        if self.global_batch % (self.microbatches * self.data_parallel):
            raise PlanError(f"plan global_batch {self.global_batch} is not a multiple of microbatches "
                            f"{self.microbatches} x data_parallel {self.data_parallel}; every micro-batch must "
                            "hold the same number of samples")
        if self.data_parallel % self.expert_parallel:
            raise PlanError(f"plan expert_parallel {self.expert_parallel} must divide data_parallel "
                            f"{self.data_parallel} (the experts are shared out over replicas of a stage)")
        if self.expert_parallel > 1 and (self.tensor_parallel > 1 or self.sharding == "fsdp"):
            raise PlanError(f"plan expert_parallel {self.expert_parallel} with tensor_parallel "
                            f"{self.tensor_parallel} and sharding {self.sharding!r}: pipeloom runs ep with "
                            "tensor_parallel 1 and sharding 'replicate' only")
        if (self.tensor_parallel > 1) != (self.tp_plan is not None):
            raise PlanError(f"plan tensor_parallel {self.tensor_parallel} needs a tp_plan exactly when it is above 1 "
                            f"(got tp_plan {shown(self.tp_plan)}); give both or neither")
        if self.tp_plan is not None:
            from pipeloom.plan.errors import RecipeError
            from pipeloom.plan.tp.recipes import check_recipe

            try:
                object.__setattr__(self, "tp_plan", check_recipe(self.tp_plan))
            except RecipeError as error:
                raise PlanError(f"plan {error}") from None
        split = tuple(self.split_points)
        if len(set(split)) != len(split) or not all(isinstance(s, str) and s for s in split):
            raise PlanError(f"plan split_points must be distinct module names, got {list(split)}")
        object.__setattr__(self, "split_points", split)
        if not isinstance(self.schedule, str) or not self.schedule:
            raise PlanError(f"plan schedule must be a schedule name or file, got {shown(self.schedule)}")
        if self.schedule in REGISTRY:
            unknown = sorted(set(self.schedule_options) - set(REGISTRY[self.schedule].options))
            if unknown:
                takes = ", ".join(REGISTRY[self.schedule].options) or "no options"
                raise PlanError(f"plan: schedule {self.schedule!r} does not take {', '.join(unknown)} "
                                f"(it takes {takes})")
        expected = model_stage_count(self.schedule, self.num_ranks, self.schedule_options)
        if expected is not None and expected != len(split) + 1:
            raise PlanError(
                f"plan: schedule {self.schedule!r} on {self.num_ranks} ranks runs {expected} model stages, but "
                f"the {len(split)} split points make {len(split) + 1}; give {expected - 1} split points"
            )
        object.__setattr__(self, "peak_memory", tuple(float(v) for v in self.peak_memory))
        object.__setattr__(self, "stage_times", tuple(float(v) for v in self.stage_times))

    @property
    def microbatch_size(self) -> int:
        """Samples per micro-batch."""
        return self.global_batch // (self.microbatches * self.data_parallel)

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: the pipeline's times the replicas times the tensor- and context-parallel ranks."""
        return self.num_ranks * self.data_parallel * self.tensor_parallel * self.context_parallel

    @property
    def num_stages(self) -> int:
        """Model stages (pieces of the cut model)."""
        return len(self.split_points) + 1


_KEYS = {"format", "num_ranks", "split_points", "schedule", "schedule_options", "microbatches", "global_batch",
         "microbatch_size", "predicted_step_time", "peak_memory", "memory_limit", "bubble_ratio", "stage_times",
         "device", "data_parallel", "sharding", "tensor_parallel", "tp_plan", "sequence_length", "model", "trials"}


def plan_to_json(plan: Plan, *, indent: int | None = 1) -> str:
    """The ``pipeloom.plan/1`` JSON text of ``plan`` (``/2`` with ``expert_parallel`` or ``context_parallel`` above
    1)."""
    document = {
        "format": PLAN_FORMAT if plan.expert_parallel == plan.context_parallel == 1 else PLAN_FORMAT_EP,
        "num_ranks": plan.num_ranks,
        "split_points": list(plan.split_points),
        "schedule": plan.schedule,
        "schedule_options": dict(plan.schedule_options),
        "microbatches": plan.microbatches,
        "global_batch": plan.global_batch,
        "microbatch_size": plan.microbatch_size,
        "predicted_step_time": plan.predicted_step_time,
        "peak_memory": list(plan.peak_memory),
        "memory_limit": plan.memory_limit,
        "bubble_ratio": plan.bubble_ratio,
        "stage_times": list(plan.stage_times),
        "device": plan.device,
        "data_parallel": plan.data_parallel,
        "sharding": plan.sharding,
    }
    if plan.tensor_parallel > 1:  # optional: plans without tensor parallelism read as before
        document["tensor_parallel"] = plan.tensor_parallel
        # an empty head_norm list is left out: a plan without per-head norms reads as before, by older readers too
        document["tp_plan"] = {k: v for k, v in (plan.tp_plan or {}).items() if k != "head_norm" or v}
    if plan.expert_parallel > 1:  # /2 only
        document["expert_parallel"] = plan.expert_parallel
    if plan.context_parallel > 1:  # /2 only
        document["context_parallel"] = plan.context_parallel
    if plan.sequence_length is not None:  # optional: a cluster plan's --seq
        document["sequence_length"] = plan.sequence_length
    if plan.model is not None:  # optional: a cluster plan's model
        document["model"] = dict(plan.model)
    if plan.trials:  # optional as well: written only for a plan chosen by measurement
        document["trials"] = [dict(trial) for trial in plan.trials]
    return json.dumps(document, indent=indent)


def _numbers(document: dict, key: str) -> tuple[float, ...]:
    values = document.get(key, [])
    if not isinstance(values, list):
        raise PlanError(f"plan.{key}: expected a list of numbers, got {shown(values)}")
    return tuple(number({key: v}, key, where="plan", error=PlanError) for v in values)


def _trials(entries: object) -> tuple[dict, ...]:
    """``plan.trials``: a list of objects, each with a ``label`` and a ``measured`` number (or null)."""
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise PlanError(f"plan.trials: expected a list of objects, got {shown(entries)}")
    for k, entry in enumerate(entries):
        string(entry, "label", where=f"plan.trials[{k}]", error=PlanError)
        number(entry, "measured", where=f"plan.trials[{k}]", error=PlanError, default=None, null=True)
    return tuple(entries)


def plan_from_json(text: str) -> Plan:
    """Parse ``pipeloom.plan/1`` JSON; unknown keys, another format or a wrong type are errors.

    Required: ``num_ranks``, ``split_points``, ``schedule``, ``microbatches``, ``global_batch``,
    ``predicted_step_time``; ``microbatch_size``, when present, must equal global_batch / (microbatches ×
    data_parallel). Optional: ``data_parallel`` (1), ``sharding`` (replicate), ``tensor_parallel`` (1),
    ``tp_plan`` (a recipe, :mod:`pipeloom.plan.tp.recipes`; required when ``tensor_parallel`` > 1),
    ``sequence_length`` (null: not said) and ``model`` (the model it was made for, where it says).
    """
    document = parse_object(text, error=PlanError, what="plan")
    if "format" not in document:
        raise PlanError(f"the plan is missing key 'format'; expected \"format\": \"{PLAN_FORMAT}\"")
    if document["format"] not in (PLAN_FORMAT, PLAN_FORMAT_EP):
        raise PlanError(f"format {shown(document['format'])} is not supported; expected {PLAN_FORMAT!r} or "
                        f"{PLAN_FORMAT_EP!r}")
    check_keys(document, _KEYS | {"expert_parallel", "context_parallel"} if document["format"] == PLAN_FORMAT_EP
               else _KEYS, where="plan", error=PlanError)
    where = "plan"
    options = document.get("schedule_options") or {}
    if not isinstance(options, dict):
        raise PlanError(f"plan.schedule_options: expected an object, got {shown(options)}")
    for key in options:  # every option of a built-in is a count (stages_per_rank)
        integer(options, key, where="plan.schedule_options", error=PlanError)
    plan = Plan(
        num_ranks=integer(document, "num_ranks", where=where, error=PlanError),
        split_points=strings(document, "split_points", where=where, error=PlanError),
        schedule=string(document, "schedule", where=where, error=PlanError),
        schedule_options=options,
        microbatches=integer(document, "microbatches", where=where, error=PlanError),
        global_batch=integer(document, "global_batch", where=where, error=PlanError),
        predicted_step_time=number(document, "predicted_step_time", where=where, error=PlanError),
        peak_memory=_numbers(document, "peak_memory"),
        memory_limit=number(document, "memory_limit", where=where, error=PlanError, default=None, null=True),
        bubble_ratio=number(document, "bubble_ratio", where=where, error=PlanError, default=None, null=True),
        stage_times=_numbers(document, "stage_times"),
        device=string(document, "device", where=where, error=PlanError, default=""),
        data_parallel=integer(document, "data_parallel", where=where, error=PlanError, default=1),
        sharding=string(document, "sharding", where=where, error=PlanError, default="replicate"),
        tensor_parallel=integer(document, "tensor_parallel", where=where, error=PlanError, default=1),
        tp_plan=document.get("tp_plan"),
        expert_parallel=integer(document, "expert_parallel", where=where, error=PlanError, default=1),
        context_parallel=integer(document, "context_parallel", where=where, error=PlanError, default=1),
        sequence_length=(integer(document, "sequence_length", where=where, error=PlanError)
                         if document.get("sequence_length") is not None else None),
        model=document.get("model"),
        trials=_trials(document.get("trials", [])),
    )
    size = document.get("microbatch_size", plan.microbatch_size)
    if size != plan.microbatch_size:
        per = "microbatches" if plan.data_parallel == 1 else "(microbatches x data_parallel)"
        raise PlanError(f"plan.microbatch_size {shown(size)} is not global_batch / {per} = {plan.microbatch_size}; "
                        "fix one of them")
    return plan


def load_plan(path: str | Path) -> Plan:
    """Read a ``pipeloom.plan/1`` file, or fetch one from a running ``pipeloom serve``
    (``http://HOST:PORT/plans/ID``). A schedule given as a relative ``.json``/``.csv`` file name is
    taken relative to the plan file's folder (and returned as that path); for a URL it is fetched from
    beside the plan into a new temporary folder, read as strictly as a file."""
    from pipeloom.remote import is_url

    if is_url(path):
        return _fetch_plan(str(path))
    path = Path(path)
    try:
        plan = plan_from_json(read_json_file(path, PlanError))
    except PlanError as error:
        raise PlanError(str(error) if str(path) in str(error) else f"{path}: {error}") from None
    schedule = Path(plan.schedule)
    if schedule.suffix.lower() in _SCHEDULE_FILE_SUFFIXES and not schedule.is_absolute():
        return replace(plan, schedule=str(path.parent / schedule))
    return plan


def _fetch_plan(url: str) -> Plan:
    """The plan at ``url`` and, where it names a relative schedule file, that file saved locally."""
    import tempfile
    from urllib.parse import urljoin

    from pipeloom.remote import read_url

    try:
        plan = plan_from_json(read_url(url))
    except PipeloomError as error:
        raise PlanError(str(error) if url in str(error) else f"{url}: {error}") from None
    schedule = Path(plan.schedule)
    if schedule.suffix.lower() not in _SCHEDULE_FILE_SUFFIXES:
        return plan  # a built-in schedule's name
    if schedule.is_absolute() or schedule.name != plan.schedule:  # a server names no file of this machine
        raise PlanError(f"{url}: the plan's schedule {plan.schedule!r} must be a plain file name beside the plan")
    text = read_url(urljoin(url, plan.schedule))
    local = Path(tempfile.mkdtemp(prefix="pipeloom-plan-")) / schedule.name
    local.write_text(text, encoding="utf-8")
    return replace(plan, schedule=str(local))


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as ``pipeloom.plan/1`` JSON."""
    Path(path).write_text(plan_to_json(plan) + "\n", encoding="utf-8")
