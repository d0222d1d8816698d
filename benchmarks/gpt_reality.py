"""The measuring half of the prediction-vs-reality checks (``plan_gpt.py``, ``plan_models.py``) on two gloo
ranks on this CPU, for any :class:`Workload` (a model, its batches, its loss, how the runtime cuts it).

One spawned pair of processes (``torch.set_num_threads(1)`` in each: one core per rank) does, in order:

1. **Link**: a gloo ping-pong between the two ranks at two message sizes, fitted as
   ``latency + bytes / bandwidth`` (the bandwidth is used; the latency under load comes from step 2).
   **Engine cost per action**: a pipeline of two 4x4 linear layers profiled inside the engine
   (``profile_in_engine``): its traced actions hold next to no compute, so their median time is the
   runtime's own work per action of a pipeline that sends at every action (printed for reference).
2. **Profile** (``profiler="engine"``, the default): ``profile_in_engine`` on the workload's model at every
   micro-batch size the plan search may pick: piece times traced inside the runtime on both ranks, the latency
   under load and the per-step cost fitted from the same steps (their medians over the sizes go into every
   table); from its two-replica pipeline, the cost per action (runs of pieces timed whole against their
   pieces), the replica-exchange latency, and from all, the time spread. ``profiler="alone"``: both ranks run
   ``profile_model`` at once, and the per-action and per-step costs come from a 1F1B run of the 4x4 pipeline
   at two micro-batch counts.
3. **Plan**: rank 0 runs ``plan_pipeline`` for 2 ranks and saves the best plan of each schedule; with
   ``uniform``, also the chosen plan with the workload's layers cut evenly (same schedule and micro-batches).
4. **Rounds**: for each plan in turn (forwards in even rounds, backwards in odd ones), warm-up steps,
   then ``cycles`` times one profiling step of the plan's micro-batch size (``EngineProfiler``) followed by
   a share of the plan's timed steps (a barrier, then rank 0's wall clock of ``engine.step``); the
   prediction (same split and order, ``recost`` + ``simulate``) comes from those profiling steps. Profile
   and run interleave within a second, so the drifting speed of a shared virtual machine hits both alike.
   A measurement during which other processes used more than ``max_foreign`` cores is taken again.
5. **Traces**: every plan's engine traces in memory (``trace=True``); the timed steps' traces are
   written per plan for ``pipeloom.viz.measured`` (task times and span of the very steps timed).
   The uniform split, where it differs from the chosen one, runs next to the chosen plan in each round.

Rank 0 writes everything to ``results.json`` in the output folder; ``plan_gpt.py`` prints it.
A workload's callables cross to the spawned ranks by pickling: module-level functions or
``functools.partial`` of them (:func:`gpt_workload` is the example GPT's).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Self, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pipeloom
from pipeloom import Schedule, build_schedule, load_schedule, save_schedule
from pipeloom.errors import PipeloomError
from pipeloom.plan import CostTable, Link, Partition, Plan, load_plan, plan_pipeline, recost, save_costs, save_plan
from pipeloom.plan.costs.file import costs_from_json, costs_to_json
from pipeloom.plan.costs.table import table_for_size
from pipeloom.plan.noise import expected_makespan
from pipeloom.plan.race import TrialBudget, run_key
from pipeloom.plan.recost import replica_sync_time, stage_spreads
from pipeloom.profile.engine import EngineProfiler
from pipeloom.profile.in_engine import profile_in_engine
from pipeloom.profile.model import profile_model
from pipeloom.runtime import Tracing
from pipeloom.sim import simulate

__all__ = ["RealityConfig", "Workload", "example", "gpt_workload", "run_reality", "uniform_split",
           "wait_until_quiet"]

T = TypeVar("T")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SEQ_LEN = 32  # the example's sequence length (GPTConfig.seq_len)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A model to profile, plan and run, and how. The callables reach the spawned ranks pickled:
    module-level functions or ``functools.partial`` of them."""

    name: str
    """What the printed tables call it."""
    build: Callable[[], nn.Module]
    """A fresh model, the same weights on every rank and every call."""
    batch: Callable[[int, int], tuple[object, object]]
    """``batch(step, rows)``: ``(inputs, target)`` of ``rows`` samples, the same for a given step."""
    loss: Callable[[object, object], torch.Tensor]
    """``loss(output, target)`` of one micro-batch."""
    layers: tuple[str, ...]
    """Module names whose numbered children are the layers the uniform split cuts evenly
    (``("blocks",)``: ``blocks.0``, ``blocks.1``...); a name without children there counts as one layer."""
    sample_bytes: int
    """Bytes of one sample's activations between layers: sizes the link measurement's messages."""
    tracer: str = "auto"
    """How the runtime traces the model (``pipeline(tracer=...)``); torch.export gets one micro-batch as
    its example inputs."""
    leaf_modules: tuple[str, ...] = ()
    """Module names the tracer keeps whole (``pipeline(leaf_modules=...)``)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"workload {self.name!r}: name the modules holding its layers (layers=('blocks',))")
        if self.sample_bytes < 1:
            raise ValueError(f"workload {self.name!r}: sample_bytes must be >= 1, got {self.sample_bytes}")

    @property
    def tracing(self) -> dict:
        """The tracer arguments of ``pipeline``, ``profile_model`` and ``profile_in_engine``."""
        return {"tracer": self.tracer, "leaf_modules": self.leaf_modules}

    def example_inputs(self, rows: int) -> tuple:
        """One micro-batch of ``rows`` samples as the runtime's example inputs (a tuple)."""
        inputs = self.batch(0, rows)[0]
        return inputs if isinstance(inputs, tuple) else (inputs,)


def _gpt_model(layers: int) -> nn.Module:
    return example().build_model(layers=layers)


def _gpt_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return example().synthetic_batch(step, batch=rows, seq_len=SEQ_LEN, vocab=64)


def _gpt_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return example().lm_loss(output, target)


def gpt_workload(layers: int = 8) -> Workload:
    """examples/train_gpt.py's GPT: ``layers`` blocks, width 64, 4 heads, vocabulary 64, 32 tokens (torch.fx)."""
    return Workload(name=f"examples/train_gpt.py ({layers} blocks)", build=functools.partial(_gpt_model, layers),
                    batch=_gpt_batch, loss=_gpt_loss, layers=("blocks",), sample_bytes=4 * SEQ_LEN * 64)


@dataclass(frozen=True, kw_only=True, slots=True)
class RealityConfig:
    """What to profile, plan and run."""

    out: str
    """Folder for the cost tables, plans, traces and ``results.json``."""
    workload: Workload = dataclasses.field(default_factory=gpt_workload)
    """The model and how to feed and cut it (default: the example GPT, 8 blocks)."""
    uniform: bool = False
    """Also run the chosen plan with the workload's layers cut evenly (same schedule, micro-batches)."""
    global_batch: int = 16
    """Sequences per step."""
    memory_limit: float = float(1 << 30)
    """Bytes per rank for the plan search (generous: the model is tiny)."""
    schedules: tuple[str, ...] | None = None
    """Schedules the plan search tries (None: every built-in one)."""
    max_plans: int = 10
    """How many plans to run: the best one of each schedule, best first."""
    repeats: int = 20
    """Profiler repeats per piece (medians), after ``profile_warmup``."""
    profile_warmup: int = 3
    """Profiler warm-up runs per piece (``alone``) or warm-up steps (``engine``)."""
    profiler: str = "engine"
    """``engine``: piece times traced inside the runtime (``profile_in_engine``); ``alone``: each piece
    timed alone (``profile_model``) on both ranks at once."""
    profile_steps: int = 4
    """Traced steps of each of the engine profiler's two runs (for the plan search)."""
    cycles: int = 5
    """Engine profiler: each round of a plan alternates this many profiling steps with its timed steps."""
    rounds: int = 3
    """Rounds over all plans (each: profile, re-predict and run every plan)."""
    warmup_steps: int = 3
    """Untimed steps of each plan at the start of each round."""
    steps: int = 10
    """Timed steps of each plan per round."""
    max_foreign: float = 0.2
    """Cores other processes may use during a measurement (a profiled size, a plan's round) before it is
    measured again: the machine is shared."""
    retries: int = 5
    """Extra attempts of a measurement while others use more than ``max_foreign``; then the quietest is kept."""
    pause: float = 2.0
    """Seconds to wait before measuring again."""
    try_plans: int = 0
    """K > 0: choose the plan by measurement (``pipeloom.profile.trials.try_plans`` over the K best predicted
    plans, with ``try_budget``) and run it with the others, marked ``tried_choice``."""
    try_budget: TrialBudget = dataclasses.field(default_factory=TrialBudget)
    """How ``try_plans`` measures (the library's defaults unless given)."""
    judge_rounds: int = 0
    """After the rounds, this many rounds more that only time every plan (no profiling), the plans interleaved
    in an order rotated by one per round, ``judge_steps`` timed steps each after one untimed: the reference the
    ``--try`` choice is judged against (``record["judged"]``, per round), measured apart from the trials."""
    judge_steps: int = 3
    """Timed steps of each plan in each judging round."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "max_plans", "repeats", "rounds", "steps", "cycles"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def sizes(self) -> list[int]:
        """Micro-batch sizes the plan search may pick: the divisors of the global batch."""
        return [b for b in range(1, self.global_batch + 1) if self.global_batch % b == 0]


def example():
    """The example script as a module (``build_model``, ``lm_loss``, ``synthetic_batch``...)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_gpt

    return train_gpt


def _cpu_busy() -> tuple[float, float]:
    """``(busy CPU seconds of the whole machine, wall seconds)`` from /proc/stat (0, 0 where it is missing)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / ticks, time.monotonic()


def wait_until_quiet(*, idle: float = 0.85, limit: float = 120.0) -> float:
    """Wait (at most ``limit`` seconds) until the machine is idle for ``idle`` of a second; returns the
    idle share last seen, so a caller can say when it started on a busy machine."""
    started = time.monotonic()
    share = 0.0
    while time.monotonic() - started < limit:
        busy0, wall0 = _cpu_busy()
        time.sleep(1.0)
        busy1, wall1 = _cpu_busy()
        if wall1 == 0.0:
            return 1.0
        share = 1.0 - (busy1 - busy0) / ((wall1 - wall0) * (os.cpu_count() or 1))
        if share >= idle:
            break
    return share


class _Foreign:
    """CPU that processes other than the two ranks used while it was open, in cores (rank 0 reads it)."""

    def __enter__(self) -> Self:
        self.busy, self.wall = _cpu_busy()
        self.own = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, wall = _cpu_busy()
        own = torch.tensor([time.process_time() - self.own], dtype=torch.float64)
        dist.all_reduce(own)  # both ranks' CPU seconds, gloo threads included
        cores = (busy - self.busy - float(own)) / (wall - self.wall) if wall > self.wall else 0.0
        shared = torch.tensor([max(0.0, cores)], dtype=torch.float64)
        dist.broadcast(shared, src=0)  # rank 0's reading on both ranks, so they agree on retrying
        self.cores = float(shared)


def _quiet(work: Callable[[], T], config: RealityConfig) -> tuple[T, float, int]:
    """``work()`` (run on both ranks) repeated while other processes used more than ``config.max_foreign``
    cores during it, at most ``config.retries`` more times. Returns the attempt with the least foreign
    load, that load in cores, and the number of attempts."""
    best: tuple[T, float] | None = None
    attempt = 0
    for attempt in range(1, config.retries + 2):  # noqa: B007 (the count is read after the loop)
        with _Foreign() as foreign:
            result = work()
        if best is None or foreign.cores < best[1]:
            best = (result, foreign.cores)
        if foreign.cores <= config.max_foreign:
            break
        time.sleep(config.pause)
    assert best is not None
    return best[0], best[1], attempt


# --------------------------------------------------------------------------------------- link


def _one_way(rank: int, nbytes: int, repeats: int) -> float:
    """Median of half a ping-pong of ``nbytes`` between ranks 0 and 1, in seconds."""
    buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    samples = []
    for k in range(repeats + 5):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        if k >= 5:
            samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples)


def _measure_link(rank: int, *, small: int, large: int, repeats: int = 200) -> tuple[Link, dict[int, float]]:
    """gloo's link, ``latency + bytes / bandwidth`` through the one-way times at ``small`` and ``large`` bytes."""
    times = {nbytes: _one_way(rank, nbytes, repeats) for nbytes in (small, large)}
    shared = [times]
    dist.broadcast_object_list(shared, src=0)  # rank 0's numbers on both ranks
    times = shared[0]
    slope = (times[large] - times[small]) / (large - small)
    if slope <= 0:
        return Link(latency=times[small]), times
    return Link(latency=max(0.0, times[small] - small * slope), bandwidth=1 / slope), times


# ---------------------------------------------------------------------------- engine overhead


def _trivial_prediction(table: CostTable, microbatches: int) -> float:
    schedule = build_schedule("1f1b", 2, microbatches)
    split = Partition(stage_of=(0, 1), split_points=("1",), stage_times=(0.0, 0.0), stage_memory=(0.0, 0.0),
                      objective=0.0, weight=0.0)
    problem = recost(schedule, table, split, memory_limit=None)
    return simulate(dataclasses.replace(schedule, problem=problem)).makespan


def _measure_overhead(rank: int, config: RealityConfig, link: Link, *, counts: tuple[int, int] = (4, 16),
                      steps: int = 40) -> tuple[float, float, dict]:
    """The engine's own cost per action: ``(inside, total, note)``.

    Engine profiler: a pipeline of two 4x4 linear layers has next to no compute, so what its traced
    actions take in the engine (``profile_in_engine``) is the runtime's work inside an action (posting
    sends and receives, bookkeeping): ``inside`` = ``total``. The latency under load and the per-step
    cost come from the real model's profiling runs (``EngineProfiler.table``).

    ``alone`` profiler: the same pipeline runs 1F1B (2 actions per micro-batch and rank) at two
    micro-batch counts; measured minus simulated (pieces timed alone, ping-pong latency) is fitted as
    ``fixed + 2 M x total``, and ``fixed`` is the note's per-step cost.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    def loss_fn(output, target):
        return ((output - target) ** 2).mean()

    if config.profiler == "engine":
        count = counts[-1]
        inputs, targets = torch.randn(count, 4), torch.randn(count, 4)
        table = profile_in_engine(model, inputs, loss_fn=loss_fn, target=targets, microbatches=count,
                                  pieces=["0", "1"], warmup_steps=3, steps=10)
        inside = statistics.median(v for p in table.pieces for v in (p.f, p.i, p.w, p.full_backward))
        return inside, inside, {"inside": inside, "overhead": inside, "fixed": table.runtime.step_overhead,
                                "latency": table.link.latency, "message": table.runtime.message_cost}
    out = Path(config.out)
    residual = {}
    for count in counts:
        inputs, targets = torch.randn(count, 4), torch.randn(count, 4)
        table = profile_model(model, inputs[:1], loss_fn=loss_fn, target=targets[:1], warmup=5, repeats=20,
                              link=link)
        path = out / f"overhead-m{count}.json"
        if rank == 0:
            save_plan(Plan(num_ranks=2, split_points=("1",), schedule="1f1b", microbatches=count, global_batch=count,
                           predicted_step_time=0.0), path)
        dist.barrier()
        engine = pipeloom.pipeline(model, plan=str(path), loss_fn=loss_fn)
        times = _steps(engine, [(inputs, targets)], 5 + steps)[5:]
        shared = [statistics.median(times)]
        dist.broadcast_object_list(shared, src=0)
        residual[count] = (shared[0], _trivial_prediction(table, count))
    (m1, (t1, p1)), (m2, (t2, p2)) = residual.items()
    overhead = max(0.0, ((t2 - p2) - (t1 - p1)) / (2 * (m2 - m1)))
    fixed = (t1 - p1) - 2 * m1 * overhead
    return 0.0, overhead, {"inside": 0.0, "overhead": overhead, "fixed": fixed,
                           "runs": {str(m): {"measured": t, "simulated": p} for m, (t, p) in residual.items()}}


# ------------------------------------------------------------------------------------ profile


def _profile_together(config: RealityConfig, link: Link, sizes: list[int], costs: EngineCosts,
                      bases: dict[int, CostTable] | None = None) -> tuple[list[CostTable], list[dict]]:
    """Profile every size; the tables and, per size, the foreign load and attempts.

    ``config.profiler == "engine"``: ``profile_in_engine`` on both ranks (pieces traced inside the
    runtime, the global batch cut into micro-batches of the size). ``"alone"``: both ranks run
    ``profile_model`` at once, each piece timed alone while the other core computes, the two ranks'
    times averaged. ``bases`` (per size) spares the engine profiler its byte count.
    """
    work = config.workload
    tables, notes = [], []
    for size in sizes:
        model = work.build()
        inputs, target = work.batch(0, config.global_batch if config.profiler == "engine" else size)

        def measure(model=model, inputs=inputs, target=target, size=size) -> CostTable:
            dist.barrier()
            if config.profiler == "engine":
                return profile_in_engine(model, inputs, loss_fn=work.loss, target=target,
                                         microbatches=config.global_batch // size, warmup_steps=config.profile_warmup,
                                         steps=config.profile_steps, bandwidth=link.bandwidth,
                                         base=(bases or {}).get(size), **work.tracing)
            table = profile_model(model, inputs, loss_fn=work.loss, target=target, warmup=config.profile_warmup,
                                  repeats=config.repeats, link=link, **work.tracing)
            both: list[str | None] = [None, None]
            dist.all_gather_object(both, costs_to_json(table))
            mean = _mean_table([costs_from_json(text) for text in both])
            return dataclasses.replace(mean, runtime=dataclasses.replace(
                mean.runtime, action_overhead=costs.overhead, step_overhead=costs.step))

        table, foreign, attempts = _quiet(measure, config)
        tables.append(table)
        notes.append({"size": size, "foreign": foreign, "attempts": attempts})
    return tables, notes


@dataclass(frozen=True, slots=True)
class EngineCosts:
    """The runtime's own costs the tables carry: per action inside a traced action (``inside``, taken
    off engine-profiled piece times), per action in all (``overhead``), per step (``step``)."""

    inside: float
    overhead: float
    step: float
    latency: float | None = None
    """Engine profiler: the link latency under load every table gets (None: each table's own fit)."""


def _with_engine_costs(table: CostTable, costs: EngineCosts) -> CostTable:
    """``table`` with the pooled latency under load and per-step cost (where pooled)."""
    if costs.latency is None:
        return table
    return dataclasses.replace(table, link=dataclasses.replace(table.link, latency=costs.latency),
                               runtime=dataclasses.replace(table.runtime, step_overhead=costs.step))


def _mean_table(tables: list[CostTable]) -> CostTable:
    """One table with each piece's f, i, w and full backward the mean over ``tables`` (one model and size)."""
    pieces = tuple(
        dataclasses.replace(group[0], **{key: statistics.fmean(getattr(p, key) for p in group) for key in "fiw"},
                            measured_full_backward=statistics.fmean(p.full_backward for p in group))
        for group in zip(*(table.pieces for table in tables))
    )
    return dataclasses.replace(tables[0], pieces=pieces, device="cpu (1 thread per rank, both ranks profiling)")


# --------------------------------------------------------------------------------------- plan


def choose_plans(tables: list[CostTable], config: RealityConfig) -> tuple[list[dict], float]:
    """Plan, and save the best plan of each schedule (best first, at most ``max_plans``) in ``out``; a plan
    running the same actions on the same ranks as one kept before (gpipe and 1f1b at one micro-batch) is that
    plan, not run twice (``pipeloom.plan.race.run_key``).

    Returns one record per plan (its file, label, prediction...) and the search's seconds. The engine
    builds a built-in name with default costs; where that order differs from the one the search
    simulated (cost-aware generators such as ZB-V), the plan names a saved copy of the simulated
    order instead (``own_order``), so the run executes what was predicted.
    """
    result = plan_pipeline(tables, num_ranks=2, global_batch=config.global_batch,
                           memory_limit=config.memory_limit, schedules=config.schedules)
    records, seen, runs = [], set(), set()
    for candidate in (c for c in result.candidates if c.fits and c.data_parallel == 1):
        if candidate.label in seen or run_key(candidate) in runs or len(records) == config.max_plans:
            continue
        seen.add(candidate.label)
        runs.add(run_key(candidate))
        path = Path(config.out) / f"plan{len(records)}-{candidate.schedule}.json"
        schedule, options = candidate.schedule, candidate.schedule_options
        own_order = not _same_order(build_schedule(schedule, 2, candidate.microbatches, **options),
                                    candidate.timeline.schedule)
        if own_order:
            schedule_file = path.with_name(f"{path.stem}.schedule.json")
            save_schedule(candidate.timeline.schedule, schedule_file)
            schedule, options = schedule_file.name, {}
        save_plan(Plan(num_ranks=2, split_points=candidate.split_points, schedule=schedule,
                       schedule_options=options, microbatches=candidate.microbatches,
                       global_batch=config.global_batch, predicted_step_time=candidate.step_time,
                       peak_memory=candidate.timeline.peak_memory, memory_limit=config.memory_limit,
                       bubble_ratio=candidate.bubble_ratio, stage_times=candidate.partition.stage_times,
                       device=tables[0].device), path)
        records.append({
            "file": str(path), "label": candidate.label, "schedule": candidate.schedule,
            "schedule_options": options if not own_order else candidate.schedule_options,
            "run_schedule": str(path.with_name(schedule)) if own_order else None,
            "microbatches": candidate.microbatches, "microbatch_size": candidate.microbatch_size,
            "split_points": list(candidate.split_points), "predicted": candidate.step_time, "own_order": own_order,
        })
    return records, result.seconds


def predict(record: dict, tables: list[CostTable], config: RealityConfig) -> float:
    """The plan search's prediction for a saved plan, re-made from ``tables``: the same split and
    action order, re-costed (``recost``) and simulated, plus the replicas' gradient exchange and the
    table's fixed ``step_overhead``."""
    schedule = _record_schedule(record)
    table = table_for_size(tables, record["microbatch_size"])
    starts = [0] + [table.names.index(name) for name in record["split_points"]] + [len(table.pieces)]
    count = len(starts) - 1
    split = Partition(stage_of=tuple(j for j in range(count) for _ in range(starts[j], starts[j + 1])),
                      split_points=tuple(record["split_points"]), stage_times=(0.0,) * count,
                      stage_memory=(0.0,) * count, objective=0.0, weight=0.0)
    problem = recost(schedule, table, split, memory_limit=config.memory_limit)
    return (expected_makespan(dataclasses.replace(schedule, problem=problem), stage_spreads(table, schedule, split),
                              start_skew=table.runtime.start_skew)
            + replica_sync_time(table, schedule, split) + table.runtime.step_overhead)


def _record_schedule(record: dict) -> Schedule:
    """The order a plan record runs: its saved schedule file, or its built-in schedule's default order."""
    if record["run_schedule"] is not None:
        return load_schedule(record["run_schedule"])
    return build_schedule(record["schedule"], 2, record["microbatches"], **record["schedule_options"])


def _same_order(a: Schedule, b: Schedule) -> bool:
    return [list(map(str, actions)) for actions in a.ranks] == [list(map(str, actions)) for actions in b.ranks]


# ---------------------------------------------------------------------------------------- run


def uniform_split(names: Sequence[str], layers: Sequence[str], stages: int) -> tuple[str, ...] | None:
    """Split points cutting the layers among ``names`` (pieces in call order; a layer is a piece named
    ``{prefix}.{k}`` or ``prefix`` for a prefix of ``layers``) evenly into ``stages`` stages: stage s starts
    at layer ``s * L // stages``, the pieces before the first layer in stage 0. None: fewer layers than
    stages."""
    found = [k for k, name in enumerate(names)
             if any(name == prefix or (name.startswith(prefix + ".") and name[len(prefix) + 1:].isdigit())
                    for prefix in layers)]
    if stages > len(found):
        return None
    return tuple(names[found[(s * len(found)) // stages]] for s in range(1, stages))


def _uniform_record(chosen: dict, tables: list[CostTable], config: RealityConfig) -> dict | None:
    """The chosen plan with the workload's layers cut evenly (:func:`uniform_split`), same schedule (the
    same order file where it has one) and micro-batches, saved as ``uniform.json``; None where the model has
    fewer layers than the plan has stages. ``same``: the cut is the chosen one's (then it is not run)."""
    stages = len(chosen["split_points"]) + 1
    split = uniform_split(tables[0].names, config.workload.layers, stages)
    if split is None:
        return None
    record = {**chosen, "file": str(Path(config.out) / "uniform.json"), "label": f"{chosen['label']} uniform",
              "split_points": list(split), "same": list(split) == chosen["split_points"]}
    record["predicted"] = predict(record, tables, config)
    planned = load_plan(chosen["file"])
    save_plan(dataclasses.replace(planned, split_points=split, predicted_step_time=record["predicted"],
                                  peak_memory=(), bubble_ratio=None, stage_times=()), record["file"])
    return record


def _engine(plan_file: str, config: RealityConfig, microbatch_size: int, trace: str | bool | None = None):
    work = config.workload
    return pipeloom.pipeline(
        work.build(),
        plan=plan_file,
        loss_fn=work.loss,
        record=trace,
        tracing=Tracing(**work.tracing, example_inputs=work.example_inputs(microbatch_size)),
    )


def _runnable(record: dict, config: RealityConfig):
    """The plan's engine, or None where the runtime refuses the plan (the reason goes into
    ``record["error"]``; the check is the same on every rank, so all of them skip it)."""
    try:
        return _engine(record["file"], config, record["microbatch_size"], trace=True)
    except PipeloomError as error:
        record["error"] = f"{type(error).__name__}: {error}"
        return None


def _steps(engine, batches: list, count: int, *, first: int = 0) -> list[float]:
    """Run ``count`` steps; rank 0's wall seconds of each ``engine.step`` (both ranks start it together)."""
    times = []
    for step in range(first, first + count):
        inputs, targets = batches[step % len(batches)]
        for param in engine.parameters():
            param.grad = None  # as after optimizer.zero_grad(set_to_none=True): each step starts from no .grad
        dist.barrier()
        start = time.perf_counter()
        engine.step(inputs, target=targets)
        times.append(time.perf_counter() - start)
    return times


def _log(rank: int, started: float, what: str) -> None:
    if rank == 0:
        print(f"[{time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)


def _profile_sizes(rank: int, begun: float, config: RealityConfig) -> tuple[Link, dict, dict, EngineCosts,
                                                                             list[CostTable], dict]:
    """Steps 1 and 2: ``(link, link document, overhead note, engine costs, tables per size, profile note)``."""
    unit = config.workload.sample_bytes
    _log(rank, begun, "measuring the link")
    link, link_times = _measure_link(rank, small=unit, large=config.global_batch * unit * 8)
    _log(rank, begun, "measuring the engine's overhead per action")
    inside, overhead, overhead_note = _measure_overhead(rank, config, link)
    _log(rank, begun, f"overhead {overhead * 1e6:.0f} us per action, fixed {overhead_note['fixed'] * 1e3:.2f} ms "
                      f"per step; profiling every micro-batch size")
    started = time.perf_counter()
    costs = EngineCosts(inside=inside, overhead=overhead, step=max(0.0, overhead_note["fixed"]))
    tables, notes = _profile_together(config, link, config.sizes, costs)
    profiled = {"seconds": time.perf_counter() - started, "sizes": notes}
    if config.profiler == "engine":
        # latency under load and per-step cost belong to the machine and runtime, not to one micro-batch
        # size: one value each, the median of the fits at every size (each fit alone is noisy)
        costs = dataclasses.replace(costs, step=statistics.median(t.runtime.step_overhead for t in tables),
                                    latency=statistics.median(t.link.latency for t in tables))
        profiled["fits"] = [{"size": t.microbatch_size, "latency": t.link.latency,
                             "step_overhead": t.runtime.step_overhead,
                             "replica_latency": getattr(t.runtime.replica_link, "latency", None),
                             "time_spread": t.runtime.time_spread, "start_skew": t.runtime.start_skew,
                             "action_cost": t.runtime.action_overhead, "message_cost": t.runtime.message_cost}
                            for t in tables]
        tables = [_with_engine_costs(table, costs) for table in tables]
        profiled.update(latency=costs.latency, step_overhead=costs.step)
    link_note = {"link": {"latency": link.latency, "bandwidth": link.bandwidth},
                 "link_times": {str(k): v for k, v in link_times.items()}}
    return link, link_note, overhead_note, costs, tables, profiled


def _worker(rank: int, store_file: str, config: RealityConfig) -> None:
    begun = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    work, out = config.workload, Path(config.out)
    link, link_note, overhead_note, costs, tables, profiled = _profile_sizes(rank, begun, config)
    bases = {table.microbatch_size: table for table in tables}
    shared: list = [None]
    if rank == 0:
        for table in tables:
            save_costs(table, out / f"costs-b{table.microbatch_size}.json")
        records, seconds = choose_plans(tables, config)
        uniform = _uniform_record(records[0], tables, config) if config.uniform and records else None
        shared = [(records, seconds, uniform)]
    if config.try_plans:  # every rank: the trials run on both
        tried = _try_choice(tables, config)
        if rank == 0:
            _mark_tried(shared[0][0], tried, config)
    dist.broadcast_object_list(shared, src=0)
    records, profiled["plan_seconds"], uniform = shared[0]
    runs = list(records)
    if uniform is not None and not uniform["same"]:
        runs.insert(1, uniform)  # next to the chosen plan in every round: the two meet the machine's speed alike
    engines = {id(record): engine for record in runs
               if (engine := _runnable(record, config)) is not None}  # a refused plan is reported, not run
    runs = [record for record in runs if id(record) in engines]
    batches = [work.batch(step, config.global_batch) for step in range(8)]
    profilers = {}
    if config.profiler == "engine":
        for size in sorted({record["microbatch_size"] for record in runs}):
            inputs, target = batches[0]
            profilers[size] = EngineProfiler(work.build(), inputs, loss_fn=work.loss, target=target,
                                             microbatches=config.global_batch // size, base=bases[size],
                                             **work.tracing)
    for round_ in range(config.rounds):
        _log(rank, begun, f"round {round_ + 1} of {config.rounds}: profile, predict and run each of {len(runs)} plans")
        # forwards in even rounds, backwards in odd ones: a drift within a round weighs on every position alike,
        # and the uniform split stays next to the chosen plan
        for record in (runs if round_ % 2 == 0 else runs[::-1]):
            _measure_plan(rank, record, engines[id(record)], profilers.get(record["microbatch_size"]), batches,
                          config, link, costs, bases)
    if config.judge_rounds:
        _log(rank, begun, f"{config.judge_rounds} judging rounds over the {len(runs)} plans, interleaved")
        _judge(rank, runs, engines, batches, config)
    for record in runs:
        record["trace"] = str(out / (f"trace-uniform-{record['schedule']}" if record is uniform
                                     else f"trace{records.index(record)}-{record['schedule']}"))
        engines[id(record)].write_trace(Path(record["trace"]) / f"rank{rank}.json")
    if rank == 0:
        (out / "results.json").write_text(json.dumps({
            **link_note, "overhead": overhead_note, "profile": profiled, "plans": records, "uniform": uniform,
        }, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _judge(rank: int, runs: list[dict], engines: dict, batches: list, config: RealityConfig) -> None:
    """``config.judge_rounds`` rounds of every plan's steps alone, the plans in an order rotated by one per round
    (A B C, B C A, ...) so the machine's drift hits them alike; rank 0 appends each round's timed steps to
    ``record["judged"]``. One untimed step first in each round: the first step after another plan's engine."""
    for round_ in range(config.judge_rounds):
        shift = round_ % len(runs)
        for record in runs[shift:] + runs[:shift]:
            engine = engines[id(record)]
            _steps(engine, batches, 1)
            times = _steps(engine, batches, config.judge_steps, first=1)
            if rank == 0:
                record.setdefault("judged", []).append(times)


def _try_choice(tables: list[CostTable], config: RealityConfig):
    """The plan ``try_plans`` chooses among the ``config.try_plans`` best of the same plan search as
    :func:`choose_plans` (deterministic: the same on both ranks), measured as ``config.try_budget`` says."""
    from pipeloom.profile.trials import try_plans

    work = config.workload
    result = plan_pipeline(tables, num_ranks=2, global_batch=config.global_batch, memory_limit=config.memory_limit,
                          schedules=config.schedules)
    inputs, target = work.batch(0, config.global_batch)
    return try_plans(result, build=work.build, inputs=inputs, target=target, loss_fn=work.loss, k=config.try_plans,
                     budget=config.try_budget,
                     options_for=lambda plan: {"tracing": Tracing(**work.tracing,
                                                                  example_inputs=work.example_inputs(plan.microbatch_size))})


def _mark_tried(records: list[dict], tried, config: RealityConfig) -> None:
    """Mark the record of the plan ``try_plans`` chose (``tried_choice``, with its trials), adding it
    (saved as ``plan-tried.json``) where it is not the best of its schedule."""
    plan = tried.plan
    runs = tried.timeline.schedule  # the order the tried plan runs: the simulated one, saved where it differs
    for kept in records:  # the same plan when it runs the same actions (gpipe and 1f1b at one micro-batch)
        if (kept["microbatches"], kept["split_points"]) == (plan.microbatches, list(plan.split_points)) \
                and _same_order(_record_schedule(kept), runs):
            kept.update(tried_choice=True, trials=list(plan.trials))
            return
    path = Path(config.out) / "plan-tried.json"
    tried.save(path)
    saved = load_plan(path)
    run_schedule = None if saved.schedule == plan.schedule else str(path.parent / saved.schedule)
    records.append({"file": str(path), "label": f"{plan.trials[0]['label']} (tried)", "schedule": plan.schedule,
                    "schedule_options": dict(plan.schedule_options), "run_schedule": run_schedule,
                    "microbatches": plan.microbatches, "microbatch_size": plan.microbatch_size,
                    "split_points": list(plan.split_points), "predicted": plan.predicted_step_time,
                    "own_order": run_schedule is not None, "tried_choice": True, "trials": list(plan.trials)})


def _measure_plan(rank: int, record: dict, engine, profiler: EngineProfiler | None, batches: list,
                  config: RealityConfig, link: Link, costs: EngineCosts, bases: dict[int, CostTable]) -> None:
    """One round of one plan: profile its micro-batch size, re-predict, run; appended to ``record`` (rank 0).

    With the engine profiler the two interleave: ``config.cycles`` times one profiling step, then a
    share of the plan's timed steps, so that profile and run meet the machine's drifting speed alike.
    """
    if profiler is None:
        (table,), (note,) = _profile_together(config, link, [record["microbatch_size"]], costs, bases)

        def measure() -> list[float]:
            _steps(engine, batches, config.warmup_steps)
            return _steps(engine, batches, config.steps, first=config.warmup_steps)

        times, foreign, attempts = _quiet(measure, config)
        traced = [record["step"] for record in engine.trace_steps[-len(times):]]
        profile_note = {"profile_foreign": note["foreign"], "profile_attempts": note["attempts"]}
        fitted_link = (table.link.latency, table.runtime.step_overhead)
    else:
        def interleaved() -> tuple[list[float], CostTable, list[int]]:
            for _ in range(config.profile_warmup):
                profiler.step()
            _steps(engine, batches, config.warmup_steps)
            skip, times = profiler.steps, []
            share = -(-config.steps // config.cycles)
            for cycle in range(config.cycles):
                profiler.step()
                times += _steps(engine, batches, share, first=config.warmup_steps + cycle * share)
            fitted = profiler.table(skip=skip, bandwidth=link.bandwidth)
            return times, fitted, [record["step"] for record in engine.trace_steps[-len(times):]]

        (times, fitted, traced), foreign, attempts = _quiet(interleaved, config)
        fitted_link = (fitted.link.latency, fitted.runtime.step_overhead)
        table = _with_engine_costs(fitted, costs)
        profile_note = {"profile_foreign": foreign, "profile_attempts": attempts,
                        "replica_latency": getattr(fitted.runtime.replica_link, "latency", None),
                        "time_spread": fitted.runtime.time_spread, "start_skew": fitted.runtime.start_skew,
                        "message_cost": fitted.runtime.message_cost,
                        "action_cost": fitted.runtime.action_overhead}
    if rank == 0:
        entry = {"predicted": predict(record, [table], config), "times": times, "traced_steps": traced,
                 "latency": fitted_link[0], "step_overhead": fitted_link[1],
                 "foreign": foreign,
                 "attempts": attempts, **profile_note, "stage_costs": _stage_costs(record, table)}
        record.setdefault("rounds", []).append(entry)


def _stage_costs(record: dict, table: CostTable) -> list[dict]:
    """Per model stage of the plan: the profiled F, I, W and full B in seconds."""
    starts = [0] + [table.names.index(name) for name in record["split_points"]] + [len(table.pieces)]
    return [{**{kind: sum(getattr(p, kind.lower()) for p in table.pieces[a:b]) for kind in "FIW"},
             "B": sum(p.full_backward for p in table.pieces[a:b])}
            for a, b in pairwise(starts)]


def run_reality(config: RealityConfig) -> dict:
    """Measure, profile, plan and run on two spawned gloo ranks; the ``results.json`` document."""
    Path(config.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(str(Path(folder) / "store"), config), nprocs=2, join=True)
    return json.loads((Path(config.out) / "results.json").read_text())
