"""The engine on 2 and 4 gloo ranks (spawned CPU processes): bitwise-exact gradients and losses for
every built-in schedule and for searched ones, failures that reach every rank, shape changes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from models import assert_bitwise_reports
from rank_jobs import (
    exactness,
    fault,
    float64_loss,
    freezing_between_steps,
    group_after_a_failure,
    replicas_eval,
    shape_change,
    two_replicas,
)
from ranks import run_ranks

from pipeloom.search import search
from pipeloom.search.placements import placement

LIBRARY = [  # (schedule, pieces per rank, options)
    ("gpipe", 1, None), ("1f1b", 1, None), ("interleaved-1f1b", 2, None), ("looped-bfs", 2, None),
    ("zb-h1", 1, None), ("zb-h2", 1, None), ("zbv", 2, None), ("dualpipev", 2, None),
    ("dualpipe", 1, None), ("chimera", 1, None),
]


def _searched(name: str, world: int, *, split: bool):
    problem = placement(name, world, split_backward=split)
    return search(problem, 8, time_limit=3.0, workers=1, name=f"searched-{name}").schedule


def _cases(world: int) -> list:
    cases = [("residual", name, world * per, options) for name, per, options in LIBRARY]
    cases += [("skip", "1f1b", world, None), ("two_inputs", "zb-h1", world, None),
              ("skip", "interleaved-1f1b", 4, None) if world == 2 else ("skip", "dualpipe", 4, None),
              ("two_inputs", "zbv", 4, None) if world == 2 else ("two_inputs", "chimera", 4, None)]
    cases += [("residual", _searched("v", world, split=True), 2 * world, None),
              ("residual", _searched("linear", world, split=True), world, None)]
    return cases


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def exact_runs(request):
    world = request.param
    cases = _cases(world)
    results = run_ranks(world, exactness, cases, timeout=240)
    return world, cases, results


@pytest.mark.timeout(300)
def test_every_schedule_is_bitwise_exact_on_every_rank(exact_runs):
    world, cases, results = exact_runs
    failures = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    assert not failures, failures
    keys = set()
    for rank, (_, report) in results.items():
        assert len(report) == len(cases)
        for key, outcome in report.items():
            keys.add(key)
            assert outcome["mismatches"] == [], (rank, key, outcome)
            assert outcome["losses_equal"], (rank, key)
    # every parameter is owned by some rank (one rank, or two for a two-replica schedule)
    for key in keys:
        assert all(results[r][1][key]["owned"] > 0 for r in range(world)), key
    assert any(key.startswith("residual/searched-v") for key in keys)


@pytest.mark.timeout(240)
def test_values_and_weights_used_several_times_are_exact_across_ranks():
    """models.MultiUse in 4 pieces on 2 ranks. Under interleaved-1f1b (pieces 0, 2 on rank 0; 1, 3 on rank 1)
    h goes from rank 0 to piece 1 on rank 1 and back to piece 2 on rank 0, and piece 1's two uses of the
    weight ``tied`` cross to rank 0 apart in the shared-parameter exchange; under zbv (I and W apart)
    pieces 1 and 2 share rank 1."""
    cases = [("multi_use", "interleaved-1f1b", 4, None), ("multi_use", "zbv", 4, None)]
    results = run_ranks(2, exactness, cases, 3, timeout=200)
    assert_bitwise_reports(results, len(cases))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["raise", "die"])
def test_a_failing_rank_makes_every_rank_fail_quickly(mode):
    results = run_ranks(3, fault, mode, 1, timeout=90)
    if mode == "die":
        assert results[1][0] == "died"
    else:
        status, report = results[1]
        assert status == "ok", report
        assert "rank 1: stage 1" in report["message"] and "injected fault" in report["message"]
        assert "1F2" in report["message"]
    for rank in (0, 2):
        status, report = results[rank]
        assert status == "ok", report
        assert report["message"] is not None, f"rank {rank} finished although rank 1 failed"
        assert "rank 1" in report["message"] or "rank 2" in report["message"], report["message"]
        assert report["seconds"] < 30  # bounded by the 10 s timeout (plus teardown); never a hang


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "hang"])
def test_a_group_a_failed_engine_closed_is_refused_by_name(how):
    """After rank 1 raised in a step (its peers closed their connections) or hung past the timeout (gloo closed them
    itself), another engine of the same group and a new one on it had died of gloo's "Connection closed by peer" (or
    "Application timeout caused pair closure"); each is refused by name, and an engine on a new group trains."""
    results = run_ranks(2, group_after_a_failure, how, timeout=100)
    for rank, (status, found) in results.items():
        assert status == "ok", found
        assert found["failed"] is not None, (rank, found)
        assert (found["bystander"] or "").startswith("this engine's process group was closed by an engine that "
                                                     "failed on it"), (rank, found["bystander"])
        said = found["same group"] or ""
        assert said.startswith("pipeline(): an engine failed on this process group earlier ("), (rank, said)
        assert "the default group is one of them" in said and "process_group=torch.distributed.new_group()" in said
    assert isinstance(results[1][1]["new group"], float)  # the last stage's rank holds the loss


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_piece_frozen_and_unfrozen_between_steps_trains_as_one_device(schedule):
    """A new user's trial (2026-12-07): freezing the first piece after a step (fine-tuning's usual move) had killed
    the run, its output no longer requiring a gradient where the first step had learnt one."""
    results = run_ranks(2, freezing_between_steps, schedule, timeout=100)
    for rank, (status, found) in results.items():
        assert status == "ok", found
        assert found["losses"] == [True] * 3 and found["mismatches"] == [[]] * 3, (rank, found)


@pytest.mark.timeout(120)
def test_a_stage_whose_output_shape_changes_is_named_with_both_sides():
    results = run_ranks(2, shape_change, timeout=90)
    status, messages = results[0]
    assert status == "ok", messages
    assert messages and "stage 0 (rank 0) produced [float32[2, 8] requiring grad]" in messages[0], messages
    assert "stage 1 (rank 1) expects [float32[2, 4] requiring grad]" in messages[0], messages
    assert results[1][0] == "ok"
    assert results[1][1], "rank 1 must fail too"




@pytest.mark.timeout(120)
def test_a_float64_loss_is_the_same_float64_on_every_rank():
    results = run_ranks(2, float64_loss, timeout=90)
    for rank, (status, found) in results.items():
        assert status == "ok", found
        assert all(found.values()), (rank, found)


@pytest.mark.timeout(180)
def test_eval_step_with_data_parallel_replicas_returns_the_whole_batch():
    """eval_step(x) without a target on a mesh with replicas had returned, on each rank holding a last piece, its
    replica's rows alone (8 of 16) without a word; it returns the whole batch's outputs, one device's."""
    results = run_ranks(4, replicas_eval, timeout=150)
    assert all(status == "ok" for status, _ in results.values()), results
    assert all(found["tp dtensor"] is True for _, found in results.values()), results  # every tp rank holds outputs
    for name, holders in (("dp pp", 2), ("fsdp", 2), ("dualpipe", 4)):  # dualpipe: a last piece on both pp ranks
        for case in (name,) if name == "fsdp" else (name, f"{name} sequence first"):  # (tokens, rows, 3): had
            said = [found[case] for _, found in results.values()]  # been joined along the tokens
            assert said.count(True) == holders and said.count("none") == 4 - holders, (case, said)


@pytest.mark.timeout(180)
def test_two_replicas_return_the_whole_batch_and_refuse_buffers_they_change_apart():
    """DualPipe's and Chimera's eval_step had returned, on each rank holding a last piece, a list of its replica's
    micro-batches; they return the whole batch's outputs, one device's, as 1F1B and DualPipeV do (on a rank without
    a last piece, None). A BatchNorm model's running statistics had been updated by each replica from its own
    micro-batches and silently kept apart; its first step is refused, naming the buffers, where one-replica schedules
    run it. Two data-parallel replicas had kept them apart too (a new user's trial, 2026-12-06, on the mesh the
    planner chose): refused alike."""
    results = run_ranks(2, two_replicas, timeout=150)
    for rank, (status, found) in results.items():
        assert status == "ok", found
        assert found["dualpipe"] is True and found["chimera"] is True, (rank, found)  # both ranks hold a last piece
        assert found["1f1b"] == (True if rank == 1 else "none") and found["dualpipev"] == (True if rank == 0
                                                                                           else "none"), (rank, found)
        for name in ("dualpipe", "chimera"):
            said = found[f"{name} batchnorm"]
            assert said.startswith(f"schedule {name!r} holds two replicas of each piece, and the step changed "), said
            assert "'1.running_mean'" in said and "'4.running_var'" in said, said
            assert "differently in each" in said and "choose a one-replica schedule" in said, said
        assert found["1f1b batchnorm"] == "ran" and found["dualpipev batchnorm"] == "ran", (rank, found)
        for sharding in ("replicate", "fsdp"):  # data-parallel replicas had kept their statistics apart silently
            said = found[f"dp {sharding} batchnorm"]
            assert said.startswith("the step changed piece 0's '1.running_mean'"), said
            assert "differently in each of the 2 data-parallel replicas" in said and "--dp 1" in said, said


@pytest.mark.timeout(180)
def test_the_batched_nccl_code_path_is_exact_on_gloo():
    cases = [("residual", name, 2 * per, None) for name, per, _ in LIBRARY if name in ("1f1b", "zbv", "dualpipe")]
    results = run_ranks(2, exactness, cases, 2, True, timeout=150)
    for rank, (status, report) in results.items():
        assert status == "ok", report
        for key, outcome in report.items():
            assert outcome["mismatches"] == [] and outcome["losses_equal"], (rank, key, outcome)


@pytest.mark.timeout(240)
def test_a_lowered_schedule_handed_in_runs_exactly(tmp_path):
    """A schedule already lowered (pipeloom.lower, or torch's compute_comms CSV) runs as given: its
    receives are posted where its RECV actions stand; on gloo and on the NCCL transport."""
    from pipeloom import build_schedule, lower, save_schedule

    zbv = lower(build_schedule("zbv", 2, 8))
    path = tmp_path / "1f1b_comms.csv"
    save_schedule(lower(build_schedule("1f1b", 2, 8)), path)
    cases = [("residual", zbv, 4, None), ("residual", str(path), 2, None),
             ("residual", lower(build_schedule("dualpipe", 2, 8)), 2, None)]
    for batched in (False, True):
        results = run_ranks(2, exactness, cases, 2, batched, timeout=150)
        for rank, (status, report) in results.items():
            assert status == "ok", report
            assert len(report) == 3
            for key, outcome in report.items():
                assert outcome["mismatches"] == [] and outcome["losses_equal"], (batched, rank, key, outcome)
