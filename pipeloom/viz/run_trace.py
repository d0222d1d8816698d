"""The runtime's per-rank trace files, as this module's old name: the format, reader and writers
moved to :mod:`pipeloom.trace` (issue 19); these names still import from here."""

from __future__ import annotations

from pipeloom.trace.format import (
    EVENT_KINDS,
    TRACE_FORMAT,
    RunTrace,
    StepTrace,
    TraceEvent,
    TraceFormatError,
    write_run_trace,
)
from pipeloom.trace.reader import load_run_trace, run_trace_from_documents
from pipeloom.trace.simulated import simulated_run_trace

__all__ = [
    "EVENT_KINDS",
    "TRACE_FORMAT",
    "RunTrace",
    "StepTrace",
    "TraceEvent",
    "TraceFormatError",
    "load_run_trace",
    "run_trace_from_documents",
    "simulated_run_trace",
    "write_run_trace",
]
