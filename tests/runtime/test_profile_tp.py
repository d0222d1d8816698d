"""Profiling tensor-parallel stages inside the engine (pipeloom.profile.profile_in_engine with mesh= and tp_plan=):
on 4 gloo ranks, a (pp 2, tp 2) mesh running Megatron's column->row plan; the collectives counted per piece
against Megatron's formula (2 all-reduces of the layer's output forward and 2 backward per layer), the table's
tensor field against what the planner needs (it loads, plans with tp 2 from the measured times)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from profile_tp_jobs import BATCH, HEADS, HIDDEN, MICROBATCHES, SEQ, profile_cli_job, profile_tp_job, refused_job
from ranks import run_ranks

from pipeloom.cli import main
from pipeloom.plan.costs.file import costs_from_json, costs_to_json, load_costs
from pipeloom.plan.mesh import plan_mesh
from pipeloom.plan.tp.megatron import layer_collectives, tensor_parallel_table


def _run(world: int, fn, *args, timeout: float) -> dict:
    """Every rank's result; asserts none failed."""
    results = run_ranks(world, fn, *args, timeout=timeout)
    bad = {rank: value for rank, value in results.items() if value[0] != "ok"}
    assert not bad, bad
    return {rank: value for rank, (_, value) in results.items()}


@pytest.fixture(scope="module")
def profiled() -> dict:
    return _run(4, profile_tp_job, timeout=240)


def test_every_rank_gets_the_same_table_and_the_model_is_left_alone(profiled):
    assert len({r["table"] for r in profiled.values()}) == 1
    assert all(r["plain"] and r["no_grads"] for r in profiled.values())


def test_counted_collectives_per_piece_equal_megatrons_formula(profiled):
    table = costs_from_json(profiled[0]["table"])
    info = table.tensor
    assert info.heads == HEADS
    assert info.layers == ("layers.0", "layers.1")  # read from the plan's Colwise/Rowwise keys
    assert info.column == ("attn.qkv", "mlp.0") and info.row == ("attn.proj", "mlp.2")
    (profile,) = info.profiles
    assert profile.size == 2 and [p.name for p in profile.pieces] == list(table.names)
    activation = BATCH // MICROBATCHES * SEQ * HIDDEN * 4  # one micro-batch's (b, s, h), float32
    for measured, piece in zip(profile.pieces, table.pieces):
        if piece.name in info.layers:
            assert piece.output_bytes == activation
            key = sorted((c.kind, c.phase, c.bytes) for c in measured.collectives)
            assert key == sorted((c.kind, c.phase, c.bytes) for c in layer_collectives(info, piece.output_bytes))
            assert key == [("all_reduce", "F", activation)] * 2 + [("all_reduce", "I", activation)] * 2
        else:
            assert measured.collectives == ()  # the embedding and the head stay whole
        assert measured.f > 0 and measured.full_backward is not None and measured.full_backward > 0


def test_fitted_table_loads_and_plans_with_the_measured_tp_times(profiled):
    table = costs_from_json(profiled[0]["table"])
    assert costs_from_json(costs_to_json(table)) == table
    fit = table.tensor.fit
    assert "all_reduce" in fit.overhead and fit.overhead["all_reduce"] >= 0
    assert fit.bandwidth["all_reduce"] is None or fit.bandwidth["all_reduce"] > 0
    sharded = tensor_parallel_table(table, 2)
    (profile,) = table.tensor.profiles
    assert [p.f for p in sharded.pieces] == [p.f for p in profile.pieces]  # measured, not the formulas
    assert sharded.runtime.step_overhead == profile.runtime["step_overhead"]
    result = plan_mesh(table, num_ranks=4, global_batch=BATCH, tensor_parallel=[1, 2], data_parallel=[1],
                       schedules=["1f1b", "gpipe"], microbatches=[MICROBATCHES])
    sizes = {c.tensor_parallel for c in result.candidates if c.fits}
    assert sizes == {1, 2}
    best_tp2 = min((c for c in result.candidates if c.tensor_parallel == 2 and c.fits), key=lambda c: c.step_time)
    assert best_tp2.step_time >= profile.runtime["step_overhead"]
    assert result.plan.tensor_parallel in (1, 2)


def test_requests_that_cannot_run_are_refused_by_name():
    errors = _run(2, refused_job, timeout=120)[0]
    assert len(errors) == 4, errors
    assert "tp_plan=" in errors[0] and "heads=" in errors[1]
    assert "('dp', 'tp')" in errors[2] and "divide the 3 heads" in errors[3]


def test_cli_profiles_tp_stages_into_the_saved_table(tmp_path):
    out = tmp_path / "costs.json"
    results = _run(4, profile_cli_job, str(out), timeout=240)
    assert all(code == 0 for code, _ in results.values()), results
    printed = results[0][1]
    assert "tensor parallel (tp 2, measured): layers layers.0, layers.1; per layer and micro-batch 2 all_reduce F, " \
           "2 all_reduce I" in printed
    table = load_costs(out)  # rank 0 wrote it
    assert table.tensor.profiles[0].size == 2 and table.tensor.heads == HEADS


@pytest.mark.parametrize(("extra", "words"), [
    (["--tp", "2"], "--tp profiles tensor-parallel stages inside the runtime; add --in-engine"),
])
def test_cli_tp_needs_in_engine(extra, words, capsys):
    assert main(["profile", "tests/runtime/profile_tp_jobs.py:build_model", "--batch", "2", *extra]) != 0
    assert words in capsys.readouterr().err
