"""Search of layouts for one job: every layout that can run (:func:`~pipeloom.plan.cluster.layout.enumerate_layouts`),
then branch and bound on the simulated step time. Every bound below is a lower bound, so no layout that could win is
skipped:

- *group bound*: layouts that differ only in vp, FSDP and schedule (DualPipe(V) apart) share a bound on step time,
  the mean pipeline rank's work ``m W / pp`` (:meth:`Bounds.group`), priced only when below the times sought.
- *time bound* of a layout: every pipeline rank waits for micro-batch 0's forwards through the stages before
  its first one, then does all its own work (:func:`~pipeloom.plan.cluster.placement.work_bound`); plus the
  exposed data-parallel time and the optimizer step, which the estimate adds as they are.
- *memory bound* of a layout: weights, gradients, optimizer and buffers exactly, and for the activations one
  micro-batch of each of a rank's stages (when a rank starts its last stage's forward of a micro-batch, its other
  stages' forwards of it are held, their backwards waiting; DualPipe's two copies: the larger stage), or where
  larger the forwards the busiest rank holds at the end of the warm-up its schedule's builder fixes
  (:func:`~pipeloom.schedules.warmup.warmup_forwards`; zbv: min(pp - r, m) on rank r, which the estimator checks).
  Before a layout is simulated its exact memory is computed (the schedule's held counts, :mod:`.held`, the
  replay's peak up to rounding); over the limit, it is not simulated.
- *memory floor* of a layout, below its memory bound and known before its cut is priced: the mean pipeline
  rank's share of the same terms (:meth:`Bounds.floor`). A layout over the limit on its floor is set aside
  unpriced, and priced only where the answer needs its bounds (the faster layouts over the limit named among
  the runners-up; the least memory when nothing fits), in the same order as if every one had been priced.

Layouts are taken in increasing bound order (groups before their members) until the bound reaches the best fitting
step time and the last runner-up's (with its twins'), so the answer is the fastest fitting layout of the whole space
and the runners-up the next fastest of this search; as the fitting set only grows with the memory limit, more memory
never gives a slower plan. When nothing fits, the least memory is found alike, in increasing memory-bound order."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeloom.formatting import format_bytes
from pipeloom.plan.cluster.estimate import WORKSPACE_BYTES, Estimator
from pipeloom.plan.cluster.held import warmup_peak
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import LAYOUT_KEYS, Layout, Refusals, enumerate_layouts
from pipeloom.plan.cluster.placement import rank_stages, work_bound
from pipeloom.plan.cluster.step import TWIN, Estimate, keys_text, runners_up_of, twin_key
from pipeloom.plan.cluster.unrunnable import barred_text, no_layout_runs
from pipeloom.plan.errors import LayoutError, NoLayoutFits

__all__ = ["Bounds", "Candidate", "SearchResult", "search_faster", "search_layouts"]

_ROUNDING = 1e-9
"""Relative slack for the memory from held counts against the replay's running sum (the same numbers, reordered)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A layout that can run, with its bounds."""

    layout: Layout
    """The layout."""
    time_bound: float
    """Lower bound on its step time."""
    memory_bound: float
    """Lower bound on its memory per GPU."""
    priced: bool = True
    """False: set aside on its memory floor alone (:meth:`Bounds.floor`; ``time_bound`` its group's bound), its
    bounds computed only where the search needs them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """The best layout, the runners-up with why each lost, and what the search did."""

    best: Estimate
    """The fastest layout that fits."""
    runners_up: tuple[tuple[Estimate, str], ...]
    """Other simulated layouts (the fastest fitting ones, then faster ones that do not fit) and why each lost."""
    candidates: int
    """Layouts that can run (before bounds)."""
    priced: int
    """Layouts whose time bound and memory bound were computed (the others' group bound was past the best, or their
    memory floor over the limit)."""
    simulated: int
    """Layouts priced by simulation."""
    memory_limit: float
    """The per-GPU memory limit used (bytes)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else worth printing."""


class Bounds:
    """The bounds of the module docstring, and a layout's exact memory."""

    def __init__(self, estimator: Estimator) -> None:
        self.estimator = e = estimator
        self._held = Counter((*e.kinds, "embedding", *e.tail))  # the model's layers, each on one rank (per copy)
        self._expert = sum(n * e.counts[kind].expert_params for kind, n in self._held.items())
        self._dense = sum(n * e.counts[kind].params for kind, n in self._held.items()) - self._expert
        self._ends = sum(n * e.counts[kind].params for kind, n in self._held.items() if kind in ("embedding", "head"))

    def floor(self, layout: Layout) -> float:
        """A lower bound on the memory bound before the layout's cut is priced: the mean pipeline rank's weights,
        gradients, optimizer state and one micro-batch of its stages' activations (DualPipe: the larger of its
        two, at least half of both), counted as the estimate counts a rank's, and the workspace; the busiest
        rank holds at least the mean."""
        e, share = self.estimator, layout.copies / layout.pp
        state = e.job.param_state(layout, self._dense * share / layout.tp, self._expert * share / layout.ep,
                                  ends=self._ends * share / layout.tp)  # FP8: their weights keep no FP8 copy
        held = sum(n * e.activation(layout, kind) for kind, n in self._held.items()) / layout.pp
        return (sum(state) + held + WORKSPACE_BYTES) * (1 - _ROUNDING)

    def candidate(self, layout: Layout) -> Candidate:
        """The layout's time bound and memory bound."""
        e = self.estimator
        m = e.check(layout)
        times, acts, _ = e.stages(layout)
        memory, exposed, optimizer = e.static_state(layout, times, m)
        # DualPipe's two stages on a rank are of different copies, which no dependency orders: one stage's activations
        held = max((max if layout.copies == 2 else sum)(acts[j] for j in stages) for stages in rank_stages(layout))
        held = max(held, warmup_peak(layout.schedule, layout.pp, layout.vp, m, acts))  # where its builder fixes it
        return Candidate(layout=layout, time_bound=work_bound(layout, m, times, paired=e.job.pairs(layout)) + exposed
                         + optimizer,
                         memory_bound=memory.total + held)

    def memory(self, layout: Layout) -> float:
        """The layout's memory per GPU (the estimate's up to rounding; LayoutError when its schedule cannot be
        built)."""
        e = self.estimator
        m = e.check(layout)
        times, acts, _ = e.stages(layout)
        return e.static_state(layout, times, m)[0].total + e.activation_peak(layout, m, acts)

    def group(self, layout: Layout) -> float:
        """A lower bound on the time bound of every layout of ``layout``'s group (:func:`_group_key`): the
        busiest pipeline rank does at least the mean rank's work, ``m W / pp`` with ``W`` one micro-batch's
        F + I + W through the whole model, whatever the cut, the stages per rank, schedule and FSDP; where pairs
        hide the expert all-to-all (DualPipe(V)) a pair hides at most its communication and takes at least as long
        as it (:func:`work_bound`), so there ``W`` is the larger of the work less the communication and the
        communication (DualPipe's m / 2 pairs of micro-batches through its two copies do the same work). Shrunk by
        1e-12 so that rounding never lifts it over a member's bound."""
        e = self.estimator
        m = layout.microbatches(e.job.global_batch)
        work = e.total_work(layout, paired=e.job.pairs(layout))
        if e.job.pairs(layout):
            work = max(work, e.total_work(layout) - work)
        return m * work / layout.pp * (1 - 1e-12)


def _group_key(job: Job, layout: Layout) -> tuple[Any, ...]:
    """Layouts that differ only in vp, FSDP and schedule share one group bound; those whose pairs hide the expert
    all-to-all (:meth:`Job.pairs`: DualPipe, DualPipeV, Megatron's overlapped interleaved 1F1B) each their own."""
    return (layout.tp, layout.cp, layout.ep, layout.pp, layout.dp, layout.mbs, layout.recompute,
            layout.schedule if job.pairs(layout) else "")


def search_layouts(job: Job, *, fixed: dict[str, Any] | None = None, memory_limit: float | None = None,
                   runners_up: int = 5, progress: Callable[[str], None] | None = None,
                   blocked: Callable[[Layout], list[str]] | None = None) -> SearchResult:
    """The fastest layout of ``job`` within ``memory_limit`` bytes per GPU (default: the GPU's memory), with the
    keys of ``fixed`` held and none that ``blocked`` gives problems of (what a runtime cannot run:
    :func:`~pipeloom.plan.cluster.runtime_plan.for_runtime`); NoLayoutFits when none fits, with the least memory
    per GPU any layout needs and that layout (``smallest_limit``, ``smallest_layout``: planning again with that
    limit finds a plan)."""
    result = _search(job, fixed, memory_limit, runners_up, progress, beat=None, blocked=blocked)
    assert result is not None  # without a time to beat, a search finds a layout or refuses
    return result


def search_faster(job: Job, beat: float, *, fixed: dict[str, Any] | None = None, memory_limit: float | None = None,
                  runners_up: int = 5, progress: Callable[[str], None] | None = None,
                  blocked: Callable[[Layout], list[str]] | None = None) -> SearchResult | None:
    """:func:`search_layouts` for a layout faster than ``beat`` seconds per step (another job's best, say): None
    when no fitting layout is. The bounds stop the search where they reach ``beat``, so a job none of whose
    layouts can beat it costs its group bounds and little else."""
    return _search(job, fixed, memory_limit, runners_up, progress, beat=beat, blocked=blocked)


def _search(job: Job, fixed: dict[str, Any] | None, memory_limit: float | None, runners_up: int,
            progress: Callable[[str], None] | None, *, beat: float | None,
            blocked: Callable[[Layout], list[str]] | None) -> SearchResult | None:
    fixed = dict(fixed or {})
    limit = float(memory_limit if memory_limit is not None else job.hw.memory_bytes)
    estimator = Estimator(job)
    groups: dict[tuple[Any, ...], list[Layout]] = {}
    refusals = Refusals()
    barred: Counter[str] = Counter()  # layouts ``blocked`` refused, by the layout key each problem names
    said: dict[str, str] = {}  # the first problem of each key
    stopped = 0
    for layout in enumerate_layouts(job, fixed, refusals):
        why = blocked(layout) if blocked is not None else []
        if why:
            stopped += 1
            problems = {problem.split("=", 1)[0]: problem for problem in why}
            barred.update(problems.keys())  # each problem starts "key=value"; a layout counted once per key
            for key, problem in problems.items():
                said.setdefault(key, problem)
            continue
        groups.setdefault(_group_key(job, layout), []).append(layout)
    if not groups and barred:
        raise NoLayoutFits(barred_text(job, fixed, barred, said, stopped))
    if not groups:
        raise no_layout_runs(job, fixed, refusals)
    run = _Run(Bounds(estimator), list(groups.values()), limit, runners_up, progress)
    best = run.search(beat)
    layouts = sum(map(len, run.groups))
    if best is None and beat is not None:
        return None
    if best is None:
        least = run.smallest()
        tried = f"{layouts} layout{'s' if layouts != 1 else ''} tried"
        tried += f" with {keys_text(fixed)}" if fixed else ""
        free = "fix fewer --layout keys, " if fixed else ""
        shown = f"{limit / 2**30:.1f} GiB" if limit >= 2**30 / 10 else format_bytes(limit)  # 10 MiB, not 0.0 GiB
        held = least.memory  # rounded up: that limit finds it; the part that sets it, and what lowers that part
        state, acts = held.weights + held.gradients + held.optimizer, held.activations + held.buffers - WORKSPACE_BYTES
        lower = "use more GPUs" + (", a shorter sequence" if acts > state else " (its weights, gradients and "
                                   f"optimizer state are {state / 2**30:.2f} GiB of it)")
        raise NoLayoutFits(f"no layout fits {shown} per GPU ({tried}; the least memory any needs is "
                           f"{math.ceil(held.total / 2**30 * 100) / 100:.2f} GiB ({math.ceil(held.total)} bytes), by "
                           f"{least.layout}); {free}{lower}, or raise --memory-limit",
                           smallest_limit=held.total, smallest_layout=str(least.layout))
    run.price_faster_over(best)
    return SearchResult(best=best, runners_up=runners_up_of(best, run.done, limit, runners_up), candidates=layouts,
                        priced=run.priced, simulated=len(run.done), memory_limit=limit)


class _Run:
    """One branch and bound over the groups of layouts (module docstring)."""

    def __init__(self, bounds: Bounds, groups: list[list[Layout]], limit: float, runners_up: int,
                 progress: Callable[[str], None] | None) -> None:
        self.bounds, self.groups, self.limit, self.priced = bounds, groups, limit, 0
        self.runners_up, self.progress = runners_up, progress
        self.done: list[Estimate] = []
        self.over: list[Candidate] = []  # layouts known or bounded (floor or bound) to need more than the limit
        self.memory: dict[Layout, float] = {}  # exact memory computed so far

    def _fits(self, bound: float) -> bool:
        return bound <= self.limit * (1 + _ROUNDING)

    def search(self, beat: float | None = None) -> Estimate | None:
        """The fastest fitting layout (ties: the smallest :func:`_key`), or None; with ``beat``, only one faster
        than ``beat`` seconds."""
        estimator = self.bounds.estimator
        queue: list[tuple[Any, ...]] = [(self.bounds.group(members[0]), 0, n) for n, members in enumerate(self.groups)]
        heapq.heapify(queue)
        best: Estimate | None = None
        counted: list[float] = []  # step times of the fitting layouts simulated, sorted, twins of earlier left out
        while queue:
            entry = heapq.heappop(queue)
            if best is None and beat is not None and entry[0] >= beat:  # nothing left can beat it
                break
            if entry[1] == 0:  # a group: its layouts' bounds, those that may fit queued (ties: groups first)
                for layout in self.groups[entry[2]]:
                    floor = self.bounds.floor(layout)
                    if not self._fits(floor):  # over whatever its cut: priced later only if needed
                        self.over.append(Candidate(layout=layout, time_bound=entry[0], memory_bound=floor,
                                                   priced=False))
                        continue
                    cand = self.bounds.candidate(layout)
                    self.priced += 1
                    if self._fits(cand.memory_bound):
                        heapq.heappush(queue, (cand.time_bound, 1, _key(layout), cand))
                    else:
                        self.over.append(cand)
                continue
            cand = entry[3]
            if best is not None and cand.time_bound >= self._listed_below(best, counted):
                break
            if not self._fits(self._memory(cand)):
                self.over.append(cand)
                continue
            if self.progress and len(self.done) % 20 == 0:
                self.progress(f"simulated {len(self.done)} layouts, priced {self.priced}")
            try:
                est = estimator.estimate(cand.layout)
            except LayoutError:
                continue
            # a runner-up found: one that fits, not named in a twin's line (runners_up_of)
            if est.memory.total <= self.limit and not any(twin_key(est, twin) for twin in self.done):
                bisect.insort(counted, est.step_time)
            self.done.append(est)
            if est.memory.total > self.limit:  # within the rounding of the limit
                self.over.append(cand)
            elif beat is not None and est.step_time >= beat:
                continue
            elif best is None or (est.step_time, _key(est.layout)) < (best.step_time, _key(best.layout)):
                best = est
        return best

    def _listed_below(self, best: Estimate, counted: list[float]) -> float:
        """The step time below which a layout may be listed: the best's, the last runner-up's and its twins' (within
        :data:`TWIN` of it, named in its line); until as many runners-up as asked for fit, none."""
        last = counted[self.runners_up] if len(counted) > self.runners_up else math.inf
        return max(best.step_time, last * (1 + TWIN))

    def _memory(self, cand: Candidate) -> float:
        """The layout's exact memory (inf when its schedule cannot be built), cached."""
        if cand.layout not in self.memory:
            try:
                self.memory[cand.layout] = self.bounds.memory(cand.layout)
            except LayoutError:
                self.memory[cand.layout] = float("inf")
        return self.memory[cand.layout]

    def smallest(self) -> Estimate:
        """After a search that found nothing (every layout bounded): the layout of least memory, taken in
        increasing memory-bound order until the bound passes the least exact memory found."""
        estimator = self.bounds.estimator
        least = float("inf")
        for cand in self._in_order(self.over, "memory_bound"):
            if cand.memory_bound > least * (1 + _ROUNDING):
                break
            least = min(least, self._memory(cand))
        found = []
        for cand in self.over:  # the replay decides among those within the rounding of the least
            if self.memory.get(cand.layout, float("inf")) <= least * (1 + _ROUNDING):
                try:
                    found.append(estimator.estimate(cand.layout))
                except LayoutError:
                    continue
        if not found:
            raise NoLayoutFits(f"no layout of {estimator.job.spec.family} on {estimator.job.gpus} GPUs has a schedule "
                               "that can be built; change the GPU count or the global batch")
        return min(found, key=lambda e: (e.memory.total, _key(e.layout)))

    def price_faster_over(self, best: Estimate) -> None:
        """Simulate a few layouts over the limit whose bound is below the best's time (the runners-up name the
        memory they need)."""
        estimator = self.bounds.estimator
        faster = self._in_order([c for c in self.over if c.time_bound < best.step_time], "time_bound")
        for cand in itertools.islice(faster, max(1, self.runners_up // 2) if self.runners_up else 0):
            if cand.time_bound >= best.step_time:
                break
            try:
                self.done.append(estimator.estimate(cand.layout))
            except LayoutError:
                continue

    def _in_order(self, cands: list[Candidate], bound: str) -> Iterator[Candidate]:
        """``cands`` priced, in increasing ``bound`` (ties: :func:`_key`), as sorting them all would give: those
        set aside on their floor are priced when they come first (their floor and group bound are below their
        bounds) and queued again."""
        queue = [(getattr(c, bound), c.priced, _key(c.layout), c) for c in cands]
        heapq.heapify(queue)
        while queue:
            value, priced, key, cand = heapq.heappop(queue)
            if priced:
                yield cand
                continue
            full = self.bounds.candidate(cand.layout)
            self.priced += 1
            heapq.heappush(queue, (getattr(full, bound), True, key, full))


def _key(layout: Layout) -> tuple[Any, ...]:
    """A total order of layouts (ties of time broken the same way at every memory limit)."""
    return tuple(getattr(layout, key) for key in LAYOUT_KEYS)
