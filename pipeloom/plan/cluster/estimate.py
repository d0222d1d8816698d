"""Step time and memory per GPU of one layout: per-stage F/I/W costs from :mod:`layer_time`, the pipeline
schedule replayed by pipeloom's simulator with those costs (its makespan and each rank's peak of held
activations), the data-parallel gradient and parameter exchange that the backward and forward do not hide,
and the optimizer step. :class:`Estimator` caches the simulations by stage shape."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pipeloom.errors import PipeloomError
from pipeloom.ir import Schedule, pair_duration, paired_forward_backward
from pipeloom.plan.cluster.counts import layer_counts
from pipeloom.plan.cluster.dispatch import pair_slowdown
from pipeloom.plan.cluster.efficiency import collective_seconds, domain_ranks, hidden_cost, memory_seconds
from pipeloom.plan.cluster.held import RankHeld, held_profile, peak_held, profiled_microbatches, replay_stages
from pipeloom.plan.cluster.job import ADAM_MOMENTS, GRAD_REDUCE, Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import PAIRED, SCHEDULES, Layout
from pipeloom.plan.cluster.model.kinds import block_kind, layer_kinds
from pipeloom.plan.cluster.mtp import mtp_times
from pipeloom.plan.cluster.placement import (
    Cut,
    balanced_counts,
    cut_of,
    cut_ranks,
    even_counts,
    mode_shapes,
    rank_stages,
    schedule_microbatches,
    stage_send_seconds,
    tied_copy,
    with_blocking_sends,
    work_bound,
)
from pipeloom.plan.cluster.recompute import kept_activations, kept_scores
from pipeloom.plan.cluster.step import Estimate, Memory, PhaseTimes, add_times, work_parts
from pipeloom.plan.errors import LayoutError
from pipeloom.schedules import build_schedule
from pipeloom.schedules.zbv import first_stage_warmups, warmup_floor
from pipeloom.sim import compile_schedule
from pipeloom.sim_replay import CompiledSchedule
from pipeloom.stages import Costs

__all__ = ["Estimator", "WORKSPACE_BYTES", "BUCKET_BYTES", "ZBV_RATIO_STEPS"]

WORKSPACE_BYTES = 2 * 1024**3
"""Memory every GPU holds besides the model: the CUDA context and library kernels (about 1 GiB) and NCCL's buffers
(0.5-1 GiB at scale: NVIDIA's NCCL docs, NCCL_BUFFSIZE x channels); a stated allowance, not fitted to any run."""
BUCKET_BYTES = 40e6 * 2
"""Data-parallel gradient bucket: Megatron's default 40M parameters in bf16 (a backward's last overlaps nothing)."""
ZBV_RATIO_STEPS = (0.5, 0.25)
"""zbv's order is built with I / F and W / F rounded to these steps: layouts whose ratios round alike share one
build (a zbv build takes about 0.4 s), and the replay prices the order with the layout's exact times (W, which
fills the bubbles, matters more to the order than I)."""


class Estimator:
    """Prices layouts of one :class:`Job`; caches layer times and schedule replays (no state but caches)."""

    def __init__(self, job: Job) -> None:
        self.job, spec, self.kinds = job, job.spec, layer_kinds(job.spec)
        self.tail = ("head",) + ("mtp",) * spec.mtp  # the last stage's kinds after its layers: head, MTP modules
        self.counts = {k: layer_counts(spec, k, job.seq) for k in ("embedding", *set(self.tail), *set(self.kinds))}
        self._layer: dict[tuple[Any, ...], PhaseTimes] = {}
        self._replays: dict[tuple[Any, ...], tuple[float, float, float]] = {}
        self._schedules: dict[tuple[Any, ...], Schedule] = {}
        self._compiled: dict[tuple[Any, ...], CompiledSchedule] = {}
        self._stages: dict[tuple[Any, ...], tuple[list[PhaseTimes], list[float], list[tuple[str, ...]]]] = {}
        self._static: dict[tuple[Any, ...], tuple[Memory, float, float]] = {}
        self._dp: dict[tuple[Any, ...], tuple[float, float]] = {}
        self._work: dict[tuple[Any, ...], float] = {}
        self._acts: dict[tuple[Any, ...], float] = {}
        self._cuts: dict[tuple[tuple[int, ...], int], Cut] = {}
        self._counts: dict[tuple[Any, ...], tuple[int, ...]] = {}  # the cut per layout's layer shapes and placement
        self._balanced: dict[tuple[Any, ...], tuple[int, ...]] = {}  # the balanced cut per placement and work ratios
        self._ranks: dict[tuple[Any, ...], tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...]] = {}
        self._profiles: dict[tuple[Any, ...], tuple[RankHeld, ...]] = {}
        self._model_kinds = tuple(sorted(Counter((*self.kinds, "embedding", *self.tail)).items()))
        # the MTP modules' matmuls are computed work of the step and counted too (their head pass included)
        self.model_flops = job.global_batch * sum(self.counts[k].model_flops for k in (*self.kinds, *self.tail))
        a, h = spec.attention, spec.hidden
        mlp = spec.experts.top_k * spec.experts.intermediate if spec.moe_layers and spec.experts else spec.intermediate
        keep = self.counts[self.kinds[-1]].activations["none"]
        # a split backward's W needs after I the four projections' inputs (two norm outputs, attention out, MLP act)
        kept = keep.sequence + keep.tensor + keep.replicated
        self.w_fraction = min(1.0, 2 * (2 * h + a.heads * a.v_dim + mlp) / kept)

    def check(self, layout: Layout) -> int:
        """:meth:`Layout.check` against this job: LayoutError when it cannot run; else its micro-batches."""
        return layout.check(self.job)

    def times(self, layout: Layout, kind: str) -> PhaseTimes:
        """:func:`layer_times`, cached by what it depends on (a layer without experts: only whether ep > 1)."""
        ep = layout.ep if kind == "mtp" or block_kind(kind) == "moe" else layout.ep > 1
        key = (kind, layout.tp, layout.cp, ep, layout.mbs, layout.recompute)
        if key not in self._layer:
            self._layer[key] = (mtp_times(self.job, layout) if kind == "mtp" else layer_times(self.job, layout, kind))
        return self._layer[key]

    def work(self, layout: Layout, kind: str, *, paired: bool = False) -> float:
        """Seconds of F + I + W of one micro-batch through one ``kind`` (``paired``: less its F's and I's comm)."""
        t = self.times(layout, kind)
        return t.f + t.i + t.w - ((t.f_comm + t.i_comm) if paired else 0.0)

    def total_work(self, layout: Layout, *, paired: bool = False) -> float:
        """:meth:`work` through the whole model (every layer, the embedding and the head): whatever the cut, the
        stages' work adds up to it (blocking pipeline sends only add to the stages); under :attr:`Job.recompute_layers`,
        whose recomputed layers depend on the cut, the work without recomputation (at most the stages')."""
        layout = self._unblocked(layout)
        key = (layout.tp, layout.cp, layout.ep, layout.mbs, layout.recompute, paired)
        if key not in self._work:
            self._work[key] = sum(count * self.work(layout, kind, paired=paired) for kind, count in self._model_kinds)
        return self._work[key]

    def stages(self, layout: Layout) -> tuple[list[PhaseTimes], list[float], list[tuple[str, ...]]]:
        """Per schedule stage (the model stages; twice over for DualPipe's copies): F/I/W seconds per
        micro-batch, activation bytes per micro-batch, its layers (priced once per distinct stage shape: its
        count of each layer kind, the embedding, the head; under :attr:`Job.recompute_layers` N, the first N
        decoder layers with the layout's full recomputation and the others without: :func:`mode_shapes`)."""
        counts = self.stage_counts(layout)
        key = (layout.tp, layout.cp, layout.ep, layout.mbs, layout.recompute, counts, layout.copies)
        if key not in self._stages:
            cut, plain = self._cut(counts, layout.copies), self._unblocked(layout)
            shapes, shape_of = mode_shapes(cut, self.job.recompute_layers if plain is not layout else None)
            priced = []
            for shape in shapes:
                parts = [(layout if own else plain, kind, count) for own, kind, count in shape]
                each = [self.times(mode, kind) for mode, kind, count in parts for _ in range(count)]
                kept = sum(count * self.activation(mode, kind) for mode, kind, count in parts)
                priced.append((add_times(*each), kept))
            self._stages[key] = ([priced[s][0] for s in shape_of], [priced[s][1] for s in shape_of], cut.layers)
        times, acts, layers = self._stages[key]
        if self.job.blocking_sends(layout):
            times = with_blocking_sends(self.job, layout, times)
        return times, acts, layers

    def _unblocked(self, layout: Layout) -> Layout:
        """``layout`` without recomputation where :attr:`Job.recompute_layers` recomputes only some layers of each
        stage (the twin whose work the cut is balanced on and the group bound counts); else ``layout`` itself."""
        if layout.recompute == "full" and self.job.recompute_layers:
            return dataclasses.replace(layout, recompute="none")
        return layout

    def stage_counts(self, layout: Layout) -> tuple[int, ...]:
        """Decoder layers per model stage (:attr:`Job.stage_cut`): the explicit cut, the even cut, or the cut that
        balances the pipeline ranks' work per micro-batch (F + I + W; under DualPipe(V) less the communication its
        pairs may hide) with this layout's layer times."""
        if layout.stages == 1 or self.job.cut() is not None:  # one stage, or the cut given (Layout.check: its size)
            return self.job.cut() or (len(self.kinds),)
        if self.job.stage_cut == "even":
            return even_counts(len(self.kinds), layout.stages)
        layout = self._unblocked(layout)
        pair = self.job.pairs(layout)
        placement = SCHEDULES[layout.schedule]
        known = (layout.tp, layout.cp, layout.ep, layout.mbs, layout.recompute, layout.pp, layout.vp, placement, pair)
        if known in self._counts:
            return self._counts[known]
        work = {kind: self.work(layout, kind, paired=pair) for kind in {*self.kinds, "embedding", *self.tail}}
        # the cut depends on the work's ratios only: to 1 % of a last layer's, so that layouts whose ratios agree
        # share one search (the cut is a search's result, and any cut is priced exactly)
        unit = work[self.kinds[-1]] if work[self.kinds[-1]] > 0 else 1.0
        ratios = {kind: round(value / unit, 2) for kind, value in work.items()}
        key = (layout.pp, layout.vp, placement, tuple(sorted(ratios.items())))
        if key not in self._balanced:
            self._balanced[key] = balanced_counts(self.kinds, cut_ranks(layout), ratios, first=ratios["embedding"],
                                                  last=sum(ratios[kind] for kind in self.tail))
        self._counts[known] = self._balanced[key]
        return self._counts[known]

    def _cut(self, counts: tuple[int, ...], copies: int) -> Cut:
        """:func:`~pipeloom.plan.cluster.placement.cut_of` the cut ``counts``, cached."""
        return self._cuts.get((counts, copies)) or self._cuts.setdefault(
            (counts, copies), cut_of(self.kinds, counts, self.tail, copies))

    def activation(self, layout: Layout, kind: str) -> float:
        """Activation bytes one micro-batch keeps in one layer of ``kind`` on one GPU."""
        return self._keep(kind, layout.tp, layout.cp, layout.mbs, layout.recompute)

    def _keep(self, kind: str, tp: int, cp: int, mbs: int, recompute: str) -> float:
        key, job = (kind, tp, cp, mbs, recompute), self.job
        if key not in self._acts:  # with the scores in HBM, those the backward reads (kept_scores)
            keep = kept_activations(job.selective, job.spec, self.counts[kind], recompute, fp8=job.saved_fp8())
            self._acts[key] = keep.per_gpu(tp=tp, cp=cp, sp=tp > 1 and job.sequence_parallel) * mbs * job.seq + (
                kept_scores(kind, recompute, job.selective, heads=max(1, job.spec.attention.heads // tp),
                            queries=mbs * job.seq // cp, keys=job.seq) if job.attention == "materialized" else 0)
        return self._acts[key]

    def schedule(self, layout: Layout, m: int) -> Schedule:
        """The layout's schedule for ``m`` micro-batches (cached by name, pp, vp, m and zbv's cost ratios): the
        order of every schedule here but zbv does not depend on the costs (tested), so they are built with unit
        costs; zbv's cost-aware order with mean I / F and W / F (:meth:`_zbv_ratios`: built for F = I = W, its
        steady state ran 13 % slower than the busiest rank's work on Llama 3 8B at tp 8 x pp 8), refused should its
        rank 0 warm up shallower than the search's bound counts (never seen). W holds :attr:`w_fraction` of F's."""
        key = self._schedule_key(layout, m)
        name, pp, vp, _, b, w, _ = key
        if key not in self._schedules:
            split = name in ("zb-h1", "zbv", "v-half", "v-min", *PAIRED)
            costs = Costs(f=1.0, b=b if split else 2.0, w=w, memory=1.0, w_memory=self.w_fraction if split else 0.0)
            options = {"stages_per_rank": vp} if SCHEDULES[name] == "interleaved" else {}
            try:
                built = build_schedule(name, pp, m, costs=costs, **options)
            except PipeloomError as error:
                raise LayoutError(f"{name} cannot run pp={pp}, vp={vp} with {m} micro-batches: {error}") from None
            if name == "zbv" and any(n < least for n, least in zip(first_stage_warmups(built), warmup_floor(pp, m))):
                raise LayoutError(f"zbv (pp={pp}, {m} micro-batches) warms a rank up shallower than 1F1B, which the "
                                  "planner's memory bound counts: not priced (please report it)")
            # Job.moe_overlap: interleaved 1F1B's backward-forward neighbours run as pairs (DualPipe's are built so)
            self._schedules[key] = paired_forward_backward(built) if self.job.overlap_pairs(layout) else built
        return self._schedules[key]

    def _schedule_key(self, layout: Layout, m: int) -> tuple[str, int, int, int, float, float, bool]:
        b, w = self._zbv_ratios(layout) if layout.schedule in ("zbv", "v-half", "v-min") else (1.0, 1.0)
        return layout.schedule, layout.pp, layout.vp, m, b, w, self.job.pairs(layout)

    def _zbv_ratios(self, layout: Layout) -> tuple[float, float]:
        """The mean I / F and W / F of the layout's twin without recomputation, rounded to :data:`ZBV_RATIO_STEPS`
        (at least one step): a layout that recomputes runs its twin's order with longer tasks, and a fixed order
        only slows when its tasks lengthen, so recomputing is never priced faster than not (and holds no more)."""
        times = self.stages(dataclasses.replace(layout, recompute="none"))[0]
        f = sum(t.f for t in times)
        i, w = (max(step, round(sum(x) / f / step) * step) if f > 0 else 1.0
                for x, step in zip(([t.i for t in times], [t.w for t in times]), ZBV_RATIO_STEPS))
        return i, w

    def activation_peak(self, layout: Layout, m: int, acts: list[float]) -> float:
        """The busiest rank's peak of held activations, as :meth:`replay` finds it (the replay of ``m``
        micro-batches, of 3 pp past 3 pp of them), without replaying: from the schedule's held counts
        (:func:`~pipeloom.plan.cluster.held.held_profile`, cached per schedule)."""
        return acts[0] if layout.pp == 1 else peak_held(self._profile(layout, m), acts)

    def _profile(self, layout: Layout, m: int) -> tuple[RankHeld, ...]:
        """The held counts of the layout's schedule per rank (:func:`held_profile`, cached per schedule)."""
        m = profiled_microbatches(layout.pp, m)
        key = self._schedule_key(layout, m)
        if key not in self._profiles:
            self._profiles[key] = held_profile(self.schedule(layout, m))
        return self._profiles[key]

    def rank_memory(self, layout: Layout) -> tuple[float, ...]:
        """Bytes on each pipeline rank at its own peak: the static memory of the layers it holds and its own peak
        of held activations (the estimate's ``memory`` adds the busiest rank's of each: at least every one)."""
        m, (times, acts, _) = self.check(layout), self.stages(layout)
        held = [acts[0]] if layout.pp == 1 else [rank.peak(acts) for rank in self._profile(layout, m)]
        runs = schedule_microbatches(layout, m)
        return tuple(self._rank_state(layout, times, tuple(stages), self._kinds_of(layout, stages), runs)[0].total
                     + peak for stages, peak in zip(rank_stages(layout), held))

    def replay(self, layout: Layout, m: int, times: list[PhaseTimes], acts: list[float]) -> tuple[float, float, float]:
        """``(makespan, bubble, peak activation bytes)`` of the layout's schedule with these stage costs."""
        job = self.job
        if layout.pp == 1:
            t = times[0]
            busy = m * (t.f + t.i + t.w)
            if job.pairs(layout):  # Job.moe_overlap: B0 with F1, ..., B(m-2) with F(m-1), each hiding the other's
                busy -= (m - 1) * (t.f + t.i + t.w - pair_duration((t.f, t.i + t.w), (t.f_comm, t.i_comm),
                                                                   slowdown=pair_slowdown(job)))
            return busy, 0.0, acts[0]
        latency = 0.0 if job.blocking_sends(layout) else stage_send_seconds(job, layout)  # blocking: in F and I
        key = (layout.schedule, layout.pp, layout.vp, m, latency, job.pairs(layout),
               tuple(tuple(round(x, 9) for x in (t.f, t.i, t.w, t.f_comm, t.i_comm)) for t in times),
               tuple(round(a) for a in acts))
        if key not in self._replays:
            self._replays[key] = self._extrapolated(layout, m, times, acts, latency)
        return self._replays[key]

    def _extrapolated(self, layout: Layout, m: int, times: list[PhaseTimes], acts: list[float],
                      latency: float) -> tuple[float, float, float]:
        """The replay of ``m`` micro-batches; past 3 pp of them, from replays of 2 pp and 3 pp: after the
        warm-up every schedule here repeats one period per micro-batch (the busiest rank's work), so the
        makespan grows linearly, ``T(m) = T(2p) + (m - 2p) (T(3p) - T(2p)) / p``, and so do the ranks' busy
        seconds (DualPipe(V)'s overlapped pairs counted as they run, less the communication they hide); the
        memory peak is the warm-up's. Never below the bound every replay meets (:func:`work_bound`)."""
        p = layout.pp
        if m <= 3 * p:
            return self._simulate(layout, m, times, acts, latency)
        (t0, b0, _), (t1, b1, peak) = (self._simulate(layout, k * p, times, acts, latency) for k in (2, 3))
        makespan = max(t0 + (m - 2 * p) * (t1 - t0) / p, work_bound(layout, m, times, paired=self.job.pairs(layout)))
        busy0, busy1 = (1 - b0) * t0, (1 - b1) * t1  # mean busy seconds per rank
        return makespan, max(0.0, 1.0 - (busy0 + (m - 2 * p) * (busy1 - busy0) / p) / makespan), peak

    def _simulate(self, layout: Layout, m: int, times: list[PhaseTimes], acts: list[float],
                  latency: float) -> tuple[float, float, float]:
        """The layout's schedule (:meth:`schedule`), compiled once, replayed with :func:`replay_stages`."""
        key = self._schedule_key(layout, m)
        if key not in self._compiled:
            self._compiled[key] = compile_schedule(self.schedule(layout, m))
        return replay_stages(self._compiled[key], times, acts, latency, pair_slowdown(self.job))

    def estimate(self, layout: Layout) -> Estimate:
        """The predicted step of ``layout`` (LayoutError when it cannot run)."""
        m = self.check(layout)
        times, acts, _ = self.stages(layout)
        makespan, bubble, peak = self.replay(layout, m, times, acts)
        memory, exposed, optimizer = self.static_state(layout, times, m)
        memory = dataclasses.replace(memory, activations=peak)
        step, job = makespan + exposed + optimizer, self.job
        return Estimate(layout=layout, stage_layers=self.stage_counts(layout), step_time=step, memory=memory,
                        pipeline_time=makespan, exposed_dp=exposed, optimizer_time=optimizer, bubble=bubble,
                        tokens_per_gpu_per_second=job.global_batch * job.seq / (step * job.gpus),
                        mfu=self.model_flops / (step * job.gpus * job.hw.peak(job.dtype)),
                        work=tuple(work_parts(times[:layout.stages]).items()))

    def static_state(self, layout: Layout, times: list[PhaseTimes], m: int) -> tuple[Memory, float, float]:
        """Memory of weights, gradients, optimizer and buffers on the busiest rank; the exposed data-parallel
        seconds; the optimizer step's seconds (cached: they do not depend on the schedule's order)."""
        key = (layout.tp, layout.cp, layout.ep, layout.mbs, layout.recompute, layout.pp, layout.vp,
               SCHEDULES[layout.schedule], layout.dp, layout.fsdp, m, self.stage_counts(layout))
        if key not in self._static:
            self._static[key] = self._static_state(layout, times, schedule_microbatches(layout, m))
        return self._static[key]

    def _static_state(self, layout: Layout, times: list[PhaseTimes], runs: int) -> tuple[Memory, float, float]:
        """:meth:`static_state` with ``runs`` the schedule's micro-batches (each runs all of a rank's stages)."""
        states, tails = zip(*(self._rank_state(layout, times, stages, kinds, runs)  # ranks of the same layers: once
                              for stages, kinds in self._rank_shapes(layout)))
        memory = max(states, key=lambda state: state.total)  # the most static memory (activations: the replay's)
        _, exposed, optimizer = max(tails)
        return memory, exposed, optimizer

    def _rank_shapes(self, layout: Layout) -> tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...]:
        """The distinct pipeline ranks of the layout's placement: one rank's stages per distinct sequence of
        stage shapes, with the layer kinds it holds and how many of each (cached per pp, vp, placement, cut)."""
        counts = self.stage_counts(layout)
        key = (layout.pp, layout.vp, SCHEDULES[layout.schedule], counts)
        if key not in self._ranks:
            cut = self._cut(counts, layout.copies)
            seen: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[tuple[str, int], ...]]] = {}
            for stages in rank_stages(layout):
                shapes = tuple(cut.shape_of[j] for j in stages)
                if shapes not in seen:
                    seen[shapes] = (tuple(stages), self._kinds_of(layout, stages))
            self._ranks[key] = tuple(seen.values())
        return self._ranks[key]

    def _kinds_of(self, layout: Layout, stages: Sequence[int]) -> tuple[tuple[str, int], ...]:
        """The layer kinds a rank holding these schedule stages holds, and how many of each."""
        cut = self._cut(self.stage_counts(layout), layout.copies)
        return tuple(sorted(sum((Counter(dict(cut.shapes[cut.shape_of[j]])) for j in stages), Counter[str]()).items()))

    def _rank_state(self, layout: Layout, times: list[PhaseTimes], stages: tuple[int, ...],
                    kinds: tuple[tuple[str, int], ...], m: int) -> tuple[Memory, tuple[float, float, float]]:
        """One rank's static memory and ``(exposed + optimizer, exposed, optimizer)`` seconds. DualPipe's two
        copies: each parameter the rank holds has its twin on the mirror rank, so gradients are reduced, and the
        optimizer state sharded, over both copies' data-parallel ranks."""
        hw, (dpcp, edp) = self.job.hw, layout.state_groups
        dense = expert = ends = 0.0
        for kind, count in kinds:  # parameters held: tp-sharded, experts over ep; ends: the embedding's and head's
            c = self.counts[kind]
            dense += count * (c.params - c.expert_params) / layout.tp
            expert += count * c.expert_params / layout.ep
            ends += count * c.params / layout.tp if kind in ("embedding", "head") else 0.0  # BF16 GEMMs in FP8 too
        copy, exchange = tied_copy(self.job, layout, stages)  # a tied head's own weight, the two ends' exchange
        dense, ends = dense + copy, ends + copy
        weights, gradients, states = self.job.param_state(layout, dense, expert, ends=ends)
        f1, b1 = sum(times[j].f for j in stages), sum(times[j].i + times[j].w for j in stages)
        # the dense replicas sit tp apart (Megatron's order tp, cp, dp); the experts' replicas ep apart (etp, ep, edp)
        exposed = exchange + sum(self._dp_exposed(layout, params, group, stride, f1, b1, m)
                                 for params, group, stride in ((dense, dpcp, layout.tp), (expert, edp, layout.ep)))
        layers = max(1, sum(count for kind, count in kinds if kind not in ("embedding", "head")))
        buffers = WORKSPACE_BYTES + (2 * 2.0 * (dense + expert) / layers if self.job.reshards(layout) else
                                     2 * BUCKET_BYTES if self.job.zero2(layout) else 0.0)  # ZeRO-2's buckets
        if layout.recompute == "full" or layout.recompute == "selective" and self.job.attention == "materialized":
            shape, again = (layout.tp, layout.cp, layout.mbs), layout.recompute == "selective"  # one layer rebuilt
            buffers += max(self._keep(k, *shape, "none") - again * self._keep(k, *shape, "selective")
                           for k in set(self.kinds))
        moments = 4.0 * ADAM_MOMENTS[self.job.adam_moments]  # read and write two moments; master, grads and weights
        stepped = dense / dpcp + expert / edp if self.job.distributed_optimizer or layout.fsdp else dense + expert
        optimizer = memory_seconds(hw, (16.0 + moments) * stepped)  # each replica steps all it holds, or its shard
        memory = Memory(weights=weights, gradients=gradients, optimizer=states, activations=0.0, buffers=buffers)
        return memory, (exposed + optimizer, exposed, optimizer)

    def _dp_exposed(self, layout: Layout, params: float, group: int, stride: int, f1: float, b1: float,
                    m: int) -> float:
        """Seconds of gradient reduce-scatter and parameter all-gather over ``group`` ranks ``stride`` apart that the
        rank's last backward / first forward does not hide, the last bucket never (:mod:`~pipeloom.plan.cluster.
        efficiency`); what is hidden still slows the compute beside it (hidden_cost). FSDP on one stage (ZeRO-3:
        :meth:`Job.reshards`) gathers for every micro-batch's forward and backward and reduce-scatters after it,
        with no gather after the step; ZeRO-2 (:meth:`Job.zero2`) reduce-scatters after every backward."""
        if group <= 1 or params == 0:
            return 0.0
        hw, nbytes, key = self.job.hw, 2.0 * params, (2.0 * params, group, stride)
        if key not in self._dp:
            per_domain = domain_ranks(group, stride, hw)
            grads = GRAD_REDUCE[self.job.grad_reduce] * params
            self._dp[key] = (collective_seconds(hw, "reduce_scatter", grads, group, ranks_per_domain=per_domain),
                             collective_seconds(hw, "all_gather", nbytes, group, ranks_per_domain=per_domain))
        rs, ag = self._dp[key]  # gradients in the reduce's dtype, weights gathered in bf16
        last, zero3 = min(1.0, BUCKET_BYTES / nbytes), self.job.reshards(layout)
        reduces = m if zero3 or self.job.zero2(layout) else 1  # ZeRO-3, ZeRO-2: one per micro-batch
        if not self.job.overlap_grad_reduce:  # nothing hidden: an all-reduce after the last backward, or ZeRO-3's
            return m * (2 * ag + rs) if zero3 else reduces * rs + ag  # two gathers and a reduce each
        exposed = max(ag - f1, ag * last)  # the step's first forward waits for its first bucket
        if zero3:  # per micro-batch: a gather beside the forward, a gather and a reduce beside the backward
            exposed += (m - 1) * (max(0.0, ag - f1) + max(0.0, ag + rs - b1)) + max(ag + rs - b1, rs * last)
            return exposed + hidden_cost(hw, m * (2 * ag + rs) - exposed)
        exposed += (reduces - 1) * max(0.0, rs - b1) + max(rs - b1, rs * last)
        return exposed + hidden_cost(hw, reduces * rs + ag - exposed)
