"""``pipeloom plan --model CONFIG.json --hardware NAME``: the cluster planner's mode of ``pipeloom plan`` (the
fastest dp x tp x pp x cp x ep layout, schedule and recomputation for a model config on N GPUs of one type)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pipeloom.cli.errors import UsageError
from pipeloom.cli.plan_cluster_args import check_export, framework_options
from pipeloom.cli.plan_cluster_report import json_notes, report, seconds_text, training_text
from pipeloom.errors import PipeloomError
from pipeloom.plan.errors import NoLayoutFits

__all__ = ["cmd_plan_cluster"]


def cmd_plan_cluster(args: argparse.Namespace) -> int:
    """Plan, then print the text report or the JSON object."""
    from pipeloom.plan.cluster.api import plan_cluster

    if args.export == "torchtitan" and args.framework is None:  # priced as torchtitan runs it; a flag given still wins
        args.framework = "torchtitan"
    progress = None
    if not args.json and sys.stderr.isatty():
        def progress(message: str) -> None:
            print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)
    options = dict(gpus=args.gpus, global_batch=args.global_batch, seq=args.seq, dtype=args.dtype, layout=args.layout,
                   **framework_options(args), overlap_grad_reduce=args.overlap_grad_reduce, moe_comm=args.moe_comm,
                   sequence_parallel=args.sequence_parallel, moe_overlap=args.moe_overlap,
                   shard_gradients=args.shard_gradients, adam_moments=args.adam_moments,
                   recompute_layers=args.recompute_layers, memory_limit=args.memory_limit,
                   runners_up=5 if args.top is None else args.top, progress=progress)
    check_export(args, options)
    try:
        try:
            result, planned = plan_cluster(args.model, args.hardware, **options), None
        except NoLayoutFits as refusal:
            if not args.save:
                raise
            result, planned = None, refusal  # none fits as planned: the runtime's own search says what it needs
        result, moved = _runnable(args, result, options, planned) if args.save else (result, [])
    except PipeloomError as error:
        raise UsageError(str(error).splitlines()[0]) from None
    finally:
        if progress is not None:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    unused = _unused(args, result.job, result.best.layout, alone=result.candidates == 1)
    if result.runs_on == "pipeloom":  # its expert exchange is its own: said in ``moved``
        unused = [note for note in unused if "--moe-" not in note]
    written = [*moved, *unused, *(_save(args, result) if args.save else [])]
    training = result.training(args.tokens) if args.tokens else None
    if args.json:
        print(json.dumps({**result.as_dict(), **json_notes(result, framework=args.framework),
                          **({"training": training} if training else {})}, indent=2))
    else:
        print(report(result, framework=args.framework)
              + (f"\n{training_text(training, result.job.gpus)}" if training else ""))
    for line in written:
        print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


def _runnable(args: argparse.Namespace, result, options: dict, planned: NoLayoutFits | None) -> tuple:
    """``--save``: ``result``'s job planned again for the plan's runtime (pipeloom's, or torchtitan with ``--export``:
    :func:`~pipeloom.plan.cluster.runtime_plan.for_runtime`), the same keys held: the layouts it runs, priced as it
    holds and runs them; and, where that is not the fastest layout as planned, the note that says why. A whole layout
    given that the runtime cannot run is left as planned (:func:`_save` refuses it, naming the keys that fix it).
    ``planned``: the refusal of the plan as asked, where it had none: said alone where no layout runs the job's counts
    (the runtime is not the cause), beside the runtime's where none fits."""
    from pipeloom.plan.cluster.api import parse_layout, plan_cluster
    from pipeloom.plan.cluster.estimate import Estimator
    from pipeloom.plan.cluster.layout import LAYOUT_KEYS
    from pipeloom.plan.cluster.runtime_plan import RUNTIME_NAMES, for_runtime

    runs_on = args.export or "pipeloom"
    where = RUNTIME_NAMES[runs_on]
    given = [flag for flag, on in ((f"--moe-comm {args.moe_comm}", args.moe_comm != "plain"),
                                   ("--moe-overlap", args.moe_overlap)) if on]
    plain = ([f"note: pipeloom's runtime exchanges the experts' tokens with all_to_all_single, one call after another: "
              f"the plan is priced so, not with {' and '.join(given)}"] if given and runs_on == "pipeloom" else [])
    whole = set(parse_layout(args.layout or "")) >= set(LAYOUT_KEYS)
    job, blocked = for_runtime(result.job, runs_on) if result is not None else (None, None)
    if result is not None and whole and blocked is not None and blocked(result.best.layout):
        return result, plain
    try:
        runnable = plan_cluster(args.model, args.hardware, **options, runs_on=runs_on)
    except NoLayoutFits as refusal:
        if planned is not None:
            if planned.smallest_limit is None:  # no runtime can run the job's counts
                raise planned from None
            # none fits in any runtime: the runtime's least memory, and any runtime's
            fastest = (f" (planned for any runtime, none fits either: the least memory any layout needs is "
                       f"{planned.smallest_limit / 2**30:.2f} GiB, by {planned.smallest_layout})")
        else:
            fastest = (f" (planned for any runtime, the fastest layout is {result.best.layout}, "
                       f"{seconds_text(result.best.step_time)} s a step)")
        raise UsageError(f"cannot save a plan {where} runs: {str(refusal).splitlines()[0]}{fastest}") from None
    if result is None or whole:
        return runnable, plain
    runnable = dataclasses.replace(runnable, seconds=runnable.seconds + result.seconds)  # both searches
    assert job is not None and blocked is not None  # result is not None
    best, there = result.best, runnable.best.step_time
    problems = blocked(best.layout)
    if str(runnable.best.layout) == str(best.layout):
        return runnable, plain
    if not problems:
        priced, limit = Estimator(job).estimate(best.layout), result.memory_limit
        if priced.memory.total <= limit and priced.step_time <= there * 1.001:
            return runnable, plain  # as fast there as the plan: a tie the search broke otherwise
        why = (f"it needs {priced.memory.total / 2**30:.1f} GiB per GPU, over the {limit / 2**30:.1f} GiB limit"
               if priced.memory.total > limit else f"it takes {seconds_text(priced.step_time)} s a step")
    else:
        why = f"it cannot run: {'; '.join(problems)}"
    fast, slow = seconds_text(best.step_time), seconds_text(there)
    return runnable, [*plain, f"note: planned as asked, the fastest layout is {best.layout} ({fast} s a step); in "
                      f"{where} {why}; the plan printed is the fastest there ({slow} s a step as {where} runs it)"]


def _unused(args: argparse.Namespace, job, layout, alone: bool = False) -> list[str]:
    """Notes for framework options given that change nothing on the chosen layout (they are priced where the
    search tries a layout they apply to, so they are not refused; ``alone``: the keys fixed leave one layout)."""
    overlap_why = "ep=1" if layout.ep == 1 else f"schedule={layout.schedule} with pp={layout.pp}"
    unused = [(args.tp_overlap and layout.tp == 1, "--tp-overlap", "tp=1"),
              (args.shard_gradients and not job.zero2(layout), "--shard-gradients",
               "fsdp=1 on one stage" if job.reshards(layout) else "one data-parallel replica"),
              (args.moe_overlap and not job.overlap_pairs(layout), "--moe-overlap", overlap_why),
              (not args.sequence_parallel and layout.tp == 1, "--no-sequence-parallel", "tp=1"),
              (args.cp_rotate not in (None, "ring") and layout.cp == 1, f"--cp-rotate {args.cp_rotate}", "cp=1"),
              (args.cp_rotate is not None and layout.cp > 1 and job.spec.indexer is not None,
               f"--cp-rotate {args.cp_rotate}", "DeepSeek's sparse attention, which all-gathers its latent keys"),
              (args.moe_comm != "plain" and layout.ep == 1, f"--moe-comm {args.moe_comm}", "ep=1"),
              (args.selective not in (None, "core_attn") and layout.recompute != "selective",
               f"--selective {args.selective}", f"recompute={layout.recompute}"),
              (args.recompute_layers and layout.recompute != "full", f"--recompute-layers {args.recompute_layers}",
               f"recompute={layout.recompute}")]
    priced = "the only layout the --layout keys leave: drop the flag" if alone else "it was priced where it applies"
    return [f"note: {flag} does not apply to the chosen layout, which runs {why} ({priced})"
            for given, flag, why in unused if given]


def _save(args: argparse.Namespace, result) -> list[str]:
    """``--save`` (and ``--export``): the chosen layout as the runtime's plan file (and the framework's settings), the
    lines that say so and what the runtime runs differently; a layout the runtime cannot run is refused before anything
    is written."""
    from pipeloom.plan.cluster import runtime_plan as saving
    from pipeloom.plan.errors import PlanError

    if args.export == "megatron":
        return _save_megatron(args, result)
    try:
        plan = saving.runtime_plan(result, export=args.export)
    except PlanError as error:  # what the layout or the export cannot run: the user's --layout to change
        raise UsageError(str(error)) from None
    written = []
    if args.export == "torchtitan":
        from pipeloom.plan.export.torchtitan import export_torchtitan, torchtitan_plan, torchtitan_recompute
        from pipeloom.schedules import build_schedule

        renamed, modules = torchtitan_plan(plan, result.job.spec.layers)
        schedule = build_schedule(plan.schedule, plan.num_ranks, plan.microbatches, **plan.schedule_options)
        recompute = torchtitan_recompute(result.job, result.best.layout)
        assert recompute is not None, "runtime_plan refuses the export of a recomputation torchtitan has not"
        written.append(export_torchtitan(renamed, schedule, args.save, list(modules), recompute,
                                         compiled=result.job.kernels == "fused",
                                         async_tp=result.job.tp_overlap and result.best.layout.tp > 1))
    return _saved(args, result, plan, written)


def _save_megatron(args: argparse.Namespace, result) -> list[str]:
    """``--export megatron``: Megatron-LM's arguments next to ``--save``, and pipeloom's plan file there where its
    format holds the layout (it holds ep only with tp 1 and ep dividing dp, as pipeloom's runtime runs it)."""
    from pipeloom.plan.cluster import runtime_plan as saving
    from pipeloom.plan.errors import PlanError
    from pipeloom.plan.export.megatron import export_megatron

    blockers = saving.save_blockers(result, export="megatron")
    if blockers:  # what Megatron-LM cannot run: the user's --layout to change, before anything is written
        raise UsageError(blockers)
    try:
        plan = saving.runtime_plan(result, export="megatron")
    except PlanError as error:
        outputs = getattr(args, "outputs", None)
        if outputs is not None:  # its staged file goes unwritten
            outputs.direct(args.save)
        return [export_megatron(result, args.save), f"note: no pipeloom plan file written at {args.save}: {error}; "
                                                    "the Megatron-LM arguments carry the plan"]
    return _saved(args, result, plan, [export_megatron(result, args.save)])


def _saved(args: argparse.Namespace, result, plan, written: list[str]) -> list[str]:
    """Write ``plan`` at ``--save``; the lines that say so, then ``written``'s, then what the runtime runs
    differently."""
    from pipeloom.plan.cluster import runtime_plan as saving
    from pipeloom.plan.plan import save_plan

    outputs = getattr(args, "outputs", None)
    save_plan(plan, outputs.path(args.save) if outputs is not None else args.save)
    memory = saving.runtime_memory_note(result)
    notes = [f"note: {note}" for note in saving.runtime_notes(result, memory=memory)]
    runs = "pipeline(model, plan=...) runs it"
    if not memory[1]:
        runs = (f"for {saving.RUNTIME_NAMES[args.export]}; pipeloom's runtime won't run it as planned" if args.export
                else f"{runs}, not as planned: see the notes")
    return [f"wrote plan {args.save} ({runs})", *written, *notes]
