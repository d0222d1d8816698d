"""``pipeline()`` without ``example_inputs`` on models only torch.export traces: the model is split at the
first step, traced on its batch. Oracles: the unsplit model's for-loop reference of DESIGN §5 (torch.equal
losses and gradients), and the errors ``pipeline(example_inputs=...)`` raises for the same mistakes."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from first_step_jobs import hf_first_step, optimizer_before_split_checkpoint
from hf_models import build_hf, lm_loss, tokens
from models import assert_bitwise_reports, mismatches
from ranks import run_ranks

from pipeloom.runtime import PipelineEngine, PipelineError, Tracing, UnknownSplitPointError, pipeline


def test_a_model_torch_fx_cannot_trace_is_split_at_its_first_step_bitwise():
    model = build_hf("gpt2")
    reference = copy.deepcopy(model)
    engine = pipeline(model, schedule="zbv", split_points=["transformer.h.2"], loss_fn=lm_loss, microbatches=4)
    assert isinstance(engine, PipelineEngine) and not engine.split
    assert engine.training is True  # it had raised NotSplitYetError before the split
    with pytest.raises(PipelineError, match="load_checkpoint: the model is split at the first step.*example_inputs"):
        engine.load_checkpoint("anywhere")  # it had named engine.names, an attribute the user never used
    assert len(engine.parameters()) == len(list(model.parameters()))  # before the split: the whole model's
    with pytest.raises(PipelineError, match="split at the first step"):
        engine.state_dict()
    # what only the split sets is an AttributeError too (hasattr had raised), with the same words
    assert not hasattr(engine, "module") and getattr(engine, "lowering", None) is None
    with pytest.raises(AttributeError, match="engine.lowering is not known yet"):
        _ = engine.lowering
    x, y = tokens()
    loss = engine.step(x, target=y)
    assert engine.split and engine.staged.num_stages == 2 and len(engine.shared.params) == 1
    expected = torch.zeros(())
    for xm, ym in zip(x.chunk(4), y.chunk(4)):  # DESIGN §5's for-loop reference
        part = lm_loss(reference(xm), ym) / 4
        part.backward()
        expected = expected + part.detach()
    assert torch.equal(loss, expected)
    assert mismatches(model, reference, {id(p) for p in engine.parameters()}) == []
    assert engine.state_dict().keys() == model.state_dict().keys()


def test_the_graphs_errors_come_at_the_first_step_and_the_others_at_pipeline():
    model = build_hf("gpt2")
    with pytest.raises(PipelineError, match="neither a built-in"):  # no graph needed: refused at once
        pipeline(model, schedule="nope", split_points=["transformer.h.2"], loss_fn=lm_loss, microbatches=4)
    with pytest.raises(PipelineError, match="say how many micro-batches"):
        pipeline(model, schedule="zbv", split_points=["transformer.h.2"], loss_fn=lm_loss)
    with pytest.raises(PipelineError, match="cut the model into 1 piece "):  # the pieces are the split points'
        pipeline(model, schedule="1f1b", split_points=["transformer.h.2"], loss_fn=lm_loss, microbatches=4)
    engine = pipeline(
        model,
        schedule="zbv",  # two stages on the one rank: as many as the split point makes pieces
        split_points=["transformer.h.9"],
        loss_fn=lm_loss,
        microbatches=4,
        tracing=Tracing(tracer="export"),
    )
    x, y = tokens()
    with pytest.raises(UnknownSplitPointError, match="transformer.h.9") as first:
        engine.step(x, target=y)
    with pytest.raises(UnknownSplitPointError) as given:
        pipeline(
            model,
            schedule="zbv",
            split_points=["transformer.h.9"],
            loss_fn=lm_loss,
            microbatches=4,
            tracing=Tracing(example_inputs=(x,)),
        )
    assert str(first.value) == str(given.value)
    assert not engine.split  # nothing half-built: a later step fails the same way


def test_eval_and_close_before_the_first_step():
    model = build_hf("gpt2", dropout=0.1)
    reference = copy.deepcopy(model).eval()
    engine = pipeline(model, schedule="1f1b", split_points=[], loss_fn=lm_loss, microbatches=2).eval()
    x, _ = tokens(rows=4)
    out = engine.eval_step(x)
    assert torch.equal(out.logits, torch.cat([reference(xm).logits for xm in x.chunk(2)]))
    assert engine.training is False
    closed = pipeline(model, schedule="1f1b", split_points=[], loss_fn=lm_loss, microbatches=2)
    closed.close()
    with pytest.raises(PipelineError, match="closed"):
        closed.step(x, target=x)


@pytest.mark.timeout(400)
def test_gpt2_and_llama_without_example_inputs_are_bitwise_exact_on_two_ranks():
    cases = [("gpt2", "1f1b", 2), ("llama", "zbv", 4)]
    results = run_ranks(2, hf_first_step, cases, timeout=360)
    for rank, key, outcome in assert_bitwise_reports(results, len(cases)):
        assert outcome["unsplit_before"], (rank, key)
        assert 0 < outcome["owned"] < outcome["total"], (rank, key)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, layout, why", [
    ("llama", "dp=2,tp=1,ep=1,fsdp=1", "data_parallel='fsdp' shards them"),
    ("llama", "dp=1,tp=2,ep=1,fsdp=0", "tensor parallelism (the tp_plan) shards them"),
    ("olmoe", "dp=2,tp=1,ep=2,fsdp=0", "expert parallelism keeps this rank's experts"),
    ("llama", "dp=2,tp=1,ep=1,fsdp=0", None)])
def test_parameters_before_the_split_are_refused_where_the_split_replaces_them(tmp_path, name, layout, why):
    """A saved cluster plan with FSDP, tp or ep, run without example_inputs: the split puts new parameter objects in the
    model's place, so ``engine.parameters()`` before the first step (which an optimizer built then would hold, never
    updating them) is refused, naming why and the fixes; after the step it gives the ones that train. A replicated
    plan keeps the model's own objects: its parameters() answers before the split."""
    from first_step_jobs import planned_first_step

    from pipeloom.plan.cluster import plan_cluster
    from pipeloom.plan.cluster.runtime_plan import runtime_plan
    from pipeloom.plan.plan import save_plan

    result = plan_cluster(build_hf(name).config, "h100", gpus=2, global_batch=8, seq=12,
                          layout=f"{layout},pp=1,vp=1,cp=1,mbs=1,recompute=none,schedule=1f1b")
    save_plan(runtime_plan(result), tmp_path / "plan.json")
    results = run_ranks(2, planned_first_step, name, str(tmp_path / "plan.json"), timeout=240)
    for rank, (status, found) in results.items():
        assert status == "ok", (rank, found)
        assert found["split"] and found["after"] > 0 and found["unchanged"] == 0, (rank, found)
        if why is None:
            assert found["before"] == len(list(build_hf(name).parameters())), (rank, found)
        else:
            assert isinstance(found["before"], str) and why in found["before"], (rank, found)
            assert "build the optimizer after the first step" in found["before"], (rank, found)
            assert "pipeloom.runtime.Tracing(example_inputs=" in found["before"], (rank, found)


def test_named_parameters_before_the_split_are_the_models():
    """Before the split ``named_parameters()`` gives what ``parameters()`` does, under the model's names (parameter
    groups, say, no weight decay on norms, built before the first step); other attributes the split sets name the
    fix as ``pipeline()`` takes it."""
    model = build_hf("llama")
    engine = pipeline(model, schedule="zbv", split_points=["model.layers.2"], loss_fn=lm_loss, microbatches=4)
    assert not engine.split
    named = list(engine.named_parameters())
    assert [name for name, _ in named] == [name for name, _ in model.named_parameters()]
    assert [p for _, p in named] == engine.parameters()
    with pytest.raises(PipelineError, match=r"or pass tracing=pipeloom\.runtime\.Tracing\(example_inputs="):
        engine.clip_grad_norm_(1.0)


def test_a_none_among_the_inputs_is_named_with_the_way_to_pass_optional_ones():
    """``step((ids, None, mask))`` (GPT-2's mask comes after its cache) had said only "got tuple"."""
    engine = pipeline(build_hf("gpt2"), schedule="1f1b", split_points=[], loss_fn=lm_loss, microbatches=2)
    x, y = tokens()
    with pytest.raises(PipelineError, match=r"got tuple whose item 1 is NoneType; for keyword or optional inputs.*"
                                            r"wrap\s+the model"):
        engine.step((x, None, torch.ones_like(x)), target=y)
    engine.step(x, target=y)  # split now: the traced engine's own check says the same
    with pytest.raises(PipelineError, match=r"step\(\)'s inputs must be a tensor .*got tuple whose item 1 is NoneType"):
        engine.step((x, None, torch.ones_like(x)), target=y)


@pytest.mark.timeout(400)
def test_an_optimizer_built_before_the_split_saves_and_resumes(tmp_path):
    """A new user's trial (2026-12-07): an optimizer built before the first step, as docs/runtime.md allows, holds
    every parameter of the model; save_checkpoint had refused it. It saves this rank's share, and another engine
    resumes from it with the uninterrupted run's loss."""
    results = run_ranks(2, optimizer_before_split_checkpoint, str(tmp_path / "ck"), timeout=360)
    for rank, (status, found) in results.items():
        assert status == "ok", found
        assert found["resumed"] == found["third"], (rank, found)
    assert results[1][1]["third"][0] is not None  # the last stage's rank holds the loss
