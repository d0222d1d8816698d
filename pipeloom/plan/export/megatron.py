"""A cluster plan as Megatron-LM's command-line arguments: ``pipeloom plan --model ... --save PLAN.json --export
megatron`` writes ``PLAN.megatron.args``.

The arguments carry what the plan was priced with: the degrees (tp, pp, cp, ep with expert tp 1, as the planner runs
the experts whole), the stage cut as ``--pipeline-model-parallel-layout`` (the stages in model order, ``E`` the
embedding, ``t`` a decoder layer, ``m`` a multi-token-prediction module, ``L`` the loss; Megatron infers the virtual
stages from it), the micro-batch and global batch sizes and the sequence, the recomputation, the distributed optimizer
and its overlaps, the gradient reduce's dtype, the precision and FP8 recipe, and the expert dispatcher. The model's
own arguments (``--num-layers``, ``--hidden-size``, ...), the data and the optimizer's hyper-parameters stay the
user's. Megatron-LM runs 1F1B and interleaved 1F1B only (``get_forward_backward_func``), Megatron-FSDP is not
exported, and a choice the arguments cannot carry is refused (:func:`megatron_problems`, :func:`unwritten`).

Checked by Megatron-LM's own ``parse_args`` and ``validate_args`` at :data:`MEGATRON_VERSIONS`
(``benchmarks/megatron_export_check.py``); ``--moe-flex-dispatcher-backend`` (DeepEP, Hybrid-EP) needs core 0.16
or later.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeloom.errors import ArgumentError
from pipeloom.plan.cluster.recompute import megatron_modules
from pipeloom.plan.errors import PlanError

if TYPE_CHECKING:
    from pipeloom.plan.cluster.api import ClusterPlan
    from pipeloom.plan.cluster.job import Job
    from pipeloom.plan.cluster.layout import Layout

__all__ = ["MEGATRON_SCHEDULES", "MEGATRON_VERSIONS", "FP8_RECIPES", "export_megatron", "megatron_args",
           "megatron_layout", "megatron_problems", "megatron_text", "model_problem", "unwritten", "check_job"]

MEGATRON_VERSIONS = ("core_v0.15.3", "core_v0.17.1")
"""The Megatron-LM releases whose argument parser and checks accepted the exported arguments."""
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")
"""The pipeline schedules Megatron-LM runs (``pipeline_parallel/schedules.py``: with and without interleaving)."""
FP8_RECIPES = {"cached": ("hybrid", "delayed"), "current": ("hybrid", "tensorwise"), "mxfp8": ("e4m3", "mxfp8")}
"""The planner's FP8 casts as Megatron-LM's ``--fp8-format`` and ``--fp8-recipe`` (Transformer Engine's delayed and
current scaling, and MXFP8 block scaling, whose format is E4M3 both ways)."""
_DISPATCHERS = {"plain": (), "deepseek": ("deepep",), "hybridep": ("hybridep",)}
"""The planner's expert all-to-all as Megatron-Core's flex dispatcher backend (none: its ``alltoall`` dispatcher)."""
_UNWRITTEN = (
    ("kernels", "eager", "--kernels eager", "Megatron-Core fuses its elementwise kernels"),
    ("attention", "flash2", "--attention flash2", "Megatron-Core runs Transformer Engine's attention"),
    ("attention", "materialized", "--attention materialized", "Megatron-Core runs Transformer Engine's attention"),
    ("fp8_cast", "dynamic", "--fp8-cast dynamic", "torchao's scaling; Megatron's recipes are delayed, current "
                                                  "(tensorwise) and mxfp8"),
    ("moe_comm", "hybridep-sync-free", "--moe-comm hybridep-sync-free", "the sync-free experts are not exported"),
    ("shard_gradients", True, "--shard-gradients", "the distributed optimizer reduce-scatters once a step"),
    ("p2p_overlap", False, "p2p_overlap=False", "Megatron-Core's interleaved 1F1B sends beside the compute"),
    ("blocking_1f1b", False, "--no-blocking-1f1b", "Megatron-Core's 1F1B sends blocking"),
)
"""Choices of a whole job the arguments cannot carry: (field, value, flag, why)."""


def unwritten(choices: Mapping[str, object]) -> list[str]:
    """The choices (a :class:`~pipeloom.plan.cluster.job.Job`'s fields by name, those given) that Megatron-LM's
    arguments cannot carry, each as its flag and why."""
    found = [f"{flag} ({why})" for field, value, flag, why in _UNWRITTEN
             if field in choices and choices[field] == value and type(choices[field]) is type(value)]
    if choices.get("adam_moments") == "bf16" and choices.get("distributed_optimizer") is False:
        found.append("adam_moments='bf16' without the distributed optimizer (Megatron's precision-aware optimizer "
                     "runs with it only)")
    return found


def model_problem(job: Job) -> str | None:
    """Why no layout of ``job``'s model is exported to Megatron-LM (None where one may be)."""
    if job.spec.linear is not None:
        return (f"the {job.spec.family} model's Gated DeltaNet layers for Megatron-LM (the export covers "
                "attention-only decoders: Megatron's own hybrid models take another layout)")
    return None


def check_job(job: Job) -> None:
    """ArgumentError or PlanError where no layout of ``job`` can be exported to Megatron-LM (the CLI refuses the same
    flags before planning: :func:`pipeloom.cli.plan_cluster_args.check_export`)."""
    unsaid = unwritten({field.name: getattr(job, field.name) for field in dataclasses.fields(job)})
    if unsaid:
        raise ArgumentError(f"runs_on='megatron' cannot carry {' and '.join(unsaid)}; plan without "
                            f"{'it' if len(unsaid) == 1 else 'them'} for Megatron-LM")
    model = model_problem(job)
    if model:  # no layout helps: said before the search
        raise PlanError(model)


def megatron_problems(job: Job, layout: Layout) -> list[tuple[str, dict[str, int | str]]]:
    """What stops ``layout`` of ``job`` being exported to Megatron-LM: each problem with the ``--layout`` keys that fix
    it (``{}`` where no key does)."""
    problems: list[tuple[str, dict[str, int | str]]] = []
    model = model_problem(job)
    if model:
        problems.append((model, {}))
    if layout.schedule not in MEGATRON_SCHEDULES:
        fix = "interleaved-1f1b" if layout.vp > 1 else "1f1b"
        problems.append((f"schedule={layout.schedule} for Megatron-LM, which runs 1F1B and interleaved 1F1B only",
                         {"schedule": fix}))
    if layout.fsdp:
        problems.append(("fsdp=1 for Megatron-LM (the export writes Megatron-Core's distributed optimizer; "
                         "Megatron-FSDP is not exported)", {"fsdp": 0}))
    if layout.recompute == "selective" and not megatron_modules(job.selective):
        problems.append((f"recompute=selective with --selective {job.selective} for Megatron-LM, whose selective "
                         "recomputation is a set of recompute_modules (plan with --selective core_attn or another "
                         "set, or with --layout recompute=full or none)", {}))
    if job.overlap_pairs(layout):
        problems += _overlap_problems(job, layout)
    return problems


def _overlap_problems(job: Job, layout: Layout) -> list[tuple[str, dict[str, int | str]]]:
    """What Megatron-LM refuses beside ``--overlap-moe-expert-parallel-comm`` (core 0.17.1's ``TransformerConfig``):
    full recomputation, the ``moe`` module recomputed, more than one multi-token-prediction module, or one on one
    pipeline stage."""
    overlap = "--moe-overlap for Megatron-LM, which refuses"
    moe = "moe" in megatron_modules(job.selective)
    problems: list[tuple[str, dict[str, int | str]]] = []
    if layout.recompute == "full":
        problems.append((f"recompute=full with {overlap} full recomputation beside --overlap-moe-expert-parallel-comm",
                         {"recompute": "none" if moe else "selective"}))
    if layout.recompute == "selective" and moe:
        problems.append((f"recompute=selective with --selective {job.selective} and {overlap} the moe module "
                         "recomputed beside --overlap-moe-expert-parallel-comm (plan with a --selective set without "
                         "moe)", {"recompute": "none"}))
    if job.spec.mtp > 1 or job.spec.mtp and layout.pp == 1:
        problems.append((f"{job.spec.mtp} multi-token-prediction module(s) with {overlap} more than one, or one on a "
                         "single pipeline stage (plan without --moe-overlap, or with pp >= 2)", {}))
    return problems


def megatron_layout(counts: Sequence[int], mtp: int = 0) -> str:
    """``--pipeline-model-parallel-layout`` for stages holding ``counts[j]`` decoder layers each, in model order: the
    embedding opens the first stage; the ``mtp`` multi-token-prediction modules and the loss close the last. Runs of
    alike middle stages are written once, repeated (``Ett|(t*3|)*22tL``)."""
    def layers(count: int) -> str:
        return "t" * count if count < 3 else f"t*{count}"

    last = len(counts) - 1
    if last == 0:
        return "E" + layers(counts[0]) + "m" * mtp + "L"
    text = "E" + layers(counts[0]) + "|"
    j = 1
    while j < last:
        run = 1
        while j + run < last and counts[j + run] == counts[j]:
            run += 1
        text += f"({layers(counts[j])}|)*{run}" if run > 1 else f"{layers(counts[j])}|"
        j += run
    return text + layers(counts[last]) + "m" * mtp + "L"


def megatron_args(job: Job, layout: Layout, counts: Sequence[int]) -> list[str]:
    """Megatron-LM's arguments for ``layout`` of ``job`` whose stages hold ``counts`` decoder layers (the plan's cut),
    for a layout and job that :func:`megatron_problems` and :func:`unwritten` let through."""
    args = ["--tensor-model-parallel-size", str(layout.tp)]
    if layout.tp > 1 and job.sequence_parallel:
        args.append("--sequence-parallel")
        if job.tp_overlap:
            args.append("--tp-comm-overlap")
    args += ["--pipeline-model-parallel-size", str(layout.pp)]
    if layout.pp > 1:
        args += ["--pipeline-model-parallel-layout", megatron_layout(counts, job.spec.mtp)]
    args += ["--context-parallel-size", str(layout.cp)]
    if layout.cp > 1:
        args += ["--cp-comm-type", "p2p" if job.cp_rotate == "ring" else "all_gather"]
    if job.spec.experts is not None:
        args += ["--expert-model-parallel-size", str(layout.ep), "--expert-tensor-parallel-size", "1",
                 "--moe-grouped-gemm"]
        backend = _DISPATCHERS[job.moe_comm] if layout.ep > 1 else ()  # ep 1: no all-to-all priced, none written
        args += ["--moe-token-dispatcher-type", "flex" if backend else "alltoall"]
        args += ["--moe-flex-dispatcher-backend", *backend] if backend else []
        if job.overlap_pairs(layout):
            args.append("--overlap-moe-expert-parallel-comm")
    args += ["--micro-batch-size", str(layout.mbs), "--global-batch-size", str(job.global_batch),
             "--seq-length", str(job.seq)]
    if not job.spec.tied:  # Megatron ties the head to the embedding unless told; the plan priced the config's
        args.append("--untie-embeddings-and-output-weights")
    if layout.recompute == "full":
        depth = job.recompute_layers
        args += ["--recompute-granularity", "full", "--recompute-method", "block" if depth else "uniform",
                 "--recompute-num-layers", str(depth or 1)]
    elif layout.recompute == "selective":
        args += ["--recompute-granularity", "selective", "--recompute-modules", *megatron_modules(job.selective)]
    if job.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if job.overlap_grad_reduce:
        args.append("--overlap-grad-reduce")
        if job.distributed_optimizer:
            args.append("--overlap-param-gather")
    if job.grad_reduce == "bf16":
        args.append("--grad-reduce-in-bf16")
    if job.adam_moments == "bf16":
        args += ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    args.append("--bf16")
    if job.dtype == "fp8":
        fp8_format, recipe = FP8_RECIPES[job.fp8_cast]
        args += ["--fp8-format", fp8_format, "--fp8-recipe", recipe]
    return args


def megatron_text(args: Sequence[str], *, layout: Layout, gpus: int, hardware: str) -> str:
    """The ``.megatron.args`` file: what it is for and what to add, then the arguments on one line."""
    flex = "; --moe-flex-dispatcher-backend needs core 0.16 or later" if "--moe-flex-dispatcher-backend" in args else ""
    connections = ("; before Blackwell set CUDA_DEVICE_MAX_CONNECTIONS=1 (tp or cp > 1)"
                   if max(layout.tp, layout.cp) > 1 else "")
    return (f"# pipeloom plan for Megatron-LM (its argument checks accept it at {' and '.join(MEGATRON_VERSIONS)}"
            f"{flex}): {layout} on {gpus} {hardware} GPUs\n"
            "# add the model's own arguments (--num-layers, --hidden-size, ...; the head's tie is written), the "
            "data's and the optimizer's; "
            f"launch on {gpus} GPUs (dp={layout.dp} follows){connections}\n{shlex.join(args)}\n")


def export_megatron(result: ClusterPlan, save: str | Path) -> str:
    """Write ``<stem>.megatron.args`` next to the plan file ``save`` for ``result``'s chosen layout (check
    :func:`megatron_problems` first: :func:`~pipeloom.plan.cluster.runtime_plan.save_blockers` does); the lines that
    say so, with the arguments."""
    job, best = result.job, result.best
    args = megatron_args(job, best.layout, best.stage_layers)
    path = Path(save).with_name(f"{Path(save).stem}.megatron.args")
    path.write_text(megatron_text(args, layout=best.layout, gpus=job.gpus, hardware=job.hw.name), encoding="utf-8")
    return f"wrote Megatron-LM arguments {path}\nMegatron-LM: {shlex.join(args)}"
