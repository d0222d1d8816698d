"""Expert parallelism on 4 gloo CPU ranks: a ``transformers`` Qwen3-MoE on (pp 2, ep 2) against the same model on
(pp 2, dp 2) — the same replicas and global batch, every expert on every replica (ep 1) — side by side: memory per
rank and step time; and DualPipeV on (pp 2, ep 2) with its overlapped pairs run part after part and interleaved at
their all-to-alls (``overlap_pairs``).

Run ``cd benchmarks && python expert_parallel.py`` (``--quick`` for a smaller, shorter run; ``--help``). It spawns 4
processes (gloo, one thread each) that build the same random-init Qwen3-MoE (``--experts`` experts of width
``--moe-width`` per layer, 2 per token, eager attention) from one seed and cut it at ``model.layers.{L/2}``.

- **Memory per rank**: bytes of the parameters this rank holds (an expert DTensor counts its local shard) and of
  their gradients after one step, and what Adam's two moments would add (2x the parameters): exact byte counts of
  the tensors, not the process's resident size (which torch's own allocations dominate at this size).
- **Step time**: ``--warmup`` then ``--steps`` rounds of one step of each engine (1f1b, ``--microbatches``), who
  goes first alternating; a step's time is the slowest rank's wall time (ranks start together after a barrier).
  The ratio is the median over rounds of ep's time / dp's time in the same round (paired: the machine's drifting
  load cancels), its spread the 10th-90th percentile. Engines: **ep** and **dp** (1f1b, cut in 2), **off** and **on**
  (dualpipev on (pp 2, ep 2), cut in 4, ``overlap_pairs`` False / True); ratios ep/dp and on/off. On gloo CPU
  ranks the all-to-alls are memory copies through loopback TCP; a GPU cluster's cost differs — the ratios say
  what ep and the overlap do here, not there.
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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional

from pipeloom.runtime import Failures, Parallelism, Tracing

__all__ = ["main"]

WORLD = 4
PRESETS = {
    "full": {"experts": 16, "moe_width": 128, "hidden": 128, "layers": 4, "batch": 16, "seq": 32,
             "microbatches": 4, "warmup": 2, "steps": 10},
    "quick": {"experts": 8, "moe_width": 64, "hidden": 64, "layers": 4, "batch": 8, "seq": 16,
              "microbatches": 4, "warmup": 1, "steps": 4},
}


def build(options: dict):
    import transformers as T

    torch.manual_seed(0)
    config = T.Qwen3MoeConfig(vocab_size=256, num_hidden_layers=options["layers"], hidden_size=options["hidden"],
                              intermediate_size=2 * options["hidden"], moe_intermediate_size=options["moe_width"],
                              num_experts=options["experts"], num_experts_per_tok=2, num_attention_heads=4,
                              num_key_value_heads=2, use_cache=False, attn_implementation="eager")
    model = T.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    return model


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def _bytes(engine) -> dict:
    from pipeloom.runtime.parallel.tp import local_of

    params = sum(local_of(p).numel() * p.element_size() for p in engine.parameters())
    grads = sum(local_of(p.grad).numel() * p.element_size() for p in engine.parameters() if p.grad is not None)
    return {"params": params, "grads": grads, "adam": 2 * params}


def worker(rank: int, options: dict, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    generator = torch.Generator().manual_seed(1)
    x = torch.randint(1, 256, (options["batch"], options["seq"]), generator=generator)
    y = torch.randint(0, 256, (options["batch"], options["seq"]), generator=generator)
    engines = {}
    layers = options["layers"]
    for name, dim, schedule, cuts in (("ep", "ep", "1f1b", [layers // 2]), ("dp", "dp", "1f1b", [layers // 2]),
                                      ("off", "ep", "dualpipev", [layers // 4, layers // 2, 3 * layers // 4]),
                                      ("on", "ep", "dualpipev", [layers // 4, layers // 2, 3 * layers // 4])):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", dim))
        engines[name] = pipeline(
            build(options),
            schedule=schedule,
            microbatches=options["microbatches"],
            split_points=[f"model.layers.{c}" for c in cuts],
            loss_fn=loss_fn,
            tracing=Tracing(tracer="export", example_inputs=(x[:2],)),
            parallel=Parallelism(mesh=mesh, overlap_pairs=name == "on"),
            failures=Failures(timeout=300),
        )
    times: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(options["warmup"] + options["steps"]):
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for dim in order:
            engine = engines[dim]
            for p in engine.parameters():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            engine.step(x, target=y)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_ >= options["warmup"]:
                times[dim].append(float(elapsed))
    memory = {dim: _bytes(engines[dim]) for dim in ("ep", "dp")}
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, memory)
    if rank == 0:
        Path(folder, "result.json").write_text(json.dumps({"memory": everyone, "times": times}))
    for engine in engines.values():
        engine.close()
    dist.destroy_process_group()


def report(result: dict, options: dict, load: tuple[float, float]) -> str:
    lines = [f"Qwen3-MoE, {options['layers']} layers, {options['experts']} experts of width {options['moe_width']}, "
             f"hidden {options['hidden']}; 4 gloo ranks, (pp 2, ep 2) vs (pp 2, dp 2); load average "
             f"{load[0]:.1f} -> {load[1]:.1f} on this machine", "",
             "| rank | params ep 1 (B) | params ep 2 (B) | ratio | grads ep 1 | grads ep 2 | + Adam ep 1 "
             "| + Adam ep 2 |",
             "|---|---|---|---|---|---|---|---|"]
    for rank, memory in enumerate(result["memory"]):
        dp, ep = memory["dp"], memory["ep"]
        lines.append(f"| {rank} | {dp['params']} | {ep['params']} | {ep['params'] / dp['params']:.3f} | "
                     f"{dp['grads']} | {ep['grads']} | {dp['params'] + dp['grads'] + dp['adam']} | "
                     f"{ep['params'] + ep['grads'] + ep['adam']} |")
    lines += ["", "| engine | median step (ms) |", "|---|---|"]
    names = {"ep": "1f1b, pp 2 x ep 2", "dp": "1f1b, pp 2 x dp 2 (ep 1)", "off": "dualpipev, pp 2 x ep 2, overlap off",
             "on": "dualpipev, pp 2 x ep 2, overlap on"}
    lines += [f"| {names[k]} | {statistics.median(v) * 1e3:.1f} |" for k, v in result["times"].items()]
    lines += ["", "| paired ratio | median | 10-90 % | rounds |", "|---|---|---|---|"]
    for top, bottom in (("ep", "dp"), ("on", "off")):
        ratios = sorted(a / b for a, b in zip(result["times"][top], result["times"][bottom]))
        decile = (ratios[int(0.1 * (len(ratios) - 1))], ratios[int(0.9 * (len(ratios) - 1))])
        lines.append(f"| {top} / {bottom} | {statistics.median(ratios):.3f} | {decile[0]:.3f}-{decile[1]:.3f} | "
                     f"{len(ratios)} |")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller, shorter run")
    args = parser.parse_args(argv)
    options = PRESETS["quick" if args.quick else "full"]
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(options, free_port(), folder), nprocs=WORLD, join=True)
        result = json.loads(Path(folder, "result.json").read_text())
    print(report(result, options, (before, os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
