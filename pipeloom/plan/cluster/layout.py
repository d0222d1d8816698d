"""One layout of a training job on a cluster: the parallel dimensions (dp x tp x pp x cp, ep inside tp x dp x cp),
virtual stages, micro-batch size, FSDP or the distributed optimizer, recomputation and the pipeline schedule; and
every layout a job can run, with the keys the user fixed held (:func:`enumerate_layouts`, for the search)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pipeloom.arithmetic import divisors
from pipeloom.plan.cluster.counts import RECOMPUTE_MODES
from pipeloom.plan.cluster.step import optimizer_bytes
from pipeloom.plan.errors import LayoutError

if TYPE_CHECKING:
    from pipeloom.plan.cluster.job import Job
    from pipeloom.plan.cluster.model.spec import ModelSpec

__all__ = ["Layout", "Refusals", "SCHEDULES", "ON_REQUEST", "FRAMEWORK_SCHEDULES", "PAIRED", "LAYOUT_KEYS",
           "MBS_CHOICES", "VP_CHOICES", "enumerate_layouts", "ep_problem", "max_stages"]

SCHEDULES: dict[str, str] = {
    "1f1b": "linear",
    "interleaved-1f1b": "interleaved",
    "zb-h1": "linear",
    "zbv": "v",
    "v-half": "v",
    "v-min": "v",
    "dualpipev": "v",
    "dualpipe": "two-copy",
}
"""The schedules the cluster planner prices, with their stage placement (linear: vp 1, interleaved: vp >= 2
looped stages per rank, v: 2 stages per rank in a V, two-copy: vp 1, the model cut into pp stages held twice,
rank r holding stage r of one copy and stage pp-1-r of the other)."""
ON_REQUEST = ("v-half", "v-min")
"""Searched only where named (``--schedules``, ``--layout schedule=``): slow builds (docs/cluster-plan.md, V-Half)."""
FRAMEWORK_SCHEDULES = {"megatron-bridge": ("1f1b", "interleaved-1f1b"),
                       "torchtitan": tuple(name for name, place in SCHEDULES.items() if place != "two-copy")}
"""The schedules a framework runs (``--framework``): Megatron-Core's ``get_forward_backward_func`` picks 1F1B or
interleaved 1F1B (``pipeline_parallel/schedules.py``: with and without interleaving, at d98e8a6); torchtitan runs
any order of one copy of the model as pipeloom's export writes it (a schedule CSV for torch's
``_PipelineScheduleRuntime``), not DualPipe's two."""
PAIRED = ("dualpipev", "dualpipe")
"""Schedules that overlap one micro-batch's forward with another's backward (DualPipe's F&B pairs)."""
LAYOUT_KEYS = ("dp", "tp", "pp", "vp", "cp", "ep", "mbs", "fsdp", "recompute", "schedule")
"""The keys of a layout, in the order ``--layout`` and the JSON print them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """How one training step is laid out over the GPUs."""

    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel ranks (with sequence parallelism when > 1)."""
    pp: int = 1
    """Pipeline ranks."""
    vp: int = 1
    """Stages per pipeline rank (interleaved: >= 2; the V placement's: 2; others 1, dualpipe's two copies apart)."""
    cp: int = 1
    """Context-parallel ranks (each holds 1/cp of every sequence)."""
    ep: int = 1
    """Expert-parallel ranks, a divisor of tp x dp x cp (1 for dense models). The routed experts run whole on
    each rank (no tensor parallelism inside an expert): the ranks of a pipeline stage form Megatron-Core's
    expert mesh (its "MoE parallel folding" with expert tp 1; torchtitan's ``expert_tensor_parallel_degree=1``),
    ep consecutive ranks sharing out the experts, the tp x dp x cp / ep groups of them holding the same experts
    (:attr:`expert_replicas`)."""
    mbs: int = 1
    """Sequences per micro-batch."""
    fsdp: bool = False
    """FSDP: the weights and gradients sharded over dp x cp too, on one pipeline stage between micro-batches (ZeRO-3:
    :attr:`reshards`), under a pipeline at rest between steps; without it the distributed optimizer shards only the
    optimizer state."""
    recompute: str = "none"
    """Activation recomputation: none, selective (the attention core) or full (each layer from its input)."""
    schedule: str = "1f1b"
    """Pipeline schedule (:data:`SCHEDULES`)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "vp", "cp", "ep", "mbs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"layout {name} must be a positive integer, got {value!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise LayoutError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
        placement = SCHEDULES.get(self.schedule)
        if placement is None:
            raise LayoutError(f"schedule {self.schedule!r} is not priced by the cluster planner; choose one of "
                              f"{', '.join(SCHEDULES)}")
        if self.pp == 1 and self.schedule != "1f1b":  # before vp's checks, whose fixes would lead here
            raise LayoutError(f"pp=1 has no pipeline to run {self.schedule}: use schedule=1f1b with vp=1, or pp >= 2")
        if placement == "v" and self.vp != 2:
            raise LayoutError(f"{self.schedule} places 2 stages per rank in a V: use vp=2, got vp={self.vp}")
        if placement == "interleaved" and self.vp < 2:
            raise LayoutError(f"interleaved-1f1b needs vp >= 2 stages per rank, got vp={self.vp}; use 1f1b for vp=1")
        if placement == "two-copy" and self.vp != 1:
            raise LayoutError(f"dualpipe cuts the model into pp stages and holds it twice: use vp=1 (dualpipev for "
                              f"2 stages per rank in a V), got vp={self.vp}")
        if placement == "linear" and self.vp != 1:
            loop = "schedule=interleaved-1f1b" if self.pp > 1 else "pp >= 2 with schedule=interleaved-1f1b"
            raise LayoutError(f"{self.schedule} runs one stage per rank: use vp=1 (or {loop} for vp >= 2 stages per "
                              f"rank), got vp={self.vp}")
        if (self.tp * self.dp * self.cp) % self.ep:
            raise LayoutError(f"ep={self.ep} must divide tp x dp x cp = {self.tp * self.dp * self.cp} (experts are "
                              "shared out over a stage's tensor-, data- and context-parallel ranks)")

    @property
    def gpus(self) -> int:
        """GPUs the layout occupies: dp x tp x pp x cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks of a pipeline stage holding the same experts (Megatron-Core's expert data parallelism): tp x dp x
        cp / ep, over which the experts' gradients are reduced and their optimizer state sharded."""
        return self.tp * self.dp * self.cp // self.ep

    @property
    def reshards(self) -> bool:
        """Whether FSDP holds the weights and gradients sharded while the step runs (ZeRO-3: each layer gathered for
        every micro-batch's forward and backward, its gradient reduce-scattered): on one pipeline stage. Under a
        pipeline FSDP runs as torch.distributed.pipelining runs it (torchtitan, and pipeloom's runtime:
        :mod:`pipeloom.runtime.parallel.fsdp`): a stage's parameters are gathered at its first forward and kept whole
        with their gradients until the step ends, then reduce-scattered once, so it holds and moves what the
        distributed optimizer does (Megatron's FSDP and DeepSpeed's ZeRO-3 do not run under a pipeline)."""
        return self.fsdp and self.pp == 1

    @property
    def stages(self) -> int:
        """Pipeline stages the model is cut into (pp x vp)."""
        return self.pp * self.vp

    @property
    def copies(self) -> int:
        """Copies of the model the pipeline holds (DualPipe: 2)."""
        return 2 if SCHEDULES[self.schedule] == "two-copy" else 1

    @property
    def state_groups(self) -> tuple[int, int]:
        """The ranks holding the same dense parameters, and the same experts, as a rank: dp x cp and the expert
        replicas (:attr:`expert_replicas`), under DualPipe both copies' (each parameter has its twin on the mirror
        rank). Gradients are reduced, and the optimizer state sharded, over them."""
        return self.dp * self.cp * self.copies, self.expert_replicas * self.copies

    def param_state(self, dense: float, expert: float, grad_bytes: float, shard_gradients: bool, moment_bytes: float,
                    *, reshards: bool, shard_optimizer: bool) -> tuple[float, float, float]:
        """``(weights, gradients, optimizer)`` bytes per GPU of the ``dense`` and ``expert`` parameters a rank holds
        (:func:`optimizer_bytes`, whole gradients of ``grad_bytes`` each, Adam's moments of ``moment_bytes``), sharded
        over :attr:`state_groups`; with ``shard_gradients`` (ZeRO-2: :meth:`Job.zero2`) the gradients too; with
        ``reshards`` (:meth:`Job.reshards`) the weights and gradients too; without ``shard_optimizer``
        (:attr:`Job.distributed_optimizer`) the optimizer state whole."""
        parts = []
        for params, group in zip((dense, expert), self.state_groups):
            weights, gradients, states = optimizer_bytes(params, shards=group if shard_optimizer else 1, fsdp=reshards,
                                                         grad_bytes=grad_bytes, moment_bytes=moment_bytes)
            parts.append((weights, gradients / group if shard_gradients else gradients, states))
        return tuple(a + b for a, b in zip(*parts))  # weights, gradients, optimizer

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per pipeline per step; LayoutError when the global batch does not split evenly."""
        if global_batch % (self.dp * self.mbs):
            raise LayoutError(f"global batch {global_batch} does not split into dp={self.dp} x mbs={self.mbs} "
                              "micro-batches; pick a dp x mbs that divides it",
                              counts=f"a global batch that is a multiple of dp x mbs = {self.dp * self.mbs}")
        return global_batch // (self.dp * self.mbs)

    def check(self, job: Job) -> int:
        """LayoutError when this layout cannot run ``job``; else its micro-batches per pipeline."""
        if self.gpus != job.gpus:
            raise LayoutError(f"dp x tp x pp x cp = {self.gpus} is not the job's {job.gpus} GPUs: give a layout of "
                              f"{job.gpus}, or --gpus {self.gpus} (gpus={self.gpus})", counts=f"{self.gpus} GPUs")
        m = self.microbatches(job.global_batch)
        if refused := self.shape_problem(job):
            raise LayoutError(refused)
        if self.pp > 1 and m < self.pp:
            fix = "lower dp or mbs" if self.dp * self.mbs > 1 else "a larger global batch or a lower pp"
            raise LayoutError(f"{m} micro-batch{'es' if m != 1 else ''} for pp={self.pp}: need at least pp ({fix})",
                              counts=self._batch_of(self.pp))
        if self.schedule in PAIRED and m < 2 * self.pp:
            raise LayoutError(f"{self.schedule} needs at least 2 x pp = {2 * self.pp} micro-batches, got {m}",
                              counts=self._batch_of(2 * self.pp))
        if self.copies == 2 and self.pp % 2:
            raise LayoutError(f"dualpipe needs an even pp (its halves mirror), got pp={self.pp}")
        if self.copies == 2 and m % 2:
            raise LayoutError(f"dualpipe needs an even number of micro-batches (half enter at each end), got {m}",
                              counts=self._batch_of(2, multiple=True))
        if self.schedule == "interleaved-1f1b" and m % self.pp:
            raise LayoutError(f"interleaved-1f1b needs micro-batches ({m}) divisible by pp={self.pp}",
                              counts=self._batch_of(self.pp, multiple=True))
        return m

    def shape_problem(self, job: Job, *, cut: bool = True) -> str | None:
        """Why the model or the sequence cannot take this layout's tp, cp, stages or ep, whatever the GPU count and
        the global batch (None where they can); ``cut``: check the stage count against an explicit stage cut."""
        spec, a, g = job.spec, job.spec.attention, job.spec.linear
        if not a.splits(self.tp):
            fits = [t for t in range(1, self.tp) if a.splits(t)]
            return (f"tp={self.tp} does not split {a.heads} query / {a.kv_heads} key-value heads evenly (each tp rank "
                    f"holds whole heads); use tp={max(fits)}, the largest below {self.tp} that divides both")
        if job.seq % (2 * self.cp) and self.cp > 1:  # the fix: the largest cp below whose 2 x cp divides it, or 1
            below = max(c for c in range(1, self.cp) if job.seq % (2 * c) == 0 or c == 1)
            return f"sequence {job.seq} does not split into 2 x cp={self.cp} load-balanced chunks; use cp={below}"
        if g is not None and not g.splits(self.tp * self.cp):
            return (f"tp={self.tp} x cp={self.cp} does not split Gated DeltaNet's {g.key_heads} key heads evenly "
                    f"(Megatron-Core gives each tp x cp rank whole heads: its context parallelism runs the whole "
                    f"sequence of a share of the heads); use a tp x cp that divides {g.key_heads}")
        if self.stages > max_stages(spec):
            lower = {"interleaved": "pp or vp", "v": f"pp ({self.schedule} places 2 stages a rank)"}.get(
                SCHEDULES[self.schedule], "pp")
            return (f"pp={self.pp} x vp={self.vp} = {self.stages} stages for {spec.layers} layers: at most one stage "
                    f"per layer, and one each for the embedding and the head; lower {lower} so that pp x vp <= "
                    f"{max_stages(spec)}")
        stages = job.cut()
        if cut and stages is not None and len(stages) != self.stages:
            return (f"pp={self.pp} x vp={self.vp} = {self.stages} stages, but the stage cut {job.stage_cut!r} has "
                    f"{len(stages)}: use pp and vp whose product is {len(stages)}")
        if self.ep > 1 and self.tp > 1 and not job.sequence_parallel:
            return (f"ep={self.ep} with tp={self.tp} needs sequence parallelism (Megatron-Core requires it for expert "
                    "and tensor parallelism together); drop --no-sequence-parallel, or use tp=1 or ep=1")
        return ep_problem(spec, self.ep)

    def _batch_of(self, microbatches: int, *, multiple: bool = False) -> str:
        """The global batches that give this layout at least (``multiple``: a multiple of) ``microbatches``."""
        batch = microbatches * self.dp * self.mbs
        return f"a global batch that is a multiple of {batch}" if multiple else f"a global batch of at least {batch}"

    def as_dict(self) -> dict[str, Any]:
        """The layout as JSON-ready values (fsdp as 0/1)."""
        data = asdict(self)
        data["fsdp"] = int(self.fsdp)
        return {key: data[key] for key in LAYOUT_KEYS}

    def __str__(self) -> str:
        return ",".join(f"{key}={value}" for key, value in self.as_dict().items())


MBS_CHOICES = (1, 2, 4, 8, 16, 32, 64)
"""Micro-batch sizes tried (sequences)."""


def max_stages(spec: ModelSpec) -> int:
    """The most pipeline stages a model cuts into: one per decoder layer, and one each for the embedding and the
    head alone (Llama 3 405B's 126 layers in 16 x 8 = 128 stages, the first and last without a decoder layer: Meta's
    "one Transformer layer short" ends; Megatron-LM's ``--account-for-embedding-in-pipeline-split`` and
    ``--account-for-loss-in-pipeline-split``)."""
    return spec.layers + 2


VP_CHOICES = (2, 3, 4, 5, 6, 7, 8)
"""Stages per rank tried for interleaved-1f1b."""


def _choices(key: str, fixed: dict[str, Any], default: list[Any]) -> list[Any]:
    return [fixed[key]] if key in fixed else default


class Refusals(list):
    """The first reason a layout was refused (at most one item): a strong one (no value of the free keys avoids it)
    in the place of a weak one; ``counts``: the GPU count or global batch that avoids it (``LayoutError.counts``)."""

    weak = False
    counts: str | None = None


def enumerate_layouts(job: Job, fixed: dict[str, Any], refusals: Refusals | None = None) -> Iterator[Layout]:
    """Every layout of ``job`` that passes :meth:`Layout.check`, with the keys of ``fixed`` as given (the ranges of
    each key: docs/cluster-plan.md, "The search"; FSDP on one pipeline stage: :attr:`Layout.reshards`); the first
    layout refused, with why, appended to ``refusals`` (for the error when none can run)."""
    spec = job.spec
    unknown = set(fixed) - set(LAYOUT_KEYS)
    if unknown:
        raise LayoutError(f"unknown layout keys {sorted(unknown)}; use {', '.join(LAYOUT_KEYS)}")
    refused, counts = _fixed_problem(job, fixed)
    if refused:  # the model's shape, the sequence or the batch: no GPU count or free key helps
        _refuse(refusals, refused, counts=counts)
        return
    n, hw = job.gpus, job.hw
    sized, size, sized_gpus = _sized(fixed)
    if n % size:  # no free tp x cp x pp leaves dp: name the fixed keys' product
        given = " x ".join(f"{key}={fixed[key]}" for key in sized) + (f" = {size}" if len(sized) > 1 else "")
        _refuse(refusals, f"{given} does not divide the {n} GPUs", counts=sized_gpus)
        return
    linear = spec.linear
    others = not {"tp", "cp"} <= set(fixed)  # other tp x cp are tried: a reason they avoid is weak
    tps = [t for t in divisors(n) if t <= hw.domain_gpus and spec.attention.splits(t)
           and (linear is None or linear.splits(t))]
    for tp in _choices("tp", fixed, tps):
        if n % tp:
            _refuse(refusals, f"tp={tp} does not divide the {n} GPUs", counts=_gpus(tp))
            continue
        cps = [c for c in divisors(n // tp) if c <= 16 and (c == 1 or job.seq % (2 * c) == 0)
               and (linear is None or linear.splits(tp * c))]
        for cp in _choices("cp", fixed, cps):
            if n % (tp * cp):
                _refuse(refusals, f"tp={tp} x cp={cp} does not divide the {n} GPUs", counts=_gpus(tp * cp))
                continue
            pps = [p for p in divisors(n // (tp * cp)) if p <= max_stages(spec)]
            for pp in _choices("pp", fixed, pps):
                if n % (tp * cp * pp):
                    _refuse(refusals, f"tp={tp} x cp={cp} x pp={pp} does not divide the {n} GPUs", weak=others,
                            counts=_gpus(tp * cp * pp))
                    continue
                dp = n // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp:
                    _refuse(refusals, f"tp={tp} x cp={cp} x pp={pp} leaves dp={dp} on {n} GPUs, not dp={fixed['dp']}",
                            weak=others or "pp" not in fixed, counts=sized_gpus)
                    continue
                yield from _inner(job, fixed, tp, cp, pp, dp, refusals)


def _fixed_problem(job: Job, fixed: dict[str, Any]) -> tuple[str | None, str | None]:
    """Why the fixed keys cannot run ``job`` whatever the GPUs and free keys (a dp x mbs the batch refuses, a tp, cp,
    pp or ep the model or sequence refuses: :meth:`Layout.shape_problem`), and the counts that avoid it, or None."""
    schedule = fixed.get("schedule", "interleaved-1f1b" if fixed.get("vp", 1) > 1 else "1f1b")
    vp = fixed.get("vp", {"v": 2, "interleaved": 2}.get(SCHEDULES.get(schedule, ""), 1))
    try:  # dp = ep: any ep divides tp x dp x cp; a pipeline schedule's fewest stages, pp 2
        probe = Layout(tp=fixed.get("tp", 1), cp=fixed.get("cp", 1), pp=fixed.get("pp", 1 if schedule == "1f1b" else 2),
                       vp=vp, ep=fixed.get("ep", 1), dp=fixed.get("ep", 1), schedule=schedule)
        refused = probe.shape_problem(job, cut="pp" in fixed and "vp" in fixed)
    except LayoutError as error:  # with a fixed schedule the probe's own choices agree with it: the fixed keys clash
        return (str(error), None) if "schedule" in fixed else (None, None)
    if refused or fixed.get("mbs", 1) > job.global_batch:
        return refused or f"mbs={fixed['mbs']} is more sequences than the global batch {job.global_batch}", (
            None if refused else f"a global batch of at least {fixed['mbs']}")
    split = fixed.get("dp", 1) * fixed.get("mbs", 1)
    if job.global_batch % split:  # with a fixed dp that the GPUs refuse too, both counts
        given = " x ".join(f"{key}={fixed[key]}" for key in ("dp", "mbs") if key in fixed)
        sized, size, needs = _sized(fixed)
        gpus = "" if (job.gpus == size if len(sized) == 4 else job.gpus % size == 0) else f" and {needs}"
        return f"{given} does not divide the global batch {job.global_batch}{' nor the GPUs' * bool(gpus)}", (
            f"a global batch that is a multiple of {split}{gpus}")
    return None, None


def _sized(fixed: dict[str, Any]) -> tuple[list[str], int, str]:
    """With dp fixed: the fixed keys of dp, tp, cp, pp, their product and the GPUs they need (all four: exactly it)."""
    sized: list[str] = [key for key in ("dp", "tp", "cp", "pp") if key in fixed] if "dp" in fixed else []
    size = int(math.prod(fixed[key] for key in sized))
    return sized, size, f"{size} GPU{'s' * (size != 1)}" if len(sized) == 4 else _gpus(size)


def _refuse(refusals: Refusals | None, reason: str, *, weak: bool = False, counts: str | None = None) -> None:
    """Keep the first refusal (a strong one over a weak one) with the job's counts that avoid it (None: none do)."""
    if refusals is not None and (not refusals or (refusals.weak and not weak)):
        refusals[:] = [reason]
        refusals.weak, refusals.counts = weak, counts


def ep_problem(spec: ModelSpec, ep: int) -> str | None:
    """Why ``spec``'s experts cannot be shared out over ``ep`` ranks (None where they can): a dense model, or an ep
    that does not divide the experts (with the eps that do)."""
    if spec.experts is None:
        return f"ep={ep} on a dense model: use ep=1" if ep > 1 else None
    count = spec.experts.count
    return None if count % ep == 0 else (f"ep={ep} does not divide the {count} experts: use ep in "
                                         f"{', '.join(map(str, divisors(count)))}")


def _gpus(multiple: int) -> str:
    return f"a GPU count that is a multiple of {multiple}"


def _inner(job: Job, fixed: dict[str, Any], tp: int, cp: int, pp: int, dp: int,
           refusals: Refusals | None) -> Iterator[Layout]:
    """Layouts of one dp x tp x pp x cp."""
    spec = job.spec
    experts = spec.experts.count if spec.experts else 1
    eps = [e for e in divisors(tp * dp * cp) if experts % e == 0] if spec.experts else [1]
    schedules = list(job.schedules or (name for name in SCHEDULES if name not in ON_REQUEST)) if pp > 1 else ["1f1b"]
    for ep, mbs, recompute, fsdp, schedule in itertools.product(
            _choices("ep", fixed, eps), _choices("mbs", fixed, list(MBS_CHOICES)),
            _choices("recompute", fixed, list(RECOMPUTE_MODES)), _choices("fsdp", fixed, [False, True]),
            _choices("schedule", fixed, schedules)):
        if job.global_batch % (dp * mbs):  # weak where a smaller mbs, or another dp, is tried
            _refuse(refusals, f"dp={dp} x mbs={mbs} does not divide the global batch {job.global_batch}",
                    weak="mbs" not in fixed or not {"tp", "cp", "pp"} <= set(fixed),
                    counts=f"a global batch that is a multiple of dp x mbs = {dp * mbs}")
            continue
        if fsdp and "fsdp" not in fixed and (dp * cp == 1 or pp > 1 and job.distributed_optimizer):
            continue  # nothing to shard over, or priced as without it (Layout.reshards) where Adam's state is sharded
        placement = SCHEDULES.get(schedule)
        vps = {"interleaved": [v for v in VP_CHOICES if pp * v <= max_stages(spec)], "v": [2]}.get(placement or "",
                                                                                                   [1])
        if not vps and "vp" not in fixed:
            _refuse(refusals, f"pp={pp} x vp={min(VP_CHOICES)} stages of {schedule} are more than the {spec.layers} "
                              "layers and the embedding and head stages", weak="pp" not in fixed)
        for vp in _choices("vp", fixed, vps):
            try:
                layout = Layout(dp=dp, tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, mbs=mbs, fsdp=bool(fsdp),
                                recompute=recompute, schedule=schedule)
                layout.check(job)
            except LayoutError as error:
                _refuse(refusals, f"dp={dp},tp={tp},pp={pp},vp={vp},cp={cp},ep={ep},mbs={mbs},schedule={schedule}: "
                                  f"{error}", counts=error.counts)
                continue
            yield layout
