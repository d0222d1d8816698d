"""A plan file of ``pipeloom plan`` as :func:`~pipeloom.runtime.pipeline`'s arguments: its schedule, split points,
options and micro-batches where none are given, the mesh it runs on (checked against the ranks launched), its
sharding and its tensor-parallel recipe; and the batch it was planned for (:class:`PlannedBatch`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeloom.plan.plan import Plan, load_plan
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.options import Parallelism
from pipeloom.runtime.parallel.tp import recipe_styles

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PlannedBatch", "plan_arguments"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PlannedBatch:
    """The global batch a plan file was made for, and its sequence length where it says one (a cluster plan's
    ``--seq``). A training step on another size runs (the runtime takes any size its micro-batches cut), but the plan's
    predicted time and memory are not for it: said once per size."""

    path: str
    rows: int
    tokens: int | None = None
    told: set[tuple[str, int]] = dataclasses.field(default_factory=set)

    def check(self, inputs: object) -> None:
        """Warn the first time a training step's batch has another number of rows, or its token ids (a 2-D integer
        first input) another sequence length."""
        first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            return  # refused by the step itself
        self._tell("rows", first.shape[0], self.rows, "this step's batch has %d rows but %s was planned for a global "
                   "batch of %d: the step runs, but the plan's predicted step time and memory are for %d rows (plan "
                   "again with --global-batch %d for this batch)")
        if self.tokens is not None and first.dim() == 2 and not (first.is_floating_point() or first.is_complex()):
            self._tell("tokens", first.shape[1], self.tokens, "this step's sequences have %d tokens but %s was planned "
                       "for %d: the step runs, but the plan's predicted step time and memory are for %d tokens (plan "
                       "again with --seq %d for these sequences)")

    def _tell(self, what: str, seen: int, planned: int, message: str) -> None:
        """Warn once per ``seen`` size of ``what`` other than the plan's; ``message`` takes the sizes as
        seen, path, planned, planned, seen."""
        if seen != planned and (what, seen) not in self.told:
            self.told.add((what, seen))
            logger.warning(message, seen, self.path, planned, planned, seen)


def plan_arguments(plan: str | Path, schedule: object, split_points: Sequence[str] | None, options: dict | None,
                   microbatches: int | None, *, parallel: Parallelism, device: torch.device | str | None,
                   model: object = None) -> tuple:
    """(schedule, split points, schedule options, micro-batches, parallelism, planned batch) from a plan file,
    explicit ones winning; a plan with replicas or tensor parallelism gets a ``("dp", "pp", "tp")`` mesh over every rank
    (``("dp", "pp", "ep")`` with expert parallelism; sizes of 1 left out) unless one is given (whose shape must
    be the plan's), its sharding as ``data_parallel`` unless given, and its saved tensor-parallel recipe becomes
    torch's ``ParallelStyle`` dict (:func:`pipeloom.runtime.parallel.tp.recipe_styles`). A warning where ``model``
    is not the one the plan says it was made for (:func:`_check_model`)."""
    chosen = load_plan(plan)
    _check_model(plan, chosen.model, model)
    if chosen.context_parallel > 1:
        raise PipelineError(f"{plan} cuts each sequence over {chosen.context_parallel} ranks (context_parallel, a "
                            "layout saved for torchtitan with --export torchtitan, which runs it), and pipeloom's "
                            "runtime has no context parallelism; run it with torchtitan, or plan for pipeloom's "
                            "runtime (--save without --export: it searches the layouts pipeloom runs)")
    if schedule is None:
        _check_schedule(plan, chosen.schedule)
    mesh, tp_plan = parallel.mesh, parallel.tp_plan
    if chosen.data_parallel > 1 or chosen.tensor_parallel > 1:  # expert_parallel > 1 implies data_parallel > 1
        mesh = _plan_mesh(chosen, mesh, parallel.process_group, device)
    elif mesh is None and parallel.process_group is None:
        _check_world(chosen)
    if tp_plan is None and chosen.tp_plan is not None:
        tp_plan = recipe_styles(chosen.tp_plan)
    parallel = dataclasses.replace(parallel, mesh=mesh, tp_plan=tp_plan,
                                   data_parallel=parallel.data_parallel or chosen.sharding)
    return (chosen.schedule if schedule is None else schedule,
            chosen.split_points if split_points is None else split_points,
            dict(chosen.schedule_options) if options is None else options,
            chosen.microbatches if microbatches is None else microbatches, parallel,
            PlannedBatch(str(plan), chosen.global_batch, chosen.sequence_length))


def _check_model(plan: str | Path, planned: dict | None, model: object) -> None:
    """Warn where a transformers ``model``'s config (its language model's, for a multimodal one) has other layer or
    hidden sizes than the plan says it was made for: its split points may still name modules of it, but its
    predicted step time and memory are another model's (a plan for another model had run without a word)."""
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", None)
    text = text_config() if callable(text_config) else config
    if planned is None or text is None:
        return
    seen = {key: getattr(text, key, None) for key in planned if key != "model_type"}
    differ = [f"{key} {value} (the plan's {planned[key]:,})" for key, value in seen.items()
              if isinstance(value, int) and isinstance(planned[key], int) and value != planned[key]]
    if differ:
        logger.warning("%s was planned for another model than this one, whose %s: it runs where its split points "
                       "are this model's modules, but its predicted step time and memory are not this model's (plan "
                       "again with this model's config)", plan, ", ".join(differ))


def _check_schedule(plan: str | Path, name: str) -> None:
    """PipelineError naming the plan file where its schedule is neither built in nor a schedule file (a hand edit)."""
    from pipeloom.schedules import REGISTRY, meant_schedule

    if name not in REGISTRY and not (name.lower().endswith((".json", ".csv")) and Path(name).is_file()):
        raise PipelineError(f"{plan}: its schedule {name!r}{meant_schedule(name)} is neither a built-in "
                            f"({', '.join(REGISTRY)}) nor a .json/.csv schedule file next to it; fix the plan's "
                            "\"schedule\"")


def _plan_mesh(chosen: Plan, mesh: DeviceMesh | None, process_group: ProcessGroup | None,
               device: torch.device | str | None) -> DeviceMesh:
    """The ``("dp", "pp", "tp")`` mesh a plan with ``data_parallel`` replicas and ``tensor_parallel`` ranks
    per stage runs on, or ``("dp", "pp", "ep")`` with ``expert_parallel`` (its replicas ``dp × ep``); "dp",
    "ep" and "tp" left out where 1."""
    import torch.distributed as dist

    ep = chosen.expert_parallel
    shape = {"dp": chosen.data_parallel // ep, "pp": chosen.num_ranks, "ep": ep, "tp": chosen.tensor_parallel}
    shape = {name: size for name, size in shape.items() if size > 1 or name == "pp"}
    described = " x ".join(f"{name} {size}" for name, size in shape.items())
    if process_group is not None:
        raise PipelineError(f"the plan runs on a {described} mesh; pass Parallelism(mesh=) a mesh (dims "
                            f"{', '.join(map(repr, shape))}) or nothing, not process_group=")
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        got = {n: mesh.size(k) for k, n in enumerate(names)}
        if any(got.get(name, 1) != size for name, size in {"dp": 1, "ep": 1, "tp": 1, **shape}.items()):
            raise PipelineError(f"the plan's mesh is {described} but mesh= is "
                                f"{' x '.join(f'{n} {v}' for n, v in got.items())}; pass a mesh of the plan's shape "
                                "or none")
        return mesh
    _check_world(chosen)
    from torch.distributed.device_mesh import init_device_mesh

    kind = torch.device(device).type if device is not None else ("cuda" if dist.get_backend() == "nccl" else "cpu")
    return init_device_mesh(kind, tuple(shape.values()), mesh_dim_names=tuple(shape))


def _check_world(chosen: Plan) -> None:
    """The plan's ranks against the job's (a plan of one rank runs without torch.distributed), said in the plan's
    own terms (ep within dp, as the planner's layout gives it)."""
    import torch.distributed as dist

    sizes = {"dp": chosen.data_parallel, "pp": chosen.num_ranks, "tp": chosen.tensor_parallel}
    described = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1 or name == "pp")
    described += f", ep {chosen.expert_parallel} within dp" if chosen.expert_parallel > 1 else ""
    if not dist.is_initialized() and chosen.world_size > 1:
        raise PipelineError(f"the plan runs on {chosen.world_size} ranks ({described}); launch them (torchrun "
                            f"--nproc-per-node {chosen.world_size}) and init_process_group first")
    if dist.is_initialized() and dist.get_world_size() != chosen.world_size:
        raise PipelineError(f"the plan runs on {chosen.world_size} ranks ({described}) but this job has "
                            f"{dist.get_world_size()}; launch {chosen.world_size} ranks or plan for "
                            f"{dist.get_world_size()}")
