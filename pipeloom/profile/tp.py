"""Tensor-parallel profiling in the engine: the stages run sharded by a ``tp_plan`` over a mesh's ``"tp"``
dimension (:class:`~pipeloom.profile.engine.EngineProfiler` with a mesh), their collectives counted
and timed, and what was measured written into a cost table's ``tensor`` field."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import PlanError
from pipeloom.plan.tp.collectives import fit_collectives
from pipeloom.plan.tp.measured import MeasuredPiece, TensorProfile, fit_overhead
from pipeloom.plan.tp.megatron import TensorInfo
from pipeloom.profile.engine import EngineProfiler

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["check_tp_request", "profile_tensor_parallel"]


def check_tp_request(mesh: DeviceMesh | None, tp_plan: object, heads: object,
                     process_group: ProcessGroup | None) -> None:
    """PlanError for a tensor-parallel profiling request that cannot run, naming what to give (what
    :func:`~pipeloom.profile.in_engine.profile_in_engine` checks first, before any profiling step)."""
    if mesh is None or tp_plan is None:
        raise PlanError("profiling tensor-parallel stages needs both mesh= (dimensions \"pp\" and \"tp\") and "
                        "tp_plan= (torch's parallelize_module plan); give both or neither")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if sorted(names) != ["pp", "tp"]:
        raise PlanError(f"the mesh has dimensions {names}; profile tensor-parallel stages on a mesh of exactly "
                        "\"pp\" and \"tp\" (plan_mesh prices \"dp\" replicas from the same table)")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise PlanError(f"heads= (attention heads per layer, which the tensor-parallel size must divide) is needed "
                        f"with a tp_plan, got {heads!r}")
    size = mesh.size(names.index("tp"))
    if size < 2 or heads % size:
        raise PlanError(f"the mesh's \"tp\" size {size} must be at least 2 and divide the {heads} heads")
    if process_group is not None:
        raise PlanError("give mesh= or process_group=, not both: with a mesh the tp-1 pipelines run over every rank")


def profile_tensor_parallel(model: nn.Module, inputs: torch.Tensor | tuple, *,
                            loss_fn: Callable[[object, object], torch.Tensor], target: object, microbatches: int,
                            base: CostTable, mesh: DeviceMesh, tp_plan: Mapping[str, object], heads: int,
                            warmup_steps: int = 2,
                            steps: int = 4, bandwidth: float | None = None, tracer: str = "auto",
                            leaf_modules: Sequence[str] = ()) -> CostTable:
    """``base`` (the tp-1 table of the same pieces) with its ``tensor`` field filled from the stages run under
    ``tp_plan`` on ``mesh``'s ``"tp"`` dimension (:class:`EngineProfiler` with ``mesh``): ``warmup_steps``
    untimed steps, one step with every collective counted (:meth:`EngineProfiler.count`) and ``steps`` timed
    ones give each piece's times on a tp rank and its collectives (kind, phase, bytes), the pipelines' link
    latency and runtime corrections (:class:`~pipeloom.plan.tp.measured.TensorProfile`; the per-action cost is
    ``base``'s, so that both sizes take the same off each action). The counted sizes (and 16 times the
    largest) are timed on the ``"tp"`` group (:func:`~pipeloom.profile.collectives.time_collectives`) and fitted
    per kind (:func:`~pipeloom.plan.tp.collectives.fit_collectives`), plus the engine's own cost per collective
    (:func:`~pipeloom.plan.tp.measured.fit_overhead`), for the sizes not measured. The table's ``layers``, ``column``
    and ``row`` are read from the plan: pieces holding modules that a ``ColwiseParallel`` or ``RowwiseParallel``
    key names, and those modules' names inside them. Every rank gets global rank 0's table."""
    from pipeloom.profile.collectives import time_collectives

    size = mesh.size(tuple(mesh.mesh_dim_names or ()).index("tp"))
    profiler = EngineProfiler(model, inputs, loss_fn=loss_fn, target=target, microbatches=microbatches,
                              pieces=list(base.names), base=base, exchange=False, tracer=tracer,
                              leaf_modules=leaf_modules, mesh=mesh, tp_plan=tp_plan)
    for _ in range(warmup_steps):
        profiler.step()
    counted = profiler.count()
    for _ in range(steps):
        profiler.step()
    timed = profiler.table(skip=warmup_steps, action_cost=base.runtime.action_overhead, bandwidth=bandwidth)
    measured = tuple(MeasuredPiece(name=p.name, f=p.f, i=p.i, w=p.w, full_backward=p.measured_full_backward,
                                   collectives=counted[p.name]) for p in timed.pieces)
    runtime = timed.runtime
    profile = TensorProfile(size=size, pieces=measured, latency=timed.link.latency,
                            runtime={"action_overhead": runtime.action_overhead, "message_cost": runtime.message_cost,
                                     "step_overhead": runtime.step_overhead, "time_spread": runtime.time_spread})
    sizes = sorted({int(c.bytes) for piece in measured for c in piece.collectives})
    samples = time_collectives(mesh.get_group("tp"), [*sizes, 16 * sizes[-1]] if sizes else [])
    fit = fit_overhead(base, profile, fit_collectives(samples))
    layers, column, row = _plan_layout(model, tp_plan, base.names)
    info = TensorInfo(heads=heads, layers=layers, column=column, row=row, fit=fit, profiles=(profile,))
    table = [dataclasses.replace(base, tensor=info)]
    dist.broadcast_object_list(table, src=0)  # every tp coordinate measured its own pipelines: one answer
    return table[0]


def _plan_layout(model: nn.Module, tp_plan: Mapping[str, object], pieces: Sequence[str]
                 ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(layers, column, row)`` of a cost table's ``tensor`` field from a plan: the pieces holding a module a
    ``ColwiseParallel`` or ``RowwiseParallel`` key names (strictly inside the piece), and those modules'
    names inside their piece, in the model's order."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipeloom.runtime.parallel.tp import resolve

    layers: dict[str, None] = {}
    column: dict[str, None] = {}
    row: dict[str, None] = {}
    for key, style in tp_plan.items():
        into = column if isinstance(style, ColwiseParallel) else row if isinstance(style, RowwiseParallel) else None
        if into is None:
            continue
        for name in resolve(model, key):
            piece = max((p for p in pieces if name.startswith(p + ".")), key=len, default=None)
            if piece is not None:
                layers[piece] = None
                into[name[len(piece) + 1:]] = None
    ordered = tuple(p for p in pieces if p in layers)
    return ordered, tuple(column), tuple(row)
