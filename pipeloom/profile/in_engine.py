"""Measure a model's piece times inside the runtime, on the ranks that will train it.

:func:`pipeloom.profile.model.profile_model` times each piece alone on one process. In a pipeline the same
kernels run while the other ranks compute and the runtime sends, receives and keeps its books, and
on shared CPU cores that changes their time by tens of percent. :func:`profile_in_engine` instead
cuts the model at every piece, gives each rank a run of consecutive pieces, runs that pipeline through
``pipeloom.pipeline`` with tracing on (once with a full backward B, once split into I and W), and
takes each piece's median traced F, B, I and W. Bytes still come from ``profile_model``. A third,
two-replica pipeline (as Chimera and DualPipe run) measures what their gradient exchange costs.

On a ``("pp", "ep")`` mesh it runs those pipelines with each MoE layer's experts shared out over ``"ep"``
(their all-to-alls inside the pieces' times, the experts' bytes this rank does not hold taken off).

On a ``("pp", "tp")`` mesh with a tensor-parallel plan it does that over every rank (the table's tp-1 times),
then runs the same two pipelines over ``"pp"`` with each stage sharded by the plan over ``"tp"`` (torch's
``parallelize_module``, as ``pipeline(mesh=..., tp_plan=...)`` runs it), counts every piece's collectives
in one step, times them on the ``"tp"`` group, and writes what it measured into the table's ``tensor`` field
(:class:`~pipeloom.plan.tp.measured.TensorProfile` and the fitted :class:`~pipeloom.plan.tp.collectives.CollectiveFit`).

Every rank must call it (a collective on the process group); every rank gets the same table. The pipelines
and their table are :mod:`pipeloom.profile.engine` (its fits :mod:`pipeloom.profile.fits`), the
tensor-parallel pass :mod:`pipeloom.profile.tp`; this module is the entry point that runs them in turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import PlanError
from pipeloom.profile.engine import EngineProfiler
from pipeloom.profile.tp import check_tp_request, profile_tensor_parallel

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["profile_in_engine"]

# The fits' names from before they moved to pipeloom.profile.fits (tests import them from here).


def profile_in_engine(
    model: nn.Module,
    inputs: torch.Tensor | tuple,
    *,
    loss_fn: Callable[[object, object], torch.Tensor],
    target: object,
    microbatches: int,
    pieces: Sequence[str] | None = None,
    process_group: ProcessGroup | None = None,
    warmup_steps: int = 2,
    steps: int = 4,
    action_cost: float | None = None,
    bandwidth: float | None = None,
    base: CostTable | None = None,
    exchange: bool = True,
    tracer: str = "auto",
    leaf_modules: Sequence[str] = (),
    mesh: DeviceMesh | None = None,
    tp_plan: Mapping[str, object] | None = None,
    heads: int | None = None,
) -> CostTable:
    """The cost table of ``model`` with piece times measured inside the runtime (see the module text).

    ``inputs``/``target`` are one step's batch, cut into ``microbatches``; the table is for that
    micro-batch size. ``warmup_steps`` untimed steps, then ``steps`` traced ones, of each of the two
    :func:`profiling_schedule` pipelines (:class:`EngineProfiler`). A traced action also holds the
    runtime's own work: the sends and receive posts it makes are taken off its piece time (their mean
    becomes the table's ``runtime.message_cost``), and ``action_cost``, the seconds of the rest per action, is
    taken off every piece time and becomes the table's ``runtime.action_overhead``, so that a stage of
    several pieces pays it once; None fits it from the two-replica pipeline (where it runs; else 0).
    The link latency, the per-step overhead, the time spread and (two-replica pipeline) the start
    skew are fitted from the same steps (:meth:`EngineProfiler.table`); ``bandwidth``
    (bytes/s) completes the link. Bytes come from ``base`` (default: ``profile_model`` on one
    micro-batch). ``exchange`` (with two ranks or more and an even number of micro-batches) also runs a
    two-replica profiling pipeline and fits the table's ``runtime.replica_link`` from its gradient exchange.
    The model is traced once, as ``pipeline`` traces it (``tracer``, ``leaf_modules``; torch.export on
    one micro-batch of ``inputs`` where torch.fx cannot), and every pipeline cuts that trace.

    ``mesh`` (a ``DeviceMesh`` with dimensions ``"pp"`` and ``"tp"``, every rank of the default group) with
    ``tp_plan`` (torch's ``parallelize_module`` plan, the model's module names) and ``heads`` (attention heads
    per layer): the above over every rank gives the tp-1 table, then :func:`profile_tensor_parallel` measures
    the stages sharded over ``"tp"`` and fills the table's ``tensor`` field.
    ``mesh`` with dimensions ``"pp"`` and ``"ep"`` (a model with MoE layers; no ``tp_plan``): the pipelines run
    over ``"pp"`` with the experts shared out over ``"ep"`` (:class:`EngineProfiler` with that mesh), so each
    piece's times hold its expert all-to-alls; see :func:`_profile_expert_parallel`.
    Every rank calls this and gets the same table; the model's gradients are cleared.
    """
    if warmup_steps < 0 or steps < 1:
        raise PlanError(f"need warmup_steps >= 0 and steps >= 1, got {warmup_steps} and {steps}")
    if mesh is not None and "ep" in tuple(getattr(mesh, "mesh_dim_names", None) or ()):
        if tp_plan is not None or process_group is not None:
            raise PlanError("profiling on a (\"pp\", \"ep\") mesh takes no tp_plan= or process_group=")
        return _profile_expert_parallel(model, inputs, loss_fn=loss_fn, target=target, microbatches=microbatches,
                                        pieces=pieces, warmup_steps=warmup_steps, steps=steps,
                                        action_cost=action_cost, bandwidth=bandwidth, base=base, tracer=tracer,
                                        leaf_modules=leaf_modules, mesh=mesh)
    if mesh is not None or tp_plan is not None:
        check_tp_request(mesh, tp_plan, heads, process_group)
        from pipeloom.runtime.parallel.tp import leaf_modules_for

        assert tp_plan is not None  # check_tp_request
        leaf_modules = leaf_modules_for(model, tp_plan, leaf_modules)  # the same pieces with and without tp
    profiler = EngineProfiler(model, inputs, loss_fn=loss_fn, target=target, microbatches=microbatches,
                              pieces=pieces, process_group=process_group, base=base, exchange=exchange,
                              tracer=tracer, leaf_modules=leaf_modules)
    for _ in range(warmup_steps + steps):
        profiler.step()
    table = profiler.table(skip=warmup_steps, action_cost=action_cost, bandwidth=bandwidth)
    if mesh is None:
        return table
    assert tp_plan is not None and heads is not None  # check_tp_request
    return profile_tensor_parallel(model, inputs, loss_fn=loss_fn, target=target, microbatches=microbatches,
                                   base=table, mesh=mesh, tp_plan=tp_plan, heads=heads, warmup_steps=warmup_steps,
                                   steps=steps, bandwidth=bandwidth, tracer=tracer, leaf_modules=leaf_modules)


def _profile_expert_parallel(model: nn.Module, inputs: torch.Tensor | tuple, *, mesh: DeviceMesh,
                             warmup_steps: int, steps: int, action_cost: float | None, bandwidth: float | None,
                             base: CostTable | None, **given: Any) -> CostTable:
    """The table of ``model``'s pieces on one ep rank of a ``("pp", "ep")`` mesh: times from the profiling
    pipelines with the experts shared out (every ep rank steps the whole ``inputs``, so the micro-batches are
    the table's), and each piece's ``param_bytes`` less the ``(ep - 1) / ep`` of its experts' parameters this
    rank does not hold (activation and output bytes as on one device: balanced routing brings each rank as
    many rows as it sends)."""
    from pipeloom.runtime.parallel.ep import find_experts

    profiler = EngineProfiler(model, inputs, base=base, exchange=False, mesh=mesh, **given)
    for _ in range(warmup_steps + steps):
        profiler.step()
    table = profiler.table(skip=warmup_steps, action_cost=action_cost, bandwidth=bandwidth)
    ep = profiler.replicas
    experts = [(name, sum(p.numel() * p.element_size() for p in model.get_submodule(name).parameters()))
               for name in find_experts(model, None)]

    def held(piece: str) -> float:  # expert bytes inside this piece that other ep ranks hold
        inside = [nbytes for name, nbytes in experts if name == piece or name.startswith(piece + ".")]
        return sum(inside) * (ep - 1) / ep

    pieces = tuple(dataclasses.replace(p, param_bytes=p.param_bytes - held(p.name)) for p in table.pieces)
    return dataclasses.replace(table, pieces=pieces, device=f"{table.device}, experts over ep {ep}")
