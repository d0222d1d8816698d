"""Overlapped forward+backward pairs (torch's ``OVERLAP_F_B``) and full backwards on split stages:
text, JSON and torch-CSV round trips (torch's own parser as the oracle), simulation (the pair's time
F + B by default, less what it hides, plus overhead; its memory the sum of its parts), validation, lowering
and pictures."""

from __future__ import annotations

import csv
import dataclasses
import io

import pytest

from pipeloom.errors import DeadlockError, OrderError, ScheduleError, ScheduleFormatError
from pipeloom.ir import (
    Action,
    Overlap,
    Schedule,
    paired_forward_backward,
    parse_action,
    schedule_from_csv,
    schedule_from_json,
    schedule_to_csv,
    schedule_to_json,
    task_actions,
)
from pipeloom.lowering import lower
from pipeloom.schedules import build_schedule
from pipeloom.schedules.dualpipe import dualpipev
from pipeloom.sim import simulate
from pipeloom.stages import Costs, Stage, stage_graph
from pipeloom.validate import validate

A = Action.parse


def _v_problem(f=1.0, b=2.0, w=1.0, memory=1.0, w_memory=0.0):
    """Stages 0 -> 1 on ranks 0 and 0 (one rank, both stages): the smallest place for a pair."""
    stage = Stage(ranks=0, f=f, b=b, w=w, memory=memory, w_memory=w_memory)
    return stage_graph([stage, stage], backward="split")


def _one_rank(actions: str, problem=None, m: int = 2) -> Schedule:
    return Schedule(name="t", problem=problem or _v_problem(), num_microbatches=m,
                    ranks=(tuple(parse_action(a) for a in actions.split()),))


# A pair per step: 0F1 with the backward of micro-batch 0 (1B0 is I+W of stage 1, 0B0 of stage 0).
PAIRED = "0F0 1F0 (0F1;1B0)OVERLAP_F_B (1F1;0B0)OVERLAP_F_B 1B1 0B1"


# ------------------------------------------------------------------------------------- text form


@pytest.mark.parametrize("text", ["(0F7;7B3)OVERLAP_F_B", "(12F0;3I11)OVERLAP_F_B"])
def test_text_round_trip_and_torch_parser_agree(text):
    pair = parse_action(text)
    assert type(pair) is Overlap and str(pair) == text and Overlap.parse(str(pair)) == pair
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    theirs = torch_schedules._Action.from_str(text)
    assert repr(theirs) == text
    assert [repr(a) for a in theirs.sub_actions] == [str(p) for p in pair.parts]


@pytest.mark.parametrize("text,match", [
    ("(0B1;1F0)OVERLAP_F_B", "first part must be a forward"),
    ("(0F1;1W0)OVERLAP_F_B", "second part must be a backward"),
    ("(0F1;1B0)OVERLAP", "expected \\(FORWARD;BACKWARD\\)OVERLAP_F_B"),
    ("(0F1)OVERLAP_F_B", "expected"),
    ("(0F1;1B0;2B0)OVERLAP_F_B", "expected"),
])
def test_bad_pairs_are_format_errors_that_show_the_form(text, match):
    with pytest.raises(ScheduleFormatError, match=match):
        parse_action(text)


# ----------------------------------------------------------------------------------- file forms


def test_json_round_trip_keeps_pairs_and_overhead():
    schedule = _one_rank(PAIRED)
    text = schedule_to_json(schedule)
    assert "overlap_overhead" not in text  # unset: files read by older versions as before
    assert schedule_from_json(text) == schedule
    costly = dataclasses.replace(schedule, problem=dataclasses.replace(schedule.problem, overlap_overhead=0.25))
    back = schedule_from_json(schedule_to_json(costly))
    assert back == costly and back.problem.overlap_overhead == 0.25


def test_old_json_without_the_overhead_key_loads():
    text = schedule_to_json(_one_rank("0F0 1F0 1I0 1W0 0I0 0W0 0F1 1F1 1I1 1W1 0I1 0W1"))
    assert schedule_from_json(text).problem.overlap_overhead == 0.0


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (4, 8), (3, 7)])
def test_dualpipev_csv_round_trip_and_torch_reads_it(p, m):
    schedule = dualpipev(p, m)
    text = schedule_to_csv(schedule)
    assert "OVERLAP_F_B" in text
    back = schedule_from_csv(text)
    assert back.ranks == schedule.ranks
    assert validate(back, ordered=True).makespan == validate(schedule, ordered=True).makespan
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    lines = csv.reader(io.StringIO(text))
    rows = {r: [torch_schedules._Action.from_str(c) for c in row] for r, row in enumerate(lines)}
    for r, row in rows.items():
        assert [repr(a) for a in row] == [str(a) for a in schedule.ranks[r]]
    torch_schedules._validate_schedule(rows, p, 2 * p, m)  # torch's own checks of a compute-only order


def test_lowered_pairs_save_as_compute_comms_and_load_back():
    schedule = lower(dualpipev(2, 4))
    text = schedule_to_csv(schedule)
    back = schedule_from_csv(text)
    assert back.ranks == schedule.ranks and back.lowered
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        cells = [repr(torch_schedules._Action.from_str(c)) for c in row]
        assert [c for c in cells if "REDUCE_GRAD" not in c] == [str(a) for a in schedule.ranks[r]]
        assert sum("REDUCE_GRAD" in c for c in cells) == 2  # one for each of the rank's stages


def test_reduce_grad_cells_follow_the_torch_installed(monkeypatch):
    """torch before 2.10 cannot read a REDUCE_GRAD cell (and scales the gradients without it): none is written
    where such a torch is installed, or when asked."""
    import importlib.metadata

    lowered = lower(dualpipev(2, 4))
    assert "REDUCE_GRAD" not in schedule_to_csv(lowered, reduce_grad=False)
    for installed, cells in (("2.9.1+cpu", False), ("2.10.0", True), ("2.13.0+cu130", True)):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=installed: v)
        assert ("REDUCE_GRAD" in schedule_to_csv(lowered)) == cells, installed


def test_torch_dualpipev_order_loads_and_validates():
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    order = object.__new__(torch_schedules.ScheduleDualPipeV)
    order.pp_group_size, order._n_microbatches = 4, 8
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in range(4):
        writer.writerow(order._calculate_single_rank_operations(rank))
    schedule = schedule_from_csv(out.getvalue())
    assert any(type(a) is Overlap for a in schedule.ranks[0])
    assert validate(schedule, ordered=True).makespan > 0


# ------------------------------------------------------------------------------------ simulator


def test_pair_takes_the_sum_of_its_parts_plus_overhead_and_sums_memory():
    problem = _v_problem(f=1.0, b=2.0, w=1.0, memory=1.0, w_memory=0.25)
    schedule = _one_rank(PAIRED, problem)
    timeline = simulate(schedule)
    durations = [end - start for _, start, end in timeline.events(0)]
    # F = 1, a full B on a split stage = I + W = 3: one device runs both, a pair takes 1 + 3 = 4
    assert durations == [1, 1, 4, 4, 3, 3]
    assert timeline.busy[0] == timeline.makespan == 16
    # memory: F +1; pair F +1 with B -(0.75 + 0.25) = 0 (applied at its start); B -1
    assert timeline.memory[0] == (1, 2, 2, 2, 1, 0)
    slow = simulate(schedule, overlap_overhead=0.5)
    assert [e - s for _, s, e in slow.events(0)] == [1, 1, 4.5, 4.5, 3, 3]
    carried = dataclasses.replace(schedule, problem=dataclasses.replace(problem, overlap_overhead=0.5))
    assert simulate(carried).makespan == slow.makespan == 17
    with pytest.raises(ValueError, match="overlap_overhead"):
        simulate(schedule, overlap_overhead=-1)


def test_pair_starts_when_both_parts_deps_are_met():
    # rank 0: stage 0, rank 1: stage 1; the pair on rank 0 waits for 1B0 (rank 1) as well as for 0F0.
    problem = stage_graph([Stage(ranks=0, f=1, b=1, w=1), Stage(ranks=1, f=1, b=5, w=1)], backward="split")
    schedule = Schedule(name="t", problem=problem, num_microbatches=2, ranks=(
        (A("0F0"), Overlap(A("0F1"), A("0B0")), A("0B1")),
        (A("1F0"), A("1B0"), A("1F1"), A("1B1")),
    ))
    timeline = validate(schedule, ordered=True)
    # 1B0 (I 5 + W 1) runs 2..8 after 1F0 (1..2), so the pair starts at 8 although its forward was ready at 1
    assert timeline.starts[0][1] == 8 and timeline.ends[0][1] == 8 + 1 + 2


def test_a_lowered_pair_receives_both_parts_first_and_sends_both_after():
    problem = stage_graph([Stage(ranks=0), Stage(ranks=1)], backward="split")
    schedule = Schedule(name="t", problem=problem, num_microbatches=2, ranks=(
        (A("0F0"), Overlap(A("0F1"), A("0B0")), A("0B1")),
        (A("1F0"), A("1B0"), A("1F1"), A("1B1")),
    ))
    low = lower(schedule)
    assert [str(a) for a in low.ranks[0]] == [
        "0F0", "0SEND_F0", "0RECV_B0", "(0F1;0B0)OVERLAP_F_B", "0SEND_F1", "0RECV_B1", "0B1"]
    assert simulate(low).makespan == simulate(schedule).makespan


# ------------------------------------------------------------------------------------ validator


def test_pair_whose_backward_depends_on_its_forward_deadlocks():
    schedule = _one_rank("0F0 1F0 0F1 (1F1;1B1)OVERLAP_F_B 1B0 0B0 0B1")
    with pytest.raises(DeadlockError, match=r"\(1F1;1B1\)OVERLAP_F_B waits for 1F1.*run at once"):
        validate(schedule)


def test_deadlock_through_a_pair_on_two_ranks_is_caught():
    problem = stage_graph([Stage(ranks=0), Stage(ranks=1)], backward="split")
    schedule = Schedule(name="t", problem=problem, num_microbatches=2, ranks=(
        (A("0F0"), Overlap(A("0F1"), A("0B0")), A("0B1")),
        (A("1F0"), A("1F1"), A("1B1"), A("1B0")),  # 1F1 needs 0F1, which waits in the pair for 1B0
    ))
    with pytest.raises(DeadlockError, match=r"rank 0 step 1: \(0F1;0B0\)OVERLAP_F_B waits for 1I0"):
        validate(schedule)


def test_a_pair_part_that_runs_twice_or_is_missing_is_named():
    with pytest.raises(ScheduleError, match=r"0F1 \(in \(0F1;1B0\)OVERLAP_F_B\) runs twice"):
        validate(_one_rank("0F0 1F0 0F1 (0F1;1B0)OVERLAP_F_B (1F1;0B0)OVERLAP_F_B 1B1 0B1"))
    with pytest.raises(ScheduleError, match="never runs 1 action"):
        validate(_one_rank("0F0 1F0 (0F1;1B0)OVERLAP_F_B 1F1 0I0 1B1 0B1"))
    with pytest.raises(ScheduleError, match="its part 5F1"):
        validate(_one_rank("0F0 1F0 (5F1;1B0)OVERLAP_F_B (1F1;0B0)OVERLAP_F_B 1B1 0B1"))


def test_memory_limit_sees_the_pair_as_one_action():
    problem = dataclasses.replace(_v_problem(), memory_limit=2.0)
    validate(_one_rank(PAIRED, problem))  # peak 2: the pair frees what it takes at once
    sequential = "0F0 1F0 0F1 1B0 1F1 0B0 1B1 0B1"
    with pytest.raises(ScheduleError, match="0F1 raises held memory to 3"):
        validate(_one_rank(sequential, problem))


def test_order_check_counts_a_pairs_backward_and_a_b_as_its_w():
    # 1B0 on split stage 1 produces its W after 1W1: out of micro-batch order
    with pytest.raises(OrderError, match=r"1B0 runs after 1W1"):
        validate(_one_rank("0F0 1F0 0F1 1F1 1I1 1W1 1B0 0B0 0B1"), ordered=True)
    # the pair's backward 0B0 comes after 0B1
    with pytest.raises(OrderError, match=r"\(0F2;0B0\)OVERLAP_F_B runs after 0W1"):
        validate(_one_rank("0F0 1F0 0F1 1F1 1B0 1B1 0B1 (0F2;0B0)OVERLAP_F_B 1F2 1B2 0B2", m=3), ordered=True)


# ------------------------------------------------------------------------ B on a split stage


def test_full_backward_on_a_split_stage_is_its_i_and_w():
    problem = _v_problem(f=1.0, b=2.0, w=0.5, memory=1.0, w_memory=0.25)
    schedule = _one_rank("0F0 1F0 1B0 0I0 0W0", problem, m=1)
    assert task_actions(problem, A("1B0")) == (A("1I0"), A("1W0"))
    timeline = validate(schedule, ordered=True)
    assert [e - s for _, s, e in timeline.events(0)] == [1, 1, 2.5, 2, 0.5]
    assert timeline.memory[0] == (1, 2, 1, 0.25, 0)
    with pytest.raises(ScheduleError, match=r"1I0 \(in 1B0\) runs twice|1B0 \(its part 1I0\)|runs twice"):
        validate(_one_rank("0F0 1F0 1I0 1B0 0I0 0W0", problem, m=1))


# ------------------------------------------------------------------------------------- pictures


def test_pictures_draw_a_pair_as_one_labelled_box_of_its_own_colour(tmp_path):
    pytest.importorskip("matplotlib")
    from pipeloom.viz import draw_timeline, render_timeline, timeline_figure
    from pipeloom.viz.style import stage_color

    timeline = simulate(dualpipev(2, 4))
    ax = timeline_figure(timeline).axes[0]  # the timeline panel (the memory strip follows)
    labels = {t.get_text() for t in ax.texts}
    assert "0:3|3:1" in labels  # rank 0's (0F3;3B1)OVERLAP_F_B: one replica, IR micro-batches are real
    boxes = sum(len(c.get_paths()) for c in ax.collections if c.get_facecolor().size
                and tuple(c.get_facecolor()[0][:3].round(3)) in {
                    tuple(round(int(stage_color("O", k)[i:i + 2], 16) / 255, 3) for i in (1, 3, 5))
                    for k in range(4)})
    assert boxes == sum(type(a) is Overlap for actions in timeline.schedule.ranks for a in actions)
    draw_timeline(timeline, tmp_path / "pairs.svg")
    assert "overlapped F&amp;B pair" in (tmp_path / "pairs.svg").read_text()
    assert "O" in render_timeline(timeline, width=80)


def test_sequential_pairs_runs_each_pair_forward_then_backward_and_the_planner_prices_that():
    from pipeloom.ir import Overlap, sequential_pairs
    from pipeloom.plan.costs.parts import Piece
    from pipeloom.plan.costs.table import CostTable
    from pipeloom.plan.partitioning.shape import library_schedule

    schedule = build_schedule("dualpipev", 4, 8)
    flat = sequential_pairs(schedule)
    assert any(type(a) is Overlap for row in schedule.ranks for a in row)
    assert not any(type(a) is Overlap for row in flat.ranks for a in row)
    for row, flat_row in zip(schedule.ranks, flat.ranks):  # each pair became its forward then backward
        assert [p for a in row for p in (a.parts if type(a) is Overlap else (a,))] == list(flat_row)
    overlapped = build_schedule("dualpipev", 4, 8, costs=Costs(overlap=1))  # pairs as max(F, B)
    assert validate(flat, ordered=True).makespan > simulate(overlapped).makespan  # no overlap: longer
    assert sequential_pairs(build_schedule("1f1b", 2, 4)) == build_schedule("1f1b", 2, 4)
    pieces = tuple(Piece(name=f"b.{k}", f=1.0, i=1.0, w=1.0, activation_bytes=1.0, w_activation_bytes=0.0,
                         param_bytes=1.0, output_bytes=1.0) for k in range(8))
    planned = library_schedule(CostTable(pieces=pieces, microbatch_size=1), "dualpipev", 4, 8, memory_limit=None)
    assert not any(type(a) is Overlap for row in planned.ranks for a in row)


@pytest.mark.parametrize(("pp", "vp", "m"), [(2, 2, 8), (3, 3, 6), (4, 2, 4), (4, 4, 16), (8, 2, 16), (8, 4, 8)])
def test_interleaved_1f1b_paired_as_megatron_overlaps_the_expert_all_to_all(pp, vp, m):
    """Megatron-Core's combined 1F1B (``overlap_moe_expert_parallel_comm``): each backward with the forward its rank
    runs next, of another micro-batch. The pairs validate and never deadlock (pairing each forward with the
    backward after it deadlocked 9 of 48 interleaved schedules: a rank's pair waiting on its neighbour's pair,
    which waited on it); without communication the makespan is the unpaired one, and with it the pairs hide some
    of it, never more than all of it."""
    built = build_schedule("interleaved-1f1b", pp, m, stages_per_rank=vp)
    paired = paired_forward_backward(built)
    pairs = [a for row in paired.ranks for a in row if type(a) is Overlap]
    assert pairs and all(p.forward.microbatch != p.backward.microbatch for p in pairs)
    assert sorted(task for row in paired.ranks for a in row for task in task_actions(paired.problem, a)) == sorted(
        task for row in built.ranks for a in row for task in task_actions(built.problem, a))
    validate(paired)
    assert simulate(paired).makespan == pytest.approx(simulate(built).makespan)
    tasks = tuple(dataclasses.replace(t, comm=0.4 * t.duration) for t in built.problem.tasks)
    problem = dataclasses.replace(built.problem, tasks=tasks)
    with_comm = simulate(dataclasses.replace(paired, problem=problem)).makespan
    unpaired = simulate(dataclasses.replace(built, problem=problem)).makespan
    hideable = sum(problem.task(p.forward.task).comm + problem.task(p.backward.task).comm for p in pairs)
    assert unpaired - hideable <= with_comm < unpaired


def test_pairing_leaves_split_backwards_and_pairs_alone():
    for built in (build_schedule("zb-h1", 4, 8), dualpipev(4, 8)):
        assert paired_forward_backward(built).ranks == built.ranks
