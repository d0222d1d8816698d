"""torch.distributed.pipelining's schedules module for the interop tests: skipped without torch, a
failure instead when PIPELOOM_REQUIRE_TORCH=1 (set by ``make test``), so the checks cannot silently
stop running."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def import_torch_schedules() -> ModuleType:
    """torch's pipelining schedules; skip the calling module without them, fail if they are required."""
    try:
        return importlib.import_module("torch.distributed.pipelining.schedules")
    except ImportError as error:
        reason = str(error)
    if os.environ.get("PIPELOOM_REQUIRE_TORCH") == "1":
        pytest.fail(f"PIPELOOM_REQUIRE_TORCH=1 but torch's pipelining cannot be imported: {reason}",
                    pytrace=False)
    pytest.skip(f"torch is not installed ({reason}); set PIPELOOM_REQUIRE_TORCH=1 to make this a failure",
                allow_module_level=True)
