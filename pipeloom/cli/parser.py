"""The argparse definitions of ``pipeloom`` and the checks on single arguments (numbers, output
file names) that run while parsing, so before anything is built or printed."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from pipeloom.cli.argtypes import count, number, path_with
from pipeloom.cli.demo import cmd_demo
from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import OutputPath
from pipeloom.cli.plan import add_plan_parser
from pipeloom.cli.profile import add_profile_parser
from pipeloom.cli.schedules import ACTIVATIONS, cmd_compare, cmd_list, cmd_show, cmd_simulate
from pipeloom.cli.search import cmd_search
from pipeloom.cli.serve import add_serve_parser
from pipeloom.cli.trace import cmd_trace

__all__ = ["COST_HELP", "build_parser"]

COST_HELP = (
    "Costs are per micro-batch for ONE RANK'S SHARE of the model (a stage of the 1F1B layout): "
    "--f forward, --b input-gradient backward (I), --w weight-gradient backward (W). Schedules "
    "that do not split the backward run one B costing b+w; schedules with v stages per rank give "
    "each stage 1/v of the costs, so every schedule runs the same model. Defaults: f=b=w=1, comm=0. "
    "An overlapped pair (DualPipe's F&B) costs F + B less the communication each part hides "
    "(--f-comm/--b-comm), unless --overlap or --pair-time says otherwise."
)


_NEGATIVE = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[A-Za-z]*$")
"""A negative number, with an exponent or a unit or neither: no option of ``pipeloom`` looks like one."""


class _StoreOnce(argparse._StoreAction):
    """argparse's store, refusing an output file's option given twice (``-o a.png -o b.png`` had written only
    b.png, without a word)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, None)
        if isinstance(values, OutputPath) and isinstance(earlier, OutputPath):
            raise UsageError(f"{option_string} is given twice ({str(earlier)!r} and {str(values)!r}) and writes one "
                             "file; give it once")
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors become one-line ``UsageError``s instead of usage dumps, and which reads a
    negative number with a unit (``--memory-limit -5GiB``) as a value, so its type says what is wrong with it
    (argparse's own rule takes only bare numbers, and reported "expected one argument")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but arguments no option takes point to their command's help, not the top level's."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            self.prog = f"{self.prog} {command}" if command else self.prog
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


# ------------------------------------------------------------------------------ argument types


_cost = number(float, "a finite number >= 0", 0)
_fraction = number(float, "a number between 0 and 1", 0, 1)


def _microbatch_limit(command: str, units: str):
    """The argparse type of ``--memory-limit`` in ``command``, which counts ``units`` (activations
    of micro-batches, not bytes): a size like ``80GiB`` is refused with a pointer to ``pipeloom plan``,
    whose ``--memory-limit`` is bytes."""
    plain = number(float, f"a finite number >= 0 of {units}", 0)

    def parse(text: str) -> float:
        try:
            return plain(text)
        except argparse.ArgumentTypeError:
            if _SIZE.match(text):
                raise argparse.ArgumentTypeError(
                    f"{text!r} is a size in bytes, but `pipeloom {command}` counts its limit in {units} "
                    "(e.g. 4); for a limit in bytes plan with `pipeloom plan --memory-limit 80GiB`") from None
            raise

    return parse


_SIZE = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*(?:[KMGT]i?B|B)\s*$", re.IGNORECASE)
"""A byte size as ``pipeloom plan`` reads one (``80GiB``, ``512 MB``, ``1e9B``)."""
MAX_TERMINAL_WIDTH = 10_000
"""Columns of the ``--terminal`` view at most (a wider view cannot be read and costs memory per column)."""
_width = number(int, "a positive integer", 1, MAX_TERMINAL_WIDTH)


# ---------------------------------------------------------------------------------- the parser


def _add_costs(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group("costs", COST_HELP)
    group.add_argument("--f", type=_cost, metavar="F", help="forward time (default 1)")
    group.add_argument("--b", type=_cost, metavar="B", help="input-gradient backward time (default 1)")
    group.add_argument("--w", type=_cost, metavar="W", help="weight-gradient backward time (default 1)")
    group.add_argument("--comm", type=_cost, metavar="C", help="latency between ranks (default 0)")
    group.add_argument("--f-comm", type=_cost, metavar="C",
                       help="part of --f spent on communication inside the forward (e.g. an MoE all-to-all), "
                            "which an overlapped pair (DualPipe's F&B) hides under the other part's compute")
    group.add_argument("--b-comm", type=_cost, metavar="C", help="part of --b spent on communication, as --f-comm")
    group.add_argument("--overlap", type=_fraction, metavar="X",
                       help="share of an overlapped pair's shorter part run at once with the longer (0..1; default "
                            "0: one device runs F then B, so F + B less the communication it hides; 1: max(F, B))")
    group.add_argument("--pair-time", type=_cost, metavar="T",
                       help="a measured time of one overlapped pair (stage costs), used instead of the formula")
    group.add_argument("--memory-limit", type=_microbatch_limit(command, ACTIVATIONS), metavar="L",
                       help="per-rank cap on held activations, counted in MICRO-BATCHES of one rank's share "
                            "(a forward holds 1 until its backward; not bytes: `pipeloom plan` takes bytes)")


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("outputs")
    group.add_argument("-o", "--out", type=path_with(".png", ".svg", ".html"),
                       help="timeline picture (.png/.svg), or an interactive view (.html: one self-contained file)")
    group.add_argument("--perfetto", "--trace", dest="perfetto", type=path_with(".json"),
                       help="the timeline as a Perfetto/Chrome file (.json; --trace is its first name)")
    group.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    group.add_argument("--terminal", action="store_true", help="draw the timeline in the terminal")
    group.add_argument("--width", type=_width, help="width of the --terminal view (default: terminal width)")


def _add_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", "-p", type=count, required=True, metavar="P", help="number of ranks")
    parser.add_argument("--microbatches", "-m", type=count, required=True, metavar="M",
                        help="number of micro-batches (real ones; two-replica schedules pair them)")


def _version() -> str:
    from pipeloom import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``pipeloom`` parser; each command sets ``handler``, a function of the parsed arguments
    returning the exit status."""
    parser = _Parser(
        prog="pipeloom",
        description="Build, search, validate, simulate, compare and draw pipeline-parallel schedules; "
                    "profile a model, plan its pipeline, and compare measured runs with predictions.",
        epilog=COST_HELP,
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="print full error details")
    parser.add_argument("--version", action="version", version=f"pipeloom {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    listing = commands.add_parser("list", help="list the built-in schedules and placements")
    listing.add_argument("--json", action="store_true", help="print one JSON object")
    listing.set_defaults(handler=cmd_list)

    show = commands.add_parser("show", help="build one schedule, check it, report and draw it",
                               epilog=COST_HELP)
    show.add_argument("name", metavar="NAME", help="schedule name (see `pipeloom list`)")
    _add_shape(show)
    show.add_argument("--stages-per-rank", type=count, metavar="V",
                      help="stages per rank, for schedules that take it (e.g. interleaved-1f1b)")
    show.add_argument("--with-comms", action="store_true",
                      help="lower the schedule first: add the send/receive actions (1SEND_F0, 2RECV_B3, "
                           "...), simulate their time (--comm per message) and draw them; --save then needs "
                           ".csv (torch compute_comms)")
    _add_costs(show, "show")
    _add_outputs(show)
    show.add_argument("--save", type=path_with(".json", ".csv"),
                      help="save the schedule: pipeloom JSON (.json) or torch CSV (.csv; compute_comms "
                           "with --with-comms)")
    show.set_defaults(handler=cmd_show)

    sim = commands.add_parser("simulate", help="check and simulate a saved schedule (JSON or torch CSV)",
                              epilog=COST_HELP + " The cost flags apply to CSV files only.")
    sim.add_argument("file", type=Path, metavar="FILE", help="a pipeloom .json or torch .csv schedule")
    sim.add_argument("--allow-unordered", action="store_true",
                     help="accept B/W of a stage out of micro-batch order (not exact in the runtime)")
    _add_costs(sim, "simulate")
    _add_outputs(sim)
    sim.set_defaults(handler=cmd_simulate)

    compare = commands.add_parser("compare", help="compare schedules side by side", epilog=COST_HELP)
    compare.add_argument("names", nargs="+", metavar="NAME", help="schedule names (see `pipeloom list`)")
    _add_shape(compare)
    _add_costs(compare, "compare")
    compare.add_argument("-o", "--out", type=path_with(".png", ".svg", ".html"),
                         help="comparison figure (.png/.svg), or an interactive view of every timeline (.html)")
    compare.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    compare.set_defaults(handler=cmd_compare)

    demo = commands.add_parser("demo", help="compare the main schedules on the zero-bubble paper's costs")
    demo.add_argument("--out", type=Path, default=Path("demo-output"),
                      help="output folder (default demo-output)")
    demo.set_defaults(handler=cmd_demo)
    _add_search(commands)
    add_plan_parser(commands)
    add_profile_parser(commands)
    _add_trace(commands)
    add_serve_parser(commands)
    for command in commands.choices.values():  # global flags are accepted after the command too
        command.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS,
                             help="print full error details (also before the command)")
    return parser


def _add_search(commands: argparse._SubParsersAction) -> None:
    search = commands.add_parser("search", help="search the fastest schedule of a placement or task graph",
                                 description="Search a schedule with CP-SAT (see docs/search.md).")
    source = search.add_mutually_exclusive_group(required=True)
    source.add_argument("--placement", metavar="NAME", help="a catalog placement (see `pipeloom list`)")
    source.add_argument("--problem", type=Path, metavar="FILE", help="a problem JSON file (docs/search.md)")
    search.add_argument("--ranks", "-p", type=count, metavar="D", help="number of ranks (with --placement)")
    search.add_argument("--microbatches", "-m", type=count, required=True, metavar="M",
                        help="number of micro-batches")
    search.add_argument("--memory-limit", type=_microbatch_limit(
                            "search", "the problem's memory units (micro-batches of activations for a placement)"),
                        metavar="L", help="per-rank cap on held memory in the problem's own units: MICRO-BATCHES "
                        "of activations for a placement (a forward holds 1), the tasks' memory units for a "
                        "problem file (overrides its memory_limit); not bytes: `pipeloom plan` takes bytes")
    search.add_argument("--time-limit", type=number(float, "a number of seconds >= 0.01", 0.01),
                        default=30.0, metavar="S", help="search time limit in seconds (default 30)")
    search.add_argument("--mode", choices=("auto", "exact", "periodic"), default="auto",
                        help="exact model, periodic (repetend) model, or auto by size (default)")
    search.add_argument("--workers", type=count, default=2, help="CP-SAT worker threads (default 2)")
    search.add_argument("--split-backward", action="store_true", help="split B into I and W (placements)")
    search.add_argument("--inference", action="store_true", help="forward only, memory 0 (placements)")
    search.add_argument("--comm", type=_cost, metavar="C", help="latency between rank sets (default 0)")
    shares = search.add_argument_group(
        "placement costs", "Per-micro-batch costs of one rank's share (--placement only; default: the "
        "placement's own). Classic placements spread them over their stages like `show`; Tessel ones give "
        "them to every single-rank block (F = f, B = b + w, or I = b and W = w with --split-backward).")
    shares.add_argument("--f", type=_cost, metavar="F", help="forward time")
    shares.add_argument("--b", type=_cost, metavar="B", help="input-gradient backward time (I)")
    shares.add_argument("--w", type=_cost, metavar="W", help="weight-gradient backward time (W)")
    shares.add_argument("--w-memory", type=_cost, metavar="S",
                        help="memory W releases, of the 1 unit a forward takes (needs --split-backward)")
    _add_outputs(search)
    search.add_argument("--save", type=path_with(".json", ".csv"),
                        help="save the schedule: pipeloom JSON (.json) or torch compute-only CSV (.csv)")
    search.set_defaults(handler=cmd_search)


def _add_trace(commands: argparse._SubParsersAction) -> None:
    trace = commands.add_parser("trace", help="compare a run's measured step with the simulator's prediction",
                                description="Read the per-rank trace files of one run (engine trace=FOLDER) "
                                            "and compare them with the schedule simulated on the measured "
                                            "task times (see docs/trace.md).")
    trace.add_argument("paths", nargs="+", type=Path, metavar="FOLDER_OR_FILE",
                       help="the run's trace folder, or its rank*.json files")
    trace.add_argument("-o", "--out", type=path_with(".json"),
                       help="merged Perfetto trace, measured and predicted side by side (.json; here -o is "
                            "the trace, the picture is --png)")
    trace.add_argument("--png", type=path_with(".png", ".svg"),
                       help="picture: measured step above predicted on one time axis (.png/.svg)")
    trace.add_argument("--steps", choices=("warm", "all"), default="warm",
                       help="steps to measure: all but the first (warm, default) or all")
    trace.add_argument("--step", type=int, metavar="N", help="step to show (default: the median one)")
    trace.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    trace.set_defaults(handler=cmd_trace)
