"""Lowering (docs/design.md §2): the ``Comm`` action type, ``lower(schedule)``, and the simulation of lowered
schedules.

Oracles: the text forms torch prints (``1SEND_F0``); closed-form counts of communication actions
(a chain of p ranks has 2(p - 1) cross-rank edges, each a send and a receive per micro-batch);
the compute-only simulator (with latency 0 a lowered schedule runs exactly as long, with the same
memory); hand-computed times of sends and receives.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeloom import (
    Action,
    Comm,
    Costs,
    LoweringError,
    Schedule,
    ScheduleError,
    Stage,
    lower,
    simulate,
    stage_graph,
    validate,
)
from pipeloom.errors import ScheduleFormatError
from pipeloom.ir import (
    COMM_KINDS,
    parse_action,
    schedule_from_csv,
    schedule_from_json,
    schedule_to_csv,
    schedule_to_json,
)
from pipeloom.plan.noise import expected_makespan
from pipeloom.schedules import build_schedule
from pipeloom.search.greedy import list_schedule
from pipeloom.search.placements import placement

# (name, ranks, micro-batches, options): built-ins of every placement family.
BUILTINS = [
    ("gpipe", 4, 8, {}),
    ("1f1b", 4, 8, {}),
    ("1f1b", 2, 1, {}),
    ("interleaved-1f1b", 4, 8, {"stages_per_rank": 2}),
    ("zb-h1", 4, 8, {}),
    ("zbv", 4, 8, {}),
    ("zbv", 2, 4, {}),
    ("dualpipev", 4, 8, {}),
    ("dualpipe", 4, 8, {}),
    ("chimera", 4, 8, {}),
]


def _compute(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(a for a in actions if type(a) is not Comm) for actions in schedule.ranks)


def _comms(schedule: Schedule) -> list[Comm]:
    return [a for actions in schedule.ranks for a in actions if type(a) is Comm]


# ------------------------------------------------------------------------------------- the type


def test_comm_text_is_torchs():
    assert str(Comm(1, "SEND_F", 0)) == "1SEND_F0"
    assert str(Comm(2, "RECV_B", 13)) == "2RECV_B13"
    assert Comm.parse(" 3SEND_B7 ") == Comm(3, "SEND_B", 7)
    assert Comm(1, "SEND_F", 0).is_send and not Comm(1, "RECV_F", 0).is_send
    assert Comm(1, "SEND_B", 0).direction == "B" and Comm(1, "RECV_F", 0).direction == "F"


@given(st.integers(0, 10**6), st.sampled_from(COMM_KINDS), st.integers(0, 10**6))
def test_comm_text_round_trip(stage, kind, microbatch):
    comm = Comm(stage, kind, microbatch)
    assert Comm.parse(str(comm)) == comm
    assert parse_action(str(comm)) == comm and type(parse_action(str(comm))) is Comm


def test_parse_action_reads_both_types():
    assert parse_action("2F0") == Action(2, "F", 0) and type(parse_action("2F0")) is Action
    assert parse_action("0RECV_B1") == Comm(0, "RECV_B", 1)


@pytest.mark.parametrize("text", ["1SEND_F", "SEND_F0", "1SEND_X0", "1SEND_F0x", "1UNSHARD", "-1RECV_F0"])
def test_bad_comm_text_is_a_format_error_with_an_example(text):
    with pytest.raises(ScheduleFormatError, match=r"e\.g\. '1SEND_F0'"):
        Comm.parse(text)


def test_compute_only_schedules_are_not_lowered():
    schedule = build_schedule("1f1b", 4, 8)
    assert not schedule.lowered and lower(schedule).lowered


# ------------------------------------------------------------------------------------- lowering


@pytest.mark.parametrize(("name", "ranks", "microbatches", "options"), BUILTINS,
                         ids=[f"{n}-p{p}-m{m}" for n, p, m, _ in BUILTINS])
def test_lowered_builtins_validate_and_keep_their_compute(name, ranks, microbatches, options):
    schedule = build_schedule(name, ranks, microbatches, **options)
    lowered = lower(schedule)
    assert _compute(lowered) == schedule.ranks
    timeline = validate(lowered, ordered=True)
    plain = simulate(schedule)
    # latency 0: a receive ends when its data is made, so nothing moves
    assert timeline.makespan == plain.makespan
    assert timeline.peak_memory == plain.peak_memory and timeline.busy == plain.busy


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 1), (4, 8), (5, 3)])
def test_a_chain_has_a_send_and_a_receive_per_edge_direction_and_microbatch(ranks, microbatches):
    lowered = lower(build_schedule("1f1b", ranks, microbatches))
    comms = _comms(lowered)
    assert len(comms) == 4 * (ranks - 1) * microbatches == len(set(comms))
    assert {c for c in comms if c.kind == "SEND_F"} == {Comm(s, "SEND_F", m) for s in range(ranks - 1)
                                                       for m in range(microbatches)}
    assert {c for c in comms if c.kind == "RECV_B"} == {Comm(s, "RECV_B", m) for s in range(ranks - 1)
                                                       for m in range(microbatches)}


def test_sends_follow_their_data_and_receives_precede_their_use_in_1f1b():
    """torch's placement: ``1RECV_F0 1F0 1SEND_F0`` (1F1B needs no receive moved for the pair order)."""
    lowered = lower(build_schedule("1f1b", 4, 8))
    head = "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1"
    assert lowered.ranks[1][:6] == tuple(map(parse_action, head.split()))
    for actions in lowered.ranks:
        for i, action in enumerate(actions):
            if type(action) is Comm:
                neighbour = actions[i - 1] if action.is_send else actions[i + 1]
                assert (neighbour.stage, neighbour.microbatch) == (action.stage, action.microbatch)


def test_a_receive_comes_early_where_the_pair_order_needs_it():
    """zbv p=2: rank 0 sends 0F2's output before 3I0's gradients, so rank 1 receives 1RECV_F2 before
    2RECV_B0 although 2I0 (which needs the gradients) runs before 1F2; validate checks the pair order."""
    lowered = lower(build_schedule("zbv", 2, 4))
    text = " ".join(map(str, lowered.ranks[1]))
    assert "1RECV_F2 2RECV_B0 2I0 1I0 1SEND_B0 1F2" in text and "1RECV_F2 1F2" not in text
    validate(lowered, ordered=True)


def test_edges_within_a_rank_carry_nothing():
    one_rank = build_schedule("zbv", 1, 4)  # stages 0 and 1 both on rank 0
    assert lower(one_rank).ranks == one_rank.ranks
    lowered = lower(build_schedule("zbv", 4, 8))  # the V turns on rank 3: stage 3 -> 4 stays there
    assert not {Comm(3, "SEND_F", 0), Comm(4, "RECV_F", 0), Comm(4, "SEND_B", 0), Comm(3, "RECV_B", 0)} & set(
        _comms(lowered))


@pytest.mark.parametrize("shape", ["xshape", "vshape", "alphafold"])
@pytest.mark.parametrize("split", [False, True])
def test_lowered_dag_placements_validate(shape, split):
    """xshape runs two chains in opposite directions (a DAG of stages, not one chain)."""
    schedule = list_schedule(placement(shape, 4, split_backward=split), 6)
    lowered = lower(schedule)
    assert _compute(lowered) == schedule.ranks
    assert validate(lowered, ordered=True).makespan == simulate(schedule).makespan


def test_multi_rank_tasks_are_refused_by_name():
    schedule = list_schedule(placement("mshape", 4), 2)
    with pytest.raises(LoweringError, match=r"task 0F runs on ranks \[0, 1, 2, 3\].*one rank"):
        lower(schedule)


def test_lowering_twice_is_refused():
    lowered = lower(build_schedule("1f1b", 2, 2))
    with pytest.raises(LoweringError, match=r"already lowered \(rank 0 step 1: 0SEND_F0\).*compute-only"):
        lower(lowered)


def test_a_send_covers_every_remote_consumer():
    """Stage 0 on rank 0 feeds stage 1 (rank 1) and stage 2 (rank 2): one 0SEND_F0."""
    problem = stage_graph([Stage(ranks=r) for r in range(3)], edges=[(0, 1), (0, 2)], backward="full")
    schedule = Schedule(name="fan", problem=problem, num_microbatches=1, ranks=[
        [Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "F", 0), Action(1, "B", 0)],
        [Action(2, "F", 0), Action(2, "B", 0)]])
    lowered = lower(schedule)
    assert lowered.to_text() == ("rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\n"
                                 "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n"
                                 "rank 2: 2RECV_F0 2F0 2B0 2SEND_B0")
    validate(lowered)


def test_no_receive_order_fitting_the_sends_is_a_lowering_error():
    """2RECV_F0 takes stage 0's then stage 1's values, but rank 0 sends stage 1's first."""
    problem = stage_graph([Stage(ranks=0), Stage(ranks=0), Stage(ranks=1)], edges=[(0, 2), (1, 2)],
                          backward="none")
    schedule = Schedule(name="crossed", problem=problem, num_microbatches=1,
                        ranks=[[Action(1, "F", 0), Action(0, "F", 0)], [Action(2, "F", 0)]])
    validate(schedule)
    with pytest.raises(LoweringError, match=r"rank 1 cannot receive 2RECV_F0 in pair order"):
        lower(schedule)


# ----------------------------------------------------------------------------------- simulation


def test_sends_and_receives_take_their_own_time():
    """1F1B, 2 ranks, 1 micro-batch, latency 0.5 (times worked out by hand).

    rank 0: 0F0 [0, 1], 0SEND_F0 [1, 1.5], 0RECV_B0 [1.5, 5] (waits for 1SEND_B0), 0B0 [5, 7];
    rank 1: 1RECV_F0 [0, 1.5], 1F0 [1.5, 2.5], 1B0 [2.5, 4.5], 1SEND_B0 [4.5, 5].
    """
    lowered = lower(build_schedule("1f1b", 2, 1, costs=Costs(comm=0.5)))
    timeline = validate(lowered)
    assert [(str(a), s, e) for a, s, e in timeline.events(0)] == [
        ("0F0", 0, 1), ("0SEND_F0", 1, 1.5), ("0RECV_B0", 1.5, 5), ("0B0", 5, 7)]
    assert [(str(a), s, e) for a, s, e in timeline.events(1)] == [
        ("1RECV_F0", 0, 1.5), ("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5), ("1SEND_B0", 4.5, 5)]
    assert timeline.makespan == 7 and timeline.busy == (3, 3)  # communication is not work
    assert timeline.bubble_ratio == 1 - 6 / 14


def test_a_send_to_two_ranks_takes_one_latency_per_message():
    """0SEND_F0 sends to stage 1 then stage 2: arrivals at 1.5 and 2.0, the send ends at 2.0."""
    problem = stage_graph([Stage(ranks=r) for r in range(3)], edges=[(0, 1), (0, 2)], backward="none",
                          comm_latency=0.5)
    schedule = Schedule(name="fan", problem=problem, num_microbatches=1,
                        ranks=[[Action(0, "F", 0)], [Action(1, "F", 0)], [Action(2, "F", 0)]])
    timeline = validate(lower(schedule))
    assert list(timeline.ends[0]) == [1.0, 2.0]
    assert list(zip(timeline.starts[1], timeline.ends[1])) == [(0, 1.5), (1.5, 2.5)]
    assert list(zip(timeline.starts[2], timeline.ends[2])) == [(0, 2.0), (2.0, 3.0)]


def test_latency_costs_the_sender_time_on_its_own_timeline():
    """With latency, each send occupies its rank: the lowered makespan is at least the compute-only
    one and the memory is unchanged."""
    schedule = build_schedule("1f1b", 4, 8, costs=Costs(comm=0.25))
    plain, timeline = simulate(schedule), validate(lower(schedule))
    assert timeline.makespan > plain.makespan
    assert timeline.peak_memory == plain.peak_memory
    sends = [e - s for r in range(4) for a, s, e in timeline.events(r) if type(a) is Comm and a.is_send]
    assert sends and all(d == 0.25 for d in sends)


def test_expected_makespan_refuses_a_lowered_schedule():
    with pytest.raises(ScheduleError, match="before lower"):
        expected_makespan(lower(build_schedule("1f1b", 2, 2)), 0.1)


# -------------------------------------------------------------------------------------- files


@pytest.mark.parametrize(("name", "options"), [("1f1b", {}), ("zbv", {}),
                                               ("interleaved-1f1b", {"stages_per_rank": 2})])
def test_compute_comms_csv_round_trip(name, options):
    lowered = lower(build_schedule(name, 4, 8, **options))
    back = schedule_from_csv(schedule_to_csv(lowered), name=lowered.name)
    assert back.ranks == lowered.ranks and back.lowered
    assert validate(back, ordered=True).makespan == simulate(lowered).makespan


def test_csv_reader_skips_torchs_fsdp_and_reduce_actions():
    text = "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n1UNSHARD,1RECV_F0,1F0,1B0,1SEND_B0\n"
    assert schedule_from_csv(text).ranks == lower(build_schedule("1f1b", 2, 1)).ranks


def test_json_holds_compute_only_schedules():
    lowered = lower(build_schedule("1f1b", 2, 2))
    with pytest.raises(ScheduleFormatError, match="compute_comms"):
        schedule_to_json(lowered)
    text = schedule_to_json(build_schedule("1f1b", 2, 2)).replace('"0F1"', '"0SEND_F0"')
    with pytest.raises(ScheduleFormatError, match=r"ranks\[0\]: 0SEND_F0 is a communication action"):
        schedule_from_json(text)
