"""Why no layout of a job can run: the search's one-line refusals when the job's counts, the model's shape or the
fixed keys leave no layout (:func:`no_layout_runs`), or when every layout has a problem where it must run
(:func:`barred_text`), each with the fix: the keys or counts that avoid it, the nearest GPU counts and global batches
some layout divides."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Refusals, enumerate_layouts
from pipeloom.plan.cluster.step import keys_text
from pipeloom.plan.errors import NoLayoutFits

__all__ = ["barred_text", "no_layout_runs"]


def no_layout_runs(job: Job, fixed: dict[str, Any], refusals: Refusals) -> NoLayoutFits:
    """The error for a job none of whose layouts can run with ``fixed`` (``refusals``: why each was refused)."""
    first = f" (the first refused: {refusals[0]})" if refusals else ""
    fixes = ["change the fixed keys"] * bool(fixed) + ["the stage cut"] * bool(job.cut())
    # a refusal by the model's own shape (heads, experts, layers) or by the keys alone: no count fixes it
    if not fixed or not refusals:
        fixes.append(f"pick a GPU count or a global batch with more common divisors{_runnable_near(job, fixed)}")
    elif refusals.counts:
        fixes.append(f"pick {refusals.counts}")
    return NoLayoutFits(f"no layout of {job.spec.family} on {job.gpus:,} GPUs can run with {keys_text(fixed)}"
                       f" (global batch {job.global_batch}, sequence {job.seq}){first}; {', '.join(fixes)}")


def barred_text(job: Job, fixed: dict[str, Any], barred: Counter[str], said: dict[str, str], total: int) -> str:
    """Why none of the ``total`` layouts runs where ``blocked`` looks: the problem that stops them all, or the
    commonest problems by layout key, each with how many layouts it stops and its first instance (one layout's
    problems named alone had read as the only obstacle)."""
    keys = f" with {keys_text(fixed)}" if fixed else ""
    fix = "; change or drop the --layout keys that ask for it" if fixed else ""
    (top, count), = barred.most_common(1)
    if count == total:  # one problem stops every layout: it alone is said
        return (f"no layout of {job.spec.family} on {job.gpus:,} GPUs{keys} runs there: {said[top]}"
                f"{_without(job, fixed, barred)}{fix}")
    shown = [f"{key} in {count:,} (e.g. {said[key]})" for key, count in barred.most_common(3)]
    more = f", and {len(barred) - 3} more" if len(barred) > 3 else ""
    return (f"no layout of {job.spec.family} on {job.gpus:,} GPUs{keys} runs there; what stops them, by layouts: "
            f"{'; '.join(shown)}{more}{_without(job, fixed, barred)}{fix}")


_PLAIN: dict[str, Any] = {"tp": 1, "cp": 1, "fsdp": False, "recompute": "none"}  # ask nothing of a runtime


def _without(job: Job, fixed: dict[str, Any], barred: Counter[str]) -> str:
    """Where no layout can run with the barred keys at the values that ask nothing of a runtime (ep is refused beside
    others, not alone), why not: the enumeration's own refusal and the count that avoids it; else ``""``."""
    plain = {key: value for key, value in _PLAIN.items() if key in barred and key not in fixed}
    refusals = Refusals()
    if not plain or next(enumerate_layouts(job, {**fixed, **plain}, refusals), None) is not None or not refusals:
        return ""
    counts = f"; pick {refusals.counts}" if refusals.counts else ""
    return f"; and with {keys_text(plain)} none can run ({refusals[0]}{counts})"


_NEAR = 64
"""Counts tried on each side of the job's GPU count and global batch for :func:`_runnable_near` (each costs an
enumeration: every count up to twice 20,000 GPUs had taken over a minute)."""


def _runnable_near(job: Job, fixed: dict[str, Any]) -> str:
    """The GPU counts and global batches nearest the job's, one each side (within :data:`_NEAR`, half and twice),
    that some layout with ``fixed`` divides, with the job's other count, as ``" (some layout divides ...)"``; ``""``
    when none. Whether a layout of them fits in memory is their plan's to say."""
    said = []
    for name, unit in (("gpus", "{} GPUs"), ("global_batch", "a global batch of {}")):
        near = [n for n in (_nearest(job, fixed, name, side) for side in (-1, 1)) if n is not None]
        if near:
            said.append(unit.format(" or ".join(f"{n:,}" for n in near)))
    return f" (some layout divides {', or '.join(said)})" if said else ""


def _nearest(job: Job, fixed: dict[str, Any], name: str, side: int) -> int | None:
    """The count of ``name`` nearest the job's on ``side`` (-1 below, 1 above) that some layout runs, or None."""
    start = getattr(job, name)
    for step in range(1, _NEAR + 1):
        n = start + side * step
        if not max(start // 2, 1) <= n <= 2 * start:
            return None
        if next(enumerate_layouts(dataclasses.replace(job, **{name: n}), fixed), None) is not None:
            return n
    return None
