"""``pipeloom search``: search the fastest schedule of a catalog placement or a problem file with
CP-SAT, showing a progress line (best, bound, gap) on a terminal."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

from pipeloom.cli.common import check_flag_sums, emit, limit_units
from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import report_console
from pipeloom.cli.schedules import MAX_RANKS
from pipeloom.formatting import format_number
from pipeloom.validate import validate
from pipeloom.viz.report import search_table, timeline_report

__all__ = ["cmd_search"]


def _search_problem(args: argparse.Namespace):
    """The problem ``pipeloom search`` works on: a catalog placement, or a problem file."""
    from pipeloom.ir import check_totals
    from pipeloom.search import PLACEMENTS, load_problem, placement

    costs = {"f": args.f, "b": args.b, "w": args.w, "w_memory": args.w_memory}
    if args.placement is None:
        flags = [flag for flag, on in (("--ranks", args.ranks), ("--split-backward", args.split_backward),
                                       ("--inference", args.inference), ("--f", args.f is not None),
                                       ("--b", args.b is not None), ("--w", args.w is not None),
                                       ("--w-memory", args.w_memory is not None)) if on]
        if flags:
            verb = "applies" if len(flags) == 1 else "apply"
            raise UsageError(f"{', '.join(flags)} {verb} to --placement; a problem file has its own tasks")
        check_flag_sums({"--comm": args.comm}, args.microbatches)
        problem = load_problem(args.problem)
        if problem.num_ranks > MAX_RANKS:  # the per-rank tables and checks grow with the ranks
            raise UsageError(f"{args.problem}: {problem.num_ranks:,} ranks is above the limit of {MAX_RANKS:,} "
                             "ranks; use fewer ranks")
        problem = problem if args.comm is None else dataclasses.replace(problem, comm_latency=args.comm)
        check_totals(problem, args.microbatches, where=f"{args.problem}: problem")  # names the file's field
        return problem
    if args.placement not in PLACEMENTS:
        raise UsageError(f"unknown placement {args.placement!r}; choose one of: {', '.join(PLACEMENTS)}")
    if args.ranks is None:
        raise UsageError("--placement needs --ranks D")
    if args.ranks > MAX_RANKS:  # building the placement alone grows with the ranks
        raise UsageError(f"--ranks {args.ranks:,} is above the limit of {MAX_RANKS:,} ranks; use fewer ranks")
    _check_costs(args)
    check_flag_sums({"--f": args.f, "--b": args.b, "--w": args.w, "--comm": args.comm}, args.microbatches)
    return placement(args.placement, args.ranks, split_backward=args.split_backward, inference=args.inference,
                     memory_limit=args.memory_limit, comm_latency=args.comm or 0.0, **costs)


_UNITS = "the problem's memory units (micro-batches of activations for a placement)"
"""The unit of ``search --memory-limit``."""


def _check_costs(args: argparse.Namespace) -> None:
    """Refuse cost flags that cannot apply: backward costs with --inference, --w-memory without
    --split-backward or above the 1 unit a forward takes."""
    if args.inference:
        given = [flag for flag, value in (("--b", args.b), ("--w", args.w), ("--w-memory", args.w_memory))
                 if value is not None]
        if given:
            pronoun = "them" if len(given) > 1 else "it"
            raise UsageError(f"{', '.join(given)}: --inference has no backward; drop {pronoun}")
    if args.w_memory is not None:
        if not args.split_backward:
            raise UsageError("--w-memory is the memory W releases; add --split-backward (W exists only then)")
        if args.w_memory > 1:
            raise UsageError(f"--w-memory must be at most 1 (a forward takes 1 unit), got {args.w_memory:g}")


def _check_save(args: argparse.Namespace, problem) -> None:
    """Refuse ``--save x.csv`` before searching when the CSV cannot carry ``problem`` (e.g. a task on
    several ranks): the same check :func:`~pipeloom.ir.schedule_to_csv` makes, on a one-micro-batch
    list schedule of the problem (the check depends on the task graph, not on the order)."""
    save = getattr(args, "save", None)
    if save is None or save.suffix.lower() != ".csv":
        return
    from pipeloom.errors import ScheduleFormatError
    from pipeloom.ir import schedule_to_csv
    from pipeloom.search.greedy import list_schedule

    tiny = list_schedule(dataclasses.replace(problem, memory_limit=None), 1, name="search")
    try:
        schedule_to_csv(tiny)
    except ScheduleFormatError as error:
        raise UsageError(f"--save {save}: {error}") from None


@contextlib.contextmanager
def _search_status(enabled: bool):
    """A transient stderr line (best, bound, gap) once a search has run 1 s; only on a terminal."""
    console = report_console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return
    status = console.status("searching")

    def show(report) -> None:
        if report.seconds < 1.0:
            return
        best = "-" if report.best is None else format_number(report.best)
        gap = "-" if report.best is None or report.bound <= 0 else f"{report.best / report.bound - 1:.2%}"
        status.update(f"searching ({report.phase}, {report.seconds:.0f} s): best {best}, "
                      f"bound {format_number(report.bound)}, gap {gap}")
        status.start()  # no-op once started

    try:
        yield show
    finally:
        status.stop()


def cmd_search(args: argparse.Namespace) -> int:
    """``pipeloom search``: search, validate the result, report and draw it."""
    from pipeloom.search import search

    problem = _search_problem(args)
    _check_save(args, problem)
    with _search_status(not args.json) as progress, limit_units(args, _UNITS):
        result = search(problem, args.microbatches, mode=args.mode, memory_limit=args.memory_limit,
                        time_limit=args.time_limit, workers=args.workers, progress=progress)
    timeline = validate(result.schedule, ordered=True)
    report = {**timeline_report(timeline), "makespan": result.makespan, "lower_bound": result.lower_bound,
              "gap": result.gap, "status": result.status, "mode": result.mode, "period": result.period,
              "period_lower_bound": result.period_lower_bound, "search_seconds": result.seconds,
              "origin": result.origin, "peak_memory": list(result.peak_memory)}
    return emit(args, timeline, report, table=search_table)
