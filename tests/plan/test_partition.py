"""The split-point DP against brute force.

Oracle: enumerate every choice of S-1 split points among n-1 gaps (n <= 8 pieces, S = 2..4 stages),
keep those whose every stage copy fits its memory limit, and take the least objective
Σ T_j + weight · max T_j computed with the public segment functions. Tables are random (seeded):
chains and DAGs with skip edges, link costs, W-kept activations, one or two copies per stage.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pipeloom.plan import CostTable, Link, MemoryRule, Piece, StageRule
from pipeloom.plan.errors import PartitionError
from pipeloom.plan.partitioning.chain import SplitFront, partition_pieces, partition_pieces_dag, smallest_memory_scale
from pipeloom.plan.partitioning.rules import objective, segment_memory, segment_time


def _random_table(rng: random.Random, n: int, *, chain: bool) -> CostTable:
    pieces = []
    for k in range(n):
        inputs = None
        if not chain and k > 1 and rng.random() < 0.5:
            inputs = (f"p{k - 1}", f"p{rng.randrange(k - 1)}")
        activation = rng.uniform(0, 10)
        pieces.append(Piece(
            name=f"p{k}", f=rng.uniform(0, 3), i=rng.uniform(0, 3), w=rng.uniform(0, 3),
            activation_bytes=activation, w_activation_bytes=activation * rng.random(),
            param_bytes=rng.uniform(0, 5), output_bytes=rng.uniform(0, 4), inputs=inputs,
        ))
    return CostTable(pieces=tuple(pieces), microbatch_size=1, link=Link(latency=0.1, bandwidth=2.0),
                     optimizer_factor=rng.choice([0.0, 2.0]))


def _random_rules(rng: random.Random, count: int) -> list[StageRule]:
    rules = []
    for _ in range(count):
        copies = []
        for _ in range(rng.randint(1, 2)):
            held = rng.randint(0, 4)
            copies.append(MemoryRule(held=held, w_held=held + rng.randint(0, 2),
                                     limit=rng.choice([None, rng.uniform(10, 80)])))
        rules.append(StageRule(sends=rng.random() < 0.8, copies=tuple(copies)))
    return rules


def _splits(n: int, count: int):
    for cuts in itertools.combinations(range(1, n), count - 1):
        yield [0, *cuts, n]


def _fits(table, rules, bounds) -> bool:
    return all(c.limit is None or segment_memory(table, bounds[j], bounds[j + 1], c) <= c.limit * (1 + 1e-9)
               for j, rule in enumerate(rules) for c in rule.copies)


def _times(table, rules, bounds) -> list[float]:
    return [segment_time(table, bounds[j], bounds[j + 1], sends=rules[j].sends) for j in range(len(rules))]


def _brute_force(table, rules, weight) -> float | None:
    values = [objective(_times(table, rules, b), weight) for b in _splits(len(table.pieces), len(rules))
              if _fits(table, rules, b)]
    return min(values, default=None)


def _cases():
    """(seed, n, S) for every n <= 8 and S in 2..4 with S <= n, 12 random tables each."""
    return [(seed, n, count) for n in range(2, 9) for count in range(2, 5) if count <= n for seed in range(12)]


@pytest.mark.parametrize(("seed", "n", "count"), _cases())
def test_dp_equals_brute_force(seed, n, count):
    rng = random.Random(1000 * n + 10 * count + seed)
    table = _random_table(rng, n, chain=seed % 2 == 0)
    rules = _random_rules(rng, count)
    weight = rng.choice([0.0, 1.0, 3.0, 7.5, 63.0])
    expected = _brute_force(table, rules, weight)
    if expected is None:
        with pytest.raises(PartitionError, match="fits the memory limits"):
            partition_pieces(table, rules, weight=weight)
        return
    found = partition_pieces(table, rules, weight=weight)
    assert found.objective == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # the split it names achieves that objective and fits
    bounds = [found.stage_of.index(j) for j in range(count)] + [n]
    assert found.split_points == tuple(table.pieces[a].name for a in bounds[1:-1])
    assert _fits(table, rules, bounds)
    assert objective(_times(table, rules, bounds), weight) == pytest.approx(found.objective)
    assert list(found.stage_times) == pytest.approx(_times(table, rules, bounds))


def test_one_front_serves_every_weight():
    rng = random.Random(7)
    table = _random_table(rng, 8, chain=False)
    rules = _random_rules(rng, 3)
    front = SplitFront(table, rules)
    for weight in (0.0, 0.5, 2.0, 10.0, 1000.0):
        expected = _brute_force(table, rules, weight)
        if expected is None:
            assert not front.feasible
        else:
            assert front.best(weight).objective == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(30))
def test_smallest_memory_scale_equals_brute_force(seed):
    rng = random.Random(seed)
    n, count = rng.randint(3, 8), rng.randint(2, 3)
    table = _random_table(rng, n, chain=True)
    rules = [StageRule(copies=tuple(MemoryRule(held=rng.randint(0, 3), w_held=4, limit=rng.uniform(5, 50))
                                    for _ in range(rng.randint(1, 2)))) for _ in range(count)]
    expected = min(max(segment_memory(table, b[j], b[j + 1], c) / c.limit for j in range(count)
                       for c in rules[j].copies) for b in _splits(n, count))
    scale, starts = smallest_memory_scale(table, rules)
    assert scale == pytest.approx(expected)
    # the limits scaled by it admit the split it names
    bounds = [*starts, n]
    grown = [StageRule(copies=tuple(MemoryRule(held=c.held, w_held=c.w_held, limit=c.limit * scale * (1 + 1e-9))
                                    for c in rule.copies)) for rule in rules]
    assert _fits(table, grown, bounds)
    partition_pieces(table, grown, weight=1.0)  # feasible now


def test_equal_pieces_split_evenly():
    table = CostTable(pieces=tuple(Piece(name=f"layers.{k}", f=1, i=1, w=1) for k in range(12)), microbatch_size=1)
    found = partition_pieces(table, [StageRule()] * 4, weight=7)
    assert found.split_points == ("layers.3", "layers.6", "layers.9")
    assert found.stage_times == (9.0, 9.0, 9.0, 9.0)
    assert found.objective == 36 + 7 * 9


def test_the_link_cost_counts_only_when_the_stage_sends():
    table = CostTable(pieces=tuple(Piece(name=f"p{k}", f=1, i=0, w=0, output_bytes=10) for k in range(4)),
                      microbatch_size=1, link=Link(latency=1.0, bandwidth=10.0))
    assert segment_time(table, 0, 2, sends=True) == 2.0 + 2.0  # two pieces + (1 s latency + 10 B / 10 B/s)
    assert segment_time(table, 0, 2, sends=False) == 2.0
    found = partition_pieces(table, [StageRule(sends=True), StageRule(sends=False)], weight=1)
    assert found.split_points == ("p1",)
    assert found.stage_times == (1.0 + 2.0, 3.0)  # balanced once the first stage pays for its send


def test_dag_crossing_bytes_count_every_value_leaving_the_stage():
    pieces = (Piece(name="a", f=1, i=0, w=0, output_bytes=5), Piece(name="b", f=1, i=0, w=0, output_bytes=7),
              Piece(name="c", f=1, i=0, w=0, inputs=("a", "b")))
    table = CostTable(pieces=pieces, microbatch_size=1, link=Link(bandwidth=1.0))
    assert segment_time(table, 0, 2) == 2 + 12  # a and b both feed c
    assert segment_time(table, 0, 1) == 1 + 5  # a feeds c, past the cut


def test_more_stages_than_pieces_is_refused():
    table = CostTable(pieces=(Piece(name="a", f=1, i=1, w=1), Piece(name="b", f=1, i=1, w=1)), microbatch_size=1)
    with pytest.raises(PartitionError, match="3 stages need at least 3 pieces.*at most 2 stages"):
        partition_pieces(table, [StageRule()] * 3, weight=1)


def test_memory_error_says_how_much_would_fit():
    table = CostTable(pieces=tuple(Piece(name=f"p{k}", f=1, i=1, w=1, activation_bytes=10) for k in range(4)),
                      microbatch_size=1, optimizer_factor=0)
    rules = [StageRule(copies=(MemoryRule(held=1, w_held=1, limit=10.0),))] * 2
    with pytest.raises(PartitionError, match=r"needs 2x the memory \(10 B -> 20 B\)"):
        partition_pieces(table, rules, weight=1)


def test_the_dag_method_matches_the_dp_on_a_small_chain():
    table = CostTable(pieces=tuple(Piece(name=f"p{k}", f=1 + k % 3, i=1, w=1) for k in range(9)), microbatch_size=1)
    rules = [StageRule(sends=False)] * 3
    exact = partition_pieces(table, rules, weight=1)
    found = partition_pieces_dag(table, rules, weight=1, time_limit=5.0)
    assert found.method == "dag" and found.split_points is not None  # a chain partition is contiguous
    assert found.max_stage_time == pytest.approx(exact.max_stage_time)
    assert math.isclose(found.objective, exact.objective)


@pytest.mark.parametrize(("seed", "n", "count"), _cases()[::3])
def test_the_cap_dp_equals_brute_force(seed, n, count):
    rng = random.Random(1000 * n + 10 * count + seed)
    table = _random_table(rng, n, chain=seed % 2 == 0)
    rules = _random_rules(rng, count)
    front = SplitFront(table, rules, method="caps")
    for weight in (0.0, 1.0, 7.5, 63.0):
        expected = _brute_force(table, rules, weight)
        assert front.feasible == (expected is not None)
        if expected is not None:
            assert front.best(weight).objective == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_the_cap_dp_equals_the_whole_front_on_bigger_tables(seed):
    rng = random.Random(seed)
    table = _random_table(rng, rng.randint(30, 60), chain=seed % 2 == 0)
    rules = _random_rules(rng, rng.randint(3, 8))
    caps, labels = SplitFront(table, rules, method="caps"), SplitFront(table, rules, method="labels")
    assert caps.feasible == labels.feasible
    for weight in (0.0, 1.0, 3.0, 63.0) if labels.feasible else ():
        assert caps.best(weight).objective == pytest.approx(labels.best(weight).objective, rel=1e-9)


def _schedule_table(rng: random.Random, n: int) -> CostTable:
    pieces = tuple(Piece(name=f"p{k}", f=rng.uniform(0.5, 2), i=rng.uniform(0.5, 2), w=rng.uniform(0, 1),
                         activation_bytes=rng.uniform(10, 100), w_activation_bytes=rng.uniform(0, 10),
                         param_bytes=rng.uniform(1, 30), output_bytes=rng.uniform(0, 4)) for k in range(n))
    return CostTable(pieces=pieces, microbatch_size=1, link=Link(latency=0.1, bandwidth=2.0))


@pytest.mark.parametrize("seed", range(24))
def test_more_memory_never_fails_and_never_slows_the_best_split(seed):
    """Limits in increasing order: once a split fits it keeps fitting, the least limit is where fitting
    starts, and (one stage per rank, where the DP is exact) the best objective never rises."""
    from pipeloom.plan.errors import MemoryTooSmall
    from pipeloom.plan.partitioning.partitioner import SchedulePartitioner
    from pipeloom.plan.partitioning.shape import library_schedule, rank_objective, schedule_shape

    rng = random.Random(seed)
    table = _schedule_table(rng, rng.randint(8, 12))
    name = ["1f1b", "gpipe", "zbv", "interleaved-1f1b", "dualpipe", "chimera"][seed % 6]
    shape = schedule_shape(library_schedule(table, name, 2, 4, memory_limit=None))
    least = SchedulePartitioner(table).smallest_limit(shape)
    feasible, objectives = [], []
    for limit in sorted(least * rng.uniform(0.8, 1.6) for _ in range(8)) + [least, least * (1 - 1e-6)]:
        try:  # a fresh partitioner per limit, as each plan_pipeline call has
            found = SchedulePartitioner(table).partition(shape, memory_limit=limit)
        except MemoryTooSmall as error:
            assert error.smallest_limit == pytest.approx(least)
            feasible.append((limit, False))
            continue
        feasible.append((limit, True))
        objectives.append((limit, rank_objective(shape, found)))
    for limit, fits in feasible:
        assert fits == (limit >= least), (limit, least)
    if len(set(shape.rank)) == shape.num_stages:
        ordered = [value for _, value in sorted(objectives)]
        assert all(b <= a * (1 + 1e-9) for a, b in zip(ordered, ordered[1:]))


@pytest.mark.parametrize(("name", "seed"), [(name, seed) for name in ("dualpipe", "chimera") for seed in range(4)])
def test_two_replica_splits_are_the_brute_force_best_by_rank_load(name, seed):
    from pipeloom.plan.partitioning.partitioner import SchedulePartitioner
    from pipeloom.plan.partitioning.shape import library_schedule, rank_objective, schedule_shape, stage_rules

    rng = random.Random(seed)
    table = _schedule_table(rng, 10)
    shape = schedule_shape(library_schedule(table, name, 4, 8, memory_limit=None))
    rules = stage_rules(shape, memory_limit=None)
    best = min(rank_objective(shape, _split(table, rules, bounds)) for bounds in _splits(10, shape.num_model_stages))
    found = SchedulePartitioner(table).partition(shape, memory_limit=None)
    assert rank_objective(shape, found) == pytest.approx(best)
    # the DP alone balances stages, not the pair a rank holds: it can be worse
    dp = SchedulePartitioner(table, exhaustive=0).partition(shape, memory_limit=None)
    assert rank_objective(shape, dp) >= rank_objective(shape, found) - 1e-9


def _split(table, rules, bounds):
    from pipeloom.plan.partitioning.rules import split_partition

    return split_partition(table, rules, bounds[:-1], weight=0.0)
