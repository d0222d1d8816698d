"""The simulated slower link (:mod:`pipeloom.runtime.parallel.link`): its stated duration, its checks, that a held
all-to-all on 2 gloo ranks completes no earlier than that duration after it was issued while its thread sleeps, with
values and gradients bitwise those of the same all-to-all without it; that an overlapped pair's two held
all-to-alls wait at once; and that dualpipev with overlapped pairs on (pp 2, ep 2) under a link stays bitwise equal
to the pairs run part after part without one."""

from __future__ import annotations

import math
import time

import pytest

torch = pytest.importorskip("torch")

from link_jobs import held_exchange, held_pair
from ranks import run_ranks

from pipeloom.runtime import Parallelism, PipelineError, SimulatedLink
from pipeloom.runtime.parallel.link import link_bytes


def _ok(results: dict) -> dict:
    bad = {r: str(v)[-2000:] for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    return {r: v[1] for r, v in results.items()}


def test_the_stated_duration_and_bytes():
    link = SimulatedLink(latency=0.002, bandwidth=1e6)
    assert link.duration(0) == 0.002
    assert link.duration(3000) == pytest.approx(0.005)
    assert SimulatedLink(latency=0.5).duration(10**9) == 0.5  # infinite bandwidth: latency only
    # rank 1 sends 2 + 4 rows to ranks 0 and 2 (keeps 3), receives 5 + 1: the larger direction, 6 rows of 16 B
    assert link_bytes([2, 3, 4], [5, 7, 1], 1, 16) == 96
    assert link_bytes([1, 9], [2, 3], 0, 4) == 36  # sends 9 rows to rank 1, receives 3


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"latency": -1.0}, "latency=-1.0"),
    ({"bandwidth": 0}, "never completes"),
    ({"latency": math.inf}, "never completes"),
    ({"latency": math.nan}, "latency=nan"),
    ({"bandwidth": True}, "bandwidth=True"),
])
def test_a_bad_link_is_refused(kwargs, message):
    with pytest.raises(PipelineError, match=message):
        SimulatedLink(**kwargs)


def test_the_link_is_an_option_off_by_default():
    assert Parallelism().simulated_link is None
    with pytest.raises(PipelineError, match="takes a SimulatedLink"):
        Parallelism(simulated_link=0.001)  # type: ignore[arg-type]


def test_hold_sleeps_until_the_stated_time_after_issue():
    link = SimulatedLink(latency=0.3)
    issued = time.perf_counter()
    cpu = time.thread_time()
    slept = link.hold(issued, 0)
    assert time.perf_counter() - issued >= 0.3
    assert 0 < slept <= 0.3
    assert time.thread_time() - cpu < 0.1  # it sleeps: no CPU
    assert link.hold(time.perf_counter() - 1.0, 0) == 0.0  # issued long ago: complete already


@pytest.mark.timeout(300)
def test_a_held_all_to_all_completes_after_the_stated_time_and_bitwise_equal():
    latency, bandwidth = 0.4, 4000.0  # each rank sends 2 rows of 32 B to the other and receives 2: 16 ms
    results = _ok(run_ranks(2, held_exchange, latency, bandwidth, timeout=240))
    for rank, found in results.items():
        assert found["equal"], (rank, found)
        assert found["bytes"] == 2 * 32, (rank, found)
        assert found["stated"] == pytest.approx(latency + found["bytes"] / bandwidth)
        assert found["wall"] >= found["stated"], (rank, found)
        assert found["cpu"] < 0.5 * found["stated"], (rank, found)  # the wait slept


@pytest.mark.timeout(300)
def test_an_overlapped_pair_waits_for_its_two_held_all_to_alls_at_once():
    latency = 1.0
    results = _ok(run_ranks(2, held_pair, latency, timeout=240))
    for rank, found in results.items():
        assert found["turns"] > 0, (rank, found)
        assert found["sequential"] >= 2 * latency, (rank, found)
        # the second part issues its all-to-all while the first one's is held: both complete about latency after
        # the first was issued (the margin is for two tiny gloo exchanges on a loaded machine)
        assert latency <= found["interleaved"] < 1.75 * latency, (rank, found)


@pytest.mark.timeout(900)
def test_overlapped_pairs_under_a_simulated_link_stay_bitwise_equal():
    from ep_jobs import ep_overlap

    link = SimulatedLink(latency=0.002, bandwidth=2e6)
    results = _ok(run_ranks(4, ep_overlap, "own", 2, link, timeout=800))
    assert all(found["equal"] for found in results.values()), results
    assert results[2]["handed"] > 0 and results[3]["handed"] > 0, results
