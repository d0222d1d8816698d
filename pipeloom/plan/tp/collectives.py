"""Collectives in the cost model (no torch): the record of one (kind, phase, whole-tensor bytes), its price
per kind on one mesh dimension (:class:`CollectiveFit`: overhead, ring latency, bandwidth) and the
least-squares fit of that price from timed samples (:func:`fit_collectives`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeloom.plan.errors import TensorParallelError

__all__ = [
    "COLLECTIVES", "Collective", "CollectiveFit", "collective_seconds", "fit_collectives", "ring_steps_and_share"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Collective kinds priced; ``bytes`` is the whole (unsharded) tensor's, for an all-to-all this rank's send buffer
(:mod:`pipeloom.plan.tp.all_to_all`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective a piece runs per micro-batch."""

    kind: str
    """One of :data:`COLLECTIVES`."""
    phase: str
    """``"F"`` (forward) or ``"I"`` (the input-gradient backward) or ``"W"``."""
    bytes: float
    """The whole tensor's bytes (an all-gather's output, a reduce-scatter's input)."""

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise TensorParallelError(f"collective kind {self.kind!r} is not one of {', '.join(COLLECTIVES)}")
        if self.phase not in ("F", "I", "W"):
            raise TensorParallelError(f"collective phase must be F, I or W, got {self.phase!r}")


def ring_steps_and_share(kind: str, size: int) -> tuple[int, float]:
    """Ring messages per rank and the share of the tensor each rank moves: an all-reduce is a
    reduce-scatter then an all-gather, ``2(n-1)`` messages and ``2(n-1)/n`` of the bytes; an all-gather
    or a reduce-scatter is one of them. The one ring formula of the cost model (tp and dp price with it). An
    all-to-all posts its ``n - 1`` messages at once: one step, ``(n-1)/n`` of the buffer
    (:func:`pipeloom.plan.tp.all_to_all.all_to_all_seconds`)."""
    if kind == "all_to_all":
        return (1 if size > 1 else 0), (size - 1) / size
    twice = 2 if kind == "all_reduce" else 1
    return twice * (size - 1), twice * (size - 1) / size


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveFit:
    """Seconds of a collective of ``S`` bytes over ``n`` ranks of one mesh dimension:
    ``overhead + steps(n)·latency + share(n)·S / bandwidth`` with the kind's latency and bandwidth."""

    latency: Mapping[str, float] = field(default_factory=dict)
    """Seconds per ring message, by kind (0 where absent)."""
    bandwidth: Mapping[str, float | None] = field(default_factory=dict)
    """Bytes per second on the link, by kind (None or absent: unlimited)."""
    overhead: Mapping[str, float] = field(default_factory=dict)
    """Seconds each collective of that kind costs whatever its size (launch, the DTensor redistribution)."""

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth", "overhead"):
            values = dict(getattr(self, name))
            for kind, value in values.items():
                if kind not in COLLECTIVES:
                    raise TensorParallelError(f"collective fit {name}: unknown kind {kind!r}; use "
                                              f"{', '.join(COLLECTIVES)}")
                if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)
                                          or value < 0 or (name == "bandwidth" and value == 0)):
                    raise TensorParallelError(f"collective fit {name}[{kind!r}] must be a number >= 0 (> 0 for a "
                                              f"bandwidth), got {value!r}")
            object.__setattr__(self, name, values)

    @classmethod
    def from_link(cls, latency: float, bandwidth: float | None) -> CollectiveFit:
        """Every kind on one point-to-point link (the table's), no overhead."""
        return cls(latency=dict.fromkeys(COLLECTIVES, latency), bandwidth=dict.fromkeys(COLLECTIVES, bandwidth))

    def seconds(self, kind: str, nbytes: float, size: int) -> float:
        if size <= 1 or nbytes <= 0:
            return 0.0
        steps, share = ring_steps_and_share(kind, size)
        bandwidth = self.bandwidth.get(kind)
        return (self.overhead.get(kind, 0.0) + steps * self.latency.get(kind, 0.0)
                + (0.0 if bandwidth is None else share * nbytes / bandwidth))


def collective_seconds(collectives: Sequence[Collective], fit: CollectiveFit, size: int, phase: str) -> float:
    """Seconds the ``phase`` collectives of one micro-batch take on ``size`` ranks (run one after the other)."""
    return sum(fit.seconds(c.kind, c.bytes, size) for c in collectives if c.phase == phase)


def fit_collectives(samples: Sequence[tuple[str, int, float, float]]) -> CollectiveFit:
    """Least-squares fit of ``(kind, ranks, bytes, seconds)`` measurements, per kind, of
    ``seconds = overhead + steps·latency + share·bytes / bandwidth`` (negative parts clamped to 0; the
    latency is only separable from the overhead when several group sizes were measured)."""
    latency, bandwidth, overhead = {}, {}, {}
    for kind in COLLECTIVES:
        rows = [(1.0, *ring_steps_and_share(kind, n)[:1], ring_steps_and_share(kind, n)[1] * b, t)
                for k, n, b, t in samples if k == kind and n > 1]
        if not rows:
            continue
        columns = [0, 2] if len({r[1] for r in rows}) == 1 else [0, 1, 2]
        solution = _least_squares([[r[c] for c in columns] for r in rows], [r[3] for r in rows])
        coef = dict(zip(columns, solution))
        overhead[kind] = max(coef[0], 0.0)
        latency[kind] = max(coef.get(1, 0.0), 0.0)
        bandwidth[kind] = 1.0 / coef[2] if coef[2] > 0 else None
    return CollectiveFit(latency=latency, bandwidth=bandwidth, overhead=overhead)


def _least_squares(a: list[list[float]], y: list[float]) -> list[float]:
    """The x minimising |a·x - y| (normal equations, Gaussian elimination; a tiny ridge keeps it solvable)."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) + (1e-30 if i == j else 0.0) for j in range(n)]
         + [sum(r[i] * v for r, v in zip(a, y))] for i in range(n)]
    for i in range(n):
        pivot = max(range(i, n), key=lambda k: abs(m[k][i]))
        m[i], m[pivot] = m[pivot], m[i]
        for k in range(n):
            if k != i and m[i][i]:
                factor = m[k][i] / m[i][i]
                m[k] = [u - factor * v for u, v in zip(m[k], m[i])]
    return [m[i][n] / m[i][i] if m[i][i] else 0.0 for i in range(n)]
