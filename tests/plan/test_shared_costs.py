"""pipeloom.plan.costs.shared: bytes and exchange time of parameters several pieces use (no torch).

Oracles: hand-computed byte counts and message times; the exchange order replayed by hand for three
holders (the runtime's order: peers ascending, the lower rank of a pair sends first).
"""

from __future__ import annotations

import pytest

from pipeloom.plan.costs.parts import Link, Piece, RuntimeCorrections, SharedParam
from pipeloom.plan.costs.shared import (
    held_param_bytes,
    shared_across_stages,
    shared_buffer_bytes,
    shared_extra_bytes,
    shared_messages,
    shared_static_bytes,
    shared_sync_time,
)
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import CostTableError

TIED = 100.0  # bytes of the tied embedding / head matrix


def _tied(**overrides) -> CostTable:
    """embed (holds the tied matrix and 20 more bytes), two blocks, head (uses the tied matrix only)."""
    pieces = (Piece(name="embed", f=1, i=0, w=1, param_bytes=TIED + 20),
              Piece(name="blocks.0", f=1, i=1, w=1, param_bytes=50),
              Piece(name="blocks.1", f=1, i=1, w=1, param_bytes=50),
              Piece(name="head", f=1, i=1, w=1, param_bytes=0))
    shared = (SharedParam(name="embed.weight", bytes=TIED, pieces=("embed", "head")),)
    return CostTable(**{"pieces": pieces, "microbatch_size": 1, "shared": shared,
                        "link": Link(latency=1e-3, bandwidth=1e5), **overrides})


def test_a_shared_parameter_counts_once_per_rank_that_holds_a_user():
    table = _tied()
    assert held_param_bytes(table, [0, 1, 2, 3]) == TIED + 20 + 100  # the whole model: each parameter once
    assert held_param_bytes(table, [3]) == TIED  # the head's rank holds the tied matrix too
    assert held_param_bytes(table, [0, 3]) == TIED + 20  # both users on one rank: once
    assert held_param_bytes(table, [1, 2]) == 100  # no user: nothing more
    assert shared_extra_bytes(table, [2, 3]) == TIED and shared_extra_bytes(table, [0, 1]) == 0
    # weights, gradients and optimizer state (2 + optimizer_factor 2) of the extra copy, per rank
    assert shared_static_bytes(table, [0, 0, 1, 1]) == {0: 0.0, 1: 4 * TIED}
    assert shared_static_bytes(table, [0, 1, 1, 0]) == {0: 0.0, 1: 0.0}


def test_sync_time_is_zero_when_every_user_is_on_one_rank():
    table = _tied()
    assert shared_sync_time(table, [0, 1, 1, 0], 4) == 0.0
    assert shared_messages(table, [0, 1, 1, 0], 4) == {}
    assert shared_buffer_bytes(table, [0, 1, 1, 0], 4) == {}
    assert shared_sync_time(CostTable(pieces=_tied().pieces, microbatch_size=1), [0, 0, 1, 1], 4) == 0.0


def test_sync_time_of_two_holders_is_one_message_each_way_in_turn():
    table = _tied()
    # 4 micro-batches x 100 bytes each way; the higher rank sends only after it has received
    assert shared_messages(table, [0, 0, 1, 1], 4) == {(0, 1): 400.0, (1, 0): 400.0}
    one_way = 1e-3 + 400 / 1e5
    assert shared_sync_time(table, [0, 0, 1, 1], 4) == pytest.approx(2 * one_way)
    assert shared_sync_time(table, [0, 0, 1, 1], 4, link=Link(latency=0.5)) == pytest.approx(1.0)
    # the engine's packed messages, measured, price it where the table has them
    measured = _tied(runtime=RuntimeCorrections(replica_link=Link(latency=0.25)))
    assert shared_sync_time(measured, [0, 0, 1, 1], 4) == pytest.approx(0.5)
    # at the exchange each holder keeps its own 4 contributions, their packed copy and the peer's 4
    assert shared_buffer_bytes(table, [0, 0, 1, 1], 4) == {0: 1200.0, 1: 1200.0}


def test_sync_time_of_three_holders_follows_the_runtime_order():
    pieces = tuple(Piece(name=f"p{k}", f=1, i=1, w=1, param_bytes=10.0 if k == 0 else 0.0) for k in range(3))
    table = CostTable(pieces=pieces, microbatch_size=1, link=Link(latency=1.0),
                      shared=(SharedParam(name="w", bytes=10, pieces=("p0", "p1", "p2")),))
    # by hand, T = 1 per message: 0->1 arrives at T; 1 answers (2T) and sends to 2 (2T); 0 then sends to 2
    # (3T); 2 answers 0 and, having 1's message, answers 1 (4T); ranks 0 and 1 end at 4T
    assert shared_sync_time(table, [0, 1, 2], 2) == pytest.approx(4.0)
    assert shared_messages(table, [0, 1, 2], 2) == {pair: 20.0 for pair in
                                                    [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]}


def test_two_uses_on_one_rank_send_both_contributions():
    table = _tied()
    both = CostTable(pieces=table.pieces, microbatch_size=1, link=table.link,
                     shared=(SharedParam(name="w", bytes=10, pieces=("embed", "blocks.0", "head")),))
    assert shared_messages(both, [0, 0, 1, 1], 3) == {(0, 1): 60.0, (1, 0): 30.0}


def test_shared_across_stages_names_what_a_two_replica_schedule_cannot_run():
    table = _tied()
    assert shared_across_stages(table, [0, 0, 1, 1]) == table.shared
    assert shared_across_stages(table, [0, 1, 1, 2]) == table.shared
    assert shared_across_stages(table, [0, 0, 0, 0]) == ()  # one stage holds both uses: one module


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(CostTableError, match="4 pieces"):
        shared_sync_time(_tied(), [0, 1], 4)
    with pytest.raises(CostTableError, match="num_microbatches"):
        shared_messages(_tied(), [0, 0, 1, 1], 0)


def _tied_chain(n: int = 8) -> CostTable:
    pieces = tuple(Piece(name=f"blocks.{k}", f=1.0, i=1.0, w=1.0, activation_bytes=100.0, w_activation_bytes=20.0,
                         param_bytes=1000.0 if k == 0 else 10.0, output_bytes=8.0) for k in range(n))
    return CostTable(pieces=pieces, microbatch_size=1, link=Link(latency=0.5, bandwidth=1e4),
                     shared=(SharedParam(name="wte.weight", bytes=800.0, pieces=("blocks.0", f"blocks.{n - 1}")),))


def test_the_planner_prices_and_places_a_tie_across_stages():
    from pipeloom.plan import plan_pipeline
    from pipeloom.plan.partitioning.shape import schedule_shape
    from pipeloom.plan.recost import piece_ranks, recost, shared_time

    table = _tied_chain()
    result = plan_pipeline(table, num_ranks=4, global_batch=8, microbatches=[8], schedules=["1f1b", "dualpipe"])
    by_name = {c.schedule: c for c in result.candidates}
    assert "one-replica schedule" in by_name["dualpipe"].reason and not by_name["dualpipe"].fits
    best = by_name["1f1b"]
    exchange = shared_time(table, best.timeline.schedule, best.partition)
    assert exchange == shared_sync_time(table, piece_ranks(schedule_shape(best.timeline.schedule), best.partition),
                                        8) > 0
    assert best.step_time == pytest.approx(best.timeline.makespan + exchange)
    # the last rank holds the tied matrix too: weights, gradients and optimizer state (2 + 2) x 800 bytes
    untied = CostTable(pieces=table.pieces, microbatch_size=1, link=table.link)
    schedule = best.timeline.schedule
    with_tie = recost(schedule, table, best.partition, memory_limit=None).static_memory
    without = recost(schedule, untied, best.partition, memory_limit=None).static_memory
    assert [a - b for a, b in zip(with_tie, without)] == [0.0, 0.0, 0.0, 4 * 800.0]


def test_data_parallel_reduces_a_shared_parameter_after_its_exchange():
    from pipeloom.plan import plan_mesh
    from pipeloom.plan.errors import NoPlanFits

    result = plan_mesh(_tied_chain(), num_ranks=8, global_batch=16, data_parallel=[2], schedules=["1f1b"],
                       microbatches=[8])
    assert result.plan.data_parallel == 2 and result.candidates[0].fits
    with pytest.raises(NoPlanFits, match="fsdp cannot shard parameters shared by several stages"):
        plan_mesh(_tied_chain(), num_ranks=8, global_batch=16, data_parallel=[2], schedules=["1f1b"],
                  microbatches=[8], sharding="fsdp")
