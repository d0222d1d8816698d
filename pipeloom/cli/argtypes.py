"""The argparse types the commands share: numbers in a range, counts, output file names. They check
while parsing, so before anything is built or printed; each command's module imports them from here."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import OutputPath
from pipeloom.errors import PipeloomError

__all__ = ["bytes_argument", "count", "memory_argument", "number", "path_with", "schedule_list", "sequence_length"]


def number(kind: type, words: str, minimum: float, maximum: float = math.inf) -> Callable[[str], float]:
    """An argparse type parsing ``kind`` and requiring a finite value in ``[minimum, maximum]``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}, got {text!r}")
        return value

    return parse


count = number(int, "a positive integer", 1)
"""An argparse type for a positive integer (ranks, micro-batches, workers...)."""


def sequence_length(text: str) -> int:
    """``--seq``: tokens per sequence, a positive integer or one with a K suffix counting 1,024 or an M suffix
    counting 1,024 K (``8k`` = 8,192, ``128K`` = 131,072, ``1M`` = 1,048,576, as context lengths are named)."""
    unit = {"k": 1024, "m": 1024**2}.get(text[-1:].lower(), 1)
    try:
        value = int(text[:-1] if unit > 1 else text) * unit
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive token count such as 8192, 8k or 1M, got {text!r}")
    return value


def path_with(*suffixes: str) -> Callable[[str], Path]:
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
        return OutputPath(text)

    return check


def schedule_list(text: str, choices: str | None = None, *, among: tuple[str, ...] | None = None) -> list[str]:
    """``--schedules``: built-in schedule names, comma-separated, in any case (as ``--layout schedule=`` takes them);
    UsageError naming the unknown ones, the name meant (among ``among``, default every built-in), and ``choices``
    (default: every built-in)."""
    from pipeloom.schedules import REGISTRY, meant_schedule

    given = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in given if name.lower() not in REGISTRY]
    if unknown or not given:
        meant = "".join(meant_schedule(name, among=among) for name in unknown[:1])
        raise UsageError(f"--schedules: unknown schedule(s) {unknown or [text]}{meant}; "
                         f"{choices or 'choose among: ' + ', '.join(REGISTRY)}")
    return [name.lower() for name in given]


def bytes_argument(text: str) -> float:
    """An argparse type for sizes such as ``80GiB``, ``512MiB``, ``16GB`` or a number of bytes."""
    from pipeloom.plan.costs.parts import parse_bytes

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    try:
        value = parse_bytes(text)
    except PipeloomError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def memory_argument(text: str) -> float:
    """:func:`bytes_argument` refusing a bare number below 1 MiB: a size whose unit was left out (80 for 80GiB)."""
    value = bytes_argument(text)
    try:
        bare = float(text)
    except ValueError:  # it has a unit
        return value
    if bare < 2**20:
        shown = f"{bare:.0f}" if bare.is_integer() else f"{bare:g}"  # 1e6 as 1000000, not 1e+06
        raise argparse.ArgumentTypeError(f"{text} is {shown} bytes; give a unit, e.g. {shown}"
                                         f"{'GiB' if bare <= 2**14 else 'MiB'}")
    return value
