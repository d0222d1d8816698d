"""Integer arithmetic the planners, the cluster search and the server's work limits share.

It imports nothing from pipeloom, so any layer may use it.
"""

from __future__ import annotations

import math

__all__ = ["divisors"]


def divisors(n: int, cap: int | None = None) -> list[int]:
    """The divisors of ``n`` (a positive int) in increasing order, those up to ``cap`` when given; trial
    division up to sqrt(n), or up to ``cap`` when that is smaller (a huge ``n`` with a small cap is cheap)."""
    if cap is not None and cap <= math.isqrt(n):
        return [d for d in range(1, cap + 1) if n % d == 0]
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    found = sorted(set(small) | {n // d for d in small})
    return found if cap is None else [d for d in found if d <= cap]
