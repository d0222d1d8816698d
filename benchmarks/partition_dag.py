"""DAG partitioner at scale: a 10,000-node layered DAG with branches and skip connections.

Run ``python benchmarks/partition_dag.py`` (``--help`` for nodes, stages, balance, seed, time limit).
For each stage count and balance slack it prints the partitioner's seconds, slowest stage, proven
bound and gap, cut bytes, and the ratios to the greedy baseline (the best contiguous split of a few
topological orders) measured in the same run. Target (issue 5): each partition in <= 10 s on 2 cores.

``--chain-dp`` instead times the planner's chain DP (:class:`pipeloom.plan.partitioning.chain.SplitFront`, split
points in call order, link time in the objective) on chains of 300, 1,000 and 2,000 pieces whose every
third piece sends a large output, and compares it with the whole-front DP where that one runs (issue 17).
"""

from __future__ import annotations

import argparse
import random
import time
from itertools import pairwise

from pipeloom.plan.partitioning.dag import partition_dag
from pipeloom.plan.partitioning.dag_graph import greedy_partition_dag

__all__ = ["chain_dp", "layered_dag", "main"]

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


def chain_dp(sizes: list[int], stages: list[int], *, seed: int = 0, exact_up_to: int = 300) -> None:
    """Print the chain DP's seconds per table (one front, four weights) and, up to ``exact_up_to``
    pieces, the whole-front DP's seconds and the largest relative gap of their objectives."""
    from pipeloom.plan import CostTable, Link, Piece, StageRule
    from pipeloom.plan.partitioning.chain import SplitFront

    rng = random.Random(seed)
    weights = (0.0, 1.0, 7.0, 31.0)
    print(f"chain, every third output 1 MB on a 1 MB/s link, seed {seed}; weights {', '.join(map(str, weights))}")
    print("pieces  stages  method  seconds  exact s  max gap  cuts after a big output")
    for n in sizes:
        pieces = tuple(Piece(name=f"p{k}", f=rng.uniform(0.5, 1.5), i=1.0, w=0.5,
                             output_bytes=1e6 if k % 3 == 2 else 1e3) for k in range(n))
        table = CostTable(pieces=pieces, microbatch_size=1, link=Link(latency=1e-3, bandwidth=1e6))
        for count in stages:
            rules = [StageRule()] * (count - 1) + [StageRule(sends=False)]
            started = time.perf_counter()
            front = SplitFront(table, rules)
            found = {w: front.best(w) for w in weights}
            seconds = time.perf_counter() - started
            exact, gap = "-", "-"
            if n <= exact_up_to:
                started = time.perf_counter()
                whole = SplitFront(table, rules, method="labels")
                gaps = [found[w].objective / whole.best(w).objective - 1 for w in weights]
                exact, gap = f"{time.perf_counter() - started:.2f}", f"{max(gaps):.1e}"
            bad = sum(1 for w in weights for k in range(1, n) if found[w].stage_of[k] != found[w].stage_of[k - 1]
                      and (k - 1) % 3 == 2)
            method = "caps" if front._caps is not None else "labels"
            print(f"{n:6d}  {count:6d}  {method:>6}  {seconds:7.2f}  {exact:>7}  {gap:>7}  {bad}")


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
    parser.add_argument("--chain-dp", action="store_true",
                        help="time the planner's chain DP at 300, 1000 and 2000 pieces instead")
    args = parser.parse_args(argv)
    if args.chain_dp:
        chain_dp([300, 1000, 2000], [4, 16], seed=args.seed)
        return
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
