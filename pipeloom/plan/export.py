"""A plan as another tool's configuration: ``pipeloom plan --export torchtitan``.

torchtitan runs a pipeline from its ``[parallelism]`` settings: where to cut the model
(``pipeline_parallel_split_points``, module names), a schedule CSV
(``pipeline_parallel_schedule_csv``, run by torch's ``_PipelineScheduleRuntime``), the micro-batch size
(``pipeline_parallel_microbatch_size``; the count is the local batch over it), the pipeline and
data-parallel degrees, and ``pipeline_parallel_schedule``, whose class decides how torchtitan places
the stages on ranks: looped (stage s on rank s mod p) for every name but ``ZBVZeroBubble`` and
``DualPipeV``, which place them in a V. pipeloom writes the plan's action order as the CSV and names a
schedule of the same placement; two-replica plans (dualpipe, chimera) have no torchtitan placement and
are refused.
"""

from __future__ import annotations

from pathlib import Path

from pipeloom.ir import Schedule, schedule_to_csv
from pipeloom.plan.errors import PlanError
from pipeloom.plan.partitioning.shape import schedule_shape
from pipeloom.plan.plan import Plan

__all__ = ["EXPORT_FORMATS", "torchtitan_overrides", "torchtitan_settings", "torchtitan_toml", "write_torchtitan"]

EXPORT_FORMATS = ("torchtitan",)


def _placement(schedule: Schedule) -> str:
    """torchtitan's name for the schedule's stage placement: ``loop`` or ``v``."""
    shape = schedule_shape(schedule)
    p = shape.num_ranks
    if shape.replicas > 1:
        raise PlanError(f"schedule {schedule.name!r} runs two model replicas per rank, which torchtitan cannot place; "
                        "plan with one-replica schedules (--schedules without dualpipe, chimera) to export it")
    loop = all(rank == s % p for s, rank in enumerate(shape.rank))
    v = len(shape.rank) == 2 * p and all(rank == (s if s < p else 2 * p - 1 - s) for s, rank in enumerate(shape.rank))
    if loop:
        return "loop"
    if v:
        return "v"
    raise PlanError(f"schedule {schedule.name!r} places its stages on ranks as {list(shape.rank)}, neither looped nor "
                    "V-shaped as torchtitan places them; plan with another schedule to export it")


def torchtitan_settings(plan: Plan, schedule: Schedule, csv_path: str | Path) -> dict[str, dict[str, object]]:
    """``{section: {key: value}}`` of torchtitan's job config for ``plan`` run as ``schedule`` (the plan's
    simulated order), whose CSV is written at ``csv_path``."""
    placement = _placement(schedule)
    if placement == "v":
        name = "ZBVZeroBubble"
    else:
        name = "Interleaved1F1B" if schedule_shape(schedule).num_stages > plan.num_ranks else "1F1B"
    parallelism: dict[str, object] = {
        "pipeline_parallel_degree": plan.num_ranks,
        "pipeline_parallel_split_points": list(plan.split_points),
        "pipeline_parallel_schedule": name,
        "pipeline_parallel_schedule_csv": str(csv_path),
        "pipeline_parallel_microbatch_size": plan.microbatch_size,
        "data_parallel_replicate_degree": plan.data_parallel if plan.sharding == "replicate" else 1,
        "data_parallel_shard_degree": plan.data_parallel if plan.sharding == "fsdp" else 1,
    }
    training: dict[str, object] = {"local_batch_size": plan.global_batch // plan.data_parallel,
                                   "global_batch_size": plan.global_batch}
    return {"parallelism": parallelism, "training": training}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def torchtitan_toml(settings: dict[str, dict[str, object]]) -> str:
    """The settings as a TOML fragment to merge into a torchtitan train config."""
    lines = ["# pipeloom plan: merge into your torchtitan train config (or pass as --section.key overrides)"]
    for section, values in settings.items():
        lines.append(f"\n[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


def torchtitan_overrides(settings: dict[str, dict[str, object]]) -> list[str]:
    """The settings as torchtitan command-line overrides (``--parallelism.key value``)."""
    words = []
    for section, values in settings.items():
        for key, value in values.items():
            shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            words += [f"--{section}.{key}", shown]
    return words


def write_torchtitan(plan: Plan, schedule: Schedule, toml_path: str | Path, csv_path: str | Path,
                     *, csv_name: str | Path | None = None) -> dict[str, dict[str, object]]:
    """Write the schedule CSV and the TOML fragment; ``csv_name`` is how the TOML names the CSV
    (default ``csv_path``). Returns the settings."""
    settings = torchtitan_settings(plan, schedule, csv_name if csv_name is not None else csv_path)
    text = schedule_to_csv(schedule)
    Path(csv_path).write_text(text, encoding="utf-8")
    Path(toml_path).write_text(torchtitan_toml(settings), encoding="utf-8")
    return settings
