"""Why a measured step differs from its prediction, as this module's old name: the analysis moved
to :mod:`pipeloom.trace.explain` (issue 19); these names still import from here."""

from __future__ import annotations

from pipeloom.trace.explain import explain_ratio, rank_gaps

__all__ = ["explain_ratio", "rank_gaps"]
