"""The cut of the decoder layers into pipeline stages (:func:`balanced_counts`): never busier than the even cut,
optimal for one kind of layer or one stage per rank (against every cut of small cases), layers taken off the
ranks holding the head or the embedding; the estimate prices the cut it reports, and ``stage_cut="even"`` keeps
the even one; DualPipe's two copies."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from pipeloom.plan.cluster import plan_cluster
from pipeloom.plan.cluster.api import parse_layout
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import Layout, enumerate_layouts
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.cluster.placement import balanced_counts, even_counts
from pipeloom.plan.errors import LayoutError

_SPEC = importlib.util.spec_from_file_location(
    "stage_cut", Path(__file__).resolve().parents[3] / "benchmarks" / "stage_cut.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)
_ranks, _loads = bench.placement_ranks, bench.rank_loads
LINEAR, LOOPED, V = bench.PLACEMENTS


def test_equal_layers_without_extras_keep_the_even_cut():
    kinds = ["d"] * 16
    assert balanced_counts(kinds, _ranks(LINEAR, 4), {"d": 1.0}, first=0.0, last=0.0) == (4, 4, 4, 4)
    counts = balanced_counts(kinds, _ranks(V, 4), {"d": 1.0}, first=0.0, last=0.0)
    assert max(_loads(kinds, counts, _ranks(V, 4), {"d": 1.0}, 0.0, 0.0)) == 4.0


def test_a_heavy_head_takes_layers_off_its_rank():
    """16 layers of work 1 and a head of work 2 on 4 ranks: the even cut's last rank does 6, the balanced cut's
    busiest rank 5 (18 / 4 rounded up to whole layers), the head's stage holding 3 layers."""
    kinds, work, ranks = ["d"] * 16, {"d": 1.0}, _ranks(LINEAR, 4)
    assert max(_loads(kinds, even_counts(16, 4), ranks, work, 0.0, 2.0)) == 6.0
    counts = balanced_counts(kinds, ranks, work, first=0.0, last=2.0)
    assert max(_loads(kinds, counts, ranks, work, 0.0, 2.0)) == 5.0 and counts[-1] == 3
    assert counts[0] <= counts[1]  # the layer freed goes to a later rank, which holds fewer micro-batches


def test_looped_ranks_are_balanced_not_their_stages():
    """10 layers over 2 ranks x 2 looped stages: filling stages greedily (3, 3, 3, 1) gives a rank 6 layers;
    the balanced cut gives each rank 5."""
    kinds, ranks = ["d"] * 10, _ranks(LOOPED, 2)
    counts = balanced_counts(kinds, ranks, {"d": 1.0}, first=0.0, last=0.0)
    assert _loads(kinds, counts, ranks, {"d": 1.0}, 0.0, 0.0) == [5.0, 5.0]


@pytest.mark.parametrize("placement", [LINEAR, LOOPED, V])
def test_one_kind_is_optimal_and_no_cut_is_busier_than_even(placement):
    """Against every cut of small random cases (``benchmarks/stage_cut.py``): one kind of layer with any
    embedding and head gets the least busy busiest rank there is, and so do dense-then-MoE layers on one stage
    per rank; on looped or V stages those are never busier than the even cut, and the optimum in most cases
    (the rest is a local search's)."""
    rng = random.Random(7)
    optimal = trials = 0
    for mixed in (False, True) * 20:
        case = bench.random_case(rng, placement, mixed)
        counts = balanced_counts(case[0], case[1], case[2], first=case[3], last=case[4])
        assert len(counts) == sum(map(len, case[1])) and sum(counts) == len(case[0]) and min(counts) >= 1
        balanced, even, best = bench.check(*case)
        assert balanced <= even + 1e-12
        if len(set(case[0])) == 1 or placement == LINEAR:
            assert balanced == pytest.approx(best)
        else:
            trials += 1
            optimal += balanced <= best + 1e-9
    assert placement == LINEAR or (trials == 20 and optimal >= 0.75 * trials)


@pytest.mark.parametrize("placement", [LOOPED, V])
def test_a_ranks_layers_go_where_its_busiest_stage_is_least_busy(placement):
    """The ranks' loads leave open how a rank's layers spread over its stages; with one kind of layer the balanced
    cut's busiest stage is the least busy of every cut with its ranks' loads (small random cases), and DeepSeek-V3's
    shape (3 dense layers, 58 MoE ones, a head and MTP module of 2.7 MoE layers' work) on 2 ranks x 8 looped stages
    gets Megatron-Bridge's hand cut ``Et*4|(t*4|)*14tmL``, not three stages of 3 layers on the head's rank."""
    rng = random.Random(11)
    for _ in range(12):
        assert bench.checks(*bench.random_case(rng, placement, False))[3]
    if placement == LOOPED:
        kinds = ["dense"] * 3 + ["moe"] * 58
        counts = balanced_counts(kinds, _ranks(LOOPED, 2, 8), {"dense": 7.0, "moe": 10.6}, first=0.1, last=28.7)
        assert counts == (4,) * 15 + (1,)


LLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 128256}
FIXED = "dp=1,tp=1,pp=4,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"


def test_the_estimate_prices_the_cut_it_reports():
    """A 128K-vocabulary head on the last of 4 stages: the balanced cut gives that stage fewer layers and a
    shorter step than the even cut, whose 4 x 4 ``stage_cut="even"`` keeps."""
    args = dict(gpus=4, global_batch=16, seq=2048, layout=FIXED)
    even = plan_cluster(LLAMA, "h100", stage_cut="even", **args).best
    balanced = plan_cluster(LLAMA, "h100", **args).best
    assert even.stage_layers == (4, 4, 4, 4)
    assert sum(balanced.stage_layers) == 16 and balanced.stage_layers[-1] < 4
    assert balanced.step_time < even.step_time


def test_the_embedding_and_the_head_may_take_a_stage_each():
    """More stages than layers (at most two more): one layer per middle stage, the first and last stages holding
    only the embedding and the head (Llama 3 405B's 126 layers in 16 x 8 stages); the estimate prices those stages,
    the layout check and the search allow them and refuse a stage more."""
    assert even_counts(4, 6) == (0, 1, 1, 1, 1, 0)
    assert even_counts(4, 5) == (1, 1, 1, 1, 0)
    kinds = ["d"] * 4
    assert balanced_counts(kinds, _ranks(LOOPED, 2, 3), {"d": 1.0}, first=0.5, last=2.0) == (0, 1, 1, 1, 1, 0)
    tiny = dict(LLAMA, num_hidden_layers=4)
    layout = "dp=1,tp=1,pp=2,vp=3,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=interleaved-1f1b"
    best = plan_cluster(tiny, "h100", gpus=2, global_batch=8, seq=2048, layout=layout).best
    assert best.stage_layers == (0, 1, 1, 1, 1, 0)
    job = Job(spec=model_spec(tiny), hw=hardware("h100"), gpus=2, global_batch=8, seq=2048)
    first, *middle, last = Estimator(job).stages(best.layout)[0]
    assert first.f < min(t.f for t in middle) and last.f > first.f  # the embedding alone; the 128K-vocabulary head
    assert {c.vp for c in enumerate_layouts(job, {"pp": 2, "schedule": "interleaved-1f1b"})} == {2, 3}
    with pytest.raises(LayoutError, match="8 stages for 4 layers.*one each for the embedding and the head.*<= 6"):
        plan_cluster(tiny, "h100", gpus=2, global_batch=8, seq=2048, layout=layout.replace("vp=3", "vp=4"))


DSV3_SHAPE = {"model_type": "deepseek_v3", "hidden_size": 1024, "intermediate_size": 2048,
              "moe_intermediate_size": 256, "num_hidden_layers": 13, "first_k_dense_replace": 1,
              "num_attention_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
              "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 16, "num_experts_per_tok": 2,
              "n_shared_experts": 1, "num_nextn_predict_layers": 1, "vocab_size": 32000}


def test_an_explicit_cut_is_priced_as_written_and_fixes_the_stage_count():
    """``stage_cut`` in Megatron-Core's pipeline-layout syntax: the estimate prices those layers per stage (the
    embedding alone on the first, the MTP module with the loss on the last), the search tries only layouts of that
    many stages, and a layout of another count is refused naming the fix."""
    cut = "E|(t*3|)*4tmL"  # 13 layers: none beside the embedding, 3 in each of 4 stages, 1 with the MTP and loss
    layout = "dp=1,tp=1,pp=2,vp=3,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=interleaved-1f1b"
    args = dict(gpus=2, global_batch=8, seq=1024)
    best = plan_cluster(DSV3_SHAPE, "h100", layout=layout, stage_cut=cut, **args).best
    assert best.stage_layers == (0, 3, 3, 3, 3, 1)
    balanced = plan_cluster(DSV3_SHAPE, "h100", layout=layout, **args).best
    assert balanced.stage_layers != best.stage_layers and balanced.step_time != best.step_time
    searched = plan_cluster(DSV3_SHAPE, "h100", stage_cut=cut, runners_up=20, **args)
    assert {est.layout.stages for est in (searched.best, *(est for est, _ in searched.runners_up))} == {6}
    assert 0 < searched.candidates < plan_cluster(DSV3_SHAPE, "h100", **args).candidates
    with pytest.raises(LayoutError, match=r"pp=2 x vp=2 = 4 stages, but the stage cut 'E\|.*has 6: use pp and vp "
                                          r"whose product is 6"):
        plan_cluster(DSV3_SHAPE, "h100", layout=layout.replace("vp=3", "vp=2"), stage_cut=cut, **args)


@pytest.mark.parametrize("cut, message", [
    ("Et*12|mL", "it holds 12 decoder layers \\(t\\); the model has 13"),
    ("Et*12|tL", "it holds 0 multi-token-prediction modules"),
    ("Et*6|mt*7L", "the multi-token-prediction modules are priced beside the loss.*put them all just before the L"),
    ("t*13mLE", "the embedding \\(E\\) must come once, first"),
    ("Et*13m", "the loss \\(L\\) must come once, last"),
    ("Et*6||t*7mL", "stage 1 holds nothing"),
    ("E(t*6|t*7mL", "a '\\(' that is never closed"),
    ("Et*|t*13mL", "a '\\*' with no count"),
    ("Ex*13mL", "'x' is not a part of a stage"),
])
def test_a_wrong_explicit_cut_is_refused_naming_the_problem(cut, message):
    with pytest.raises(LayoutError, match=f"stage cut .*: {message}.*e.g. Et\\*4"):
        plan_cluster(DSV3_SHAPE, "h100", gpus=2, global_batch=8, seq=1024, stage_cut=cut)


def test_an_unknown_stage_cut_is_refused():
    with pytest.raises(LayoutError, match="stage_cut='uneven'.*'balanced'.*'even'"):
        plan_cluster(LLAMA, "h100", gpus=4, global_batch=16, seq=2048, layout=FIXED, stage_cut="uneven")


SMALL_VOCAB = dict(LLAMA, vocab_size=64)


def test_dualpipe_holds_two_copies_and_shards_their_state_over_both():
    """DualPipe (two copies, rank r holding model stages r and pp-1-r): twice the layers' weights and gradients
    of 1F1B on the same pp, the optimizer state sharded over both copies' ranks (about 1F1B's), and its balanced
    cut over the ranks' stage pairs."""
    args = dict(gpus=4, global_batch=16, seq=2048, stage_cut="even")
    one = plan_cluster(SMALL_VOCAB, "h100", layout=FIXED, **args).best
    two = plan_cluster(SMALL_VOCAB, "h100", layout=FIXED.replace("1f1b", "dualpipe"), **args).best
    assert two.stage_layers == one.stage_layers == (4, 4, 4, 4)
    assert two.memory.weights == pytest.approx(2 * one.memory.weights, rel=0.01)
    assert two.memory.gradients == pytest.approx(2 * one.memory.gradients, rel=0.01)
    assert two.memory.optimizer == pytest.approx(one.memory.optimizer, rel=0.01)
    balanced = plan_cluster(LLAMA, "h100", gpus=4, global_batch=16, seq=2048,
                            layout=FIXED.replace("1f1b", "dualpipe")).best.stage_layers
    assert sum(balanced) == 16 and balanced[0] + balanced[3] < balanced[1] + balanced[2]  # the head's pair


@pytest.mark.parametrize("layout, message", [
    ("pp=3,schedule=dualpipe", "dualpipe needs an even pp"),
    ("pp=4,vp=2,schedule=dualpipe", "use vp=1"),
])
def test_dualpipe_refuses_what_it_cannot_run(layout, message):
    estimator = Estimator(Job(spec=model_spec(LLAMA), hw=hardware("h100"), gpus=12, global_batch=48, seq=2048))
    fixed = parse_layout(layout)
    with pytest.raises(LayoutError, match=message):
        estimator.check(Layout(dp=12 // fixed["pp"], **fixed))


@pytest.mark.parametrize("schedule, cut, holds", [
    ("1f1b", "E|t*16L", True),  # the head with every layer on the last rank
    # rank 0 holds the first copy's embedding and the second copy's head: the copies are alike, so one weight serves
    # both, and the mirror ranks' reduce sums its gradients
    ("dualpipe", "Et*8|t*8L", False),
    ("zbv", "Et*6|t*2|t*2|t*6L", False),  # a V: rank 0 holds both ends of the model (and is the fuller)
])
def test_a_tied_head_on_another_rank_holds_its_own_copy_of_the_weight(schedule, cut, holds):
    """A tied embedding and head on different pipeline ranks: Megatron keeps a copy of the weight (with its gradient
    and optimizer state) on the head's rank and all-reduces the two ends' gradients after the backward. The head's
    rank had been priced without it (a new user's Llama-3.2-1B, 2026-12-06: 1.81 GiB of weights for 2.30 GiB);
    now it holds as much as untied, a little slower for the exchange, where a V's first rank (and DualPipe's end
    ranks) hold both ends."""
    vp = 2 if schedule == "zbv" else 1
    layout = FIXED.replace("pp=4,vp=1", f"pp=2,vp={vp}").replace("1f1b", schedule)
    args = dict(gpus=2, global_batch=16, seq=2048, layout=layout, stage_cut=cut)
    tied = plan_cluster(dict(LLAMA, tie_word_embeddings=True), "h100", **args).best
    untied = plan_cluster(dict(LLAMA, tie_word_embeddings=False), "h100", **args).best
    if holds:
        assert tied.memory.weights == untied.memory.weights and tied.memory.optimizer == untied.memory.optimizer
        assert untied.step_time < tied.step_time < 1.01 * untied.step_time
    else:
        head = LLAMA["vocab_size"] * LLAMA["hidden_size"]
        assert untied.memory.weights - tied.memory.weights == pytest.approx(2 * head, rel=1e-6)  # bf16 weights
        assert tied.step_time <= untied.step_time


def test_the_tied_ends_exchange_goes_over_the_link_between_their_gpus():
    """The two ends' gradient all-reduce between GPU i and i + (pp - 1) x tp x cp x dp: inside one 8-GPU domain for
    pp 4 x dp 2 (GPUs 0 and 6, 1 and 7; it had been priced over the NIC, 12 ms more a step, as the domain count of a
    group whose stride does not divide the domain said), across domains for pp 2 x dp 8 on 16 GPUs."""
    def exposed(tied: bool, gpus: int, layout: str) -> float:
        return plan_cluster(dict(LLAMA, tie_word_embeddings=tied), "h100", gpus=gpus, global_batch=32, seq=2048,
                            layout=layout, stage_cut="even").best.exposed_dp

    inside = "dp=2,tp=1,pp=4,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    across = "dp=8,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    head = LLAMA["vocab_size"] * LLAMA["hidden_size"] * 2.0  # its gradient in bf16
    near = exposed(True, 8, inside) - exposed(False, 8, inside)
    far = exposed(True, 16, across) - exposed(False, 16, across)
    assert 0 < near < head / 100e9 < far  # faster than 100 GB/s inside the domain, slower across (an H100's NIC)



def test_one_pipeline_stage_holds_both_tied_ends():
    """With pp 1 the one stage is both the first and the last: no copy of the tied weight and no exchange (a benchmark
    rerun found the 2021 Megatron rows of pp 1 priced with both, one stage counted as a head without its embedding)."""
    layout = FIXED.replace("pp=4", "pp=1")
    tied, untied = (plan_cluster(dict(LLAMA, tie_word_embeddings=tie), "h100", gpus=1, global_batch=16, seq=2048,
                                 layout=layout).best for tie in (True, False))
    head = LLAMA["vocab_size"] * LLAMA["hidden_size"]
    assert untied.memory.weights - tied.memory.weights == pytest.approx(2 * head, rel=1e-6)
    assert tied.exposed_dp == 0 and tied.step_time < untied.step_time
