"""Searches and plans of ``pipeloom serve`` in worker processes: at most ``workers`` run at once, at
most ``max_waiting`` wait; a job that is cancelled or runs past its limit has its process stopped, which
frees the worker at once. Processes fork from a forkserver that has imported the solver, so a job starts
in milliseconds and never inherits the server's threads."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pipeloom.serve.config import ServeConfig
from pipeloom.serve.errors import RequestError

__all__ = ["FINISHED", "Job", "Jobs"]

FINISHED = ("done", "failed", "cancelled", "timed_out")
"""The states a job ends in."""

_POLL_SECONDS = 0.05


@dataclass(kw_only=True)
class Job:
    """One search or plan and what is known of it (owned and updated by :class:`Jobs`)."""

    id: str
    """Its id in URLs."""
    kind: str
    """``search`` or ``plan``."""
    request: dict
    """The checked request."""
    seconds: float
    """Its own time limit; the worker is stopped ``job_grace_seconds`` later."""
    status: str = "queued"
    """``queued``, ``running``, then one of :data:`FINISHED`."""
    progress: dict | None = None
    """The latest progress report (a search's best, bound, phase)."""
    result: dict | None = None
    """The answer, once done."""
    error: str | None = None
    """Why it failed, was cancelled or timed out."""
    created: float = field(default_factory=time.time)
    """When it was submitted (Unix time)."""
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when it reaches a state of :data:`FINISHED`."""

    def public(self) -> dict:
        """Its JSON form in the API (without the result's files)."""
        result = None if self.result is None else {k: v for k, v in self.result.items() if k != "files"}
        return {"id": self.id, "kind": self.kind, "status": self.status, "progress": self.progress,
                "error": self.error, "result": result}


class Jobs:
    """The worker processes' queue and the finished jobs kept for download."""

    def __init__(self, config: ServeConfig) -> None:
        self._config = config
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["pipeloom.serve.work"])
        self._slots: asyncio.Semaphore | None = None
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._processes: dict[str, Any] = {}
        self._tasks: set[asyncio.Task] = set()
        self._waiting = 0

    def submit(self, kind: str, request: dict, seconds: float) -> Job:
        """Queue a job; RequestError 429 when ``max_waiting`` jobs already wait."""
        if self._waiting >= self._config.max_waiting:
            raise RequestError(f"{self._waiting} jobs are waiting for a worker, this server's limit; try again later",
                               429)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._config.workers)
        job = Job(id=uuid.uuid4().hex[:16], kind=kind, request=request, seconds=seconds)
        self._jobs[job.id] = job
        self._forget_old()
        self._waiting += 1
        task = asyncio.create_task(self._run(job, self._slots))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def get(self, job_id: str, kind: str) -> Job:
        """The job ``job_id`` of ``kind``; RequestError 404 when there is none."""
        job = self._jobs.get(job_id)
        if job is None or job.kind != kind:
            raise RequestError(f"no {kind} {job_id!r} on this server (finished ones are kept for the last "
                               f"{self._config.kept_results})", 404)
        return job

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: a waiting one never starts, a running one has its worker stopped now."""
        if job.status in FINISHED:
            return
        self._finish(job, "cancelled", "cancelled by the client")
        process = self._processes.get(job.id)
        if process is not None and process.is_alive():
            process.kill()

    async def warm(self) -> None:
        """Start the forkserver now (it imports the solver, a second or two) rather than on the first job."""
        from pipeloom.serve.work import ready

        process = self._context.Process(target=ready, daemon=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, process.start)
        await loop.run_in_executor(None, process.join, 60)

    async def close(self) -> None:
        """Stop every worker (the server is shutting down)."""
        for job in list(self._jobs.values()):
            self.cancel(job)
        for task in list(self._tasks):
            task.cancel()

    def _forget_old(self) -> None:
        finished = [job_id for job_id, job in self._jobs.items() if job.status in FINISHED]
        for job_id in finished[: max(0, len(finished) - self._config.kept_results)]:
            del self._jobs[job_id]

    def _finish(self, job: Job, status: str, error: str | None = None, result: dict | None = None) -> None:
        if job.status in FINISHED:
            return
        job.status, job.error, job.result = status, error, result
        job.finished.set()

    async def _run(self, job: Job, slots: asyncio.Semaphore) -> None:
        started = False
        try:
            async with slots:
                started = True
                self._waiting -= 1
                if job.status in FINISHED:  # cancelled while waiting
                    return
                await self._work(job)
        except BaseException:
            if not started:
                self._waiting -= 1
            self._finish(job, "failed", "the server stopped")
            raise

    async def _work(self, job: Job) -> None:
        from pipeloom.serve.work import run_job

        receiver, sender = self._context.Pipe(duplex=False)
        process = self._context.Process(target=run_job, args=(job.kind, job.request, job.id, sender), daemon=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, process.start)  # the first start launches the forkserver
        sender.close()
        self._processes[job.id] = process
        job.status = "running" if job.status == "queued" else job.status
        deadline = loop.time() + job.seconds + self._config.job_grace_seconds
        try:
            while job.status not in FINISHED:
                try:
                    while receiver.poll():
                        self._message(job, receiver.recv())
                except (EOFError, OSError):
                    if job.status not in FINISHED:
                        self._finish(job, "failed",
                                     f"the worker ended without an answer (exit code {process.exitcode})")
                    break
                if loop.time() > deadline:
                    self._finish(job, "timed_out", f"ran past its limit of {job.seconds:g} s and was stopped")
                    break
                await asyncio.sleep(_POLL_SECONDS)
        finally:
            if process.is_alive():
                process.kill()
            await loop.run_in_executor(None, process.join, 5)
            receiver.close()
            self._processes.pop(job.id, None)

    def _message(self, job: Job, message: tuple) -> None:
        kind, value = message
        if kind == "progress":
            job.progress = value
        elif kind == "done":
            self._finish(job, "done", result=value)
        else:
            self._finish(job, "failed", str(value))
