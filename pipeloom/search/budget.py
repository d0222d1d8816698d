"""The time budget of one search call: a deadline every phase reads, and estimates of the steps
that cannot be stopped half-way (building, unrolling and validating a whole schedule), so a step
that would overrun the deadline is skipped instead of started."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["SECONDS_PER_ACTION", "Budget"]

SECONDS_PER_ACTION = 4e-5
"""Starting estimate of the time to build (or unroll) and validate a schedule, per action.
Measured on the 2-core development container under load: validate ~30 us, build ~14 us, simulate
~8 us per action (zbv, p=32, M=256); :meth:`Budget.observe` raises it to what this machine shows."""


@dataclass(kw_only=True, slots=True)
class Budget:
    """A deadline (a :func:`time.perf_counter` value) and the measured cost of whole-schedule steps.

    Not frozen: :meth:`observe` learns how long a schedule step takes on this machine now.
    """

    deadline: float
    """When the work must be done."""
    seconds_per_action: float = field(default=SECONDS_PER_ACTION)
    """Current estimate of building and validating one action."""

    @classmethod
    def of(cls, seconds: float) -> Budget:
        """A budget of ``seconds`` from now."""
        return cls(deadline=time.perf_counter() + seconds)

    def left(self) -> float:
        """Seconds until the deadline (negative once past it)."""
        return self.deadline - time.perf_counter()

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.left() <= 0

    def sub(self, fraction: float) -> Budget:
        """A budget ending after ``fraction`` of the time left (sharing this one's estimate)."""
        return Budget(deadline=time.perf_counter() + max(0.0, self.left()) * fraction,
                      seconds_per_action=self.seconds_per_action)

    def schedule_cost(self, actions: int, passes: float = 1.0) -> float:
        """Estimated seconds of ``passes`` build-and-validate passes over ``actions`` actions."""
        return actions * passes * self.seconds_per_action

    def fits(self, actions: int, passes: float = 1.0) -> bool:
        """Whether ``passes`` build-and-validate passes over ``actions`` actions end in time."""
        return self.schedule_cost(actions, passes) <= self.left()

    def observe(self, actions: int, seconds: float) -> None:
        """Learn from a build-and-validate pass over ``actions`` actions that took ``seconds``
        (small passes are dominated by fixed costs and teach nothing)."""
        if actions >= 2000:
            self.seconds_per_action = max(SECONDS_PER_ACTION / 4, seconds / actions)
