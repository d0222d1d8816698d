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
- **Under a simulated link** (``--link-latency``/``--link-bandwidth``, :class:`pipeloom.runtime.SimulatedLink`:
  each expert all-to-all completes ``latency + bytes / bandwidth`` after it was issued, its wait sleeping, so the
  other part of a pair has idle time to fill): dualpipev on (pp 2, ep 2), overlap **off** and **on**, paired rounds
  as above; and the simulator's prediction for the same costs, measured on the same ranks in the same run: zbv (the
  same four stages, split backward, no pairs) traced with and without the link gives each stage's F, I (input
  gradient) and W; the link's share of F and of I (``f_comm``, ``b_comm``: the traced time with the link less the
  time without) is the communication a pair may hide (a stage whose input needs no gradient runs its backward
  all-to-alls in W, which a :class:`pipeloom.stages.Stage` cannot price: reported, not credited). dualpipev's
  schedule priced with those stages is simulated with the pairs at F + B less the hidden communication
  (:func:`pipeloom.ir.pair_duration`) and at F + B; the predicted on/off is the ratio of the two makespans.
  ``--link-only`` runs this part alone.
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

from pipeloom.runtime import Failures, Parallelism, SimulatedLink, Tracing

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
            elapsed = _timed_step(engines[dim], x, y)
            if round_ >= options["warmup"]:
                times[dim].append(elapsed)
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


# ------------------------------------------------------------------------------------- under a simulated link


def _link_engine(options: dict, schedule: str, link: SimulatedLink | None, *, overlap: bool, record: bool,
                 x: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    layers = options["layers"]
    return pipeline(
        build(options),
        schedule=schedule,
        microbatches=options["microbatches"],
        split_points=[f"model.layers.{c}" for c in (layers // 4, layers // 2, 3 * layers // 4)],
        loss_fn=loss_fn,
        record=record or None,
        tracing=Tracing(tracer="export", example_inputs=(x[:2],)),
        parallel=Parallelism(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep")),
                             overlap_pairs=overlap, simulated_link=link),
        failures=Failures(timeout=300),
    )


def _timed_step(engine, x: torch.Tensor, y: torch.Tensor) -> float:
    for p in engine.parameters():
        p.grad = None
    dist.barrier()
    start = time.perf_counter()
    engine.step(x, target=y)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def link_worker(rank: int, options: dict, port: int, folder: str) -> None:
    """Rounds of dualpipev overlap off / on under the link (who goes first alternating), each round also one traced
    zbv step with and without the link; every rank's zbv traces gathered to rank 0."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(1, 256, (options["batch"], options["seq"]), generator=generator)
    y = torch.randint(0, 256, (options["batch"], options["seq"]), generator=generator)
    link = SimulatedLink(latency=options["link_latency"], bandwidth=options["link_bandwidth"])
    engines = {"off": _link_engine(options, "dualpipev", link, overlap=False, record=False, x=x),
               "on": _link_engine(options, "dualpipev", link, overlap=True, record=False, x=x),
               "zbv-link": _link_engine(options, "zbv", link, overlap=False, record=True, x=x),
               "zbv-plain": _link_engine(options, "zbv", None, overlap=False, record=True, x=x)}
    times: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(options["warmup"] + options["steps"]):
        for name in (list(engines) if round_ % 2 == 0 else ["on", "off", "zbv-plain", "zbv-link"]):
            elapsed = _timed_step(engines[name], x, y)
            if round_ >= options["warmup"] and name in times:
                times[name].append(elapsed)
    traces = {}
    for name in ("zbv-link", "zbv-plain"):
        documents: list = [None] * WORLD
        dist.all_gather_object(documents, engines[name].trace_document())
        traces[name] = documents
    if rank == 0:
        Path(folder, "result.json").write_text(json.dumps({"times": times, "traces": traces}))
    for engine in engines.values():
        engine.close()
    dist.destroy_process_group()


def _stage_costs(documents: list, warmup: int) -> tuple[dict[tuple[int, str], float], float]:
    """Median traced seconds of each (stage, kind) of zbv, each action less its own sends and receive posts,
    and the fitted stage-to-stage latency, averaged over both pipelines (ep index 0: global ranks 0, 2; 1: ranks
    1, 3; the mesh is (pp 2, ep 2)); micro-batches and the steps after ``warmup``."""
    from pipeloom.trace.analysis import comm_latency_estimate, task_durations
    from pipeloom.trace.reader import run_trace_from_documents

    found: dict[tuple[int, str], list[float]] = {}
    latencies = []
    for ep_index in (0, 1):
        run = run_trace_from_documents([documents[ep_index], documents[2 + ep_index]])
        steps = list(run.steps[warmup:])
        for key, seconds in task_durations(run, steps=steps, messages=False).items():
            found.setdefault(key, []).append(seconds)
        latencies.append(comm_latency_estimate(run, steps=steps))
    return {key: statistics.fmean(values) for key, values in found.items()}, statistics.fmean(latencies)


def predict(result: dict, options: dict) -> dict:
    """The simulator's dualpipev makespans for the measured stage costs: pairs at F + B less the hidden
    communication, and at F + B (module doc)."""
    import dataclasses

    from pipeloom.schedules import build_schedule
    from pipeloom.sim import simulate
    from pipeloom.stages import Stage, stage_graph
    from pipeloom.validate import validate

    slow, latency = _stage_costs(result["traces"]["zbv-link"], options["warmup"])
    plain, _ = _stage_costs(result["traces"]["zbv-plain"], options["warmup"])
    base = build_schedule("dualpipev", 2, options["microbatches"])
    rank_of = {task.stage: task.ranks for task in base.problem.tasks}
    stages = []
    for s in range(4):
        f, b, w = slow[(s, "F")], slow[(s, "I")], slow[(s, "W")]
        stages.append(Stage(ranks=rank_of[s], f=f, b=b, w=w, f_comm=min(f, max(0.0, f - plain[(s, "F")])),
                            b_comm=min(b, max(0.0, b - plain[(s, "I")]))))
    makespans = {}
    for name, priced in (("hidden", stages), ("plain", [dataclasses.replace(st, f_comm=0.0, b_comm=0.0)
                                                        for st in stages])):
        problem = stage_graph(priced, num_ranks=2, backward="split", comm_latency=latency,
                              memory_limit=base.problem.memory_limit)
        schedule = dataclasses.replace(base, problem=problem)
        validate(schedule)
        makespans[name] = simulate(schedule).makespan
    w_comm = [max(0.0, slow[(s, "W")] - plain[(s, "W")]) for s in range(4)]  # no Stage field: reported only
    return {"stages": [dataclasses.asdict(st) for st in stages], "makespans": makespans, "latency": latency,
            "w_comm": w_comm}


def link_report(result: dict, options: dict, load: tuple[float, float]) -> str:
    predicted = predict(result, options)
    lines = [f"Under a simulated link: latency {options['link_latency'] * 1e3:g} ms, bandwidth "
             f"{options['link_bandwidth']:g} B/s per all-to-all; dualpipev, (pp 2, ep 2), {options['microbatches']} "
             f"micro-batches; stage-to-stage latency fitted {predicted['latency'] * 1e3:.2f} ms; load average "
             f"{load[0]:.1f} -> {load[1]:.1f}", "",
             "| stage | F (ms) | I (ms) | W (ms) | f_comm (ms) | b_comm (ms) | W's link share (ms, not priced) |",
             "|---|---|---|---|---|---|---|"]
    for s, st in enumerate(predicted["stages"]):
        lines.append(f"| {s} | {st['f'] * 1e3:.1f} | {st['b'] * 1e3:.1f} | {st['w'] * 1e3:.1f} | "
                     f"{st['f_comm'] * 1e3:.1f} | {st['b_comm'] * 1e3:.1f} | {predicted['w_comm'][s] * 1e3:.1f} |")
    off, on = result["times"]["off"], result["times"]["on"]
    ratios = sorted(a / b for a, b in zip(on, off))
    decile = (ratios[int(0.1 * (len(ratios) - 1))], ratios[int(0.9 * (len(ratios) - 1))])
    hidden, plain = predicted["makespans"]["hidden"], predicted["makespans"]["plain"]
    lines += ["", "| | overlap off (ms) | overlap on (ms) | on / off |", "|---|---|---|---|",
              f"| measured (median step; paired ratio, 10-90 % {decile[0]:.3f}-{decile[1]:.3f}, {len(ratios)} rounds) "
              f"| {statistics.median(off) * 1e3:.1f} | {statistics.median(on) * 1e3:.1f} | "
              f"{statistics.median(ratios):.3f} |",
              f"| simulated makespan (pairs F + B; F + B less the hidden communication) | {plain * 1e3:.1f} | "
              f"{hidden * 1e3:.1f} | {hidden / plain:.3f} |"]
    share = {key: sum(st[key] for st in predicted["stages"]) / 2 * 1e3 for key in ("f", "b", "w", "f_comm", "b_comm")}
    lines += ["", "The same with every rank's share priced alike (the mean of the two ranks' stages, ms):",
              f"pipeloom compare dualpipev -p 2 -m {options['microbatches']} --f {share['f']:.1f} --b {share['b']:.1f} "
              f"--w {share['w']:.1f} --comm {predicted['latency'] * 1e3:.2f} --f-comm {share['f_comm']:.1f} "
              f"--b-comm {share['b_comm']:.1f}"]
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller, shorter run")
    parser.add_argument("--link-latency", type=float, default=0.004,
                        help="the simulated link's latency per all-to-all, seconds (default 0.004)")
    parser.add_argument("--link-bandwidth", type=float, default=2e7,
                        help="the simulated link's bandwidth, bytes per second (default 2e7)")
    parser.add_argument("--link-only", action="store_true", help="run only the part under the simulated link")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default: the preset's)")
    args = parser.parse_args(argv)
    options = {**PRESETS["quick" if args.quick else "full"], "link_latency": args.link_latency,
               "link_bandwidth": args.link_bandwidth}
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps {args.steps}: at least 1 round")
        options["steps"] = args.steps
    parts = [(link_worker, link_report)] if args.link_only else [(worker, report), (link_worker, link_report)]
    for run, describe in parts:
        before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(run, args=(options, free_port(), folder), nprocs=WORLD, join=True)
            result = json.loads(Path(folder, "result.json").read_text())
        print(describe(result, options, (before, os.getloadavg()[0])), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
