"""What a worker process runs for ``pipeloom serve``: one search or one plan, reporting progress and
its answer over a pipe as plain JSON values (the server never unpickles anything a client sent; the
pipe carries only what this module builds)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeloom.errors import PipeloomError
from pipeloom.ir import schedule_to_csv, schedule_to_json
from pipeloom.plan.costs.file import costs_from_json
from pipeloom.plan.mesh import plan_mesh
from pipeloom.search import placement, search
from pipeloom.validate import validate
from pipeloom.viz.html import timeline_data
from pipeloom.viz.report import timeline_report
from pipeloom.viz.units import PLAN_UNITS

__all__ = ["PROGRESS_SECONDS", "ready", "run_job"]

PROGRESS_SECONDS = 0.2
"""Least time between two progress messages of a search."""


def _files(schedule) -> dict[str, Any]:
    """The schedule as ``pipeloom.schedule/1`` text and torch CSV text (None where CSV cannot hold it)."""
    try:
        csv = schedule_to_csv(schedule)
    except PipeloomError:
        csv = None
    return {"json": schedule_to_json(schedule, indent=1) + "\n", "csv": csv}


def _search(request: dict, conn) -> dict:
    problem = placement(request["placement"], request["ranks"], split_backward=request["split_backward"],
                        memory_limit=request["memory_limit"], comm_latency=request["comm"], **request["costs"])
    last = [0.0]

    def progress(report) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_SECONDS:
            last[0] = now
            conn.send(("progress", {"seconds": report.seconds, "best": report.best, "bound": report.bound,
                                    "phase": report.phase}))

    result = search(problem, request["microbatches"], mode=request["mode"], memory_limit=request["memory_limit"],
                    time_limit=request["time_limit"], workers=1, progress=progress)
    timeline = validate(result.schedule, ordered=True)
    report = {**timeline_report(timeline), "makespan": result.makespan, "lower_bound": result.lower_bound,
              "gap": result.gap, "status": result.status, "mode": result.mode, "search_seconds": result.seconds,
              "origin": result.origin}
    return {"report": report, "view": timeline_data(timeline, title=f"search: {request['placement']}"),
            "files": _files(timeline.schedule)}


def _candidate(candidate) -> dict:
    return {"schedule": candidate.schedule, "schedule_options": candidate.schedule_options,
            "microbatches": candidate.microbatches, "step_time": candidate.step_time,
            "peak_memory": candidate.peak_memory, "fits": candidate.fits, "reason": candidate.reason,
            "data_parallel": candidate.data_parallel}


def _plan(request: dict, job_id: str) -> dict:
    tables = [costs_from_json(text) for text in request["costs"]]
    result = plan_mesh(tables, num_ranks=request["ranks"], global_batch=request["global_batch"],
                       memory_limit=request["memory_limit"], data_parallel=request["data_parallel"],
                       tensor_parallel=request["tensor_parallel"], sharding=request["sharding"],
                       schedules=request["schedules"], stages_per_rank=request["stages_per_rank"],
                       microbatches=request["microbatches"], search_time=request["search"])
    with tempfile.TemporaryDirectory(prefix="pipeloom-plan-") as folder:
        path = Path(folder) / f"{job_id}.json"  # the plan names a companion schedule <id>.schedule.json
        result.save(path)
        companion = path.with_name(f"{job_id}.schedule.json")
        plan_text = path.read_text(encoding="utf-8")
        schedule_text = companion.read_text(encoding="utf-8") if companion.exists() else None
    plan = result.plan
    title = (f"{plan.schedule}: p={plan.num_ranks}, m={plan.microbatches} x {plan.microbatch_size}, "
             f"predicted {plan.predicted_step_time:.4g} s")
    return {"plan": plan_text, "schedule_file": schedule_text, "seconds": result.seconds,
            "tried": len(result.candidates),
            "candidates": [_candidate(c) for c in result.candidates[:10]],
            "view": timeline_data(result.timeline, units=PLAN_UNITS, title=title), "files": _files(result.schedule)}


def ready() -> None:
    """Nothing: run once at start-up so the forkserver has imported the solver before the first job."""


def run_job(kind: str, request: dict, job_id: str, conn) -> None:
    """Run one ``search`` or ``plan`` job and send ``("done", answer)`` or ``("error", message)``."""
    try:
        answer = _search(request, conn) if kind == "search" else _plan(request, job_id)
        conn.send(("done", json.loads(json.dumps(answer))))  # plain JSON values only
    except PipeloomError as error:
        conn.send(("error", (str(error).strip().splitlines() or [type(error).__name__])[0]))
    except MemoryError:
        conn.send(("error", "out of memory; ask for fewer ranks or micro-batches"))
    except Exception as error:  # a defect: the client gets one line, not a dead worker
        conn.send(("error", f"internal error: {type(error).__name__}: {error}"))
    finally:
        conn.close()
