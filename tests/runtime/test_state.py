"""Training-loop helpers (runtime/state/state_dict.py) against their single-device meaning: named_parameters
against ``model.named_parameters()``, clip_grad_norm_ against ``torch.nn.utils.clip_grad_norm_`` on the
reference model (torch.equal), state dicts against ``model.state_dict()``, and a DCP checkpoint against
training on without one. One rank in this process; two gloo ranks in spawned processes."""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F
from models import SPLITS, batch, build, mismatches, reference_step
from ranks import run_ranks
from state_jobs import (
    MICROBATCHES,
    Tied,
    batch_for,
    checkpoint_cases,
    checkpoint_job,
    clip_cases,
    engine_for,
    full_state_job,
    model_for,
    names_job,
    refused_on_one_rank_job,
    scheduler_job,
    train_scheduled,
    warmup_cosine,
)
from torch import nn

from pipeloom.runtime import LoadResult, PipelineError, pipeline


def _ok(results: dict) -> dict:
    failures = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    assert not failures, failures
    return {rank: value for rank, (_, value) in results.items()}


# ------------------------------------------------------------------------------ one rank


def test_named_parameters_are_the_models_names_and_objects_in_its_order():
    model = build("residual")
    engine = engine_for(model, "zbv", 1)  # two pieces on one rank
    expected = [(name, id(p)) for name, p in model.named_parameters()]
    assert [(name, id(p)) for name, p in engine.named_parameters()] == expected
    assert list(engine.state_dict()) == list(model.state_dict())


def test_a_tied_parameter_has_the_models_name_and_every_state_dict_key():
    model = model_for("tied")
    engine = engine_for(model, "zbv", 1)  # the embedding in piece 0, the head in piece 1
    names = [name for name, _ in engine.named_parameters()]
    assert names == [name for name, _ in model.named_parameters()] and "head.weight" not in names
    state = engine.state_dict()
    assert list(state) == list(model.state_dict()) and "head.weight" in state
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr() == model.head.weight.data_ptr()


def test_manual_mode_names_are_stages_k_name():
    torch.manual_seed(0)
    first, second = nn.Linear(16, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 3))
    engine = pipeline(schedule="zbv", stages=[first, second], loss_fn=F.cross_entropy, microbatches=4)
    assert [name for name, _ in engine.named_parameters()] == [
        "stages.0.weight", "stages.0.bias", "stages.1.1.weight", "stages.1.1.bias"]
    assert next(engine.named_parameters())[1] is first.weight


@pytest.mark.parametrize(("norm_type", "foreach"), [(2.0, None), ("inf", None), (1.0, None), (2.0, False)])
def test_clip_on_one_rank_equals_torch_with_a_frozen_parameter(norm_type, foreach):
    model = build("residual")
    model.layers[0].weight.requires_grad_(False)  # held, without a gradient
    reference = copy.deepcopy(model)
    engine = engine_for(model, "zbv", 1)
    (x,), y = batch("residual")
    engine.step(x, target=y)
    reference_step(reference, (x,), y, MICROBATCHES)
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    max_norm = float(torch.nn.utils.get_total_norm(grads, norm_type)) / 2
    ours = engine.clip_grad_norm_(max_norm, norm_type=norm_type, foreach=foreach)
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type,
                                            foreach=foreach)
    assert torch.equal(ours, theirs) and theirs > max_norm  # it scaled
    assert mismatches(model, reference, {id(p) for p in model.parameters()}) == []


def test_clip_without_gradients_and_a_non_finite_norm_behave_as_torch():
    model = build("residual")
    engine = engine_for(model, "1f1b", 1)
    assert torch.equal(engine.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    (x,), y = batch("residual")
    engine.step(x, target=y)
    model.head.weight.grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        engine.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert torch.isinf(engine.clip_grad_norm_(1.0))


def test_load_state_dict_checks_before_copying_and_loads_a_single_device_state_dict():
    model = build("residual")
    engine = engine_for(model, "zbv", 1)
    other = build("residual", seed=5).state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    partial = {k: v for k, v in other.items() if k != "head.bias"}
    with pytest.raises(PipelineError, match=r"missing keys \['head.bias'\]"):
        engine.load_state_dict(partial)
    with pytest.raises(PipelineError, match=r"unexpected keys \['extra'\]"):
        engine.load_state_dict(dict(other, extra=torch.zeros(1)))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing copied
    assert engine.load_state_dict(partial, strict=False) == LoadResult(["head.bias"], [])
    assert torch.equal(model.head.bias, before["head.bias"])
    assert torch.equal(model.head.weight, other["head.weight"])
    assert engine.load_state_dict(other) == LoadResult([], [])
    assert all(torch.equal(other[k], v) for k, v in model.state_dict().items())
    with pytest.raises(PipelineError, match="shape"):
        engine.load_state_dict(dict(other, **{"head.bias": torch.zeros(4)}))


def test_a_tied_weight_loads_from_either_of_its_keys():
    """Hugging Face's save_pretrained leaves out a tied head's key (lm_head.weight): such a state dict had been
    refused as missing it, in Weights(state_dict=) too, whose refusal said to pass strict=False, which Weights
    does not take (a new user's trial, 2026-12-07)."""
    model = model_for("tied")
    engine = engine_for(model, "1f1b", 1)
    other = model_for("tied", seed=5).state_dict()
    for left_out in ("head.weight", "embed.weight"):
        assert engine.load_state_dict({k: v for k, v in other.items() if k != left_out}) == LoadResult([], [])
        assert torch.equal(model.embed.weight, other["embed.weight"]) and model.head.weight is model.embed.weight
    with pytest.raises(PipelineError, match=r"missing keys \['embed.weight', 'head.weight'\]"):
        engine.load_state_dict({k: v for k, v in other.items() if k not in ("head.weight", "embed.weight")})


def test_full_state_dict_on_one_rank_is_the_model_state_dict():
    model = model_for("tied")
    engine = engine_for(model, "zbv", 1)
    full = engine.full_state_dict()
    expected = model.state_dict()
    assert list(full) == list(expected) and all(torch.equal(full[k], v) for k, v in expected.items())
    assert full["embed.weight"].data_ptr() != model.embed.weight.data_ptr()  # a copy, not the live tensor


def test_dcp_round_trip_on_one_rank_resumes_bitwise(tmp_path):
    report = checkpoint_job(0, 1, str(tmp_path), "residual", "zbv")
    assert report["different_before"], "the fresh engine must start from other weights"
    assert report["params_equal"] and report["state_equal"] and report["losses_equal"], report
    assert report["groups_equal"] == [True]  # lr and weight decay came from the checkpoint


def test_saving_an_optimizer_that_never_stepped_is_refused_and_leaves_it_as_it_was(tmp_path):
    model = build("residual")
    engine = engine_for(model, "1f1b", 1)
    adam = torch.optim.AdamW(engine.parameters())
    with pytest.raises(PipelineError, match="has not stepped"):
        engine.save_checkpoint(tmp_path / "adam", optimizer=adam)
    assert not adam.state
    sgd = torch.optim.SGD(engine.parameters(), lr=0.1)  # stateless: its param groups are all there is
    engine.save_checkpoint(tmp_path / "sgd", optimizer=sgd)
    fresh = torch.optim.SGD(engine.parameters(), lr=0.7)
    engine.load_checkpoint(tmp_path / "sgd", optimizer=fresh)
    assert fresh.param_groups[0]["lr"] == 0.1


def _chain(width: int = 16, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)), nn.Linear(width, 3))


def _chain_engine(model: nn.Module, **options):
    return pipeline(model, schedule="1f1b", split_points=[], microbatches=2, loss_fn=F.cross_entropy, **options)


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_in_one_line(tmp_path):
    """Each had raised torch's CheckpointException (a BaseException, every rank's traceback), a raw OS error, or
    (keys the model lacks) loaded silently."""
    from pipeloom.runtime import Weights

    engine = _chain_engine(_chain())
    adam = torch.optim.AdamW(engine.parameters())
    x, y = torch.randn(4, 16), torch.randint(0, 3, (4,))
    engine.step(x, target=y)
    adam.step()
    engine.save_checkpoint(tmp_path / "ck", optimizer=adam)
    torch.save(_chain().state_dict(), tmp_path / "plain.pt")
    cases = [
        (_chain(width=24), {}, r"not a checkpoint of this model: it has other shapes: \[0.weight \(16, 16\) saved, "
                               r"\(24, 24\) here"),
        (_chain(depth=5), {}, r"not a checkpoint of this model: it lacks \[5.weight, 5.bias\]"),
        (_chain(depth=3), {}, r"not a checkpoint of this model: it holds keys the model does not have: "
                              r"\[4.weight, 4.bias\]"),
    ]
    for model, kwargs, message in cases:
        with pytest.raises(PipelineError, match=message):
            _chain_engine(model).load_checkpoint(tmp_path / "ck", **kwargs)
    other = _chain_engine(_chain())
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(PipelineError, match=r"holds optimizer state \[.*exp_avg.*\], and this optimizer needs "
                                            r"\[.*momentum_buffer.*\]"):
        other.load_checkpoint(tmp_path / "ck", optimizer=sgd)
    for path, state in ((tmp_path / "nope", "does not exist"), (tmp_path / "plain.pt", "is a file")):
        with pytest.raises(PipelineError, match=f"{state}, not a checkpoint folder"):
            other.load_checkpoint(path)
    with pytest.raises(PipelineError, match="is a file; a checkpoint is a folder"):
        other.save_checkpoint(tmp_path / "plain.pt")
    with torch.device("meta"):
        smaller = _chain(depth=3)
    with pytest.raises(PipelineError, match="holds keys the model does not have"):  # strict, as the docs say
        _chain_engine(smaller, weights=Weights(state_dict=str(tmp_path / "ck")))
    same = _chain_engine(_chain())
    same.load_checkpoint(tmp_path / "ck", optimizer=torch.optim.AdamW(same.parameters()))  # the same model loads


def test_an_optimizer_grouped_otherwise_than_saved_is_refused(tmp_path):
    """Two AdamW groups (weight decay 0.1 on the weights, 0 on the biases) saved, one group loaded: every parameter
    had silently got weight decay 0.1."""
    engine = _chain_engine(_chain())
    params = dict(engine.named_parameters())

    def grouped(by_kind: bool) -> torch.optim.Optimizer:
        if not by_kind:
            return torch.optim.AdamW(list(params.values()), weight_decay=0.1)
        weights = [p for n, p in params.items() if n.endswith("weight")]
        biases = [p for n, p in params.items() if n.endswith("bias")]
        return torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}])

    adam = grouped(True)
    engine.step(torch.randn(4, 16), target=torch.randint(0, 3, (4,)))
    adam.step()
    engine.save_checkpoint(tmp_path / "ck", optimizer=adam)
    with pytest.raises(PipelineError, match=r"saved weight_decay 0.1 \(0.weight\), 0.0 \(0.bias\) for parameters "
                                            r"this optimizer holds in one group \(param_groups\[0\]\)"):
        engine.load_checkpoint(tmp_path / "ck", optimizer=grouped(False))
    again = grouped(True)
    engine.load_checkpoint(tmp_path / "ck", optimizer=again)  # grouped as saved: loads
    assert [g["weight_decay"] for g in again.param_groups] == [0.1, 0.0]


# ------------------------------------------------------------------------------ two ranks


@pytest.mark.timeout(240)
def test_a_checkpoint_one_rank_refuses_is_refused_on_every_rank(tmp_path):
    """Only rank 1's stage differs (its head's shape; then its parameters' grouping): rank 1 had raised alone and
    rank 0 waited in the collective load until the process group's timeout."""
    results = run_ranks(2, refused_on_one_rank_job, str(tmp_path), timeout=180)
    found = _ok(results)
    for case, words in (("shape", "has other shapes: [4.weight (3, 16) saved, (5, 16) here"),
                        ("groups", "saved weight_decay 0.01 (2.weight), 0.0 (4.weight)")):
        mine, seconds = found[1][case]
        assert words in mine and seconds < 20, (case, mine)
        theirs, seconds = found[0][case]
        assert theirs == f"rank 1 of the checkpoint's group: {mine}" and seconds < 20, (case, theirs)

CLIP_CASES = [(model, schedule, norm)
              for model, schedule in [("residual", "1f1b"), ("residual", "zbv"), ("residual", "dualpipe"),
                                      ("tied", "1f1b"), ("tied", "zbv")]
              for norm in (2.0, "inf")]


@pytest.mark.timeout(240)
def test_clip_on_two_ranks_equals_torch_on_one_device():
    """Each parameter counted once: dualpipe holds every one on both ranks, the tied weight sits on
    both ranks under 1f1b and in two pieces of rank 0 under zbv."""
    reports = _ok(run_ranks(2, clip_cases, CLIP_CASES, timeout=200))
    for rank, report in reports.items():
        assert len(report) == len(CLIP_CASES)
        for key, outcome in report.items():
            assert outcome["total_equal"] and outcome["scaled"], (rank, key, outcome)
            assert outcome["mismatches"] == [] and outcome["owned"] > 0, (rank, key, outcome)


@pytest.mark.timeout(180)
def test_names_and_state_dict_keys_on_two_ranks():
    reports = _ok(run_ranks(2, names_job, timeout=150))
    residual = [name for name, _ in build("residual").named_parameters()]
    first, second = reports[0]["residual"], reports[1]["residual"]
    assert first["names"] + second["names"] == residual  # split at layers.4: disjoint, in model order
    assert first["state_keys"] == first["names"] and second["state_keys"] == second["names"]
    assert first["loaded"] == second["loaded"] == {"result": ([], []), "equal": True}
    tied = Tied()
    for rank, layers in ((0, (0, 1)), (1, (2, 3))):
        expected = ["embed.weight"] + [f"layers.{i}.{kind}" for i in layers for kind in ("weight", "bias")]
        found = reports[rank]["tied"]
        assert found["names"] == expected and found["same_objects"], (rank, found)
        keys = [k for k in tied.state_dict() if k in found["state_keys"]]
        assert found["state_keys"] == keys and "head.weight" in keys, (rank, found)


@pytest.mark.timeout(180)
def test_full_state_dict_after_training_equals_the_reference_state_dict():
    cases = [("residual", "1f1b"), ("residual", "dualpipe"), ("tied", "1f1b"), ("tied", "zbv")]
    reports = _ok(run_ranks(2, full_state_job, cases, timeout=150))
    for key, outcome in reports[0].items():
        assert outcome["keys"] == outcome["expected_keys"] and outcome["values_equal"], (key, outcome)
    assert all(outcome["empty"] for outcome in reports[1].values())


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    cases = [("residual", "zbv"), ("tied", "1f1b")]
    return folder, _ok(run_ranks(2, checkpoint_cases, str(folder), cases, timeout=240))


@pytest.mark.timeout(300)
def test_dcp_round_trip_on_two_ranks_resumes_bitwise(two_rank_checkpoints):
    _, reports = two_rank_checkpoints
    for rank, report in reports.items():
        for key, outcome in report.items():
            assert outcome["different_before"], (rank, key)
            assert outcome["params_equal"] and outcome["state_equal"], (rank, key, outcome)
            assert outcome["losses_equal"], (rank, key, outcome)
            assert outcome["groups_equal"] == [True], (rank, key, outcome)
    first, second = reports[0]["residual/zbv"], reports[1]["residual/zbv"]
    assert first["full_keys"] == list(build("residual").state_dict())
    assert second["full_keys"] == [] and first["full_on_last_keys"] == []  # full_state_dict(rank=1)
    assert second["full_on_last_keys"] == first["full_keys"]


@pytest.mark.timeout(300)
def test_a_two_rank_checkpoint_resumes_bitwise_on_one_rank(two_rank_checkpoints):
    folder, _ = two_rank_checkpoints
    case = folder / "residual-zbv"
    expected = torch.load(case / "expected.pt")
    model = build("residual", seed=9)
    engine = pipeline(model, schedule="1f1b", split_points=SPLITS["residual"][1], loss_fn=F.cross_entropy,
                      microbatches=MICROBATCHES)
    optimizer = torch.optim.AdamW(engine.parameters())
    engine.load_checkpoint(case / "dcp", optimizer=optimizer)
    state = engine.state_dict()
    assert list(state) == list(expected["full"])
    assert all(torch.equal(value, state[key]) for key, value in expected["full"].items())
    for step, loss in zip(range(2, 4), expected["losses"]):
        x, y = batch_for("residual", step)
        assert torch.equal(engine.step(x, target=y), loss), step
        engine.clip_grad_norm_(0.5)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_scheduler_and_the_seed_resume_bitwise_on_two_ranks(tmp_path, schedule):
    reports = _ok(run_ranks(2, scheduler_job, str(tmp_path), schedule, timeout=240))
    for rank, report in reports.items():
        assert report["seed"] == 7, (rank, report)
        assert report["with"]["seed"] == (99, 7), (rank, report)  # the checkpoint's seed replaced the engine's
        assert report["with"]["rates_equal"] and report["with"]["losses_equal"] == [True] * 3, (rank, report)
        # forgetting the scheduler restarts its warm-up: other learning rates, other losses from the 2nd step
        assert not report["without"]["rates_equal"] and not all(report["without"]["losses_equal"]), (rank, report)
    if schedule == "1f1b":  # the same 2 pieces on one rank (zbv): another layout resumes bitwise too
        engine = engine_for(model_for("dropped", seed=123), "zbv", 1, seed=99)
        optimizer = torch.optim.AdamW(engine.parameters(), lr=0.5)
        scheduler = warmup_cosine(optimizer)
        engine.load_checkpoint(tmp_path / "dcp", optimizer=optimizer, extra={"scheduler": scheduler})
        losses, rates = train_scheduled(engine, optimizer, scheduler, range(2, 5))
        assert engine.seed == 7 and rates == reports[0]["rates"]
        assert [float(loss) for loss in losses] == reports[0]["losses"]


def test_resuming_with_the_engines_own_seed_draws_other_dropout_masks(tmp_path):
    """Why the seed is saved: the same checkpoint resumed with the step count but the fresh engine's seed
    (set back by hand) gives other losses; with the restored seed, the uninterrupted run's."""
    report = scheduler_job(0, 1, str(tmp_path / "run"), "1f1b")
    assert report["with"]["losses_equal"] == [True] * 3
    fresh = engine_for(model_for("dropped", seed=123), "1f1b", 1, seed=99)
    optimizer = torch.optim.AdamW(fresh.parameters())
    scheduler = warmup_cosine(optimizer)
    fresh.load_checkpoint(tmp_path / "run" / "dcp", optimizer=optimizer, extra={"scheduler": scheduler})
    x, y = batch_for("dropped", 2)
    restored = fresh.step(x, target=y)
    other = engine_for(model_for("dropped", seed=123), "1f1b", 1, seed=99)
    with pytest.warns(UserWarning, match=r"holds an optimizer's state \(pass optimizer=\) and extra \['scheduler'\]"):
        other.load_checkpoint(tmp_path / "run" / "dcp")  # the model alone: said, since a resume would want all
    other.seed = 99
    other.pieces = dataclasses.replace(other.pieces, seed=99)
    assert not torch.equal(other.step(x, target=y), restored)


def test_extra_objects_are_checked_and_names_the_checkpoint_lacks_are_refused(tmp_path):
    engine = engine_for(model_for("dropped"), "1f1b", 1)
    sgd = torch.optim.SGD(engine.parameters(), lr=0.1)
    with pytest.raises(PipelineError, match="has no state_dict"):
        engine.save_checkpoint(tmp_path / "a", extra={"steps": 3})
    with pytest.raises(PipelineError, match="without dots"):
        engine.save_checkpoint(tmp_path / "a", extra={"lr.scheduler": warmup_cosine(sgd)})
    engine.save_checkpoint(tmp_path / "a")
    with pytest.raises(PipelineError, match=r"holds no state for extra \['scheduler'\]"):
        engine.load_checkpoint(tmp_path / "a", extra={"scheduler": warmup_cosine(sgd)})


@pytest.mark.timeout(180)
def test_a_sharded_gradients_norm_is_the_whole_gradients():
    """An FSDP-sharded gradient's norm is torch's of the whole gradient, bitwise: the norm of the shards' norms, as
    the clip had computed it, differs from it in the last bits for most sizes (a new user's tiny LLaMA clipped to
    2.0099029541 under FSDP against 2.0099031925 under "replicate" and on one device). One sharded over another mesh
    (ep's experts, tp's shards) keeps the norm of its shards' norms: an expert gradient is too large to gather."""
    from state_jobs import sharded_norm_job

    sizes = [1000 + 37 * k for k in range(16)]
    for rank, found in _ok(run_ranks(2, sharded_norm_job, sizes, timeout=150)).items():
        assert all(case["equal"] and case["elsewhere_from_shards"] for case in found), (rank, found)
        assert any(case["shards_differ"] for case in found), "no size tells the shards' norms apart: a weak test"
