"""The ``pipeloom`` command line, a thin layer over the library: list, show, simulate, compare, demo,
search.

Every bad input ends as one line ``pipeloom: error: ...`` on stderr and a non-zero exit status
(2 for usage errors, 1 for the rest); the library's exceptions carry the message.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeloom.errors import PipeloomError
from pipeloom.ir import load_schedule, save_schedule
from pipeloom.problem import Costs
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.sim import Timeline
from pipeloom.validate import validate
from pipeloom.viz.report import (compare_markdown, comparison_rows, format_number, per_rank_table,
                                 placements_table, print_comparison, schedules_table, search_table,
                                 summary_table, terminal_timeline, timeline_report)

__all__ = ["main", "DEMO_COSTS", "DEMO_RANKS", "DEMO_MICROBATCHES", "DEMO_SCHEDULES", "MAX_ACTIONS"]

DEMO_COSTS = Costs(f=18522, b=18086, w=9337, comm=601)
"""Per-rank F, I, W and communication costs from the zero-bubble paper, used by ``pipeloom demo``."""
DEMO_RANKS, DEMO_MICROBATCHES = 8, 24
DEMO_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zbv", "interleaved-1f1b", "dualpipev", "gpipe")
"""Schedules the demo compares; one that cannot be built gets a note instead of a row."""

MAX_ACTIONS = 10_000_000
"""Most actions (estimated) ``show``/``compare`` build: about a minute and 4 GB, since building and
validating took 2.5-4.5 s and 0.4 GB per million actions (1f1b p=64 m=8192, zbv p=64 m=4096)."""

_COST_FLAGS = ("f", "b", "w", "comm")
COST_HELP = (
    "Costs are per micro-batch for ONE RANK'S SHARE of the model (a stage of the 1F1B layout): "
    "--f forward, --b input-gradient backward (I), --w weight-gradient backward (W). Schedules "
    "that do not split the backward run one B costing b+w; schedules with v stages per rank give "
    "each stage 1/v of the costs, so every schedule runs the same model. Defaults: f=b=w=1, comm=0."
)


class _UsageError(PipeloomError):
    """Bad command-line usage (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors become one-line ``_UsageError``s instead of usage dumps."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


# ------------------------------------------------------------------------------ argument types


def _number(kind: type, words: str, minimum: float):
    """An argparse type parsing ``kind`` and requiring a finite value >= ``minimum``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}")
        return value

    return parse


_cost = _number(float, "a finite number >= 0", 0)
_count = _number(int, "a positive integer", 1)


def _path_with(*suffixes: str):
    """An argparse type for an output file: suffix one of ``suffixes`` (any case), in an existing
    folder, not itself a folder; checked while parsing, so before anything is built or printed."""

    def check(text: str) -> Path:
        path = Path(text)
        if path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r}: use a {' or '.join(suffixes)} file name")
        parent = path.parent
        if not parent.is_dir():
            what = "is not a folder" if parent.exists() else "does not exist"
            raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(parent)!r} {what}; create it first")
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
        return path

    return check


# ---------------------------------------------------------------------------------- the parser


def _add_costs(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("costs", COST_HELP)
    group.add_argument("--f", type=_cost, metavar="F", help="forward time (default 1)")
    group.add_argument("--b", type=_cost, metavar="B", help="input-gradient backward time (default 1)")
    group.add_argument("--w", type=_cost, metavar="W", help="weight-gradient backward time (default 1)")
    group.add_argument("--comm", type=_cost, metavar="C", help="latency between ranks (default 0)")
    group.add_argument("--memory-limit", type=_cost, metavar="L",
                       help="per-rank cap on held activations, in micro-batches of one rank's share")


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("outputs")
    group.add_argument("-o", "--out", type=_path_with(".png", ".svg"), help="timeline picture (.png/.svg)")
    group.add_argument("--trace", type=_path_with(".json"), help="Chrome/Perfetto trace (.json)")
    group.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    group.add_argument("--terminal", action="store_true", help="draw the timeline in the terminal")
    group.add_argument("--width", type=_count, help="width of the --terminal view (default: terminal width)")


def _add_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", "-p", type=_count, required=True, metavar="P", help="number of ranks")
    parser.add_argument("--microbatches", "-m", type=_count, required=True, metavar="M",
                        help="number of micro-batches (real ones; two-replica schedules pair them)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pipeloom",
        description="Build, validate, simulate, compare and draw pipeline-parallel schedules.",
        epilog=COST_HELP,
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="print full error details")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    listing = commands.add_parser("list", help="list the built-in schedules and placements")
    listing.add_argument("--json", action="store_true", help="print one JSON object")
    listing.set_defaults(handler=_cmd_list)

    show = commands.add_parser("show", help="build one schedule, check it, report and draw it",
                               epilog=COST_HELP)
    show.add_argument("name", metavar="NAME", help="schedule name (see `pipeloom list`)")
    _add_shape(show)
    show.add_argument("--stages-per-rank", type=_count, metavar="V",
                      help="stages per rank, for schedules that take it (e.g. interleaved-1f1b)")
    _add_costs(show)
    _add_outputs(show)
    show.add_argument("--save", type=_path_with(".json", ".csv"),
                      help="save the schedule: pipeloom JSON (.json) or torch compute-only CSV (.csv)")
    show.set_defaults(handler=_cmd_show)

    sim = commands.add_parser("simulate", help="check and simulate a saved schedule (JSON or torch CSV)",
                              epilog=COST_HELP + " The cost flags apply to CSV files only.")
    sim.add_argument("file", type=Path, metavar="FILE", help="a pipeloom .json or torch .csv schedule")
    sim.add_argument("--allow-unordered", action="store_true",
                     help="accept B/W of a stage out of micro-batch order (not exact in the runtime)")
    _add_costs(sim)
    _add_outputs(sim)
    sim.set_defaults(handler=_cmd_simulate)

    compare = commands.add_parser("compare", help="compare schedules side by side", epilog=COST_HELP)
    compare.add_argument("names", nargs="+", metavar="NAME", help="schedule names (see `pipeloom list`)")
    _add_shape(compare)
    _add_costs(compare)
    compare.add_argument("-o", "--out", type=_path_with(".png", ".svg"), help="comparison figure (.png/.svg)")
    compare.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    compare.set_defaults(handler=_cmd_compare)

    demo = commands.add_parser("demo", help="compare the main schedules on the zero-bubble paper's costs")
    demo.add_argument("--out", type=Path, default=Path("demo-output"),
                      help="output folder (default demo-output)")
    demo.set_defaults(handler=_cmd_demo)
    _add_search(commands)
    return parser


def _add_search(commands: argparse._SubParsersAction) -> None:
    search = commands.add_parser("search", help="search the fastest schedule of a placement or task graph",
                                 description="Search a schedule with CP-SAT (see docs/search.md).")
    source = search.add_mutually_exclusive_group(required=True)
    source.add_argument("--placement", metavar="NAME", help="a catalog placement (see `pipeloom list`)")
    source.add_argument("--problem", type=Path, metavar="FILE", help="a problem JSON file (docs/search.md)")
    search.add_argument("--ranks", "-p", type=_count, metavar="D", help="number of ranks (with --placement)")
    search.add_argument("--microbatches", "-m", type=_count, required=True, metavar="M",
                        help="number of micro-batches")
    search.add_argument("--memory-limit", type=_cost, metavar="L",
                        help="per-rank cap on held memory (overrides a problem file's)")
    search.add_argument("--time-limit", type=_number(float, "a number of seconds >= 0.01", 0.01),
                        default=30.0, metavar="S", help="search time limit in seconds (default 30)")
    search.add_argument("--mode", choices=("auto", "exact", "periodic"), default="auto",
                        help="exact model, periodic (repetend) model, or auto by size (default)")
    search.add_argument("--workers", type=_count, default=2, help="CP-SAT worker threads (default 2)")
    search.add_argument("--split-backward", action="store_true", help="split B into I and W (placements)")
    search.add_argument("--inference", action="store_true", help="forward only, memory 0 (placements)")
    search.add_argument("--comm", type=_cost, metavar="C", help="latency between rank sets (default 0)")
    _add_outputs(search)
    search.add_argument("--save", type=_path_with(".json", ".csv"),
                        help="save the schedule: pipeloom JSON (.json) or torch compute-only CSV (.csv)")
    search.set_defaults(handler=_cmd_search)


# --------------------------------------------------------------------------- building, reports


def _costs(args: argparse.Namespace) -> Costs:
    """Costs from the --f/--b/--w/--comm flags; a flag left out keeps the Costs default."""
    return Costs(**{k: getattr(args, k) for k in _COST_FLAGS if getattr(args, k) is not None})


def _check_name(name: str) -> None:
    if name not in REGISTRY:
        raise _UsageError(f"unknown schedule {name!r}; choose one of: {', '.join(REGISTRY)}")


def _check_size(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> None:
    """Refuse, before building, a schedule of more than about ``MAX_ACTIONS`` actions, estimated as
    ranks x micro-batches x stages per rank (``stages_per_rank``, else 2, the most a built-in uses
    by default) x kinds (3 with a split backward: F, I, W; else 2: F, B), a rough upper bound."""
    estimate = ranks * microbatches * (stages_per_rank or 2) * (3 if REGISTRY[name].splits_backward else 2)
    if estimate > MAX_ACTIONS:
        shape = f"p={ranks}, m={microbatches}" + (f", v={stages_per_rank}" if stages_per_rank else "")
        raise _UsageError(f"{name} with {shape} would have about {estimate:,} actions, above the limit "
                          f"of {MAX_ACTIONS:,}; use fewer ranks, micro-batches or stages per rank")


def _build(name: str, ranks: int, microbatches: int, costs: Costs, limit: float | None,
           **options: Any) -> Timeline:
    """Build a registered schedule and validate it in ordered mode; returns its timeline."""
    try:
        schedule = build_schedule(name, ranks, microbatches, costs=costs, memory_limit=limit, **options)
    except ImportError as error:
        raise PipeloomError(f"schedule {name!r} is registered but cannot be imported ({error})") from None
    return validate(schedule, ordered=True)


def _write_files(args: argparse.Namespace, timeline: Timeline, report: dict) -> list[str]:
    """Write the requested files before anything is printed, so a refused or failed write leaves
    stdout empty; returns one message per file written."""
    written = []
    if getattr(args, "save", None):
        save_schedule(timeline.schedule, args.save)
        written.append(f"wrote schedule {args.save}")
    if args.out or args.trace:
        from pipeloom import viz

        if args.out:
            title = f"{report['name']}: p={report['num_ranks']}, m={report['num_microbatches']}"
            viz.draw_timeline(timeline, args.out, title=title)
            written.append(f"wrote timeline picture {args.out}")
        if args.trace:
            viz.write_trace(timeline, args.trace)
            written.append(f"wrote trace {args.trace} (open it in https://ui.perfetto.dev)")
    return written


def _emit(args: argparse.Namespace, timeline: Timeline, report: dict, table=summary_table) -> int:
    """Write the requested files, then print the report (tables or JSON) and the terminal view."""
    written = _write_files(args, timeline, report)
    console = Console(stderr=args.json, highlight=False)
    if args.json:
        print(json.dumps(report))
    else:
        console.print(table(report))
        console.print(per_rank_table(report))
    if args.terminal:
        view = terminal_timeline(timeline, console_width=console.width, width=args.width)
        console.print(view, soft_wrap=True)
    for message in written:
        console.print(message, markup=False, soft_wrap=True)
    return 0


# ------------------------------------------------------------------------------------ commands


def _cmd_list(args: argparse.Namespace) -> int:
    from pipeloom.search.placements import PLACEMENTS

    placements = [{"name": info.name, "summary": info.summary, "ranks": info.rule}
                  for info in PLACEMENTS.values()]
    if args.json:
        schedules = [
            {"name": info.name, "summary": info.summary, "options": list(info.options),
             "splits_backward": info.splits_backward}
            for info in REGISTRY.values()
        ]
        print(json.dumps({"schedules": schedules, "placements": placements}))
        return 0
    console = Console(highlight=False)
    console.print(schedules_table(REGISTRY.values()))
    console.print("\nPlacements (task graphs for the search)", style="bold")
    console.print(placements_table(PLACEMENTS.values()))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    _check_name(args.name)
    options = {}
    if args.stages_per_rank is not None:
        if "stages_per_rank" not in REGISTRY[args.name].options:
            takers = [name for name, info in REGISTRY.items() if "stages_per_rank" in info.options]
            raise _UsageError(f"schedule {args.name!r} does not take --stages-per-rank; "
                              f"schedules that do: {', '.join(takers)}")
        options["stages_per_rank"] = args.stages_per_rank
    _check_size(args.name, args.ranks, args.microbatches, args.stages_per_rank)
    costs = _costs(args)
    timeline = _build(args.name, args.ranks, args.microbatches, costs, args.memory_limit, **options)
    return _emit(args, timeline, timeline_report(timeline, microbatches=args.microbatches, costs=costs))


def _cmd_simulate(args: argparse.Namespace) -> int:
    is_csv = args.file.suffix.lower() == ".csv"
    cost_flags = [f"--{k}" for k in _COST_FLAGS if getattr(args, k) is not None]
    if cost_flags and not is_csv:
        raise _UsageError(f"{'/'.join(cost_flags)} set the costs of a torch CSV; a pipeloom JSON "
                          "schedule carries its own task durations")
    costs = _costs(args)
    schedule = load_schedule(args.file, costs=costs)
    problem = schedule.problem
    if args.memory_limit is not None:  # overrides the limit a JSON file carries
        problem = dataclasses.replace(problem, memory_limit=args.memory_limit)
    schedule = dataclasses.replace(schedule, problem=problem)
    timeline = validate(schedule, ordered=not args.allow_unordered)
    return _emit(args, timeline, timeline_report(timeline, costs=costs if is_csv else None))


def _compare(names: Sequence[str], ranks: int, microbatches: int, costs: Costs,
             limit: float | None) -> tuple[list[dict], list[Timeline]]:
    """Build each schedule: rows as ``comparison_rows`` (a failure is a row with an ``error``) and
    the timelines built; raises when none could be built."""
    outcomes: list[tuple[str, Timeline | str]] = []
    for name in names:
        try:
            outcomes.append((name, _build(name, ranks, microbatches, costs, limit)))
        except ValueError as error:
            outcomes.append((name, _first_line(error)))
    rows = comparison_rows(outcomes, microbatches=microbatches, costs=costs)
    if all("error" in row for row in rows):
        reasons = "; ".join(f"{row['name']}: {row['error']}" for row in rows)
        raise PipeloomError(f"no schedule could be built ({reasons})")
    return rows, [outcome for _, outcome in outcomes if not isinstance(outcome, str)]


def _cmd_compare(args: argparse.Namespace) -> int:
    for name in args.names:
        _check_name(name)
        _check_size(name, args.ranks, args.microbatches)
    costs = _costs(args)
    rows, timelines = _compare(args.names, args.ranks, args.microbatches, costs, args.memory_limit)
    title = f"p={args.ranks}, m={args.microbatches}"
    if args.out:  # written first: a failed write leaves stdout empty
        from pipeloom import viz

        viz.draw_comparison(timelines, args.out, title=title)
    console = Console(stderr=args.json, highlight=False)
    if args.json:
        print(json.dumps({"num_ranks": args.ranks, "num_microbatches": args.microbatches,
                          "costs": dataclasses.asdict(costs), "memory_limit": args.memory_limit,
                          "schedules": rows}))
    else:
        print_comparison(console, rows, title)
    if args.out:
        console.print(f"wrote comparison figure {args.out}", markup=False, soft_wrap=True)
    return 0


def _search_problem(args: argparse.Namespace):
    """The problem ``pipeloom search`` works on: a catalog placement, or a problem file."""
    from pipeloom.search import PLACEMENTS, load_problem, placement

    if args.placement is None:
        flags = [flag for flag, on in (("--ranks", args.ranks), ("--split-backward", args.split_backward),
                                       ("--inference", args.inference)) if on]
        if flags:
            raise _UsageError(f"{', '.join(flags)} apply to --placement; a problem file has its own tasks")
        problem = load_problem(args.problem)
        return problem if args.comm is None else dataclasses.replace(problem, comm_latency=args.comm)
    if args.placement not in PLACEMENTS:
        raise _UsageError(f"unknown placement {args.placement!r}; choose one of: {', '.join(PLACEMENTS)}")
    if args.ranks is None:
        raise _UsageError("--placement needs --ranks D")
    return placement(args.placement, args.ranks, split_backward=args.split_backward,
                     inference=args.inference, memory_limit=args.memory_limit, comm_latency=args.comm or 0.0)


@contextlib.contextmanager
def _search_status(enabled: bool):
    """A transient stderr line (best, bound, gap) once a search has run 1 s; only on a terminal."""
    console = Console(stderr=True, highlight=False)
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


def _cmd_search(args: argparse.Namespace) -> int:
    from pipeloom.search import search

    problem = _search_problem(args)
    with _search_status(not args.json) as progress:
        result = search(problem, args.microbatches, mode=args.mode, memory_limit=args.memory_limit,
                        time_limit=args.time_limit, workers=args.workers, progress=progress)
    timeline = validate(result.schedule, ordered=True)
    report = {**timeline_report(timeline), "makespan": result.makespan, "lower_bound": result.lower_bound,
              "gap": result.gap, "status": result.status, "mode": result.mode, "period": result.period,
              "period_lower_bound": result.period_lower_bound, "search_seconds": result.seconds,
              "peak_memory": list(result.peak_memory)}
    return _emit(args, timeline, report, table=search_table)


def _cmd_demo(args: argparse.Namespace) -> int:
    from pipeloom import viz

    out: Path = args.out
    try:  # before anything is built
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _UsageError(f"--out {str(out)!r}: cannot create the folder ({error.strerror})") from None
    rows, timelines = _compare(DEMO_SCHEDULES, DEMO_RANKS, DEMO_MICROBATCHES, DEMO_COSTS, None)
    c = DEMO_COSTS
    title = (f"p={DEMO_RANKS}, m={DEMO_MICROBATCHES}, zero-bubble paper costs "
             f"(f={c.f:g}, b={c.b:g}, w={c.w:g}, comm={c.comm:g})")
    built = [row["name"] for row in rows if "error" not in row]  # aligned with timelines
    best = min(range(len(built)), key=lambda i: timelines[i].makespan)
    name = built[best]
    files = [(out / "compare.png", "comparison figure"),
             (out / f"timeline-{name}.png", f"timeline of the best schedule, {name}"),
             (out / f"trace-{name}.json", "its trace; open it in https://ui.perfetto.dev"),
             (out / "summary.md", "the table and the command that made it")]
    viz.draw_comparison(timelines, files[0][0], title=title)
    viz.draw_timeline(timelines[best], files[1][0], title=f"{name}: {title}")
    viz.write_trace(timelines[best], files[2][0])
    files[3][0].write_text(_summary_markdown(rows, title, out))
    console = Console(highlight=False)
    print_comparison(console, rows, title)
    console.print("Files:", markup=False, soft_wrap=True)
    for path, what in files:
        console.print(f"  {path}  ({what})", markup=False, soft_wrap=True)
    return 0


def _summary_markdown(rows: list[dict], title: str, out: Path) -> str:
    """The demo's table as Markdown, with the commands that reproduce it."""
    c, names = DEMO_COSTS, " ".join(row["name"] for row in rows)
    command = (f"pipeloom compare {names} --ranks {DEMO_RANKS} --microbatches {DEMO_MICROBATCHES} "
               f"--f {c.f:g} --b {c.b:g} --w {c.w:g} --comm {c.comm:g}")
    footer = [f"Made by `pipeloom demo --out {out}`, or:", "", "```", command, "```"]
    return compare_markdown(rows, heading="pipeloom demo", title=title, footer=footer)


# ---------------------------------------------------------------------------------------- main


def _first_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _fail(error: BaseException, status: int, verbose: bool) -> int:
    """Print one ``pipeloom: error:`` line; with --verbose also the rest (e.g. the step grid)."""
    extra = str(error).strip().splitlines()[1:]
    hint = " (add --verbose for details)" if extra and not verbose else ""
    print(f"pipeloom: error: {_first_line(error)}{hint}", file=sys.stderr)
    if verbose and extra:
        print("\n".join(extra), file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = None
    try:
        args = _parser().parse_args(argv)
        return args.handler(args)
    except _UsageError as error:
        return _fail(error, 2, getattr(args, "verbose", False))
    except (PipeloomError, ValueError, OSError) as error:
        return _fail(error, 1, getattr(args, "verbose", False))
    except MemoryError:
        error = MemoryError("out of memory; use fewer ranks, micro-batches or stages per rank")
        return _fail(error, 1, False)
