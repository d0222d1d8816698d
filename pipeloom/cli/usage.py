"""The command line's usage error: bad flags, names or paths (exit status 2)."""

from __future__ import annotations

from pipeloom.errors import PipeloomError

__all__ = ["UsageError"]


class UsageError(PipeloomError):
    """Bad command-line usage (exit status 2)."""
