"""Errors the playground's API answers with an HTTP status."""

from __future__ import annotations

from pipeloom.errors import PipeloomError

__all__ = ["RequestError"]


class RequestError(PipeloomError):
    """A request the API refuses (answered 4xx with this message); ``status`` is the HTTP code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
