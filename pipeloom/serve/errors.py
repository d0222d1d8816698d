"""Errors the playground's API answers with an HTTP status."""

from __future__ import annotations

from pipeloom.errors import PipeloomError

__all__ = ["RequestError", "WorkError"]


class WorkError(PipeloomError):
    """A request above one of the server's limits (answered 413, or 400 for a count that is not one)."""

    def __init__(self, message: str, status: int = 413) -> None:
        super().__init__(message)
        self.status = status


class RequestError(WorkError):
    """A request the API refuses (answered 4xx with this message); ``status`` is the HTTP code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message, status)
