"""Search of layouts for one job: every dp x tp x pp x cp (ep for MoE inside dp x cp), vp, mbs, recomputation,
FSDP or the distributed optimizer and schedule that can run, pruned by bounds, then branch and bound on the
simulated step time.

Exactness: each candidate gets a lower bound on its step time (every pipeline rank must wait for micro-batch
0's forwards through the stages before its first one, then do all its own work; plus the exposed
data-parallel time and the optimizer step, which the estimate adds as they are) and a lower bound on its
memory (weights, gradients, optimizer, buffers exactly; activations as the schedule's peak count of held
stages, replayed with unit costs, times the smallest stage's activations, for schedules whose order does not
depend on costs; one stage's otherwise). Candidates are simulated in increasing bound order until the bound
reaches the best fitting step time, so the answer is the fastest fitting layout of the whole space; as the
fitting set only grows with the memory limit, more memory never gives a slower plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeloom.plan.cluster.counts import RECOMPUTE_MODES
from pipeloom.plan.cluster.estimate import Estimate, Estimator, rank_stages, work_bound
from pipeloom.plan.cluster.layer_time import Job
from pipeloom.plan.cluster.layout import LAYOUT_KEYS, SCHEDULES, Layout
from pipeloom.plan.errors import LayoutError, NoLayoutFits
from pipeloom.problem import Costs
from pipeloom.schedules import build_schedule
from pipeloom.sim import simulate

__all__ = ["Candidate", "SearchResult", "enumerate_layouts", "search_layouts", "MBS_CHOICES",
           "VP_CHOICES"]

MBS_CHOICES = (1, 2, 4)
"""Micro-batch sizes tried (sequences)."""
VP_CHOICES = (2, 3, 4, 5, 6, 7, 8)
"""Stages per rank tried for interleaved-1f1b."""
_COST_AWARE = ("zbv",)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A layout that can run, with its bounds."""

    layout: Layout
    """The layout."""
    time_bound: float
    """Lower bound on its step time."""
    memory_bound: float
    """Lower bound on its memory per GPU."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """The best layout, the runners-up with why each lost, and what the search did."""

    best: Estimate
    """The fastest layout that fits."""
    runners_up: tuple[tuple[Estimate, str], ...]
    """Other simulated layouts (the fastest fitting ones, then faster ones that do not fit) and why each lost."""
    candidates: int
    """Layouts that can run (before bounds)."""
    simulated: int
    """Layouts priced by simulation."""
    memory_limit: float
    """The per-GPU memory limit used (bytes)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else worth printing."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(key: str, fixed: dict[str, Any], default: list[Any]) -> list[Any]:
    return [fixed[key]] if key in fixed else default


def enumerate_layouts(estimator: Estimator, fixed: dict[str, Any]) -> Iterator[Layout]:
    """Every layout of the job that passes :meth:`Estimator.check`, with the keys of ``fixed`` as given."""
    job, spec = estimator.job, estimator.job.spec
    unknown = set(fixed) - set(LAYOUT_KEYS)
    if unknown:
        raise LayoutError(f"unknown layout keys {sorted(unknown)}; use {', '.join(LAYOUT_KEYS)}")
    n, hw = job.gpus, job.hw
    tps = [t for t in _divisors(n) if t <= hw.scale_up_size and spec.attention.heads % t == 0]
    for tp in _choices("tp", fixed, tps):
        cps = [c for c in _divisors(n // tp) if c <= 16 and (c == 1 or job.seq % (2 * c) == 0)] if n % tp == 0 else []
        for cp in _choices("cp", fixed, cps):
            if n % (tp * cp):
                continue
            pps = [p for p in _divisors(n // (tp * cp)) if p <= spec.layers]
            for pp in _choices("pp", fixed, pps):
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                yield from _inner(estimator, fixed, tp, cp, pp, dp)


def _inner(estimator: Estimator, fixed: dict[str, Any], tp: int, cp: int, pp: int, dp: int) -> Iterator[Layout]:
    """Layouts of one dp x tp x pp x cp."""
    spec, job = estimator.job.spec, estimator.job
    experts = spec.experts.count if spec.experts else 1
    eps = [e for e in _divisors(dp * cp) if experts % e == 0] if spec.experts else [1]
    schedules = list(SCHEDULES) if pp > 1 else ["1f1b"]
    for ep, mbs, recompute, fsdp, schedule in itertools.product(
            _choices("ep", fixed, eps), _choices("mbs", fixed, list(MBS_CHOICES)),
            _choices("recompute", fixed, list(RECOMPUTE_MODES)), _choices("fsdp", fixed, [False, True]),
            _choices("schedule", fixed, schedules)):
        if job.global_batch % (dp * mbs):
            continue
        placement = SCHEDULES.get(schedule)
        vps = {"interleaved": [v for v in VP_CHOICES if pp * v <= spec.layers], "v": [2]}.get(placement or "", [1])
        for vp in _choices("vp", fixed, vps):
            try:
                layout = Layout(dp=dp, tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, mbs=mbs, fsdp=bool(fsdp),
                                recompute=recompute, schedule=schedule)
                estimator.check(layout)
            except LayoutError:
                continue
            yield layout


class _Bounds:
    """Lower bounds of a layout's step time and memory (module docstring), with unit-cost replays cached."""

    def __init__(self, estimator: Estimator) -> None:
        self.estimator = estimator
        self._units: dict[tuple[str, int, int, int], tuple[float, ...]] = {}

    def held_units(self, layout: Layout, m: int) -> tuple[float, ...]:
        """Per rank: the most stages' activations the schedule holds at once (unit costs, one per stage),
        replayed with at most 2 pp micro-batches: the warm-up that sets the peak is the same with more."""
        m = min(m, 2 * layout.pp)
        key = (layout.schedule, layout.pp, layout.vp, m)
        if key not in self._units:
            if layout.pp == 1 or layout.schedule in _COST_AWARE:
                self._units[key] = (1.0,) * layout.pp
            else:
                options = {"stages_per_rank": layout.vp} if SCHEDULES[layout.schedule] == "interleaved" else {}
                schedule = build_schedule(layout.schedule, layout.pp, m, costs=Costs(memory=float(layout.vp)),
                                          **options)
                self._units[key] = tuple(simulate(schedule).peak_memory)
        return self._units[key]

    def candidate(self, layout: Layout) -> Candidate:
        e = self.estimator
        m = e.check(layout)
        times, acts, cut = e.stages(layout)
        memory, exposed, optimizer = e.static_state(layout, times, cut, m)
        ranks = rank_stages(layout)
        units = self.held_units(layout, m)
        act_bound = max(units[r] * min(acts[j] for j in js) for r, js in enumerate(ranks))
        bound = work_bound(layout, m, times)
        return Candidate(layout=layout, time_bound=bound + exposed + optimizer,
                         memory_bound=memory.total + act_bound)


def search_layouts(job: Job, *, fixed: dict[str, Any] | None = None, memory_limit: float | None = None,
                   runners_up: int = 5, progress: Callable[[str], None] | None = None) -> SearchResult:
    """The fastest layout of ``job`` within ``memory_limit`` bytes per GPU (default: the GPU's memory), with the
    keys of ``fixed`` held; NoLayoutFits when none fits (naming the smallest memory any layout needs)."""
    fixed = dict(fixed or {})
    limit = float(memory_limit if memory_limit is not None else job.hw.memory_bytes)
    estimator = Estimator(job)
    bounds = _Bounds(estimator)
    candidates = [bounds.candidate(layout) for layout in enumerate_layouts(estimator, fixed)]
    if not candidates:
        raise NoLayoutFits(f"no layout of {job.spec.family} on {job.gpus} GPUs can run with {_fixed_text(fixed)}"
                           f" (global batch {job.global_batch}, sequence {job.seq}); change the fixed keys, the GPU "
                           "count or the global batch")
    fitting = sorted((c for c in candidates if c.memory_bound <= limit), key=lambda c: (c.time_bound, _key(c.layout)))
    best: Estimate | None = None
    done: list[Estimate] = []
    extra = 0  # candidates simulated past the bound, for the runners-up
    for count, cand in enumerate(fitting):
        if best is not None and cand.time_bound >= best.step_time:
            extra += 1
            if extra > runners_up:
                break
        if progress and count % 20 == 0:
            progress(f"simulated {count} of {len(fitting)} candidates")
        try:
            est = estimator.estimate(cand.layout)
        except LayoutError:
            continue
        done.append(est)
        if est.memory.total <= limit and (best is None or (est.step_time, _key(est.layout)) <
                                          (best.step_time, _key(best.layout))):
            best = est
    if best is None:
        smallest = min(c.memory_bound for c in candidates)
        raise NoLayoutFits(f"no layout fits {limit / 2**30:.1f} GiB per GPU ({len(candidates)} layouts tried; the "
                           f"smallest needs at least {smallest / 2**30:.1f} GiB); use more GPUs, a smaller global "
                           "batch or sequence, or raise --memory-limit")
    return SearchResult(best=best, runners_up=_runners_up(best, done, limit, runners_up),
                        candidates=len(candidates), simulated=len(done), memory_limit=limit)


def _key(layout: Layout) -> tuple[Any, ...]:
    """A total order of layouts (ties of time broken the same way at every memory limit)."""
    return tuple(getattr(layout, key) for key in LAYOUT_KEYS)


def _runners_up(best: Estimate, done: list[Estimate], limit: float, count: int) -> tuple[tuple[Estimate, str], ...]:
    """The fastest other fitting layouts (slower by how much, and where the time goes), then faster ones that
    do not fit."""
    fits = sorted((e for e in done if e.memory.total <= limit and e is not best), key=lambda e: e.step_time)
    over = sorted((e for e in done if e.memory.total > limit), key=lambda e: e.step_time)
    out = []
    for est in fits[:count]:
        out.append((est, f"{(est.step_time / best.step_time - 1) * 100:.1f}% slower ({_why(est, best)})"))
    for est in over[:max(1, count // 2)]:
        out.append((est, f"needs {est.memory.total / 2**30:.1f} GiB per GPU > {limit / 2**30:.1f} GiB limit"))
    return tuple(out)


def _why(est: Estimate, best: Estimate) -> str:
    """The part of the step that grew most against the best."""
    parts = {"bubble": est.bubble * est.pipeline_time - best.bubble * best.pipeline_time,
             "compute and tp/ep communication": (1 - est.bubble) * est.pipeline_time
             - (1 - best.bubble) * best.pipeline_time,
             "exposed dp communication": est.exposed_dp - best.exposed_dp,
             "optimizer step": est.optimizer_time - best.optimizer_time}
    name, delta = max(parts.items(), key=lambda item: item[1])
    return f"{name} +{delta:.3g} s"


def _fixed_text(fixed: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in fixed.items()) or "no fixed keys"

