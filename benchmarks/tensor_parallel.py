"""Tensor parallelism inside pipeline stages, on 4 gloo CPU ranks: pipeloom's pp 2 x tp 2 against pipeloom's pp 4
and against torch.distributed.pipelining's own stages with the same tensor-parallel plan, side by side; and the
planner's predicted step time of the pp 2 x tp 2 plan (from a table profiled in the engine) against its measured one.

Run ``cd benchmarks && python tensor_parallel.py`` (``--quick`` for a smaller, shorter run; ``--help``). It spawns 4
processes (gloo, one thread each) that build the same GPT-like model from one seed: an input projection,
``--layers`` pre-norm transformer layers (fused head-major q/k/v projection, so a column shard holds whole heads;
a 4x MLP) and a classifier per position. The tensor-parallel plan is Megatron's column->row, as torch's
``parallelize_module`` takes it: ``layers.*.attn.qkv`` and ``layers.*.mlp.0`` ``ColwiseParallel``,
``layers.*.attn.proj`` and ``layers.*.mlp.2`` ``RowwiseParallel`` (2 all-reduces forward and 2 backward per layer).

In order, in one run:

1. **Profile**: ``profile_in_engine(..., mesh=(pp 2, tp 2), tp_plan=plan, heads=...)``: every piece timed inside
   the runtime over the 4 ranks (tp 1), then over "pp" with the stages sharded over "tp" (its collectives counted
   and timed, the fit written into the table's ``tensor`` field).
2. **Plan**: ``plan_mesh`` on that table, 1F1B with ``--microbatches`` micro-batches, once with tp 2 (pp 2) and
   once with tp 1 (pp 4): each plan's split and predicted step time (the planner's own predictor: the schedule
   re-costed with the measured times and simulated, plus the runtime's per-step cost).
3. **Rounds**: ``--warmup`` then ``--steps`` rounds of one step of each system, who goes first rotating:
   **tp**, pipeloom ``pipeline(model, mesh=mesh, tp_plan=plan, schedule="1f1b")`` on the tp 2 plan's split;
   **pp4**, pipeloom's ``1f1b`` on the pp 4 plan's split; **torch**, ``PipelineStage`` + ``Schedule1F1B`` over the
   mesh's "pp" groups with the tp 2 plan's split, each stage module sharded by the same plan with
   ``parallelize_module``. A step's time is the slowest rank's wall time of one step (ranks start together after a
   barrier); gradients are dropped between steps, no optimizer runs. A ratio is the median over rounds of one
   system's time / another's in the same round (paired: the machine's drifting load cancels), its spread the
   10th-90th percentile.

Target: the tp plan's measured median step time within 25 % of its prediction (|measured / predicted - 1| <= 0.25).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional

__all__ = ["main"]

WORLD = 4
TARGET = 0.25  # |measured / predicted - 1| of the tp plan
SYSTEMS = ("tp", "pp4", "torch")


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Sizes and repetitions of one run."""

    layers: int  # transformer layers
    hidden: int  # width of the residual stream
    head_dim: int  # features per attention head (heads = hidden / head_dim)
    seq: int  # tokens per sample
    features: int  # input features per token
    classes: int  # classifier outputs per token
    batch: int  # samples per step, cut into `microbatches`
    microbatches: int  # M
    profile_warmup: int  # untimed profiling steps (each pipeline)
    profile_steps: int  # timed profiling steps (each pipeline)
    warmup: int  # untimed rounds
    steps: int  # timed rounds
    seed: int


PRESETS = {
    "full": {"layers": 4, "hidden": 256, "head_dim": 32, "seq": 32, "batch": 16, "microbatches": 4,
             "profile_warmup": 2, "profile_steps": 5, "warmup": 3, "steps": 20},
    "quick": {"layers": 4, "hidden": 128, "head_dim": 32, "seq": 16, "batch": 16, "microbatches": 4,
              "profile_warmup": 1, "profile_steps": 3, "warmup": 2, "steps": 8},
}


class Attention(nn.Module):
    """Self-attention with one fused projection laid out head by head (columns: heads x (q, k, v) x head_dim),
    so that a column-parallel shard holds whole heads and the heads come from the local width."""

    def __init__(self, hidden: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, hidden) -> (B, T, hidden)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # each (B, heads, T, hd)
        att = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(att.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    """Pre-norm transformer layer: attention and a 4x MLP, each around a residual."""

    def __init__(self, hidden: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, head_dim)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Pieces ``embed``, ``layers.0`` ... ``layers.{L-1}``, ``head`` (traceable by torch.fx)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.embed = nn.Linear(config.features, config.hidden)
        self.layers = nn.ModuleList(Layer(config.hidden, config.head_dim) for _ in range(config.layers))
        self.head = nn.Linear(config.hidden, config.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, features) -> (B, T, classes)
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Stage(nn.Module):
    """torch's stage module: the model's pieces in [start, stop) under their own names (``layers`` renumbered, so
    the plan's ``layers.*`` patterns name the same modules)."""

    def __init__(self, model: GPT, pieces: list[str]) -> None:
        super().__init__()
        self.embed = model.embed if "embed" in pieces else None
        self.layers = nn.ModuleList(model.layers[int(p.split(".")[1])] for p in pieces if p.startswith("layers."))
        self.head = model.head if "head" in pieces else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def megatron_plan() -> dict:
    """Megatron's column->row plan for every layer (torch's parallelize_module plan)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"layers.*.attn.qkv": ColwiseParallel(), "layers.*.attn.proj": RowwiseParallel(),
            "layers.*.mlp.0": ColwiseParallel(), "layers.*.mlp.2": RowwiseParallel()}


def build_model(config: Config) -> GPT:
    torch.manual_seed(config.seed)
    return GPT(config)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def pieces_of(config: Config) -> list[str]:
    return ["embed", *(f"layers.{k}" for k in range(config.layers)), "head"]


class PipeloomRunner:
    """pipeloom's engine: 1F1B over the split, on a (pp, tp) mesh with the plan or over every rank."""

    def __init__(self, config: Config, split: list[str], *, mesh: object = None) -> None:
        from pipeloom.runtime import Parallelism, pipeline

        tp = Parallelism(mesh=mesh, tp_plan=megatron_plan()) if mesh is not None else None
        self.engine = pipeline(build_model(config), schedule="1f1b", split_points=split, loss_fn=loss_fn,
                               microbatches=config.microbatches, parallel=tp)
        self.parameters = list(self.engine.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.engine.step(x, target=y)


class TorchRunner:
    """torch.distributed.pipelining: this rank's stage of the split (over the mesh's "pp" group), its modules
    sharded with the same plan over "tp", run by ``Schedule1F1B``."""

    def __init__(self, config: Config, split: list[str], mesh: object) -> None:
        from torch.distributed import pipelining
        from torch.distributed.tensor.parallel import parallelize_module

        names = pieces_of(config)
        cuts = [0, *(names.index(s) for s in split), len(names)]
        stage = mesh.get_local_rank("pp")
        module = Stage(build_model(config), names[cuts[stage]:cuts[stage + 1]])
        parallelize_module(module, mesh["tp"], {k: v for k, v in megatron_plan().items() if module.layers})
        self.parameters = list(module.parameters())
        piped = pipelining.PipelineStage(module, stage, len(cuts) - 1, torch.device("cpu"),
                                         group=mesh.get_group("pp"))
        self.schedule = pipelining.Schedule1F1B(piped, config.microbatches, loss_fn=loss_fn)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.schedule.step(x, target=y, losses=[], return_outputs=False)


def timed_step(runner: PipeloomRunner | TorchRunner, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one step on the slowest rank (ranks start together)."""
    dist.barrier()
    start = time.perf_counter()
    runner.step(x, y)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    for p in runner.parameters:
        p.grad = None
    return float(elapsed)


def profile_and_plan(config: Config, mesh: object, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The table profiled in the engine (tp 1 and tp 2) and the planner's 1F1B plans for tp 2 and tp 1."""
    from pipeloom.plan.costs.file import costs_to_json
    from pipeloom.plan.mesh import plan_mesh
    from pipeloom.profile.in_engine import profile_in_engine

    started = time.perf_counter()
    table = profile_in_engine(build_model(config), x, loss_fn=loss_fn, target=y, microbatches=config.microbatches,
                              mesh=mesh, tp_plan=megatron_plan(), heads=config.hidden // config.head_dim,
                              warmup_steps=config.profile_warmup, steps=config.profile_steps, exchange=False)
    seconds = time.perf_counter() - started
    plans = {}
    for name, tp in (("tp", 2), ("pp4", 1)):
        plan = plan_mesh(table, num_ranks=WORLD, global_batch=config.batch, tensor_parallel=[tp], data_parallel=[1],
                         schedules=["1f1b"], microbatches=[config.microbatches]).plan
        plans[name] = {"split": list(plan.split_points), "predicted_s": plan.predicted_step_time}
    return {"table": costs_to_json(table), "plans": plans, "profile_s": seconds}


def worker(rank: int, config: Config, port: int, folder: str) -> None:
    """One rank: profile, plan, then rounds of the three systems; rank 0 writes ``folder``/result.json."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        generator = torch.Generator().manual_seed(config.seed + 1)
        x = torch.randn(config.batch, config.seq, config.features, generator=generator)
        y = torch.randint(0, config.classes, (config.batch, config.seq), generator=generator)
        found = [profile_and_plan(config, mesh, x, y)]  # a collective: every rank profiles (and gets one table)
        dist.broadcast_object_list(found, src=0)  # rank 0's plans, so that every rank runs the same split
        planned = found[0]
        runners = {"tp": PipeloomRunner(config, planned["plans"]["tp"]["split"], mesh=mesh),
                   "pp4": PipeloomRunner(config, planned["plans"]["pp4"]["split"]),
                   "torch": TorchRunner(config, planned["plans"]["tp"]["split"], mesh)}
        times: dict[str, list[float]] = {name: [] for name in runners}
        load = []
        for step in range(config.warmup + config.steps):
            order = SYSTEMS[step % len(SYSTEMS):] + SYSTEMS[:step % len(SYSTEMS)]
            for name in order:
                seconds = timed_step(runners[name], x, y)
                if step >= config.warmup:
                    times[name].append(seconds)
            load.append(os.getloadavg()[0])
        if rank == 0:
            Path(folder, "result.json").write_text(json.dumps({"config": asdict(config), "times": times,
                                                               "load": load, **planned}))
    finally:
        dist.destroy_process_group()


def paired(times: dict[str, list[float]], name: str, other: str) -> tuple[float, float, float]:
    """Median and 10th/90th percentiles over rounds of ``name``'s time / ``other``'s in the same round."""
    ratios = [a / b for a, b in zip(times[name], times[other])]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    low, high = statistics.quantiles(ratios, n=10, method="inclusive")[::8]
    return statistics.median(ratios), low, high


def report(result: dict, load_before: float, load_after: float) -> str:
    """The printed tables: step times and paired ratios; predicted against measured."""
    from pipeloom.plan.costs.file import costs_from_json

    c, times, plans = result["config"], result["times"], result["plans"]
    table = costs_from_json(result["table"])
    info = table.tensor
    profile = info.profiles[0]
    layer = next(p for p in profile.pieces if p.name in info.layers)
    comms = {f"{k.kind} {k.phase}" for k in layer.collectives}
    whole = [p.f + p.full_backward for p in table.pieces if p.name in info.layers]
    sharded = [p.f + (p.full_backward if p.full_backward is not None else p.i + p.w)
               for p in profile.pieces if p.name in info.layers]
    counted = ", ".join(f"{sum(f'{k.kind} {k.phase}' == t for k in layer.collectives)} {t}" for t in sorted(comms))
    lines = [
        f"4 gloo ranks (CPU, 1 thread each, {os.cpu_count()} cores), GPT-like: {c['layers']} layers, hidden "
        f"{c['hidden']}, {c['hidden'] // c['head_dim']} heads, seq {c['seq']}, batch {c['batch']} = "
        f"{c['microbatches']} micro-batches, 1F1B; Megatron column->row plan over tp 2",
        f"profiled in the engine in {result['profile_s']:.1f} s ({c['profile_warmup']} + {c['profile_steps']} steps "
        f"per pipeline): counted per layer and micro-batch {counted}; fitted all_reduce "
        f"{info.fit.overhead.get('all_reduce', 0.0) * 1e3:.2f} ms per collective",
        f"one layer's F + B per micro-batch, mean over layers, measured in the engine: tp 1 "
        f"{statistics.fmean(whole) * 1e3:.2f} ms, tp 2 {statistics.fmean(sharded) * 1e3:.2f} ms",
        "",
        f"step time, medians of {c['steps']} rounds after {c['warmup']} warm-up (who goes first rotates):",
        f"{'system':<34} {'split':<28} {'ms':>8}",
    ]
    labels = {"tp": "pp 2 x tp 2, pipeloom", "pp4": "pp 4 (no tp), pipeloom", "torch": "pp 2 x tp 2, torch pipelining"}
    for name in SYSTEMS:
        split = plans["tp" if name == "torch" else name]["split"]
        lines.append(f"{labels[name]:<34} {','.join(split):<28} {statistics.median(times[name]) * 1e3:>8.1f}")
    lines += ["", f"{'paired ratio':<34} {'median':>8} {'p10-p90':>13}"]
    for name, other in (("tp", "pp4"), ("tp", "torch")):
        median, low, high = paired(times, name, other)
        lines.append(f"{labels[name] + ' / ' + other:<34} {median:>8.3f} {f'{low:.2f}-{high:.2f}':>13}")
    lines += ["", f"{'predicted (planner) vs measured':<34} {'pred ms':>8} {'meas ms':>8} {'meas/pred':>9}"]
    verdict = ""
    for name in ("tp", "pp4"):
        predicted, measured = plans[name]["predicted_s"], statistics.median(times[name])
        lines.append(f"{labels[name]:<34} {predicted * 1e3:>8.1f} {measured * 1e3:>8.1f} {measured / predicted:>9.3f}")
        if name == "tp":
            error = abs(measured / predicted - 1)
            verdict = (f"target: tp plan's measured step within {TARGET:.0%} of its prediction: off by {error:.1%}: "
                       f"{'met' if error <= TARGET else 'MISSED'}")
    lines += [verdict, f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after; during the rounds "
                       f"{min(result['load']):.2f}-{max(result['load']):.2f} ({os.cpu_count()} CPUs)"]
    return "\n".join(lines)


def free_port() -> int:
    """A TCP port free on this machine for the gloo rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (about a minute)")
    for name in ("layers", "hidden", "head_dim", "seq", "batch", "microbatches", "warmup", "steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="override the preset")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    values = {name: getattr(args, name) if getattr(args, name, None) is not None else value
              for name, value in preset.items()}
    config = Config(features=16, classes=8, seed=args.seed, **values)
    if config.hidden % config.head_dim or (config.hidden // config.head_dim) % 2:
        parser.error(f"--hidden {config.hidden} / --head-dim {config.head_dim} must give an even number of heads")
    if config.batch % config.microbatches or config.microbatches < 2 or config.layers < 2:
        parser.error("--batch must be a multiple of --microbatches (>= 2), and --layers >= 2 (one piece per rank)")
    return config


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(config, free_port(), folder), nprocs=WORLD, join=True)
        result = json.loads(Path(folder, "result.json").read_text())
    print(report(result, load_before, os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
