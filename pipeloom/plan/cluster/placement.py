"""Where a layout's layers and stages go: the cut of the decoder layers into stages (even, or balanced over the
pipeline ranks' work), each stage's pipeline rank (looped, in a V, or DualPipe's two copies), the sends between
stages, and a lower bound on any schedule's makespan from the stages' work."""

from __future__ import annotations

import functools
import heapq
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from pipeloom.plan.cluster.efficiency import collective_seconds, domain_ranks, p2p_seconds
from pipeloom.plan.cluster.job import GRAD_REDUCE, Job
from pipeloom.plan.cluster.layout import SCHEDULES, Layout
from pipeloom.plan.cluster.step import PhaseTimes

__all__ = ["Cut", "even_counts", "balanced_counts", "cut_of", "cut_ranks", "stage_layers", "rank_stages", "tied_copy",
           "schedule_microbatches", "work_bound", "mode_shapes", "stage_send_seconds", "crossing_sends",
           "with_blocking_sends"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cut:
    """The layers of each stage of one cut, and the stages' distinct shapes."""

    counts: tuple[int, ...]
    """Per model stage, its decoder layers."""
    layers: list[tuple[str, ...]]
    """Per schedule stage (the model stages; twice over for DualPipe's two copies), its layer kinds in model order."""
    shapes: tuple[tuple[tuple[str, int], ...], ...]
    """The distinct ``(kind, count)`` multisets of a stage's layers, the embedding and the head included."""
    shape_of: tuple[int, ...]
    """Per stage, the index of its shape."""


def cut_of(kinds: Sequence[str], counts: tuple[int, ...], tail: tuple[str, ...], copies: int = 1) -> Cut:
    """The cut of the layers ``kinds`` with ``counts[j]`` in stage ``j``: the embedding joins the first stage's
    layers, ``tail`` (the head, multi-token prediction) the last's; with 2 ``copies`` (DualPipe) the schedule's
    stages are the cut's stages twice over, copy by copy."""
    layers = stage_layers(kinds, counts) * copies
    shapes: dict[tuple[tuple[str, int], ...], int] = {}
    shape_of = []
    for n, held in enumerate(layers):
        j = n % len(counts)
        extra = (("embedding",) if j == 0 else ()) + (tail if j == len(counts) - 1 else ())
        shape = tuple(sorted(Counter((*held, *extra)).items()))
        shape_of.append(shapes.setdefault(shape, len(shapes)))
    return Cut(counts=counts, layers=layers, shapes=tuple(shapes), shape_of=tuple(shape_of))


def mode_shapes(cut: Cut, recomputed: int | None) -> tuple[tuple[tuple[tuple[bool, str, int], ...], ...],
                                                              tuple[int, ...]]:
    """The distinct stage shapes of ``cut`` as ``(own, kind, count)`` triples, ``own`` for layers priced with the
    layout's recomputation (else without), and each stage's shape index: with ``recomputed`` None, every layer
    (the cut's own shapes); with N, each stage's first N decoder layers in model order, its embedding and tail
    (Megatron-Core's block method: :attr:`~pipeloom.plan.cluster.job.Job.recompute_layers`)."""
    if recomputed is None:
        return tuple(tuple((True, kind, count) for kind, count in shape) for shape in cut.shapes), cut.shape_of
    shapes: dict[tuple[tuple[bool, str, int], ...], int] = {}
    shape_of = []
    for j, held in enumerate(cut.layers):
        own = Counter(dict(cut.shapes[cut.shape_of[j]]))
        own.subtract(held[recomputed:])
        shape = (tuple((True, kind, count) for kind, count in sorted(own.items()) if count)
                 + tuple((False, kind, count) for kind, count in sorted(Counter(held[recomputed:]).items())))
        shape_of.append(shapes.setdefault(shape, len(shapes)))
    return tuple(shapes), tuple(shape_of)


def stage_send_seconds(job: Job, layout: Layout) -> float:
    """Seconds of one stage-to-stage send of a micro-batch's hidden states (over tp: Megatron's scatter-gather), and
    where layers reuse an earlier layer's top-k keys (GLM-5's shared indexer layers) the int32 top-k indices too, as
    at a boundary before such a layer (every boundary is priced so). The schedule's boundaries between ranks
    (:func:`crossing_sends`) that cross a scale-up domain go over the NIC, the others over the scale-up link: each
    send is priced at their mean, so that a micro-batch's way through the pipeline takes what its sends add up to."""
    spec, tokens = job.spec, layout.mbs * job.seq // layout.cp
    hidden = tokens * spec.hidden * 2 / layout.tp
    if spec.indexer is not None and len(spec.indexer_layers) < spec.layers:
        hidden += tokens * 4 * spec.indexer.topk / layout.tp
    crossing, sends = crossing_sends(layout, job.hw.domain_gpus)
    return (crossing * p2p_seconds(job.hw, hidden, same_domain=False)
            + (sends - crossing) * p2p_seconds(job.hw, hidden, same_domain=True)) / sends if sends else 0.0


def tied_copy(job: Job, layout: Layout, stages: Sequence[int]) -> tuple[float, float]:
    """For a tied embedding and head, a rank holding these schedule stages: parameters per GPU of its own copy of the
    weight (a head without the embedding: Megatron's copy on the last stage), and the seconds of the two ends'
    gradient all-reduce after the backward (ranks pp - 1 stages apart) where it holds one end without the other (a
    V's first rank holds both, and so do DualPipe's end ranks, one copy's embedding and the other's head: their
    mirror ranks' reduce already sums the weight's gradients)."""
    per_copy = (2 * layout.pp if SCHEDULES[layout.schedule] in ("v", "two-copy") else layout.stages) // layout.copies
    held = {j % per_copy for j in stages}  # DualPipe's copies are alike: one weight serves both
    if not job.spec.tied or (0 in held) == (per_copy - 1 in held):
        return 0.0, 0.0
    tied, place = job.spec.vocab * job.spec.hidden / layout.tp, layout.tp * layout.cp * layout.dp
    # the pair of each place of the first stage, GPU i and i + (pp - 1) x place: in one domain for every i, or not
    apart = any(i // job.hw.domain_gpus != (i + (layout.pp - 1) * place) // job.hw.domain_gpus
                for i in range(min(place, job.hw.domain_gpus)))
    return tied * (per_copy - 1 in held), collective_seconds(job.hw, "all_reduce", GRAD_REDUCE[job.grad_reduce] * tied,
                                                            2, ranks_per_domain=1 if apart else 2)


def crossing_sends(layout: Layout, domain: int) -> tuple[int, int]:
    """``(crossing, sends)``: of the sends between consecutive stages that change rank (the schedule's placement:
    :func:`rank_stages`; an interleaved schedule's last rank sends to the first), those whose two GPUs sit in
    different scale-up domains of ``domain`` GPUs. Pipeline rank ``k`` of the first pipeline is GPU ``k x tp x cp x
    dp`` (Megatron's rank order tp, cp, dp, pp)."""
    stride = layout.tp * layout.cp * layout.dp
    rank_of = {stage: rank for rank, stages in enumerate(rank_stages(layout)) for stage in stages}
    pairs = [(rank_of[s], rank_of[s + 1]) for s in range(len(rank_of) - 1)
             if rank_of[s] != rank_of[s + 1] and (layout.copies == 1 or s + 1 != layout.stages)]
    return sum(a * stride // domain != b * stride // domain for a, b in pairs), len(pairs)


def with_blocking_sends(job: Job, layout: Layout, times: list[PhaseTimes]) -> list[PhaseTimes]:
    """The stages' ``times`` with blocking exchanges (``Job.p2p_overlap`` off): the rank waits for each transfer,
    so a stage's F sends forward and its I sends back inside the stage's time; the 1/tp pieces are all-gathered
    over tp after they arrive (Megatron's scatter-gather)."""
    hidden = layout.mbs * job.seq // layout.cp * job.spec.hidden * 2.0
    send = stage_send_seconds(job, layout) + collective_seconds(job.hw, "all_gather", hidden, layout.tp,
                                                                 ranks_per_domain=domain_ranks(layout.tp, 1, job.hw))
    last = layout.stages - 1  # of each copy
    return [replace(t, f=t.f + (send if j % layout.stages < last else 0.0),
                    i=t.i + (send if j % layout.stages > 0 else 0.0)) for j, t in enumerate(times)]


def even_counts(layers: int, stages: int) -> tuple[int, ...]:
    """Decoder layers per stage of an even cut: ``layers // stages`` each, the remainder going to the middle
    stages first (the first holds the embedding, the last the head; with more stages than layers, the first and
    the last hold only those)."""
    base, extra = divmod(layers, stages)
    order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 2 else list(range(stages))
    return tuple(base + (j in order[:extra]) for j in range(stages))


def balanced_counts(kinds: Sequence[str], ranks: Sequence[Sequence[int]], work: Mapping[str, float], *,
                    first: float, last: float) -> tuple[int, ...]:
    """Decoder layers per stage that balance the pipeline ranks' work: ``kinds`` the layers' kinds in model
    order, ``ranks`` each pipeline rank's stages, ``work`` seconds per micro-batch of a layer of each kind,
    ``first`` / ``last`` what the first stage (the embedding) and the last (the head, multi-token prediction)
    add. With one kind of layer, the rank fill (:func:`_rank_fill`) is optimal; with one stage per rank, the
    cut with the least busy stage (:func:`_stage_cut`) is; otherwise a local search (:class:`_Balance`) from the
    rank fill, or the even cut (:func:`even_counts`) where that is better: the ranks' loads sorted from the
    largest down, compared in that order, then the busiest stage (a stage busier than the others holds up the
    stages after it: under interleaving the ranks' loads alone leave the cut of a rank's layers over its stages
    open). Never busier than the even cut; every stage keeps at least one
    layer, but where there are more stages than layers: then the even cut, one layer per stage and none on the
    first or last (or both)."""
    stages = sum(len(r) for r in ranks)
    if stages == 1:
        return (len(kinds),)
    if stages > len(kinds):  # one layer per stage, the embedding or the head (or both) on a stage of its own
        return even_counts(len(kinds), stages)
    if len(set(kinds)) == 1:
        return _rank_fill(kinds, ranks, work, first, last)
    if stages == len(ranks):
        return _stage_cut(kinds, stages, work, first, last)
    balance = _Balance(kinds, ranks, work, first, last)
    ends = [even_counts(len(kinds), stages), balance.descend(_rank_fill(kinds, ranks, work, first, last))]
    return min(ends, key=lambda counts: (balance.rounded(balance.rank_loads(counts)),
                                         balance.rounded(balance.stage_loads(counts))[0], counts))


def _rank_fill(kinds: Sequence[str], ranks: Sequence[Sequence[int]], work: Mapping[str, float], first: float,
               last: float) -> tuple[int, ...]:
    """Layers per rank that minimise the busiest rank's load if every layer did the average work (one more layer
    at a time to the rank it leaves least busy; exact for one kind of layer, where any counts are a cut), each
    rank's layers spread over its stages so that its busiest stage is least busy, the embedding and the head
    counted (one more layer at a time to the stage it leaves least busy, ties to a stage without them, then the
    earlier). Ties go to the later ranks."""
    stages = sum(len(r) for r in ranks)
    mean = sum(work[k] for k in kinds) / len(kinds)
    extra = [(first if 0 in held else 0.0) + (last if stages - 1 in held else 0.0) for held in ranks]
    held_layers = [len(held) for held in ranks]
    # ties go to the later ranks, which hold fewer micro-batches' activations under 1F1B-like schedules
    heap = [(mean * (n + 1) + e, -r) for r, (n, e) in enumerate(zip(held_layers, extra))]
    heapq.heapify(heap)
    for _ in range(len(kinds) - stages):
        _, r = heapq.heappop(heap)
        held_layers[-r] += 1
        heapq.heappush(heap, (mean * (held_layers[-r] + 1) + extra[-r], r))
    counts = [0] * stages
    for held, n in zip(ranks, held_layers):
        ends = {j: (first if j == 0 else 0.0) + (last if j == stages - 1 else 0.0) for j in held}
        for j in held:
            counts[j] = 1
        for _ in range(n - len(held)):  # to the stage it leaves least busy: a stage with an end gets fewer
            j = min(held, key=lambda j: (mean * (counts[j] + 1) + ends[j], ends[j] > 0, j))
            counts[j] += 1
    return tuple(counts)


def _stage_cut(kinds: Sequence[str], stages: int, work: Mapping[str, float], first: float,
               last: float) -> tuple[int, ...]:
    """The cut whose busiest stage is least busy (stages taken alone, each with at least one layer): bisection
    on the busiest stage's load, each bound checked by filling the stages greedily in model order."""
    weights = [work[k] for k in kinds]
    layers = len(weights)

    def fill(bound: float) -> list[int] | None:
        counts, load = [0], first
        for n, w in enumerate(weights):
            tail = last if n == layers - 1 else 0.0
            if counts[-1] and load + w + tail > bound:
                counts.append(0)
                load = 0.0
            counts[-1] += 1
            load += w
        if len(counts) > stages or load + last > bound:
            return None
        while len(counts) < stages:  # split the first stage of several layers: no stage gets busier
            j = next(j for j, c in enumerate(counts) if c > 1)
            counts[j:j + 1] = [counts[j] - 1, 1]
        return counts

    lo = max(max(weights), first + weights[0], last + weights[-1])
    hi = first + last + sum(weights)
    best = fill(hi)
    for _ in range(60):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        found = fill(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    assert best is not None
    return tuple(best)


class _Balance:
    """The local search of :func:`balanced_counts`: a layer moves from a stage of a busiest rank to a
    neighbouring stage while the sorted rank loads fall."""

    def __init__(self, kinds: Sequence[str], ranks: Sequence[Sequence[int]], work: Mapping[str, float],
                 first: float, last: float) -> None:
        self.ranks, self.first, self.last = ranks, first, last
        self.stages = sum(len(r) for r in ranks)
        self.cumulative = list(accumulate((work[k] for k in kinds), initial=0.0))
        self.owner = [0] * self.stages
        for r, held in enumerate(ranks):
            for j in held:
                self.owner[j] = r
        total = sum(work[k] for k in kinds) + first + last
        self.scale = total if total > 0 else 1.0

    def load(self, j: int, begin: int, end: int) -> float:
        """Stage ``j`` holding layers ``begin .. end-1``."""
        extra = (self.first if j == 0 else 0.0) + (self.last if j == self.stages - 1 else 0.0)
        return extra + self.cumulative[end] - self.cumulative[begin]

    def rounded(self, values: Sequence[float]) -> list[float]:
        """Sorted from the largest down, rounded so that ranks of equal work compare equal."""
        return sorted((round(x / self.scale, 12) for x in values), reverse=True)

    def stage_loads(self, counts: Sequence[int]) -> list[float]:
        """Each stage's load under the cut ``counts``."""
        starts = list(accumulate(counts, initial=0))
        return [self.load(j, starts[j], starts[j + 1]) for j in range(self.stages)]

    def rank_loads(self, counts: Sequence[int]) -> list[float]:
        """Each rank's load under the cut ``counts``."""
        per_rank = [0.0] * len(self.ranks)
        for j, load in enumerate(self.stage_loads(counts)):
            per_rank[self.owner[j]] += load
        return per_rank

    @staticmethod
    def _nearest(light: list[bool], j: int) -> tuple[int, ...]:
        """The nearest stage of a least busy rank before stage ``j`` and after it (where there is one)."""
        before = next((k for k in range(j - 1, -1, -1) if light[k]), None)
        after = next((k for k in range(j + 1, len(light)) if light[k]), None)
        return tuple(k for k in (before, after) if k is not None)

    def descend(self, counts: Sequence[int]) -> tuple[int, ...]:
        """From ``counts``, the first move that lowers the sorted loads until none does: a layer from a stage of
        a busiest rank to a stage next to it or to the nearest stage of a least busy rank on either side, each
        boundary between them shifted by one. Two sorted vectors that differ only in the loads of the ranks a
        move touches compare as those ranks' loads do."""
        owner, stages, scale = self.owner, self.stages, self.scale
        starts = list(accumulate(counts, initial=0))  # stage j: layers starts[j] .. starts[j+1]-1
        stage_load = [self.load(j, starts[j], starts[j + 1]) for j in range(stages)]
        per_rank = [sum(stage_load[j] for j in held) for held in self.ranks]
        while True:
            level = [round(x / scale, 12) for x in per_rank]
            busiest = [r for r, x in enumerate(level) if x == max(level)]
            lightest = {r for r, x in enumerate(level) if x == min(level)}
            light = [owner[j] in lightest for j in range(stages)]
            moves = [(j, to) for r in busiest for j in self.ranks[r] if starts[j + 1] - starts[j] >= 2
                     for to in (j - 1, j + 1, *self._nearest(light, j)) if 0 <= to < stages and to != j]
            for j, to in moves:
                step = 1 if to > j else -1
                # boundaries between j and to move one layer toward j: starts[b] for b in (j+1 .. to) or (to+1 .. j)
                bounds = range(j + 1, to + 1) if step > 0 else range(to + 1, j + 1)
                new_starts = {b: starts[b] - step for b in bounds}
                if any(new_starts.get(b + 1, starts[b + 1]) - new_starts.get(b, starts[b]) < 1
                       for b in range(min(j, to), max(j, to) + 1)):
                    continue
                changed = {}
                for stage in range(min(j, to), max(j, to) + 1):
                    changed[stage] = self.load(stage, new_starts.get(stage, starts[stage]),
                                               new_starts.get(stage + 1, starts[stage + 1]))
                trial: dict[int, float] = {}
                for stage, new in changed.items():
                    r = owner[stage]
                    trial[r] = trial.get(r, per_rank[r]) + new - stage_load[stage]
                if self.rounded(list(trial.values())) < self.rounded([per_rank[r] for r in trial]):
                    for b, first_layer in new_starts.items():
                        starts[b] = first_layer
                    for stage, new in changed.items():
                        stage_load[stage] = new
                    for r, rank_load in trial.items():
                        per_rank[r] = rank_load
                    break
            else:
                return tuple(b - a for a, b in zip(starts, starts[1:]))


def stage_layers(kinds: Sequence[str], counts: Sequence[int]) -> list[tuple[str, ...]]:
    """The layer kinds of each stage in model order, ``counts[j]`` layers in stage ``j``."""
    starts = list(accumulate(counts, initial=0))
    return [tuple(kinds[a:b]) for a, b in zip(starts, starts[1:])]


def schedule_microbatches(layout: Layout, m: int) -> int:
    """The schedule's micro-batches for ``m`` per pipeline per step: DualPipe's counts a pair (one per end) once."""
    return m // layout.copies


def _rank_work(times: list[PhaseTimes], stages: Sequence[int], paired: bool, *, weights: bool = True) -> float:
    """The least busy time one micro-batch's parts on a rank holding ``stages`` can take: F + I + W of each (without
    ``weights``: F + I); with ``paired`` (overlapped pairs of a forward and a backward of the rank's stages,
    :func:`pipeloom.ir.pair_duration`) each part's communication hidden at most under the compute of the other part
    of its pair, so each F's ``f_comm`` at most under the rank's longest backward compute (I + W less ``i_comm``) and
    each I's ``i_comm`` under its longest forward compute; and never below the communication itself, which a pair
    only hides."""
    work = sum(times[j].f + times[j].i + (times[j].w if weights else 0.0) for j in stages)
    if not paired:
        return work
    longest_b = max(times[j].i + times[j].w - times[j].i_comm for j in stages)
    longest_f = max(times[j].f - times[j].f_comm for j in stages)
    hidden = sum(min(times[j].f_comm, longest_b) + min(times[j].i_comm, longest_f) for j in stages)
    return max(work - hidden, sum(times[j].f_comm + times[j].i_comm for j in stages))


def work_bound(layout: Layout, m: int, times: list[PhaseTimes], *, paired: bool) -> float:
    """A lower bound on any schedule's makespan (``m`` micro-batches, ``times`` per schedule stage): a rank
    starts after micro-batch 0's forwards through the stages before its first one, then does all its own work
    (``paired``: the schedule runs overlapped pairs, :meth:`~pipeloom.plan.cluster.job.Job.pairs`; a pair of a
    forward and a backward takes F + B less the communication each part hides under the other's compute:
    :func:`_rank_work`; DualPipe's rank starts on the copy that reaches it first). With one copy of the model, also:
    the last input gradient of a rank's first stage ``s`` waits for every forward and input gradient the rank runs
    (each micro-batch's pass through the rank's later stages comes before its input gradient at ``s``), and the input
    gradients of stages ``s - 1 .. 0`` follow it on the other ranks."""
    bound = 0.0
    before = list(accumulate((t.f for t in times), initial=0.0))  # before[j]: forwards of stages 0 .. j-1
    # a full backward in micro-batch order (1F1B, interleaved): a rank's last action is its first stage's B of the
    # last micro-batch, after which that micro-batch's B still runs through the stages before it on the other ranks
    full_b = layout.schedule in ("1f1b", "interleaved-1f1b")
    backs = list(accumulate((t.i + t.w for t in times), initial=0.0)) if full_b else []
    runs = schedule_microbatches(layout, m)
    for stages in rank_stages(layout):
        busy = runs * _rank_work(times, stages, paired)
        wait = before[min(stages)]
        if layout.copies == 2:  # the other copy's stages pp .. (its stage here) - 1 come first
            wait = min(wait, before[max(stages)] - before[layout.pp])
        bound = max(bound, wait + busy)
        if layout.copies == 1:
            first = min(stages)
            drain = sum(times[j].i - (times[j].i_comm if paired else 0.0) for j in range(first))
            bound = max(bound, wait + runs * _rank_work(times, stages, paired, weights=False) + drain)
            if full_b:
                bound = max(bound, wait + busy + backs[first])
    return bound


def rank_stages(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """Per pipeline rank, its schedule stages in order: looped (interleaved, linear: stage s on rank s mod pp),
    a V, or DualPipe's two copies (stage ``s < pp`` of the copy fed from rank 0 on rank ``s``, stage ``pp + k``
    of the other copy on rank ``pp - 1 - k``: the V's ranks)."""
    return _rank_stages(SCHEDULES[layout.schedule] in ("v", "two-copy"), layout.pp, layout.vp)


@functools.lru_cache(maxsize=1024)
def _rank_stages(v: bool, pp: int, vp: int) -> tuple[tuple[int, ...], ...]:
    if v:
        return tuple((r, 2 * pp - 1 - r) for r in range(pp))
    return tuple(tuple(range(r, pp * vp, pp)) for r in range(pp))


def cut_ranks(layout: Layout) -> Sequence[Sequence[int]]:
    """Per pipeline rank, the model stages of the cut it holds, each rank once (:func:`balanced_counts`'s
    ``ranks``): :func:`rank_stages`, but for DualPipe's copies model stages ``r`` and ``pp - 1 - r`` on ranks
    ``r`` and ``pp - 1 - r`` alike, listed once."""
    if layout.copies == 2:
        return [[r, layout.pp - 1 - r] for r in range(layout.pp // 2)]
    return rank_stages(layout)
