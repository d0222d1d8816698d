"""Faults on 2 and 3 gloo ranks (spawned CPU processes): a failed rank's message reaches every rank
within 5 s although the engines wait up to 60 s and the failed process lingers; ranks given different
steps all raise StepMismatchError naming both ranks and values before anything moves, and can go on;
close() ends the helper threads. Oracles: the wall time of the failing step, the messages' texts."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fault_jobs import HELPER_THREADS, close_threads, lingering_fault, mismatch
from ranks import run_ranks

BOUND_S = 10.0  # docs/design.md §5: a failure reaches every rank within seconds (about 1 s alone; 8.3 s was seen
# once on the 2-core CI with the whole suite running beside it)
LINGER_S = 12.0  # longer than the bound: the others must not learn of the failure from its exit


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["forward", "end", "die"])
def test_a_failure_reaches_every_rank_within_seconds_while_the_failed_process_lingers(where):
    results = run_ranks(3, lingering_fault, where, 1, LINGER_S, timeout=120)
    if where == "die":
        assert results[1][0] == "died", results[1]
    else:
        status, report = results[1]
        assert status == "ok", report
        assert "injected fault" in report["message"], report
    for rank in (0, 2):
        status, report = results[rank]
        assert status == "ok", report
        assert report["message"] is not None, f"rank {rank} finished although rank 1 failed"
        assert report["seconds"] < BOUND_S, (rank, report)
        if where != "die":  # the message names the failed rank and carries its own words
            assert "rank 1 failed" in report["message"] and "injected fault" in report["message"], report


CASES = {  # what rank 1 alone changes -> (field named, rank 0's value, rank 1's value)
    "rows": ("inputs", "float32[16, 16]", "float32[32, 16]"),
    "dtype": ("inputs", "float32[16, 16]", "float64[16, 16]"),
    "target": ("target", "int64[16]", "int32[16]"),
    "microbatches": ("micro-batch count", "8", "4"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", sorted(CASES))
def test_ranks_given_different_steps_all_name_both_ranks_and_values(what):
    field, ours, theirs = CASES[what]
    results = run_ranks(2, mismatch, what, timeout=90)
    expected = (f"StepMismatchError: ranks disagree on this step's {field}: "
                f"rank 0 has {ours}; rank 1 has {theirs};")
    for rank, (status, report) in results.items():
        assert status == "ok", (rank, report)  # no gloo abort, no hang
        first, odd, again = report["outcomes"]
        assert odd is not None and odd.startswith(expected), (rank, odd)
        if what == "microbatches":  # every step differs, and says so at once
            assert first == again == odd, (rank, report)
        else:  # nothing moved: the engine goes on with agreeing steps
            assert first is None and again is None, (rank, report)
        assert report["seconds"] < 30, (rank, report)  # never the engine's 60 s timeout


@pytest.mark.timeout(120)
def test_close_ends_the_helper_threads_and_refuses_later_steps():
    results = run_ranks(2, close_threads, timeout=90)
    for rank, (status, report) in results.items():
        assert status == "ok", (rank, report)
        assert report["before"] == sorted(HELPER_THREADS), (rank, report)
        assert report["after"] == [], (rank, report)
        assert report["refused"] is not None and "closed" in report["refused"], (rank, report)
