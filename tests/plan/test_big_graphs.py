"""Plans for big tables: the chain DP over split points in call order at every size.

Oracles: the split points are piece names in call order (what the runtime cuts), and a chain whose
every third piece has a large output is never cut after one of those (the link time is in the
objective). The cap-at-a-time DP (:class:`SplitFront` above ``LABEL_DP_MAX_PIECES``) is compared with
brute force and with the whole-front DP on random tables in tests/plan/test_partition.py.
"""

from __future__ import annotations

import time

from pipeloom.plan import CostTable, Link, Piece, StageRule, plan_pipeline
from pipeloom.plan.partitioning.chain import LABEL_DP_MAX_PIECES, SplitFront


def _chain(n: int) -> CostTable:
    """Tiny equal pieces; pieces 2, 5, 8, ... send 1 MB on a 1 MB/s link (1 s), the others 1 byte."""
    pieces = tuple(Piece(name=f"layers.{k}", f=0.01, i=0.01, w=0.01, activation_bytes=10.0,
                         output_bytes=1e6 if k % 3 == 2 else 1.0) for k in range(n))
    return CostTable(pieces=pieces, microbatch_size=1, link=Link(latency=0.0, bandwidth=1e6))


def test_a_thousand_piece_table_plans_with_cuts_in_call_order_past_the_big_outputs():
    table = _chain(1200)
    assert len(table.pieces) > LABEL_DP_MAX_PIECES
    started = time.perf_counter()
    result = plan_pipeline(table, num_ranks=4, global_batch=8, microbatches=[8], schedules=["1f1b", "zb-h1"])
    assert time.perf_counter() - started < 10
    cuts = [table.names.index(name) for name in result.plan.split_points]
    assert len(cuts) == 3 and cuts == sorted(cuts) and cuts[0] > 0  # contiguous stages in call order
    assert all((k - 1) % 3 != 2 for k in cuts)  # no stage ends on a piece with a big output
    # the balanced cuts (300, 600, 900) would each end on such a piece: 1 s each in the objective
    assert max(result.plan.stage_times) < 300 * 0.03 + 0.1


def test_the_cap_dp_and_the_whole_front_agree_at_the_label_limit():
    table = _chain(LABEL_DP_MAX_PIECES)
    rules = [StageRule()] * 5 + [StageRule(sends=False)]
    caps, labels = SplitFront(table, rules, method="caps"), SplitFront(table, rules, method="labels")
    for weight in (0.0, 1.0, 7.0, 63.0):
        assert abs(caps.best(weight).objective - labels.best(weight).objective) <= 1e-9 * labels.best(weight).objective
