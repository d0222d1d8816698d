"""What a worker process runs for ``pipeloom serve``: one search, one plan or one quick request (simulate,
compare, a schedule file), under a memory limit, reporting progress and its answer over a pipe as JSON
text and plain values (the server never unpickles anything a client sent; the pipe carries only what this
module builds)."""

from __future__ import annotations

import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeloom.errors import PipeloomError
from pipeloom.ir import schedule_to_csv, schedule_to_json
from pipeloom.plan.costs.file import costs_from_json
from pipeloom.plan.mesh import plan_mesh
from pipeloom.search import placement, search
from pipeloom.serve import requests as api
from pipeloom.serve.errors import WorkError
from pipeloom.validate import validate
from pipeloom.viz.html import timeline_data
from pipeloom.viz.report import timeline_report
from pipeloom.viz.units import PLAN_UNITS

__all__ = ["PROGRESS_SECONDS", "ready", "run_job"]

PROGRESS_SECONDS = 0.2
"""Least time between two progress messages of a search."""


def _files(schedule) -> dict[str, Any]:
    """The schedule as ``pipeloom.schedule/1`` text and torch CSV text (None where CSV cannot hold it, and
    ``csv_refused`` says why)."""
    try:
        csv, refused = schedule_to_csv(schedule), None
    except PipeloomError as error:
        csv, refused = None, str(error)
    return {"json": schedule_to_json(schedule, indent=1) + "\n", "csv": csv, "csv_refused": refused}


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
    public = {"report": report, "view": timeline_data(timeline, title=f"search: {request['placement']}")}
    return {"public": json.dumps(public), "files": _files(timeline.schedule)}


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
    files = _files(result.schedule)
    public = {"plan": json.loads(plan_text), "seconds": result.seconds, "tried": len(result.candidates),
              "candidates": [_candidate(c) for c in result.candidates[:10]],
              "view": timeline_data(result.timeline, units=PLAN_UNITS, title=title),
              "schedule": json.loads(files["json"])}
    return {"public": json.dumps(public), "files": {**files, "plan": plan_text, "schedule_file": schedule_text}}


_CHECKS = {"check_search": api.search_request, "check_plan": api.plan_request}
"""The request checks that run in a worker (a cost table of 10,000 pieces takes a second or two to read: in a
thread of the server it would slow every other request through the GIL)."""


def _quick(kind: str, request: dict) -> dict:
    """A quick request's answer: ``public`` is its JSON text (a schedule file's text for ``schedule_file``; the
    checked request for ``check_search`` and ``check_plan``)."""
    config = request["config"]
    if kind in _CHECKS:
        return {"public": json.dumps(_CHECKS[kind](request["document"], config)), "files": {}}
    if kind == "simulate":
        return {"public": json.dumps(api.simulate(request["document"], config)), "files": {}}
    if kind == "compare":
        return {"public": json.dumps(api.compare(request["document"], config)), "files": {}}
    assert kind == "schedule_file", kind
    return {"public": api.schedule_file(request["name"], request["format"], request["document"], config),
            "files": {}}


def _limit_memory(extra: int) -> None:
    """Let this process grow its address space by at most ``extra`` bytes (RLIMIT_AS over what it maps now:
    the forkserver's imports already map a few hundred MB); past it allocations raise MemoryError."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
    except OSError:  # not Linux: no /proc, no limit of this kind
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = mapped + extra if hard == resource.RLIM_INFINITY else min(hard, mapped + extra)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def ready() -> None:
    """Nothing: run once at start-up so the forkserver has imported the solver before the first job."""


def _refusal(status: int, message: str) -> tuple[str, dict]:
    return "error", {"status": status, "message": message}


def run_job(kind: str, request: dict, job_id: str, conn, memory_bytes: int) -> None:
    """Run one ``search``, ``plan`` or quick request with at most ``memory_bytes`` more address space; send
    ``("done", {"public": JSON text, "files": {name: text}})`` or ``("error", {"status", "message"})``."""
    try:
        _limit_memory(memory_bytes)
        if kind == "search":
            answer = _search(request, conn)
        elif kind == "plan":
            answer = _plan(request, job_id)
        else:
            answer = _quick(kind, request)
        message: tuple[str, Any] = ("done", answer)
    except WorkError as error:
        message = _refusal(error.status, (str(error).strip().splitlines() or [type(error).__name__])[0])
    except PipeloomError as error:
        message = _refusal(422, (str(error).strip().splitlines() or [type(error).__name__])[0])
    except MemoryError:
        message = _refusal(507, f"the request needed more than this server's memory limit of "
                                f"{memory_bytes / 2**20:,.0f} MiB per worker; ask for fewer ranks or micro-batches")
    except Exception as error:  # a defect: the client gets one line, not a dead worker
        message = _refusal(500, f"internal error: {type(error).__name__}: {error}")
    try:
        conn.send(message)
    except MemoryError:
        conn.send(_refusal(507, "the answer needed more than this server's memory limit per worker"))
    finally:
        conn.close()
