"""Dense timelines as an image: each pixel column of a rank's row takes the colours of the actions
in it weighted by the time they cover, so boxes narrower than a pixel read as their true share of
busy time on every rank alike, instead of aliasing into stripes on some rows and solid bars on others.

Coverage is exact, not sampled: with ``G(x)`` the busy length in ``[0, x)``,
``G(x) = sum_{a_k < x} (x - a_k) - sum_{b_k < x} (x - b_k)`` over the intervals ``[a_k, b_k)``
(in pixels), and pixel ``i`` is covered ``G(i + 1) - G(i)``. A schedule that repeats every couple
of pixels would still beat against the pixel grid (moire), so the coverage is then smoothed along
time with a Gaussian of :data:`SMOOTH_PX` pixels, the same on every row: repeating detail under
about four pixels averages out, bubbles wider than that stay.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["ROWS_PER_RANK", "SMOOTH_PX", "coverage", "coverage_image", "smooth"]

SMOOTH_PX = 1.5
"""Standard deviation, in pixels, of the smoothing along time."""

ROWS_PER_RANK = 40
"""Image rows per rank row: y from ``r - 0.5`` to ``r + 0.5`` in steps of 1/40."""


def coverage(starts: Sequence[float], ends: Sequence[float], *, width: int):
    """Per pixel ``0..width-1``, the fraction of it covered by the intervals ``[start, end)``,
    given in pixels; intervals are assumed not to overlap (one rank runs one action at a time)."""
    import numpy as np

    grid = np.arange(width + 1, dtype=float)

    def ramp(points) -> np.ndarray:  # sum over points p < x of (x - p), at every grid x
        points = np.sort(np.asarray(points, dtype=float))
        sums = np.concatenate(([0.0], np.cumsum(points)))
        count = np.searchsorted(points, grid, side="left")
        return count * grid - sums[count]

    covered = ramp(starts) - ramp(ends)
    return np.clip(np.diff(covered), 0.0, 1.0)


def smooth(values, *, sigma: float = SMOOTH_PX):
    """``values`` (last axis: pixels) convolved with a normalised Gaussian of ``sigma`` pixels,
    edges padded with zeros (time before 0 and after the end is idle)."""
    import numpy as np

    if sigma <= 0:
        return values
    reach = int(3 * sigma + 0.5)
    offsets = np.arange(-reach, reach + 1)
    weights = np.exp(-0.5 * (offsets / sigma) ** 2)
    weights /= weights.sum()
    out = np.zeros_like(values)
    width = values.shape[-1]
    for offset, weight in zip(offsets, weights):
        if offset >= 0:
            out[..., offset:] += weight * values[..., : width - offset]
        else:
            out[..., :offset] += weight * values[..., -offset:]
    return out


def coverage_image(layers: Iterable[tuple[tuple[float, float, float], float, float,
                                          Sequence[tuple[float, float, int]]]],
                   *, num_ranks: int, xmax: float, width: int, min_width: float = 0.0,
                   sigma: float = SMOOTH_PX):
    """An RGBA image, ``num_ranks * ROWS_PER_RANK`` rows by ``width`` pixel columns over time
    ``[0, xmax]``.

    ``layers``: ``(rgb, y0, y1, [(start, end, rank), ...])``: intervals of one colour drawn from
    ``rank + y0`` to ``rank + y1`` (as the boxes are). Colours sharing a pixel mix in proportion to
    the time they cover it; alpha is the covered share, so idle time shows the background.
    ``min_width`` (pixels) widens shorter intervals about their middle (zero-time marks stay visible);
    ``sigma``: the smoothing along time (:func:`smooth`; 0 for none).
    """
    import numpy as np

    height = num_ranks * ROWS_PER_RANK
    color = np.zeros((height, width, 3))
    alpha = np.zeros((height, width))
    per_px = width / xmax if xmax > 0 else 0.0
    for rgb, y0, y1, items in layers:
        if not items:
            continue
        data = np.asarray(items, dtype=float).reshape(-1, 3)
        a, b = data[:, 0] * per_px, data[:, 1] * per_px
        short = (b - a) < min_width
        middle = (a + b) / 2
        a = np.where(short, middle - min_width / 2, a)
        b = np.where(short, middle + min_width / 2, b)
        rows = slice(round((y0 + 0.5) * ROWS_PER_RANK), round((y1 + 0.5) * ROWS_PER_RANK))
        ranks = data[:, 2].astype(int)
        for rank in np.unique(ranks):
            mine = ranks == rank
            share = smooth(coverage(a[mine], b[mine], width=width), sigma=sigma)
            top = rank * ROWS_PER_RANK
            band = slice(top + rows.start, top + rows.stop)
            color[band] += share[None, :, None] * np.asarray(rgb)[None, None, :]
            alpha[band] += share[None, :]
    color = color / np.maximum(alpha, 1e-12)[..., None]  # the mean colour of what covers the pixel
    return np.concatenate([np.clip(color, 0.0, 1.0), np.clip(alpha, 0.0, 1.0)[..., None]], axis=2)
