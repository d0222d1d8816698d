"""The ``pipeloom`` command line, a thin layer over the library: list, show, simulate, compare, demo,
search.

Every bad input ends as one line ``pipeloom: error: ...`` on stderr and a non-zero exit status
(2 for usage errors, 1 for the rest); the library's exceptions carry the message. A reader closing
the pipe early (``pipeloom list | head -1``) ends the command quietly with status 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pipeloom.cli.common import first_line
from pipeloom.cli.demo import DEMO_COSTS, DEMO_MICROBATCHES, DEMO_RANKS, DEMO_SCHEDULES
from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import StagedOutputs
from pipeloom.cli.parser import build_parser
from pipeloom.cli.schedules import MAX_ACTIONS
from pipeloom.errors import PipeloomError

__all__ = ["main", "DEMO_COSTS", "DEMO_RANKS", "DEMO_MICROBATCHES", "DEMO_SCHEDULES", "MAX_ACTIONS"]


def _fail(error: BaseException, status: int, verbose: bool) -> int:
    """Print one ``pipeloom: error:`` line; with --verbose also the rest (e.g. the step grid)."""
    extra = str(error).strip().splitlines()[1:]
    hint = " (add --verbose for details)" if extra and not verbose else ""
    print(f"pipeloom: error: {first_line(error)}{hint}", file=sys.stderr)
    if verbose and extra:
        print("\n".join(extra), file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = None
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "width", None) is not None and not getattr(args, "terminal", False):  # had drawn nothing
            raise UsageError("--width sets the --terminal view's width: add --terminal, or drop --width")
        with StagedOutputs.of(args) as outputs:  # each output proven writable now, renamed in at the end
            args.outputs = outputs
            status = args.handler(args)
            if status:
                outputs.discard()
            return status
    except BrokenPipeError:  # the reader went away (`pipeloom list | head -1`): not an error of ours
        _silence_stdout()
        return 0
    except UsageError as error:
        return _fail(error, 2, getattr(args, "verbose", False))
    except (PipeloomError, ValueError, OSError) as error:
        return _fail(error, 1, getattr(args, "verbose", False))
    except MemoryError:
        short = MemoryError("out of memory; use fewer ranks, micro-batches or stages per rank")
        return _fail(short, 1, False)


def _silence_stdout() -> None:
    """Point stdout at the null device, so the interpreter's flush at exit does not fail again."""
    import os

    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file behind stdout (a test's stand-in)
        pass
