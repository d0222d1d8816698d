"""DAG partitioner at scale: a 10,000-node layered DAG with branches and skip connections.

Run ``python benchmarks/partition_dag.py`` (``--help`` for nodes, stages, balance, seed, time limit).
For each stage count and balance slack it prints the partitioner's seconds, slowest stage, proven
bound and gap, cut bytes, and the ratios to the greedy baseline (the best contiguous split of a few
topological orders) measured in the same run. Target (issue 5): each partition in <= 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import random
from itertools import pairwise

from pipeloom.plan.dag import greedy_partition_dag, partition_dag

__all__ = ["layered_dag", "main"]

COLUMNS = ("nodes", "edges", "stages", "balance", "seconds", "max stage", "bound", "gap", "cut bytes",
           "status", "greedy max", "greedy cut", "max/greedy", "cut/greedy")

Graph = tuple[list[float], list[tuple[int, int]], list[int]]


def layered_dag(nodes: int, *, seed: int = 0, dead_ends: float = 0.0) -> Graph:
    """(times, edges, out_bytes) of a model-like DAG, deterministic in ``seed``.

    Layers of 1-4 parallel nodes (branches); each node consumes 1-2 nodes of the layer before; every
    output is consumed in the next layer (the last layer ends the graph, as a loss does) except a
    ``dead_ends`` share left unconsumed; one node in ten also feeds a node 2-8 layers ahead (skip
    connections). Times are log-normal (median 1), outputs 64 KiB to 16 MiB.
    """
    rng = random.Random(seed)
    layers: list[list[int]] = []
    count = 0
    while count < nodes:
        width = min(rng.choice((1, 1, 2, 3, 4)), nodes - count)
        layers.append(list(range(count, count + width)))
        count += width
    edges = set()
    for before, layer in pairwise(layers):
        consumed = set()
        for v in layer:
            for u in rng.sample(before, k=min(len(before), rng.choice((1, 2)))):
                edges.add((u, v))
                consumed.add(u)
        for u in before:
            if u not in consumed and rng.random() >= dead_ends:
                edges.add((u, rng.choice(layer)))
    for depth, layer in enumerate(layers):
        for u in layer:
            if rng.random() < 0.1 and depth + 2 < len(layers):
                ahead = layers[min(len(layers) - 1, depth + rng.randint(2, 8))]
                edges.add((u, rng.choice(ahead)))
    times = [rng.lognormvariate(0.0, 0.75) for _ in range(nodes)]
    out_bytes = [rng.randint(1 << 16, 1 << 24) for _ in range(nodes)]
    return times, sorted(edges), out_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--stages", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--balance", type=float, nargs="+", default=[0.0, 0.02],
                        help="slack on the slowest stage allowed to cut fewer bytes")
    parser.add_argument("--dead-ends", type=float, default=0.0, help="share of outputs nobody consumes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    times, edges, out_bytes = layered_dag(args.nodes, seed=args.seed, dead_ends=args.dead_ends)
    rows = []
    for stages in args.stages:
        greedy = greedy_partition_dag(times, edges, num_stages=stages, out_bytes=out_bytes)
        for balance in args.balance:
            result = partition_dag(times, edges, num_stages=stages, out_bytes=out_bytes, balance=balance,
                                   time_limit=args.time_limit, workers=args.workers)
            rows.append((len(times), len(edges), stages, f"{balance:g}", f"{result.seconds:.2f}",
                         f"{result.max_stage_time:.2f}", f"{result.bound:.2f}", f"{result.gap:.1e}",
                         f"{result.cut_bytes:.3e}", result.status, f"{greedy.max_stage_time:.2f}",
                         f"{greedy.cut_bytes:.3e}", f"{result.max_stage_time / greedy.max_stage_time:.4f}",
                         f"{result.cut_bytes / greedy.cut_bytes:.3f}" if greedy.cut_bytes else "-"))
    widths = [max(len(c), *(len(str(r[i])) for r in rows)) for i, c in enumerate(COLUMNS)]
    print(f"layered DAG, seed {args.seed}, dead ends {args.dead_ends:g}; time limit {args.time_limit:g} s, "
          f"{args.workers} workers")
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths)))
    for row in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))


if __name__ == "__main__":
    main()
