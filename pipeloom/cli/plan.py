"""``pipeloom plan``: choose the whole pipeline plan (split points, schedule, micro-batches) for a cost
table, print the best plan and the runners-up, and draw or save it."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from pipeloom.cli.argtypes import bytes_argument, count, memory_argument, number, path_with, schedule_list
from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import report_console, target
from pipeloom.cli.plan_cluster import cmd_plan_cluster
from pipeloom.cli.plan_cluster_args import add_cluster_arguments, check_plan_mode
from pipeloom.cli.plan_try import add_try_arguments, check_try, trial_lines, try_in_engine

__all__ = ["PLAN_TIME_LIMIT", "add_plan_parser", "cmd_plan"]

PLAN_TIME_LIMIT = 15.0
"""Seconds ``pipeloom plan`` tries candidates by default (``--time-limit``): with reading the table and
printing, a plan ends within about 20 s whatever the global batch or the table's size."""


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``pipeloom plan``."""
    plan = commands.add_parser(
        "plan", help="plan a cluster from a model config (--model), or a pipeline from a cost table (--costs)",
        description="For a cluster you may not have yet: --model CONFIG.json|DIR|ID --hardware GPU --gpus N "
                    "--global-batch B --seq S searches dp x tp x pp x cp x ep, recomputation and the schedule for the "
                    "fastest layout that fits (docs/cluster-plan.md). For a model profiled here: --costs FILE "
                    "--ranks P --global-batch B searches every schedule, stages per rank and micro-batch count for "
                    "the fastest plan that fits the memory (docs/plan.md).")
    _add_table_arguments(plan)
    plan.add_argument("--global-batch", type=count, metavar="B",
                      help="samples per step (with --model: sequences); required")
    plan.add_argument("--memory-limit", type=memory_argument, metavar="SIZE",
                      help="bytes per rank, e.g. 80GiB or 512MiB (default: no limit; with --model the GPU's "
                           "memory)")
    plan.add_argument("--schedules", metavar="NAMES",
                      help="comma-separated schedules to try (default: every built-in one; --model: not v-half, v-min, "
                           "and the layouts of one pipeline stage, which run no schedule, are planned as well)")
    plan.add_argument("--stages-per-rank", type=count, nargs="+", default=[2], metavar="V",
                      help="stages per rank for the looped schedules (default 2)")
    plan.add_argument("--microbatches", "-m", type=count, nargs="+", metavar="M",
                      help="micro-batch counts to try (default: every divisor of the global batch)")
    plan.add_argument("--search", type=number(float, "a number of seconds >= 0", 0), default=0.0,
                      metavar="SECONDS", help="also run the CP-SAT schedule search on the best candidates for "
                                              "this long (default 0: off); a better order is saved next to --save")
    plan.add_argument("--time-limit", type=number(float, "a number of seconds >= 0.01", 0.01), default=PLAN_TIME_LIMIT,
                      metavar="SECONDS", help=f"stop trying candidates after this long (default {PLAN_TIME_LIMIT:g}); "
                                              "those left untried (the largest micro-batch counts) are counted")
    _add_output_arguments(plan)
    add_cluster_arguments(plan)
    add_try_arguments(plan)
    # what each flag is when not given: --model refuses the cost-table mode's flags that were given
    plan.set_defaults(handler=cmd_plan, plan_defaults={action.dest: action.default for action in plan._actions})


def _add_table_arguments(plan: argparse.ArgumentParser) -> None:
    """The cost-table mode's own flags: the tables, the ranks and how replicas and tensor parallelism split them."""
    plan.add_argument("--costs", type=Path, nargs="+", metavar="FILE",
                      help="pipeloom.costs/2 (or /1) files (pipeloom profile --save, or written by hand); several "
                           "files of one model at different micro-batch sizes are interpolated")
    plan.add_argument("--ranks", "-p", type=count, metavar="P",
                      help="number of ranks: dp replicas x pp pipeline ranks")
    plan.add_argument("--data-parallel", "--dp", type=count, nargs="+", metavar="DP",
                      help="replica counts to try (default: every divisor of --ranks that divides the global batch; "
                           "1 for one pipeline over every rank)")
    plan.add_argument("--tp", "--tensor-parallel", type=count, nargs="+", metavar="TP", dest="tensor_parallel",
                      help="tensor-parallel sizes to try (dp x pp x tp = --ranks; each must divide the heads); "
                           "default 1 (no tensor parallelism)")
    plan.add_argument("--heads", type=count, metavar="H",
                      help="attention heads per layer, for a cost table without a 'tensor' field (with --tp-layers)")
    plan.add_argument("--tp-layers", metavar="PATTERN", default="blocks.*",
                      help="fnmatch pattern of the pieces that are transformer layers (with --heads; default blocks.*)")
    plan.add_argument("--tp-column", metavar="NAMES", default="attn.qkv,mlp.0",
                      help="comma-separated modules inside a layer made column-parallel (with --heads; default "
                           "attn.qkv,mlp.0)")
    plan.add_argument("--tp-row", metavar="NAMES", default="attn.proj,mlp.2",
                      help="comma-separated modules inside a layer made row-parallel (with --heads; default "
                           "attn.proj,mlp.2)")
    plan.add_argument("--tp-head-norm", metavar="NAMES", default="",
                      help="comma-separated modules inside a layer that normalize each head the columns split, e.g. "
                           "self_attn.q_norm,self_attn.k_norm for Qwen3 (with --heads; default none)")
    plan.add_argument("--sharding", choices=("replicate", "fsdp"), default="replicate",
                      help="how replicas hold the weights: replicate (gradients all-reduced) or fsdp (optimizer state "
                           "sharded over the replicas, gradients reduce-scattered); default replicate")
    plan.add_argument("--dp-latency", type=number(float, "a number of seconds >= 0", 0), metavar="S",
                      help="link latency between replicas in seconds (default: the cost table's link)")
    plan.add_argument("--dp-bandwidth", type=bytes_argument, metavar="BYTES_PER_S",
                      help="link bytes per second between replicas, e.g. 25GB (default: the cost table's link)")


def _add_output_arguments(plan: argparse.ArgumentParser) -> None:
    """What the plan is shown, saved or exported as (both modes)."""
    plan.add_argument("--top", type=number(int, "an integer >= 0", 0), metavar="N",
                      help="runners-up to show (default 10; with --model 5; 0: none)")
    plan.add_argument("-o", "--out", type=path_with(".png", ".svg", ".html"),
                      help="the best plan's simulated timeline (.png/.svg, or .html: interactive)")
    plan.add_argument("--server", metavar="URL",
                      help="ask a running `pipeloom serve` (e.g. http://127.0.0.1:8765) for the plan instead of "
                           "planning here; the answer names the plan's URL for pipeline(model, plan=URL)")
    plan.add_argument("--save", type=path_with(".json"),
                      help="write the plan (pipeloom.plan/1 JSON); with --model, of the fastest layout the runtime "
                           "that trains it runs (pipeloom's; torchtitan's or Megatron-LM's with --export), said where "
                           "another is faster")
    plan.add_argument("--export", choices=("torchtitan", "megatron"),
                      help="also write the plan as torchtitan settings next to --save (checked with torchtitan 0.2.2 "
                           "and 0.3.0): <stem>.torchtitan.args (overrides: each stage's module names, the schedule "
                           "CSV by path, micro-batch size, degrees; 0.3.x also --training.disable_cuda_graphs), "
                           "<stem>.torchtitan.toml (the same for a 0.2.x TOML config), <stem>.torchtitan.csv (the "
                           "schedule); a cost table's pieces must be torchtitan's modules (tok_embeddings, layers.N). "
                           "megatron (with --model): <stem>.megatron.args, Megatron-LM's arguments for the layout "
                           "(degrees, stage layout, batch, recomputation, optimizer sharding, precision)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _schedules(text: str | None) -> list[str] | None:
    return None if text is None else schedule_list(text)


def _candidate_json(candidate) -> dict:
    return {
        "schedule": candidate.schedule, "schedule_options": candidate.schedule_options,
        "microbatches": candidate.microbatches, "microbatch_size": candidate.microbatch_size,
        "step_time": candidate.step_time, "peak_memory": candidate.peak_memory,
        "bubble_ratio": candidate.bubble_ratio,
        "split_points": None if candidate.split_points is None else list(candidate.split_points),
        "fits": candidate.fits, "reason": candidate.reason, "data_parallel": candidate.data_parallel,
        "tensor_parallel": getattr(candidate, "tensor_parallel", 1),
    }


def _progress(args: argparse.Namespace):
    """A callback printing the search's progress on a terminal's stderr (None when stderr is not one)."""
    import sys

    if args.json or not sys.stderr.isatty():
        return None

    def show(message: str) -> None:
        print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)

    return show


def _best_table(result):
    from rich.table import Table

    from pipeloom.formatting import format_bytes

    plan = result.plan
    table = Table(title="best plan", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    options = ", ".join(f"{k}={v}" for k, v in plan.schedule_options.items())
    limit = "none" if plan.memory_limit is None else format_bytes(plan.memory_limit)
    mesh = (f"{plan.data_parallel} replicas ({plan.sharding}) x {plan.num_ranks} pipeline ranks"
            if plan.data_parallel > 1 else f"one pipeline of {plan.num_ranks} ranks")
    if plan.tensor_parallel > 1:
        mesh += f" x {plan.tensor_parallel} tensor-parallel ranks ({plan.tp_plan['recipe']})"
    for label, value in (
        ("schedule", plan.schedule + (f" ({options})" if options else "")),
        ("mesh (dp x pp x tp)" if plan.tensor_parallel > 1 else "mesh (dp x pp)", mesh),
        ("ranks / model stages", f"{plan.world_size} / {plan.num_stages}"),
        ("micro-batches", f"{plan.microbatches} x {plan.microbatch_size} samples"),
        ("predicted step time", f"{plan.predicted_step_time:#.4g} s"),
        ("bubble ratio", f"{plan.bubble_ratio:.2%}"),
        ("peak memory (max over ranks)", f"{format_bytes(max(plan.peak_memory))} (limit {limit})"),
        ("split points", ", ".join(plan.split_points) or "-"),
        ("candidates tried", f"{len(result.candidates)} in {result.seconds:.2f} s"),
    ):
        table.add_row(label, value)
    return table


def _runners_up(result, top: int):
    from rich.table import Table

    from pipeloom.formatting import format_bytes

    best = result.plan.predicted_step_time
    table = Table(title=f"runners-up (best {top} of {len(result.candidates)})")
    columns = ("#", "schedule", "dp", "tp", "M x size", "step time (s)", "vs best", "bubble", "peak memory", "note")
    for column in columns:
        table.add_column(column, justify="left" if column in ("schedule", "note") else "right")
    for k, c in enumerate(result.candidates[:top]):
        fits = c.fits
        table.add_row(
            str(k + 1), c.label, str(c.data_parallel), str(getattr(c, "tensor_parallel", 1)),
            f"{c.microbatches} x {c.microbatch_size}",
            f"{c.step_time:#.4g}" if c.step_time is not None else "-",
            f"{c.step_time / best:.3f}" if c.step_time is not None and fits else "-",
            f"{c.bubble_ratio:.1%}" if c.bubble_ratio is not None else "-",
            format_bytes(c.peak_memory) if c.peak_memory is not None else "-",
            "" if fits else c.reason[:70],
        )
    return table


def _dp_link(args: argparse.Namespace, tables):
    """The link between replicas: the table's, with --dp-latency / --dp-bandwidth in place of its parts."""
    import dataclasses

    link = tables[0].link
    if args.dp_latency is not None:
        link = dataclasses.replace(link, latency=args.dp_latency)
    if args.dp_bandwidth is not None:
        link = dataclasses.replace(link, bandwidth=args.dp_bandwidth)
    return link


def _with_heads(args: argparse.Namespace, tables: list) -> list:
    """The tables, given a ``tensor`` field from --heads/--tp-layers/--tp-column/--tp-row/--tp-head-norm where
    asked."""
    if args.heads is None:
        return tables
    import dataclasses
    from fnmatch import fnmatch

    from pipeloom.plan.tp.megatron import TensorInfo

    layers = tuple(name for name in tables[0].names if fnmatch(name, args.tp_layers))
    if not layers:
        raise UsageError(f"--tp-layers {args.tp_layers!r} matches no piece of the cost table; its pieces are "
                         f"{', '.join(tables[0].names[:6])}, ...")
    info = TensorInfo(heads=args.heads, layers=layers, column=_names(args.tp_column), row=_names(args.tp_row),
                      head_norm=_names(args.tp_head_norm))
    return [dataclasses.replace(table, tensor=info) for table in tables]


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _check_cost_table_export(args: argparse.Namespace) -> None:
    if args.export == "megatron":
        raise UsageError("--export megatron writes the arguments of a cluster plan: plan with --model CONFIG.json "
                         "--hardware NAME (a cost table's plan exports to torchtitan only)")


def _plan_mesh(args: argparse.Namespace, tables: list):
    """:func:`~pipeloom.plan.mesh.plan_mesh` of the flags; UsageError for flags the tables cannot meet."""
    from pipeloom.plan.errors import NoPlanFits, PlanArgumentError
    from pipeloom.plan.mesh import plan_mesh

    try:
        return plan_mesh(
            tables, num_ranks=args.ranks, global_batch=args.global_batch, memory_limit=args.memory_limit,
            data_parallel=args.data_parallel, tensor_parallel=args.tensor_parallel or (1,), sharding=args.sharding,
            dp_link=_dp_link(args, tables), schedules=_schedules(args.schedules),
            stages_per_rank=args.stages_per_rank, microbatches=args.microbatches, search_time=args.search,
            progress=_progress(args), deadline=time.perf_counter() + args.time_limit,
        )
    except (PlanArgumentError, NoPlanFits) as error:  # flags the table cannot meet, as --model's "no layout fits"
        raise UsageError(str(error)) from None


def cmd_plan(args: argparse.Namespace) -> int:
    """``pipeloom plan``: search, write the requested files, then print the plan and runners-up."""
    from pipeloom.plan.costs.file import load_costs

    if args.export and not args.save:
        raise UsageError(f"--export {args.export} writes next to the plan file; give --save PLAN.json too")
    if check_plan_mode(args):
        return cmd_plan_cluster(args)
    _check_cost_table_export(args)
    check_try(args)
    if args.server is not None:
        return _plan_on_server(args)
    tables = _with_heads(args, [load_costs(path) for path in args.costs])
    written: list[str] = []
    result = _plan_mesh(args, tables)
    if args.try_k is not None:  # every rank of the launch runs the trials; rank 0 alone writes and prints
        result = try_in_engine(args, result)
        if os.environ.get("RANK", "0") != "0":
            return 0
        written.extend(trial_lines(result.plan))
    if result.untried:
        written.append(f"note: --time-limit {args.time_limit:g} s reached: {result.untried} candidate(s) left untried "
                       "(larger micro-batch counts); raise --time-limit, or narrow --microbatches/--schedules")
    if args.out:
        plan = result.plan
        title = (f"{plan.schedule}: p={plan.num_ranks}, m={plan.microbatches} x {plan.microbatch_size}, "
                 f"predicted {plan.predicted_step_time:.4g} s")
        written.append(_draw(args, result.timeline, title))
    if args.save:  # last: it names a companion schedule file after itself, so it is written in place
        if args.export == "torchtitan":  # first: a plan torchtitan cannot take is refused before anything is saved
            from pipeloom.plan.export.torchtitan import export_torchtitan

            # the plan was measured and priced keeping every activation: torchtitan is told to recompute nothing
            written.append(export_torchtitan(result.plan, result.schedule, args.save,
                                             [piece.name for piece in tables[0].pieces], "none",
                                             table=tables[0]))
        outputs = getattr(args, "outputs", None)
        result.save(outputs.direct(args.save) if outputs is not None else args.save)
        written.insert(0, f"wrote plan {args.save}")
    console = report_console(stderr=args.json)
    if args.json:
        from pipeloom.plan.plan import plan_to_json

        print(json.dumps({"plan": json.loads(plan_to_json(result.plan, indent=None)),
                          "candidates": [_candidate_json(c) for c in result.candidates],
                          "seconds": result.seconds, "untried": result.untried}))
    else:
        console.print(_best_table(result))
        if args.top != 0:
            console.print(_runners_up(result, 10 if args.top is None else args.top))
    for message in written:
        console.print(message, markup=False, soft_wrap=True)
    return 0


def _draw(args: argparse.Namespace, timeline, title: str) -> str:
    """Draw the plan's timeline to ``-o`` (a picture, or the interactive .html view); the line saying so."""
    from pipeloom.viz.units import PLAN_UNITS

    if args.out.suffix.lower() == ".html":
        from pipeloom.viz.html import write_html

        write_html(timeline, target(args, args.out), title=title, units=PLAN_UNITS)
        return f"wrote interactive timeline {args.out}"
    from pipeloom.viz import draw_timeline

    draw_timeline(timeline, target(args, args.out), title=title, units=PLAN_UNITS)
    return f"wrote timeline picture {args.out}"


def _plan_on_server(args: argparse.Namespace) -> int:
    """``pipeloom plan --server URL``: the server plans (:mod:`pipeloom.serve`); print and save its answer."""
    import dataclasses
    import types
    from urllib.parse import urljoin

    from pipeloom.ir import schedule_from_json
    from pipeloom.plan.costs.file import load_costs
    from pipeloom.plan.plan import plan_from_json, save_plan
    from pipeloom.remote import is_url, post_json, read_url
    from pipeloom.sim import simulate

    flags = (("--heads", args.heads), ("--dp-latency", args.dp_latency), ("--dp-bandwidth", args.dp_bandwidth),
             ("--export", args.export))
    local = [flag for flag, given in flags if given is not None]
    if local:
        raise UsageError(f"{', '.join(local)} cannot be sent to a server; drop it or plan here (without --server)")
    if not is_url(args.server):
        raise UsageError(f"--server {args.server!r}: give the server's http:// URL, e.g. http://127.0.0.1:8765")
    for path in args.costs:  # the same strict reader here first: a bad file is named before anything is sent
        load_costs(path)
    document = {"costs": [json.loads(Path(path).read_text(encoding="utf-8")) for path in args.costs],
                "ranks": args.ranks, "global_batch": args.global_batch, "memory_limit": args.memory_limit,
                "data_parallel": args.data_parallel, "tensor_parallel": args.tensor_parallel, "sharding": args.sharding,
                "schedules": _schedules(args.schedules), "stages_per_rank": args.stages_per_rank,
                "microbatches": args.microbatches, "search": args.search}
    answer = post_json(args.server.rstrip("/") + "/api/plans", document)
    plan = plan_from_json(json.dumps(answer["plan"]))
    written = [f"plan on the server: {answer['url']} (pipeline(model, plan=URL) reads it)"]
    if args.out:
        timeline = simulate(schedule_from_json(json.dumps(answer["schedule"])))
        title = (f"{plan.schedule}: p={plan.num_ranks}, m={plan.microbatches} x {plan.microbatch_size}, "
                 f"predicted {plan.predicted_step_time:.4g} s")
        written.append(_draw(args, timeline, title))
    if args.save:
        outputs = getattr(args, "outputs", None)
        save = outputs.direct(args.save) if outputs is not None else args.save
        if Path(plan.schedule).suffix.lower() == ".json" and Path(plan.schedule).name == plan.schedule:
            companion = save.with_name(f"{save.stem}.schedule.json")
            companion.write_text(read_url(urljoin(answer["url"], plan.schedule)), encoding="utf-8")
            plan = dataclasses.replace(plan, schedule=companion.name)
        save_plan(plan, save)
        written.insert(0, f"wrote plan {args.save}")
    console = report_console(stderr=args.json)
    if args.json:
        print(json.dumps({key: value for key, value in answer.items() if key not in ("view", "schedule")}))
    else:
        console.print(_best_table(types.SimpleNamespace(plan=plan, candidates=range(answer["tried"]),
                                                        seconds=answer["seconds"])))
    for message in written:
        console.print(message, markup=False, soft_wrap=True)
    return 0
