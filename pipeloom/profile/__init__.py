"""Measure a model's costs with torch: each piece alone (:func:`profile_model`) or inside the runtime on the
ranks that will train it (:func:`profile_in_engine`). Imports torch and the runtime; the torch-free planner
(:mod:`pipeloom.plan`) reads what these write.
"""

from __future__ import annotations

from pipeloom.profile.collectives import CollectiveCounter, time_collectives
from pipeloom.profile.engine import EngineProfiler
from pipeloom.profile.errors import PieceError
from pipeloom.profile.in_engine import profile_in_engine
from pipeloom.profile.model import profile_model

__all__ = [
    "CollectiveCounter",
    "EngineProfiler",
    "PieceError",
    "profile_in_engine",
    "profile_model",
    "time_collectives",
]
