"""One worker process of ``pipeloom serve``: started from the forkserver, watched from the event loop until it
answers, fails, or passes its deadline, and then stopped (SIGKILL), so no work outlives its request. The
pipe carries only plain values that :mod:`pipeloom.serve.work` builds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Outcome", "Worker"]

_POLL_SECONDS = 0.02


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """How a worker ended."""

    kind: str
    """``done`` (``value`` is the answer), ``error`` (``value`` is ``{"status", "message"}``), ``timeout`` (it
    passed its deadline and was stopped), ``cancelled`` (stopped by :meth:`Worker.kill`) or ``died`` (it ended
    without an answer; ``value`` is its exit code)."""
    value: Any = None
    """The answer, the refusal, or the exit code."""


class Worker:
    """A process running :func:`pipeloom.serve.work.run_job` for one job or request."""

    def __init__(self, context: Any, kind: str, request: Any, *, job_id: str, memory_bytes: int) -> None:
        from pipeloom.serve.work import run_job

        self._receiver, self._sender = context.Pipe(duplex=False)
        self._process = context.Process(target=run_job, args=(kind, request, job_id, self._sender, memory_bytes),
                                        daemon=True)
        self._killed = False

    async def start(self) -> None:
        """Start the process (the first start launches the forkserver: off the event loop)."""
        await asyncio.get_running_loop().run_in_executor(None, self._process.start)
        self._sender.close()

    def kill(self) -> None:
        """Stop the process now (its work stops with it)."""
        self._killed = True
        if self._process.is_alive():
            self._process.kill()

    async def outcome(self, seconds: float, progress: Callable[[Any], None] | None = None) -> Outcome:
        """Wait for the answer at most ``seconds``; the process is stopped and reaped before this returns."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        try:
            while True:
                if self._killed:
                    return Outcome(kind="cancelled")
                try:
                    while self._receiver.poll():
                        kind, value = self._receiver.recv()
                        if kind != "progress":
                            return Outcome(kind=kind, value=value)
                        if progress is not None:
                            progress(value)
                except (EOFError, OSError):
                    await loop.run_in_executor(None, self._process.join, 5)
                    return Outcome(kind="died", value=self._process.exitcode)
                if loop.time() > deadline:
                    return Outcome(kind="timeout")
                await asyncio.sleep(_POLL_SECONDS)
        finally:
            self.kill()
            await loop.run_in_executor(None, self._process.join, 5)
            self._receiver.close()
