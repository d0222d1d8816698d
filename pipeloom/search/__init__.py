"""Schedule search with CP-SAT: exact and periodic (repetend) modes, a placement catalog and a
block builder for Tessel-style task graphs, behind one call, :func:`search`.
"""

from pipeloom.search.api import search
from pipeloom.search.blocks import PlacementBuilder
from pipeloom.search.errors import SearchError
from pipeloom.search.placements import PLACEMENTS, placement
from pipeloom.search.problem_file import load_problem, problem_from_json
from pipeloom.search.result import SearchProgress, SearchResult

__all__ = [
    "PLACEMENTS",
    "PlacementBuilder",
    "SearchError",
    "SearchProgress",
    "SearchResult",
    "load_problem",
    "placement",
    "problem_from_json",
    "search",
]
