"""Peak memory per rank of one training step: one process, pipeloom (whole model or meta-built), torch.

Run ``python benchmarks/memory.py`` (``--help`` for sizes). The model is a chain of ``--layers`` blocks
``Linear(width, width) + ReLU`` (by default 16 x 4096 x 4096: 268M parameters, 1.07 GB of float32), cut
in the middle for 2 pipeline ranks. One step is: ``--microbatches`` micro-batches of ``--rows`` rows,
forward and backward of each with MSE loss / M, then ``torch.optim.SGD`` (no momentum, so no optimizer
state). The configurations, each in fresh processes (this script re-run with ``--role``; gloo on CPU,
``torch.set_num_threads(1)``), so that one's peak never counts in another's:

- ``single``: one process holds the whole model and trains the step (the baseline);
- ``pipeloom-whole``: 2 ranks, each builds the whole model on CPU and runs ``pipeline(model, ...)``;
- ``pipeloom-meta``: 2 ranks, each builds the model on the meta device and runs ``pipeline(model, ...,
  init_weights=...)``, which allocates and initialises only this rank's pieces;
- ``torch-pipelining``: 2 ranks of ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``),
  each allocating only its own half (meta, ``to_empty``, init).

Measured: ``VmHWM`` (peak resident set) from ``/proc/self/status``, after building the model and engine
("setup") and after the step and the optimizer step ("peak"); MB = 10**6 bytes. With the weights, their
gradients and one process's fixed cost (Python, torch, gloo), a rank holding half the model should peak
at about half of ``single`` plus that fixed cost: the target is the worst rank <= 0.6 x single. Every
layer is initialised from its own seed, so all configurations train the same weights and their losses
must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

__all__ = ["main"]

LR = 0.01  # SGD learning rate
SEED = 0  # layer i is initialised from seed SEED + i; the data from SEED - 1
TARGET = 0.6  # a 2-rank configuration's worst rank peak / single's peak


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Sizes of the model and the step."""

    layers: int  # Linear + ReLU blocks
    width: int  # features in and out of every Linear
    rows: int  # rows of the step's batch
    microbatches: int  # M: the batch is cut into M equal micro-batches
    timeout: float  # seconds a configuration's processes may run before they are killed

    @property
    def split_point(self) -> str:
        """Where the second rank's stage starts (the blocks' names in the nn.Sequential are "0", "1", ...)."""
        return str(self.layers // 2)

    def size_args(self) -> list[str]:
        return ["--layers", str(self.layers), "--width", str(self.width), "--rows", str(self.rows),
                "--microbatches", str(self.microbatches), "--timeout", str(self.timeout)]


def build_model(config: Config, device: str) -> nn.Sequential:
    """The model on ``device`` ("cpu": initialised, each layer from its own seed; "meta": shapes only)."""
    blocks = []
    with torch.device(device):
        for i in range(config.layers):
            torch.manual_seed(SEED + i)
            blocks.append(nn.Sequential(nn.Linear(config.width, config.width), nn.ReLU()))
    return nn.Sequential(*blocks)


def seeded_init(model: nn.Sequential) -> Callable[[nn.Module], None]:
    """A function that re-initialises one module of ``model`` as ``build_model`` on "cpu" did."""
    seed_of = {id(block[0]): SEED + i for i, block in enumerate(model)}

    def init(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if reset is not None:
            torch.manual_seed(seed_of[id(module)])
            reset()

    return init


def batch(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's input and MSE target, the same in every process."""
    generator = torch.Generator().manual_seed(SEED - 1)
    x = torch.randn(config.rows, config.width, generator=generator)
    return x, torch.randn(config.rows, config.width, generator=generator)


def peak_mb() -> float:
    """This process's peak resident set so far (VmHWM), in MB (10**6 bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_single(config: Config) -> dict:
    """The baseline: the whole model, every micro-batch forward and backward (loss / M), then SGD."""
    model = build_model(config, "cpu")
    setup = peak_mb()
    x, y = batch(config)
    total = 0.0
    for xm, ym in zip(x.chunk(config.microbatches), y.chunk(config.microbatches)):
        loss = functional.mse_loss(model(xm), ym) / config.microbatches
        loss.backward()
        total += float(loss.detach())
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {"setup_mb": setup, "loss": total}


def run_pipeloom(config: Config, meta: bool) -> dict:
    """pipeloom's 1F1B on this rank, the model built on CPU (whole) or on the meta device."""
    from pipeloom.runtime import Weights, pipeline

    model = build_model(config, "meta" if meta else "cpu")
    engine = pipeline(model, schedule="1f1b", split_points=[config.split_point], loss_fn=functional.mse_loss,
                      microbatches=config.microbatches,
                      weights=Weights(init_weights=seeded_init(model) if meta else None))
    setup = peak_mb()
    x, y = batch(config)
    loss = engine.step(x, target=y)
    torch.optim.SGD(engine.parameters(), lr=LR).step()
    engine.close()
    return {"setup_mb": setup, "loss": float(loss.detach())}


def run_torch(config: Config, rank: int) -> dict:
    """torch.distributed.pipelining's Schedule1F1B, this rank's half allocated from the meta model."""
    from torch.distributed import pipelining

    model = build_model(config, "meta")
    half = config.layers // 2
    part = (model[:half] if rank == 0 else model[half:]).to_empty(device="cpu")
    part.apply(seeded_init(model))
    stage = pipelining.PipelineStage(part, rank, 2, torch.device("cpu"))
    # torch computes loss_fn per micro-batch unscaled and divides the gradients by M (scale_grads=True),
    # the same gradients as the baseline's loss / M
    schedule = pipelining.Schedule1F1B(stage, config.microbatches, loss_fn=functional.mse_loss,
                                       scale_grads=True)
    setup = peak_mb()
    x, y = batch(config)
    losses: list[torch.Tensor] = []
    schedule.step(x, target=y, losses=losses)
    torch.optim.SGD(part.parameters(), lr=LR).step()
    loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
    dist.all_reduce(loss)  # only the last stage's rank has the losses
    return {"setup_mb": setup, "loss": float(loss)}


ROLES: dict[str, tuple[int, Callable[[Config, int], dict]]] = {  # name: (ranks, run on one rank)
    "single": (1, lambda config, rank: run_single(config)),
    "pipeloom-whole": (2, lambda config, rank: run_pipeloom(config, meta=False)),
    "pipeloom-meta": (2, lambda config, rank: run_pipeloom(config, meta=True)),
    "torch-pipelining": (2, run_torch),
}


def role(config: Config, name: str, rank: int) -> None:
    """One rank of configuration ``name``: run it and print its result as one JSON line."""
    torch.set_num_threads(1)
    ranks, run = ROLES[name]
    if ranks > 1:  # MASTER_ADDR and MASTER_PORT come from the launching process
        dist.init_process_group("gloo", rank=rank, world_size=ranks,
                                timeout=timedelta(seconds=config.timeout))
    try:
        result = run(config, rank)
    finally:
        if ranks > 1:
            dist.destroy_process_group()
    print(json.dumps({**result, "rank": rank, "peak_mb": peak_mb()}), flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config: Config, name: str) -> tuple[list[dict] | str, float]:
    """Run configuration ``name`` in fresh processes: (their results by rank, or why not; seconds)."""
    ranks = ROLES[name][0]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        logs = [Path(folder, f"rank{r}.{stream}") for r in range(ranks) for stream in ("out", "err")]
        procs = []
        try:
            for r in range(ranks):
                with open(logs[2 * r], "w") as out, open(logs[2 * r + 1], "w") as err:
                    procs.append(subprocess.Popen(
                        [sys.executable, __file__, *config.size_args(), "--role", name, "--rank", str(r)],
                        env=env, stdout=out, stderr=err))
            deadline = start + config.timeout
            while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
                   and not any(p.returncode for p in procs)):  # a failed rank: the others would only wait
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        seconds = time.monotonic() - start
        failed = [r for r, p in enumerate(procs) if p.returncode]
        if failed:
            r = failed[0]
            error = logs[2 * r + 1].read_text().strip().splitlines() or ["no message"]
            why = "timed out (killed)" if procs[r].returncode < 0 else error[-1]
            return f"rank {r} failed: {why}", seconds
        return [json.loads(log.read_text().splitlines()[-1]) for log in logs[::2]], seconds


def report(results: dict[str, tuple[list[dict] | str, float]]) -> str:
    """The table (one row per configuration and rank), then one verdict per 2-rank configuration."""
    single = results.get("single", ("not run", 0.0))[0]
    base = single[0]["peak_mb"] if isinstance(single, list) else None
    lines = [f"{'configuration':<17} {'rank':>4} {'setup MB':>9} {'peak MB':>9} {'peak/single':>11} "
             f"{'loss':>12} {'wall s':>7}"]
    verdicts = []
    for name, (rows, seconds) in results.items():
        if isinstance(rows, str):
            lines.append(f"{name:<17} {'-':>4} {rows}")
            continue
        for row in rows:
            ratio = f"{row['peak_mb'] / base:.3f}" if base else "-"
            lines.append(f"{name:<17} {row['rank']:>4} {row['setup_mb']:>9.0f} {row['peak_mb']:>9.0f} "
                         f"{ratio:>11} {row['loss']:>12.6g} {seconds:>7.1f}")
        if len(rows) > 1 and base:
            worst = max(row["peak_mb"] for row in rows) / base
            verdicts.append(f"{name}: worst rank {worst:.3f} x single -> "
                            f"{'meets' if worst <= TARGET else 'misses'} the target <= {TARGET}")
    lines += verdicts
    lines.append("setup = VmHWM after building the model (and pipeline), peak = VmHWM after the step and "
                 "SGD; MB = 10**6 bytes; wall s = the configuration's processes, start to end")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="Linear + ReLU blocks (default 16)")
    parser.add_argument("--width", type=int, default=4096, help="features of every Linear (default 4096)")
    parser.add_argument("--rows", type=int, default=64, help="rows of the step's batch (default 64)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a configuration may run before its processes are killed (default 300)")
    parser.add_argument("--only", action="append", choices=list(ROLES), metavar="NAME",
                        help=f"run only this configuration (repeatable; one of {', '.join(ROLES)})")
    parser.add_argument("--role", choices=list(ROLES), help=argparse.SUPPRESS)  # one rank of a configuration
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layers < 2 or args.rows % args.microbatches:
        parser.error("need --layers >= 2 and --rows divisible by --microbatches")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = Config(layers=args.layers, width=args.width, rows=args.rows, microbatches=args.microbatches,
                    timeout=args.timeout)
    if args.role is not None:
        role(config, args.role, args.rank)
        return 0
    params = config.layers * (config.width * config.width + config.width)
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"model: {config.layers} x (Linear({config.width}, {config.width}) + ReLU) = {params:,} "
          f"parameters, {params * 4 / 1e6:,.1f} MB float32; batch {config.rows} x {config.width} in "
          f"{config.microbatches} micro-batches; 2-rank split at {config.split_point!r}; SGD lr={LR}; "
          "gloo on CPU, 1 thread per process")
    results = {name: launch(config, name) for name in ROLES if not args.only or name in args.only}
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
