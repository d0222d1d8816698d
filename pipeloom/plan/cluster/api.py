"""The cluster planner's Python API: :func:`plan_cluster` mirrors ``pipeloom plan --model ... --hardware ...``
(a model config and a GPU type in, the fastest layout that fits, its prediction and the runners-up out)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeloom.errors import ArgumentError
from pipeloom.plan.cluster.counts import RECOMPUTE_MODES, model_params
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import FRAMEWORK_SCHEDULES, LAYOUT_KEYS, ON_REQUEST, SCHEDULES, Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.cluster.model.spec import ModelSpec
from pipeloom.plan.cluster.recompute import SEARCHED, module_sets, recompute_depths
from pipeloom.plan.cluster.runtime_plan import for_runtime
from pipeloom.plan.cluster.search import search_faster, search_layouts
from pipeloom.plan.cluster.step import Estimate, runners_up_of
from pipeloom.plan.costs.parts import parse_bytes
from pipeloom.plan.errors import CostTableError, LayoutError, NoLayoutFits, PlanError
from pipeloom.schedules import REGISTRY, meant_schedule

__all__ = ["ClusterPlan", "FRAMEWORKS", "framework_options", "parse_layout", "plan_cluster"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterPlan:
    """The planner's answer."""

    job: Job
    """What was planned."""
    best: Estimate
    """The chosen layout's prediction."""
    runners_up: tuple[tuple[Estimate, str], ...]
    """Other layouts and why each lost."""
    memory_limit: float
    """Bytes per GPU the plan had to fit."""
    seconds: float
    """Seconds the planning took."""
    candidates: int
    """Layouts that could run."""
    priced: int
    """Layouts whose step-time bound and memory were computed."""
    simulated: int
    """Layouts priced by replaying their schedule."""
    searched: tuple[str, ...] = ()
    """The job's choices the planner searched (``selective``, ``recompute_layers``: given as ``"search"``); the
    job holds the values that won."""
    variants: int = 0
    """Plans made for :attr:`searched` (the first values over every layout, each other value over its
    recomputation mode's layouts: every combination covered), 0 when nothing was searched."""
    runs_on: str | None = None
    """The runtime whose layouts alone were searched (``plan_cluster``'s ``runs_on``), None for every layout."""

    @property
    def fits(self) -> bool:
        """Whether the chosen layout's memory per GPU is within :attr:`memory_limit` (a layout fixed whole is predicted
        whether or not it fits; ``--json``'s ``best.fits``)."""
        return self.best.memory.total <= self.memory_limit

    def training(self, tokens: float) -> dict[str, float]:
        """Training ``tokens`` tokens with the chosen layout: ``steps`` (whole steps of the global batch),
        ``seconds`` and ``gpu_hours`` (every GPU of the job for that time), as NeMo's performance tables give
        time to train; the step's predicted time throughout (no warm-up, checkpoints or failures)."""
        if (isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not 0 < tokens < float("inf")
                or not float(tokens).is_integer()):
            raise ArgumentError(f"tokens to train must be a positive whole number, got {tokens!r}")
        steps = math.ceil(tokens / (self.job.global_batch * self.job.seq))
        seconds = steps * self.best.step_time
        return {"tokens": float(tokens), "steps": steps, "seconds": seconds,
                "gpu_hours": seconds * self.job.gpus / 3600}

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object (seconds and bytes)."""
        hw = self.job.hw
        return {
            "best": dict(self.best.as_dict(), fits=self.fits, fits_gpu=self.best.memory.total <= hw.memory_bytes),
            "runners_up": [dict(est.as_dict(), why=why) for est, why in self.runners_up],
            # as given (a small job's placement in one domain is the job's): read back, the same job prices alike
            "hardware": (self.job.described or hw).to_dict(),
            "model": _model(self.job.spec),
            "gpus": self.job.gpus, "global_batch": self.job.global_batch, "seq": self.job.seq,
            "dtype": self.job.dtype, **{name: getattr(self.job, name) for name in _JOB_CHOICES},  # what it assumes
            "searched": list(self.searched), "variants": self.variants, "runs_on": self.runs_on,
            "memory_limit": self.memory_limit, "candidates": self.candidates, "priced": self.priced,
            "simulated": self.simulated, "seconds": self.seconds,
        }


_JOB_CHOICES = tuple(f.name for f in dataclasses.fields(Job) if f.name not in  # the framework's choices it assumes
                     ("spec", "hw", "gpus", "global_batch", "seq", "dtype", "schedules", "described"))


def _model(spec: ModelSpec) -> dict[str, Any]:
    """``--json``'s ``model``: :meth:`ModelSpec.as_dict` with the parameter counts after its size (``params`` as
    transformers counts them, ``active_params`` with only the top-k routed experts a token runs)."""
    out: dict[str, Any] = {}
    for key, value in spec.as_dict().items():
        out[key] = value
        if key == "hidden":
            out.update(params=model_params(spec), active_params=model_params(spec, active=True))
    return out


FRAMEWORKS: dict[str, dict[str, Any]] = {
    "megatron-bridge": {"kernels": "fused", "attention": "flash", "selective": "core_attn", "cp_rotate": "ring",
                        "grad_reduce": "bf16", "stage_cut": "even", "tp_overlap": True, "fp8_cast": "current"},
    "torchtitan": {"kernels": "eager", "attention": "flash2", "selective": "op", "cp_rotate": "allgather",
                   "grad_reduce": "fp32", "stage_cut": "even", "tp_overlap": False, "fp8_cast": "dynamic",
                   "distributed_optimizer": False, "blocking_1f1b": False},
}
"""The :class:`Job` choices a framework makes as its users run it (:func:`framework_options`), each from its source:
**megatron-bridge**, NVIDIA's Megatron-Bridge performance recipes at v0.4.2 (``scripts/performance/configs/``):
Transformer Engine's fused kernels and attention, the attention core as selective recomputation (Megatron-Core's
default ``recompute_modules``), K/V passed around the context-parallel ring, gradients reduce-scattered in bf16
(``grad_reduce_in_fp32`` False), layers cut evenly over the stages (Megatron-Core's split), ``tp_comm_overlap`` where
tp > 1, FP8 with current scaling (their FP8-CS); **torchtitan**, its job config's defaults (torchtitan 0.3): no
``torch.compile`` (eager elementwise kernels), PyTorch SDPA (FlashAttention-2), the op-level selective policy,
``context_parallel_rotate_method = "allgather"``, ``mixed_precision_reduce = "float32"``, ``generate_split_points``'
even cut, async TP off, torchao's per-tensor dynamic Float8, no distributed optimizer (Adam's state whole on each
replica without FSDP), 1F1B's sends beside the compute (torch's pipelining). Per-model exceptions are flags."""


def framework_options(name: str, *, dtype: str = "bf16") -> dict[str, Any]:
    """The :data:`FRAMEWORKS` choices of ``name`` as :func:`~pipeloom.plan.cluster.api.plan_cluster` keywords (the
    FP8 casts only for ``dtype="fp8"``: a BF16 job casts nothing); LayoutError for an unknown name."""
    if name not in FRAMEWORKS:
        raise LayoutError(f"unknown framework {name!r}: use one of {', '.join(FRAMEWORKS)}, or give its choices "
                          "one by one (kernels, attention, selective, ...)")
    return {key: value for key, value in FRAMEWORKS[name].items() if key != "fp8_cast" or dtype == "fp8"}


def plan_cluster(model: str | Path | Mapping[str, Any] | ModelSpec | Any, hw: str | Path | Hardware | dict, *,
                 gpus: int, global_batch: int, seq: int, dtype: str = "bf16",
                 layout: str | Mapping[str, Any] | None = None, kernels: str = "fused", attention: str = "flash",
                 overlap_grad_reduce: bool = True, p2p_overlap: bool = True, blocking_1f1b: bool = True,
                 selective: str = "core_attn", cp_rotate: str = "ring", moe_comm: str = "plain",
                 grad_reduce: str = "bf16", sequence_parallel: bool = True, tp_overlap: bool = False,
                 fp8_cast: str = "cached", stage_cut: str = "balanced", moe_overlap: bool = False,
                 recompute_layers: int | str = 0, shard_gradients: bool = False, adam_moments: str = "fp32",
                 distributed_optimizer: bool = True, memory_limit: float | str | None = None, runners_up: int = 5,
                 runs_on: str | None = None, schedules: Sequence[str] | None = None,
                 progress: Callable[[str], None] | None = None) -> ClusterPlan:
    """The fastest layout of ``model`` (config.json path, dict, PretrainedConfig or ModelSpec) on ``gpus`` GPUs of type
    ``hw`` (a built-in name, a hardware JSON file or a Hardware) for ``global_batch`` sequences of ``seq`` tokens,
    within ``memory_limit`` per GPU (bytes, or a size such as ``"40GiB"``; default the GPU's memory). The framework
    choices are :class:`Job`'s fields of the same names: ``kernels`` ``fused`` or ``eager`` elementwise kernels;
    ``attention`` ``flash`` or ``materialized`` scores (Megatron-LM before flash attention); ``overlap_grad_reduce``
    False: the gradient all-reduce after the backward, exposed; ``p2p_overlap`` False: blocking pipeline sends (both
    Megatron-LM 2021), ``blocking_1f1b`` False: 1F1B's beside the compute (Megatron-Core's block); ``selective``:
    what ``recompute=selective`` recomputes, Megatron-Core's ``recompute_modules`` comma-separated (default
    ``core_attn``, the attention core; :mod:`.recompute`), ``op`` (torchtitan's op-level policy), ``layer`` (every
    second layer whole), ``deepseek`` (DeepSeek-V3's) or ``search`` (each of :func:`.recompute.module_sets`);
    ``cp_rotate`` ``ring`` (Megatron-Core) or ``allgather`` (PyTorch's); ``moe_comm`` ``plain``, ``deepseek`` or
    ``hybridep`` all-to-all kernels; ``grad_reduce`` the gradient reduce-scatter's dtype, ``bf16`` or ``fp32``;
    ``sequence_parallel`` False: Megatron-LM's tensor parallelism before 2022; ``tp_overlap``: tensor-parallel
    exchanges beside the GEMMs; ``fp8_cast``: how FP8 GEMMs cast their inputs (:attr:`Job.fp8_cast`);
    ``stage_cut`` ``balanced``, ``even`` or a Megatron-Core pipeline layout; ``moe_overlap``: each backward beside the
    rank's next forward, hiding each other's expert all-to-all; ``recompute_layers``: with ``recompute=full``, only
    the first N decoder layers of each stage (0: every layer), or ``search`` (each of
    :func:`~pipeloom.plan.cluster.recompute.recompute_depths` tried); ``shard_gradients``: ZeRO-2; ``adam_moments``
    ``fp32`` or ``bf16``; ``distributed_optimizer`` False: Adam's state whole on each replica without FSDP (as
    torchtitan holds it). ``layout``: keys held fixed (``"tp=4,pp=8"`` or a dict); with all of :data:`LAYOUT_KEYS`
    it predicts that layout alone. ``runs_on``: only the layouts that runtime runs, ``pipeloom`` (``pipeline(model,
    plan=...)``), ``torchtitan`` or ``megatron`` (the exports), priced as it holds their state (:func:`.for_runtime`);
    ``schedules``: only these (:data:`.FRAMEWORK_SCHEDULES`; default all but :data:`.ON_REQUEST`'s)."""
    start = time.perf_counter()
    device = hardware(hw)
    listed = _checked_arguments(dtype, runners_up, schedules)
    spec = model_spec(model)
    depth: Any = 0 if recompute_layers == SEARCHED else recompute_layers  # Job refuses anything but a count
    flags: dict[str, Any] = _checked_flags(
        overlap_grad_reduce=overlap_grad_reduce, p2p_overlap=p2p_overlap, blocking_1f1b=blocking_1f1b,
        sequence_parallel=sequence_parallel, tp_overlap=tp_overlap, moe_overlap=moe_overlap,
        shard_gradients=shard_gradients, distributed_optimizer=distributed_optimizer)
    job = Job(spec=spec, hw=device, gpus=gpus, global_batch=global_batch, seq=seq, dtype=dtype,
              kernels=kernels, attention=attention, selective="core_attn" if selective == SEARCHED else selective,
              cp_rotate=cp_rotate, moe_comm=moe_comm, grad_reduce=grad_reduce, schedules=listed or (),
              fp8_cast=fp8_cast, stage_cut=stage_cut, adam_moments=adam_moments, recompute_layers=depth, **flags)
    fixed = parse_layout(layout if isinstance(layout, str) else _layout_text(layout))
    limit = _memory_limit(memory_limit, device)
    job, runtime = for_runtime(job, runs_on)
    blocked = _only(listed, runtime)
    choices: dict[str, list[Any]] = {
        "selective": [",".join(modules) for modules in module_sets(spec)] if selective == SEARCHED else [],
        "recompute_layers": recompute_depths(spec) if recompute_layers == SEARCHED else []}
    searched = {name: values for name, values in choices.items() if values}
    if not searched:
        return dataclasses.replace(_plan(job, fixed, limit, runners_up, progress, start, blocked), runs_on=runs_on)
    job = dataclasses.replace(job, **{name: values[0] for name, values in searched.items()})
    return dataclasses.replace(_best_variant(_variants(job, searched, fixed), tuple(searched), fixed, limit,
                                             runners_up, progress, start, blocked), runs_on=runs_on)


_MODE_OF = {"selective": "selective", "recompute_layers": "full"}  # the recompute mode whose layouts each changes


def _only(allowed: tuple[str, ...] | None, runtime: Callable[[Layout], list[str]] | None
          ) -> Callable[[Layout], list[str]] | None:
    """The search's filter: ``runtime``'s, and a schedule not among ``allowed`` (None: any)."""
    if allowed is None:
        return runtime

    who = next((f"{name} runs" for name, runs in FRAMEWORK_SCHEDULES.items()  # its own, or all but ON_REQUEST's
                if set(runs) - set(ON_REQUEST) <= set(allowed) <= set(runs)), "the schedules given are")

    def blocked(layout: Layout) -> list[str]:  # one stage (1f1b) runs without a pipeline schedule
        off = ([f"schedule={layout.schedule} ({who} {', '.join(allowed)})"]
               if layout.schedule not in allowed and layout.pp > 1 else [])
        return (runtime(layout) if runtime else []) + off
    return blocked


def _schedule_hint(name: str) -> str:
    """What follows a schedule name the cluster planner does not take: that it does not price a built-in one (gpipe,
    zb-h2, ...), else the name meant (``zb-v``: zbv)."""
    if name in REGISTRY:
        return " (the cluster planner does not price it; pipeloom plan --costs searches every built-in schedule)"
    return meant_schedule(name, among=SCHEDULES)


def _checked_flags(**flags: Any) -> dict[str, bool]:
    """``flags`` as they are; ArgumentError for one that is not True or False (``"false"`` had been read as true)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ArgumentError(f"{name} must be True or False, got {value!r}")
    return flags


def _checked_arguments(dtype: str, runners_up: int, schedules: Sequence[str] | None) -> tuple[str, ...] | None:
    """``schedules`` as a tuple (None: not given); ArgumentError for a dtype other than bf16 / fp8, a runners-up count
    that is not a whole number >= 0, or schedules naming none or one the planner does not price."""
    if dtype not in ("bf16", "fp8"):
        raise ArgumentError(f"dtype must be 'bf16' or 'fp8' (the GEMMs' inputs), got {dtype!r}")
    if isinstance(runners_up, bool) or not isinstance(runners_up, int) or runners_up < 0:
        raise ArgumentError(f"runners_up must be a whole number >= 0 (0: the best layout alone), got {runners_up!r}")
    if schedules is None:
        return None
    given = (schedules,) if isinstance(schedules, str) else tuple(schedules)
    if any(not isinstance(name, str) for name in given):
        raise ArgumentError(f"schedules must be names, some of {', '.join(SCHEDULES)}, got {list(given)!r}")
    listed = tuple(dict.fromkeys(name.strip().lower() for name in given))  # each once; ZBV as zbv, as --schedules
    wrong = next((name for name in listed if name not in SCHEDULES), None)
    if not listed or wrong is not None:
        hint = "" if wrong is None else " (give a list: ['zbv', '1f1b'])" if "," in wrong else _schedule_hint(wrong)
        raise ArgumentError(f"schedules must be some of {', '.join(SCHEDULES)}, got {list(given)!r}{hint}")
    return listed


def parse_layout(text: str) -> dict[str, Any]:
    """The keys of ``tp=4,pp=8,...,recompute=selective,schedule=zbv`` (some or all of :data:`LAYOUT_KEYS`)."""
    fixed: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()  # TP=2 as tp=2, as the values' names are read in any case
        if not sep or key not in LAYOUT_KEYS:
            raise LayoutError(f"bad layout item {item!r}: expected key=value with key one of {', '.join(LAYOUT_KEYS)}")
        if key in fixed:
            raise LayoutError(f"layout key {key!r} given twice")
        value = value.strip()
        if key in ("recompute", "schedule"):
            fixed[key] = value.lower()  # 1F1B, None: the names are lower-case
            choices = RECOMPUTE_MODES if key == "recompute" else tuple(SCHEDULES)
            if fixed[key] not in choices:
                raise LayoutError(f"layout {key}={value} is not one of {', '.join(choices)}"
                                  + (_schedule_hint(fixed[key]) if key == "schedule" else ""))
            continue
        try:
            number = int(value)
        except ValueError:
            apart = " (the items are separated by commas: tp=2,pp=4)" if "=" in value or " " in value.strip() else ""
            raise LayoutError(f"layout {key} must be an integer, got {value!r}{apart}") from None
        if number < (0 if key == "fsdp" else 1) or (key == "fsdp" and number > 1):
            raise LayoutError(f"layout {key}={value} is out of range ({'0 or 1' if key == 'fsdp' else '>= 1'})")
        fixed[key] = bool(number) if key == "fsdp" else number
    return fixed


def _layout_text(layout: Mapping[str, Any] | None) -> str:
    """A ``layout`` mapping as :func:`parse_layout`'s text, so that it is checked alike: whole numbers (``fsdp`` also
    true or false), names for ``recompute`` and ``schedule``; anything else is refused naming the key."""
    if layout is None:
        return ""
    if not isinstance(layout, Mapping):
        raise LayoutError(f"layout must be a text such as 'tp=4,pp=8' or a mapping of its keys, got "
                          f"{type(layout).__name__}")
    items = []
    for given, value in layout.items():
        key = str(given).strip().lower()  # FSDP as fsdp, as parse_layout reads the text's keys
        named = key in ("recompute", "schedule")
        if isinstance(value, int) and not named and (key == "fsdp" or not isinstance(value, bool)):
            value = int(value)  # fsdp also true or false
        elif isinstance(value, bool) or not isinstance(value, str) or "," in value:
            raise LayoutError(f"layout {key} must be {'a name' if named else 'an integer'}, got {value!r}")
        items.append(f"{key}={value}")
    return ",".join(items)


def _memory_limit(limit: float | str | None, device: Hardware) -> float:
    """Bytes per GPU a plan may use: ``limit`` (bytes, or a size such as ``"40GiB"``), else the GPU's memory."""
    if limit is None:
        return float(device.memory_bytes)
    try:
        value = parse_bytes(limit)
    except CostTableError as err:  # a negative number is refused as 0 is, not as parse_bytes' ">= 0"
        raise ArgumentError(f"memory_limit: {err}" if not isinstance(limit, (int, float)) or limit >= 0 else
                            f"memory_limit must be more than 0 bytes, got {limit!r}") from None
    if value <= 0:
        raise ArgumentError(f"memory_limit must be more than 0 bytes, got {limit!r}")
    if value < 2**20:
        raise ArgumentError(f"memory_limit {limit!r} is {value:g} bytes per GPU; give bytes (80 * 2**30) or a size "
                            "such as '80GiB'")
    return value


def _variants(job: Job, searched: dict[str, list[Any]], fixed: dict[str, Any]) -> list[tuple[Job, dict[str, Any]]]:
    """The plans the searched choices need, as (job, fixed keys): ``job`` (every choice at its first value) over
    every layout, then each other value of a choice over the layouts of its mode alone (:data:`_MODE_OF`: a
    selective set changes only the layouts that recompute selectively, a depth only those that recompute fully),
    which covers every combination of the values without planning each one."""
    modes = [fixed["recompute"]] if "recompute" in fixed else None
    runs = [(job, fixed)]
    for name, values in searched.items():
        mode = _MODE_OF[name]
        if modes is None or mode in modes:
            runs += [(dataclasses.replace(job, **{name: value}), {**fixed, "recompute": mode}) for value in values[1:]]
    return runs


def _plan(job: Job, fixed: dict[str, Any], limit: float, runners_up: int, progress: Callable[[str], None] | None,
          start: float, blocked: Callable[[Layout], list[str]] | None = None) -> ClusterPlan:
    """The plan of ``job``: the layout ``fixed`` gives whole, predicted, or the fastest that fits ``limit`` (of those
    ``blocked`` passes: a whole layout it blocks is refused)."""
    if set(fixed) >= set(LAYOUT_KEYS):
        layout = Layout(**fixed)
        why = blocked(layout) if blocked is not None else []
        if why:
            raise PlanError(f"{layout} cannot run there: {'; '.join(why)}")
        return ClusterPlan(job=job, best=Estimator(job).estimate(layout), runners_up=(), memory_limit=limit,
                           seconds=time.perf_counter() - start, candidates=1, priced=1, simulated=1)
    result = search_layouts(job, fixed=fixed, memory_limit=limit, runners_up=runners_up, progress=progress,
                            blocked=blocked)
    return ClusterPlan(job=job, best=result.best, runners_up=result.runners_up, memory_limit=limit,
                       seconds=time.perf_counter() - start, candidates=result.candidates, priced=result.priced,
                       simulated=result.simulated)


def _best_variant(runs: list[tuple[Job, dict[str, Any]]], searched: tuple[str, ...], fixed: dict[str, Any],
                  limit: float, runners_up: int, progress: Callable[[str], None] | None, start: float,
                  blocked: Callable[[Layout], list[str]] | None = None) -> ClusterPlan:
    """The searched choices (:func:`_variants`): the first run planned whole, each later one searched for a layout
    faster than the best so far (:func:`~pipeloom.plan.cluster.search.search_faster`), the fastest plan that fits
    kept (the earlier on a tie); the runners-up the fastest other layouts any run simulated. A whole layout given:
    each run's prediction, the fastest within ``limit``, else the one that needs least memory. None fits: the
    refusal that names the least memory."""
    whole = set(fixed) >= set(LAYOUT_KEYS)
    plans: list[ClusterPlan] = []
    refusals: list[NoLayoutFits] = []
    for job, keys in runs:
        fitting = [plan.best.step_time for plan in plans if plan.best.memory.total <= limit]
        try:
            if whole:
                plans.append(_plan(job, keys, limit, runners_up, progress, start, blocked))
                continue
            # searched even where the run's keys name a whole layout: it must fit the limit, as the search's would
            found = (search_faster(job, min(fitting), fixed=keys, memory_limit=limit, runners_up=runners_up,
                                   progress=progress, blocked=blocked) if fitting
                     else search_layouts(job, fixed=keys, memory_limit=limit, runners_up=runners_up,
                                         progress=progress, blocked=blocked))
        except NoLayoutFits as refusal:
            refusals.append(refusal)
            continue
        if found is not None:
            plans.append(ClusterPlan(job=job, best=found.best, runners_up=found.runners_up, memory_limit=limit,
                                     seconds=0.0, candidates=found.candidates, priced=found.priced,
                                     simulated=found.simulated))
    if not plans:
        raise min(refusals, key=lambda r: float("inf") if r.smallest_limit is None else r.smallest_limit)
    fitting_plans = [plan for plan in plans if plan.best.memory.total <= limit]
    best = (min(fitting_plans, key=lambda plan: plan.best.step_time) if fitting_plans
            else min(plans, key=lambda plan: plan.best.memory.total))
    others: dict[str, Estimate] = {}
    for est in (est for plan in plans for est in (plan.best, *(e for e, _ in plan.runners_up))):
        name = str(est.layout)
        if name != str(best.best.layout) and (
                name not in others or est.step_time < others[name].step_time):
            others[name] = est  # a layout under two values of a choice: its faster
    return dataclasses.replace(best, seconds=time.perf_counter() - start, searched=searched, variants=len(runs),
                               runners_up=runners_up_of(best.best, list(others.values()), limit, runners_up),
                               candidates=sum(plan.candidates for plan in plans),
                               priced=sum(plan.priced for plan in plans),
                               simulated=sum(plan.simulated for plan in plans))
