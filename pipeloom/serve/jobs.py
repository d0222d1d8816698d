"""Searches, plans and quick requests of ``pipeloom serve`` in worker processes: at most ``workers`` jobs
(searches, plans) run at once and ``max_waiting`` wait; at most ``quick_workers`` quick requests (simulate,
compare, downloads) compute at once and ``max_quick_waiting`` wait. Work that is cancelled or runs past its
limit has its process stopped, which stops the work and frees the worker at once; each process may add at
most ``worker_memory_bytes`` of address space (RLIMIT_AS). Processes fork from a forkserver that has
imported the solver, so one starts in milliseconds and never inherits the server's threads. Finished jobs
keep their answers as JSON text, bounded by count, bytes and age."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pipeloom.serve.config import ServeConfig
from pipeloom.serve.errors import RequestError
from pipeloom.serve.workers import Outcome, Worker

__all__ = ["FINISHED", "PRELOAD", "Job", "Jobs"]

PRELOAD = ("pipeloom.serve.work", "pipeloom.serve.requests", "pipeloom.viz.html", "pipeloom.viz.report", "matplotlib")
"""Modules the forkserver imports once (with every schedule generator's), so that a worker starts with them: a
quick request then takes tens of milliseconds, not the imports' half second (matplotlib: the view's colours)."""

FINISHED = ("done", "failed", "cancelled", "timed_out")
"""The states a job ends in."""


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
    result: str | None = None
    """The answer's JSON text (a JSON object, without the files), once done."""
    files: dict[str, str | None] = field(default_factory=dict)
    """The answer's files as text (``json``, ``csv``, a plan's ``plan`` and ``schedule_file``), once done."""
    error: str | None = None
    """Why it failed, was cancelled or timed out."""
    error_status: int = 422
    """The HTTP status of that refusal."""
    created: float = field(default_factory=time.time)
    """When it was submitted (Unix time)."""
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when it reaches a state of :data:`FINISHED`."""
    ended: float = 0.0
    """When it finished (``time.monotonic()``)."""

    @property
    def size(self) -> int:
        """Characters of text it keeps (its answer and files)."""
        return len(self.result or "") + sum(len(text or "") for text in self.files.values())

    def public(self) -> str:
        """Its JSON form in the API (without the result's files), as text: the kept answer is spliced in, never
        parsed again."""
        head = json.dumps({"id": self.id, "kind": self.kind, "status": self.status, "progress": self.progress,
                           "error": self.error})
        return f'{head[:-1]}, "result": {self.result or "null"}}}'



class Jobs:
    """The worker processes' queue and the finished jobs kept for download."""

    def __init__(self, config: ServeConfig) -> None:
        self._config = config
        self._context = multiprocessing.get_context("forkserver")
        from pipeloom.schedules import REGISTRY

        generators = {f"pipeloom.schedules.{info.module}" for info in REGISTRY.values()}
        self._context.set_forkserver_preload([*PRELOAD, *sorted(generators)])
        self._slots: asyncio.Semaphore | None = None
        self._quick: asyncio.Semaphore | None = None
        self._quick_waiting = 0
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._workers: dict[str, Worker] = {}
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

    async def quick(self, kind: str, request: Any) -> str:
        """The JSON text answering a quick request (``simulate``, ``compare``, ``schedule_file``) computed in a
        worker process: RequestError 429 when ``max_quick_waiting`` already wait, 503 when no worker is free within
        ``request_seconds``, 504 past it (the process is stopped), the worker's own refusal otherwise."""
        config = self._config
        if self._quick_waiting >= config.max_quick_waiting:
            raise RequestError(f"{self._quick_waiting} requests are waiting for a worker, this server's limit; "
                               "try again later", 429)
        if self._quick is None:
            self._quick = asyncio.Semaphore(config.quick_workers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.request_seconds
        self._quick_waiting += 1
        try:  # wait for a slot, never past the deadline (one granted as the wait ends is given back, not leaked)
            acquire = asyncio.ensure_future(self._quick.acquire())
            await asyncio.wait({acquire}, timeout=config.request_seconds)
            if not acquire.done() or loop.time() >= deadline:  # it never ran: the server is busy, not the request big
                if acquire.done():  # granted as the wait ended, with no time left to run in
                    self._quick.release()
                acquire.cancel()
                raise RequestError(f"no worker was free within this server's limit of {config.request_seconds:g} s "
                                   "(the server is busy); try again later", 503)
        finally:
            self._quick_waiting -= 1
        try:
            worker = Worker(self._context, kind, request, job_id=kind, memory_bytes=config.worker_memory_bytes)
            await worker.start()
            outcome = await worker.outcome(max(0.0, deadline - loop.time()))
        finally:
            self._quick.release()
        if outcome.kind == "done":
            return outcome.value["public"]
        if outcome.kind == "timeout":
            raise _timed_out(config)
        status, message = self._failure(outcome)
        raise RequestError(message, status)

    def get(self, job_id: str, kind: str) -> Job:
        """The job ``job_id`` of ``kind``; RequestError 404 when there is none."""
        self._forget_old()
        job = self._jobs.get(job_id)
        if job is None or job.kind != kind:
            raise RequestError(f"no {kind} {job_id!r} on this server (finished ones are kept for the last "
                               f"{self._config.kept_results}, at most {self._config.kept_bytes:,} bytes in all, "
                               f"for {self._config.kept_seconds:g} s)", 404)
        return job

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: a waiting one never starts, a running one has its worker stopped now."""
        if job.status in FINISHED:
            return
        self._finish(job, "cancelled", "cancelled by the client")
        worker = self._workers.get(job.id)
        if worker is not None:
            worker.kill()

    @property
    def kept_bytes(self) -> int:
        """Characters of text the finished jobs keep."""
        return sum(job.size for job in self._jobs.values())

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
        """Drop finished jobs past ``kept_seconds``, then the oldest past ``kept_results`` or ``kept_bytes``."""
        config, now = self._config, time.monotonic()
        finished = [job for job in self._jobs.values() if job.status in FINISHED]
        total = sum(job.size for job in finished)
        for k, job in enumerate(finished):
            if now - job.ended <= config.kept_seconds and len(finished) - k <= config.kept_results \
                    and total <= config.kept_bytes:
                break
            total -= job.size
            del self._jobs[job.id]

    def _finish(self, job: Job, status: str, error: str | None = None, answer: dict | None = None,
                error_status: int = 422) -> None:
        if job.status in FINISHED:
            return
        job.status, job.error, job.error_status, job.ended = status, error, error_status, time.monotonic()
        if answer is not None:
            job.result, job.files = answer["public"], answer["files"]
        job.finished.set()
        self._forget_old()

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
            self._finish(job, "failed", "the server stopped", error_status=503)
            raise

    async def _work(self, job: Job) -> None:
        worker = Worker(self._context, job.kind, job.request, job_id=job.id,
                        memory_bytes=self._config.worker_memory_bytes)
        self._workers[job.id] = worker
        try:
            await worker.start()
            job.status = "running" if job.status == "queued" else job.status

            def progress(value: Any) -> None:
                job.progress = value

            outcome = await worker.outcome(job.seconds + self._config.job_grace_seconds, progress)
        finally:
            self._workers.pop(job.id, None)
        if outcome.kind == "done":
            self._finish(job, "done", answer=outcome.value)
        elif outcome.kind == "timeout":
            self._finish(job, "timed_out", f"ran past its limit of {job.seconds:g} s and was stopped",
                         error_status=504)
        elif outcome.kind != "cancelled":
            status, message = self._failure(outcome)
            self._finish(job, "failed", message, error_status=status)

    def _failure(self, outcome: Outcome) -> tuple[int, str]:
        """The status and message of a worker's refusal or death."""
        if outcome.kind == "error":
            return int(outcome.value["status"]), str(outcome.value["message"])
        if outcome.kind == "cancelled":
            return 503, "cancelled: the server is stopping"
        return 507, (f"the worker ended without an answer (exit code {outcome.value}); it may have needed more "
                     f"than this server's memory limit of {self._config.worker_memory_bytes / 2**20:,.0f} MiB")


def _timed_out(config: ServeConfig) -> RequestError:
    return RequestError(f"the request took more than this server's limit of {config.request_seconds:g} s and was "
                        "stopped; ask for fewer ranks or micro-batches", 504)
