"""The runtime's measured traces: the per-rank file format ``pipeloom.runtime-trace/1`` (the engine
writes it, :mod:`~pipeloom.trace.reader` reads one run's files back) and its analysis (step and task
times, fitted latencies, the prediction from measured times and what it leaves out). No torch, no
matplotlib: the pictures of a trace are in :mod:`pipeloom.viz.measured`.
"""

from pipeloom.trace.analysis import (
    MESSAGE_KINDS,
    Comparison,
    Steps,
    comm_latency_estimate,
    compare_run,
    measured_step_time,
    measured_timeline,
    message_cost,
    predicted_timeline,
    recosted_schedule,
    selected_steps,
    step_times,
    task_durations,
    typical_step,
)
from pipeloom.trace.errors import StepSelectionError, TraceFormatError
from pipeloom.trace.explain import explain_ratio, rank_gaps
from pipeloom.trace.format import (
    EVENT_KINDS,
    TRACE_FORMAT,
    RunTrace,
    StepTrace,
    TraceEvent,
    step_record,
    trace_document,
    write_run_trace,
    write_trace_file,
)
from pipeloom.trace.reader import load_run_trace, run_trace_from_documents
from pipeloom.trace.simulated import simulated_run_trace
from pipeloom.trace.summary import trace_summary

__all__ = [
    "EVENT_KINDS",
    "MESSAGE_KINDS",
    "TRACE_FORMAT",
    "Comparison",
    "RunTrace",
    "StepSelectionError",
    "StepTrace",
    "Steps",
    "TraceEvent",
    "TraceFormatError",
    "comm_latency_estimate",
    "compare_run",
    "explain_ratio",
    "load_run_trace",
    "measured_step_time",
    "measured_timeline",
    "message_cost",
    "predicted_timeline",
    "rank_gaps",
    "recosted_schedule",
    "run_trace_from_documents",
    "selected_steps",
    "simulated_run_trace",
    "step_record",
    "step_times",
    "task_durations",
    "trace_document",
    "trace_summary",
    "typical_step",
    "write_run_trace",
    "write_trace_file",
]
