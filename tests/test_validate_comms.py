"""Validation of lowered schedules: one hand-corrupted lowered 1F1B per kind of communication error.

Oracle: the lowered 1F1B on 2 ranks, 3 micro-batches (itself valid), edited by hand; every error
must be a specific ScheduleError subclass naming the rank, the step, the action and the fix, and
show the grid with the failing step marked.
"""

from __future__ import annotations

import pytest

from pipeloom import CommError, DeadlockError, Schedule, ScheduleError, lower, validate
from pipeloom.ir import parse_action
from pipeloom.schedules import build_schedule

# lower(build_schedule("1f1b", 2, 3)):
RANK0 = "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2"
RANK1 = "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2"


def _lowered(rank0: str = RANK0, rank1: str = RANK1) -> Schedule:
    base = build_schedule("1f1b", 2, 3)
    ranks = [tuple(map(parse_action, row.split())) for row in (rank0, rank1)]
    return Schedule(name="hand", problem=base.problem, num_microbatches=3, ranks=ranks)


def _assert_error(error: BaseException, *words: str) -> None:
    message = str(error)
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"
    assert "<-- here" in message, "the grid must mark the failing step"


def test_the_hand_written_lowering_is_lowers_own():
    assert _lowered().ranks == lower(build_schedule("1f1b", 2, 3)).ranks
    validate(_lowered(), ordered=True)


@pytest.mark.parametrize(
    ("rank0", "rank1", "words"),
    [
        # unmatched send: rank 1 never receives 0F1's output.
        (RANK0, RANK1.replace("1RECV_F1 ", ""),
         ["rank 0 step 3", "0SEND_F1 sends stage 0's values for stage 1 (micro-batch 1) to rank 1",
          "unmatched send", "add 1RECV_F1 on rank 1 before 1F1"]),
        # unmatched receive: rank 1 never sends 1B2's gradients.
        (RANK0, RANK1.replace(" 1SEND_B2", ""),
         ["rank 0 step 10", "0RECV_B2 waits for stage 1's gradients for stage 0 (micro-batch 2) from rank 1",
          "unmatched receive", "add 1SEND_B2 on rank 1 after 1B2"]),
        # pair order: rank 1 receives micro-batch 2's values before micro-batch 1's.
        (RANK0, RANK1.replace("1RECV_F1 1F1", "1RECV_F2 1RECV_F1 1F1").replace("1RECV_F2 1F2", "1F2"),
         ["rank 1 step 4", "pair order", "rank 0's message #2 to rank 1 is stage 0's values for stage 1 "
          "(micro-batch 1) (0SEND_F1, rank 0 step 3)", "receive #2 from rank 0 takes", "(1RECV_F2)",
          "reorder the receives on rank 1"]),
        # a send before its data is made.
        (RANK0.replace("0F0 0SEND_F0", "0SEND_F0 0F0"), RANK1,
         ["rank 0 step 0", "0SEND_F0 sends the output of 0F0 before 0F0 runs", "right after 0F0"]),
        # a compute action before its receive.
        (RANK0, RANK1.replace("1RECV_F2 1F2", "1F2 1RECV_F2"),
         ["rank 1 step 8", "1F2 needs data from rank(s) [0]", "put 1RECV_F2 before 1F2"]),
        # a receive on the wrong rank.
        (RANK0 + " 1RECV_F0", RANK1.replace("1RECV_F0 ", ""),
         ["rank 0 step 12", "1RECV_F0 is not rank 0's: stage 1 runs on rank 1"]),
        # a receive that carries nothing: stage 0 has no producer.
        ("0RECV_F0 " + RANK0, RANK1, ["rank 0 step 0", "0RECV_F0 carries nothing", "remove it"]),
        # a send twice.
        (RANK0.replace("0SEND_F0", "0SEND_F0 0SEND_F0"), RANK1, ["rank 0 step 2", "0SEND_F0 runs twice"]),
        # a micro-batch that does not exist.
        (RANK0 + " 0SEND_F3", RANK1, ["rank 0 step 12", "micro-batch 3, outside 0..2"]),
    ],
    ids=["unmatched-send", "unmatched-receive", "pair-order", "send-before-data", "receive-after-use",
         "wrong-rank", "carries-nothing", "duplicate", "microbatch"],
)
def test_each_communication_error_names_rank_step_action_and_fix(rank0, rank1, words):
    with pytest.raises(CommError) as caught:
        validate(_lowered(rank0, rank1))
    _assert_error(caught.value, *words)


def test_deadlock_through_communication():
    """Rank 0 waits for 1B0's gradients before sending 0F0's output, which rank 1 waits for first:
    every send and receive matches and comes in a legal place, but the lists cannot run."""
    rank0 = RANK0.replace("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0", "0F0 0RECV_B0 0SEND_F0 0F1 0SEND_F1")
    with pytest.raises(DeadlockError) as caught:
        validate(_lowered(rank0))
    _assert_error(caught.value, "deadlock",
                  "rank 0 step 1: 0RECV_B0 waits for stage 1's gradients for stage 0 (micro-batch 0) from "
                  "rank 1, whose 1SEND_B0 never runs first",
                  "rank 1 step 0: 1RECV_F0 waits for stage 0's values for stage 1 (micro-batch 0) from "
                  "rank 0",
                  "sends do not wait")


def test_sends_do_not_block():
    """Rank 1 sends all its gradients late; rank 0 posts every send before any receive: valid."""
    rank0 = "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2"
    timeline = validate(_lowered(rank0), ordered=True)
    assert timeline.makespan > 0


def test_a_lowered_schedule_still_has_its_compute_checked():
    with pytest.raises(ScheduleError, match="never runs 1 action"):
        validate(_lowered(RANK0.replace(" 0RECV_B2 0B2", " 0RECV_B2")))
