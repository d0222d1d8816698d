"""What :func:`~pipeloom.runtime.pipeline` settles before the engine exists: the world, the stages, the
schedule and its lowering, and the values every rank must share (the random seed, the run's id)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.ir import Schedule, load_schedule
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.model.split import StagedModel, split_model, stages_from_modules
from pipeloom.runtime.parallel.dp import Layout
from pipeloom.runtime.program import Lowering, build_programs
from pipeloom.schedules import build_schedule, schedule_info, schedule_names
from pipeloom.validate import validate

__all__ = ["default_store", "device_for", "lower_for", "resolve_schedule", "shared_run_id", "shared_seed",
           "staged_model"]


def device_for(layout: Layout, device: torch.device | str | None, modules: Sequence[nn.Module]) -> torch.device:
    """``device``, or the one the backend (or the mesh) implies: the current CUDA device for NCCL or a
    CUDA mesh; else, with one rank, where this rank's ``modules`` already are (a model moved to a GPU stays
    there); else the CPU."""
    if device is not None:
        return torch.device(device)
    backend = dist.get_backend(layout.group) if layout.group is not None else None
    if backend == "nccl" or layout.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if layout.world == 1 and layout.dp.size == 1:
        found = {t.device for module in modules for t in (*module.parameters(), *module.buffers()) if not t.is_meta}
        if len(found) == 1:
            return found.pop()
    return torch.device("cpu")


def staged_model(model: nn.Module | None, split_points: Sequence[str] | None,
                 stages: StagedModel | Sequence[nn.Module] | None, *, tracer: str = "auto",
                 leaf_modules: Sequence[str] = (), example_inputs: object = None,
                 export_leaves: Sequence[str] = ()) -> StagedModel:
    """The stages: given, chained from given modules (manual mode), or cut from ``model`` (``tracer``,
    ``leaf_modules``, ``example_inputs`` and ``export_leaves`` as :func:`~pipeloom.runtime.split_model` takes
    them)."""
    if stages is not None and split_points is not None:
        raise PipelineError("give split_points= or stages=, not both")
    if isinstance(stages, StagedModel):
        return stages
    if stages is not None:
        return stages_from_modules(list(stages))
    if split_points is None:
        raise PipelineError("say where to cut the model: split_points=['layers.4', ...] (module names where stages "
                            "1.. start) or stages=[module0, module1, ...]; split_points=[] runs it as one stage")
    if model is None:
        raise PipelineError("split_points needs the model; pass it as the first argument")
    return split_model(model, split_points, tracer=tracer, leaf_modules=leaf_modules,
                       example_inputs=example_inputs, export_leaves=export_leaves)


def resolve_schedule(schedule: object, *, num_ranks: int, num_pieces: int, microbatches: int | None,
                     options: dict) -> Schedule:
    """A Schedule from a built-in name, a Schedule, or a saved .json/.csv file."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, (str, Path)) and str(schedule) in schedule_names():
        name = str(schedule)
        if microbatches is None:
            raise PipelineError(f"schedule {name!r} is built here; say how many micro-batches: microbatches=8")
        info = schedule_info(name)
        options = dict(options)
        if "stages_per_rank" in info.options and "stages_per_rank" not in options:
            if num_pieces % num_ranks:
                raise PipelineError(f"{name} puts the same number of stages on every rank, but the model has "
                                    f"{num_pieces} pieces for {num_ranks} ranks; cut it into a multiple of {num_ranks}")
            options["stages_per_rank"] = num_pieces // num_ranks
        return build_schedule(name, num_ranks, microbatches, **options)  # two-replica ones pair them
    if isinstance(schedule, (str, Path)):
        path = Path(schedule)
        if path.suffix.lower() in (".json", ".csv") or path.exists():
            return load_schedule(path)
        names = ", ".join(schedule_names())
        raise PipelineError(f"schedule {str(schedule)!r} is neither a built-in ({names}) nor a .json/.csv file")
    raise PipelineError(f"schedule must be a built-in name, a pipeloom.Schedule or a file path, "
                        f"got {type(schedule).__name__}")


def lower_for(schedule: Schedule, staged: StagedModel, *, world: int, microbatches: int | None) -> Lowering:
    """``schedule`` checked (ranks, validity, micro-batch order) and lowered onto the staged model."""
    if schedule.num_ranks != world:
        raise PipelineError(
            f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks but this process group has {world}; "
            f"launch with `torchrun --nproc-per-node {schedule.num_ranks}` or use a schedule for {world} ranks"
        )
    validate(schedule, ordered=True, check_memory_limit=False)
    piece_inputs = [[(ref.stage, ref.index) for ref in spec.inputs] for spec in staged.graph.stages]
    outputs = [(ref.stage, ref.index) for ref in staged.graph.output_refs()]
    lowering = build_programs(schedule, piece_inputs, outputs)
    if microbatches is not None and lowering.num_microbatches != microbatches:
        raise PipelineError(f"the schedule runs {lowering.num_microbatches} micro-batches per step, but "
                            f"microbatches={microbatches}; pass microbatches={lowering.num_microbatches} or rebuild it")
    return lowering


def default_store() -> dist.Store | None:
    """The process group's key-value store, used only to pass failure messages (None if unreachable)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 (private API: without it failures still surface through timeouts)
        return None


def shared_seed(group: dist.ProcessGroup | None, world: int, seed: int | None) -> int:
    """``seed``, or rank 0's ``torch.initial_seed()`` on every rank (63 bits)."""
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise PipelineError(f"seed must be an integer, got {seed!r}")
        return seed & ((1 << 63) - 1)
    value = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64)
    if world > 1:
        assert group is not None  # a world of several ranks has its group
        tensor = value.cuda() if dist.get_backend(group) == "nccl" else value
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
        value = tensor.cpu()
    return int(value.item())


def shared_run_id(group: dist.ProcessGroup, rank: int) -> str:
    """One id for this engine on every rank (rank 0's, broadcast), so failure keys never collide."""
    mine = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8)
    backend = dist.get_backend(group)
    tensor = mine.cuda() if backend == "nccl" else mine
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return bytes(tensor.cpu().tolist()).hex()
