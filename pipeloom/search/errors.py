"""Errors of the schedule search."""

from __future__ import annotations

from pipeloom.errors import PipeloomError

__all__ = ["SearchError"]


class SearchError(PipeloomError):
    """The search cannot return a schedule (e.g. the memory limit admits none)."""
