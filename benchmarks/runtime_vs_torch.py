"""pipeloom's runtime against torch.distributed.pipelining: same model, same schedule, side by side.

Run ``python benchmarks/runtime_vs_torch.py`` (``--help`` for sizes). It spawns ``--ranks`` processes
(gloo on CPU, ``torch.set_num_threads(1)`` in each: the development machine has 2 cores for 2 ranks),
builds the same residual-MLP model on every rank from one seed, and for each schedule runs warm-up
steps, then ``--steps`` timed steps of pipeloom and torch in turn (also of pipeloom running torch's
own action lists, for the multi-stage classes). A step's time is the slowest rank's wall time of
one ``step`` call (all ranks start it together after a barrier). Gradients are zeroed between steps
and no optimizer runs, so every step sees the same weights and loss.

Printed per schedule: the step-time medians and pipeloom / torch (target <= 0.9), the loss of both
(they must agree), and pipeloom's measured step time against the simulator's prediction from the
measured per-action costs of a traced run (target <= 1.15).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


COMPUTE = re.compile(r"\d+[FBIW]\d+")  # a compute action's text, e.g. 2F0 or 0W3


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One schedule in both systems."""

    name: str  # pipeloom's built-in schedule name
    torch_class: str  # the torch.distributed.pipelining schedule class of the same family
    stages_per_rank: int  # model stages each rank holds (1, or 2 for looped and V placements)


CASES = (
    Case(name="gpipe", torch_class="ScheduleGPipe", stages_per_rank=1),
    Case(name="1f1b", torch_class="Schedule1F1B", stages_per_rank=1),
    Case(name="interleaved-1f1b", torch_class="ScheduleInterleaved1F1B", stages_per_rank=2),
    Case(name="zbv", torch_class="ScheduleZBVZeroBubble", stages_per_rank=2),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Sizes and repetitions of one benchmark run."""

    ranks: int  # processes, one pipeline rank each
    blocks: int  # residual MLP blocks in the model
    width: int  # features of the residual stream
    expansion: int  # hidden features of a block = expansion * width
    batch: int  # rows per step, cut into `microbatches` equal micro-batches
    microbatches: int  # M
    warmup: int  # untimed steps per system before timing
    steps: int  # timed steps per system
    traced_steps: int  # steps of a separate traced pipeloom run for the simulator comparison
    seed: int  # model and data seed, the same on every rank
    schedules: tuple[str, ...]  # names from CASES


class Block(nn.Module):
    """x + fc2(gelu(fc1(x))): (rows, width) -> (rows, width)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(functional.gelu(self.fc1(x)))


class ResidualMLP(nn.Module):
    """A chain of residual MLP blocks (traceable by torch.fx; split points are ``blocks.k``)."""

    def __init__(self, *, blocks: int, width: int, expansion: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, expansion * width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model(config: Config) -> ResidualMLP:
    """The benchmark model, identical on every rank (seeded)."""
    torch.manual_seed(config.seed)
    return ResidualMLP(blocks=config.blocks, width=config.width, expansion=config.expansion)


def stage_bounds(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Blocks [start, stop) of each stage, as even as possible (earlier stages take the extra)."""
    if num_stages > num_blocks:
        raise SystemExit(f"{num_stages} stages need at least as many blocks; raise --blocks")
    base, extra = divmod(num_blocks, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def torch_stage_indices(case: Case, rank: int, ranks: int) -> list[int]:
    """Stages torch places on ``rank``: looped (s % p) for interleaved, V (r, 2p-1-r) for ZB-V."""
    if case.stages_per_rank == 1:
        return [rank]
    if case.torch_class == "ScheduleZBVZeroBubble":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(case.stages_per_rank)]


class TorchRunner:
    """torch.distributed.pipelining running ``case`` on this rank."""

    def __init__(self, case: Case, config: Config, rank: int) -> None:
        from torch.distributed import pipelining

        model = build_model(config)
        num_stages = config.ranks * case.stages_per_rank
        bounds = stage_bounds(config.blocks, num_stages)
        stages = []
        for s in torch_stage_indices(case, rank, config.ranks):
            start, stop = bounds[s]
            module = nn.Sequential(*model.blocks[start:stop])
            stages.append(pipelining.PipelineStage(module, s, num_stages, torch.device("cpu")))
        schedule_class = getattr(pipelining, case.torch_class)
        self.parameters = [p for stage in stages for p in stage.submod.parameters()]
        self.schedule = schedule_class(stages if case.stages_per_rank > 1 else stages[0],
                                       config.microbatches, loss_fn=functional.mse_loss)
        self.holds_last = (num_stages - 1) in torch_stage_indices(case, rank, config.ranks)

    def order_csv(self) -> str:
        """The compute actions torch runs, as a torch CSV (one row per rank) that pipeloom loads.

        Only for the multi-stage classes: they execute ``pipeline_order``; the single-stage ones
        (GPipe, 1F1B) run their own loops and keep ``pipeline_order`` for display.
        """
        order = self.schedule.pipeline_order
        return "".join(",".join(str(a) for a in order[rank] if a is not None and COMPUTE.match(str(a))) + "\n"
                       for rank in sorted(order))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        self.schedule.step(x, target=y, losses=losses, return_outputs=False)
        return losses

    def loss(self, losses: list[torch.Tensor]) -> float:
        """The step's loss (mean over micro-batches, as pipeloom sums loss_m / M) on every rank."""
        value = torch.stack(losses).mean() if self.holds_last else torch.zeros(())
        dist.all_reduce(value)  # only the last stage's rank contributes
        return float(value.detach())


class PipeloomRunner:
    """pipeloom's engine running ``case`` on this rank (trace to ``trace`` when given)."""

    def __init__(self, case: Case, config: Config, *, trace: str | None = None, schedule: object = None) -> None:
        import pipeloom.runtime as rt

        model = build_model(config)
        num_stages = config.ranks * case.stages_per_rank
        split_points = [f"blocks.{start}" for start, _ in stage_bounds(config.blocks, num_stages)[1:]]
        options = {"stages_per_rank": case.stages_per_rank} if case.name == "interleaved-1f1b" else None
        self.engine = rt.pipeline(model, schedule=schedule or case.name, split_points=split_points,
                                  loss_fn=functional.mse_loss, microbatches=config.microbatches,
                                  schedule_options=None if schedule else options, trace=trace)
        self.parameters = list(self.engine.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.engine.step(x, target=y)

    def loss(self, loss: torch.Tensor) -> float:
        return float(loss.detach())


def timed_step(runner: TorchRunner | PipeloomRunner, x: torch.Tensor, y: torch.Tensor) -> tuple[float, object]:
    """Seconds of one step on the slowest rank (ranks start together), and the step's result."""
    dist.barrier()
    start = time.perf_counter()
    result = runner.step(x, y)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    for p in runner.parameters:
        p.grad = None
    return float(elapsed), result


def run_side_by_side(case: Case, config: Config, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Warm-up, then timed steps of every runner in turn (rotating who goes first); medians, losses."""
    from pipeloom.ir import schedule_from_csv

    torch_runner = TorchRunner(case, config, dist.get_rank())
    runners: dict[str, TorchRunner | PipeloomRunner] = {"torch": torch_runner,
                                                        "pipeloom": PipeloomRunner(case, config)}
    if case.stages_per_rank > 1:  # torch executes its pipeline_order: pipeloom runs the very same lists
        order = schedule_from_csv(torch_runner.order_csv(), name=f"torch-{case.name}")
        runners["pipeloom_torch_order"] = PipeloomRunner(case, config, schedule=order)
    times: dict[str, list[float]] = {name: [] for name in runners}
    losses: dict[str, float] = {}
    names = list(runners)
    for step in range(config.warmup + config.steps):
        for name in names[step % len(names):] + names[:step % len(names)]:
            runner = runners[name]
            seconds, result = timed_step(runner, x, y)
            if step >= config.warmup:
                times[name].append(seconds)
            losses[name] = runner.loss(result)
    row = {"schedule": case.name, "torch_class": case.torch_class}
    for name in runners:
        row[f"{name}_median_s"] = statistics.median(times[name])
        row[f"{name}_loss"] = losses[name]
        # paired: each round's steps ran back to back, so their ratio cancels slow drifts of machine load
        row[f"{name}_paired_ratio"] = statistics.median(a / b for a, b in zip(times[name], times["torch"]))
    return row


def traced_prediction(case: Case, config: Config, x: torch.Tensor, y: torch.Tensor, folder: str) -> dict:
    """pipeloom's measured step time against the simulator's prediction from the same traced steps.

    The prediction re-costs the schedule with the median measured time of each (stage, kind) and the
    fitted communication latency (``pipeloom.viz.measured``) and simulates it. Two measured times:
    ``wall`` brackets the whole ``engine.step`` calls (first start to last end over ranks), ``span``
    only the schedule's compute, wait and send events.
    """
    runner = PipeloomRunner(case, config, trace=folder)
    for _ in range(config.warmup + config.traced_steps):
        timed_step(runner, x, y)
    dist.barrier()  # every rank's trace file is written
    if dist.get_rank() != 0:
        return {}
    from pipeloom.viz.measured import compare_run, load_run_trace, trace_summary

    run = load_run_trace(folder)
    summary = trace_summary(compare_run(run, steps=list(run.steps[-config.traced_steps:])))
    return {"measured_s": summary["wall_step_time"], "span_s": summary["measured_step_time"],
            "predicted_s": summary["predicted_step_time"]}


def worker(rank: int, config: Config, port: int, folder: str) -> None:
    """One rank: every case side by side; rank 0 writes the rows to ``folder``/result.json."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=config.ranks)
    try:
        generator = torch.Generator().manual_seed(config.seed + 1)
        x = torch.randn(config.batch, config.width, generator=generator)
        y = torch.randn(config.batch, config.width, generator=generator)
        rows = []
        for case in (c for c in CASES if c.name in config.schedules):
            row = run_side_by_side(case, config, x, y)
            if config.traced_steps > 0:
                row.update(traced_prediction(case, config, x, y, os.path.join(folder, case.name)))
            rows.append(row)
        if rank == 0:
            Path(folder, "result.json").write_text(json.dumps({"config": asdict(config), "rows": rows}))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ratio(numerator: float | None, denominator: float | None) -> str:
    if numerator is None or denominator is None:
        return "-"
    return f"{numerator / denominator:.3f}"


def milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def loss_check(row: dict) -> str:
    """``equal`` when every system's loss is the same float, else the largest difference."""
    losses = [row[key] for key in row if key.endswith("_loss")]
    spread = max(losses) - min(losses)
    return "equal" if spread == 0 else f"differ {spread:.1e}"


def table(result: dict) -> str:
    """The printed table: one row per schedule."""
    c = result["config"]
    lines = [(f"{c['ranks']} ranks (gloo, CPU, 1 thread each), {c['blocks']} residual MLP blocks, width "
              f"{c['width']}, hidden {c['width'] * c['expansion']}, batch {c['batch']} = {c['microbatches']} "
              f"micro-batches; medians of {c['steps']} steps after {c['warmup']} warm-up; times in ms"),
             (f"{'schedule':<17} {'pipeloom':>8} {'torch':>7} {'ratio':>6} {'same order':>10} {'ratio':>6} "
              f"{'loss (pipeloom)':>19} {'losses':>8} {'wall':>7} {'span':>7} {'predicted':>9} "
              f"{'wall/pred':>9} {'span/pred':>9}")]
    for row in result["rows"]:
        ours, theirs, same = (row.get(f"{k}_median_s") for k in ("pipeloom", "torch", "pipeloom_torch_order"))
        paired, paired_same = row["pipeloom_paired_ratio"], row.get("pipeloom_torch_order_paired_ratio")
        lines.append(
            f"{row['schedule']:<17} {milliseconds(ours):>8} {milliseconds(theirs):>7} {paired:>6.3f} "
            f"{milliseconds(same):>10} {'-' if paired_same is None else f'{paired_same:.3f}':>6} "
            f"{row['pipeloom_loss']!r:>19} "
            f"{loss_check(row):>8} {milliseconds(row.get('measured_s')):>7} {milliseconds(row.get('span_s')):>7} "
            f"{milliseconds(row.get('predicted_s')):>9} {ratio(row.get('measured_s'), row.get('predicted_s')):>9} "
            f"{ratio(row.get('span_s'), row.get('predicted_s')):>9}")
    lines += [
        "ratio = median over rounds of pipeloom's step time / torch's in the same round (target <= 0.9);",
        "same order = pipeloom running torch's own action lists",
        "(multi-stage classes only; torch's GPipe/1F1B run the same order as pipeloom's). losses: pipeloom's",
        "and torch's step loss compared as floats. wall = engine.step calls of a separate traced run (first",
        "start to last end over ranks), span = its compute/wait/send events; predicted = the simulator on the",
        "measured median task times and fitted comm latency (target wall/pred <= 1.15).",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--expansion", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--traced-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schedules", nargs="+", default=[c.name for c in CASES],
                        choices=[c.name for c in CASES])
    args = parser.parse_args(argv)
    return Config(ranks=args.ranks, blocks=args.blocks, width=args.width, expansion=args.expansion,
                  batch=args.batch, microbatches=args.microbatches, warmup=args.warmup, steps=args.steps,
                  traced_steps=args.traced_steps, seed=args.seed, schedules=tuple(args.schedules))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(config, free_port(), folder), nprocs=config.ranks, join=True)
        result = json.loads(Path(folder, "result.json").read_text())
    print(table(result))
    # the machine's other work disturbs the medians: say how busy it was
    print(f"1-minute load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
          f"({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
