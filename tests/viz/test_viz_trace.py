"""The Chrome/Perfetto trace: structure of the Trace Event Format and times against the simulator."""

from __future__ import annotations

import json
import math

import pytest

from pipeloom.schedules import build_schedule
from pipeloom.stages import Costs
from pipeloom.validate import validate
from pipeloom.viz import perfetto_events, write_perfetto


def _timeline(name: str = "1f1b", ranks: int = 4, microbatches: int = 8, costs: Costs = Costs()):
    return validate(build_schedule(name, ranks, microbatches, costs=costs))


def _of(trace, ph):
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def test_round_trips_through_json(tmp_path):
    timeline = _timeline()
    path = tmp_path / "trace.json"
    write_perfetto(timeline, path)
    loaded = json.loads(path.read_text())
    assert loaded == perfetto_events(timeline)
    assert loaded["displayTimeUnit"] == "ms"
    assert loaded["otherData"]["time_unit_us"] == 1000  # integer costs: 1 unit = 1 ms


def test_one_process_per_rank():
    trace = perfetto_events(_timeline())
    names = {e["pid"]: e["args"]["name"] for e in _of(trace, "M") if e["name"] == "process_name"}
    assert sorted(names.values()) == [f"rank {r}" for r in range(4)]
    assert {e["pid"] for e in _of(trace, "X")} == set(names)
    assert names == {r: f"rank {r}" for r in range(4)}  # pid = rank, as the issue asks
    threads = [e for e in _of(trace, "M") if e["name"] == "thread_name"]
    assert sorted(e["args"]["name"] for e in threads) == [f"stage {s}" for s in range(4)]


def test_complete_events_match_simulated_times():
    timeline = _timeline("gpipe", 3, 5, costs=Costs(f=1.0, b=1 / 3, w=0.25))
    trace = perfetto_events(timeline)
    scale = trace["otherData"]["time_unit_us"]
    assert scale == 10000  # shortest action B = b + w = 7/12: 583 us at 1 ms/unit, so one power of ten more
    events = _of(trace, "X")
    assert len(events) == timeline.schedule.num_actions
    rank_of = {e["pid"]: e["args"]["name"] for e in _of(trace, "M") if e["name"] == "process_name"}
    by_key = {(rank_of[e["pid"]], e["name"]): e for e in events}
    for rank in range(timeline.num_ranks):
        for action, start, end in timeline.events(rank):
            event = by_key[(f"rank {rank}", str(action))]
            assert event["ts"] == round(start * scale)
            assert event["dur"] == round(end * scale) - round(start * scale)
            assert abs(event["dur"] - (end - start) * scale) <= 1
            assert event["args"] == {"stage": action.stage, "kind": action.kind,
                                     "microbatch": action.microbatch, "start": start, "end": end}


def test_numbers_finite_and_slices_never_overlap_on_a_thread():
    trace = perfetto_events(_timeline("1f1b", 5, 9, costs=Costs(f=0.7, b=1.3, w=0.1, comm=0.05)))
    json.dumps(trace, allow_nan=False)  # raises on NaN/inf
    tracks = {}
    for e in _of(trace, "X"):
        assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
        tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["dur"]))
    for slices in tracks.values():
        slices.sort()
        assert all(a + d <= b for (a, d), (b, _) in zip(slices, slices[1:]))


def test_memory_counter_follows_the_simulator():
    timeline = _timeline("gpipe", 3, 4)
    trace = perfetto_events(timeline)
    for rank in range(3):
        values = [e["args"]["held"] for e in _of(trace, "C") if e["pid"] == rank]
        # GPipe: 0, then +1 per forward up to m, then -1 per backward (docs/design.md §6 memory m)
        assert values == [0, 1, 2, 3, 4, 3, 2, 1, 0]
        assert max(values) == timeline.peak_memory[rank]


def test_bad_time_unit():
    with pytest.raises(ValueError, match="time_unit_us"):
        perfetto_events(_timeline(), time_unit_us=0)
    trace = perfetto_events(_timeline(), time_unit_us=2.5)
    # 1F1B p=4: rank 1's first forward runs from 1 to 2 -> ts round(2.5) = 2, dur round(5) - 2 = 3
    first = next(e for e in _of(trace, "X") if e["name"] == "1F0")
    assert (first["ts"], first["dur"]) == (2, 3)


def test_huge_times_keep_timestamps_in_perfettos_exact_range():
    """Tasks of 1e15 units (1 ms each by default: 3.3e19 us, past int64) take a smaller unit, every timestamp within
    2**53 / 1000 us; a unit given that passes it is refused."""
    limit = 2.0**53 / 1000
    for f in (1e15, 1e30):
        timeline = _timeline(costs=Costs(f=f, b=2 * f))
        trace = perfetto_events(timeline)
        assert max(e["ts"] + e.get("dur", 0) for e in _of(trace, "X")) <= limit
        assert trace["otherData"]["time_unit_us"] == 10.0 ** math.floor(math.log10(limit / timeline.makespan))
    with pytest.raises(ValueError, match="past the .* us Perfetto keeps exact; give a smaller time_unit_us"):
        perfetto_events(_timeline(costs=Costs(f=1e15, b=2e15)), time_unit_us=1000)


def test_cross_rank_dependencies_are_flow_events():
    """1F1B on 4 ranks, 8 micro-batches: 3 rank boundaries x 8 micro-batches x (F, B) = 48 flows, each
    an ``s`` at the producer's start on its thread and an ``f`` (bp e) at the consumer's start."""
    from pipeloom import build_schedule, simulate
    from pipeloom.viz import perfetto_events

    timeline = simulate(build_schedule("1f1b", 4, 8))
    events = perfetto_events(timeline, time_unit_us=1000)["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(ends) == 48 and starts.keys() == ends.keys()
    slices = {(e["pid"], e["tid"], e["ts"]): e["name"] for e in events if e["ph"] == "X"}
    for flow, end in ends.items():
        start = starts[flow]
        assert end["bp"] == "e" and start["cat"] == end["cat"] == "dependency"
        producer, consumer = start["name"].split(" -> ")
        assert slices[(start["pid"], start["tid"], start["ts"])] == producer
        assert slices[(end["pid"], end["tid"], end["ts"])] == consumer
        assert start["pid"] != end["pid"]
