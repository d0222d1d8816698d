"""Pipeline × data parallel × tensor parallel: choose how N ranks split into ``dp`` replicas of a
``pp``-rank pipeline whose stages run on ``tp`` ranks each (tp costed by :mod:`pipeloom.plan.tp.megatron`).

For every ``dp`` dividing N (and the global batch), :func:`plan_mesh` plans a pipeline of ``pp = N / dp``
ranks for the replica's share of the batch (:func:`pipeloom.plan.plan_pipeline`), then adds what the
replicas cost on top, priced as the runtime runs them (:mod:`pipeloom.runtime.parallel.dp`,
:mod:`pipeloom.runtime.parallel.fsdp`):

- **replicate**: each model stage's gradients are all-reduced over ``dp`` in buckets of at most
  ``BUCKET_BYTES``, posted as soon as the stage's last gradient action of the step has run on its
  rank, one after the other on that rank, so they overlap the rest of the schedule. A ring all-reduce
  of S bytes over d ranks takes ``2(d-1)`` messages of latency per bucket and ``2(d-1)/d · S`` bytes
  on the link. Two-replica schedules settle their gradients at the end of the step, so their
  reduction starts after the makespan; parameters shared by several stages are reduced by each rank
  holding them once their after-step exchange is done.
- **fsdp**: the optimizer state is sharded over ``dp`` (weights and gradients stay whole during the
  step, as the runtime keeps them), each stage's parameters are all-gathered before the step (the
  rank's gathers add to its start) and its gradients reduce-scattered where the all-reduce would be
  (half the bytes). Two-replica schedules and parameters shared by several stages are not sharded (the
  runtime refuses them).

The step time is the pipeline's predicted step plus however far the last reduction ends past the
pipeline's makespan; the memory is the pipeline's (for fsdp, with the sharded optimizer state).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

from pipeloom.arithmetic import divisors
from pipeloom.ir.core import compute_parts
from pipeloom.plan.costs.parts import Link
from pipeloom.plan.costs.shared import shared_across_stages, shared_sync_time
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import NoPlanFits, PlanArgumentError, PlanError
from pipeloom.plan.partitioning.shape import schedule_shape
from pipeloom.plan.plan import Plan
from pipeloom.plan.planner import Candidate, PlanResult, plan_pipeline
from pipeloom.plan.recost import piece_ranks
from pipeloom.plan.refusals import running_stats_pieces
from pipeloom.plan.tp.collectives import ring_steps_and_share
from pipeloom.schedules import REGISTRY

__all__ = ["BUCKET_BYTES", "SHARDINGS", "MeshCandidate", "collective_time", "plan_mesh", "reduction_time"]

BUCKET_BYTES = 25 * 2**20
"""The most gradient bytes one all-reduce carries (the runtime's bucket size)."""

SHARDINGS = ("replicate", "fsdp")

logger = logging.getLogger(__name__)


def collective_time(nbytes: float, size: int, link: Link, *, kind: str) -> float:
    """Seconds of a ring ``all_reduce``, ``reduce_scatter`` or ``all_gather`` of ``nbytes`` over
    ``size`` ranks, in buckets of :data:`BUCKET_BYTES` (each bucket pays the link's latency per step)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    steps, share = ring_steps_and_share(kind, size)
    buckets = math.ceil(nbytes / BUCKET_BYTES)
    return buckets * steps * link.latency + (0.0 if link.bandwidth is None else share * nbytes / link.bandwidth)


def reduction_time(candidate: Candidate, table: CostTable, *, data_parallel: int, link: Link,
                   sharding: str = "replicate") -> float:
    """Seconds the replicas' gradient reduction (and, for fsdp, the parameter gathers) adds to
    ``candidate``'s step on ``data_parallel`` replicas (see the module doc)."""
    if data_parallel <= 1 or candidate.timeline is None or candidate.partition is None:
        return 0.0
    timeline = candidate.timeline
    schedule = timeline.schedule
    shape = schedule_shape(schedule)
    stage_of = candidate.partition.stage_of
    late = shared_across_stages(table, stage_of) if shape.replicas == 1 else ()
    params = _model_stage_params(table, stage_of, shape.num_model_stages, late)
    kind = "reduce_scatter" if sharding == "fsdp" else "all_reduce"
    at_end = shape.replicas > 1  # the replicas' merge settles every gradient at the end of the step
    ready = _last_gradient_ends(timeline)
    settled = timeline.makespan + (shared_sync_time(table, piece_ranks(shape, candidate.partition),
                                                    schedule.num_microbatches) if late else 0.0)
    latest = timeline.makespan
    for rank in range(shape.num_ranks):
        stages = [s for s in range(shape.num_stages) if shape.rank[s] == rank]
        sizes = {s: params[shape.model_stage[s] % shape.num_model_stages] for s in stages}
        gather = (sum(collective_time(sizes[s], data_parallel, link, kind="all_gather") for s in stages)
                  if sharding == "fsdp" else 0.0)
        clock = 0.0
        for s in sorted(stages, key=lambda s: ready.get(s, timeline.makespan)):
            start = (timeline.makespan if at_end else ready.get(s, timeline.makespan)) + gather
            clock = max(clock, start) + collective_time(sizes[s], data_parallel, link, kind=kind)
        held = {shape.model_stage[s] for s in stages}  # shared parameters: reduced once settled, per holder
        late_bytes = sum(entry.bytes for entry in late
                         if any(stage_of[table.names.index(name)] in held for name in entry.pieces))
        if late_bytes:
            clock = max(clock, settled) + collective_time(late_bytes, data_parallel, link, kind=kind)
        latest = max(latest, clock)
    return latest - timeline.makespan


def _model_stage_params(table: CostTable, stage_of: Sequence[int], stages: int, late: Sequence) -> list[float]:
    """Per model stage: the parameter bytes reduced when its gradients are done (shared parameters in
    ``late`` are reduced at the end of the step instead)."""
    params = [0.0] * stages
    for piece, stage in zip(table.pieces, stage_of):
        params[stage] += piece.param_bytes
    for entry in late:  # counted in its first user's param_bytes
        params[stage_of[table.names.index(entry.pieces[0])]] -= entry.bytes
    return params


def _last_gradient_ends(timeline) -> dict[int, float]:
    """Per schedule stage: when its last gradient action (B, I or W) of the step ends."""
    ends: dict[int, float] = {}
    for rank in range(timeline.num_ranks):
        for action, _, end in timeline.events(rank):
            for part in compute_parts(action):
                if part.kind in ("B", "I", "W"):
                    ends[part.stage] = max(ends.get(part.stage, 0.0), end)
    return ends


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MeshCandidate(Candidate):
    """A candidate of :func:`plan_mesh`: a pipeline with its replicas and its tensor-parallel size."""

    tensor_parallel: int = 1
    """Tensor-parallel ranks per pipeline stage (the table it was costed with is one such rank's)."""


def plan_mesh(
    table: CostTable | Sequence[CostTable],
    *,
    num_ranks: int,
    global_batch: int,
    memory_limit: float | None = None,
    data_parallel: Sequence[int] | None = None,
    tensor_parallel: Sequence[int] | None = (1,),
    sharding: str = "replicate",
    dp_link: Link | None = None,
    schedules: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    **options,
) -> PlanResult:
    """The fastest plan for ``num_ranks`` ranks as ``dp`` replicas of a ``pp``-rank pipeline whose stages
    each run on ``tp`` tensor-parallel ranks, ``dp x pp x tp = num_ranks``.

    ``data_parallel``: the replica counts to try (default: every divisor of ``num_ranks / tp`` that divides
    ``global_batch`` and leaves a pipeline no longer than the table); ``tensor_parallel``: the tp sizes to
    try (default ``(1,)``; None: every divisor of ``num_ranks`` dividing the table's head count), each
    costed with :func:`~pipeloom.plan.tp.megatron.tensor_parallel_table` (memory per rank as the plan shards
    it); ``sharding``: ``"replicate"`` or ``"fsdp"`` (see the module doc); ``dp_link``: the link between
    replicas (default: the table's link); ``progress``: called with a short line as the search goes, and
    with "" at its end. Other keywords go to :func:`~pipeloom.plan.plan_pipeline` for each pipeline. The
    result's plan carries ``data_parallel``, ``sharding``, ``tensor_parallel`` and the table's Megatron
    ``tp_plan``; its ``num_ranks`` is the pipeline's ranks; its candidates (:class:`MeshCandidate`) are
    every mesh's, ranked by step time with the replicas' cost included.
    """
    from pipeloom.plan.errors import TensorParallelError
    from pipeloom.plan.tp.megatron import tensor_parallel_table, tp_sizes

    started = time.perf_counter()
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise PlanError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    tables = [table] if isinstance(table, CostTable) else list(table)
    try:
        sizes = tp_sizes(tables[0], num_ranks, tensor_parallel)
    except TensorParallelError as error:  # a size the ranks or heads refuse stays the caller's argument's error
        raise (error if isinstance(error, PlanError) else PlanError(str(error))) from None
    results, failures = [], []
    for tp in sizes:
        report = None if progress is None or len(sizes) == 1 else _prefixed(progress, f"tp {tp}: ")
        replicas = data_parallel
        if data_parallel is not None and tp > 1:  # the asked replica counts that fit beside this tp
            replicas = [d for d in data_parallel if isinstance(d, int) and (num_ranks // tp) % d == 0]
            if not replicas:
                continue
        try:
            result = _plan_dp_pp([tensor_parallel_table(t, tp) for t in tables], num_ranks=num_ranks // tp,
                                 global_batch=global_batch, memory_limit=memory_limit, data_parallel=replicas,
                                 sharding=sharding, dp_link=dp_link, schedules=_one_replica(schedules, tp),
                                 progress=report,
                                 **options)
        except NoPlanFits as error:
            logger.info("tensor parallel %d: no plan fits: %s", tp, error)
            failures.append((tp, error))
            continue
        results.append((tp, result))
    if not results:
        raise _nothing_fits(failures, what="tensor-parallel")
    ranked = sorted((_with_tensor_parallel(c, tp) for tp, result in results for c in result.candidates), key=_order)
    tp, best = min(results, key=lambda r: _order(r[1].candidates[0]))
    tensor = tables[0].tensor
    if tp == 1:
        plan = best.plan
    else:
        assert tensor is not None, "tp_sizes offers tp > 1 only for a table with a tensor field"
        plan = dataclasses.replace(best.plan, tensor_parallel=tp, tp_plan=tensor.recipe())
    return PlanResult(plan=plan, timeline=best.timeline, candidates=tuple(ranked),
                      seconds=time.perf_counter() - started, untried=sum(result.untried for _, result in results))


def _plan_dp_pp(tables: list[CostTable], *, num_ranks: int, global_batch: int, memory_limit: float | None,
                data_parallel: Sequence[int] | None, sharding: str, dp_link: Link | None,
                schedules: Sequence[str] | None, progress: Callable[[str], None] | None, **options) -> PlanResult:
    """:func:`plan_mesh` for one tensor-parallel size: dp x pp = ``num_ranks``."""
    started = time.perf_counter()
    if sharding not in SHARDINGS:
        raise PlanError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    sizes = _replica_counts(tables[0], num_ranks, global_batch, data_parallel)
    link = dp_link or tables[0].link
    names = list(schedules) if schedules is not None else None
    results, failures = [], []
    for k, dp in enumerate(sizes):
        report = None if progress is None else _prefixed(progress, f"mesh {k + 1} of {len(sizes)}: dp {dp} x pp "
                                                                    f"{num_ranks // dp}: ")
        shard_tables = _sharded(tables, dp) if sharding == "fsdp" and dp > 1 else tables
        chosen = _schedules_for(names, num_ranks // dp, sharded=sharding == "fsdp" and dp > 1)
        if chosen == []:  # said if no other mesh runs
            failures.append((dp, _unscheduled(dp, num_ranks // dp, names or [], sharded=sharding == "fsdp")))
            continue
        counts = options.get("microbatches")
        if counts is not None and dp != sizes[0]:  # the counts that divide this replica's share
            counts = [m for m in counts if isinstance(m, int) and (global_batch // dp) % m == 0]
            if not counts:
                failures.append((dp, NoPlanFits(f"dp {dp}: none of the micro-batch counts given divides a replica's "
                                                f"{global_batch // dp} samples", smallest_limit=None)))
                continue
        try:
            result = plan_pipeline(shard_tables, num_ranks=num_ranks // dp, global_batch=global_batch // dp,
                                   memory_limit=memory_limit, schedules=chosen, progress=report,
                                   **{**options, "microbatches": counts})
        except NoPlanFits as error:
            logger.info("dp %d x pp %d: no plan fits: %s", dp, num_ranks // dp, error)
            failures.append((dp, error))
            continue
        finally:
            if progress is not None and k == len(sizes) - 1:
                progress("")
        results.append((dp, result, shard_tables))
    if not results:
        raise _nothing_fits(failures)
    ranked = sorted((_with_replicas(MeshCandidate(**_fields(c)), dp, tables_dp, link, sharding)
                     for dp, result, tables_dp in results for c in result.candidates), key=_order)
    best = ranked[0]
    if not best.fits:  # every pipeline fitted, but not with its replicas
        reasons = "; ".join(dict.fromkeys(c.reason for c in ranked if c.reason))
        raise NoPlanFits(f"no plan runs on {num_ranks} ranks with {sharding} replicas: {reasons}", smallest_limit=None)
    dp, result, _ = next(r for r in results if r[0] == best.data_parallel)
    logger.info("best mesh: dp %d x pp %d (%s), %s: step %.4g s with the replicas' reduction", dp, num_ranks // dp,
                sharding, best.label, best.step_time)
    chosen_plan = result.plan
    step_time, timeline, _ = best.simulation()
    if best.schedule != chosen_plan.schedule:
        chosen_plan = _plan_of(best, result)
    else:
        timeline = result.timeline
    plan = dataclasses.replace(chosen_plan, global_batch=global_batch, data_parallel=dp,
                               sharding=sharding if dp > 1 else "replicate", predicted_step_time=step_time)
    return PlanResult(plan=plan, timeline=timeline, candidates=tuple(ranked), seconds=time.perf_counter() - started,
                      untried=sum(result.untried for _, result, _ in results))


def _with_tensor_parallel(candidate: Candidate, tp: int) -> MeshCandidate:
    """``candidate``, one of :func:`_plan_dp_pp`'s (a :class:`MeshCandidate`), costed with ``tp`` ranks per stage."""
    assert isinstance(candidate, MeshCandidate), "_plan_dp_pp ranks MeshCandidates"
    return dataclasses.replace(candidate, tensor_parallel=tp)


def _one_replica(names: Sequence[str] | None, tp: int) -> Sequence[str] | None:
    """The schedules a tensor-parallel pipeline runs: one replica per piece (the runtime refuses two-replica
    schedules on a "tp" mesh)."""
    if tp == 1:
        return names
    return [n for n in (names if names is not None else REGISTRY) if REGISTRY[n].replicas == 1]


def _fields(candidate: Candidate) -> dict:
    return {f.name: getattr(candidate, f.name) for f in dataclasses.fields(Candidate)}


def _unscheduled(dp: int, pp: int, names: Sequence[str], *, sharded: bool) -> NoPlanFits:
    """Why ``dp`` replicas of a ``pp``-rank pipeline run none of the schedules ``names`` (:func:`_schedules_for`)."""
    runs = ", ".join(_schedules_for(None, pp, sharded=sharded and dp > 1) or [])
    where = "one rank" if pp == 1 else f"{pp} ranks sharded with fsdp"
    return NoPlanFits(f"dp {dp} leaves a pipeline of {where}, where none of the schedules given ({', '.join(names)}) "
                      f"runs: give fewer replicas (--dp), or a schedule that runs there ({runs})", smallest_limit=None)


def _schedules_for(names: Sequence[str] | None, pp: int, *, sharded: bool) -> list[str] | None:
    """The schedules worth trying for a pipeline of ``pp`` ranks: on one rank, those that keep the model
    whole in one stage of one replica (the others only add stage boundaries to the same work); the
    runtime shards (fsdp) one-replica schedules only. None: every built-in one."""
    if pp > 1 and not sharded:
        return None if names is None else list(names)
    keep = [n for n in (names if names is not None else REGISTRY) if REGISTRY[n].replicas == 1
            and (pp > 1 or REGISTRY[n].num_pieces(1) == 1)]
    return keep


def _prefixed(progress: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    return lambda message: progress(prefix + message)


def _replica_counts(table: CostTable, num_ranks: int, global_batch: int, asked: Sequence[int] | None) -> list[int]:
    updating = running_stats_pieces(table)
    if asked is None:
        sizes = [d for d in divisors(num_ranks)
                 if global_batch % d == 0 and num_ranks // d <= len(table.pieces) and not (updating and d > 1)]
        return sizes or [1]  # one pipeline over every rank, whose check says what is wrong
    sizes = sorted(set(asked))
    for dp in sizes:
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1 or num_ranks % dp:
            raise PlanArgumentError(f"data parallel size {dp!r} does not divide {num_ranks} ranks; choose among "
                            f"{divisors(num_ranks)}")
        if global_batch % dp:
            raise PlanArgumentError(f"data parallel size {dp} does not divide the global batch {global_batch}; each "
                            "replica runs an equal share")
    if updating and any(dp != 1 for dp in sizes):
        raise PlanArgumentError(
            f"data parallel size {max(sizes)}: piece(s) {updating} update running statistics (BatchNorm) in training, "
            "which replicas would update apart (the runtime refuses it after the first step): use --dp 1, or keep "
            "them fixed (BatchNorm(track_running_stats=False)) and profile again")
    return sizes


def _sharded(tables: Sequence[CostTable], dp: int) -> list[CostTable]:
    """The tables with the optimizer state sharded over ``dp`` replicas (weights and gradients whole)."""
    return [dataclasses.replace(t, optimizer_factor=t.optimizer_factor / dp) for t in tables]


def _with_replicas(candidate: Candidate, dp: int, tables: Sequence[CostTable], link: Link,
                   sharding: str) -> Candidate:
    if not candidate.fits:
        return dataclasses.replace(candidate, data_parallel=dp)
    table = _table_at(tables, candidate.microbatch_size)  # cached: every candidate of a size shares it
    step_time, _, partition = candidate.simulation()
    if sharding == "fsdp" and dp > 1 and shared_across_stages(table, partition.stage_of):
        return dataclasses.replace(candidate, data_parallel=dp, reason="fsdp cannot shard parameters shared by "
                                                                     "several stages (the runtime refuses it)")
    extra = reduction_time(candidate, table, data_parallel=dp, link=link, sharding=sharding)
    return dataclasses.replace(candidate, data_parallel=dp, step_time=step_time + extra)


_TABLES_AT: dict[tuple[int, ...], tuple[Sequence[CostTable], dict[int, CostTable]]] = {}
"""The last tables :func:`_table_at` scaled (by identity; held, so an id is not reused) and their tables per
micro-batch size: scaling a table rebuilds its pieces, which for thousands of pieces took longer than the
plan search itself when done per candidate."""


def _table_at(tables: Sequence[CostTable], size: int) -> CostTable:
    from pipeloom.plan.costs.table import table_for_size

    key = tuple(map(id, tables))
    entry = _TABLES_AT.get(key)
    if entry is None:  # one plan's tables at a time (plans in other threads keep their own entry object)
        entry = (tables, {})
        _TABLES_AT.clear()
        _TABLES_AT[key] = entry
    sizes = entry[1]
    if size not in sizes:
        sizes[size] = table_for_size(list(tables), size)
    return sizes[size]


def _order(candidate: Candidate) -> tuple:
    if candidate.fits:
        return (0, candidate.step_time, candidate.peak_memory, candidate.data_parallel, candidate.microbatches)
    need = candidate.peak_memory if candidate.peak_memory is not None else float("inf")
    return (1, need, 0.0, candidate.data_parallel, candidate.microbatches)


def _plan_of(best: Candidate, result: PlanResult) -> Plan:
    """The plan of ``best``, a fitting candidate of ``result`` that was not its own best."""
    _, timeline, partition = best.simulation()
    return dataclasses.replace(
        result.plan, split_points=best.split_points or (), schedule=best.schedule,
        schedule_options=best.schedule_options, microbatches=best.microbatches,
        peak_memory=timeline.peak_memory, bubble_ratio=best.bubble_ratio, stage_times=partition.stage_times)


def _nothing_fits(failures: Sequence[tuple[int, NoPlanFits]], *, what: str = "data-parallel") -> NoPlanFits:
    """The error of the mesh that came closest (the least memory that would fit), naming the meshes tried."""
    if not failures:
        return NoPlanFits(f"no {what} size could be tried", smallest_limit=None)
    dp, closest = min(failures, key=lambda f: math.inf if f[1].smallest_limit is None else f[1].smallest_limit)
    if len(failures) == 1:
        return closest
    tried = ", ".join(str(d) for d, _ in failures)
    return NoPlanFits(f"{closest} ({what} sizes tried: {tried}; the closest was {dp})",
                      smallest_limit=closest.smallest_limit)
