"""The plan search: re-costed schedules, the best plan against its candidates, and infeasible requests.

Oracles: 1F1B's closed-form makespan (m + p - 1)(F + B) for equal stages and a free link, the
validator on every re-costed schedule, the simulator's peak against the limit, and re-planning
with the limit an error message suggests.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pipeloom import validate
from pipeloom.ir.composite import action_duration
from pipeloom.plan import CostTable, Link, Piece, PlanError, load_plan, parse_bytes, plan_pipeline
from pipeloom.plan.costs.parts import RuntimeCorrections
from pipeloom.plan.errors import NoPlanFits
from pipeloom.plan.noise import expected_makespan
from pipeloom.plan.partitioning.partitioner import SchedulePartitioner
from pipeloom.plan.partitioning.rules import Partition
from pipeloom.plan.partitioning.shape import library_schedule
from pipeloom.plan.recost import recost, replica_sync_time, stage_spreads
from pipeloom.schedules import REGISTRY


def _table(n: int = 8, **overrides) -> CostTable:
    pieces = tuple(Piece(name=f"blocks.{k}", f=1.0, i=1.0, w=1.0, activation_bytes=100.0, w_activation_bytes=20.0,
                         param_bytes=10.0, output_bytes=8.0) for k in range(n))
    return CostTable(**{"pieces": pieces, "microbatch_size": 1, **overrides})


def test_a_new_registry_entry_is_tried_by_the_planner_with_no_other_edit(monkeypatch):
    import pipeloom.schedules as schedules

    entry = schedules.ScheduleInfo(name="zb-h1-again", module="zero_bubble", function="zb_h1", splits_backward=True,
                                   summary="a second name for zb-h1")
    monkeypatch.setitem(schedules._BY_NAME, entry.name, entry)
    result = plan_pipeline(_table(), num_ranks=4, global_batch=8, microbatches=[8])
    tried = {c.schedule: c for c in result.candidates}
    assert set(tried) >= set(REGISTRY) and "zb-h1-again" in tried
    assert tried["zb-h1-again"].reason == ""
    assert tried["zb-h1-again"].step_time == tried["zb-h1"].step_time


def test_1f1b_prediction_matches_the_closed_form():
    # 8 equal pieces on 4 ranks: 2 per stage, F = 2, B = I + W = 4 per stage; free link
    result = plan_pipeline(_table(), num_ranks=4, global_batch=8, schedules=["1f1b"], microbatches=[8])
    assert result.plan.split_points == ("blocks.2", "blocks.4", "blocks.6")
    assert result.plan.predicted_step_time == pytest.approx((8 + 4 - 1) * (2 + 4))
    assert result.plan.stage_times == (6.0, 6.0, 6.0, 6.0)
    # static memory: 2 pieces x 10 bytes x (2 + optimizer factor 2); 1F1B holds p - r micro-batches
    assert result.plan.peak_memory == tuple(80 + (4 - r) * 200.0 for r in range(4))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_recosted_schedules_validate_and_keep_the_task_graph(name):
    table = _table(16, link=Link(latency=0.25))
    options = {"stages_per_rank": 2} if "stages_per_rank" in REGISTRY[name].options else {}
    schedule = library_schedule(table, name, 4, 8, memory_limit=None, **options)
    found = SchedulePartitioner(table).partition(schedule, memory_limit=None)
    problem = recost(schedule, table, found, memory_limit=None)
    assert {t.key: (t.ranks, set(t.deps)) for t in problem.tasks} == \
        {t.key: (t.ranks, set(t.deps)) for t in schedule.problem.tasks}
    assert problem.comm_latency == 0.25  # link latency + 8 bytes at unlimited bandwidth
    timeline = validate(dataclasses.replace(schedule, problem=problem), ordered=True)
    # every action busy for its duration: a task's, or an overlapped pair's F + B + overhead
    work = sum(action_duration(problem, action) for row in schedule.ranks for action in row)
    assert sum(timeline.busy) == pytest.approx(work)
    assert work <= sum(t.duration for t in problem.tasks) * schedule.num_microbatches + 1e-9


def test_the_best_plan_is_the_fastest_candidate_that_fits():
    table = _table(12, link=Link(latency=0.1, bandwidth=100.0))
    limit = 1500.0
    result = plan_pipeline(table, num_ranks=4, global_batch=16, memory_limit=limit)
    fitting = [c for c in result.candidates if c.fits]
    assert fitting and result.candidates[:len(fitting)] == tuple(fitting)  # fitting ones first
    assert result.plan.predicted_step_time == min(c.step_time for c in fitting)
    assert [c.step_time for c in fitting] == sorted(c.step_time for c in fitting)
    for candidate in fitting:
        assert max(candidate.timeline.peak_memory) <= limit
    assert max(result.plan.peak_memory) <= limit
    assert result.timeline.makespan == pytest.approx(result.plan.predicted_step_time)
    assert any(not c.fits and "needs about" in c.reason for c in result.candidates)  # GPipe at large M
    assert result.plan.global_batch == 16 and 16 % result.plan.microbatches == 0


def test_two_replica_schedules_pay_the_gradient_exchange():
    table = _table(8, link=Link(latency=0.5, bandwidth=10.0))
    result = plan_pipeline(table, num_ranks=4, global_batch=8, schedules=["chimera"], microbatches=[8])
    best = result.candidates[0]
    # a model stage is 2 pieces, 20 parameter bytes: one link message takes 0.5 + 20 / 10 = 2.5 s. The
    # second replica sends its 4 micro-batch gradients (4 messages), the first sends the sum back (1)
    assert replica_sync_time(table, best.timeline.schedule, best.partition) == pytest.approx(4 * 2.5 + 2.5)
    assert best.step_time == pytest.approx(best.timeline.makespan + 12.5)


def test_memory_too_small_names_a_limit_that_fits():
    table = _table(8)
    with pytest.raises(PlanError, match="no plan fits 100 B per rank.*the smallest that fits is about") as caught:
        plan_pipeline(table, num_ranks=4, global_batch=8, memory_limit=100.0)
    suggested = caught.value.smallest_limit
    assert isinstance(caught.value, NoPlanFits)
    result = plan_pipeline(table, num_ranks=4, global_batch=8, memory_limit=suggested)
    assert max(result.plan.peak_memory) <= suggested


def test_more_ranks_than_pieces_says_how_many_fit():
    with pytest.raises(PlanError, match="8 ranks need at least 8 pieces.*at most 3 ranks"):
        plan_pipeline(_table(3), num_ranks=8, global_batch=8)


def test_too_many_stages_for_every_schedule():
    with pytest.raises(PlanError, match="no plan could be built.*too many stages"):
        plan_pipeline(_table(3), num_ranks=2, global_batch=4, schedules=["zbv", "interleaved-1f1b"],
                      microbatches=[4])


def test_the_obstacle_of_the_most_microbatches_is_named_first():
    """DualPipe with a tied weight: the micro-batch counts too small to build had come first, and the reason no
    count could run (the shared weight) last."""
    from pipeloom.plan.costs.parts import SharedParam

    tied = _table(shared=(SharedParam(name="emb.weight", bytes=10.0, pieces=("blocks.0", "blocks.7")),))
    with pytest.raises(PlanError, match=r"no plan could be built for 8 pieces on 2 ranks: shared parameter\(s\) "
                                        r"emb.weight on several stages need a one-replica schedule; not built: "):
        plan_pipeline(tied, num_ranks=2, global_batch=4, schedules=["dualpipe"])


def test_bad_requests():
    with pytest.raises(PlanError, match="does not divide the global batch 8"):
        plan_pipeline(_table(), num_ranks=2, global_batch=8, microbatches=[3])
    with pytest.raises(PlanError, match="unknown schedule"):
        plan_pipeline(_table(), num_ranks=2, global_batch=8, schedules=["2f2b"])
    with pytest.raises(PlanError, match="num_ranks must be a positive integer"):
        plan_pipeline(_table(), num_ranks=0, global_batch=8)


def test_micro_batch_size_scales_the_table():
    # twice the samples per micro-batch, half as many micro-batches: 1F1B's fill costs twice as much
    table = _table(4)
    one = plan_pipeline(table, num_ranks=4, global_batch=8, schedules=["1f1b"], microbatches=[8])
    two = plan_pipeline(table, num_ranks=4, global_batch=8, schedules=["1f1b"], microbatches=[4])
    assert one.plan.predicted_step_time == pytest.approx((8 + 3) * 3)
    assert two.plan.predicted_step_time == pytest.approx((4 + 3) * 6)
    assert two.plan.microbatch_size == 2


def test_save_writes_a_plan_the_runtime_reads(tmp_path):
    result = plan_pipeline(_table(), num_ranks=2, global_batch=8, schedules=["interleaved-1f1b"], microbatches=[4])
    result.save(tmp_path / "plan.json")
    plan = load_plan(tmp_path / "plan.json")
    assert plan == result.plan
    assert plan.schedule_options == {"stages_per_rank": 2} and len(plan.split_points) == 3


def test_tables_at_several_sizes_capture_fixed_costs():
    # measured: 1 sample costs 1 s per phase and piece, 4 samples only 1.2 s (a fixed part dominates)
    pieces = [Piece(name=f"blocks.{k}", f=1.0, i=1.0, w=1.0) for k in range(4)]
    small = CostTable(pieces=tuple(pieces), microbatch_size=1)
    large = CostTable(pieces=tuple(dataclasses.replace(p, f=1.2, i=1.2, w=1.2) for p in pieces), microbatch_size=4)
    alone = plan_pipeline(small, num_ranks=2, global_batch=16, schedules=["1f1b"])
    both = plan_pipeline([small, large], num_ranks=2, global_batch=16, schedules=["1f1b"])
    assert alone.plan.microbatch_size == 1  # linear scaling sees no fixed cost
    assert both.plan.microbatch_size == 4
    assert both.plan.predicted_step_time == pytest.approx((4 + 1) * 2 * 3.6)  # (m + p - 1)(F + B), 2 pieces


def test_the_search_can_beat_a_built_in_and_its_schedule_is_saved(tmp_path):
    from pipeloom import load_schedule

    costs = [1, 3, 1, 2, 1, 1, 4, 1]
    pieces = tuple(Piece(name=f"b{k}", f=c, i=c, w=0.5, activation_bytes=1) for k, c in enumerate(costs))
    table = CostTable(pieces=pieces, microbatch_size=1, link=Link(latency=0.5))
    plain = plan_pipeline(table, num_ranks=4, global_batch=8, schedules=["zb-h1"], microbatches=[8])
    searched = plan_pipeline(table, num_ranks=4, global_batch=8, schedules=["zb-h1"], microbatches=[8],
                             search_time=3.0)
    assert searched.plan.schedule == "search"
    assert searched.plan.predicted_step_time < plain.plan.predicted_step_time
    assert searched.plan.split_points == plain.plan.split_points  # same cut, better order
    searched.save(tmp_path / "plan.json")
    plan = load_plan(tmp_path / "plan.json")
    assert plan.schedule == str(tmp_path / "plan.schedule.json")
    timeline = validate(load_schedule(plan.schedule), ordered=True)
    assert timeline.makespan == pytest.approx(searched.plan.predicted_step_time)


def test_recost_moves_the_first_stages_input_gradient_to_w_and_adds_the_action_overhead():
    table = _table(4, runtime=RuntimeCorrections(action_overhead=0.25))
    zb = library_schedule(table, "zb-h1", 2, 4, memory_limit=None)
    found = SchedulePartitioner(table).candidates(zb, memory_limit=None)[0]
    assert found.split_points == ("blocks.2",)
    split = recost(zb, table, found, memory_limit=None)
    # stage 0 reads only model inputs: no input gradient, its I (2 pieces x 1 s) is done in W
    assert [split.task((0, kind)).duration for kind in ("F", "I", "W")] == [2.25, 0.25, 4.25]
    assert [split.task((1, kind)).duration for kind in ("F", "I", "W")] == [2.25, 2.25, 2.25]
    full = recost(library_schedule(table, "1f1b", 2, 4, memory_limit=None), table, found, memory_limit=None)
    assert [full.task((s, "B")).duration for s in (0, 1)] == [4.25, 4.25]  # one B: overhead once


def test_recost_charges_the_message_cost_per_edge_that_crosses_ranks():
    table = _table(4, runtime=RuntimeCorrections(message_cost=0.5))
    one = library_schedule(table, "1f1b", 2, 4, memory_limit=None)
    found = SchedulePartitioner(table).candidates(one, memory_limit=None)[0]
    full = recost(one, table, found, memory_limit=None)
    # each stage sends to or receives from the other rank once: its F and its B pay one message
    assert [full.task((s, kind)).duration for s in (0, 1) for kind in ("F", "B")] == [2.5, 4.5, 2.5, 4.5]
    looped = library_schedule(table, "interleaved-1f1b", 2, 4, memory_limit=None, stages_per_rank=2)
    split = SchedulePartitioner(table).candidates(looped, memory_limit=None)[0]
    costed = recost(looped, table, split, memory_limit=None)
    free = recost(looped, dataclasses.replace(table, runtime=RuntimeCorrections()), split, memory_limit=None)
    # stages 0..3 alternate ranks: the inner ones have a neighbour on the other rank on both sides
    assert [costed.task((s, "F")).duration - free.task((s, "F")).duration for s in range(4)] == [0.5, 1.0, 1.0, 0.5]
    assert costed.task((1, "B")).duration - free.task((1, "B")).duration == 1.0


def test_save_writes_the_simulated_order_when_the_name_builds_another(tmp_path):
    from pipeloom import build_schedule, load_schedule

    # ZB-V's list scheduler orders by costs: with I three times F its order is not the default one
    table = CostTable(pieces=tuple(Piece(name=f"blocks.{k}", f=1.0, i=3.0, w=1.0, activation_bytes=100.0)
                                   for k in range(8)), microbatch_size=1)
    result = plan_pipeline(table, num_ranks=2, global_batch=8, schedules=["zbv"], microbatches=[8])
    assert result.plan.schedule == "zbv"
    default = build_schedule("zbv", 2, 8)
    assert [list(map(str, r)) for r in default.ranks] != [list(map(str, r)) for r in result.schedule.ranks]
    result.save(tmp_path / "plan.json")
    plan = load_plan(tmp_path / "plan.json")
    assert plan.schedule == str(tmp_path / "plan.schedule.json")
    saved = load_schedule(plan.schedule)
    assert [list(map(str, r)) for r in saved.ranks] == [list(map(str, r)) for r in result.schedule.ranks]
    # 1F1B does not depend on costs: the plan names it
    plain = plan_pipeline(table, num_ranks=2, global_batch=8, schedules=["1f1b"], microbatches=[8])
    plain.save(tmp_path / "plain.json")
    assert load_plan(tmp_path / "plain.json").schedule == "1f1b"
    assert not (tmp_path / "plain.schedule.json").exists()


def test_full_backward_schedules_price_b_and_split_ones_i_and_w():
    pieces = tuple(Piece(name=f"blocks.{k}", f=1.0, i=1.0, w=1.0, measured_full_backward=1.5)
                   for k in range(4))
    table = CostTable(pieces=pieces, microbatch_size=1)
    zb = library_schedule(table, "zb-h1", 2, 4, memory_limit=None)
    found = SchedulePartitioner(table).candidates(zb, memory_limit=None)[0]
    split = recost(zb, table, found, memory_limit=None)
    assert [split.task((1, kind)).duration for kind in ("F", "I", "W")] == [2.0, 2.0, 2.0]
    full = recost(library_schedule(table, "1f1b", 2, 4, memory_limit=None), table, found, memory_limit=None)
    assert [full.task((s, "B")).duration for s in (0, 1)] == [3.0, 3.0]  # 2 pieces x b, not I + W


def test_step_overhead_is_added_once_to_every_prediction():
    table = _table()
    plain = plan_pipeline(table, num_ranks=4, global_batch=8, microbatches=[8])
    overhead = dataclasses.replace(table, runtime=RuntimeCorrections(step_overhead=2.5))
    extra = plan_pipeline(overhead, num_ranks=4, global_batch=8,
                          microbatches=[8])
    before = {(c.label, c.microbatches): c.step_time for c in plain.candidates if c.fits}
    after = {(c.label, c.microbatches): c.step_time for c in extra.candidates if c.fits}
    assert after.keys() == before.keys()
    assert all(after[key] == pytest.approx(before[key] + 2.5) for key in before)
    assert extra.plan.predicted_step_time == pytest.approx(plain.plan.predicted_step_time + 2.5)


def test_the_replica_link_prices_the_exchange_where_the_table_has_one():
    table = _table(8, link=Link(latency=0.5, bandwidth=10.0),
                   runtime=RuntimeCorrections(replica_link=Link(latency=1.5, bandwidth=10.0)))
    result = plan_pipeline(table, num_ranks=4, global_batch=8, schedules=["chimera"], microbatches=[8])
    best = result.candidates[0]
    # as above, with 1.5 + 20 / 10 = 3.5 s per message: 4 micro-batch gradients in, the sum back
    assert replica_sync_time(table, best.timeline.schedule, best.partition) == pytest.approx(5 * 3.5)
    assert replica_sync_time(table, best.timeline.schedule, best.partition, link=Link(latency=0.5)) \
        == pytest.approx(5 * 0.5)
    assert best.step_time == pytest.approx(best.timeline.makespan + 17.5)
    one = plan_pipeline(table, num_ranks=4, global_batch=8, schedules=["1f1b"], microbatches=[8]).candidates[0]
    assert replica_sync_time(table, one.timeline.schedule, one.partition) == 0.0


def test_stage_spreads_are_the_tables_for_every_stage_with_work():
    pieces = (Piece(name="a", f=3.0, i=1.0, w=1.0), Piece(name="b", f=4.0, i=1.0, w=1.0),
              Piece(name="c", f=1.0, i=1.0, w=1.0), Piece(name="d", f=0.0, i=0.0, w=0.0))
    table = CostTable(pieces=pieces, microbatch_size=1, runtime=RuntimeCorrections(time_spread=0.35))
    schedule = library_schedule(table, "1f1b", 3, 3, memory_limit=None)
    found = Partition(stage_of=(0, 0, 1, 2), split_points=("c", "d"), stage_times=(0.0,) * 3,
                      stage_memory=(0.0,) * 3, objective=0.0, weight=0.0)
    assert stage_spreads(table, schedule, found) == [0.35, 0.35, 0.0]  # a stage with no time varies by nothing
    chimera = library_schedule(table, "chimera", 2, 2, memory_limit=None)
    two = Partition(stage_of=(0, 0, 1, 1), split_points=("c",), stage_times=(0.0,) * 2,
                    stage_memory=(0.0,) * 2, objective=0.0, weight=0.0)
    assert stage_spreads(table, chimera, two) == [0.35] * 4  # both replicas' stages


def test_a_time_spread_predicts_the_mean_step_and_keeps_the_plain_timeline():
    table = _table()
    spread = dataclasses.replace(table, runtime=RuntimeCorrections(time_spread=0.3))
    plain = plan_pipeline(table, num_ranks=4, global_batch=8, microbatches=[8], schedules=["1f1b", "gpipe"])
    varied = plan_pipeline(spread, num_ranks=4, global_batch=8, microbatches=[8], schedules=["1f1b", "gpipe"])
    before = {c.label: c for c in plain.candidates if c.fits}
    after = {c.label: c for c in varied.candidates if c.fits}
    assert after.keys() == before.keys()
    for label, candidate in after.items():
        assert candidate.timeline.makespan == before[label].timeline.makespan  # the picture is the plain replay
        assert candidate.step_time > before[label].step_time  # waiting on the later path costs on average
        schedule = candidate.timeline.schedule
        assert candidate.step_time == pytest.approx(
            expected_makespan(schedule, stage_spreads(spread, schedule, candidate.partition)))


def test_a_huge_or_prime_global_batch_plans_at_once_and_too_many_microbatches_are_refused():
    import time

    from pipeloom.plan.planner import MAX_PLAN_MICROBATCHES

    started = time.perf_counter()
    result = plan_pipeline(_table(), num_ranks=4, global_batch=1_000_000_007, schedules=["1f1b"])  # a prime
    assert time.perf_counter() - started < 30  # counted to the batch before: never ended
    assert {c.microbatches for c in result.candidates} == {1}
    with pytest.raises(PlanError, match=f"choose at most {MAX_PLAN_MICROBATCHES}"):
        plan_pipeline(_table(), num_ranks=4, global_batch=4096, schedules=["1f1b"], microbatches=[4096])


@pytest.mark.parametrize("seed", range(3))
def test_the_smallest_limit_round_trip_is_exact_for_one_stage_per_rank(seed):
    import random

    rng = random.Random(seed)
    pieces = tuple(Piece(name=f"blocks.{k}", f=rng.uniform(0.5, 2), i=1.0, w=1.0, activation_bytes=rng.uniform(50, 150),
                         w_activation_bytes=10.0, param_bytes=rng.uniform(5, 20), output_bytes=8.0) for k in range(9))
    table = CostTable(pieces=pieces, microbatch_size=1)
    request = dict(num_ranks=3, global_batch=6, schedules=["1f1b", "gpipe", "zb-h1"])
    with pytest.raises(NoPlanFits, match=r"the smallest that fits is about .* \(rounded up") as caught:
        plan_pipeline(table, memory_limit=50.0, **request)
    least = caught.value.smallest_limit
    plan = plan_pipeline(table, memory_limit=least, **request).plan  # the value returned fits
    assert max(plan.peak_memory) <= least * (1 + 1e-9)
    printed = re.search(r"is about ([0-9.]+ [KMG]?i?B)", str(caught.value)).group(1)
    assert parse_bytes(printed) >= least  # the value printed fits too: rounded up
    plan_pipeline(table, memory_limit=parse_bytes(printed), **request)
    with pytest.raises(NoPlanFits):  # a bit less does not
        plan_pipeline(table, memory_limit=least * (1 - 1e-6), **request)


def test_no_memory_limit_plans_no_slower_than_a_generous_one(tmp_path):
    """Without a limit a memory-aware schedule (interleaved-zb) had been built only at its default memory, 1F1B's, and
    the best plan was slower than with a 100 GiB limit, at which it was built for that limit (a new user's table)."""
    from pipeloom.plan.costs.file import load_costs

    layers = [(f"layers.{k}", 2e-3, 1e-3, 2e8) for k in range(8)]
    rows = [("embed", 5e-4, 3e-4, 5e7), *layers, ("head", 5e-4, 3e-4, 5e7)]
    pieces = [dict(name=name, f=f, i=f, w=w, activation_bytes=act, w_activation_bytes=0, param_bytes=1e8,
                   output_bytes=8e6) for name, f, w, act in rows]
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(dict(format="pipeloom.costs/2", microbatch_size=2,
                                    link=dict(latency=1e-5, bandwidth=1e10), pieces=pieces)))
    table = load_costs(path)
    free = plan_pipeline(table, num_ranks=4, global_batch=16)
    for limit in (100 * 2**30, 4 * 2**30):
        assert free.plan.predicted_step_time <= plan_pipeline(table, num_ranks=4, global_batch=16,
                                                              memory_limit=limit).plan.predicted_step_time


@pytest.mark.parametrize("name", ["zbv", "interleaved-zb", "v-half", "v-min"])
def test_a_memory_aware_schedules_smallest_limit_is_the_least_its_generator_orders_for(name):
    """Below every limit that fits, the smallest had been said from the order built without a limit (1F1B's memory):
    zbv on a 24-layer GPT for 4 ranks said 3.98 GiB while 2.4 GiB fit. It is now the least of that order's need and the
    need of the order built for the generator's least memory, and a limit a little below it fits no order."""
    from pipeloom.plan.costs.analytical import analytical_gpt_costs

    table = analytical_gpt_costs(layers=24, hidden=1024, heads=16, seq=1024, vocab=50257, microbatch_size=1,
                                 flops_per_second=100e12, bytes_per_second=2e12,
                                 link=Link(latency=2e-5, bandwidth=25e9))
    request = dict(num_ranks=4, global_batch=16, schedules=[name], microbatches=[16])
    with pytest.raises(NoPlanFits) as caught:
        plan_pipeline(table, memory_limit=2 * 2**30, **request)
    least = caught.value.smallest_limit
    plan = plan_pipeline(table, memory_limit=least, **request).plan  # the value returned fits
    assert max(plan.peak_memory) <= least * (1 + 1e-9)
    unlimited = plan_pipeline(table, **request).plan
    assert least < 0.8 * max(unlimited.peak_memory)
    for fraction in (0.97, 0.9):  # no limit below it fits (each builds its own order)
        with pytest.raises(NoPlanFits):
            plan_pipeline(table, memory_limit=least * fraction, **request)
