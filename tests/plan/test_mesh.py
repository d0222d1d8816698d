"""Pipeline × data parallel in the planner (pipeloom.plan.mesh) and the torchtitan export.

Oracles: the ring collectives' closed forms; a synthetic table where replicas are faster by the
predictor (a free link, few micro-batches, so a long pipeline idles) and one where they are slower
(a slow link between replicas and heavy weights); memory that fits only when fsdp shards the optimizer
state; the plan file's round trip; torch's CSV reader on the exported schedule.
"""

from __future__ import annotations

import csv
import dataclasses
import io

import pytest

from pipeloom.ir import schedule_from_csv
from pipeloom.plan import CostTable, Link, Piece, PlanError, load_plan, plan_mesh, plan_pipeline
from pipeloom.plan.export.torchtitan import torchtitan_settings, torchtitan_toml, write_torchtitan
from pipeloom.plan.mesh import BUCKET_BYTES, collective_time, reduction_time
from pipeloom.plan.plan import Plan, plan_from_json, plan_to_json


def _table(n: int = 8, *, param_bytes: float = 10.0, link: Link = Link(), optimizer_factor: float = 2.0) -> CostTable:
    pieces = tuple(Piece(name=f"blocks.{k}", f=1.0, i=1.0, w=1.0, activation_bytes=100.0, w_activation_bytes=20.0,
                         param_bytes=param_bytes, output_bytes=8.0) for k in range(n))
    return CostTable(pieces=pieces, microbatch_size=1, link=link, optimizer_factor=optimizer_factor)


def test_ring_collectives_have_their_closed_forms():
    link = Link(latency=1e-3, bandwidth=1e9)
    nbytes = 3 * BUCKET_BYTES  # three buckets
    assert collective_time(nbytes, 4, link, kind="all_reduce") == pytest.approx(3 * 6 * 1e-3 + 1.5 * nbytes / 1e9)
    assert collective_time(nbytes, 4, link, kind="reduce_scatter") == pytest.approx(3 * 3 * 1e-3 + 0.75 * nbytes / 1e9)
    assert collective_time(nbytes, 1, link, kind="all_reduce") == 0.0
    assert collective_time(0, 8, link, kind="all_gather") == 0.0


def test_replicas_are_chosen_when_the_predictor_says_they_are_faster():
    # 8 micro-batches on an 8-rank pipeline idle a lot; 2 x 4 halves the pipeline and the free link costs nothing
    result = plan_mesh(_table(), num_ranks=8, global_batch=16, schedules=["1f1b"], microbatches=[8, 4, 2])
    only_pipeline = plan_pipeline(_table(), num_ranks=8, global_batch=16, schedules=["1f1b"], microbatches=[8])
    assert result.plan.data_parallel > 1
    assert result.plan.world_size == 8 and result.plan.global_batch == 16
    assert result.plan.predicted_step_time < only_pipeline.plan.predicted_step_time
    assert {c.data_parallel for c in result.candidates} == {1, 2, 4, 8}
    assert [c.step_time for c in result.candidates if c.fits] == sorted(c.step_time for c in result.candidates
                                                                        if c.fits)


def test_pieces_that_update_running_statistics_are_planned_without_replicas():
    """The runtime refuses data-parallel replicas that update BatchNorm's statistics apart after the first step; the
    planner had chosen dp 2 for such a model (a new user's trial, 2026-12-06). Without replicas the same job plans
    one pipeline; replicas asked for are refused, naming the pieces and the fix."""
    table = _table()
    table = dataclasses.replace(table, pieces=tuple(dataclasses.replace(p, running_stats=k == 1)
                                                    for k, p in enumerate(table.pieces)))
    request = dict(num_ranks=8, global_batch=16, schedules=["1f1b"], microbatches=[8, 4, 2])
    assert plan_mesh(_table(), **request).plan.data_parallel > 1  # as the replicas test above
    result = plan_mesh(table, **request)
    assert result.plan.data_parallel == 1 and {c.data_parallel for c in result.candidates} == {1}
    with pytest.raises(PlanError, match=r"data parallel size 2: piece\(s\) blocks.1 update running statistics.*"
                                        r"use --dp 1"):
        plan_mesh(table, data_parallel=[1, 2], **request)


def test_one_pipeline_is_kept_when_the_replicas_link_is_slow():
    slow = Link(latency=1.0, bandwidth=1.0)  # one byte per second between replicas
    result = plan_mesh(_table(param_bytes=1e3), num_ranks=4, global_batch=16, schedules=["1f1b"], dp_link=slow)
    assert result.plan.data_parallel == 1
    replicated = [c for c in result.candidates if c.fits and c.data_parallel == 2]
    best_pipeline = min(c.step_time for c in result.candidates if c.fits and c.data_parallel == 1)
    assert replicated and min(c.step_time for c in replicated) > best_pipeline


def test_the_reduction_overlaps_the_rest_of_the_schedule():
    """A stage's all-reduce starts when its last gradient action ends: the first rank's stage finishes
    last under 1F1B, so a reduction shorter than the others' slack adds only the first rank's own."""
    table = _table(4, param_bytes=1.0, link=Link(latency=0.5))
    result = plan_pipeline(table, num_ranks=4, global_batch=4, schedules=["1f1b"], microbatches=[4])
    best = result.candidates[0]
    extra = reduction_time(best, table, data_parallel=2, link=Link(latency=0.5))
    assert extra == pytest.approx(2 * 0.5)  # one bucket, 2(d - 1) latencies, after rank 0's last backward
    assert reduction_time(best, table, data_parallel=1, link=Link(latency=0.5)) == 0.0


def test_fsdp_shards_the_optimizer_state_to_fit():
    table = _table(param_bytes=1000.0, optimizer_factor=6.0)
    # 2 pieces per rank x 1000 B x (2 + 6) = 16 kB static with replicas; fsdp over 2: 2 + 3 -> 10 kB
    with pytest.raises(PlanError):
        plan_mesh(table, num_ranks=8, global_batch=16, data_parallel=[2], memory_limit=12_000, schedules=["1f1b"])
    result = plan_mesh(table, num_ranks=8, global_batch=16, data_parallel=[2], memory_limit=12_000,
                       schedules=["1f1b", "dualpipe"], sharding="fsdp")
    assert result.plan.data_parallel == 2 and result.plan.sharding == "fsdp"
    assert max(result.plan.peak_memory) <= 12_000
    assert all(c.schedule != "dualpipe" for c in result.candidates)  # the runtime shards one-replica schedules


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"data_parallel": [3]}, "does not divide 8 ranks"),
    ({"data_parallel": [8], "global_batch": 12}, "does not divide the global batch 12"),
    ({"sharding": "zero"}, "sharding must be one of replicate, fsdp"),
])
def test_bad_mesh_requests_name_the_fix(kwargs, words):
    request = {"num_ranks": 8, "global_batch": 16, **kwargs}
    with pytest.raises(PlanError, match=words):
        plan_mesh(_table(), **request)


def test_the_plan_file_carries_the_mesh(tmp_path):
    plan = Plan(num_ranks=4, split_points=("blocks.2", "blocks.4", "blocks.6"), schedule="1f1b", microbatches=4,
                global_batch=32, predicted_step_time=1.0, data_parallel=2, sharding="fsdp")
    assert plan.microbatch_size == 4 and plan.world_size == 8
    again = plan_from_json(plan_to_json(plan))
    assert again == plan
    old = plan_to_json(Plan(num_ranks=4, split_points=("blocks.2", "blocks.4", "blocks.6"), schedule="1f1b",
                            microbatches=4, global_batch=32, predicted_step_time=1.0))
    assert plan_from_json(old.replace('"data_parallel": 1,', "")).data_parallel == 1  # older files still load
    with pytest.raises(PlanError, match="not a multiple of microbatches 4 x data_parallel 3"):
        Plan(num_ranks=4, split_points=("blocks.2", "blocks.4", "blocks.6"), schedule="1f1b", microbatches=4,
             global_batch=32, predicted_step_time=1.0, data_parallel=3)


@pytest.mark.parametrize(("schedule", "name", "placement"), [
    ("1f1b", "1F1B", [0, 1, 2, 3]),
    ("interleaved-1f1b", "Interleaved1F1B", [0, 1, 2, 3, 0, 1, 2, 3]),
    ("zbv", "ZBVZeroBubble", [0, 1, 2, 3, 3, 2, 1, 0]),
])
def test_torchtitan_export_writes_settings_and_a_csv_torch_reads(tmp_path, schedule, name, placement):
    result = plan_mesh(_table(16), num_ranks=8, global_batch=32, schedules=[schedule], data_parallel=[2],
                       microbatches=[8])
    plan = result.plan
    modules = [f"blocks.{k}" for k in range(16)]
    settings = write_torchtitan(plan, result.schedule, tmp_path / "p.toml", tmp_path / "p.csv", modules=modules,
                                args_path=tmp_path / "p.args")
    parallelism = settings["parallelism"]
    assert parallelism["pipeline_parallel_schedule"] == name
    assert parallelism["pipeline_parallel_degree"] == 4 and parallelism["data_parallel_replicate_degree"] == 2
    parts = parallelism["module_fqns_per_model_part"]  # each stage's modules, in order, cut at the split points
    assert len(parts) == len(placement) and sum(parts, []) == modules
    assert [part[0] for part in parts[1:]] == list(plan.split_points)
    assert parallelism["pipeline_parallel_microbatch_size"] == plan.microbatch_size == 2
    assert settings["training"] == {"local_batch_size": 16, "global_batch_size": 32}
    rows = list(csv.reader(io.StringIO((tmp_path / "p.csv").read_text())))
    assert len(rows) == 4
    back = schedule_from_csv((tmp_path / "p.csv").read_text())
    assert back.ranks == result.schedule.ranks
    stage_rank = {a.stage: r for r, actions in enumerate(back.ranks) for a in actions}
    assert [stage_rank[s] for s in range(len(placement))] == placement
    text = (tmp_path / "p.toml").read_text()
    assert "[parallelism]" in text and f'pipeline_parallel_schedule = "{name}"' in text
    import tomllib

    loaded = tomllib.loads(text)["parallelism"]
    assert loaded["pipeline_parallel_schedule_csv"] == str((tmp_path / "p.csv").resolve())
    assert loaded["module_fqns_per_model_part"] == parts
    args = (tmp_path / "p.args").read_text().splitlines()
    assert args[1].startswith("--parallelism.pipeline_parallel_degree 4 --parallelism.module_fqns_per_model_part ")
    assert args[3] == "--training.disable_cuda_graphs"


def test_torchtitan_export_refuses_two_replica_schedules():
    result = plan_pipeline(_table(), num_ranks=4, global_batch=8, schedules=["dualpipe"], microbatches=[8])
    with pytest.raises(PlanError, match="two model replicas per rank.*without dualpipe, chimera"):
        torchtitan_settings(result.plan, result.schedule, "x.csv", modules=[f"blocks.{k}" for k in range(8)])
    assert "[training]" in torchtitan_toml({"training": {"local_batch_size": 4}})
    one = plan_pipeline(_table(), num_ranks=4, global_batch=8, schedules=["1f1b"], microbatches=[4])
    ep = dataclasses.replace(one.plan, data_parallel=2, expert_parallel=2)
    with pytest.raises(PlanError, match="expert_parallel=2 ranks.*export a plan saved with ep=1"):
        torchtitan_settings(ep, one.schedule, "x.csv", modules=[f"blocks.{k}" for k in range(8)])


def test_torchtitan_async_tp_goes_on_each_versions_own_line(tmp_path):
    """Async tensor parallelism is ``parallelism.enable_async_tensor_parallel`` in 0.2.x (its TOML and line) and
    ``compile.enable_async_tensor_parallel`` in 0.3.x (its line): never on the shared line; only with compile, which
    both versions need for it (tests/plan/test_torchtitan_export.py reads them with torchtitan's own parsers)."""
    result = plan_mesh(_table(16), num_ranks=8, global_batch=32, schedules=["1f1b"], data_parallel=[2],
                       microbatches=[8])
    modules = [f"blocks.{k}" for k in range(16)]
    with pytest.raises(PlanError, match="async tensor parallelism runs only under torch.compile"):
        write_torchtitan(result.plan, result.schedule, tmp_path / "p.toml", tmp_path / "p.csv", modules=modules,
                         async_tp=True)
    write_torchtitan(result.plan, result.schedule, tmp_path / "p.toml", tmp_path / "p.csv", modules=modules,
                     args_path=tmp_path / "p.args", compiled=True, async_tp=True)
    lines = (tmp_path / "p.args").read_text().splitlines()
    assert "enable_async" not in lines[1] and lines[1].endswith("--compile.enable")
    assert lines[3] == "--parallelism.enable_async_tensor_parallel"
    assert lines[5] == "--training.disable_cuda_graphs --compile.enable_async_tensor_parallel"
    assert "enable_async_tensor_parallel = true" in (tmp_path / "p.toml").read_text()


def test_stage_modules_cut_the_pieces_and_refuse_what_torchtitan_cannot_split():
    from pipeloom.plan.export.torchtitan import stage_modules

    modules = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    assert stage_modules(["layers.1", "norm"], modules) == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"],
                                                            ["norm", "output"]]
    with pytest.raises(PlanError, match="piece 'layers.0.attention' of the cost table is finer"):
        stage_modules(["layers.1"], ["layers.0.attention", "layers.1"])
    with pytest.raises(PlanError, match=r"split point\(s\) \['blocks.3'\] are not pieces of the cost table"):
        stage_modules(["blocks.3"], modules)
    with pytest.raises(PlanError, match="not in the cost table's piece order"):
        stage_modules(["norm", "layers.1"], modules)


def test_cli_plans_the_mesh_and_exports(tmp_path, capsys):
    from pipeloom.cli import main
    from pipeloom.plan import save_costs

    save_costs(_table(), tmp_path / "costs.json")
    code = main(["plan", "--costs", str(tmp_path / "costs.json"), "--ranks", "8", "--global-batch", "16",
                 "--schedules", "1f1b", "--save", str(tmp_path / "plan.json"), "--export", "torchtitan"])
    out = capsys.readouterr().out
    assert code == 0 and "mesh (dp x pp)" in out and "--parallelism.pipeline_parallel_degree" in out
    plan = load_plan(tmp_path / "plan.json")
    assert plan.data_parallel * plan.num_ranks == 8
    assert all((tmp_path / f"plan.torchtitan.{ext}").exists() for ext in ("toml", "args"))
    # the schedule's CSV only for a pipeline: torchtitan builds none for one stage, and nothing would read it
    assert (tmp_path / "plan.torchtitan.csv").exists() == (plan.num_ranks > 1) == (" and schedule " in out)
    graphs = "--training.disable_cuda_graphs " if plan.num_ranks > 1 else ""  # CUDA graphs refuse a pipeline only
    assert f"torchtitan 0.3.x also: {graphs}activation_checkpoint:none" in out
    assert "torchtitan 0.2.x also: --activation_checkpoint.mode none" in out  # priced keeping every activation
    fine = CostTable(pieces=tuple(dataclasses.replace(p, name=f"layers.{k}.mlp", inputs=None)
                                  for k, p in enumerate(_table().pieces)), microbatch_size=1)
    save_costs(fine, tmp_path / "fine.json")
    code = main(["plan", "--costs", str(tmp_path / "fine.json"), "--ranks", "8", "--global-batch", "16",
                 "--schedules", "1f1b", "--save", str(tmp_path / "fine.plan.json"), "--export", "torchtitan"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "piece 'layers.0.mlp' of the cost table is finer" in err[0], err
    assert not (tmp_path / "fine.plan.json").exists()  # refused before anything was written
    code = main(["plan", "--costs", str(tmp_path / "costs.json"), "--ranks", "8", "--global-batch", "16",
                 "--export", "torchtitan"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "give --save PLAN.json too" in err[0]
