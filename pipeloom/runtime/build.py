"""``pipeline()``: everything settled before a rank's engine runs — the process groups, the stages, the
schedule and its lowering, this rank's pieces on its device (moved, or allocated from the meta device and
filled; sharded with FSDP2 where asked) — and the :class:`~pipeloom.runtime.engine.PipelineEngine` that
runs them."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.ir import Schedule
from pipeloom.runtime.comm.threads import end_group_at_exit
from pipeloom.runtime.comm.watch import closed_by
from pipeloom.runtime.engine import PipelineEngine
from pipeloom.runtime.errors import NeedsExampleError, PipelineError, SplitOrderError, UnknownSplitPointError
from pipeloom.runtime.first_step import FirstStepEngine, replaced_by
from pipeloom.runtime.model.materialize import place_pieces
from pipeloom.runtime.model.split import StagedModel
from pipeloom.runtime.options import Failures, Parallelism, Tracing, Weights
from pipeloom.runtime.parallel.dp import Layout, layout_of
from pipeloom.runtime.parallel.ep import (
    check_experts_agree,
    check_options_agree,
    check_tp_with_experts,
    experts_for,
    moe_layers,
    shard_experts,
)
from pipeloom.runtime.parallel.fsdp import shard_pieces
from pipeloom.runtime.parallel.tp import (
    apply_tp_plan,
    check_tied_untouched,
    check_tp_plan,
    leaf_modules_for,
    plan_blocks,
    set_group_timeout,
)
from pipeloom.runtime.parallel.tp_auto import AutoPlan, AutoSharding, auto_tp_plan, is_auto
from pipeloom.runtime.plan_file import PlannedBatch, plan_arguments
from pipeloom.runtime.program import Lowering, check_pieces
from pipeloom.runtime.setup import device_for, lower_for, resolve_schedule, shared_seed, staged_model
from pipeloom.runtime.state.state_dict import model_names
from pipeloom.runtime.step.pieces import RankPieces
from pipeloom.runtime.step.shared import SharedParameters, check_placement, shared_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TRACE_ENV", "pipeline"]

TRACE_ENV = "PIPELOOM_TRACE"

logger = logging.getLogger(__name__)


def pipeline(
    model: nn.Module | None = None,
    *,
    schedule: object = None,
    split_points: Sequence[str] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    microbatches: int | None = None,
    stages: StagedModel | Sequence[nn.Module] | None = None,
    schedule_options: dict | None = None,
    plan: str | Path | None = None,
    device: torch.device | str | None = None,
    seed: int | None = None,
    record: str | Path | bool | None = None,
    tracing: Tracing | None = None,
    parallel: Parallelism | None = None,
    weights: Weights | None = None,
    failures: Failures | None = None,
) -> PipelineEngine:
    """Build the engine that runs ``schedule`` over ``model`` cut into stages at ``split_points``.

    The simple call is ``pipeline(model, schedule="1f1b", split_points=["layers.4"], loss_fn=loss,
    microbatches=8)`` on the ranks ``torchrun`` started; the rest is optional:

    - ``schedule``: a built-in name (built for this world size, ``microbatches`` and the model's pieces;
      ``schedule_options`` passed to its generator), a :class:`~pipeloom.Schedule`, or a saved ``.json``/``.csv``.
    - ``stages``: the stages given instead of ``split_points`` (a :class:`StagedModel`, or one module per stage).
    - ``plan``: a plan file of ``pipeloom plan`` (split points, schedule, micro-batches, mesh; explicit
      arguments win).
    - ``device``: where this rank's pieces run (default: the rank's GPU, or the CPU).
    - ``seed``: every piece's forward draws its random numbers from it (default: rank 0's
      ``torch.initial_seed()``), so dropout draws the same on any number of ranks (docs/runtime.md).
    - ``record``: a folder to write the run trace ``rank<R>.json`` to after every step (R the pipeline rank; with
      replicas or tp the first pipeline's ranks alone write), or True to keep the steps in memory
      (``engine.trace_steps``); default: the ``PIPELOOM_TRACE`` environment variable.
    - Without ``Tracing(example_inputs=...)``, a model only torch.export traces (every ``transformers`` model)
      is split at the first step, traced on its batch (:class:`~pipeloom.runtime.first_step.FirstStepEngine`);
      the checks that need the graph happen then, with the same errors.
    - ``tracing``, ``parallel``, ``weights``, ``failures``: :class:`~pipeloom.runtime.options.Tracing`,
      :class:`~pipeloom.runtime.options.Parallelism`, :class:`~pipeloom.runtime.options.Weights`,
      :class:`~pipeloom.runtime.options.Failures` (each field documented there).
    """
    end_group_at_exit()  # whether or not an engine is built: a refusal must not leave gloo to the teardown
    tracing, parallel = tracing or Tracing(), parallel or Parallelism()
    weights, failures = weights or Weights(), failures or Failures()
    planned_batch, whose = None, ""  # whose: the plan file whose split points they are, for their errors
    if plan is not None:
        schedule, planned, schedule_options, microbatches, parallel, planned_batch = plan_arguments(
            plan, schedule, split_points, schedule_options, microbatches, parallel=parallel, device=device, model=model)
        split_points, whose = (planned, str(plan)) if stages is None and split_points is None else (split_points, "")
    _check_arguments(schedule, loss_fn, microbatches, split_points, record)
    assert loss_fn is not None  # _check_arguments refused None
    layout = layout_of(parallel.process_group, parallel.mesh)
    _refuse_broken_groups(layout)
    sharding, tp_plan = _tensor_parallel(model, parallel, layout, microbatches, tracing)
    if layout.tp.group is not None:  # a TP all-reduce inside a forward ends within the engine's timeout
        set_group_timeout([layout.group, layout.dp.group, layout.tp.group], failures.timeout)
    expert_names = experts_for(model, stages, layout.ep, parallel)
    if layout.ep.size > 1:  # an all-to-all inside a forward ends within the engine's timeout
        set_group_timeout([layout.group, layout.dp.group, layout.ep.group, layout.ep.dp_group], failures.timeout)
        check_options_agree({"capacity_factor": parallel.capacity_factor, "overlap_pairs": parallel.overlap_pairs},
                            layout.ep, stage_rank=layout.rank, everyone=layout.everyone)
    if model is not None and stages is None and split_points is not None:  # refused before any tracing
        schedule = _for_pieces(schedule, layout, len(split_points) + 1, microbatches, schedule_options or {})
    seed = shared_seed(layout.everyone, layout.everyone_size, seed)  # here, whenever the model is split
    settle = functools.partial(
        _engine_parts, model=model, layout=layout, schedule=schedule, microbatches=microbatches,
        schedule_options=schedule_options or {}, device=device, weights=weights, tp_plan=tp_plan, parallel=parallel,
        loss_fn=loss_fn, seed=seed, record=record if record is not None else os.environ.get(TRACE_ENV) or None,
        timeout=failures.timeout, sharding=sharding, expert_names=expert_names, planned_batch=planned_batch)

    def cut(example: object = None) -> StagedModel:
        given = tracing if example is None else dataclasses.replace(tracing, example_inputs=example, tracer="export")
        return _staged(model, split_points, stages, given, tp_plan, expert_names, whose=whose)

    try:
        staged = cut()
    except NeedsExampleError:  # only torch.export traces it, and no example was given: the first batch is one
        assert model is not None and split_points is not None  # a model to trace: its schedule resolved above
        logger.info("rank %d: torch.fx cannot trace %s; it is split at the first step, traced with torch.export "
                    "on that step's batch", layout.rank, type(model).__name__)
        return FirstStepEngine(model=model, sharding=sharding, build=lambda batch: settle(cut(batch)),
                               replaced=replaced_by(parallel, layout, tp_plan, expert_names))
    return PipelineEngine(**settle(staged))


def _for_pieces(schedule: object, layout: Layout, pieces: int, microbatches: int | None,
                options: dict) -> Schedule:
    """The schedule for a model cut into ``pieces``, checked to run that many before the model is traced (a
    large model's trace takes long; the pieces are known from its split points)."""
    resolved = resolve_schedule(schedule, num_ranks=layout.world, num_pieces=pieces, microbatches=microbatches,
                                options=options)
    check_pieces(resolved, pieces)
    return resolved


def _engine_parts(staged: StagedModel, *, model: nn.Module | None, layout: Layout, schedule: object,
                  microbatches: int | None, schedule_options: dict, device: torch.device | str | None,
                  weights: Weights, tp_plan: dict | None, parallel: Parallelism, loss_fn: Callable, seed: int,
                  record: str | Path | bool | None, timeout: float, sharding: AutoSharding | None,
                  expert_names: Sequence[str], planned_batch: PlannedBatch | None) -> dict:
    """What :class:`PipelineEngine` is built from, once the model is cut into ``staged``: the schedule lowered
    onto it, this rank's pieces placed on their device (tensor-parallel and FSDP-sharded where asked)."""
    sched = resolve_schedule(schedule, num_ranks=layout.world, num_pieces=staged.num_stages,
                             microbatches=microbatches, options=schedule_options)
    lowering = lower_for(sched, staged, world=layout.world, microbatches=microbatches)
    shared = shared_parameters(staged.stages)
    check_placement(shared, lowering)
    names = model_names(model, staged.stages)  # by identity: before any tensor is moved or allocated
    held = _held(lowering, layout.rank)
    if layout.ep.size > 1:
        _check_ep(lowering)
        check_experts_agree({k: staged.stages[k] for k in held}, expert_names, layout.ep, stage_rank=layout.rank,
                            everyone=layout.everyone)
    device = device_for(layout, device, [staged.stages[k] for k in held])
    replaced = place_pieces({k: staged.stages[k] for k in held}, device, model=model, names=names,
                            state_dict=weights.state_dict, init_weights=weights.init_weights)
    shared = dataclasses.replace(shared, params=tuple(cast(nn.Parameter, replaced.get(id(p), p))
                                                      for p in shared.params))
    data_parallel = parallel.data_parallel or "replicate"
    if tp_plan is not None:
        if layout.ep.size > 1:
            check_tp_with_experts(tp_plan, {k: staged.stages[k] for k in held}, expert_names)
        _apply_tp(staged, held, tp_plan, layout, lowering, data_parallel, shared)
    experts = shard_experts({k: staged.stages[k] for k in held}, expert_names, layout.ep,
                            link=parallel.simulated_link,
                            capacity_factor=parallel.capacity_factor) if layout.ep.size > 1 else []
    sharded = _sharded(data_parallel, layout, lowering, shared)
    if sharded:  # an experts module is sharded over "dp" on its own (its parameters are over "ep" already)
        shard_pieces({k: staged.stages[k] for k in held}, layout.dp.mesh,
                     inner=[(module, layout.ep.dp_mesh) for module in experts])
    pieces = _rank_pieces(lowering, layout, device, staged, loss_fn, seed, shared, sharded)
    logger.info("rank %d runs pieces %s on %s (data parallel: %s)", layout.rank, held, device, data_parallel)
    return dict(staged=staged, pieces=pieces, layout=layout, trace=record, timeout=timeout, names=names,
                scatter_boundaries=parallel.scatter_boundaries, tp_sharding=sharding,
                overlap_pairs=parallel.overlap_pairs, planned_batch=planned_batch)


def _tensor_parallel(model: nn.Module | None, parallel: Parallelism, layout: Layout, microbatches: int | None,
                     tracing: Tracing) -> tuple[AutoSharding | None, dict | None]:
    """The search's choice for ``tp_plan="auto"`` (else None) and the plan to apply (None: no tensor parallelism)."""
    if is_auto(parallel.tp_plan):
        if layout.ep.size > 1:
            check_tp_with_experts(parallel.tp_plan, {}, ())  # refused: the search does not know the experts
        sharding = _auto_plan(model, parallel.tp_plan, parallel.mesh, layout, microbatches, tracing.example_inputs)
        return sharding, sharding.plan or None  # every region replicated: nothing to apply
    return None, check_tp_plan(parallel.tp_plan, layout.tp, model=model)


def _staged(model: nn.Module | None, split_points: Sequence[str] | None,
            stages: StagedModel | Sequence[nn.Module] | None, tracing: Tracing, tp_plan: dict | None,
            expert_names: Sequence[str] = (), *, whose: str = "") -> StagedModel:
    """The stages, with the modules a tensor-parallel plan needs whole kept whole (torch.export would bake
    the trace's head counts in), and the experts modules of an "ep" mesh run as calls of the modules; ``whose``: the
    plan file the split points come from, named in their errors."""
    leaf_modules, blocks = list(tracing.leaf_modules), []
    if tp_plan is not None and model is not None and stages is None:
        leaf_modules = leaf_modules_for(model, tp_plan, leaf_modules)
        blocks = plan_blocks(model, tp_plan)
    if expert_names and model is not None and stages is None:
        leaf_modules = [*leaf_modules, *(n for n in expert_names if n not in leaf_modules)]
        blocks += [layer for layer in moe_layers(expert_names)
                   if not any(layer == b or layer.startswith(b + ".") for b in blocks)]
    try:
        return staged_model(model, split_points, stages, tracer=tracing.tracer, leaf_modules=leaf_modules,
                            example_inputs=tracing.example_inputs, export_leaves=blocks)
    except (UnknownSplitPointError, SplitOrderError) as error:  # the split points' own faults, not the trace's
        if not whose:
            raise
        raise type(error)(f"{whose}'s split_points {list(split_points or ())}: {error}") from None


def _held(lowering: Lowering, rank: int) -> list[int]:
    """The model pieces this rank holds (one copy of each)."""
    held = [lowering.piece_of[s] for s in lowering.stages_on(rank)]
    if len(set(held)) != len(held):
        raise PipelineError(f"rank {rank} holds two replicas of one model piece; put replicas on different ranks")
    return held


def _apply_tp(staged: StagedModel, held: Sequence[int], tp_plan: dict, layout: Layout, lowering: Lowering,
              data_parallel: str, shared: SharedParameters) -> None:
    """Shard this rank's pieces with torch's ``parallelize_module`` over the ``"tp"`` dimension."""
    _check_tp(lowering, data_parallel)
    check_tied_untouched(staged.stages, tp_plan, dict(zip(map(id, shared.params), shared.names)))
    before = _ids([staged.stages[k] for k in held])
    apply_tp_plan({k: staged.stages[k] for k in held}, tp_plan, layout.tp)
    _check_shared_kept(shared, before - _ids([staged.stages[k] for k in held]))


def _auto_plan(model: nn.Module | None, tp_plan: object, mesh: DeviceMesh | None, layout: Layout,
               microbatches: int | None, example_inputs: object) -> AutoSharding:
    """``tp_plan="auto"``: the search's plan for the whole model on this mesh (the same on every rank: it reads
    only the model's shapes and the options)."""
    if layout.tp.mesh is None:
        raise PipelineError("tp_plan='auto' shards over the mesh's \"tp\" dimension: pass Parallelism(mesh=) a "
                            "mesh with mesh_dim_names holding \"pp\" and \"tp\", e.g. init_device_mesh('cpu', (2, 2), "
                            "mesh_dim_names=('pp', 'tp'))")
    if model is None:
        raise PipelineError("tp_plan='auto' reads the model's shapes: pass the model too (pipeline(model, "
                            "stages=[...]) with stages of your own), or torch's parallelize_module plan as a dict")
    options = tp_plan if isinstance(tp_plan, AutoPlan) else AutoPlan()
    found = auto_tp_plan(model, mesh, microbatches=microbatches or 1, example_inputs=example_inputs,
                         options=options)
    logger.info("tp_plan='auto' chose %s (predicted %.3g s per step, %.3g bytes per rank)", found.result.choice,
                found.predicted_step_time, found.predicted_memory)
    return found


def _refuse_broken_groups(layout: Layout) -> None:
    """PipelineError for a process group whose connections a failed engine of this process closed (or saw closed):
    a new engine on it had died of gloo's own errors ("Connection closed by peer")."""
    for group in layout.groups():
        why = closed_by(group)
        if why is None:
            continue
        world = group is dist.group.WORLD  # a mesh's groups include it (one dimension, or every rank's agreement)
        fix = ("the default group is one of them, and a DeviceMesh uses it too: pass parallel=Parallelism("
               "process_group=torch.distributed.new_group()), or restart the processes" if world else
               "build the next engine on a new group: parallel=Parallelism(process_group=torch.distributed."
               "new_group()), or a DeviceMesh made anew")
        raise PipelineError(f"pipeline(): an engine failed on this process group earlier ({why}), which closed its "
                            f"connections; {fix}")


def _check_arguments(schedule: object, loss_fn: object, microbatches: object, split_points: object,
                     record: object) -> None:
    if schedule is None:
        raise PipelineError("say which schedule to run: schedule='1f1b' (see `pipeloom list`), a Schedule or a file")
    if loss_fn is None:
        raise PipelineError("give loss_fn=, called as loss_fn(output, target) for every micro-batch")
    if not callable(loss_fn):
        raise PipelineError(f"loss_fn must be a function called as loss_fn(output, target), got {loss_fn!r}; e.g. "
                            "loss_fn=torch.nn.functional.cross_entropy")
    if split_points is not None and (isinstance(split_points, str) or not isinstance(split_points, Sequence)
                                     or not all(isinstance(point, str) for point in split_points)):
        raise PipelineError(f"split_points must be a list of module names where stages start, e.g. ['layers.4'], got "
                            f"{split_points!r}")
    if record is not None and not isinstance(record, (str, os.PathLike, bool)):
        raise PipelineError(f"record must be a folder to write the run trace to (or True), got {record!r}")
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                     or microbatches < 1):
        raise PipelineError(f"microbatches must be a positive integer, got {microbatches!r}")


def _check_tp(lowering: Lowering, data_parallel: str) -> None:
    """Refuse what does not compose with a "tp" dimension yet (docs/parallelism.md)."""
    if lowering.replicas > 1:
        raise PipelineError(f"schedule {lowering.schedule.name!r} holds two replicas of each piece, whose gradient "
                            "exchange packs plain tensors, not the DTensor gradients of a tp_plan; on a \"tp\" "
                            "mesh choose a one-replica schedule (1f1b, zb-h1, zbv, interleaved-1f1b, ...)")
    if data_parallel == "fsdp":
        raise PipelineError("data_parallel='fsdp' with a tp_plan (2-D sharding) is not built yet; use "
                            "data_parallel='replicate' on a mesh with \"dp\", \"pp\" and \"tp\"")


def _check_ep(lowering: Lowering) -> None:
    """Refuse what does not compose with an "ep" dimension yet (docs/parallelism.md)."""
    if lowering.replicas > 1:
        raise PipelineError(f"schedule {lowering.schedule.name!r} holds two replicas of each piece, whose gradient "
                            "exchange packs plain tensors, not the sharded experts of an \"ep\" mesh; choose a "
                            "one-replica schedule (1f1b, zbv, dualpipev, interleaved-1f1b, ...)")


def _ids(modules: Sequence[nn.Module]) -> set[int]:
    return {id(p) for module in modules for p in module.parameters()}


def _check_shared_kept(shared: SharedParameters, replaced: set[int]) -> None:
    """A parameter used by several pieces (tied) must not be resharded by the plan (``replaced``: ids of
    the parameters it swapped): its gradients are exchanged between ranks as plain tensors."""
    for name, param in zip(shared.names, shared.params):
        if id(param) in replaced:
            raise PipelineError(f"parameter {name!r} is used by several pieces (tied) and tp_plan shards it; "
                                "sharding a tied parameter is not built yet: leave its modules out of tp_plan "
                                "or split so that all its uses fall in one piece")


def _sharded(data_parallel: str, layout: Layout, lowering: Lowering, shared: SharedParameters) -> bool:
    """Whether the pieces are sharded with FSDP2 (checking that they can be)."""
    if data_parallel == "replicate":
        return False
    if layout.dp.mesh is None:
        raise PipelineError("data_parallel='fsdp' shards over the mesh's \"dp\" dimension: pass Parallelism(mesh=) a "
                            "mesh with mesh_dim_names=('dp', 'pp') and a dp size above 1")
    if lowering.replicas > 1:
        raise PipelineError(f"schedule {lowering.schedule.name!r} holds two replicas of each piece; with "
                            "data_parallel='fsdp' choose a one-replica schedule (1f1b, zbv, interleaved-1f1b, ...)")
    if shared.params:
        raise PipelineError(f"parameter {shared.names[0]!r} is used by several pieces, which FSDP cannot shard "
                            "once; use data_parallel='replicate', or split so that all its uses fall in one piece")
    return True


def _rank_pieces(lowering: Lowering, layout: Layout, device: torch.device, staged: StagedModel, loss_fn: Callable,
                 seed: int, shared: SharedParameters, sharded: bool) -> RankPieces:
    """What every step of this rank reads (see :class:`~pipeloom.runtime.step.pieces.RankPieces`)."""
    rank = layout.rank
    program = lowering.programs[rank]
    modules = {s: staged.stages[lowering.piece_of[s]] for s in lowering.stages_on(rank)}
    last_gradient: dict[int, int] = {}  # stage -> the program index of its last weight-gradient action
    for t, step in enumerate(program):
        if step.action.kind in ("B", "W"):
            last_gradient[step.action.stage] = t
    return RankPieces(
        lowering=lowering, rank=rank, device=device, modules=modules, program=program,
        eval_program=tuple(dataclasses.replace(step, pair=None) for step in program if step.action.kind == "F"),
        num_outputs=tuple(spec.num_outputs for spec in staged.graph.stages), output=staged.graph.output,
        loss_fn=loss_fn, seed=seed, shared=shared, dp=layout.dp, sharded=sharded, tp_mesh=layout.tp.mesh,
        gradients_done={t: s for s, t in last_gradient.items()},  # where "dp" buckets are posted
        joined=frozenset(t for t, (step, after) in enumerate(zip(program, program[1:]))
                         if step.action.kind == "I" and after.action == step.action._replace(kind="W")),
    )


