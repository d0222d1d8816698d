"""The files a command writes, all or none, and the console its report is printed on (:func:`report_console`).

Every output path a command was given (``--save``, ``-o``, ``--perfetto``, ``--png``: the flags parsed by
``_path_with``, whose values are :class:`OutputPath`) gets a temporary file in its own folder before
the command does any work, which proves the folder writable and fails at once with one line naming
the path. The command writes into the temporary files; when it ends well they are renamed over the
real names (``os.replace``, atomic within a folder), and when anything fails they are removed, so a
failure leaves no output half-written and none written. A report whose reader goes away (``| head -1``) is not a
failure: the commands write their files before their report, so those written are kept and the empty ones removed.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from pipeloom.cli.errors import UsageError

__all__ = ["OutputPath", "PIPED_WIDTH", "StagedOutputs", "report_console", "target"]


if TYPE_CHECKING:
    from rich.console import Console

    _ConcretePath = Path
else:
    _ConcretePath = type(Path())  # PosixPath or WindowsPath: Python < 3.12 cannot subclass Path itself


class OutputPath(_ConcretePath):  # the concrete Path class of this platform
    """A path the command writes (set by the parser's output-path type)."""


class StagedOutputs:
    """Temporary files for a command's outputs, renamed over them at the end (see the module doc)."""

    def __init__(self, finals: list[Path]) -> None:
        self._temps: dict[Path, Path] = {}
        try:
            for final in finals:
                folder = final.parent if str(final.parent) else Path(".")
                handle, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=final.suffix, dir=folder)
                os.close(handle)
                self._temps[final] = Path(name)
        except OSError as error:
            self.discard()
            raise UsageError(f"cannot write {str(final)!r}: {error.strerror or error}; choose a folder you can "
                             "write in") from None

    @classmethod
    def of(cls, args: argparse.Namespace) -> StagedOutputs:
        """The outputs among the parsed arguments; UsageError where two name one file (the second would overwrite
        the first: ``--save same.json --perfetto same.json`` had kept only the trace, without a word)."""
        given = [(dest, value) for dest, value in vars(args).items() if isinstance(value, OutputPath)]
        seen: dict[str, str] = {}
        for dest, value in given:
            where = os.path.normcase(os.path.abspath(value))
            if where in seen:
                raise UsageError(f"--{seen[where].replace('_', '-')} and --{dest.replace('_', '-')} both write "
                                 f"{str(value)!r}; give each output a file of its own")
            seen[where] = dest
        return cls([value for _, value in given])

    def path(self, final: Path) -> Path:
        """Where to write ``final`` now (its temporary file)."""
        return self._temps[final]

    def direct(self, final: Path) -> Path:
        """Write ``final`` under its own name (for a writer that names companion files after it); its
        temporary file, which proved the folder writable, goes. Write such a file last."""
        temp = self._temps.pop(final, None)
        if temp is not None:
            temp.unlink(missing_ok=True)
        return final

    def commit(self) -> None:
        """Rename every temporary file over its real name, with the usual permissions of a new file."""
        mask = os.umask(0)
        os.umask(mask)
        for final, temp in self._temps.items():
            os.chmod(temp, 0o666 & ~mask)
            os.replace(temp, final)
        self._temps.clear()

    def discard(self) -> None:
        """Remove every temporary file."""
        for temp in self._temps.values():
            temp.unlink(missing_ok=True)
        self._temps.clear()

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is BrokenPipeError:  # the report's reader went away (`| head -1`): the files it followed stay
            for final, temp in list(self._temps.items()):
                if temp.stat().st_size == 0:  # never written: the command stopped before it
                    temp.unlink(missing_ok=True)
                    del self._temps[final]
            self.commit()
        elif kind is None:
            self.commit()
        else:
            self.discard()


def target(args: argparse.Namespace, final: Path) -> Path:
    """Where a command writes output ``final``: its temporary file while ``main`` stages the outputs."""
    outputs = getattr(args, "outputs", None)
    return outputs.path(final) if outputs is not None else final


PIPED_WIDTH = 160
"""Columns of a report printed to a pipe or a file: rich's 80 (without ``COLUMNS``) cut the tables' numbers to
``0.002…``, the figures a script reads."""


def report_console(*, stderr: bool = False) -> Console:
    """A rich console for a command's report on stdout (``stderr``: on stderr, as under ``--json``), as wide as the
    terminal, or :data:`PIPED_WIDTH` columns where the stream is none and ``COLUMNS`` does not say."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich exits 1 there, which dropped the files: main's own handling
            raise BrokenPipeError("the report's reader went away")

    console = _Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPED_WIDTH
    return console
