"""Unchanged ``transformers`` models (tiny random-init configs, no downloads) cut at module names with
torch.export and trained on 2 and 4 gloo ranks. Oracles: the unsplit model's for-loop reference of
docs/design.md §5 (torch.equal losses and gradients, tied weights included), and for dropout the single-process
reference with the runtime's random numbers, ``pipeloom.runtime.reference_step``."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_jobs import hf_dropout, hf_exactness, hf_plan
from models import assert_bitwise_reports
from ranks import run_ranks

CASES = [(name, schedule, 2 if schedule == "1f1b" else 4) for name in ("gpt2", "llama", "bert", "qwen2")
         for schedule in ("1f1b", "zbv")]


@pytest.mark.timeout(400)
def test_transformers_models_are_bitwise_exact_on_two_ranks():
    results = run_ranks(2, hf_exactness, CASES, timeout=360)
    for rank, key, outcome in assert_bitwise_reports(results, len(CASES)):
        assert outcome["owned"] > 0, (rank, key)
    # the tied head and embedding: held by both ranks under 1f1b, identical after the optimizer steps

    for key in ("gpt2/1f1b", "bert/1f1b", "qwen2/1f1b"):
        first, second = results[0][1][key]["shared"], results[1][1][key]["shared"]
        assert first and first.keys() == second.keys(), key
        assert all(first[name] == second[name] for name in first), key
    assert results[0][1]["llama/1f1b"]["shared"] == {}  # LLaMA does not tie its head


@pytest.mark.timeout(400)
def test_the_cluster_planners_other_families_are_bitwise_exact_on_two_ranks():
    """Granite, Phi-3, OLMo 2 and 3 (its sliding windows), Gemma 1-3 (Gemma 2's soft-capped scores and logits, Gemma 3's
    per-head q/k norms), SmolLM3 (layers without rotary embedding), StarCoder2,
    Cohere (its parallel branches under one norm, per-head q/k norms) and Cohere 2 (rotary on its sliding-window
    layers only), ERNIE 4.5 MoE (biased projections, shared experts, a biased head; its dense first layer is the
    dense ERNIE 4.5's), GLM-4 (four norms, interleaved rotary on half the dimensions), Falcon (its layers under
    transformer.h, a fused q/k/v projection), MiniMax-M2 (a sigmoid router with a correction bias buffer), OLMoE,
    GLM-4.5 (its MoE layers and dense first layer), Granite MoE (a shared MLP beside the experts, Granite's
    multipliers), Mistral 4 (MLA, a group-limited softmax router, queries scaled by their positions), Llama 4
    (chunked attention on its rotary layers, NoPE layers, a sigmoid router, every expert run on every token),
    DeepSeek-V3.2 and GLM-5 (DeepSeek's sparse attention: an indexer under no_grad whose top-k masks the scores, its
    count made once and read by every later layer; GLM-5's shared layers reusing the top-k of the layer before, across
    the cut), Qwen3-Next, Qwen3.5-MoE, Qwen3.5 and OLMo hybrid (Gated DeltaNet layers, exported through their eager
    branch, cut between them and attention layers, gated in Qwen's, OLMo 3's in OLMo's): of the
    families ``pipeloom plan --model`` reads and saves plans for, those the other cases do not cover, cut at
    ``model.layers.N`` as its plan files cut them."""
    from hf_models import PLANNED

    cases = [(name, schedule, 2 if schedule == "1f1b" else 4) for name in PLANNED for schedule in ("1f1b", "zbv")]
    for rank, key, outcome in assert_bitwise_reports(run_ranks(2, hf_exactness, cases, timeout=360), len(cases)):
        assert outcome["owned"] > 0, (rank, key)


ENCODER_DECODER = [(name, schedule, 2 if schedule == "1f1b" else 4) for name in ("bart", "t5", "whisper")
                   for schedule in ("1f1b", "zbv")]


@pytest.mark.timeout(600)
def test_encoder_decoder_models_are_bitwise_exact_on_two_ranks():
    """BART, T5 and Whisper (hf_models.hf_splits): under 1f1b piece 0 holds the encoder and half the decoder,
    so BART's and T5's shared embedding is used twice there (encoder and decoder) and once by piece 1 (the
    head); under zbv the encoder's output feeds decoder layers of pieces 1, 2 (both on rank 1) and 3 (rank 0).
    Before the runtime added every use in one device's order, gradients differed by up to 2e-8 (docs/runtime.md)."""
    results = run_ranks(2, hf_exactness, ENCODER_DECODER, timeout=540)
    for rank, key, outcome in assert_bitwise_reports(results, len(ENCODER_DECODER)):
        assert outcome["owned"] > 0, (rank, key)
    for key in ("bart/1f1b", "t5/1f1b"):  # piece 0 gives its two uses of the embedding apart
        assert list(results[0][1][key]["uses"].values()) == [(2, 1)], key
        first, second = results[0][1][key]["shared"], results[1][1][key]["shared"]
        assert first and first.keys() == second.keys() and all(first[n] == second[n] for n in first), key


def _assert_seeded_reference(results: dict) -> None:
    """Every rank's :func:`hf_jobs.hf_dropout` report: gradients and losses equal the seeded reference's bitwise,
    and the draws changed the loss (eval mode, which draws nothing, gives another)."""
    failures = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    assert not failures, failures
    for rank, (_, report) in results.items():
        for schedule, outcome in report.items():
            assert outcome["mismatches"] == [], (rank, schedule, outcome["mismatches"])
            assert all(ours == theirs for ours, theirs in outcome["losses"]), (rank, schedule, outcome["losses"])
            assert outcome["losses"][0][0] != pytest.approx(outcome["no_dropout_loss"], rel=1e-6)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world, schedules", [(1, ["interleaved-1f1b"]), (2, ["zbv", "interleaved-1f1b"]),
                                              (4, ["1f1b"])], ids=["1rank", "2ranks", "4ranks"])
def test_dropout_is_the_same_on_any_number_of_ranks(world, schedules):
    if world == 1:
        results = {0: ("ok", hf_dropout(0, 1, schedules))}
    else:
        results = run_ranks(world, hf_dropout, schedules, timeout=360)
    _assert_seeded_reference(results)


@pytest.mark.timeout(400)
def test_random_routing_is_the_same_on_any_number_of_ranks():
    """Phi-3.5-MoE (``pipeloom plan --model`` reads it): its sparsemixer samples each token's two experts and its
    input jitter multiplies by noise in training; on two ranks under zbv and interleaved 1f1b (four pieces), its
    losses and gradients equal the seeded single-process reference's bitwise, as dropout's do."""
    _assert_seeded_reference(run_ranks(2, hf_dropout, ["zbv", "interleaved-1f1b"], 2, "phimoe", timeout=360))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule, vp", [("dualpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 3), ("v-half", 2)])
def test_a_cluster_plan_runs_bitwise(tmp_path, schedule, vp):
    """``pipeloom plan --model ... --save`` for the tiny LLaMA on 2 GPUs (dualpipe: two copies of the model, a
    pair of micro-batches per schedule micro-batch; 1f1b; interleaved 1f1b over 2 x 3 stages for the 4 layers, the
    first holding only the embedding and the last only the final norm and head; V-Half, searched only when named)
    runs through
    ``pipeline(model, plan=...)`` on 2 ranks bitwise equal to the unsplit model."""
    from hf_models import LAYERS, VOCAB

    from pipeloom.plan.cluster import plan_cluster
    from pipeloom.plan.cluster.runtime_plan import runtime_plan
    from pipeloom.plan.plan import save_plan

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB}
    result = plan_cluster(config, "h100", gpus=2, global_batch=8, seq=12,
                          layout=f"dp=1,tp=1,pp=2,vp={vp},cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule={schedule}")
    plan = runtime_plan(result)
    if vp == 3:
        assert result.best.stage_layers == (0, 1, 1, 1, 1, 0)
        assert plan.split_points == (*(f"model.layers.{k}" for k in range(LAYERS)), "model.norm")
    save_plan(plan, tmp_path / "plan.json")
    found = assert_bitwise_reports(run_ranks(2, hf_plan, str(tmp_path / "plan.json"), timeout=360), cases=1)
    assert all(outcome["microbatches"] == (4 if schedule == "dualpipe" else 8) for _, _, outcome in found)
