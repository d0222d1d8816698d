"""DAG partitioner: optimum equals an exhaustive search over every valid assignment on small DAGs;
partitions are valid pipelines (no edge goes back a stage) on random DAGs; clear input errors."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeloom.errors import PipeloomError
from pipeloom.plan.errors import PartitionError
from pipeloom.plan.partitioning import dag
from pipeloom.plan.partitioning.dag import partition_dag
from pipeloom.plan.partitioning.dag_graph import DagPartition, greedy_partition_dag


def random_dag(rng: random.Random, n: int, *, skip: float = 0.3) -> list[tuple[int, int]]:
    """Edges u < v: a chain-like spine with branches (each node feeds 1-2 of the next three) and
    skip connections (probability ``skip`` to a node further ahead); some nodes stay unconnected."""
    edges = set()
    for u in range(n - 1):
        for v in rng.sample(range(u + 1, min(n, u + 4)), k=min(rng.randint(0, 2), min(n, u + 4) - u - 1)):
            edges.add((u, v))
        if rng.random() < skip and u + 2 < n:
            edges.add((u, rng.randint(u + 2, n - 1)))
    return sorted(edges)


def exhaustive(times, edges, stages, *, out_bytes=None, memory=None, limit=None, balance=0.0):
    """Best (slowest stage, cut bytes) over every valid assignment (non-empty stages, stage_u <=
    stage_v on every edge, memory within limit), cut minimised within (1 + balance) of the best time.
    Returns (best time, best cut) or None when nothing is valid."""
    n = len(times)
    out_bytes = out_bytes or [0] * n
    preds = [[u for u, w in edges if w == v] for v in range(n)]
    succs = [[w for u, w in edges if u == v] for v in range(n)]
    found = []
    stage_of = [0] * n

    def assign(v: int) -> None:  # nodes 0..n-1 are in topological order (edges go u < v)
        if v == n:
            if len(set(stage_of)) < stages:
                return
            loads = [sum(times[i] for i in range(n) if stage_of[i] == k) for k in range(stages)]
            if memory is not None and max(sum(memory[i] for i in range(n) if stage_of[i] == k)
                                          for k in range(stages)) > limit:
                return
            cut = sum(out_bytes[u] * len({stage_of[w] for w in succs[u]} - {stage_of[u]}) for u in range(n))
            found.append((max(loads), cut))
            return
        for k in range(max((stage_of[u] for u in preds[v]), default=0), stages):
            stage_of[v] = k
            assign(v + 1)

    assign(0)
    if not found:
        return None
    best_time = min(t for t, _ in found)
    return best_time, min(c for t, c in found if t <= (1 + balance) * best_time)


def check_valid(result: DagPartition, times, edges, stages: int) -> None:
    """Every edge goes forward or stays, stages are non-empty, reported sums match the assignment."""
    assert len(result.stage_of) == len(times)
    assert set(result.stage_of) == set(range(stages))
    for u, v in edges:
        assert result.stage_of[u] <= result.stage_of[v], (u, v, result.stage_of)
    loads = [sum(t for t, s in zip(times, result.stage_of) if s == k) for k in range(stages)]
    assert result.stage_times == pytest.approx(loads)
    assert result.max_stage_time == pytest.approx(max(loads))
    assert result.bound <= result.max_stage_time + 1e-9
    assert result.bound >= max(sum(times) / stages, max(times)) - 1e-9


@pytest.mark.parametrize("seed", range(24))
def test_matches_exhaustive_search(seed):
    rng = random.Random(seed)
    n, stages = rng.randint(3, 9), rng.choice([2, 3])
    times = [rng.randint(0, 9) for _ in range(n)]
    out_bytes = [rng.randint(0, 5) for _ in range(n)]
    edges = random_dag(rng, n)
    result = partition_dag(times, edges, num_stages=stages, out_bytes=out_bytes)
    check_valid(result, times, edges, stages)
    best_time, best_cut = exhaustive(times, edges, stages, out_bytes=out_bytes)
    assert (result.max_stage_time, result.cut_bytes) == (best_time, best_cut)
    assert result.status == "optimal" and result.bound == best_time and result.gap == 0


@pytest.mark.parametrize("seed", range(8))
def test_matches_exhaustive_search_with_balance_and_memory(seed):
    rng = random.Random(100 + seed)
    n, stages = rng.randint(4, 9), rng.choice([2, 3])
    times = [rng.randint(1, 9) for _ in range(n)]
    out_bytes = [rng.randint(0, 9) for _ in range(n)]
    memory = [rng.randint(1, 4) for _ in range(n)]
    limit = max(max(memory), -(-sum(memory) // stages)) + rng.randint(0, 3)
    edges = random_dag(rng, n)
    expected = exhaustive(times, edges, stages, out_bytes=out_bytes, memory=memory, limit=limit, balance=0.25)
    if expected is None:
        with pytest.raises(PartitionError, match="memory_limit"):
            partition_dag(times, edges, num_stages=stages, out_bytes=out_bytes, memory=memory,
                          memory_limit=limit, balance=0.25)
        return
    result = partition_dag(times, edges, num_stages=stages, out_bytes=out_bytes, memory=memory,
                           memory_limit=limit, balance=0.25)
    check_valid(result, times, edges, stages)
    assert max(result.stage_memory) <= limit
    best_time, best_cut = expected
    assert result.max_stage_time <= 1.25 * best_time and result.cut_bytes == best_cut
    assert result.bound == best_time


def test_chain_and_float_times():
    times = [0.5, 1.25, 0.75, 2.0, 1.0, 0.5]
    edges = [(i, i + 1) for i in range(5)]
    result = partition_dag(times, edges, num_stages=3)
    check_valid(result, times, edges, 3)
    assert result.stage_of == (0, 0, 0, 1, 2, 2) and result.max_stage_time == 2.5
    assert result.status == "optimal" and result.stages == ((0, 1, 2), (3,), (4, 5))


def test_cut_counts_an_output_once_per_consuming_stage():
    # node 0 feeds 1, 2 (same stage) and 3; stage 0 = {0}: its output goes to two other stages
    times, edges = [4, 1, 1, 2], [(0, 1), (0, 2), (0, 3)]
    result = partition_dag(times, edges, num_stages=2, out_bytes=[10, 0, 0, 0])
    assert result.stage_of == (0, 1, 1, 1) and result.cut_bytes == 10


def test_secondary_prefers_fewer_bytes_among_equal_times():
    # a diamond 0 -> (1, 2) -> 3 plus a free node 4; the big output of 1 should stay inside its stage
    times, edges = [2, 2, 2, 2, 2], [(0, 1), (0, 2), (1, 3), (2, 3)]
    out_bytes = [1, 100, 1, 0, 0]
    result = partition_dag(times, edges, num_stages=2, out_bytes=out_bytes)
    assert result.max_stage_time == 6 and result.stage_of[1] == result.stage_of[3]
    assert result.cut_bytes == exhaustive(times, edges, 2, out_bytes=out_bytes)[1]


@pytest.mark.parametrize("seed", range(6))
def test_float_times_match_exhaustive_search(seed):
    # times that no power of ten makes whole: CP-SAT sees floor-scaled integers; the optimum is still
    # the exhaustive one (up to rounding) and the bound stays below it
    rng = random.Random(200 + seed)
    n, stages = rng.randint(4, 9), rng.choice([2, 3])
    times = [rng.uniform(0.0, 3.0) for _ in range(n)]
    edges = random_dag(rng, n)
    result = partition_dag(times, edges, num_stages=stages)
    check_valid(result, times, edges, stages)
    best_time, _ = exhaustive(times, edges, stages)
    assert result.max_stage_time == pytest.approx(best_time, rel=1e-9)
    assert result.bound <= best_time + 1e-12 and result.gap < 1e-6 and result.status == "optimal"


@pytest.mark.parametrize("seed", range(6))
def test_heaviest_path_windows_above_the_closure_size(seed, monkeypatch):
    # above CLOSURE_NODES the windows come from heaviest paths (weaker, still valid): same optimum
    monkeypatch.setattr(dag, "CLOSURE_NODES", 0)
    rng = random.Random(300 + seed)
    n, stages = rng.randint(4, 9), rng.choice([2, 3])
    times = [rng.randint(1, 9) for _ in range(n)]
    out_bytes = [rng.randint(0, 5) for _ in range(n)]
    edges = random_dag(rng, n)
    result = partition_dag(times, edges, num_stages=stages, out_bytes=out_bytes)
    assert (result.max_stage_time, result.cut_bytes) == exhaustive(times, edges, stages, out_bytes=out_bytes)


@pytest.mark.parametrize("seed", range(2))
def test_larger_random_dags_are_valid_and_no_worse_than_greedy(seed):
    rng = random.Random(seed)
    n, stages = 200, 4 + 4 * seed
    times = [rng.uniform(0.1, 3.0) for _ in range(n)]
    out_bytes = [rng.randint(1, 1000) for _ in range(n)]
    edges = random_dag(rng, n, skip=0.2)
    result = partition_dag(times, edges, num_stages=stages, out_bytes=out_bytes, time_limit=0.5)
    greedy = greedy_partition_dag(times, edges, num_stages=stages, out_bytes=out_bytes)
    check_valid(result, times, edges, stages)
    check_valid(greedy, times, edges, stages)
    assert result.max_stage_time <= greedy.max_stage_time + 1e-9
    assert 0 <= result.gap < 0.05


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_property_valid_pipeline(data):
    n = data.draw(st.integers(1, 12), label="n")
    stages = data.draw(st.integers(1, n), label="stages")
    times = data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n), label="times")
    pairs = [(u, v) for v in range(n) for u in range(v)]
    edges = data.draw(st.lists(st.sampled_from(pairs), max_size=20), label="edges") if pairs else []
    perm = data.draw(st.permutations(range(n)), label="numbering")  # node numbers need not be topological
    edges = [(perm[u], perm[v]) for u, v in edges]
    times = [times[perm.index(i)] for i in range(n)]
    result = partition_dag(times, edges, num_stages=stages, time_limit=2.0)
    check_valid(result, times, edges, stages)


def test_cycle_is_named():
    with pytest.raises(PartitionError, match=r"cycle: 1 -> 2 -> 3 -> 1"):
        partition_dag([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3), (3, 1)], num_stages=2)
    with pytest.raises(PartitionError, match=r"cycle: 2 -> 2"):
        partition_dag([1, 1, 1], [(0, 1), (2, 2)], num_stages=2)


def test_input_errors():
    assert issubclass(PartitionError, PipeloomError)
    with pytest.raises(PartitionError, match="more stages than nodes .3.; .*at most 3 stages"):
        partition_dag([1, 1, 1], [], num_stages=4)
    with pytest.raises(PartitionError, match=r"times\[1\] = -1.0"):
        partition_dag([1, -1, 1], [], num_stages=2)
    with pytest.raises(PartitionError, match="out_bytes has 2 values for 3 nodes"):
        partition_dag([1, 1, 1], [], num_stages=2, out_bytes=[1, 1])
    with pytest.raises(PartitionError, match=r"edge \(0, 5\)"):
        partition_dag([1, 1, 1], [(0, 5)], num_stages=2)
    with pytest.raises(PartitionError, match=r"edge \(0, 1, 2\) is not a pair"):
        partition_dag([1, 1, 1], [(0, 1, 2)], num_stages=2)
    with pytest.raises(PartitionError, match="num_stages=1.5"):
        partition_dag([1, 1, 1], [], num_stages=1.5)
    with pytest.raises(PartitionError, match="memory_limit needs memory"):
        partition_dag([1, 1, 1], [], num_stages=2, memory_limit=3)
    with pytest.raises(PartitionError, match="balance"):
        partition_dag([1, 1, 1], [], num_stages=2, balance=-0.1)


def test_memory_too_small_says_the_smallest_limit_and_stage_count():
    times, edges = [1] * 6, [(i, i + 1) for i in range(5)]
    memory = [3, 3, 3, 3, 3, 3]
    # 2 stages need 9 each; with limit 6, 3 stages fit
    with pytest.raises(PartitionError, match="smallest limit that fits 2 stages is 9, or keep this limit with "
                                             "3 stages"):
        partition_dag(times, edges, num_stages=2, memory=memory, memory_limit=6)
    with pytest.raises(PartitionError, match=r"\(node 0 alone needs 3\); the smallest limit that fits 2 stages is 9$"):
        partition_dag(times, edges, num_stages=2, memory=memory, memory_limit=2)


def test_memory_limit_shapes_the_split():
    # a chain whose time-balanced split (0, 0, 1, 1) holds 6 > 5 in stage 0
    times, edges, memory = [5, 1, 1, 5], [(0, 1), (1, 2), (2, 3)], [4, 2, 2, 1]
    result = partition_dag(times, edges, num_stages=2, memory=memory, memory_limit=5)
    assert result.stage_of == (0, 1, 1, 1) and result.stage_memory == (4, 5) and result.status == "optimal"


def test_memory_fit_when_no_topological_split_fits():
    # independent nodes: every order the greedy tries is 0, 1, 2, 3, and no contiguous split fits;
    # {0, 2} and {1, 3} do
    with pytest.raises(PartitionError, match="no topological split"):
        greedy_partition_dag([1, 1, 1, 1], [], num_stages=2, memory=[2, 2, 1, 1], memory_limit=3)
    result = partition_dag([1, 1, 1, 1], [], num_stages=2, memory=[2, 2, 1, 1], memory_limit=3)
    assert result.stage_memory == (3, 3) and result.max_stage_time == 2 and result.status == "optimal"
