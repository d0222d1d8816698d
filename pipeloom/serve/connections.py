"""Connections of ``pipeloom serve`` that silent clients cannot hoard: uvicorn's HTTP/1.1 protocol (h11) with a
deadline for each request head (the first one after the connection opens, and each next one after an answer)
and a connection limit that makes room by closing the oldest connection that carries no request. uvicorn's
own ``limit_concurrency`` counts open connections, so 256 sockets that never send a byte locked every client
out; here they are closed after ``first_request_seconds``, or sooner when new clients need their places.
The real work stays bounded by the worker queues (:mod:`pipeloom.serve.jobs`) and the guard's request limit
(:mod:`pipeloom.serve.guard`)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeloom.serve.config import ServeConfig

__all__ = ["guarded_protocol"]


def guarded_protocol(config: ServeConfig) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with ``config``'s connection limits."""
    opened = itertools.count()

    class GuardedH11Protocol(H11Protocol):
        """H11Protocol with a request-head deadline and idle-first eviction past ``max_connections``."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.opened_at = next(opened)
            self.head_deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._make_room()
            self._expect_request()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_deadline is not None:
                self.head_deadline.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._expect_request()

        def carries_request(self) -> bool:
            """Whether a request is being answered on this connection."""
            return self.cycle is not None and not self.cycle.response_complete

        def _expect_request(self) -> None:
            """Close this connection unless a new request's head arrives within ``first_request_seconds``
            (bytes that trickle in without completing one do not count)."""
            if self.head_deadline is not None:
                self.head_deadline.cancel()
            waiting_for = self.cycle
            self.head_deadline = self.loop.call_later(config.first_request_seconds, self._deadline, waiting_for)

        def _deadline(self, waiting_for: Any) -> None:
            if self.cycle is waiting_for and not self.carries_request() and not self.transport.is_closing():
                self.transport.close()

        def _make_room(self) -> None:
            """Past ``max_connections``, close the oldest connections that carry no request."""
            open_now = [c for c in self.connections if not c.transport.is_closing()]
            excess = len(open_now) - config.max_connections
            if excess <= 0:
                return
            idle = sorted((c for c in open_now if c is not self and isinstance(c, GuardedH11Protocol)
                           and not c.carries_request()), key=lambda c: c.opened_at)
            for connection in idle[:excess]:
                connection.transport.close()

    return GuardedH11Protocol
