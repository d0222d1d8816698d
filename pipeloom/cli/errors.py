"""The command line's usage error: bad flags, names or paths (exit status 2)."""

from __future__ import annotations

from pipeloom.errors import PipeloomError

__all__ = ["UsageError", "UserCodeError"]


class UsageError(PipeloomError):
    """Bad command-line usage (exit status 2)."""


class UserCodeError(PipeloomError):
    """The user's file raised while pipeloom ran it (importing it, building the model, making inputs,
    the forward or the loss). The first line names the file, the line and the error; the rest of
    the message is the traceback (shown with --verbose)."""
