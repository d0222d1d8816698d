"""pipeloom's runtime against torch.distributed.pipelining: same model, same action order, side by side.

Run ``python benchmarks/runtime_vs_torch.py`` (``--help``; docs/runtime-benchmark.md explains it). It
spawns ``--ranks`` processes (gloo on CPU, one thread each: the development machine has 2 cores), builds
the same residual-MLP model on every rank from one seed and, for every torch class of GPipe, 1F1B,
Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV that this torch has, times in
rounds (who goes first rotates): **torch**; **same order**, pipeloom on torch's own compute actions
(the multi-stage classes' ``pipeline_order`` as a torch CSV, a full B that torch mixes with I/W run as
I then W; for GPipe and 1F1B, whose loops do not execute ``pipeline_order``, pipeloom's ``gpipe`` and
``1f1b``, which reproduce those loops action for action); and **own order**, pipeloom's own schedule
for the placement, in general a different order and never parity: gpipe, 1f1b, interleaved-1f1b, one
found by ``pipeloom.search`` on the looped placement with split backward (no built-in interleaved
zero-bubble exists), zbv, dualpipev. Where the own order equals torch's list, one run fills both.

A step's time is the slowest rank's wall time of one ``step`` call (ranks start together after a
barrier); gradients are zeroed between steps and no optimizer runs. A ratio is the median over rounds
of pipeloom's time / torch's in the same round (paired: load drifts cancel), its spread the 10th-90th
percentile. Sizes: "hidden" is the printed inner width ``width * expansion``, so "hidden 256 batch 64"
is ``--size small`` (width 64, expansion 4, batch 64) and "hidden 1024 batch 256" is ``large`` (width
256, expansion 4, batch 256). Targets: same order <= 0.95 for every class, own order <= 0.9, and
wall/pred <= 1.15 for a traced run of the own order against the simulator's prediction.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import pipelining
from torch.nn import functional

__all__ = ["main"]


COMPUTE = re.compile(r"\d+[FBIW]\d+")  # a compute action's text, e.g. 2F0 or 0W3
SEARCHED = "searched"  # Case.own for a schedule found by pipeloom.search (built in main, once)
SAME_TARGET, OWN_TARGET = 0.95, 0.9
LEGEND = """\
ratio: median over rounds of pipeloom's step time / torch's in the same round; p10-p90: its spread.
same order: pipeloom on torch's own action list (= own: identical to pipeloom's order, one run gives both
columns; loop: torch's GPipe/1F1B loops; B=I+W: torch's full backwards run as I then W). own order:
pipeloom's own schedule for the same placement, in general a different action order (not parity).
losses: all systems' step losses compared as floats. wall/pred: the own order's traced step time / the
simulator's prediction from its measured task times."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One torch schedule class and pipeloom's own schedule for the same placement."""

    torch_class: str  # the torch.distributed.pipelining schedule class
    own: str  # pipeloom's built-in of the same family, or SEARCHED
    placement: str  # where stage s lives: "linear" (rank s), "looped" (rank s % p), "v" (r and 2p-1-r)

    @property
    def stages_per_rank(self) -> int:
        """Model stages each rank holds: 1, or 2 for the looped and V placements."""
        return 1 if self.placement == "linear" else 2

    @property
    def label(self) -> str:
        """The class name without ``Schedule``, e.g. ``Interleaved1F1B``."""
        return self.torch_class.removeprefix("Schedule")


CASES = tuple(case for case in (
    Case(torch_class="ScheduleGPipe", own="gpipe", placement="linear"),
    Case(torch_class="Schedule1F1B", own="1f1b", placement="linear"),
    Case(torch_class="ScheduleInterleaved1F1B", own="interleaved-1f1b", placement="looped"),
    Case(torch_class="ScheduleInterleavedZeroBubble", own=SEARCHED, placement="looped"),
    Case(torch_class="ScheduleZBVZeroBubble", own="zbv", placement="v"),
    Case(torch_class="ScheduleDualPipeV", own="dualpipev", placement="v"),
) if hasattr(pipelining, case.torch_class))  # every one of them that this torch has

SIZES = {"small": {"width": 64, "expansion": 4, "batch": 64},  # hidden 256, batch 64
         "large": {"width": 256, "expansion": 4, "batch": 256}}  # hidden 1024, batch 256


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Sizes and repetitions of one benchmark run (one model size)."""

    size: str  # the preset's name, or "custom"
    ranks: int  # processes, one pipeline rank each
    blocks: int  # residual MLP blocks in the model
    width: int  # features of the residual stream
    expansion: int  # hidden features of a block = expansion * width
    batch: int  # rows per step, cut into `microbatches` equal micro-batches
    microbatches: int  # M
    warmup: int  # untimed rounds before timing
    steps: int  # timed rounds (one step of every system each)
    traced_steps: int  # steps of a separate traced pipeloom run for the simulator comparison
    search_seconds: float  # time limit of the search for the SEARCHED own order
    seed: int  # model and data seed, the same on every rank
    schedules: tuple[str, ...]  # Case.label of the torch classes to run
    searched: str  # the SEARCHED own order as torch CSV ("" until main() has searched)


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
    """Stages torch places on ``rank``: rank, looped (s % p) or V (r, 2p-1-r)."""
    if case.placement == "linear":
        return [rank]
    if case.placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(case.stages_per_rank)]


def compute_texts(action: object) -> list[str]:
    """torch action -> its compute actions as text (an overlapped F+B pair gives both, in order)."""
    if action is None:
        return []
    if getattr(action, "sub_actions", None):
        return [text for sub in action.sub_actions for text in compute_texts(sub)]
    return [str(action)] if COMPUTE.fullmatch(str(action)) else []


def torch_order(schedule: object) -> tuple[list[list[str]], bool]:
    """The compute actions torch's ``pipeline_order`` lists, one row per rank, and whether B was split:
    a list mixing B with I/W gets each B as I then W (pipeloom's CSV reader takes one backward style)."""
    order = schedule.pipeline_order
    rows = [[text for action in order[rank] for text in compute_texts(action)] for rank in sorted(order)]
    kinds = {re.sub(r"\d", "", text) for row in rows for text in row}
    mixed = "B" in kinds and bool(kinds & {"I", "W"})
    if mixed:
        rows = [[part for text in row for part in ((text.replace("B", "I"), text.replace("B", "W"))
                                                   if "B" in text else (text,))] for row in rows]
    return rows, mixed


class TorchRunner:
    """torch.distributed.pipelining running ``case``'s class on this rank."""

    def __init__(self, case: Case, config: Config, rank: int) -> None:
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
    """pipeloom's engine running ``schedule`` (a built-in name or a Schedule) over ``case``'s stages."""

    def __init__(self, case: Case, config: Config, schedule: object, *, trace: str | None = None) -> None:
        import pipeloom.runtime as rt

        model = build_model(config)
        num_stages = config.ranks * case.stages_per_rank
        split_points = [f"blocks.{start}" for start, _ in stage_bounds(config.blocks, num_stages)[1:]]
        options = {"stages_per_rank": case.stages_per_rank} if schedule == "interleaved-1f1b" else None
        self.engine = rt.pipeline(
            model,
            schedule=schedule,
            split_points=split_points,
            loss_fn=functional.mse_loss,
            microbatches=config.microbatches,
            schedule_options=options,
            record=trace,
        )
        self.parameters = list(self.engine.parameters())

    def order(self) -> list[list[str]]:
        """The compute actions of every rank, as text (comparable with :func:`torch_order`)."""
        ranks = self.engine.schedule.ranks
        return [[str(a) for a in actions if COMPUTE.fullmatch(str(a))] for actions in ranks]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.engine.step(x, target=y)

    def loss(self, loss: torch.Tensor) -> float:
        return float(loss.detach())


def own_schedule(case: Case, config: Config) -> object:
    """pipeloom's own order for ``case``: a built-in name, or the searched schedule main() found."""
    from pipeloom.ir import schedule_from_csv

    return schedule_from_csv(config.searched, name=SEARCHED) if case.own == SEARCHED else case.own


def timed_step(runner: TorchRunner | PipeloomRunner, x: torch.Tensor, y: torch.Tensor
               ) -> tuple[float, object]:
    """Seconds of one step on the slowest rank (ranks start together), and the step's result."""
    dist.barrier()
    start = time.perf_counter()
    result = runner.step(x, y)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    for p in runner.parameters:
        p.grad = None
    return float(elapsed), result


def timed_rounds(runners: dict, config: Config, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, dict]:
    """Warm-up, then rounds of one step per runner (rotating who goes first): times and last losses."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    losses: dict[str, float] = {}
    names = list(runners)
    for step in range(config.warmup + config.steps):
        for name in names[step % len(names):] + names[:step % len(names)]:
            seconds, result = timed_step(runners[name], x, y)
            if step >= config.warmup:
                times[name].append(seconds)
            losses[name] = runners[name].loss(result)
    return times, losses


def paired(times: dict[str, list[float]], name: str) -> dict:
    """Median and 10th/90th percentile over rounds of ``name``'s time / torch's in the same round."""
    ratios = [a / b for a, b in zip(times[name], times["torch"])]
    low, high = (statistics.quantiles(ratios, n=10, method="inclusive")[::8] if len(ratios) > 1
                 else (ratios[0], ratios[0]))
    return {f"{name}_s": statistics.median(times[name]), f"{name}_ratio": statistics.median(ratios),
            f"{name}_p10": low, f"{name}_p90": high}


def run_side_by_side(case: Case, config: Config, x: torch.Tensor, y: torch.Tensor) -> dict:
    """torch, pipeloom on torch's list and pipeloom's own order, timed in rounds; one table row."""
    from pipeloom.ir import schedule_from_csv

    torch_runner = TorchRunner(case, config, dist.get_rank())
    own = PipeloomRunner(case, config, own_schedule(case, config))
    runners: dict[str, TorchRunner | PipeloomRunner] = {"torch": torch_runner, "own": own}
    if case.placement == "linear":  # torch runs its own loop, whose order gpipe/1f1b reproduce
        identical, how = True, "= own, loop"
    else:  # torch executes pipeline_order
        rows, split_b = torch_order(torch_runner.schedule)
        identical = own.order() == rows
        how = ("= own" if identical else "torch list") + (", B=I+W" if split_b else "")
    if not identical:
        csv = "".join(",".join(row) + "\n" for row in rows)
        runners["same"] = PipeloomRunner(case, config, schedule_from_csv(csv, name=f"torch-{case.label}"))
    times, losses = timed_rounds(runners, config, x, y)
    if identical:  # one pipeloom run is both columns
        times["same"], losses["same"] = times["own"], losses["own"]
    return {"torch_class": case.label, "own": case.own, "same_run": how, "losses": losses,
            "torch_s": statistics.median(times["torch"]), **paired(times, "same"), **paired(times, "own")}


def traced_prediction(case: Case, config: Config, x: torch.Tensor, y: torch.Tensor, folder: str) -> dict:
    """The own order's wall step time (whole ``engine.step`` calls) and the simulator's prediction from
    the same traced steps' median (stage, kind) times and fitted latency (``pipeloom.viz.measured``)."""
    runner = PipeloomRunner(case, config, own_schedule(case, config), trace=folder)
    for _ in range(config.warmup + config.traced_steps):
        timed_step(runner, x, y)
    dist.barrier()  # every rank's trace file is written
    if dist.get_rank() != 0:
        return {}
    from pipeloom.trace.analysis import compare_run
    from pipeloom.trace.reader import load_run_trace
    from pipeloom.trace.summary import trace_summary

    run = load_run_trace(folder)
    summary = trace_summary(compare_run(run, steps=list(run.steps[-config.traced_steps:])))
    return {"measured_s": summary["wall_step_time"], "predicted_s": summary["predicted_step_time"]}


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
        for case in (c for c in CASES if c.label in config.schedules):
            row = run_side_by_side(case, config, x, y)
            if config.traced_steps > 0:
                row.update(traced_prediction(case, config, x, y, os.path.join(folder, case.label)))
            rows.append(row)
        if rank == 0:
            Path(folder, "result.json").write_text(json.dumps({"config": asdict(config), "rows": rows}))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this machine for the gloo rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loss_check(row: dict) -> str:
    """``equal`` when every system's loss is the same float, else the largest difference."""
    spread = max(row["losses"].values()) - min(row["losses"].values())
    return "equal" if spread == 0 else f"differ {spread:.1e}"


def table(result: dict) -> str:
    """The printed table of one size: one row per torch class."""
    c = result["config"]
    lines = [(f"{c['size']}: {c['ranks']} ranks (gloo, CPU, 1 thread each), {c['blocks']} residual MLP "
              f"blocks, width {c['width']}, hidden {c['width'] * c['expansion']}, batch {c['batch']} = "
              f"{c['microbatches']} micro-batches; medians of {c['steps']} rounds after {c['warmup']} "
              "warm-up; ms"),
             (f"{'torch class':<21} {'torch':>7} | {'same order':>17} {'ms':>7} {'ratio':>6} "
              f"{'p10-p90':>11} | {'own order':>16} {'ms':>7} {'ratio':>6} {'p10-p90':>11} | "
              f"{'losses':>7} {'wall/pred':>9}")]
    for row in result["rows"]:
        cells = [f"{row['torch_class']:<21} {row['torch_s'] * 1e3:>7.1f} |"]
        for name, label, width in (("same", row["same_run"], 17), ("own", row["own"], 16)):
            spread = f"{row[f'{name}_p10']:.2f}-{row[f'{name}_p90']:.2f}"
            cells.append(f"{label:>{width}} {row[f'{name}_s'] * 1e3:>7.1f} {row[f'{name}_ratio']:>6.3f} "
                         f"{spread:>11} |")
        wall_pred = f"{row['measured_s'] / row['predicted_s']:.3f}" if "predicted_s" in row else "-"
        cells.append(f"{loss_check(row):>7} {wall_pred:>9}")
        lines.append(" ".join(cells))
    return "\n".join(lines + verdicts(result["rows"]))


def verdicts(rows: list[dict]) -> list[str]:
    """One line per target, as measured: worst same-order ratio, best own-order ratio."""
    worst = max(rows, key=lambda row: row["same_ratio"])
    best = min(rows, key=lambda row: row["own_ratio"])
    lines = []
    for text, row, key, target in (
            ("same order (pipeloom on torch's own list): worst", worst, "same", SAME_TARGET),
            ("own order (pipeloom's schedule; not parity unless '= own'): best", best, "own", OWN_TARGET)):
        value, met = row[f"{key}_ratio"], sum(r[f"{key}_ratio"] <= target for r in rows)
        lines.append(f"{text} {value:.3f} ({row[key] + ' vs ' if key == 'own' else ''}{row['torch_class']}) "
                     f"vs target <= {target}: {'met' if value <= target else 'MISSED'} "
                     f"({met} of {len(rows)} classes <= {target})")
    return lines


def searched_schedule(config: Config) -> str:
    """pipeloom.search on the looped placement (2 stages per rank, split backward), as torch CSV."""
    from pipeloom.ir import schedule_to_csv
    from pipeloom.search import placement, search

    problem = placement("interleaved", config.ranks, split_backward=True)
    found = search(problem, config.microbatches, time_limit=config.search_seconds, workers=1, name=SEARCHED)
    print(f"{SEARCHED} (own order for InterleavedZeroBubble): pipeloom.search, {found.mode} mode, "
          f"{found.status}, makespan {found.makespan:g} vs lower bound {found.lower_bound:g} (Costs(): F 1, "
          f"I 1, W 1 per rank's share), {found.seconds:.1f} s")
    return schedule_to_csv(found.schedule)


def parse_args(argv: list[str] | None) -> list[Config]:
    """One Config per selected size (``--width/--expansion/--batch`` override the presets)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=[*SIZES, "both"], default="both",
                        help="small: hidden 256 batch 64; large: hidden 1024 batch 256")
    for name in ("width", "expansion", "batch"):
        parser.add_argument(f"--{name}", type=int, help="override the preset")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--traced-steps", type=int, default=10)
    parser.add_argument("--search-seconds", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    labels = [case.label for case in CASES]
    parser.add_argument("--schedules", nargs="+", default=labels, choices=labels)
    args = parser.parse_args(argv)
    configs = []
    for size in SIZES if args.size == "both" else [args.size]:
        shape = {name: getattr(args, name) or value for name, value in SIZES[size].items()}
        label = size if shape == SIZES[size] else f"{size} (custom)"
        configs.append(Config(size=label, ranks=args.ranks, blocks=args.blocks, warmup=args.warmup,
                              microbatches=args.microbatches, steps=args.steps,
                              traced_steps=args.traced_steps, search_seconds=args.search_seconds,
                              seed=args.seed, schedules=tuple(args.schedules), searched="", **shape))
    return configs


def main(argv: list[str] | None = None) -> int:
    """Search the own order if needed, then one spawned run and one table per size."""
    configs = parse_args(argv)
    if any(case.own == SEARCHED and case.label in configs[0].schedules for case in CASES):
        searched = searched_schedule(configs[0])  # once: the problem does not depend on the size
        configs = [replace(config, searched=searched) for config in configs]
    for config in configs:
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(worker, args=(config, free_port(), folder), nprocs=config.ranks, join=True)
            result = json.loads(Path(folder, "result.json").read_text())
        print(table(result))
        # the machine's other work disturbs the medians: say how busy it was
        print(f"1-minute load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
              f"({os.cpu_count()} CPUs)\n")
    print(LEGEND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
