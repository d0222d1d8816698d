"""The profiling pipelines of :func:`pipeloom.profile.in_engine.profile_in_engine`: the schedule they run
(:func:`profiling_schedule`) and :class:`EngineProfiler`, which steps them traced (tp-1, or with each stage
sharded by a tensor-parallel plan), counts each piece's collectives and turns the steps into a cost table."""

from __future__ import annotations

import copy
import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.ir import Action, Schedule
from pipeloom.plan.costs.parts import Link, RuntimeCorrections
from pipeloom.plan.costs.shared import shared_across_stages, shared_sync_time
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import PlanError
from pipeloom.plan.tp.collectives import Collective
from pipeloom.profile.fits import fit_run, fitted_action_cost, fitted_replica_link, start_skew, time_spread
from pipeloom.profile.model import profile_model, updates_running_stats
from pipeloom.profile.pieces import pieces_in_trace, trace_for_pieces
from pipeloom.runtime import Parallelism, PipelineEngine, Tracing, pipeline, split_model
from pipeloom.schedules.common import chain_problem
from pipeloom.stages import Costs, stage_graph
from pipeloom.trace.analysis import message_cost, task_durations
from pipeloom.trace.format import RunTrace
from pipeloom.trace.reader import run_trace_from_documents

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["EngineProfiler", "profiling_schedule"]


def profiling_schedule(num_pieces: int, num_ranks: int, num_microbatches: int, *, split_backward: bool,
                       replicas: int = 1) -> Schedule:
    """The schedule :func:`~pipeloom.profile.in_engine.profile_in_engine` runs: piece k is stage k, the pieces
    cut into ``num_ranks`` runs of consecutive pieces (piece k on rank ``k * num_ranks // num_pieces``).

    Micro-batch by micro-batch, each rank runs the forwards of its pieces, then (after every forward)
    the backwards in reverse, B or I then W. Only the pieces at the ends of a rank's run send to
    another rank, as in a pipeline of ``num_ranks`` stages, and the ranks compute at the same time on
    different micro-batches (GPipe's pattern). Every rank's list is a subsequence of one dependency
    order, so it cannot deadlock.

    ``replicas=2``: two model replicas as in Chimera, the second one's piece k (stage
    ``num_pieces + k``) on the mirrored rank ``num_ranks - 1 - k * num_ranks // num_pieces``, and
    ``num_microbatches`` per replica. Each rank runs the forwards of the replica whose pieces it
    holds nearer that replica's start, then the other replica's forwards, their backwards, then the
    first one's backwards, as Chimera does: the last rank starts the second replica while the first
    rank starts the first, both at the step's start, and every rank's list follows the data.
    """
    if num_pieces < num_ranks:
        raise PlanError(f"the model has {num_pieces} piece(s) for {num_ranks} ranks; profiling in the engine "
                        f"needs at least one piece per rank (name more pieces, or profile on fewer ranks)")
    if replicas not in (1, 2):
        raise PlanError(f"replicas must be 1 or 2, got {replicas!r}")
    if replicas == 2 and num_ranks % 2:
        raise PlanError(f"two replicas need an even number of ranks, got {num_ranks} (with an odd number the "
                        f"middle rank would hold both copies of a piece, which the engine refuses)")
    rank_of = [k * num_ranks // num_pieces for k in range(num_pieces)]
    backward = ("I", "W") if split_backward else ("B",)
    name = "profile-split" if split_backward else "profile-full"

    def forwards(stages: list[int]) -> list[Action]:
        return [Action(s, "F", m) for m in range(num_microbatches) for s in stages]

    def backwards(stages: list[int]) -> list[Action]:
        return [Action(s, kind, m) for m in range(num_microbatches) for s in reversed(stages) for kind in backward]

    if replicas == 1:
        problem = chain_problem(rank_of, Costs(), num_ranks=num_ranks, split_backward=split_backward,
                                memory_limit=None)
        order = forwards(list(range(num_pieces))) + backwards(list(range(num_pieces)))
        ranks = tuple(tuple(a for a in order if rank_of[a.stage] == r) for r in range(num_ranks))
        return Schedule(name=name, problem=problem, num_microbatches=num_microbatches, ranks=ranks)
    stage_rank = rank_of + [num_ranks - 1 - r for r in rank_of]
    edges = [(k, k + 1) for k in range(num_pieces - 1)] + [(num_pieces + k, num_pieces + k + 1)
                                                         for k in range(num_pieces - 1)]
    problem = stage_graph([Costs().stage(r) for r in stage_rank], num_ranks=num_ranks, edges=edges,
                          backward="split" if split_backward else "full")
    rows: list[tuple[Action, ...]] = []
    for r in range(num_ranks):
        first = [k for k in range(num_pieces) if stage_rank[k] == r]
        second = [num_pieces + k for k in range(num_pieces) if stage_rank[num_pieces + k] == r]
        if second[0] - num_pieces < first[0]:  # nearer the start of the second replica's chain
            first, second = second, first
        rows.append(tuple(forwards(first) + forwards(second) + backwards(second) + backwards(first)))
    return Schedule(name=f"{name}-2", problem=problem, num_microbatches=num_microbatches, ranks=tuple(rows))


class EngineProfiler:
    """The profiling pipelines of :func:`~pipeloom.profile.in_engine.profile_in_engine`, run step by step: full
    backward, split backward and (``exchange``, where it can run) the two-replica one.

    Each :meth:`step` runs one traced step of each (a collective on the process group); :meth:`table`
    turns the steps recorded so far into a cost table. Stepping it between the steps of a training
    run measures both under the same conditions (on a shared machine whose speed drifts, that is
    the fair comparison).

    ``mesh`` (dimensions ``"pp"`` and ``"tp"``) with ``tp_plan`` (torch's ``parallelize_module`` plan): the
    pipelines run over ``"pp"`` on a copy of the model each, their stages sharded by the plan over ``"tp"``
    (no two-replica pipeline: the runtime refuses those with a plan); :meth:`count` counts each piece's
    collectives. Its table holds one tp rank's times (that of the pipelines global rank 0 is in).

    ``mesh`` with dimensions ``"pp"`` and ``"ep"`` (no ``tp_plan``): the pipelines run on a copy of the model each
    with its MoE layers' experts shared out over ``"ep"`` (:mod:`pipeloom.runtime.parallel.ep`), every ep rank
    a replica stepping the whole ``inputs``; the pieces' times include the expert all-to-alls, and
    :meth:`count` counts each piece's (kind ``all_to_all``, this rank's send buffer; what
    :func:`pipeloom.plan.tp.all_to_all.moe_exchanges` predicts per MoE layer).
    """

    def __init__(self, model: nn.Module, inputs: torch.Tensor | tuple, *,
                 loss_fn: Callable[[object, object], torch.Tensor], target: object, microbatches: int,
                 pieces: Sequence[str] | None = None, process_group: ProcessGroup | None = None,
                 base: CostTable | None = None, exchange: bool = True, tracer: str = "auto",
                 leaf_modules: Sequence[str] = (), mesh: DeviceMesh | None = None,
                 tp_plan: Mapping[str, object] | None = None) -> None:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise PlanError(f"microbatches must be a positive integer, got {microbatches!r}")
        dims = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        self.expert_parallel = "ep" in dims  # the MoE layers' experts shared out over "ep" (no tp_plan)
        if mesh is not None and sorted(dims) not in (["pp", "tp"], ["ep", "pp"]):
            raise PlanError(f"the profiling mesh has dimensions {dims}; give (\"pp\", \"tp\") with a tp_plan or "
                            "(\"pp\", \"ep\") for a model with MoE layers")
        if (tp_plan is not None) != (mesh is not None and not self.expert_parallel):
            raise PlanError("profiling tensor-parallel stages needs both mesh= (with \"pp\" and \"tp\") and "
                            "tp_plan= (torch's parallelize_module plan); give both or neither")
        self.model, self.inputs, self.target = model, inputs, target
        self.tensor_parallel = mesh is not None  # the pipelines run copies of the model over the mesh
        # with "ep" each ep rank's pipeline is a replica: it gets the whole inputs (the batch repeated ep times)
        self.replicas = mesh.size(dims.index("ep")) if mesh is not None and self.expert_parallel else 1
        self.ep_group = mesh.get_group("ep") if mesh is not None and self.expert_parallel else None
        world_group = dist.group.WORLD
        assert world_group is not None, "profiling in the engine needs an initialised process group"
        self.group: ProcessGroup = (_mesh_group(mesh, "pp") if mesh is not None
                                    else process_group if process_group is not None else world_group)
        self.everyone: ProcessGroup = world_group if self.tensor_parallel else self.group  # who steps together
        self.world = dist.get_world_size(self.group)
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        first = tuple(t.chunk(microbatches)[0] if isinstance(t, torch.Tensor) else t for t in args)
        self.leaf_modules = tuple(leaf_modules)
        self.traced = trace_for_pieces(model, first, tracer=tracer, leaf_modules=self.leaf_modules)  # as cut
        self.names = list(pieces) if pieces is not None else pieces_in_trace(model, self.traced, self.leaf_modules)
        if base is None:
            first_target = target.chunk(microbatches)[0] if isinstance(target, torch.Tensor) else target
            base = profile_model(model, first, pieces=self.names, tracer=tracer, leaf_modules=self.leaf_modules,
                                 loss_fn=loss_fn, target=first_target, warmup=1, repeats=1)
        if base.names != tuple(self.names):
            raise PlanError(f"base table pieces {list(base.names)} differ from the profiled pieces {self.names}")
        self.base = base
        self.microbatches = microbatches
        self.rank_of = [k * self.world // len(self.names) for k in range(len(self.names))]  # profiling_schedule's
        self.engines = [self._pipeline(split, loss_fn, process_group, mesh, tp_plan, tracer, first)
                        for split in (False, True)]
        self.exchange = (self._exchange_pipeline(loss_fn, microbatches, process_group)
                         if exchange and not self.tensor_parallel else None)
        self.steps = 0
        self.counted_steps: list[int] = []

    def _pipeline(self, split: bool, loss_fn: Callable, process_group: ProcessGroup | None, mesh: DeviceMesh | None,
                  tp_plan: Mapping[str, object] | None, tracer: str, first: tuple) -> PipelineEngine:
        """One profiling pipeline: the one trace cut at every piece, or (tensor parallel) a copy of the model
        cut by ``pipeline`` itself, whose stages the plan shards (the copy keeps the user's model whole)."""
        schedule = profiling_schedule(len(self.names), self.world, self.microbatches, split_backward=split)
        if mesh is None:
            return pipeline(
                self.model,
                schedule=schedule,
                stages=self._cut(self.names[1:]),
                loss_fn=loss_fn,
                record=True,
                parallel=Parallelism(process_group=process_group),
            )
        return pipeline(
            copy.deepcopy(self.model),
            schedule=schedule,
            split_points=self.names[1:],
            loss_fn=loss_fn,
            record=True,
            tracing=Tracing(tracer=tracer, leaf_modules=self.leaf_modules, example_inputs=first),
            parallel=Parallelism(mesh=mesh, tp_plan=dict(tp_plan) if tp_plan is not None else None),
        )

    def _exchange_pipeline(self, loss_fn: Callable, microbatches: int,
                           process_group: ProcessGroup | None) -> PipelineEngine | None:
        """The two-replica pipeline whose replica-gradient exchange :meth:`table` prices, or None
        where there is none to run (an odd number of ranks, as two-replica schedules need an even one,
        or of micro-batches; a parameter shared by pieces on two ranks, which the runtime combines with
        one-replica schedules only; or running statistics a training step updates, BatchNorm's, which two replicas
        would update apart, as the runtime refuses): each rank's run of pieces is one stage, and the replicas mirror
        each other (:func:`profiling_schedule`)."""
        rank_of = self.rank_of
        if self.world < 2 or self.world % 2 or microbatches % 2 or shared_across_stages(self.base, rank_of):
            return None
        if updates_running_stats(self.model):
            return None
        cuts = [k for k in range(1, len(self.names)) if rank_of[k] != rank_of[k - 1]]
        bounds = [0, *cuts, len(self.names)]
        self.exchange_bounds = bounds
        schedule = profiling_schedule(self.world, self.world, microbatches // 2, split_backward=False, replicas=2)
        return pipeline(
            self.model,
            schedule=schedule,
            stages=self._cut([self.names[k] for k in cuts]),
            loss_fn=loss_fn,
            record=True,
            parallel=Parallelism(process_group=process_group),
        )

    def _cut(self, split_points: list[str]):
        """The model cut at ``split_points`` from the one trace (``split_model``, as ``pipeline`` cuts it)."""
        return split_model(self.traced, split_points, leaf_modules=self.leaf_modules)

    @property
    def _all_engines(self) -> list:
        return [*self.engines, *([self.exchange] if self.exchange is not None else [])]

    def step(self) -> None:
        """One traced step of each profiling pipeline (every rank calls it)."""
        for engine in self._all_engines:
            self._clear()
            dist.barrier(self.everyone)
            inputs, target = self._batch()
            engine.step(inputs, target=target)
        self._clear()
        self.steps += 1

    def _batch(self) -> tuple:
        """(inputs, {"target": target}) of one step: with ``"ep"`` the batch repeated once per ep rank, so that
        every replica's micro-batches are those of the table (the engine gives each replica its share)."""
        def repeated(value: object) -> object:
            if isinstance(value, torch.Tensor) and self.replicas > 1:
                return torch.cat([value] * self.replicas)
            if isinstance(value, tuple):
                return tuple(repeated(v) for v in value)
            return value

        return repeated(self.inputs), repeated(self.target)

    def count(self) -> dict[str, tuple[Collective, ...]]:
        """One step of each pipeline with every collective counted
        (:class:`~pipeloom.profile.collectives.CollectiveCounter`; a step :meth:`table` leaves out, as counting
        slows every operation) and put down to the traced action it began in: per piece, the collectives of
        one micro-batch (F, I and W from the split pipeline; the full one's B must hold the same as I and W
        together). The same on every rank of a pipeline."""
        from pipeloom.profile.collectives import CollectiveCounter, by_interval, group_mean

        found: dict[object, list[tuple[str, float]]] = {}
        me = dist.get_rank(self.group)
        for engine in self.engines:
            self._clear()
            dist.barrier(self.everyone)
            inputs, target = self._batch()
            with CollectiveCounter() as counter:
                engine.step(inputs, target=target)
            events = engine.trace_document()["steps"][-1]["events"]
            compute = [e for e in events if e["kind"] == "compute"]
            actions = [a for a in engine.schedule.ranks[me] if isinstance(a, Action)]  # the profiling schedule's
            if len(compute) != len(actions):
                raise PlanError(f"rank {me}: the counting step traced {len(compute)} actions for the "
                                f"{len(actions)} it ran; profile again")
            grouped = by_interval(counter, [((a.stage, a.kind, a.microbatch), e["start_ns"], e["end_ns"])
                                            for a, e in zip(actions, compute)])
            outside = grouped.pop(None)
            if outside:
                raise PlanError(f"rank {me}: {len(outside)} collective(s) ran outside every action of the counting "
                                f"step ({sorted(set(outside))[:3]}); a piece's collectives cannot be told apart")
            found.update(grouped)
        self._clear()
        self.counted_steps.append(self.steps)
        self.steps += 1
        if self.ep_group is not None:
            found = group_mean(found, self.ep_group)
        everyone: list[dict | None] = [None] * self.world
        dist.all_gather_object(everyone, found, group=self.group)
        merged = {key: records for part in everyone if part for key, records in part.items()}
        return {name: _piece_collectives(name, k, merged, self.microbatches) for k, name in enumerate(self.names)}

    def table(self, *, skip: int = 0, action_cost: float | None = None, bandwidth: float | None = None,
              action_overhead: float | None = None) -> CostTable:
        """The cost table from the steps after the first ``skip``; the same on every rank.

        Piece times: medians over steps and micro-batches (F: the mean of the two pipelines' medians)
        of each action less the sends and receive posts it made (their mean time becomes the table's
        ``runtime.message_cost``, which a plan's stages pay per edge crossing ranks), and less
        ``action_cost``, the runtime's own seconds inside one action. None fits it where the
        two-replica pipeline ran (else 0): that pipeline runs each rank's run of pieces as one action,
        so a run of n pieces timed whole, ``T``, against its pieces timed apart, ``sum t``, gives
        ``(sum t - T) / (n - 1)``; the median over runs, replicas, F and B, at least 0.
        ``action_overhead`` (default ``action_cost``) is what the planner adds per action. Also
        measured, from the same steps: the link latency under load (mean wait of an action for a
        message it was waiting for), the time spread (:func:`~pipeloom.profile.fits.time_spread`) and
        the step's own cost outside the schedule (``engine.step`` time minus the schedule's span: preamble,
        loss all-reduce, last sends; less the shared-parameter exchange as
        :func:`~pipeloom.plan.costs.shared.shared_sync_time` prices it, which a plan pays apart); both averaged
        over the two pipelines. Where the two-replica pipeline ran, its own cost outside the schedule beyond
        that is its replica-gradient exchange, priced by the table's ``runtime.replica_link``
        (:func:`~pipeloom.profile.fits.fitted_replica_link`);
        and, as both its replicas start a step at once, its ``start_skew`` (:func:`~pipeloom.profile.fits.start_skew`).
        ``bandwidth`` (bytes/s; None: unlimited) goes into the table's link.
        """
        if self.steps <= skip:
            raise PlanError(f"{self.steps} profiling step(s) recorded, {skip} to skip; run step() more often")
        runs = [self._run(engine) for engine in self.engines]
        steps = [step for step in range(skip, self.steps) if step not in self.counted_steps]
        if not steps:
            raise PlanError(f"no timed profiling step after the {skip} skipped and the counting one; run step() more")
        durations = [task_durations(run, steps=steps, messages=False) for run in runs]
        latencies, outside = zip(*(fit_run(run, steps) for run in runs))

        def raw(stage: int, kind: str) -> float:
            return statistics.fmean(d[(stage, kind)] for d in durations if (stage, kind) in d)

        exchange = self._run(self.exchange) if self.exchange is not None else None
        if action_cost is None:
            action_cost = 0.0 if exchange is None else fitted_action_cost(
                raw, self.exchange_bounds, task_durations(exchange, steps=steps, messages=False))
        messages = statistics.fmean(message_cost(run, steps=steps) for run in runs)

        def seconds(stage: int, kind: str) -> float:
            return max(0.0, raw(stage, kind) - action_cost)

        pieces = tuple(dataclasses.replace(piece, f=seconds(k, "F"), i=seconds(k, "I"), w=seconds(k, "W"),
                                           measured_full_backward=seconds(k, "B"))
                       for k, piece in enumerate(self.base.pieces))
        spread = time_spread([(run, task_durations(run, steps=steps)) for run in runs], steps)
        where = self.base.device.split(" (")[0]
        replica_link, skew = self.base.runtime.replica_link, self.base.runtime.start_skew
        link = Link(latency=statistics.fmean(latencies), bandwidth=bandwidth)
        if exchange is not None:
            skew = start_skew(exchange, steps)
            params = [sum(p.param_bytes for p in self.base.pieces[a:b]) for a, b in pairwise(self.exchange_bounds)]
            replica_link = fitted_replica_link(exchange, steps, statistics.fmean(outside), params, link,
                                               speak=dist.get_rank(self.group) == 0)
        # the shared-parameter exchange after the step is priced apart (pipeloom.plan.costs.shared): take it off
        shared = shared_sync_time(self.base, self.rank_of, self.microbatches, link=replica_link or link)
        runtime = RuntimeCorrections(
            action_overhead=action_cost if action_overhead is None else action_overhead, message_cost=messages,
            step_overhead=max(0.0, statistics.fmean(outside) - shared), time_spread=spread, start_skew=skew,
            replica_link=replica_link)
        return dataclasses.replace(
            self.base, pieces=pieces, source="profile", link=link, runtime=runtime,
            device=f"{where} (in the engine, {self.world} ranks, {torch.get_num_threads()} thread(s) each)")

    def _run(self, engine: PipelineEngine) -> RunTrace:
        """The engine's recorded steps on every rank, as one checked :class:`RunTrace`."""
        documents: list[dict | None] = [None] * self.world
        dist.all_gather_object(documents, engine.trace_document(), group=self.group)
        return run_trace_from_documents(documents)

    def _clear(self) -> None:
        for param in self.model.parameters():
            param.grad = None
        if self.tensor_parallel:  # the pipelines' own copies of the model
            for engine in self.engines:
                for param in engine.parameters():
                    param.grad = None


def _mesh_group(mesh: DeviceMesh, name: str) -> ProcessGroup:
    """The process group of ``mesh``'s dimension ``name``; PlanError naming the mesh's dimensions otherwise."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if name not in names:
        raise PlanError(f"the mesh has dimensions {names}; profiling tensor-parallel stages needs \"pp\" and "
                        "\"tp\", e.g. init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'tp'))")
    return mesh.get_group(name)


def _piece_collectives(name: str, stage: int, found: Mapping[object, list[tuple[str, float]]],
                       microbatches: int) -> tuple[Collective, ...]:
    """Piece ``stage``'s collectives of one micro-batch from the counted actions ``found`` ((stage, kind,
    micro-batch) -> (kind, bytes) records): F, I and W of micro-batch 0, checked equal for every micro-batch,
    and the full backward's B equal to I and W together."""
    def records(kind: str, m: int) -> list[tuple[str, float]]:
        return sorted(found.get((stage, kind, m), []))

    for m in range(1, microbatches):
        for kind in ("F", "B", "I", "W"):
            if records(kind, m) != records(kind, 0):
                raise PlanError(f"piece {name!r} ran other collectives in micro-batch {m}'s {kind} "
                                f"({records(kind, m)}) than in micro-batch 0's ({records(kind, 0)})")
    if records("B", 0) != sorted(records("I", 0) + records("W", 0)):
        raise PlanError(f"piece {name!r}: its full backward ran {records('B', 0)}, its I and W together "
                        f"{sorted(records('I', 0) + records('W', 0))}")
    return tuple(Collective(kind=kind, phase=phase, bytes=float(nbytes))
                 for phase in ("F", "I", "W") for kind, nbytes in records(phase, 0))
