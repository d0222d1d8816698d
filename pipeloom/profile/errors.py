"""Errors of profiling a model's pieces."""

from __future__ import annotations

from pipeloom.plan.errors import PlanError

__all__ = ["PieceError"]


class PieceError(PlanError):
    """One piece cannot be profiled (it fails when run on its own); the message names it and a fix."""
