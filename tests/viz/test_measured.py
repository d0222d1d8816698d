"""Measured against predicted: synthetic trace files written from simulated timelines (one timeline
per step, 1 schedule time unit = 1 ms) must come back as the same times. The oracles: the simulator's
own start/end times, medians computed by hand from the per-step cost factors, and the comm latency
the schedule was simulated with."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pipeloom import Costs, build_schedule
from pipeloom.ir import schedule_to_json
from pipeloom.search.greedy import list_schedule
from pipeloom.search.placements import placement
from pipeloom.sim import simulate
from pipeloom.trace.analysis import (
    comm_latency_estimate,
    compare_run,
    measured_step_time,
    measured_timeline,
    predicted_timeline,
    selected_steps,
    step_times,
    task_durations,
)
from pipeloom.trace.errors import StepSelectionError, TraceFormatError
from pipeloom.trace.format import write_run_trace
from pipeloom.trace.reader import load_run_trace, run_trace_from_documents
from pipeloom.trace.simulated import simulated_run_trace
from pipeloom.trace.summary import trace_summary
from pipeloom.viz.measured import draw_measured, merged_trace_events, write_merged_trace

MS = 1e-3  # seconds per schedule time unit in the synthetic files (unit_ns = 1_000_000)


def _scaled(schedule, factor: float):
    """The simulated timeline of ``schedule`` with every duration and the comm latency times ``factor``
    (so the makespan scales by ``factor`` too)."""
    problem = schedule.problem
    tasks = tuple(dataclasses.replace(task, duration=task.duration * factor) for task in problem.tasks)
    problem = dataclasses.replace(problem, tasks=tasks, comm_latency=problem.comm_latency * factor)
    return simulate(dataclasses.replace(schedule, problem=problem))


def _write(folder: Path, schedule, factors=(1.0, 1.0)) -> Path:
    """A run of ``schedule`` whose step k runs ``factors[k]`` times as long as the simulation."""
    write_run_trace(simulated_run_trace([_scaled(schedule, f) for f in factors]), folder)
    return folder


def _docs(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]


def _save(folder: Path, docs: list[dict]) -> None:
    """Write ``docs[i]`` back to ``rank<i>.json`` (whatever rank it now claims)."""
    for i, doc in enumerate(docs):
        (folder / f"rank{i}.json").write_text(json.dumps(doc))


ONE_F_ONE_B = build_schedule("1f1b", 2, 4, costs=Costs(f=1, b=1, w=1, comm=0.5))


# -------------------------------------------------------------------------- round trip oracles


@pytest.mark.parametrize("schedule", [
    ONE_F_ONE_B,
    build_schedule("zbv", 2, 4, costs=Costs(f=1.5, b=1, w=0.5, comm=0.25)),
    build_schedule("interleaved-1f1b", 2, 4, stages_per_rank=2, costs=Costs(comm=0.125)),
    build_schedule("dualpipe", 2, 4),
    list_schedule(placement("mshape", 4, comm_latency=0.25), 3, name="mshape"),  # multi-rank tasks
], ids=["1f1b", "zbv", "interleaved", "dualpipe", "mshape-multi-rank"])
def test_predicted_reproduces_the_synthetic_times(tmp_path, schedule):
    run = load_run_trace(_write(tmp_path, schedule, factors=(1.0, 1.0, 1.0)))
    expected = simulate(schedule)
    comparison = compare_run(run)
    assert comparison.ratio == pytest.approx(1.0, rel=1e-9)
    assert comparison.measured_step_time == pytest.approx(expected.makespan * MS, rel=1e-9)
    assert comparison.predicted.schedule.problem.comm_latency == pytest.approx(
        schedule.problem.comm_latency * MS, abs=1e-12)
    for timeline in (comparison.measured, comparison.predicted):
        assert timeline.schedule.ranks == schedule.ranks
        for rank in range(schedule.num_ranks):
            assert timeline.starts[rank] == pytest.approx([t * MS for t in expected.starts[rank]], abs=1e-12)
            assert timeline.ends[rank] == pytest.approx([t * MS for t in expected.ends[rank]], abs=1e-12)
        assert timeline.memory == expected.memory  # memory follows the order only
        assert timeline.peak_memory == expected.peak_memory


def test_medians_leave_out_the_warm_up_step_by_default(tmp_path):
    run = load_run_trace(_write(tmp_path, ONE_F_ONE_B, factors=(10.0, 1.0, 2.0, 3.0)))
    base = {task.key: task.duration * MS for task in ONE_F_ONE_B.problem.tasks}  # F 1 ms, B 2 ms
    makespan = simulate(ONE_F_ONE_B).makespan * MS
    assert selected_steps(run) == (1, 2, 3)
    warm = task_durations(run)
    assert warm == pytest.approx({key: 2.0 * value for key, value in base.items()})  # median(1, 2, 3)
    assert task_durations(run, steps="all") == pytest.approx({k: 2.5 * v for k, v in base.items()})
    assert task_durations(run, steps=[0]) == pytest.approx({k: 10.0 * v for k, v in base.items()})
    assert step_times(run) == pytest.approx({1: makespan, 2: 2 * makespan, 3: 3 * makespan})
    assert measured_step_time(run) == pytest.approx(2 * makespan)
    # of 1, 2, 3, 10 the lower middle one: a real step's time, not pulled up by the 10x warm-up step
    assert measured_step_time(run, steps="all") == pytest.approx(2 * makespan)
    # the latency scales with the step too: 0.5 units x (1, 2, 3) -> median 1 unit
    assert comm_latency_estimate(run) == pytest.approx(1.0 * MS)
    # over all steps the samples are 0.5 units x (10, 1, 2, 3): median 1.25 units, mean 2 units
    assert comm_latency_estimate(run, steps="all") == pytest.approx(1.25 * MS)
    assert comm_latency_estimate(run, steps="all", mean=True) == pytest.approx(2.0 * MS)
    assert compare_run(run).step == 2  # the step with the median step time is the one shown


def test_documents_in_memory_read_as_their_files_do(tmp_path):
    folder = _write(tmp_path, ONE_F_ONE_B, factors=(1.0, 2.0))
    from_files = load_run_trace(folder)
    from_memory = run_trace_from_documents(list(reversed(_docs(folder))))  # any order: sorted by rank
    assert (from_memory.schedule, from_memory.steps, from_memory.ranks) == \
        (from_files.schedule, from_files.steps, from_files.ranks)
    assert step_times(from_memory) == step_times(from_files)
    with pytest.raises(TraceFormatError, match="no trace documents"):
        run_trace_from_documents([])
    with pytest.raises(TraceFormatError, match="document 1: a trace file holds a JSON object, got list"):
        run_trace_from_documents([_docs(folder)[0], []])
    broken = _docs(folder)
    del broken[1]["clock"]
    with pytest.raises(TraceFormatError, match="document 1: clock"):
        run_trace_from_documents(broken)


def test_a_single_step_is_measured_even_though_it_is_the_warm_up(tmp_path):
    run = load_run_trace(_write(tmp_path, ONE_F_ONE_B, factors=(3.0,)))
    assert selected_steps(run) == (0,)
    assert task_durations(run)[(0, "B")] == pytest.approx(3 * 2 * MS)


def test_median_over_uneven_micro_batches_and_ranks(tmp_path):
    folder = _write(tmp_path, ONE_F_ONE_B, factors=(1.0, 1.0, 1.0))
    docs = _docs(folder)
    stretched = []
    for k, step in enumerate(docs[1]["steps"]):  # rank 1's 1F events: (1 + k)(1 + mb^2) ms, mb = 0..3
        for event in step["events"]:
            if event["kind"] == "compute" and event["name"].startswith("1F"):
                duration = round((1 + k) * (1 + int(event["name"][2:]) ** 2) * 1e6)
                event["end_ns"] = event["start_ns"] + duration
                stretched.append((k, duration))
    _save(folder, docs)
    run = load_run_trace(folder)
    warm = [d for k, d in stretched if k >= 1]
    assert len(warm) == 8
    assert statistics.median(warm) == 8e6  # 2, 3, 4, 6 | 10, 15, 20, 30 ms (the mean would be 11.25)
    assert task_durations(run)[(1, "F")] == pytest.approx(8 * MS)
    assert task_durations(run)[(0, "F")] == pytest.approx(MS)  # untouched tasks keep their time


def test_no_communication_gives_a_zero_latency_estimate(tmp_path):
    run = load_run_trace(_write(tmp_path, build_schedule("gpipe", 3, 4)))
    assert comm_latency_estimate(run) == 0.0
    assert predicted_timeline(run, comm_latency=0.002).schedule.problem.comm_latency == 0.002


def test_a_slower_run_than_predicted_shows_in_the_ratio(tmp_path):
    """Every compute event keeps its measured length but a rank starts 0F... late: the measured step
    grows while the prediction (from the same medians) does not."""
    folder = _write(tmp_path, ONE_F_ONE_B, factors=(1.0, 1.0))
    docs = _docs(folder)
    for doc in docs:  # delay everything after the first action of step 1 by 4 ms on both ranks
        step = doc["steps"][1]
        first = min(e["start_ns"] for e in step["events"])
        for event in step["events"]:
            if event["start_ns"] > first or doc["rank"] == 1:
                event["start_ns"] += 4_000_000
                event["end_ns"] += 4_000_000
        step["end_ns"] += 4_000_000
    _save(folder, docs)
    comparison = compare_run(load_run_trace(folder))
    makespan = simulate(ONE_F_ONE_B).makespan * MS
    assert comparison.predicted.makespan == pytest.approx(makespan)
    assert comparison.measured_step_time == pytest.approx(makespan + 4 * MS)
    assert comparison.ratio == pytest.approx((makespan + 4 * MS) / makespan)


# ------------------------------------------------------------------------ views of the comparison


def test_measured_timeline_of_a_chosen_step_and_its_busy_time(tmp_path):
    run = load_run_trace(_write(tmp_path, ONE_F_ONE_B, factors=(1.0, 2.0)))
    timeline = measured_timeline(run, step=0)
    expected = simulate(ONE_F_ONE_B)
    assert timeline.makespan == pytest.approx(expected.makespan * MS)
    assert timeline.busy == pytest.approx([b * MS for b in expected.busy])
    assert timeline.schedule.name == "1f1b measured (step 0)"
    with pytest.raises(StepSelectionError, match="step 7 is not in the trace"):
        measured_timeline(run, step=7)


def test_summary_reports_ratio_medians_and_per_rank_busy_and_wait(tmp_path):
    run = load_run_trace(_write(tmp_path, ONE_F_ONE_B, factors=(5.0, 1.0, 1.0)))
    expected = simulate(ONE_F_ONE_B)
    summary = trace_summary(compare_run(run))
    json.dumps(summary, allow_nan=False)
    assert summary["steps_used"] == [1, 2] and summary["steps_recorded"] == [0, 1, 2]
    assert summary["ratio"] == pytest.approx(1.0)
    assert summary["measured_step_time"] == pytest.approx(expected.makespan * MS)
    assert summary["predicted_step_time"] == pytest.approx(expected.makespan * MS)
    assert summary["comm_latency"] == pytest.approx(0.5 * MS)
    assert [(t["stage"], t["kind"], t["count"]) for t in summary["tasks"]] == [
        (0, "F", 8), (0, "B", 8), (1, "F", 8), (1, "B", 8)]  # 4 micro-batches x 2 warm steps
    assert [t["median"] for t in summary["tasks"]] == pytest.approx([MS, 2 * MS, MS, 2 * MS])
    for row in summary["ranks"]:
        rank = row["rank"]
        last_end = expected.ends[rank][-1]
        assert row["busy"] == pytest.approx(expected.busy[rank] * MS)
        assert row["wait"] == pytest.approx((last_end - expected.busy[rank]) * MS)  # every gap is a wait
        assert row["send"] == 0.0
        assert row["idle"] == pytest.approx((expected.makespan - expected.busy[rank]) * MS)
        assert row["idle"] == pytest.approx(row["predicted_idle"])
        assert row["predicted_busy"] == pytest.approx(expected.busy[rank] * MS)


def _slices(trace: dict, pid: int, thread: str) -> list[dict]:
    tid = next(e["tid"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid
               and e["args"]["name"] == thread)
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid]


def test_merged_trace_holds_measured_and_predicted_processes_aligned_at_zero(tmp_path):
    run = load_run_trace(_write(tmp_path, ONE_F_ONE_B, factors=(1.0, 1.0)))
    comparison = compare_run(run)
    trace = merged_trace_events(comparison)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "measured rank 0", 1: "measured rank 1", 2: "predicted rank 0", 3: "predicted rank 1"}
    expected = simulate(ONE_F_ONE_B)
    for rank in range(2):
        for pid in (rank, rank + 2):  # measured, predicted: the same times here, in microseconds
            slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid
                      and e.get("cat") not in ("wait", "send")]
            assert [(e["name"], e["ts"], e["dur"]) for e in slices] == [
                (str(a), round(s * 1000), round(e * 1000) - round(s * 1000)) for a, s, e in expected.events(rank)]
        waits = _slices(trace, rank, "recv waits")
        assert sum(e["dur"] for e in waits) == round((expected.ends[rank][-1] - expected.busy[rank]) * 1000)
        assert all(e["name"].startswith("RECV") for e in waits)
        sends = _slices(trace, rank, "sends")
        assert [e["name"] for e in sends] == [f"SEND {a} to {1 - rank}" for a in ONE_F_ONE_B.ranks[rank]
                                              if (a.kind == "F") == (rank == 0)]
    tracks: dict = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert isinstance(e["ts"], int) and e["ts"] >= 0 and e["dur"] >= 0
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["dur"]))
    for slices in tracks.values():  # no two slices of a thread overlap
        slices.sort()
        assert all(a + d <= b for (a, d), (b, _) in itertools.pairwise(slices))
    path = tmp_path / "merged.json"
    write_merged_trace(comparison, path)
    assert json.loads(path.read_text()) == trace
    assert trace["otherData"]["ratio"] == pytest.approx(1.0)


def test_picture_shows_measured_above_predicted(tmp_path):
    comparison = compare_run(load_run_trace(_write(tmp_path, ONE_F_ONE_B)))
    path = tmp_path / "side.png"
    draw_measured(comparison, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="suffix"):
        draw_measured(comparison, tmp_path / "side.jpg")


# ------------------------------------------------------------------------------- reading checks


def test_a_list_of_files_in_any_order_and_extra_keys_and_kinds_are_accepted(tmp_path):
    folder = _write(tmp_path, ONE_F_ONE_B)
    docs = _docs(folder)
    docs[0]["host"] = "node-1"  # a key a later engine may add
    docs[0]["steps"][0]["events"].insert(0, {"name": "loss", "kind": "loss", "start_ns": 1, "end_ns": 2})
    _save(folder, docs)
    run = load_run_trace([folder / "rank1.json", folder / "rank0.json", folder / "rank0.json"])
    assert run.paths == (folder / "rank0.json", folder / "rank1.json")
    assert all(e.kind in ("compute", "wait", "send", "post") for e in run.ranks[0][0].events)


def test_task_durations_without_messages_and_the_message_cost():
    from pipeloom import build_schedule
    from pipeloom.ir import schedule_to_json
    from pipeloom.trace.analysis import message_cost, task_durations
    from pipeloom.trace.format import TRACE_FORMAT
    from pipeloom.trace.reader import run_trace_from_documents

    schedule = build_schedule("1f1b", 2, 1)  # rank 0: 0F0 0B0, rank 1: 1F0 1B0; 1 ms each
    ms = 1_000_000
    documents = []
    for rank, actions in enumerate(schedule.ranks):
        events = []
        for k, action in enumerate(actions):
            start = (2 * rank + k) * 2 * ms
            events.append({"name": str(action), "kind": "compute", "start_ns": start, "end_ns": start + ms})
            # inside the action: a send of 0.2 ms and a receive posted ahead, 0.1 ms
            events.append({"name": "SEND", "kind": "send", "start_ns": start + ms // 2, "end_ns": start + 7 * ms // 10})
            events.append({"name": "POST", "kind": "post", "start_ns": start + 8 * ms // 10,
                           "end_ns": start + 9 * ms // 10})
        # outside every action: a post of 1 ms before the step's first one, counted nowhere
        events.append({"name": "POST", "kind": "post", "start_ns": 10 * ms, "end_ns": 11 * ms})
        documents.append({"format": TRACE_FORMAT, "rank": rank, "world_size": 2, "clock": "unix_ns",
                          "schedule": json.loads(schedule_to_json(schedule)),
                          "steps": [{"step": 0, "start_ns": 0, "end_ns": 12 * ms, "events": events}]})
    run = run_trace_from_documents(documents)
    assert task_durations(run, steps="all") == {key: pytest.approx(1e-3) for key in task_durations(run, steps="all")}
    assert all(v == pytest.approx(0.7e-3) for v in task_durations(run, steps="all", messages=False).values())
    assert message_cost(run, steps="all") == pytest.approx(0.15e-3)  # the mean of 0.2 and 0.1 ms


def test_a_step_only_some_ranks_recorded_is_left_out_with_a_note(tmp_path):
    folder = _write(tmp_path, ONE_F_ONE_B, factors=(1.0, 1.0, 1.0))
    docs = _docs(folder)
    del docs[1]["steps"][2]
    _save(folder, docs)
    run = load_run_trace(folder)
    assert run.steps == (0, 1)
    assert run.notes and "steps 2 are not in every rank's file" in run.notes[0]


def _mutate(folder: Path, change) -> None:
    docs = _docs(folder)
    change(docs)
    _save(folder, docs)


def _other_run(folder: Path) -> None:
    other = _write(folder.parent / "other", build_schedule("gpipe", 2, 4))
    (folder / "rank1.json").write_text((other / "rank1.json").read_text())


def _shift_rank1(docs):
    for step in docs[1]["steps"]:
        step["start_ns"] += 10**12
        step["end_ns"] += 10**12
        for event in step["events"]:
            event["start_ns"] += 10**12
            event["end_ns"] += 10**12


def _drop_last_compute_of_rank1(docs):
    events = docs[1]["steps"][0]["events"]
    events.remove([e for e in events if e["kind"] == "compute"][-1])


BAD_RUNS = {
    "missing rank": (lambda f: (f / "rank1.json").unlink(), "missing rank1.json of the 2 ranks"),
    "another schedule": (_other_run, "records another schedule than"),
    "another world size": (lambda f: _mutate(f, lambda d: d[1].update(world_size=3)), "world_size 3"),
    "same rank twice": (lambda f: _mutate(f, lambda d: d[1].update(rank=0)), "rank 0 is in both"),
    "steps of another time": (lambda f: _mutate(f, _shift_rank1), "different runs"),
    "newer version": (lambda f: _mutate(f, lambda d: d[0].update(format="pipeloom.runtime-trace/2")),
                      "another version than this pipeloom reads"),
    "schedule file": (lambda f: (f / "rank0.json").write_text(schedule_to_json(ONE_F_ONE_B)),
                      "it is a schedule file"),
    "chrome trace": (lambda f: (f / "rank0.json").write_text('{"traceEvents": []}'), "Chrome/Perfetto trace"),
    "malformed": (lambda f: (f / "rank0.json").write_text('{"format": '), "malformed JSON"),
    "not utf-8": (lambda f: (f / "rank0.json").write_bytes(b"\xff\xfe\x00"), "not UTF-8"),
    "other clock": (lambda f: _mutate(f, lambda d: d[0].update(clock="monotonic_ns")), "clock 'monotonic_ns'"),
    "no steps": (lambda f: _mutate(f, lambda d: d[0].update(steps=[])), "record no steps"),
    "rank out of range": (lambda f: _mutate(f, lambda d: d[0].update(rank=5)), "rank 5 is not in 0..world_size-1"),
    "missing key": (lambda f: _mutate(f, lambda d: d[0].pop("world_size")), "missing key 'world_size'"),
    "bool time": (lambda f: _mutate(f, lambda d: d[0]["steps"][0].update(start_ns=True)), "start_ns must be int"),
    "end before start": (lambda f: _mutate(f, lambda d: d[0]["steps"][0]["events"][0].update(end_ns=0)),
                         "is before start_ns"),
    "event without kind": (lambda f: _mutate(f, lambda d: d[0]["steps"][0]["events"][0].pop("kind")),
                           "missing key 'kind'"),
    "step twice": (lambda f: _mutate(f, lambda d: d[0]["steps"].append(d[0]["steps"][0])), "recorded twice"),
    "wrong action": (lambda f: _mutate(f, lambda d: d[0]["steps"][0]["events"][0].update(name="0B0")),
                     "compute event 0 is '0B0' but rank 0's action 0 is '0F0'"),
    "missing action": (lambda f: _mutate(f, _drop_last_compute_of_rank1),
                       "7 compute events but rank 1 runs 8 actions"),
}


@pytest.mark.parametrize("case", BAD_RUNS, ids=list(BAD_RUNS))
def test_bad_runs_raise_a_trace_format_error_naming_the_problem(tmp_path, case):
    folder = _write(tmp_path / "run", ONE_F_ONE_B)
    breaks, fragment = BAD_RUNS[case]
    breaks(folder)
    with pytest.raises(TraceFormatError) as error:
        load_run_trace(folder)
    message = str(error.value)
    assert fragment in message
    assert "\n" not in message
    assert "rank0.json" in message or "rank1.json" in message  # names a file


def test_folders_without_trace_files_and_missing_paths(tmp_path):
    with pytest.raises(TraceFormatError, match="no rank<N>.json files in this folder; record a run with record="):
        load_run_trace(tmp_path)
    with pytest.raises(TraceFormatError, match="no such file or folder"):
        load_run_trace(tmp_path / "nope")
    with pytest.raises(TraceFormatError, match="no trace files given"):
        load_run_trace([])


def test_bad_step_selections(tmp_path):
    run = load_run_trace(_write(tmp_path, ONE_F_ONE_B))
    with pytest.raises(StepSelectionError, match=r"steps \[9\] are not in the trace; recorded steps: 0, 1"):
        task_durations(run, steps=[9])
    with pytest.raises(StepSelectionError, match="use 'warm', 'all' or a list"):
        task_durations(run, steps="first")


def test_simulated_run_trace_refuses_timelines_of_different_lists():
    with pytest.raises(TraceFormatError, match="different action lists"):
        simulated_run_trace([simulate(ONE_F_ONE_B), simulate(build_schedule("gpipe", 2, 4))])


def test_importing_the_trace_tools_does_not_import_torch():
    code = ("import sys, pipeloom.viz.measured, pipeloom.cli.trace, pipeloom.cli; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=120).returncode == 0


def test_the_ratio_is_explained_and_idle_is_a_mean_like_the_waits(tmp_path):
    """Steps 1-3 at 1x, 1x and 4x: the median step is a 1x one; the explanation names the steps and the
    slow one; every rank's receive wait stays within its idle (both means over the steps)."""
    run = load_run_trace(_write(tmp_path, ONE_F_ONE_B, factors=(5.0, 1.0, 1.0, 4.0)))
    summary = trace_summary(compare_run(run))
    lines = summary["explanation"]
    assert lines[0].startswith("measured / predicted 1.00: ") and lines == summary["notes"][-len(lines):]
    assert any(line.startswith("- task-time variation") for line in lines)
    assert "left out: step 0" in lines[-1] and "3 took over 1.5x the median" in lines[-1]
    for row in summary["ranks"]:
        assert row["wait"] <= row["idle"] + 1e-12
