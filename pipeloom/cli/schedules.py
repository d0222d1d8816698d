"""The schedule commands of ``pipeloom``: list, show, simulate and compare, with the size check
that refuses a schedule too big to build."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from pipeloom.cli.common import (
    COST_FLAGS,
    check_flag_sums,
    check_picture,
    costs_from_args,
    emit,
    first_line,
    limit_units,
)
from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import report_console, target
from pipeloom.errors import PipeloomError
from pipeloom.ir import load_schedule
from pipeloom.lowering import lower
from pipeloom.problem import MAX_INTERVALS
from pipeloom.schedules import REGISTRY, build_schedule, meant_schedule
from pipeloom.sim import Timeline
from pipeloom.stages import Costs
from pipeloom.validate import validate
from pipeloom.viz.report import (
    comparison_rows,
    costs_report,
    placements_table,
    print_comparison,
    schedules_table,
    timeline_report,
)

__all__ = ["MAX_ACTIONS", "MAX_LOWERED_ACTIONS", "MAX_RANKS", "compare_schedules", "cmd_list", "cmd_show",
           "cmd_simulate", "cmd_compare"]

MAX_ACTIONS = MAX_INTERVALS
"""Most actions (estimated) ``show``/``compare`` build, the same cap as the search's: about a minute
and 4 GB, since building and validating took 2.5-4.5 s and 0.4 GB per million actions (1f1b p=64
m=8192, zbv p=64 m=4096)."""


MAX_RANKS = 65_536
"""Most ranks a built-in schedule is built, checked and drawn for by the command line (validation and
the per-rank tables grow with the ranks even at one micro-batch: 100,000 ranks took 8 s)."""
MAX_LOWERED_ACTIONS = 1_000_000
"""Most compute actions (estimated as for ``MAX_ACTIONS``) ``show --with-comms`` lowers: lowering adds
about 2 communication actions per compute action and checks and replays them in Python, about 6 s per
100,000 compute actions (1f1b p=64 m=1024), so this is about a minute too."""


ACTIVATIONS = "micro-batches of activations"
"""The unit of ``--memory-limit`` in show/simulate/compare (``Costs.memory`` = 1 per micro-batch)."""


def _cost_flags(args: argparse.Namespace) -> dict[str, float | None]:
    """The cost flags given, by flag (``{"--f": 1e308, ...}``), for :func:`check_flag_sums`."""
    return {f"--{key}": getattr(args, key) for key in COST_FLAGS}


def _check_name(name: str) -> None:
    if name not in REGISTRY:
        if name.lower().endswith((".json", ".csv")):  # a schedule file: simulate reads it
            raise UsageError(f"{name!r} is a file, and this command takes a built-in schedule's name; simulate a "
                             f"schedule file with `pipeloom simulate {name}`")
        raise UsageError(f"unknown schedule {name!r}{meant_schedule(name)}; choose one of: {', '.join(REGISTRY)}")


def _check_size(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None, *,
                with_comms: bool = False) -> None:
    """Refuse, before building, a schedule of more than ``MAX_ACTIONS`` compute actions (``MAX_LOWERED_ACTIONS``
    ``with_comms``), counted by :meth:`~pipeloom.schedules.ScheduleInfo.num_actions`."""
    if ranks > MAX_RANKS:
        raise UsageError(f"{name} on {ranks:,} ranks is above the limit of {MAX_RANKS:,} ranks; use fewer ranks")
    estimate = REGISTRY[name].num_actions(ranks, microbatches,
                                          {"stages_per_rank": stages_per_rank} if stages_per_rank else None)
    limit = MAX_LOWERED_ACTIONS if with_comms else MAX_ACTIONS
    if estimate > limit:
        shape = f"p={ranks}, m={microbatches}" + (f", v={stages_per_rank}" if stages_per_rank else "")
        what = " compute actions to lower (--with-comms)" if with_comms else " actions"
        fewer = "ranks, micro-batches or stages per rank" if stages_per_rank else "ranks or micro-batches"
        raise UsageError(f"{name} with {shape} would have about {estimate:,}{what}, above the limit "
                         f"of {limit:,}; use fewer {fewer}")


def _build(name: str, ranks: int, microbatches: int, costs: Costs, limit: float | None, *,
           with_comms: bool = False, **options: Any) -> Timeline:
    """Build a registered schedule (lowered when ``with_comms``) and validate it in ordered mode;
    returns its timeline."""
    try:
        schedule = build_schedule(name, ranks, microbatches, costs=costs, memory_limit=limit, **options)
    except ImportError as error:
        raise PipeloomError(f"schedule {name!r} is registered but cannot be imported ({error})") from None
    if with_comms:
        validate(schedule, ordered=True)  # a compute-order error is reported as such, not through its comms
        schedule = lower(schedule)
    return validate(schedule, ordered=True)


def cmd_list(args: argparse.Namespace) -> int:
    """``pipeloom list``: the registered schedules and the search's placements."""
    from pipeloom.search.placements import PLACEMENTS

    placements = [{"name": info.name, "summary": info.summary, "ranks": info.rule}
                  for info in PLACEMENTS.values()]
    if args.json:
        schedules = [
            {"name": info.name, "summary": info.summary, "options": list(info.options),
             "splits_backward": info.splits_backward, "placement": info.placement,
             "memory_aware": info.memory_aware}
            for info in REGISTRY.values()
        ]
        print(json.dumps({"schedules": schedules, "placements": placements}))
        return 0
    console = report_console()
    console.print(schedules_table(REGISTRY.values()))
    console.print()
    console.print(placements_table(PLACEMENTS.values()))  # its title names them and the command that searches them
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """``pipeloom show``: build one schedule, check it, report and draw it."""
    _check_name(args.name)
    options = {}
    if args.stages_per_rank is not None:
        if "stages_per_rank" not in REGISTRY[args.name].options:
            takers = [name for name, info in REGISTRY.items() if "stages_per_rank" in info.options]
            raise UsageError(f"schedule {args.name!r} does not take --stages-per-rank; "
                             f"schedules that do: {', '.join(takers)}")
        options["stages_per_rank"] = args.stages_per_rank
    _check_size(args.name, args.ranks, args.microbatches, args.stages_per_rank, with_comms=args.with_comms)
    if args.with_comms and args.save is not None and args.save.suffix.lower() != ".csv":
        raise UsageError(f"--save {args.save}: a lowered schedule (--with-comms) is saved as torch "
                         "compute_comms CSV; use a .csv file name")
    check_flag_sums(_cost_flags(args), args.microbatches)
    check_picture(args, args.ranks)
    costs = costs_from_args(args)
    with limit_units(args, ACTIVATIONS):
        timeline = _build(args.name, args.ranks, args.microbatches, costs, args.memory_limit,
                          with_comms=args.with_comms, **options)
    return emit(args, timeline, timeline_report(timeline, microbatches=args.microbatches, costs=costs))


def cmd_simulate(args: argparse.Namespace) -> int:
    """``pipeloom simulate``: check and simulate a saved schedule (pipeloom JSON or torch CSV)."""
    is_csv = args.file.suffix.lower() == ".csv"
    cost_flags = [f"--{k}" for k in COST_FLAGS if getattr(args, k) is not None]
    if cost_flags and not is_csv:
        raise UsageError(f"{'/'.join(cost_flags)} set the costs of a torch CSV; a pipeloom JSON "
                         "schedule carries its own task durations")
    check_flag_sums(_cost_flags(args), 1)  # before the CSV reader adds b + w
    costs = costs_from_args(args)
    schedule = load_schedule(args.file, costs=costs)
    if schedule.problem.num_ranks > MAX_RANKS:  # validating and the per-rank tables grow with the ranks
        raise UsageError(f"{args.file}: {schedule.problem.num_ranks:,} ranks is above the limit of {MAX_RANKS:,} "
                         "ranks; use fewer ranks")
    check_picture(args, schedule.problem.num_ranks)
    check_flag_sums(_cost_flags(args), schedule.num_microbatches)
    problem = schedule.problem
    if args.memory_limit is not None:  # overrides the limit a JSON file carries
        problem = dataclasses.replace(problem, memory_limit=args.memory_limit)
    if args.overlap is not None:  # overrides the pricing of pairs a JSON file carries
        problem = dataclasses.replace(problem, overlap_fraction=args.overlap)
    if args.pair_time is not None:
        problem = dataclasses.replace(problem, pair_time=args.pair_time)
    schedule = dataclasses.replace(schedule, problem=problem)
    with limit_units(args, ACTIVATIONS if is_csv else "the file's memory units"):
        timeline = validate(schedule, ordered=not args.allow_unordered)
    entry = REGISTRY.get(schedule.name)  # a two-replica schedule's file counts pairs: reported as `show` reports them
    real = schedule.num_microbatches * entry.replicas if entry is not None else None
    return emit(args, timeline, timeline_report(timeline, costs=costs if is_csv else None, microbatches=real))


def compare_schedules(names: Sequence[str], ranks: int, microbatches: int, costs: Costs,
                      limit: float | None) -> tuple[list[dict], list[Timeline]]:
    """Build each schedule: rows as ``comparison_rows`` (a failure is a row with an ``error``) and
    the timelines built; raises when none could be built."""
    outcomes: list[tuple[str, Timeline | str]] = []
    for name in names:
        try:
            outcomes.append((name, _build(name, ranks, microbatches, costs, limit)))
        except ValueError as error:
            outcomes.append((name, first_line(error)))
    rows = comparison_rows(outcomes, microbatches=microbatches, costs=costs)
    if all("error" in row for row in rows):
        reasons = "; ".join(f"{row['name']}: {row['error']}" for row in rows)
        raise PipeloomError(f"no schedule could be built ({reasons})")
    return rows, [outcome for _, outcome in outcomes if not isinstance(outcome, str)]


def cmd_compare(args: argparse.Namespace) -> int:
    """``pipeloom compare``: build the named schedules and compare them side by side."""
    twice = sorted({name for name in args.names if args.names.count(name) > 1})
    if twice:
        raise UsageError(f"{twice[0]!r} is named twice; name each schedule once")
    for name in args.names:
        _check_name(name)
        _check_size(name, args.ranks, args.microbatches)
    check_flag_sums(_cost_flags(args), args.microbatches)
    check_picture(args, args.ranks * len(args.names))
    costs = costs_from_args(args)
    rows, timelines = compare_schedules(args.names, args.ranks, args.microbatches, costs, args.memory_limit)
    title = f"p={args.ranks}, m={args.microbatches}"
    if args.out:  # written first: a failed write leaves stdout empty
        if args.out.suffix.lower() == ".html":
            from pipeloom.viz.html import write_html

            write_html(timelines, target(args, args.out), title=title)
        else:
            from pipeloom import viz

            viz.draw_comparison(timelines, target(args, args.out), title=title)
    console = report_console(stderr=args.json)
    if args.json:
        print(json.dumps({"num_ranks": args.ranks, "num_microbatches": args.microbatches,
                          "costs": costs_report(costs), "memory_limit": args.memory_limit,
                          "schedules": rows}))
    else:
        print_comparison(console, rows, title)
    if args.out:
        console.print(f"wrote comparison figure {args.out}", markup=False, soft_wrap=True)
    return 0
