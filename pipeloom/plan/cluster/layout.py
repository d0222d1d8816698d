"""One layout of a training job on a cluster: the parallel dimensions (dp x tp x pp x cp, ep inside dp x cp),
virtual stages, micro-batch size, FSDP or the distributed optimizer, recomputation and the pipeline schedule."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pipeloom.plan.cluster.counts import RECOMPUTE_MODES
from pipeloom.plan.errors import LayoutError

if TYPE_CHECKING:
    from pipeloom.plan.cluster.job import Job

__all__ = ["Layout", "SCHEDULES", "PAIRED", "LAYOUT_KEYS", "parse_layout"]

SCHEDULES: dict[str, str] = {
    "1f1b": "linear",
    "interleaved-1f1b": "interleaved",
    "zb-h1": "linear",
    "zbv": "v",
    "dualpipev": "v",
    "dualpipe": "two-copy",
}
"""The schedules the cluster planner prices, with their stage placement (linear: vp 1, interleaved: vp >= 2
looped stages per rank, v: 2 stages per rank in a V, two-copy: vp 1, the model cut into pp stages held twice,
rank r holding stage r of one copy and stage pp-1-r of the other)."""
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
    """Stages per pipeline rank (interleaved: >= 2; zbv and dualpipev: 2; others 1, dualpipe's two copies apart)."""
    cp: int = 1
    """Context-parallel ranks (each holds 1/cp of every sequence)."""
    ep: int = 1
    """Expert-parallel ranks, a divisor of dp x cp (1 for dense models)."""
    mbs: int = 1
    """Sequences per micro-batch."""
    fsdp: bool = False
    """Weights and gradients sharded over dp x cp too (ZeRO-3); without it the distributed optimizer shards
    only the optimizer state."""
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
        if placement == "v" and self.vp != 2:
            raise LayoutError(f"{self.schedule} places 2 stages per rank in a V: use vp=2, got vp={self.vp}")
        if placement == "interleaved" and self.vp < 2:
            raise LayoutError(f"interleaved-1f1b needs vp >= 2 stages per rank, got vp={self.vp}; use 1f1b for vp=1")
        if placement == "two-copy" and self.vp != 1:
            raise LayoutError(f"dualpipe cuts the model into pp stages and holds it twice: use vp=1 (dualpipev for "
                              f"2 stages per rank in a V), got vp={self.vp}")
        if placement == "linear" and self.vp != 1:
            raise LayoutError(f"{self.schedule} runs one stage per rank: use vp=1 (or schedule=interleaved-1f1b for "
                              f"vp >= 2 stages per rank), got vp={self.vp}")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp x cp = {self.dp * self.cp} (experts are sharded over "
                              "the data- and context-parallel ranks)")

    @property
    def gpus(self) -> int:
        """GPUs the layout occupies: dp x tp x pp x cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def stages(self) -> int:
        """Pipeline stages the model is cut into (pp x vp)."""
        return self.pp * self.vp

    @property
    def copies(self) -> int:
        """Copies of the model the pipeline holds (DualPipe: 2)."""
        return 2 if SCHEDULES[self.schedule] == "two-copy" else 1

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per pipeline per step; LayoutError when the global batch does not split evenly."""
        if global_batch % (self.dp * self.mbs):
            raise LayoutError(f"global batch {global_batch} does not split into dp={self.dp} x mbs={self.mbs} "
                              "micro-batches; pick a dp x mbs that divides it")
        return global_batch // (self.dp * self.mbs)

    def check(self, job: Job) -> int:
        """LayoutError when this layout cannot run ``job``; else its micro-batches per pipeline."""
        spec = job.spec
        if self.gpus != job.gpus:
            raise LayoutError(f"dp x tp x pp x cp = {self.gpus} is not the job's {job.gpus} GPUs")
        m = self.microbatches(job.global_batch)
        a = spec.attention
        if a.heads % self.tp or a.kv_heads % self.tp:  # Megatron-Core divides both by tp (torchtitan too)
            fits = [t for t in range(1, self.tp) if a.heads % t == 0 and a.kv_heads % t == 0]
            raise LayoutError(f"tp={self.tp} does not split {a.heads} query / {a.kv_heads} key-value heads evenly "
                              f"(each tp rank holds whole heads); use tp={max(fits)}, the largest below {self.tp} "
                              "that divides both")
        if job.seq % (2 * self.cp) and self.cp > 1:
            raise LayoutError(f"sequence {job.seq} does not split into 2 x cp={self.cp} load-balanced chunks")
        if self.stages > spec.layers:
            raise LayoutError(f"pp={self.pp} x vp={self.vp} = {self.stages} stages for {spec.layers} layers: at most "
                              f"one stage per layer; lower pp or vp so that pp x vp <= {spec.layers}")
        if spec.experts is None and self.ep > 1:
            raise LayoutError(f"ep={self.ep} on a dense model: use ep=1")
        if spec.experts is not None and spec.experts.count % self.ep:
            raise LayoutError(f"ep={self.ep} does not divide {spec.experts.count} experts")
        if self.pp > 1 and m < self.pp:
            raise LayoutError(f"{m} micro-batches for pp={self.pp}: need at least pp (lower dp or mbs)")
        if self.schedule in PAIRED and m < 2 * self.pp:
            raise LayoutError(f"{self.schedule} needs at least 2 x pp = {2 * self.pp} micro-batches, got {m}")
        if self.copies == 2 and (self.pp % 2 or m % 2):
            raise LayoutError(f"dualpipe needs an even pp (its halves mirror) and an even number of micro-batches "
                              f"(half enter at each end), got pp={self.pp} and {m}")
        if self.schedule == "interleaved-1f1b" and m % self.pp:
            raise LayoutError(f"interleaved-1f1b needs micro-batches ({m}) divisible by pp={self.pp}")
        if self.pp == 1 and self.schedule != "1f1b":
            raise LayoutError("pp=1 has no pipeline: use schedule=1f1b")
        return m

    def as_dict(self) -> dict[str, Any]:
        """The layout as JSON-ready values (fsdp as 0/1)."""
        data = asdict(self)
        data["fsdp"] = int(self.fsdp)
        return {key: data[key] for key in LAYOUT_KEYS}

    def __str__(self) -> str:
        return ",".join(f"{key}={value}" for key, value in self.as_dict().items())


def parse_layout(text: str) -> dict[str, Any]:
    """The keys of ``tp=4,pp=8,...,recompute=selective,schedule=zbv`` (some or all of :data:`LAYOUT_KEYS`)."""
    fixed: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in LAYOUT_KEYS:
            raise LayoutError(f"bad layout item {item!r}: expected key=value with key one of {', '.join(LAYOUT_KEYS)}")
        if key in fixed:
            raise LayoutError(f"layout key {key!r} given twice")
        value = value.strip()
        if key in ("recompute", "schedule"):
            fixed[key] = value.lower()  # 1F1B, None: the names are lower-case
            choices = RECOMPUTE_MODES if key == "recompute" else tuple(SCHEDULES)
            if fixed[key] not in choices:
                raise LayoutError(f"layout {key}={value} is not one of {', '.join(choices)}")
            continue
        try:
            number = int(value)
        except ValueError:
            raise LayoutError(f"layout {key} must be an integer, got {value!r}") from None
        if number < (0 if key == "fsdp" else 1) or (key == "fsdp" and number > 1):
            raise LayoutError(f"layout {key}={value} is out of range ({'0 or 1' if key == 'fsdp' else '>= 1'})")
        fixed[key] = bool(number) if key == "fsdp" else number
    return fixed
