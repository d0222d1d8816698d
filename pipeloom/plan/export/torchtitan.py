"""A plan as another tool's configuration: ``pipeloom plan --export torchtitan``.

torchtitan runs a pipeline from its ``parallelism`` settings: the module names of each stage
(``module_fqns_per_model_part``: its model's top-level modules and the children of a top-level
``ModuleList``/``ModuleDict``, ``tok_embeddings``, ``layers.3``, ``norm``, ``output``), a schedule CSV
(``pipeline_parallel_schedule_csv``, run by torch's ``_PipelineScheduleRuntime``; checked with
``os.path.isfile`` from the working directory, so written as an absolute path), the micro-batch size
(``pipeline_parallel_microbatch_size``; the count is the local batch over it), the degrees, and
``pipeline_parallel_schedule``, whose class decides how torchtitan places the stages on ranks: looped
(stage s on rank s mod p) for every name but ``ZBVZeroBubble`` and ``DualPipeV``, which place them in a V.
pipeloom writes the plan's action order as the CSV and names a schedule of the same placement; two-replica
plans (dualpipe, chimera) have no torchtitan placement and are refused. The recomputation the plan was priced
with is set as torchtitan's activation checkpointing (:data:`ACTIVATION_CHECKPOINTS`; torchtitan's own default
recomputes selectively).

Checked against the configuration classes of torchtitan 0.2.2 and 0.3.0 (:data:`TORCHTITAN_VERSIONS`;
``tests/plan/test_torchtitan_export.py`` when torchtitan is installed). 0.2.x reads a TOML train config
(``--job.config_file``) plus command-line overrides; 0.3.x reads no TOML (a Python config registry,
``--module``/``--config``, plus command-line overrides) and refuses pipeline parallelism while CUDA graphs
are on, its default (``--training.disable_cuda_graphs``, an option 0.2.x does not have). So pipeloom writes
the settings both read as command-line overrides, the 0.3.x extra on its own line, and a TOML fragment for
0.2.x. torchtitan dropped ``pipeline_parallel_split_points`` after 0.1.0.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeloom.errors import ArgumentError
from pipeloom.ir import Schedule, schedule_to_csv
from pipeloom.plan.costs.shared import shared_across_stages
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import PlanError
from pipeloom.plan.partitioning.shape import schedule_shape
from pipeloom.plan.plan import Plan

if TYPE_CHECKING:
    from pipeloom.plan.cluster.job import Job
    from pipeloom.plan.cluster.layout import Layout

__all__ = ["ACTIVATION_CHECKPOINTS", "TORCHTITAN_MODELS", "check_job", "torchtitan_family", "torchtitan_plan",
           "torchtitan_problems", "torchtitan_recompute", "unwritten", "TORCHTITAN_03_MOVED", "TORCHTITAN_03_SETTINGS",
           "TORCHTITAN_VERSIONS", "export_torchtitan", "stage_modules", "torchtitan_args", "torchtitan_overrides",
           "torchtitan_settings", "torchtitan_toml", "version_overrides", "write_torchtitan"]

TORCHTITAN_VERSIONS = ("0.2.2", "0.3.0")
"""The torchtitan releases whose configuration classes accept the exported settings."""

TORCHTITAN_03_SETTINGS: dict[str, dict[str, object]] = {"training": {"disable_cuda_graphs": True}}
"""What torchtitan 0.3.x needs besides :func:`torchtitan_settings` for pipeline parallelism (its
``Trainer.Config`` refuses ``pipeline_parallel_degree > 1`` while CUDA graphs are on); 0.2.x lacks the option."""


TORCHTITAN_03_MOVED = {("parallelism", "enable_async_tensor_parallel"): ("compile", "enable_async_tensor_parallel")}
"""Settings 0.3.x reads under another section than 0.2.x (the settings, and 0.2.x's TOML, keep 0.2.x's names)."""


ACTIVATION_CHECKPOINTS: dict[str, dict[str, object]] = {
    "none": {"mode": "none"}, "full": {"mode": "full"}, "op": {"mode": "selective", "selective_ac_option": "op"}}
"""torchtitan's activation checkpointing the export can set: no recomputation, every block recomputed, or its
op-level selective policy, as 0.2.x's ``activation_checkpoint`` section; 0.3.x takes the same ``mode`` as its
``activation_checkpoint`` subcommand (``none``, ``full``, ``selective``: its ``SelectiveAC`` is the op-level
policy), after every other override as tyro wants it."""


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


def stage_modules(split_points: Sequence[str], modules: Sequence[str]) -> list[list[str]]:
    """``module_fqns_per_model_part``: ``modules`` (the model's pieces in call order, the cost table's piece
    names) cut before each split point. torchtitan keeps a stage's top-level modules and the named children
    of its top-level ``ModuleList``/``ModuleDict``, so a finer piece (``layers.0.attention``) is refused."""
    names = list(modules)
    finer = [name for name in names if name.count(".") > 1]
    if finer:
        raise PlanError(f"torchtitan cuts a model at its top-level modules and the children of a top-level "
                        f"ModuleList (tok_embeddings, layers.3, norm, output); piece {finer[0]!r} of the cost table is "
                        "finer: profile the model with pieces at those modules to export to torchtitan")
    missing = [point for point in split_points if point not in names]
    if missing or len(set(names)) != len(names):
        raise PlanError(f"split point(s) {missing} are not pieces of the cost table (or its pieces repeat a name); "
                        "export with the cost table the plan was made from")
    cuts = [0, *(names.index(point) for point in split_points), len(names)]
    if cuts != sorted(set(cuts)):
        raise PlanError(f"split points {list(split_points)} are not in the cost table's piece order; export with "
                        "the cost table the plan was made from")
    return [names[a:b] for a, b in zip(cuts, cuts[1:])]


def torchtitan_settings(plan: Plan, schedule: Schedule, csv_path: str | Path, *,
                        modules: Sequence[str]) -> dict[str, dict[str, object]]:
    """``{section: {key: value}}`` of torchtitan's configuration (0.2.x and 0.3.x alike) for ``plan`` run as
    ``schedule`` (the plan's simulated order), whose CSV is written at ``csv_path`` (made absolute); ``modules``:
    the model's pieces in call order (see :func:`stage_modules`); the plan's ``context_parallel`` above 1 as
    ``parallelism.context_parallel_degree`` (the plan's data parallelism and batch per context-parallel group, each of
    whose ranks holds 1/cp of the sequence)."""
    if plan.expert_parallel > 1:
        raise PlanError(f"the plan shares its experts over expert_parallel={plan.expert_parallel} ranks; the "
                        "torchtitan export is checked without expert parallelism only: export a plan saved with ep=1")
    placement = _placement(schedule)
    if placement == "v":
        name = "ZBVZeroBubble"
    else:
        name = "Interleaved1F1B" if schedule_shape(schedule).num_stages > plan.num_ranks else "1F1B"
    parts = stage_modules(plan.split_points, modules)  # checked on one stage too: the pieces are torchtitan's modules
    pipeline: dict[str, object] = {
        "module_fqns_per_model_part": parts,
        "pipeline_parallel_schedule": name,
        "pipeline_parallel_schedule_csv": str(Path(csv_path).resolve()),
        "pipeline_parallel_microbatch_size": plan.microbatch_size,
    } if plan.num_ranks > 1 else {}  # one stage: torchtitan builds no pipeline, its settings would only mislead
    parallelism: dict[str, object] = {
        "pipeline_parallel_degree": plan.num_ranks,
        **pipeline,
        "data_parallel_replicate_degree": plan.data_parallel if plan.sharding == "replicate" else 1,
        "data_parallel_shard_degree": plan.data_parallel if plan.sharding == "fsdp" else 1,
        "tensor_parallel_degree": plan.tensor_parallel,
    }
    if plan.context_parallel > 1:  # the data parallelism and batch are per context-parallel group
        parallelism["context_parallel_degree"] = plan.context_parallel
    # torchtitan splits a rank's local batch into micro-batches only under pipeline parallelism; without, it runs the
    # local batch whole and accumulates gradients over global / (local x dp) of them: one micro-batch each
    local = plan.global_batch // plan.data_parallel if plan.num_ranks > 1 else plan.microbatch_size
    training: dict[str, object] = {"local_batch_size": local, "global_batch_size": plan.global_batch}
    if plan.sequence_length is not None:  # what the plan was priced for; torchtitan's own default is 2,048
        training["seq_len"] = plan.sequence_length
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
    """The settings as a TOML fragment to merge into a torchtitan 0.2.x train config (0.3.x reads no TOML)."""
    lines = [f"# pipeloom plan for torchtitan 0.2.x (checked with {TORCHTITAN_VERSIONS[0]}): merge into the train",
             "# config --job.config_file reads. torchtitan 0.3.x reads no TOML: pass the .torchtitan.args overrides."]
    for section, values in settings.items():
        lines.append(f"\n[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


def torchtitan_overrides(settings: dict[str, dict[str, object]]) -> list[str]:
    """The settings as torchtitan command-line overrides (``--section.key value``, as its tyro parser takes
    them): a list of strings joined by commas, a list of lists as one comma-joined word per inner list, a
    true flag alone."""
    words = []
    for section, values in settings.items():
        for key, value in values.items():
            flag = f"--{section}.{key}"
            if isinstance(value, bool):
                if not value:
                    raise PlanError(f"{flag}: only options set to true are exported (false is torchtitan's default)")
                words.append(flag)
            elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
                words += [flag, *(",".join(map(str, inner)) for inner in value)]
            elif isinstance(value, list):
                words += [flag, ",".join(map(str, value))]
            else:
                words += [flag, str(value)]
    return words


def _versions(settings: dict[str, dict[str, object]]) -> tuple[dict, dict[str, object] | None, bool]:
    """What of ``settings`` one torchtitan version takes apart from the other: the settings 0.3.x moved (0.2.x's
    ``(section, key)`` to 0.3.x's), the activation checkpointing (0.2.x's section, 0.3.x's subcommand), and whether
    a pipeline runs (0.3.x's CUDA graphs refuse one)."""
    moved = {old: new for old, new in TORCHTITAN_03_MOVED.items() if old[1] in settings.get(old[0], {})}
    degree = settings.get("parallelism", {}).get("pipeline_parallel_degree", 1)
    return moved, settings.get("activation_checkpoint"), isinstance(degree, int) and degree > 1


def version_overrides(settings: dict[str, dict[str, object]]) -> tuple[list[str], list[str], list[str]]:
    """The overrides both versions take, 0.2.x's own (its ``activation_checkpoint`` section, the settings 0.3.x
    moved) and 0.3.x's own (:data:`TORCHTITAN_03_SETTINGS`, the moved settings under their new names, then the
    activation-checkpointing subcommand, last as tyro wants it)."""
    moved, ac, piped = _versions(settings)
    shared = {section: {key: value for key, value in values.items() if (section, key) not in moved}
              for section, values in settings.items() if section != "activation_checkpoint"}
    older = torchtitan_overrides({old[0]: {old[1]: settings[old[0]][old[1]]} for old in moved})
    older += torchtitan_overrides({"activation_checkpoint": ac}) if ac else []
    newer = torchtitan_overrides(TORCHTITAN_03_SETTINGS) if piped else []  # CUDA graphs refuse a pipeline only
    newer += torchtitan_overrides({new[0]: {new[1]: settings[old[0]][old[1]]} for old, new in moved.items()})
    if ac:
        newer.append(f"activation_checkpoint:{ac['mode']}")
    return torchtitan_overrides(shared), older, newer


def torchtitan_args(settings: dict[str, dict[str, object]]) -> str:
    """The ``.torchtitan.args`` text: the overrides both versions take on one line, each version's own on
    another, each with why."""
    shared, older, newer = version_overrides(settings)
    moved, ac, piped = _versions(settings)
    text = (f"# pipeloom plan: torchtitan command-line overrides (checked with torchtitan "
            f"{' and '.join(TORCHTITAN_VERSIONS)}); append to the training command\n{shlex.join(shared)}\n")
    whys = [why for why, there in (("its activation checkpointing", ac),
                                   ("its names of the settings 0.3.x moved", moved)) if there]
    if older:
        text += f"# torchtitan 0.2.x also ({'; '.join(whys)})\n{shlex.join(older)}\n"
    if not newer:
        return text
    whys = [why for why, there in (
        ("CUDA graphs, on by default, refuse pipeline parallelism; 0.2.x has no such option", piped),
        ("its names of the settings it moved", moved),
        ("its activation-checkpointing subcommand, last", ac)) if there]
    return text + f"# torchtitan 0.3.x also needs this ({'; then '.join(whys)})\n{shlex.join(newer)}\n"


def write_torchtitan(plan: Plan, schedule: Schedule, toml_path: str | Path, csv_path: str | Path, *,
                     modules: Sequence[str], args_path: str | Path | None = None,
                     activation_checkpoint: str | None = None, compiled: bool = False,
                     async_tp: bool = False) -> dict[str, dict[str, object]]:
    """Write the schedule CSV (a plan of more than one pipeline rank: torchtitan builds no pipeline for one), the
    0.2.x TOML fragment and (``args_path``) the command-line overrides (:func:`torchtitan_settings`); the settings
    name the CSV by its absolute path, and with ``activation_checkpoint`` (a key of :data:`ACTIVATION_CHECKPOINTS`)
    set torchtitan's recomputation (else torchtitan's own default runs); with ``compiled``, ``torch.compile``
    (``compile.enable``: the elementwise kernels fused, as a plan priced with ``kernels="fused"`` assumes;
    torchtitan's default runs them eagerly); with ``async_tp`` (which needs ``compiled``) its async tensor
    parallelism, the tp exchanges beside the GEMMs (0.2.x: ``parallelism.enable_async_tensor_parallel``, 0.3.x:
    ``compile.enable_async_tensor_parallel``, both only under ``torch.compile``). Returns the settings."""
    settings = torchtitan_settings(plan, schedule, csv_path, modules=modules)
    if async_tp and not compiled:
        raise PlanError("torchtitan's async tensor parallelism runs only under torch.compile: export it compiled")
    if async_tp:
        settings["parallelism"]["enable_async_tensor_parallel"] = True
    if compiled:
        settings["compile"] = {"enable": True}
    if activation_checkpoint is not None:
        if activation_checkpoint not in ACTIVATION_CHECKPOINTS:
            raise PlanError(f"activation checkpointing {activation_checkpoint!r} for torchtitan: use one of "
                            f"{', '.join(ACTIVATION_CHECKPOINTS)}")
        settings["activation_checkpoint"] = dict(ACTIVATION_CHECKPOINTS[activation_checkpoint])
    if plan.num_ranks > 1:
        Path(csv_path).write_text(schedule_to_csv(schedule), encoding="utf-8")
    Path(toml_path).write_text(torchtitan_toml(settings), encoding="utf-8")
    if args_path is not None:
        Path(args_path).write_text(torchtitan_args(settings), encoding="utf-8")
    return settings


def export_torchtitan(plan: Plan, schedule: Schedule, save: Path, modules: Sequence[str],
                      activation_checkpoint: str | None = None, *, compiled: bool = False,
                      async_tp: bool = False, table: CostTable | None = None) -> str:
    """Write ``<stem>.torchtitan.args``, ``.toml`` and (under pipeline parallelism) ``.csv`` next to the plan file
    ``save`` (:func:`write_torchtitan`'s settings); the lines that say so, with the overrides of each torchtitan
    version. PlanError, before writing, where a parameter the cost ``table`` shares has users on different stages."""
    stages = stage_modules(plan.split_points, modules)
    apart = shared_across_stages(table, [k for k, stage in enumerate(stages) for _ in stage]) if table else ()
    if apart:
        raise PlanError(f"the plan puts the pieces sharing {apart[0].name} on different pipeline stages, and "
                        "torchtitan ties no weight across stages (each would train its own copy): run the plan with "
                        "pipeline(model, plan=...), which keeps one weight, or save it without --export torchtitan")
    args, toml, csv = (save.with_name(f"{save.stem}.torchtitan.{ext}") for ext in ("args", "toml", "csv"))
    settings = write_torchtitan(plan, schedule, toml, csv, modules=modules, args_path=args,
                                activation_checkpoint=activation_checkpoint, compiled=compiled, async_tp=async_tp)
    shared, older, newer = version_overrides(settings)
    written = f" and schedule {csv}" if plan.num_ranks > 1 else ""
    lines = [f"wrote torchtitan overrides {args}, 0.2.x TOML {toml}{written}",
             f"torchtitan 0.2.x and 0.3.x: {shlex.join(shared)}"]
    if older:
        lines.append(f"torchtitan 0.2.x also: {shlex.join(older)}")
    return "\n".join([*lines, f"torchtitan 0.3.x also: {shlex.join(newer)}"])


TORCHTITAN_MODELS = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3"}
"""Families torchtitan has a model of, with its module names (``tok_embeddings``, ``layers.N``, ``norm``,
``output``): ``--export torchtitan`` writes only these."""


def torchtitan_family(job: Job) -> str:
    """Why torchtitan cannot train ``job``'s model family ("" where it can)."""
    if job.spec.family in TORCHTITAN_MODELS:
        return ""
    names = ", ".join(f"{k} ({v})" for k, v in TORCHTITAN_MODELS.items())
    return (f"{job.spec.family} for torchtitan, which has no such model (the export covers {names}; save the plan "
            "without --export)")


def torchtitan_problems(job: Job, layout: Layout) -> list[tuple[str, dict[str, int | str]]]:
    """What the torchtitan export cannot take of ``layout``, each with the ``--layout`` keys that fix it."""
    problems: list[tuple[str, dict[str, int | str]]] = []
    family = torchtitan_family(job)
    if family:
        problems.append((family, {}))
    if layout.copies == 2:
        problems.append(("schedule=dualpipe for torchtitan (two copies of the model, which it cannot place)",
                         {"schedule": "dualpipev"}))
    if layout.ep > 1:
        problems.append((f"ep={layout.ep} for torchtitan (the export is checked without expert parallelism)",
                         {"ep": 1}))
    if job.spec.tied and layout.pp > 1:
        problems.append((f"a tied embedding and head over pp={layout.pp} for torchtitan, which ties no weight across "
                         "pipeline stages (the two ends would train copies apart)", {"pp": 1}))
    if torchtitan_recompute(job, layout) is None:
        problems.append((f"recompute=selective with --selective {job.selective} for torchtitan, whose selective "
                         "recomputation is its op-level policy (plan with --selective op, or with --layout "
                         "recompute=full or none)", {}))
    return problems


def check_job(job: Job) -> None:
    """PlanError or ArgumentError where no layout of ``job`` can be exported to torchtitan: a family it has no model
    of, or a choice other than :class:`Job`'s defaults that the export drops (:func:`unwritten`; the CLI refuses their
    flags, the defaults it reprices without a word)."""
    family = torchtitan_family(job)
    if family:
        raise PlanError(family)
    unsaid = unwritten(job)
    if unsaid:
        raise ArgumentError(f"runs_on='torchtitan' cannot carry {' and '.join(unsaid)}: the export writes none of "
                            "them and torchtitan runs its own; plan without them for torchtitan")


def unwritten(job: Job) -> list[str]:
    """The choices of ``job`` other than :class:`Job`'s defaults that the torchtitan export drops (``pipeloom plan
    --export torchtitan`` refuses their flags, :func:`pipeloom.cli.plan_cluster_args.check_export`)."""
    return [text for text, on in (
        (f"recompute_layers={job.recompute_layers} (a recomputation depth)", bool(job.recompute_layers)),
        ("dtype='fp8' (float8 training)", job.dtype == "fp8"),
        ("adam_moments='bf16' (torch's AdamW keeps fp32 moments)", job.adam_moments == "bf16"),
        ("shard_gradients=True (torch's pipelining holds gradients whole)", job.shard_gradients),
        ("sequence_parallel=False", not job.sequence_parallel),
        ("overlap_grad_reduce=False", not job.overlap_grad_reduce)) if on]


def torchtitan_recompute(job: Job, layout: Layout) -> str | None:
    """``layout``'s recomputation as torchtitan's activation checkpointing (:data:`ACTIVATION_CHECKPOINTS`), None
    where torchtitan has no such setting (a selective policy other than its op-level one:
    :func:`~pipeloom.plan.cluster.runtime_plan.save_blockers` refuses the export)."""
    if layout.recompute != "selective":
        return layout.recompute
    return "op" if job.selective == "op" else None


def torchtitan_plan(plan: Plan, layers: int) -> tuple[Plan, Sequence[str]]:
    """The plan in torchtitan's module names (``tok_embeddings``, ``layers.N``, ``norm``, ``output``) and the
    model's modules in call order, for ``--export torchtitan``."""
    ends = [point.rsplit(".", 1)[1] for point in plan.split_points]  # a layer's index, or the final norm's name
    modules = ["tok_embeddings", *(f"layers.{k}" for k in range(layers)), "norm", "output"]
    renamed = dataclasses.replace(plan, split_points=tuple(f"layers.{k}" if k.isdigit() else "norm" for k in ends))
    return renamed, modules
