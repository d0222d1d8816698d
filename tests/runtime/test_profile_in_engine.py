"""pipeloom.profile.in_engine: the profiling schedule, and piece times traced inside the engine on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from rank_jobs import (
    profile_cli_job,
    profile_in_engine_batchnorm_job,
    profile_in_engine_job,
    profile_in_engine_odd_job,
)
from ranks import run_ranks

from pipeloom import validate
from pipeloom.cli import main
from pipeloom.ir import schedule_to_json
from pipeloom.plan import PlanError, load_costs
from pipeloom.plan.costs.file import costs_from_json
from pipeloom.plan.costs.parts import Link
from pipeloom.plan.noise import starting_ranks
from pipeloom.plan.partitioning.shape import schedule_shape
from pipeloom.plan.recost import exchange_time
from pipeloom.profile.engine import profiling_schedule
from pipeloom.profile.fits import exchange_latency, fitted_action_cost, fitted_replica_link, start_skew, time_spread
from pipeloom.runtime.program import model_pieces
from pipeloom.trace import TRACE_FORMAT, run_trace_from_documents, task_durations


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("pieces", "ranks"), [(1, 1), (2, 2), (5, 2), (7, 3), (4, 4)])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_profiling_schedule_is_valid_with_consecutive_pieces_per_rank(pieces, ranks, microbatches, split):
    schedule = profiling_schedule(pieces, ranks, microbatches, split_backward=split)
    validate(schedule, ordered=True, check_memory_limit=False)
    stages = [sorted({a.stage for a in actions}) for actions in schedule.ranks]
    assert all(stages), "every rank profiles at least one piece"
    assert [s for rank in stages for s in rank] == list(range(pieces))  # consecutive runs, in rank order
    kinds = {a.kind for actions in schedule.ranks for a in actions}
    assert kinds == ({"F", "I", "W"} if split else {"F", "B"})
    assert sum(map(len, schedule.ranks)) == pieces * microbatches * (3 if split else 2)


def test_profiling_schedule_needs_a_piece_per_rank():
    with pytest.raises(PlanError, match="2 piece.*4 ranks"):
        profiling_schedule(2, 4, 2, split_backward=False)


@pytest.mark.timeout(180)
def test_profile_in_engine_gives_every_rank_the_same_table(tmp_path):
    folders = [tmp_path / "rank0", tmp_path / "rank1"]
    for folder in folders:
        folder.mkdir()
    results = run_ranks(2, profile_in_engine_job, str(tmp_path), timeout=150)
    assert all(status == "ok" for status, _ in results.values()), results
    (_, first), (_, second) = results[0], results[1]
    assert first["table"] == second["table"]
    table = costs_from_json(first["table"])
    assert table.names == tuple([f"layers.{k}" for k in range(8)] + ["head"])
    assert table.microbatch_size == 4
    # each piece is its time less the runtime's cost per action (fitted; a tiny piece may keep 0 of it)
    assert all(min(p.f, p.full_backward, p.w) + table.runtime.action_overhead > 0 for p in table.pieces)
    assert sum(p.f + p.full_backward for p in table.pieces) > 0
    assert table.link.latency >= 0 and table.runtime.step_overhead >= 0
    assert 0 < table.runtime.time_spread < 1  # real actions vary, by far less than their own time
    assert table.runtime.message_cost > 0  # the pieces at the ends of a rank's run send and post receives
    # 4 micro-batches: the two-replica pipeline ran too, and its exchange priced the replica link
    exchange = table.runtime.replica_link
    assert exchange is not None and exchange.latency >= 0 and exchange.bandwidth is None
    assert "in the engine, 2 ranks" in table.device
    assert all(p.param_bytes > 0 and p.activation_bytes > 0 for p in table.pieces)  # from profile_model
    assert first["trace_steps"] == 2 and first["files"] == []  # trace=True keeps the steps in memory only
    for _, result in results.values():  # every rank posts receives ahead of their actions on gloo
        assert {"compute", "post", "send", "wait"} <= set(result["kinds"])
    assert all(first["grads"]), "gradients are cleared after profiling"


@pytest.mark.parametrize(("pieces", "ranks"), [(2, 2), (5, 2), (7, 4), (4, 4)])
@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("split", [False, True])
def test_two_replica_profiling_schedule_mirrors_the_first(pieces, ranks, microbatches, split):
    schedule = profiling_schedule(pieces, ranks, microbatches, split_backward=split, replicas=2)
    validate(schedule, ordered=True, check_memory_limit=False)
    shape = schedule_shape(schedule)
    assert shape.replicas == 2 and model_pieces(schedule) == pieces
    assert [shape.rank[k] for k in range(pieces)] == [k * ranks // pieces for k in range(pieces)]
    assert [shape.rank[pieces + k] for k in range(pieces)] == [ranks - 1 - k * ranks // pieces for k in range(pieces)]
    assert sum(map(len, schedule.ranks)) == 2 * pieces * microbatches * (3 if split else 2)
    assert starting_ranks(schedule) == [0, ranks - 1]  # both replicas start at once, as in Chimera


def test_two_replica_profiling_needs_an_even_number_of_ranks_and_one_or_two_replicas():
    for ranks in (1, 3):  # the middle rank would hold both copies of a piece
        with pytest.raises(PlanError, match=f"even number of ranks, got {ranks}"):
            profiling_schedule(3, ranks, 2, split_backward=False, replicas=2)
    with pytest.raises(PlanError, match="replicas must be 1 or 2"):
        profiling_schedule(3, 2, 2, split_backward=False, replicas=3)


@pytest.mark.timeout(120)
def test_profile_in_engine_runs_no_two_replica_pipeline_for_batchnorm():
    """Its two replicas would update BatchNorm's running statistics apart, which the runtime refuses after the first
    step: the profile had failed on every even number of ranks, naming a schedule the user did not choose."""
    results = run_ranks(2, profile_in_engine_batchnorm_job, timeout=100)
    assert all(status == "ok" for status, _ in results.values()), results
    tables = [costs_from_json(value) for _, value in results.values()]
    assert tables[0] == tables[1] and tables[0].runtime.replica_link is None


@pytest.mark.timeout(120)
def test_profile_in_engine_on_three_ranks_runs_no_two_replica_pipeline():
    results = run_ranks(3, profile_in_engine_odd_job, timeout=100)
    assert all(status == "ok" for status, _ in results.values()), results
    tables = [costs_from_json(value) for _, value in results.values()]
    assert tables[0] == tables[1] == tables[2]
    assert tables[0].runtime.replica_link is None  # nothing to fit it from
    assert tables[0].runtime.action_overhead == 0.0


def _documents(schedule, factor, start=lambda step, rank: 0.0) -> list[dict]:
    """Runtime-trace documents of two steps of ``schedule``: each action takes ``factor(step, action)``
    seconds, one after the other on its rank, the first ``start(step, rank)`` seconds into the step."""
    documents = []
    for rank, actions in enumerate(schedule.ranks):
        steps = []
        for step in range(2):
            now, events = round(start(step, rank) * 1e9), []
            for action in actions:
                end = now + round(factor(step, action) * 1e9)
                events.append({"name": str(action), "kind": "compute", "start_ns": now, "end_ns": end})
                now = end
            steps.append({"step": step, "start_ns": 0, "end_ns": now, "events": events})
        documents.append({"format": TRACE_FORMAT, "rank": rank, "world_size": len(schedule.ranks),
                          "clock": "unix_ns", "schedule": json.loads(schedule_to_json(schedule)), "steps": steps})
    return documents


@pytest.mark.parametrize("drift", [1.0, 1.5])
def test_time_spread_is_the_variation_left_after_each_steps_drift(drift):
    schedule = profiling_schedule(2, 2, 2, split_backward=False)
    # micro-batch 0 at 0.8 and 1 at 1.2 of the piece's time: 0.2 either way; the second step all
    # ``drift`` times slower, which the spread must not count
    base = {"F": 0.01, "B": 0.02}
    run = run_trace_from_documents(_documents(
        schedule, lambda step, a: base[a.kind] * (1 + a.stage) * (0.8 if a.microbatch == 0 else 1.2)
        * (drift if step else 1.0)))
    spread = time_spread([(run, task_durations(run, steps=[0, 1]))], [0, 1])
    assert spread == pytest.approx(1.4826 * 0.2, rel=1e-3)
    steady = run_trace_from_documents(_documents(schedule, lambda step, a: base[a.kind] * (drift if step else 1.0)))
    assert time_spread([(steady, task_durations(steady, steps=[0, 1]))], [0, 1]) == pytest.approx(0.0, abs=1e-6)


def test_start_skew_is_the_mean_gap_between_ranks_that_start_at_once():
    # 4 ranks, two of which (0 and 3) start the step: 3 ms apart in step 0, 1 ms in step 1 (rank 0
    # late there); the middle ranks' first actions wait for data and do not count
    schedule = profiling_schedule(4, 4, 2, split_backward=False, replicas=2)
    offsets = {(0, 3): 3e-3, (1, 0): 1e-3, (0, 1): 7e-3, (1, 2): 9e-3}
    run = run_trace_from_documents(_documents(schedule, lambda step, a: 0.01,
                                              lambda step, rank: offsets.get((step, rank), 0.0)))
    assert start_skew(run, [0, 1]) == pytest.approx(2e-3)
    assert start_skew(run, [1]) == pytest.approx(1e-3)
    one = profiling_schedule(2, 2, 2, split_backward=False)  # one replica: one rank starts
    assert start_skew(run_trace_from_documents(_documents(one, lambda step, a: 0.01)), [0, 1]) == 0.0


@pytest.mark.parametrize("bandwidth", [None, 1e3])
@pytest.mark.parametrize("latency", [0.0, 0.25, 3.0])
def test_the_exchange_latency_fit_inverts_the_priced_exchange(latency, bandwidth):
    schedule = profiling_schedule(2, 2, 3, split_backward=False, replicas=2)
    params = [400.0, 100.0]
    seconds = exchange_time(params, schedule, Link(latency=latency, bandwidth=bandwidth))
    assert exchange_latency(seconds, params, schedule, bandwidth) == pytest.approx(latency, abs=1e-9)
    if bandwidth is not None:  # faster than the bytes alone allow: no latency
        assert exchange_latency(0.1, params, schedule, bandwidth) == 0.0
    assert exchange_latency(1.0, [0.0, 0.0], schedule, bandwidth) == 0.0  # nothing to exchange


def test_the_action_cost_fit_compares_runs_timed_whole_with_their_pieces():
    # pieces of 1 s (F) and 2 s (B) of compute, each traced action holding 0.25 s of the runtime's own
    bounds = [0, 3, 7]  # runs of 3 and 4 pieces: stages 0, 1 (first replica) and 2, 3 (second)

    def raw(piece: int, kind: str) -> float:
        return (1.0 if kind == "F" else 2.0) + 0.25

    whole = {(stage, kind): n * (1.0 if kind == "F" else 2.0) + 0.25
             for stage, n in ((0, 3), (1, 4), (2, 3), (3, 4)) for kind in ("F", "B")}
    assert fitted_action_cost(raw, bounds, whole) == pytest.approx(0.25)
    slower = {key: value + 1.0 for key, value in whole.items()}  # whole runs slower than their pieces: no cost
    assert fitted_action_cost(raw, bounds, slower) == 0.0
    assert fitted_action_cost(raw, [0, 1, 2], {}) == 0.0  # one piece per run: nothing to compare


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.mark.timeout(150)
def test_pipeloom_profile_in_engine_on_two_ranks(tmp_path):
    out = tmp_path / "costs.json"
    results = run_ranks(2, profile_cli_job, str(EXAMPLE), str(out), timeout=120)
    assert results == {0: ("ok", 0), 1: ("ok", 0)}, results
    assert [p.name for p in tmp_path.iterdir()] == ["costs.json"]  # no rank leaves a temporary file
    table = load_costs(out)  # written by rank 0 only: another rank's empty staged file must not replace it
    assert table.names == ("token_embedding", "blocks.0", "blocks.1", "ln_f", "head")
    assert table.microbatch_size == 2 and table.optimizer_factor == 6
    assert "in the engine, 2 ranks" in table.device and table.runtime.replica_link is not None


@pytest.mark.parametrize(("extra", "words"), [
    ([], "torchrun --nproc-per-node 2 -m pipeloom profile"),
    (["--device", "cuda"], "profiles CPU ranks with gloo, not --device cuda"),
])
def test_pipeloom_profile_in_engine_says_how_to_launch_it(capsys, monkeypatch, tmp_path, extra, words):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["profile", f"{EXAMPLE}:build_model", "--batch", "2", "--seq", "8", "--loss", "lm_loss",
                 "--in-engine", "--save", str(tmp_path / "c.json"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "c.json").exists()


def test_pipeloom_profile_in_engine_needs_a_loss(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: the missing loss is found before any group starts
    code = main(["profile", f"{EXAMPLE}:build_model", "--batch", "2", "--seq", "8", "--in-engine"])
    err = capsys.readouterr().err
    assert code == 2 and "name the loss with --loss NAME" in err, err


def test_an_exchange_lost_in_the_noise_is_priced_with_the_stage_link(caplog):
    """The two-replica run measured no longer outside its schedule than the one-replica run: the exchange had been
    fitted as free (0 ms a message), and the planner then chose chimera; it is priced with the stage link, said once."""
    schedule = profiling_schedule(2, 2, 3, split_backward=False, replicas=2)
    run = run_trace_from_documents(_documents(schedule, lambda step, a: 0.01))  # nothing outside its schedule
    link = Link(latency=2e-3, bandwidth=1e9)
    with caplog.at_level("WARNING", logger="pipeloom.profile.fits"):
        assert fitted_replica_link(run, [0, 1], 1e-3, [400.0, 100.0], link, speak=True) == link
        assert fitted_replica_link(run, [0, 1], 1e-3, [400.0, 100.0], link, speak=False) == link
    [said] = [record.getMessage() for record in caplog.records]
    assert "measured no longer than the one-replica step (-1.00 ms: noise)" in said and "more --repeats" in said
    fitted = fitted_replica_link(run, [0, 1], -4e-3, [400.0, 100.0], link, speak=True)  # 4 ms beyond: measured
    assert fitted.latency == pytest.approx(exchange_latency(4e-3, [400.0, 100.0], schedule, 1e9))
