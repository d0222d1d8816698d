"""Lowering: stage -> piece mapping, replicas, message units in each sender's order, and refusals."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import pipeloom
from pipeloom.ir import Action
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.program import MODEL_INPUT, build_programs, model_pieces
from pipeloom.stages import Costs, stage_graph

CHAIN = {n: [[(MODEL_INPUT, 0)]] + [[(k - 1, 0)] for k in range(1, n)] for n in (2, 4, 8)}
OUT = {n: [(n - 1, 0)] for n in (2, 4, 8)}


@pytest.mark.parametrize(("name", "ranks", "pieces"), [
    ("1f1b", 4, 4), ("zbv", 2, 4), ("interleaved-1f1b", 2, 4), ("dualpipe", 4, 4), ("chimera", 2, 2),
])
def test_every_received_unit_is_sent_once_and_each_pair_keeps_its_order(name, ranks, pieces):
    schedule = pipeloom.build_schedule(name, ranks, 8)
    low = build_programs(schedule, CHAIN[pieces], OUT[pieces])
    sent = [uid for program in low.programs for step in program for uid in step.sends]
    received = [uid for program in low.programs for step in program for uid in step.recvs]
    assert sorted(sent) == sorted(set(sent)) == list(range(len(low.units)))
    assert set(received) <= set(sent)
    forward = [u for u in low.units if u.kind == "F"]
    assert {u.id for u in forward} <= set(received)
    for (src, dst), order in low.pair_order.items():
        assert list(order) == sorted(order)
        assert all(low.units[u].src == src and low.units[u].dst == dst for u in order)
    replicas = 2 if name in ("dualpipe", "chimera") else 1
    assert low.replicas == replicas and low.num_microbatches == 8
    assert sorted(low.piece_of) == sorted(list(range(pieces)) * replicas)


def test_two_replicas_take_alternate_microbatches():
    low = build_programs(pipeloom.build_schedule("dualpipe", 2, 8), CHAIN[2], OUT[2])
    first = {step.microbatch for p in low.programs for step in p if low.replica_of[step.action.stage] == 0}
    second = {step.microbatch for p in low.programs for step in p if low.replica_of[step.action.stage] == 1}
    assert first == {0, 2, 4, 6} and second == {1, 3, 5, 7}


def test_a_skip_connection_becomes_its_own_unit():
    skip = [[(MODEL_INPUT, 0)], [(0, 0)], [(1, 0), (0, 0)]]
    low = build_programs(pipeloom.build_schedule("1f1b", 3, 4), skip, [(2, 0)])
    pairs = {(u.producer, u.consumer) for u in low.units if u.kind == "F"}
    assert pairs == {(0, 1), (1, 2), (0, 2)}


def test_pieces_must_match_the_schedule():
    with pytest.raises(PipelineError, match="cut the model into 4 pieces"):
        build_programs(pipeloom.build_schedule("zbv", 2, 4), CHAIN[2], OUT[2])


def _schedule(problem, lists):
    ranks = tuple(tuple(Action.parse(a) for a in actions) for actions in lists)
    return pipeloom.Schedule(name="custom", problem=problem, num_microbatches=1, ranks=ranks)


def test_dataflow_against_the_schedule_order_is_refused():
    problem = stage_graph([Costs().stage(0)] * 3, num_ranks=1, edges=[(0, 2), (2, 1)])
    schedule = _schedule(problem, [["0F0", "2F0", "1F0", "1B0", "2B0", "0B0"]])
    with pytest.raises(PipelineError, match="model piece 2 reads piece 1.*stage 2 does not come after stage 1"):
        build_programs(schedule, CHAIN[2] + [[(1, 0)]], [(2, 0)])


def test_multi_rank_tasks_are_refused():
    problem = stage_graph([Costs().stage([0, 1])], num_ranks=2)
    schedule = _schedule(problem, [["0F0", "0B0"], ["0F0", "0B0"]])
    with pytest.raises(PipelineError, match="one rank"):
        build_programs(schedule, [[(MODEL_INPUT, 0)]], [(0, 0)])


@pytest.mark.parametrize(("name", "ranks", "pieces"), [
    ("1f1b", 4, 4), ("zbv", 2, 4), ("interleaved-1f1b", 2, 4), ("dualpipe", 4, 4), ("chimera", 2, 2),
])
def test_model_pieces_is_stages_over_replicas(name, ranks, pieces):
    schedule = pipeloom.build_schedule(name, ranks, 8)
    assert model_pieces(schedule) == pieces
    assert build_programs(schedule, CHAIN[pieces], OUT[pieces]).num_pieces == pieces


def test_a_lowered_schedule_posts_its_receives_where_they_stand():
    compute = pipeloom.build_schedule("zbv", 2, 4)
    plain = build_programs(compute, CHAIN[4], OUT[4])
    given = build_programs(pipeloom.lower(compute), CHAIN[4], OUT[4])
    assert given.explicit_posts and not plain.explicit_posts
    for rank in range(2):  # the same compute program and messages, with post points
        assert [(s.action, s.recvs, s.sends) for s in given.programs[rank]] == \
               [(s.action, s.recvs, s.sends) for s in plain.programs[rank]]
        posted = [uid for step in given.programs[rank] for uid in step.posts]
        received = [uid for step in plain.programs[rank] for uid in step.recvs]
        assert sorted(posted) == sorted(received) and len(set(posted)) == len(posted)
        for t, step in enumerate(given.programs[rank]):  # each posted at or before the action needing it
            needed = {uid for later in given.programs[rank][t:] for uid in later.recvs}
            assert set(step.posts) <= needed
