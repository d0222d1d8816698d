"""The partitioner on big tables: least Σ T under a cap on every stage's time by a range-minimum DP,
the Pareto front walked one cap at a time (:class:`CapFront`), and the memory scale by bisection."""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.plan.partitioning.rules import TOLERANCE, PieceSums, StageRule

__all__ = ["CAP_TOLERANCE", "CapFront", "scale_by_bisection"]

CAP_TOLERANCE = 1e-10
"""Relative precision of the bisections on the cap: a front point's max T is at most this much above
the least max T with its Σ T, so a split's objective is within ``weight · max T · 1e-10`` of the exact one."""


class CapFront:
    """:class:`~pipeloom.plan.partitioning.chain.SplitFront`'s front for big tables: least Σ T under a cap on every
    T_j, found by a DP in O(S·n·log n) (a range minimum per stage end), then a search over the cap
    (Eisner-Severance style).

    ``least(cap)``: the split of least Σ T whose stages all take <= cap; among equal sums, bisection on
    the cap finds the least max T (to a relative :data:`CAP_TOLERANCE`). Every point of the
    Pareto front of (max T, Σ T) is one such split, so :meth:`best` walks the front from the least
    Σ T down to the least max T, skipping caps that cannot beat the best split seen (a split of max T
    = M can only win if ``Σ_seen + weight · M`` is below the best objective).
    """

    def __init__(self, sums: PieceSums, rules: Sequence[StageRule]) -> None:
        import numpy as np

        self.np, self.sums, self.rules = np, sums, tuple(rules)
        n = sums.n
        self.time = np.array(sums.time)
        self.lower = max(max(sums.time[k + 1] - sums.time[k] for k in range(n)), sums.time[n] / len(rules))
        # query intervals: stage end b, its start a in [lo, hi], the bytes leaving [a, b) constant there
        qb, qlo, qhi, qbytes = [], [], [], []
        live = _live_values(sums)
        for b in range(1, n + 1):
            first, produced = 0, live[b]
            suffix = sum(sums.out[k] for k in produced)
            for k in produced:
                if first <= k:
                    qb.append(b)
                    qlo.append(first)
                    qhi.append(k)
                    qbytes.append(suffix)
                suffix -= sums.out[k]
                first = k + 1
            if first <= b - 1:
                qb.append(b)
                qlo.append(first)
                qhi.append(b - 1)
                qbytes.append(0.0)
        self.qb, self.qlo, self.qhi = np.array(qb), np.array(qlo), np.array(qhi)
        link = np.array([sums.link.time(x) for x in qbytes])
        self.link = [link if rule.sends else np.zeros(len(qb)) for rule in self.rules]
        self.fits_from = [self._fits_from(rule) for rule in self.rules]
        self.starts = np.searchsorted(self.qb, np.arange(n + 2))  # queries of b: starts[b]:starts[b+1]
        self._points: list[tuple[float, float, float, tuple[int, ...]]] = []  # (cap, max T, Σ T, starts)

    def _fits_from(self, rule: StageRule):
        """Per stage end b: the first start a whose stage fits every copy's limit."""
        np, sums = self.np, self.sums
        first = np.zeros(sums.n + 1, dtype=np.int64)
        for c in rule.copies:
            if c.limit is None:
                continue
            held = np.array([c.bytes(s, a, w) for s, a, w in zip(sums.static, sums.activation, sums.w_activation)])
            first = np.maximum(first, np.searchsorted(held, held - c.limit * (1 + TOLERANCE), side="left"))
        return first

    def _solve(self, cap: float) -> tuple[float, float, tuple[int, ...]] | None:
        """``(max T, Σ T, starts)`` of a split of least Σ T with every T_j <= cap; None when none fits."""
        np, n, count = self.np, self.sums.n, len(self.rules)
        values = np.full(n + 1, np.inf)
        values[0] = 0.0
        table = [values]
        for j in range(count):
            lo = np.maximum(self.qlo, np.maximum(self.fits_from[j][self.qb], j))
            if cap < np.inf:  # T = time[b] - time[a] + link <= cap
                lo = np.maximum(lo, np.searchsorted(self.time, self.time[self.qb] + self.link[j] - cap * (1 + 1e-12)))
            ok = (lo <= self.qhi) & (self.qb <= n - (count - 1 - j))
            found = _range_min(np, values - self.time, lo[ok], self.qhi[ok]) + self.time[self.qb[ok]] + self.link[j][ok]
            values = np.full(n + 1, np.inf)
            np.minimum.at(values, self.qb[ok], found)
            table.append(values)
        if not np.isfinite(values[n]):
            return None
        found_starts, b = [], n
        for j in range(count, 0, -1):  # walk back: the start whose sum gives the stage end's value
            q = slice(self.starts[b], self.starts[b + 1])
            lo = np.maximum(self.qlo[q], np.maximum(self.fits_from[j - 1][b], j - 1))
            if cap < np.inf:
                lo = np.maximum(lo, np.searchsorted(self.time, self.time[b] + self.link[j - 1][q] - cap * (1 + 1e-12)))
            best = (np.inf, -1)
            for low, high, link in zip(lo, self.qhi[q], self.link[j - 1][q]):
                if low <= high:
                    segment = table[j - 1][low:high + 1] - self.time[low:high + 1]
                    k = int(np.argmin(segment))
                    best = min(best, (segment[k] + link, low + k))
            found_starts.append(best[1])
            b = best[1]
        starts = tuple(found_starts[::-1])
        times = [self.sums.seconds(a, z, r.sends) for a, z, r in zip(starts, [*starts[1:], n], self.rules)]
        return max(times), sum(times), starts

    def point(self, cap: float, lower: float | None = None) -> tuple[float, float, tuple[int, ...]] | None:
        """The front point of least Σ T under ``cap``: ``(max T, Σ T, starts)`` with max T the least one
        for that sum (bisection on the cap down to ``lower``, below which nothing fits)."""
        for top, mx, total, starts in self._points:
            if mx <= cap <= top:
                return mx, total, starts
        found = self._solve(cap)
        if found is None:
            return None
        target = found[1] + TOLERANCE * abs(found[1])
        lo = max(self.lower, lower or 0.0) * (1 - 1e-12)
        while found[0] - lo > CAP_TOLERANCE * found[0]:
            middle = (lo + found[0]) / 2
            trial = self._solve(middle)
            if trial is not None and trial[1] <= target:
                found = trial
            else:
                lo = middle
        self._points.append((cap, *found))
        return found

    def best(self, weight: float) -> tuple[int, ...] | None:
        """Stage starts of the split of least ``Σ T + weight · max T``; None when none fits."""
        top = self.point(float("inf"))
        if top is None:
            return None
        if weight == 0:
            return top[2]
        least = self._least_max(top[0])
        bottom = self.point(least)
        assert bottom is not None, "a split of max T = least fits"
        best = min((top, bottom), key=lambda p: p[1] + weight * p[0])
        cap, total = top[0], top[1]
        while True:
            cap = min(cap * (1 - CAP_TOLERANCE), (best[1] + weight * best[0] - total) / weight)
            if cap < bottom[0]:
                return best[2]
            found = self.point(cap, lower=bottom[0])
            if found is None:
                return best[2]
            cap, total = found[0], found[1]
            best = min((best, found), key=lambda p: p[1] + weight * p[0])

    def _least_max(self, high: float) -> float:
        """The least max T of any split that fits (bisection: within :data:`CAP_TOLERANCE`)."""
        lo = self.lower * (1 - 1e-12)
        while high - lo > CAP_TOLERANCE * high:
            middle = (lo + high) / 2
            trial = self._solve(middle)
            if trial is None:
                lo = middle
            else:
                high = trial[0]
        return high


def _range_min(np, values, lo, hi):
    """``min(values[lo[q] .. hi[q]])`` for every query q (a sparse table; lo <= hi)."""
    levels = [values]
    width = 1
    while 2 * width <= len(values):
        last = levels[-1]
        levels.append(np.minimum(last[:-width], last[width:]))
        width *= 2
    size = len(values)
    stacked = np.full((len(levels), size), np.inf)
    for k, level in enumerate(levels):
        stacked[k, :len(level)] = level
    k = np.frexp((hi - lo + 1).astype(np.float64))[1] - 1
    return np.minimum(stacked[k, lo], stacked[k, hi - (1 << k) + 1])


def _live_values(sums: PieceSums) -> list[list[int]]:
    """Per cut b (pieces before b | pieces from b): the pieces before it whose output is read at or
    after b, ascending (a chain: ``[b - 1]``; none at the end)."""
    n = sums.n
    if sums.chain:
        return [[]] + [[b - 1] for b in range(1, n)] + [[]]
    live: list[list[int]] = [[] for _ in range(n + 1)]
    for k in range(n):
        for b in range(k + 1, min(sums.last_use[k], n - 1) + 1):
            live[b].append(k)
    return live


def scale_by_bisection(sums: PieceSums, rules: Sequence[StageRule]) -> tuple[float, tuple[int, ...]]:
    """:func:`smallest_memory_scale` for big tables: bisection on the scale (relative 1e-12), each step a
    reachability DP with numpy; the scale returned is the split's own need, so it fits exactly."""
    import numpy as np

    n, count = sums.n, len(rules)
    copies = [[(np.array([c.bytes(*t) for t in zip(sums.static, sums.activation, sums.w_activation)]), c.limit)
               for c in rule.copies if c.limit] for rule in rules]

    def split(scale: float) -> tuple[int, ...] | None:
        firsts, reach = [], np.zeros(n + 1, dtype=bool)
        reach[0] = True
        for j, held in enumerate(copies):
            first = np.full(n + 1, j, dtype=np.int64)
            for prefix, limit in held:
                first = np.maximum(first, np.searchsorted(prefix, prefix - limit * scale, side="left"))
            counts = np.concatenate(([0], np.cumsum(reach)))  # counts[b] = reachable starts below b
            last = np.arange(n + 1)  # a <= b - 1
            reach = (first <= last - 1) & (counts[last] - counts[np.minimum(first, last)] > 0)
            reach[:j + 1] = False
            firsts.append((first, reach.copy()))
        if not reach[n]:
            return None
        starts, b = [], n
        for j in range(count - 1, -1, -1):
            previous = firsts[j - 1][1] if j else np.eye(1, n + 1, 0, dtype=bool)[0]
            a = int(np.flatnonzero(previous[firsts[j][0][b]:b])[0]) + int(firsts[j][0][b])
            starts.append(a)
            b = a
        return tuple(starts[::-1])

    def need(starts: tuple[int, ...]) -> float:
        bounds = [*starts, n]
        return max((sums.nbytes(bounds[j], bounds[j + 1], c) / c.limit for j in range(count)
                    for c in rules[j].copies if c.limit), default=0.0)

    if not any(copies):
        return 0.0, tuple(range(count))
    best = split(float("inf"))
    assert best is not None, "with no limit every split fits"
    high, low = need(best), 0.0
    while high - low > 1e-12 * high:
        middle = (low + high) / 2
        trial = split(middle)
        if trial is None:
            low = middle
        else:
            best, high = trial, need(trial)
    return high, best
