"""The multi-rank tests' launcher (ranks.run_ranks): what it reports for ranks that hang or die, and the
torch.export programs its ranks inherit from their server (a job's traces taken before the fork; a model the
ranks of two launches traced)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from launch_jobs import exit_on_rank_1, sleep, traced, traced_before_fork
from ranks import run_ranks


@pytest.mark.timeout(120)
def test_ranks_past_their_deadline_are_killed_and_the_next_launch_runs():
    assert run_ranks(2, sleep, 60.0, timeout=3) == {0: ("timeout", None), 1: ("timeout", None)}
    assert run_ranks(2, sleep, 0.0) == {0: ("ok", 0), 1: ("ok", 1)}


@pytest.mark.timeout(120)
def test_a_rank_that_exits_is_reported_dead_with_its_code():
    assert run_ranks(2, exit_on_rank_1, 3) == {0: ("ok", 0), 1: ("died", 3)}


@pytest.mark.timeout(120)
def test_traces_taken_before_the_fork_are_inherited():
    # widths no other test traces: this test process's server has not seen them
    assert run_ranks(2, traced_before_fork, 13) == {0: ("ok", True), 1: ("ok", True)}


@pytest.mark.timeout(120)
def test_a_model_two_launches_traced_is_traced_by_the_server_for_the_next():
    assert run_ranks(2, traced, 11) == {0: ("ok", False), 1: ("ok", False)}
    assert run_ranks(2, traced, 11) == {0: ("ok", False), 1: ("ok", False)}
    assert run_ranks(2, traced, 11) == {0: ("ok", True), 1: ("ok", True)}


@pytest.mark.timeout(120)
def test_a_model_a_launch_of_four_traced_is_traced_by_the_server_for_the_next():
    assert run_ranks(4, traced, 17) == {r: ("ok", False) for r in range(4)}
    assert run_ranks(4, traced, 17) == {r: ("ok", True) for r in range(4)}
