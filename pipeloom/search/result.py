"""What a search returns: the schedule, the solver's status, the bound and the gap."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from pipeloom.ir import Schedule
from pipeloom.problem import Problem

__all__ = ["SearchResult", "SearchProgress", "Status", "Mode"]

Status = Literal["optimal", "feasible"]
Mode = Literal["exact", "periodic"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """A searched schedule with its proof of quality."""

    schedule: Schedule
    """The schedule found (validates; B/W in micro-batch order)."""
    status: Status
    """``optimal`` when the makespan equals the proven lower bound, else ``feasible``."""
    mode: Mode
    """Which search produced it."""
    makespan: float
    """Simulated makespan of ``schedule`` (real time units)."""
    lower_bound: float
    """No schedule of this problem under the memory limit finishes earlier."""
    seconds: float
    """Wall time the search took."""
    peak_memory: tuple[float, ...]
    """Per-rank peak memory of ``schedule``."""
    period: float | None = None
    """Steady-state period (periodic mode), real time units."""
    period_lower_bound: float | None = None
    """No period can be shorter: the busiest rank's work per micro-batch, or its memory-time area per
    micro-batch over the memory limit when larger (periodic mode)."""
    time_scale: float = 1.0
    """Integer solver units per real time unit (durations were scaled to integers)."""
    origin: str = "solver"
    """What produced ``schedule``: ``solver`` (the mode's CP-SAT model or its list-schedule
    fallback), ``builtin:NAME`` (a registry schedule), or a construction from another problem's
    answer, with that answer's origin in brackets: ``split-backward(...)`` (each B of the
    full-backward problem's answer split into I then W) or ``all-rank-blocks(...)`` (the answer
    without the all-rank blocks, the blocks put back)."""

    @property
    def gap(self) -> float:
        """``(makespan - lower_bound) / lower_bound``; 0 when proven optimal."""
        if self.lower_bound <= 0:
            return 0.0
        return max(0.0, (self.makespan - self.lower_bound) / self.lower_bound)

    def on_ranks(self, problem: Problem, used: tuple[int, ...]) -> SearchResult:
        """This result (a search of ``problem`` on its ``used`` ranks alone, renumbered in order) on all of
        ``problem``'s ranks: the others run nothing and hold their static memory."""
        actions, peaks = dict(zip(used, self.schedule.ranks)), dict(zip(used, self.peak_memory))
        static = problem.static_memory or (0.0,) * problem.num_ranks
        schedule = replace(self.schedule, problem=problem,
                           ranks=tuple(actions.get(rank, ()) for rank in range(problem.num_ranks)))
        return replace(self, schedule=schedule,
                       peak_memory=tuple(peaks.get(rank, static[rank]) for rank in range(problem.num_ranks)))


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchProgress:
    """A progress report while a search runs (for a terminal display)."""

    seconds: float
    """Time since the search started."""
    best: float | None
    """Best makespan (or period, in periodic mode) found so far, real units."""
    bound: float
    """Current proven bound, real units."""
    phase: str
    """What runs now, e.g. ``exact``, ``period``, ``warm-up``."""
