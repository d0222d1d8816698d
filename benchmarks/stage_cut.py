"""The cluster planner's balanced stage cut (``pipeloom.plan.cluster.placement.balanced_counts``) against every
cut of small random models: how often its busiest pipeline rank is the least busy any cut gives, and by how much
it misses otherwise, per placement (one stage per rank, looped stages, a V).

    python benchmarks/stage_cut.py [--cases 400] [--seed 1]

Each case: 2-4 pipeline ranks, as many layers as stages up to 8 more, an embedding of 0-0.3 and a head of
0.3-3 layers' work; half the cases of one kind of layer, the other half DeepSeek's shape (1 or 3 dense
layers of work 1, then MoE layers of work 1-3). Prints the counts and checks that no cut is busier than the
even one and that one kind of layer, and one stage per rank, always get the optimum; "least busy stage" counts
the cases whose busiest stage is the least busy of any cut with the same ranks' loads (the tie the ranks'
loads leave open under looped and V stages).
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Iterator, Sequence

from pipeloom.plan.cluster.placement import balanced_counts, even_counts

PLACEMENTS = ("linear", "looped", "v")


def placement_ranks(placement: str, pp: int, vp: int = 2) -> list[list[int]]:
    """Each pipeline rank's stages: one stage per rank, ``vp`` looped stages, or two in a V."""
    if placement == "linear":
        return [[r] for r in range(pp)]
    if placement == "looped":
        return [list(range(r, pp * vp, pp)) for r in range(pp)]
    return [[r, 2 * pp - 1 - r] for r in range(pp)]


def rank_loads(kinds: Sequence[str], counts: Sequence[int], ranks: Sequence[Sequence[int]], work: dict[str, float],
               first: float, last: float) -> list[float]:
    """Each rank's work under the cut ``counts`` (the embedding on the first stage, the head on the last)."""
    stage, start = [], 0
    for j, count in enumerate(counts):
        extra = (first if j == 0 else 0.0) + (last if j == len(counts) - 1 else 0.0)
        stage.append(extra + sum(work[k] for k in kinds[start:start + count]))
        start += count
    return [sum(stage[j] for j in held) for held in ranks]


def every_cut(layers: int, stages: int) -> Iterator[tuple[int, ...]]:
    """Every cut of ``layers`` layers into ``stages`` stages of at least one layer."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def random_case(rng: random.Random, placement: str, mixed: bool):
    """``(kinds, ranks, work, first, last)`` of one small random model."""
    ranks = placement_ranks(placement, rng.choice([2, 3, 4]))
    stages = sum(map(len, ranks))
    layers = rng.randint(stages, stages + 8)
    dense = rng.choice([1, 3]) if mixed else layers
    kinds = ["dense"] * dense + ["moe"] * (layers - dense)
    work = {"dense": 1.0, "moe": rng.uniform(1.0, 3.0)}
    return kinds, ranks, work, rng.uniform(0.0, 0.3), rng.uniform(0.3, 3.0)


def check(kinds, ranks, work, first, last) -> tuple[float, float, float]:
    """The busiest rank's load under the balanced cut, the even cut and the best cut."""
    return checks(kinds, ranks, work, first, last)[:3]


def checks(kinds, ranks, work, first, last) -> tuple[float, float, float, bool]:
    """:func:`check`'s three loads, and whether the balanced cut's busiest stage is the least busy of any cut
    whose ranks' loads are the balanced cut's (each stage's load: :func:`rank_loads` with one stage per rank)."""
    stages = sum(map(len, ranks))
    counts = balanced_counts(kinds, ranks, work, first=first, last=last)
    loads = rank_loads(kinds, counts, ranks, work, first, last)
    even = max(rank_loads(kinds, even_counts(len(kinds), stages), ranks, work, first, last))
    alone = [[j] for j in range(stages)]
    best, least = float("inf"), float("inf")
    for cut in every_cut(len(kinds), stages):
        cut_loads = rank_loads(kinds, cut, ranks, work, first, last)
        best = min(best, max(cut_loads))
        if all(abs(a - b) <= 1e-9 for a, b in zip(sorted(cut_loads), sorted(loads))):
            least = min(least, max(rank_loads(kinds, cut, alone, work, first, last)))
    peak = max(rank_loads(kinds, counts, alone, work, first, last))
    return max(loads), even, best, peak <= least + 1e-9


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    print("| placement | layers | cases | optimal | worst gap | mean gap where missed | least busy stage |")
    print("|---|---|---|---|---|---|---|")
    for placement, mixed in itertools.product(PLACEMENTS, (False, True)):
        gaps, peaks = [], 0
        for _ in range(args.cases // (2 * len(PLACEMENTS))):
            balanced, even, best, least = checks(*random_case(rng, placement, mixed))
            assert balanced <= even + 1e-12, "busier than the even cut"
            assert (mixed and placement != "linear") or balanced <= best + 1e-9, "not optimal where exact"
            assert mixed or least, "a one-kind rank's layers not spread to its least busy busiest stage"
            gaps.append(balanced / best - 1)
            peaks += least
        missed = [g for g in gaps if g > 1e-9]
        mean = f"{100 * sum(missed) / len(missed):.1f} %" if missed else "-"
        print(f"| {placement} | {'dense then MoE' if mixed else 'one kind'} | {len(gaps)} | "
              f"{len(gaps) - len(missed)} | {100 * max(gaps):.1f} % | {mean} | {peaks} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
