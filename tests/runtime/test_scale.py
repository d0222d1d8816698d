"""Models larger than one device and pipelines × replicas, on spawned gloo ranks: a model built on the
meta device is filled by the engine (only this rank's pieces are allocated) and trains bitwise as on one
device; on a (dp 2, pp 2) mesh the replicas stay bitwise identical and match one device over the global
batch within the summation bound of docs/runtime.md."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F
from hf_models import build_hf, lm_loss, tokens
from models import SPLITS, batch, build, reference_step
from ranks import run_ranks
from scale_jobs import deferred, meshed, planned_mesh, replica_fault

from pipeloom.runtime import Parallelism, PipelineError, Tracing, Weights, pipeline

U = 2.0**-24  # float32's unit roundoff


@pytest.fixture(autouse=True)
def one_thread():
    """The ranks compute with one thread; so does the reference (CPU reductions such as LayerNorm's weight
    gradient add in another order with more threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tensors(value: object) -> object:
    """The ranks' results with their numpy arrays back as tensors."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tensors(v) for v in value]
    return value


def _ok(results: dict) -> dict:
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    return {r: _tensors(v[1]) for r, v in results.items()}


# ------------------------------------------------------------------------------ deferred initialisation

DEFERRED = [("residual", "1f1b", "dict"), ("residual", "zbv", "file"), ("residual", "zb-h1", "dcp"),
            ("gpt2", "1f1b", "dcp"), ("llama", "zb-h1", "init+dict")]


@pytest.fixture(scope="module")
def deferred_runs(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("deferred")
    for name in ("residual", "gpt2", "llama"):
        model = build_hf(name) if name != "residual" else build(name)
        torch.save(model.state_dict(), folder / f"{name}.pt")
        dcp.save(model.state_dict(), checkpoint_id=str(folder / f"{name}-dcp"), no_dist=True)
    return _ok(run_ranks(2, deferred, DEFERRED, str(folder), timeout=240))


@pytest.mark.parametrize("case", DEFERRED, ids=["-".join(c) for c in DEFERRED])
def test_a_meta_model_filled_by_the_engine_trains_bitwise(deferred_runs, case):
    model_name, schedule, source = case
    hf = model_name != "residual"
    reference = build_hf(model_name) if hf else build(model_name)
    if hf:
        inputs, target = tokens()
        total = None
        for x, y in zip(torch.chunk(inputs, 4), torch.chunk(target, 4)):
            loss = lm_loss(reference(x), y) / 4
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
    else:
        inputs, target = batch(model_name)
        total = reference_step(reference, inputs, target, 4)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for rank, found in deferred_runs.items():
        run = found[case]
        assert torch.equal(run["loss"], total), (rank, run["loss"], total)
        assert run["grads"], rank
        for name, grad in run["grads"].items():
            assert torch.equal(grad, expected[name]), (rank, name)


@pytest.mark.parametrize("case", DEFERRED, ids=["-".join(c) for c in DEFERRED])
def test_a_meta_model_never_allocates_another_ranks_pieces(deferred_runs, case):
    for rank, found in deferred_runs.items():
        run = found[case]
        for piece, (every, some) in run["allocated"].items():
            if piece in run["local"]:
                assert every, (rank, piece)
            else:
                assert not some, (rank, piece, "another rank's tensor was allocated")
        assert run["model_meta"] > 0, rank  # the model keeps the other ranks' parameters on meta


def test_meta_models_need_values_and_real_models_refuse_them():
    with torch.device("meta"):
        model = build("residual")
    with pytest.raises(PipelineError, match="meta device .*state_dict=.*init_weights="):
        pipeline(model, schedule="gpipe", split_points=[], microbatches=2, loss_fn=F.cross_entropy)
    with pytest.raises(PipelineError, match="not a torch.distributed.checkpoint|does not exist"):
        pipeline(
            model,
            schedule="gpipe",
            split_points=[],
            microbatches=2,
            loss_fn=F.cross_entropy,
            weights=Weights(state_dict="/nonexistent/model.pt"),
        )
    with pytest.raises(PipelineError, match="fill a model built on the meta device"):
        pipeline(
            build("residual"),
            schedule="gpipe",
            split_points=[],
            microbatches=2,
            loss_fn=F.cross_entropy,
            weights=Weights(state_dict=build("residual").state_dict()),
        )


def test_missing_non_persistent_buffers_are_named():
    with torch.device("meta"):
        model = build_hf("llama")
    state = build_hf("llama").state_dict()
    with pytest.raises(PipelineError, match="inv_freq.*init_weights="):
        pipeline(
            model,
            schedule="gpipe",
            split_points=[],
            microbatches=2,
            loss_fn=lm_loss,
            tracing=Tracing(example_inputs=(tokens()[0],)),
            weights=Weights(state_dict=state),
        )


def test_one_rank_meta_model_equals_the_model_it_was_saved_from():
    reference = build("skip")
    with torch.device("meta"):
        model = build("skip")
    engine = pipeline(
        model,
        schedule="gpipe",
        split_points=SPLITS["skip"][1],
        microbatches=4,
        loss_fn=F.cross_entropy,
        weights=Weights(state_dict=reference.state_dict()),
    )
    inputs, target = batch("skip")
    loss = engine.step(inputs[0], target=target)
    assert torch.equal(loss, reference_step(reference, inputs, target, 4))
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert not p.is_meta and torch.equal(p.grad, q.grad), name


# ------------------------------------------------------------------------------ pipeline × data parallel

MESHED = [("1f1b", 2), ("zbv", 4), ("dualpipe", 2)]
STEPS = 3


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mesh")
    return _ok(run_ranks(4, meshed, MESHED, STEPS, str(folder), timeout=300)), folder


def _per_microbatch_abs(model, inputs, target, n) -> dict:
    """Σ_m |g_m| per parameter: the scale of the summation bound."""
    totals = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for x, y in zip(torch.chunk(inputs[0], n), torch.chunk(target, n)):
        loss = F.cross_entropy(model(x), y) / n
        for (name, _), g in zip(model.named_parameters(), torch.autograd.grad(loss, list(model.parameters()))):
            totals[name] += g.abs()
    return totals


@pytest.mark.parametrize("schedule", [s for s, _ in MESHED])
def test_replicas_are_bitwise_identical(mesh_runs, schedule):
    runs, _ = mesh_runs
    by_pp: dict[int, list] = {}
    for found in runs.values():
        by_pp.setdefault(found[schedule]["pp"], []).append(found[schedule])
    assert sorted(by_pp) == [0, 1] and all(len(v) == 2 for v in by_pp.values())
    for first, second in by_pp.values():
        assert first["dp"] != second["dp"]
        for step in range(STEPS):
            assert torch.equal(first["losses"][step], second["losses"][step])
            assert first["grads"][step].keys() == second["grads"][step].keys()
            for name, grad in first["grads"][step].items():
                assert torch.equal(grad, second["grads"][step][name]), (step, name)
        assert all(torch.equal(v, second["params"][k]) for k, v in first["params"].items())


@pytest.mark.parametrize("schedule", [s for s, _ in MESHED])
def test_the_mesh_matches_one_device_over_the_global_batch(mesh_runs, schedule):
    runs, _ = mesh_runs
    model = build("residual")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 8  # 4 micro-batches per replica × 2 replicas
    for step in range(STEPS):
        inputs, target = batch("residual", rows=32, seed=step)
        scale = _per_microbatch_abs(copy.deepcopy(model), inputs, target, n)
        loss = reference_step(model, inputs, target, n)
        expected = {name: p.grad.clone() for name, p in model.named_parameters()}
        for rank, found in runs.items():
            run = found[schedule]
            if step == 0:  # the same micro-batch losses added in the same order
                assert torch.equal(run["losses"][0], loss), (rank, run["losses"][0], loss)
                names = set(run["grads"][0])
                assert names and names <= set(expected)
                for name in names:
                    error = (run["grads"][0][name] - expected[name]).abs()
                    bound = 2 * (n - 1) * U * scale[name]
                    assert bool((error <= bound).all()), (rank, name, float((error - bound).max()))
            else:  # the parameters drifted apart by rounding: the loss curve agrees closely
                assert torch.allclose(run["losses"][step], loss, rtol=1e-5, atol=0), (step, rank)
        optimizer.step()
        optimizer.zero_grad()


def test_clipping_and_checkpoints_cover_both_dimensions(mesh_runs):
    runs, folder = mesh_runs
    for schedule, _ in MESHED:
        norms = [found[schedule]["norm"] for found in runs.values()]
        assert all(torch.equal(norm, norms[0]) for norm in norms), schedule
    _checkpoints_load_into_one_device(runs, folder, [s for s, _ in MESHED])


def _checkpoints_load_into_one_device(runs: dict, folder, schedules: list[str]) -> None:
    """Each schedule's DCP folder loads into a one-device model holding every rank's final parameters."""
    import torch.distributed.checkpoint as dcp

    for schedule in schedules:
        model = build("residual")
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(folder / schedule), no_dist=True)
        model.load_state_dict(state["model"])
        for found in runs.values():
            for name, value in found[schedule]["params"].items():
                assert torch.equal(dict(model.named_parameters())[name].detach(), value), (schedule, name)


SHARDED = [("1f1b", 2), ("zbv", 4)]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    return _ok(run_ranks(4, meshed, SHARDED, STEPS, str(folder), "fsdp", timeout=300)), folder


@pytest.mark.parametrize("schedule", [s for s, _ in SHARDED])
def test_fsdp_shards_train_as_the_replicas_do(mesh_runs, fsdp_runs, schedule):
    """FSDP2 over "dp" reduce-scatters what the replicas all-reduce: with two replicas both add the same
    two partial sums, so losses, gradients, clipping, parameters and the full state dict are bitwise
    those of data_parallel="replicate"."""
    replicated, _ = mesh_runs
    sharded, _ = fsdp_runs
    for rank in range(4):
        ours, theirs = sharded[rank][schedule], replicated[rank][schedule]
        for step in range(STEPS):
            assert torch.equal(ours["losses"][step], theirs["losses"][step]), (rank, step)
            assert ours["grads"][step].keys() == theirs["grads"][step].keys()
            for name, grad in ours["grads"][step].items():
                assert torch.equal(grad, theirs["grads"][step][name]), (rank, step, name)
        assert torch.equal(ours["norm"], theirs["norm"])
        for name, grad in ours["clipped"].items():
            assert torch.equal(grad, theirs["clipped"][name]), (rank, name)
        for name, value in ours["params"].items():
            assert torch.equal(value, theirs["params"][name]), (rank, name)
        assert ours["full"].keys() == theirs["full"].keys()
        assert all(torch.equal(v, theirs["full"][k]) for k, v in ours["full"].items())


def test_an_fsdp_checkpoint_loads_into_one_device(fsdp_runs):
    runs, folder = fsdp_runs
    _checkpoints_load_into_one_device(runs, folder, [s for s, _ in SHARDED])


def test_fsdp_is_refused_where_it_cannot_shard():
    with pytest.raises(PipelineError, match=r"data_parallel='zero'\): choose 'replicate' or 'fsdp'"):
        pipeline(
            build("residual"),
            schedule="gpipe",
            split_points=[],
            microbatches=2,
            loss_fn=F.cross_entropy,
            parallel=Parallelism(data_parallel="zero"),
        )
    with pytest.raises(PipelineError, match="shards over the mesh's \"dp\" dimension"):
        pipeline(
            build("residual"),
            schedule="gpipe",
            split_points=[],
            microbatches=2,
            loss_fn=F.cross_entropy,
            parallel=Parallelism(data_parallel="fsdp"),
        )


def test_a_mesh_needs_named_pp_and_dp_dimensions():
    class FakeMesh:
        mesh_dim_names = ("dp", "tp")

        def get_group(self, name):
            raise AssertionError

    with pytest.raises(PipelineError, match=r"\"pp\" dimension"):
        pipeline(
            build("residual"),
            schedule="gpipe",
            split_points=[],
            microbatches=2,
            loss_fn=F.cross_entropy,
            parallel=Parallelism(mesh=FakeMesh()),
        )
    with pytest.raises(PipelineError, match="DeviceMesh"):
        pipeline(
            build("residual"),
            schedule="gpipe",
            split_points=[],
            microbatches=2,
            loss_fn=F.cross_entropy,
            parallel=Parallelism(mesh=object()),
        )


@pytest.mark.timeout(180)
def test_a_failure_in_one_replica_stops_the_other_replicas_promptly():
    """One failure board spans the mesh: the other replica's ranks (waiting in the "dp" gradient
    reduction or on their pipeline) learn of it within seconds, not at the 60 s timeout, and say why."""
    results = _ok(run_ranks(4, replica_fault, 12.0, timeout=150))
    assert "injected fault" in results[3]["message"]
    for rank in (0, 1, 2):
        report = results[rank]
        assert report["message"] is not None, f"rank {rank} finished although rank 3 failed"
        assert report["seconds"] < 10.0, (rank, report)
        assert "injected fault" in report["message"], (rank, report)


@pytest.mark.timeout(200)
def test_a_plan_with_replicas_runs_on_its_own_mesh(tmp_path):
    """``pipeloom plan`` chose dp 2 x pp 2: ``pipeline(model, plan=...)`` builds that mesh over the 4 ranks
    itself and trains exactly as the same settings on an explicit mesh."""
    from pipeloom.plan import Plan, save_plan

    plan = Plan(num_ranks=2, split_points=tuple(SPLITS["residual"][2]), schedule="zb-h1", microbatches=4,
                global_batch=32, predicted_step_time=1.0, data_parallel=2)
    save_plan(plan, tmp_path / "plan.json")
    results = _ok(run_ranks(4, planned_mesh, str(tmp_path / "plan.json"), str(tmp_path / "trace"), timeout=150))
    assert sorted(r["dp"] for r in results.values()) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # record=: the first replica's pipeline writes the files (each replica's rank r had written rank{r}.json)
    assert sorted(path.name for path in (tmp_path / "trace").iterdir()) == ["rank0.json", "rank1.json"]
    for result in results.values():
        if result["dp"][0] == 0:
            written = json.loads((tmp_path / "trace" / f"rank{result['pp']}.json").read_text())
            assert written == json.loads(json.dumps(result["trace"]))
    for result in results.values():
        assert result["planned"].keys() == result["explicit"].keys() and result["planned"]
        for name, grad in result["planned"].items():
            assert torch.equal(grad, result["explicit"][name]), name


def test_a_pipeline_plan_refuses_another_number_of_ranks(tmp_path):
    """A plan of a 2-rank pipeline (no replicas) launched on 3 ranks, or with no ranks launched, says how many it
    runs on (before, the schedule's stages were compared with the pieces: 'zbv has 6 stages, but the model is cut
    into 4 pieces')."""
    from scale_jobs import planned_refusal

    from pipeloom.plan import Plan, save_plan

    plan = Plan(num_ranks=2, split_points=("layers.2", "layers.4", "layers.6"), schedule="zbv", microbatches=4,
                global_batch=32, predicted_step_time=1.0)
    save_plan(plan, tmp_path / "plan.json")
    with pytest.raises(PipelineError, match=r"the plan runs on 2 ranks \(pp 2\); launch them \(torchrun "
                                            r"--nproc-per-node 2\)"):
        pipeline(build("residual"), plan=tmp_path / "plan.json", loss_fn=F.cross_entropy)
    for rank, said in _ok(run_ranks(3, planned_refusal, str(tmp_path / "plan.json"), timeout=150)).items():
        assert said == "the plan runs on 2 ranks (pp 2) but this job has 3; launch 2 ranks or plan for 3", (rank, said)
    experts = Plan(num_ranks=2, split_points=("layers.4",), schedule="1f1b", microbatches=4, global_batch=32,
                   predicted_step_time=1.0, data_parallel=2, expert_parallel=2)  # in the planner's terms
    save_plan(experts, tmp_path / "ep.json")
    with pytest.raises(PipelineError, match=r"the plan runs on 4 ranks \(dp 2 x pp 2, ep 2 within dp\); launch"):
        pipeline(build("residual"), plan=tmp_path / "ep.json", loss_fn=F.cross_entropy)


def test_a_plan_with_replicas_refuses_a_mesh_of_another_shape(tmp_path):
    from pipeloom.plan import Plan, save_plan

    plan = Plan(num_ranks=2, split_points=("layers.4",), schedule="1f1b", microbatches=4, global_batch=32,
                predicted_step_time=1.0, data_parallel=2)
    save_plan(plan, tmp_path / "plan.json")
    with pytest.raises(PipelineError, match="launch them"):
        pipeline(build("residual"), plan=tmp_path / "plan.json", loss_fn=F.cross_entropy)

    class Mesh:
        mesh_dim_names = ("dp", "pp")

        def size(self, dim=None):
            return (4, 1)[dim]

    with pytest.raises(PipelineError, match=r"mesh is dp 2 x pp 2 but mesh= is dp 4 x pp 1"):
        pipeline(
            build("residual"),
            plan=tmp_path / "plan.json",
            loss_fn=F.cross_entropy,
            parallel=Parallelism(mesh=Mesh()),
        )


def test_token_ids_of_another_length_than_the_plans_are_told_once_per_length(tmp_path, caplog):
    """A cluster plan says its --seq (``sequence_length``): a step whose token ids (a 2-D integer first input) have
    another length runs, and is told once per length that the prediction is for the plan's (a new user's --seq 64
    run of a 128-token plan had gone unsaid); float inputs have no sequence length to compare."""
    from pipeloom.plan import Plan, save_plan
    from pipeloom.runtime.plan_file import PlannedBatch, plan_arguments

    save_plan(Plan(num_ranks=1, split_points=(), schedule="1f1b", microbatches=4, global_batch=8,
                   predicted_step_time=1.0, sequence_length=12), tmp_path / "plan.json")
    planned = plan_arguments(tmp_path / "plan.json", None, None, None, None, parallel=Parallelism(), device=None)[-1]
    assert planned == PlannedBatch(str(tmp_path / "plan.json"), 8, 12)
    with caplog.at_level("WARNING", logger="pipeloom.runtime.plan_file"):
        for shape in ((8, 12), (8, 16), (8, 16), (8, 6)):
            planned.check((torch.zeros(shape, dtype=torch.long),))
        planned.check((torch.zeros(8, 20),))
    told = [record.getMessage() for record in caplog.records]
    assert [said.split(" but ")[0] for said in told] == ["this step's sequences have 16 tokens",
                                                        "this step's sequences have 6 tokens"], told
    assert told[0].endswith("plan.json was planned for 12: the step runs, but the plan's predicted step time and "
                            "memory are for 12 tokens (plan again with --seq 16 for these sequences)"), told[0]


def test_a_plan_made_for_another_model_is_told_at_pipeline(tmp_path, caplog):
    """A cluster plan says the model it was made for; a transformers model whose config (its language model's) has
    other layer or hidden sizes is warned about once, at pipeline() (a plan for a 12-layer config had run a 6-layer
    model's layers until a split point was missing, and one for another width had run without a word)."""
    import types

    from pipeloom.plan import Plan, load_plan, save_plan
    from pipeloom.runtime.plan_file import plan_arguments

    made_for = {"model_type": "llama", "num_hidden_layers": 12, "hidden_size": 256}
    save_plan(Plan(num_ranks=1, split_points=(), schedule="1f1b", microbatches=4, global_batch=8,
                   predicted_step_time=1.0, model=made_for), tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").model == made_for  # read back as written

    def warned(**sizes):
        config = types.SimpleNamespace(get_text_config=lambda: types.SimpleNamespace(**sizes))
        caplog.clear()
        with caplog.at_level("WARNING", logger="pipeloom.runtime.plan_file"):
            plan_arguments(tmp_path / "plan.json", None, None, None, None, parallel=Parallelism(), device=None,
                           model=types.SimpleNamespace(config=config))
        return [record.getMessage() for record in caplog.records]

    assert warned(num_hidden_layers=12, hidden_size=256) == []
    said = warned(num_hidden_layers=6, hidden_size=256)
    assert len(said) == 1 and said[0].startswith(f"{tmp_path / 'plan.json'} was planned for another model than this "
                                                 "one, whose num_hidden_layers 6 (the plan's 12): it runs where")
    assert "hidden_size 128 (the plan's 256)" in warned(num_hidden_layers=12, hidden_size=128)[0]
    # a hand-edited size that is not a count is not compared (formatting it had raised a ValueError)
    save_plan(Plan(num_ranks=1, split_points=(), schedule="1f1b", microbatches=4, global_batch=8,
                   predicted_step_time=1.0, model={**made_for, "hidden_size": "wide"}), tmp_path / "plan.json")
    assert warned(num_hidden_layers=12, hidden_size=128) == []


def test_a_step_on_another_batch_than_the_plans_is_told_once_per_size(tmp_path, caplog):
    """A plan made for 32 samples trains on 16 (the runtime takes any size its micro-batches cut), and says once
    that the plan's predicted time and memory are for 32; evaluation batches are not told."""
    from pipeloom.plan import Plan, save_plan

    save_plan(Plan(num_ranks=1, split_points=(), schedule="1f1b", microbatches=4, global_batch=32,
                   predicted_step_time=1.0), tmp_path / "plan.json")
    engine = pipeline(build("residual"), plan=tmp_path / "plan.json", loss_fn=F.cross_entropy)
    with caplog.at_level("WARNING", logger="pipeloom.runtime.plan_file"):
        for rows in (32, 16, 16, 8):
            inputs, target = batch("residual", rows)
            engine.step(inputs, target=target)
        inputs, target = batch("residual", 4)
        engine.eval_step(inputs, target=target)
    told = [record.getMessage() for record in caplog.records if "was planned for" in record.getMessage()]
    assert [said.split(" but ")[0] for said in told] == ["this step's batch has 16 rows",
                                                        "this step's batch has 8 rows"], told
    assert told[0].endswith("plan.json was planned for a global batch of 32: the step runs, but the plan's predicted "
                            "step time and memory are for 32 rows (plan again with --global-batch 16 for this "
                            "batch)"), told[0]
