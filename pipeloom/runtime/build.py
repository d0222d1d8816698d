"""``pipeline()``: everything settled before a rank's engine runs — the process groups, the stages, the
schedule and its lowering, this rank's pieces on its device (moved, or allocated from the meta device and
filled; sharded with FSDP2 where asked) — and the :class:`~pipeloom.runtime.engine.PipelineEngine` that
runs them."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from pipeloom.runtime.dp import Layout, layout_of
from pipeloom.runtime.engine import PipelineEngine
from pipeloom.runtime.fsdp import shard_pieces
from pipeloom.runtime.lower import Lowering, PipelineError
from pipeloom.runtime.materialize import StateSource, place_pieces
from pipeloom.runtime.parallel.ep import check_experts_agree, experts_for, moe_layers, shard_experts
from pipeloom.runtime.pieces import RankPieces
from pipeloom.runtime.setup import device_for, lower_for, resolve_schedule, shared_seed, staged_model
from pipeloom.runtime.shared import SharedParameters, check_placement, shared_parameters
from pipeloom.runtime.split import StagedModel
from pipeloom.runtime.state import model_names
from pipeloom.runtime.tp import apply_tp_plan, check_tp_plan, leaf_modules_for, plan_blocks, set_group_timeout
from pipeloom.runtime.tp_auto import AutoPlan, AutoSharding, auto_tp_plan, is_auto

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TRACE_ENV", "pipeline"]

TRACE_ENV = "PIPELOOM_TRACE"

logger = logging.getLogger(__name__)


def pipeline(
    model: nn.Module | None = None,
    *,
    schedule: object = None,
    split_points: Sequence[str] | None = None,
    stages: StagedModel | Sequence[nn.Module] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    microbatches: int | None = None,
    process_group: ProcessGroup | None = None,
    schedule_options: dict | None = None,
    device: torch.device | str | None = None,
    trace: str | Path | bool | None = None,
    timeout: float = 60.0,
    plan: str | Path | None = None,
    tracer: str = "auto",
    leaf_modules: Sequence[str] = (),
    example_inputs: object = None,
    seed: int | None = None,
    mesh: DeviceMesh | None = None,
    state_dict: StateSource | None = None,
    init_weights: Callable[[nn.Module], object] | None = None,
    data_parallel: str | None = None,
    tp_plan: dict | str | AutoPlan | None = None,
    scatter_boundaries: bool = True,
    experts: Sequence[str] | None = None,
    overlap_pairs: bool = False,
) -> PipelineEngine:
    """Build the engine that runs ``schedule`` over ``model`` cut into stages on this process group.

    ``schedule``: a built-in name (built for this world size, ``microbatches`` and the model's
    pieces), a :class:`~pipeloom.Schedule`, or a saved ``.json``/``.csv`` file. ``plan``: a plan file
    of ``pipeloom plan`` (split points, schedule and micro-batches; explicit arguments win).
    ``trace``: a folder to write ``rank<R>.json`` to after every step, or True to record the steps
    in memory only (``engine.trace_steps``; ``engine.write_trace(path)`` writes them).
    ``tracer``/``leaf_modules``/``example_inputs``: how ``split_points`` cut the model
    (:func:`~pipeloom.runtime.split_model`: torch.fx, or torch.export from example inputs).
    ``seed``: the random numbers of every piece's forward derive from it (default: rank 0's
    ``torch.initial_seed()``), so dropout draws the same on any number of ranks (docs/runtime.md).
    ``mesh``: a ``DeviceMesh`` with a ``"pp"`` dimension (the pipeline) and optionally ``"dp"`` (replicas
    of it, each running its share of the global batch; :mod:`pipeloom.runtime.dp`), instead of
    ``process_group``.
    ``state_dict``/``init_weights``: for a model built on the meta device, what fills this rank's pieces
    (a state dict, a ``torch.save`` file or a ``torch.distributed.checkpoint`` folder; a function called
    on every module this rank holds); other ranks' tensors are never allocated.
    ``data_parallel``: how the mesh's ``"dp"`` replicas hold the pieces: ``"replicate"`` (whole,
    gradients all-reduced; the default) or ``"fsdp"`` (sharded with torch's ``fully_shard``;
    :mod:`pipeloom.runtime.fsdp`).
    A plan with replicas (``pipeloom plan``'s ``data_parallel`` > 1) builds its ``("dp", "pp")`` mesh over
    every rank when no ``mesh`` is given, and sets ``data_parallel`` to its ``sharding``.
    ``tp_plan``: with a ``"tp"`` mesh dimension, torch's ``parallelize_module`` plan ({module name or
    pattern: ParallelStyle}, the model's names) applied to this rank's stages before the engine captures their
    parameters; a named module a style needs whole is kept whole in the split (docs/parallelism.md);
    ``"hf"``: a ``transformers`` model's own plan (its config's ``base_model_tp_plan`` and its head's);
    ``"auto"`` or an :class:`~pipeloom.runtime.tp_auto.AutoPlan`: the plan the sharding search chooses for the
    model's shapes (``engine.tp_sharding`` holds it with its prediction; sizes from ``example_inputs``).
    ``scatter_boundaries``: with ``"tp"``, a stage-boundary tensor equal on every tp rank crosses once per
    tp group (each sends 1/tp of it, the receivers all-gather); False sends it whole from every tp rank.
    ``experts``: with an ``"ep"`` mesh dimension, the names (or fnmatch patterns) of the experts modules whose
    experts are shared out over ``"ep"`` (:mod:`pipeloom.runtime.parallel.ep`: the interface they follow);
    None finds every module of the model with that interface (``transformers``' MoE experts have it).
    ``overlap_pairs``: an overlapped pair ``(iF;jB)OVERLAP_F_B`` (DualPipe's) runs its two parts interleaved at
    their expert all-to-alls, one computing while the other's is in flight
    (:mod:`pipeloom.runtime.parallel.overlap`); every rank passes the same value.
    """
    if plan is not None:
        schedule, planned, schedule_options, microbatches, mesh, data_parallel, tp_plan = _from_plan(
            plan, schedule, split_points, schedule_options, microbatches, mesh=mesh, process_group=process_group,
            data_parallel=data_parallel, device=device, tp_plan=tp_plan)
        split_points = planned if stages is None else split_points
    data_parallel = data_parallel or "replicate"
    _check_arguments(schedule, loss_fn, timeout, microbatches)
    layout = layout_of(process_group, mesh)
    rank, world = layout.rank, layout.world
    sharding = _auto_plan(model, tp_plan, mesh, layout, microbatches, example_inputs) if is_auto(tp_plan) else None
    if sharding is not None:
        tp_plan = sharding.plan or None  # every region replicated: nothing to apply
    else:
        tp_plan = check_tp_plan(tp_plan, layout.tp, model=model)
    blocks: list[str] = []  # kept whole when torch.export traces (it would bake the trace's head counts in)
    if tp_plan is not None and model is not None and stages is None:
        leaf_modules = leaf_modules_for(model, tp_plan, leaf_modules)
        blocks = plan_blocks(model, tp_plan)
    if layout.tp.group is not None:  # a TP all-reduce inside a forward ends within the engine's timeout
        set_group_timeout([layout.group, layout.dp.group, layout.tp.group], float(timeout))
    expert_names = experts_for(model, stages, experts, layout.ep, data_parallel)
    if expert_names and model is not None and stages is None:  # the experts run as calls of the modules
        leaf_modules = [*leaf_modules, *(n for n in expert_names if n not in leaf_modules)]
        blocks += [layer for layer in moe_layers(expert_names)
                   if not any(layer == b or layer.startswith(b + ".") for b in blocks)]
    if layout.ep.size > 1:  # an all-to-all inside a forward ends within the engine's timeout
        set_group_timeout([layout.group, layout.dp.group, layout.ep.group, layout.ep.dp_group], float(timeout))
    staged = staged_model(model, split_points, stages, tracer=tracer, leaf_modules=leaf_modules,
                          example_inputs=example_inputs, export_leaves=blocks)
    sched = resolve_schedule(schedule, num_ranks=world, num_pieces=staged.num_stages,
                             microbatches=microbatches, options=schedule_options or {})
    lowering = lower_for(sched, staged, world=world, microbatches=microbatches)
    shared = shared_parameters(staged.stages)
    check_placement(shared, lowering)
    names = model_names(model, staged.stages)  # by identity: before any tensor is moved or allocated
    held = [lowering.piece_of[s] for s in lowering.stages_on(rank)]
    if len(set(held)) != len(held):
        raise PipelineError(f"rank {rank} holds two replicas of one model piece; put replicas on different ranks")
    if layout.ep.size > 1:
        _check_ep(lowering)
        check_experts_agree({k: staged.stages[k] for k in held}, expert_names, layout.ep, stage_rank=rank,
                            everyone=layout.everyone)
    device = device_for(layout, device, [staged.stages[k] for k in held])
    replaced = place_pieces({k: staged.stages[k] for k in held}, device, model=model, names=names,
                            state_dict=state_dict, init_weights=init_weights)
    shared = dataclasses.replace(shared, params=tuple(cast(nn.Parameter, replaced.get(id(p), p))
                                                      for p in shared.params))
    if tp_plan is not None:
        _check_tp(lowering, data_parallel)
        before = _ids([staged.stages[k] for k in held])
        apply_tp_plan({k: staged.stages[k] for k in held}, tp_plan, layout.tp)
        _check_shared_kept(shared, before - _ids([staged.stages[k] for k in held]))
    if layout.ep.size > 1:
        shard_experts({k: staged.stages[k] for k in held}, expert_names, layout.ep)
    sharded = _sharded(data_parallel, layout, lowering, shared)
    if sharded:
        shard_pieces({k: staged.stages[k] for k in held}, layout.dp.mesh)
    assert loss_fn is not None  # _check_arguments refused None
    pieces = _rank_pieces(lowering, layout, device, staged, loss_fn,
                          shared_seed(layout.everyone, layout.everyone_size, seed), shared, sharded)
    trace = trace if trace is not None else os.environ.get(TRACE_ENV) or None
    logger.info("rank %d runs pieces %s on %s (data parallel: %s)", rank, held, device, data_parallel)
    engine = PipelineEngine(staged=staged, pieces=pieces, layout=layout, trace=trace, timeout=float(timeout),
                            names=names, scatter_boundaries=bool(scatter_boundaries))
    engine.tp_sharding = sharding
    engine.overlap_pairs = bool(overlap_pairs)
    return engine


def _auto_plan(model: nn.Module | None, tp_plan: object, mesh: DeviceMesh | None, layout: Layout,
               microbatches: int | None, example_inputs: object) -> AutoSharding:
    """``tp_plan="auto"``: the search's plan for the whole model on this mesh (the same on every rank: it reads
    only the model's shapes and the options)."""
    if layout.tp.mesh is None:
        raise PipelineError("tp_plan='auto' shards over the mesh's \"tp\" dimension: pass mesh= with "
                            "mesh_dim_names holding \"pp\" and \"tp\", e.g. init_device_mesh('cpu', (2, 2), "
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


def _from_plan(plan: str | Path, schedule: object, split_points: Sequence[str] | None,
               options: dict | None, microbatches: int | None, *, mesh: DeviceMesh | None,
               process_group: ProcessGroup | None, data_parallel: str | None, device: torch.device | str | None,
               tp_plan: object = None) -> tuple:
    """(schedule, split points, schedule options, micro-batches, mesh, data_parallel, tp_plan) from a plan
    file, explicit ones winning; a plan with replicas or tensor parallelism gets a ``("dp", "pp", "tp")`` mesh
    over every rank (sizes of 1 left out) unless one is given (whose shape must be the plan's), and its saved
    tensor-parallel recipe becomes torch's ``ParallelStyle`` dict
    (:func:`pipeloom.plan.recipes.recipe_styles`)."""
    from pipeloom.plan import load_plan

    chosen = load_plan(plan)
    if chosen.data_parallel > 1 or chosen.tensor_parallel > 1:
        mesh = _plan_mesh(chosen, mesh, process_group, device)
    if tp_plan is None and chosen.tp_plan is not None:
        from pipeloom.plan.recipes import recipe_styles

        tp_plan = recipe_styles(chosen.tp_plan)
    return (chosen.schedule if schedule is None else schedule,
            chosen.split_points if split_points is None else split_points,
            dict(chosen.schedule_options) if options is None else options,
            chosen.microbatches if microbatches is None else microbatches,
            mesh, data_parallel or chosen.sharding, tp_plan)


def _plan_mesh(chosen, mesh: DeviceMesh | None, process_group: ProcessGroup | None,
               device: torch.device | str | None) -> DeviceMesh:
    """The ``("dp", "pp", "tp")`` mesh a plan with ``data_parallel`` replicas and ``tensor_parallel`` ranks
    per stage runs on ("dp" and "tp" left out where 1)."""
    import torch.distributed as dist

    shape = {"dp": chosen.data_parallel, "pp": chosen.num_ranks, "tp": chosen.tensor_parallel}
    shape = {name: size for name, size in shape.items() if size > 1 or name == "pp"}
    described = " x ".join(f"{name} {size}" for name, size in shape.items())
    if process_group is not None:
        raise PipelineError(f"the plan runs on a {described} mesh; pass mesh= (dims {', '.join(map(repr, shape))}) "
                            "or nothing, not process_group=")
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        got = {n: mesh.size(k) for k, n in enumerate(names)}
        if any(got.get(name, 1) != size for name, size in {"dp": 1, "tp": 1, **shape}.items()):
            raise PipelineError(f"the plan's mesh is {described} but mesh= is "
                                f"{' x '.join(f'{n} {v}' for n, v in got.items())}; pass a mesh of the plan's shape "
                                "or none")
        return mesh
    if not dist.is_initialized():
        raise PipelineError(f"the plan runs on {chosen.world_size} ranks ({described}); launch them (torchrun "
                            f"--nproc-per-node {chosen.world_size}) and init_process_group first")
    if dist.get_world_size() != chosen.world_size:
        raise PipelineError(f"the plan runs on {chosen.world_size} ranks ({described}) but this job has "
                            f"{dist.get_world_size()}; launch {chosen.world_size} ranks or plan for "
                            f"{dist.get_world_size()}")
    from torch.distributed.device_mesh import init_device_mesh

    kind = torch.device(device).type if device is not None else ("cuda" if dist.get_backend() == "nccl" else "cpu")
    return init_device_mesh(kind, tuple(shape.values()), mesh_dim_names=tuple(shape))


def _check_arguments(schedule: object, loss_fn: object, timeout: object, microbatches: object) -> None:
    if schedule is None:
        raise PipelineError("say which schedule to run: schedule='1f1b' (see `pipeloom list`), a Schedule or a file")
    if loss_fn is None:
        raise PipelineError("give loss_fn=, called as loss_fn(output, target) for every micro-batch")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise PipelineError(f"timeout must be a positive number of seconds, got {timeout!r}")
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
    if data_parallel not in ("replicate", "fsdp"):
        raise PipelineError(f"data_parallel must be 'replicate' or 'fsdp', got {data_parallel!r}")
    if data_parallel == "replicate":
        return False
    if layout.dp.mesh is None:
        raise PipelineError("data_parallel='fsdp' shards over the mesh's \"dp\" dimension: pass mesh= with "
                            "mesh_dim_names=('dp', 'pp') and a dp size above 1")
    if lowering.replicas > 1:
        raise PipelineError(f"schedule {lowering.schedule.name!r} holds two replicas of each piece; with "
                            "data_parallel='fsdp' choose a one-replica schedule (1f1b, zbv, interleaved-1f1b, ...)")
    if shared.params:
        raise PipelineError(f"parameter {shared.names[0]!r} is used by several pieces, which FSDP cannot shard "
                            "once; use data_parallel='replicate', or split so that all its uses fall in one piece")
    return True


def _rank_pieces(lowering: Lowering, layout: Layout, device: torch.device, staged: StagedModel, loss_fn: Callable,
                 seed: int, shared: SharedParameters, sharded: bool) -> RankPieces:
    """What every step of this rank reads (see :class:`~pipeloom.runtime.pieces.RankPieces`)."""
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


