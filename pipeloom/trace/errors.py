"""Errors of reading and analysing run traces."""

from __future__ import annotations

from pipeloom.errors import PipeloomError

__all__ = ["StepSelectionError", "TraceFormatError"]


class TraceFormatError(PipeloomError):
    """A runtime trace file cannot be read, or the files given are not the complete trace of one run."""


class StepSelectionError(PipeloomError):
    """A step selection names a step the trace does not hold, or is not ``warm``/``all``/a list."""
