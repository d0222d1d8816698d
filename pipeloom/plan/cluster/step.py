"""What the estimator predicts for one layout: :class:`Estimate` (step time, its parts, throughput, MFU) and
:class:`Memory` (bytes per GPU of the busiest pipeline rank); and what it adds up: :class:`PhaseTimes` (one
micro-batch through one layer or stage, by kind of work); mixed-precision Adam's bytes (:func:`optimizer_bytes`);
how other layouts' estimates compare with the best's (:func:`runners_up_of`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeloom.plan.cluster.layout import Layout

__all__ = ["Memory", "Estimate", "PhaseTimes", "WORK_PARTS", "add_times", "gap_text", "key_text", "named_work",
           "optimizer_bytes", "runners_up_of", "twin_key", "work_parts"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    """Bytes per GPU (the busiest pipeline rank)."""

    weights: float
    """Model weights held (bf16)."""
    gradients: float
    """Gradients held (whole ones in the reduce's dtype: :func:`optimizer_bytes`)."""
    optimizer: float
    """fp32 master weights and Adam's two moments held."""
    activations: float
    """Peak of activations held for the backward (from the schedule's replay)."""
    buffers: float
    """Workspaces: :data:`WORKSPACE_BYTES`, FSDP's gathered layers, a fully recomputed layer's activations."""

    @property
    def total(self) -> float:
        """All of it."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        """The breakdown and the total, in bytes."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "total": self.total}


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """The predicted step of one layout."""

    layout: Layout
    """The layout."""
    stage_layers: tuple[int, ...]
    """Decoder layers of each model stage, in model order (the embedding rides with the first, the head with the
    last)."""
    step_time: float
    """Seconds per step."""
    pipeline_time: float
    """Of it, the schedule's makespan (compute, tp/ep/cp communication, pipeline sends, bubbles)."""
    exposed_dp: float
    """Of it, the data-parallel / FSDP communication the computation does not hide."""
    optimizer_time: float
    """Of it, the optimizer step (bandwidth-bound)."""
    bubble: float
    """Idle fraction of the pipeline ranks during the makespan."""
    memory: Memory
    """Bytes per GPU."""
    tokens_per_gpu_per_second: float
    """Throughput per GPU."""
    mfu: float
    """Model FLOPs (matmuls, causal attention) per second over the GPUs' dense peak in the job's dtype."""
    work: tuple[tuple[str, float], ...] = ()
    """Seconds of one micro-batch's F + I + W through every model stage (one copy of the model: one GPU of each
    stage), by kind of work (:func:`work_parts`)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (seconds and bytes)."""
        return {"layout": self.layout.as_dict(), "stage_layers": list(self.stage_layers), "step_time": self.step_time,
                "pipeline_time": self.pipeline_time,
                "exposed_dp_time": self.exposed_dp, "optimizer_time": self.optimizer_time, "bubble": self.bubble,
                "tokens_per_gpu_per_second": self.tokens_per_gpu_per_second, "mfu": self.mfu,
                "memory_per_gpu": self.memory.as_dict(), "work_per_microbatch": dict(self.work)}


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseTimes:
    """Seconds of one micro-batch through one layer (or the embedding / head) on one GPU."""

    f: float
    """Forward."""
    i: float
    """Input-gradient backward (with recomputation)."""
    w: float
    """Weight-gradient backward."""
    f_comm: float = 0.0
    """Of ``f``, the seconds spent in communication another micro-batch's compute can hide: the expert
    all-to-alls (DualPipe's overlapped pairs hide them, the compute beside them slowed by
    :func:`~pipeloom.plan.cluster.dispatch.pair_slowdown`; :class:`pipeloom.problem.Task` ``comm``)."""
    i_comm: float = 0.0
    """Of ``i``, the same for the input-gradient backward."""
    parts: tuple[tuple[str, float], ...] = ()
    """Of ``f + i + w``, the seconds of each kind of work (:data:`WORK_PARTS`), where priced by part."""


WORK_PARTS = ("GEMMs", "attention", "elementwise", "tensor-parallel exchanges", "expert all-to-all",
              "recomputation")
"""The kinds of work :attr:`PhaseTimes.parts` names: GEMMs (projections, MLPs, experts, router, head); the
attention core (or Gated DeltaNet's kernel, with context parallelism's exchanges and an indexer's scoring);
bandwidth-bound elementwise kernels (norms, activations, rotary, permutes, the loss); the tensor-parallel all-gathers
and reduce-scatters (or all-reduces) between them; the expert dispatch and combine; what recomputation adds."""


def add_times(*parts: PhaseTimes) -> PhaseTimes:
    """The phase times of ``parts`` run one after the other (their communication and work parts summed too)."""
    work: dict[str, float] = {}
    for part in parts:
        for name, seconds in part.parts:
            work[name] = work.get(name, 0.0) + seconds
    return PhaseTimes(f=sum(p.f for p in parts), i=sum(p.i for p in parts), w=sum(p.w for p in parts),
                      f_comm=sum(p.f_comm for p in parts), i_comm=sum(p.i_comm for p in parts),
                      parts=tuple(work.items()))


def named_work(**seconds: float) -> tuple[tuple[str, float], ...]:
    """:attr:`PhaseTimes.parts` from seconds by keyword: ``GEMMs``, ``attention``, ``elementwise``, ``tp`` (the
    tensor-parallel exchanges), ``a2a`` (the expert all-to-all), ``recomputation``; the parts that are nothing left
    out."""
    names = {"GEMMs": "GEMMs", "attention": "attention", "elementwise": "elementwise",
             "tp": "tensor-parallel exchanges", "a2a": "expert all-to-all", "recomputation": "recomputation"}
    return tuple((names[key], value) for key, value in seconds.items() if value > 0)


def work_parts(stages: list[PhaseTimes]) -> dict[str, float]:
    """Seconds of each kind of work (:data:`WORK_PARTS`) of one micro-batch through ``stages`` (F + I + W), what
    no part names (pipeline sends that block, the multi-token-prediction modules) as ``other``."""
    total = add_times(*stages)
    work = dict(total.parts)
    other = total.f + total.i + total.w - sum(work.values())
    if other > 1e-9 * (total.f + total.i + total.w):
        work["other"] = other
    return work


def optimizer_bytes(params: float, *, shards: int = 1, fsdp: bool = False, grad_bytes: float = 2.0,
                    moment_bytes: float = 4.0) -> tuple[float, float, float]:
    """``(weights, gradients, optimizer)`` bytes per GPU of mixed-precision Adam for ``params`` parameters
    held by this GPU: bf16 weights (2), gradients accumulated in the reduce's dtype (``grad_bytes``: 2 for bf16,
    4 for fp32, as Megatron-Core's ``main_grad`` buffer and FSDP2's unsharded accumulation keep them), fp32 master
    weights and two moments of ``moment_bytes`` each (12 in all; 8 with Megatron-Core's precision-aware optimizer's
    bf16 moments). The distributed optimizer shards the optimizer state over ``shards`` data-parallel ranks;
    FSDP also shards the weights and gradients, 16 bytes a parameter in all with fp32 moments whatever the reduce's
    dtype (FSDP2's fp32 shard is the master, its gradient the same dtype; one layer's weights are gathered at a
    time: counted by the estimator as buffers).
    """
    weights, states = 2.0 * params, (4.0 + 2 * moment_bytes) * params
    if fsdp:
        return weights / shards, 2.0 * params / shards, states / shards
    return weights, grad_bytes * params, states / shards


TWIN = 5e-4
"""Runners-up whose step times differ by at most this fraction (below the 0.1 % the text shows) and whose layouts
differ in one key are told in one line."""


def runners_up_of(best: Estimate, done: list[Estimate], limit: float,
                  count: int) -> tuple[tuple[Estimate, str], ...]:
    """The fastest other fitting layouts (slower by how much, and where the time goes), then faster ones that
    do not fit. Layouts within :data:`TWIN` of one listed in step time that differ from it in one key are named in
    its line instead of filling the list (the one of them holding least memory is listed): on a pipeline whose
    busiest rank sets the step, interleaved 1F1B at vp 2 to 8 takes one time, and five such lines had made the
    whole list."""
    fits = _distinct(sorted((e for e in done if e.memory.total <= limit and e is not best),
                            key=lambda e: (e.step_time, e.memory.total)), count)
    over = _distinct(sorted((e for e in done if e.memory.total > limit and e.step_time < best.step_time),
                            key=lambda e: (e.step_time, e.memory.total)), max(1, count // 2) if count else 0)
    out = []
    for est, alike in fits:
        out.append((est, f"{gap_text(est.step_time / best.step_time - 1)} slower ({_why(est, best)}){alike}"))
    for est, alike in over:
        out.append((est, f"needs {est.memory.total / 2**30:.1f} GiB per GPU > {limit / 2**30:.1f} GiB limit{alike}"))
    return tuple(out)


def gap_text(fraction: float) -> str:
    """A runner-up's gap to the best as a percentage, to a thousandth of a percent under 0.1 % (a layout within
    rounding of the best had read "0.0% slower")."""
    return f"{fraction:.1%}" if fraction >= 0.00095 else f"{fraction:.3%}" if fraction >= 5e-6 else "under 0.001%"


def _distinct(ranked: list[Estimate], count: int) -> list[tuple[Estimate, str]]:
    """The first ``count`` groups of twins in ``ranked`` (:func:`twin_key`; a group's twins differ in one key, the
    same for all), each as its member of least memory with the others said: ``"; within 0.05 %: vp=3, 4 or 5"``."""
    groups: list[list[Estimate]] = []
    for est in ranked:
        for members in groups:
            other = twin_key(est, members[0])
            if other is not None and _shared_key(members) in (None, other):
                members.append(est)
                break
        else:
            if len(groups) < count:
                groups.append([est])
    out = []
    for members in groups:
        shown = min(members, key=lambda e: (e.memory.total, dataclasses.astuple(e.layout)))
        key = _shared_key(members)
        said = [str(value) for value in sorted(key_text(getattr(e.layout, key)) for e in members
                                               if e is not shown)] if key is not None else []
        within = f"; within {TWIN:.2%} of its time with"
        out.append((shown, f"{within} {key}={', '.join(said[:-1])} or {said[-1]}" if len(said) > 1
                    else f"{within} {key}={said[0]}" if said else ""))
    return out


def _shared_key(members: list[Estimate]) -> str | None:
    """The key a group of twins differs in (None while it holds one layout)."""
    return twin_key(members[1], members[0]) if len(members) > 1 else None


def twin_key(a: Estimate, b: Estimate) -> str | None:
    """The one layout key ``a`` and ``b`` differ in where their step times are within :data:`TWIN` of each other:
    twins to the reader; else None (a twin of a twin differs from the first in two keys, and is not its twin)."""
    other = [f.name for f in dataclasses.fields(a.layout) if getattr(a.layout, f.name) != getattr(b.layout, f.name)]
    return other[0] if len(other) == 1 and abs(a.step_time - b.step_time) <= TWIN * b.step_time else None


def key_text(value: Any) -> Any:
    """A layout key's value as ``--layout`` takes it (fsdp as 0 or 1)."""
    return int(value) if isinstance(value, bool) else value


def keys_text(fixed: dict[str, Any]) -> str:
    """Layout keys as ``--layout`` takes them, or ``no fixed keys``."""
    return ",".join(f"{k}={key_text(v)}" for k, v in fixed.items()) or "no fixed keys"


def _why(est: Estimate, best: Estimate) -> str:
    """The parts of the step that grew against the best, most first, then those that shrank (each by at least a
    twentieth of the largest change), and the rest where it shows, so the gap adds up (a runner-up slower in both its
    compute and its exposed dp exchange had been told the first alone); the compute's part names the exchanges on
    its critical path only where either layout has them."""
    exchanged = "/".join(key for key in ("tp", "cp", "ep") if max(getattr(one.layout, key) for one in (est, best)) > 1)
    parts = {"bubble": est.bubble * est.pipeline_time - best.bubble * best.pipeline_time,
             f"compute{f' and {exchanged} communication' if exchanged else ''}": (1 - est.bubble) * est.pipeline_time
             - (1 - best.bubble) * best.pipeline_time,
             "exposed dp communication": est.exposed_dp - best.exposed_dp,
             "optimizer step": est.optimizer_time - best.optimizer_time}
    largest = max(parts.values())
    if largest <= 1e-9 * best.step_time:
        return "the same step within rounding"
    shown = sorted(((name, d) for name, d in parts.items() if abs(d) >= 0.05 * largest), key=lambda item: -item[1])
    # the small parts left out, said where they show against the step or the gap (a 0.034 % gap had been told as
    # parts adding up to a faster step, the optimizer's +0.00014 s left out)
    gap, step = sum(parts.values()), best.step_time
    rest = gap - sum(d for _, d in shown)
    shows = abs(rest) >= min(1e-3 * step, 0.1 * abs(gap)) and abs(rest) > 1e-9 * step
    tail = [f"the rest {rest:+.2g} s"] if shows else []
    return ", ".join([*(f"{name} {d:+.3g} s" for name, d in shown), *tail])
