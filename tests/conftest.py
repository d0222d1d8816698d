"""Settings for every test: Hypothesis examples have no per-example deadline (its default of 200 ms measures the
machine's load, not the code: a loaded 2-core CI machine can take longer on any example)."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("pipeloom", deadline=None)
settings.load_profile("pipeloom")
