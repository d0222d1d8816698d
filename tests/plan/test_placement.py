"""Stage rules read off schedules, and partitions per placement style.

Oracles: the closed forms of docs/design.md §6 (1F1B holds p - r micro-batches on rank r, GPipe holds M),
the V placement (rank r holds stages r and 2p-1-r), and the simulator's per-rank peak, which the
rules' byte count must bound.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom import build_schedule, simulate
from pipeloom.plan import CostTable, Link, Piece, partition
from pipeloom.plan.errors import MemoryTooSmall, PartitionError
from pipeloom.plan.partitioning.partitioner import SchedulePartitioner
from pipeloom.plan.partitioning.shape import (
    in_flight,
    library_schedule,
    rank_memory,
    schedule_shape,
    stage_rules,
    visits_per_rank,
)
from pipeloom.plan.recost import recost


def _table(n: int = 16, **overrides) -> CostTable:
    pieces = tuple(Piece(name=f"layers.{k}", f=1.0 + (k % 3) / 4, i=1.0, w=0.5, activation_bytes=100.0,
                         w_activation_bytes=30.0, param_bytes=10.0, output_bytes=8.0) for k in range(n))
    return CostTable(pieces=pieces, microbatch_size=1, **overrides)


def test_in_flight_matches_the_closed_forms():
    p, m = 4, 8
    assert [held for held, _ in in_flight(build_schedule("1f1b", p, m))] == [4, 3, 2, 1]
    assert in_flight(build_schedule("gpipe", p, m)) == ((8, 8),) * 4
    # zero-bubble: I frees what W does not keep; W's deferred by ZB-H1 keep their part longer
    held = in_flight(build_schedule("zb-h1", p, m))
    assert [h for h, _ in held] == [4, 3, 2, 1] and all(w >= h for h, w in held)


def test_shapes_of_the_placements():
    p = 4
    linear = schedule_shape(build_schedule("1f1b", p, 8))
    assert linear.rank == (0, 1, 2, 3) and linear.model_stage == (0, 1, 2, 3) and linear.replicas == 1
    v = schedule_shape(build_schedule("zbv", p, 8))
    assert v.rank == (0, 1, 2, 3, 3, 2, 1, 0) and v.num_model_stages == 8
    looped = schedule_shape(build_schedule("interleaved-1f1b", p, 8, stages_per_rank=2))
    assert looped.rank == (0, 1, 2, 3, 0, 1, 2, 3)
    twins = schedule_shape(build_schedule("dualpipe", p, 8))
    assert twins.replicas == 2 and twins.num_model_stages == 4
    assert twins.model_stage == (0, 1, 2, 3, 0, 1, 2, 3) and twins.rank == (0, 1, 2, 3, 3, 2, 1, 0)


def test_visits_per_rank():
    assert visits_per_rank(build_schedule("1f1b", 4, 8)) == 8
    assert visits_per_rank(build_schedule("interleaved-1f1b", 4, 8, stages_per_rank=3)) == 24
    assert visits_per_rank(build_schedule("zbv", 4, 8)) == 16
    assert visits_per_rank(build_schedule("chimera", 4, 8)) == 8  # 4 pairs through two stages


def test_rules_send_only_across_ranks_and_share_the_limit():
    rules = stage_rules(schedule_shape(build_schedule("zbv", 4, 8)), memory_limit=100.0)
    assert [rule.sends for rule in rules] == [True, True, True, False, True, True, True, False]
    assert all(c.limit == 50.0 for rule in rules for c in rule.copies)  # two stages per rank
    twins = stage_rules(schedule_shape(build_schedule("chimera", 4, 8)), memory_limit=100.0)
    assert len(twins) == 4 and all(len(rule.copies) == 2 for rule in twins)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1", "zb-h2", "zbv", "interleaved-1f1b", "dualpipev",
                                  "chimera", "dualpipe"])
def test_the_rules_bound_the_simulated_peak(name):
    table = _table()
    schedule = library_schedule(table, name, 4, 8, memory_limit=None)
    shape = schedule_shape(schedule)
    found = SchedulePartitioner(table).partition(schedule, memory_limit=None)
    timeline = simulate(dataclasses.replace(schedule, problem=recost(schedule, table, found, memory_limit=None)))
    bound = rank_memory(table, shape, found)
    for peak, counted in zip(timeline.peak_memory, bound):
        assert peak <= counted * (1 + 1e-12)


@pytest.mark.parametrize("placement", ["linear", "interleaved", "v"])
def test_partition_respects_the_rank_limit(placement):
    table = _table()
    free = partition(table, num_ranks=4, placement=placement, microbatches=8)
    name = {"linear": "1f1b", "interleaved": "interleaved-1f1b", "v": "zbv"}[placement]
    schedule = library_schedule(table, name, 4, 8, memory_limit=None)
    shape = schedule_shape(schedule)
    tight = 0.97 * max(rank_memory(table, shape, free))
    found = SchedulePartitioner(table).partition(schedule, memory_limit=tight)
    assert max(rank_memory(table, shape, found)) <= tight * (1 + 1e-9)
    assert found.objective >= free.objective - 1e-9  # the limit can only cost time


def test_partition_linear_balances_equal_layers():
    table = CostTable(pieces=tuple(Piece(name=f"blocks.{k}", f=1, i=1, w=1) for k in range(8)), microbatch_size=1)
    found = partition(table, num_ranks=4, microbatches=8)
    assert found.split_points == ("blocks.2", "blocks.4", "blocks.6")
    assert len(partition(table, num_ranks=2, placement="v", microbatches=8).split_points) == 3
    assert len(partition(table, num_ranks=2, placement="interleaved", stages_per_rank=4).split_points) == 7


def test_partition_errors():
    table = _table(4)
    with pytest.raises(PartitionError, match="8 stages, but the cost table has 4 pieces"):
        partition(table, num_ranks=4, placement="v")
    with pytest.raises(PartitionError, match="unknown placement 'w'"):
        partition(table, num_ranks=2, placement="w")
    with pytest.raises(MemoryTooSmall, match="the smallest limit that fits is about") as caught:
        partition(table, num_ranks=2, microbatches=4, memory_limit=50.0)
    limit = caught.value.smallest_limit
    assert partition(table, num_ranks=2, microbatches=4, memory_limit=limit).num_stages == 2
    with pytest.raises(MemoryTooSmall):
        partition(table, num_ranks=2, microbatches=4, memory_limit=limit * 0.99)


def test_link_costs_move_the_cut():
    # the first stage's output is small after piece 0 and huge elsewhere: the cut goes there
    pieces = (Piece(name="a", f=1, i=1, w=1, output_bytes=1), Piece(name="b", f=1, i=1, w=1, output_bytes=1e6),
              Piece(name="c", f=1, i=1, w=1, output_bytes=1e6), Piece(name="d", f=1, i=1, w=1))
    table = CostTable(pieces=pieces, microbatch_size=1, link=Link(bandwidth=1e5))
    assert partition(table, num_ranks=2, microbatches=4).split_points == ("b",)


@pytest.mark.parametrize("name", ["zbv", "interleaved-1f1b"])
def test_smallest_limit_of_shared_ranks_is_near_the_brute_force_least(name):
    import itertools

    from pipeloom.plan.partitioning.rules import Partition

    table = _table(10)
    schedule = library_schedule(table, name, 3, 6, memory_limit=None)
    shape = schedule_shape(schedule)
    least = float("inf")
    for cuts in itertools.combinations(range(1, 10), 5):
        bounds = [0, *cuts, 10]
        stage_of = tuple(j for j in range(6) for _ in range(bounds[j], bounds[j + 1]))
        split = Partition(stage_of=stage_of, split_points=(), stage_times=(1.0,) * 6, stage_memory=(0.0,) * 6,
                          objective=0.0, weight=0.0)
        least = min(least, max(rank_memory(table, shape, split)))
    partitioner = SchedulePartitioner(table)
    limit = partitioner.smallest_limit(schedule)
    assert least <= limit <= 1.05 * least
    found = partitioner.partition(schedule, memory_limit=limit)  # a split fits the limit it names
    assert max(rank_memory(table, shape, found)) <= limit
