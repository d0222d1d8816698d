"""Megatron-Core's ``recompute_modules`` as the selective policy (:mod:`pipeloom.plan.cluster.recompute`): the
names it takes, the modules it refuses where they recompute nothing, the seconds each adds to a layer's backward
and what the plan then keeps; the command's ``--selective``. What each keeps is checked against the tensors
autograd saves in ``test_activations.py``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeloom.cli import main
from pipeloom.cli.plan_cluster_report import report
from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.cluster.efficiency import gemm_seconds, memory_seconds
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.cluster.recompute import MEGATRON_MODULES, module_sets, recompute_depths
from pipeloom.plan.errors import LayoutError, NoLayoutFits

CONFIGS = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "configs"
MOE = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
DENSE = json.loads((CONFIGS / "llama3-8b.json").read_text())
MLA = json.loads((CONFIGS / "deepseek-v3.json").read_text())


def _job(config, **options) -> Job:
    return Job(spec=model_spec(config), hw=hardware("h100"), gpus=16, global_batch=64, seq=4096, **options)


def test_modules_are_written_in_megatron_order_and_checked():
    assert _job(MOE, selective="moe_act, layernorm").selective == "layernorm,moe_act"
    for bad, what in (("core_attention", "unknown 'core_attention'"), ("mlp,mlp", "a module named twice"),
                      ("", "unknown ''")):
        with pytest.raises(LayoutError, match=what):
            _job(DENSE, selective=bad)


@pytest.mark.parametrize(("config", "modules", "why"), [
    (DENSE, "moe_act", "moe_act recomputes nothing in the llama model, which has no MoE layer"),
    (DENSE, "layernorm", "fuses every norm into the linear layer after it"),
    (MOE, "mla_up_proj,shared_experts", "has no multi-head latent attention; shared_experts .* no shared experts"),
    (MOE, "mlp", "has no dense MLP: leave it out"),
])
def test_a_module_that_recomputes_nothing_is_refused(config, modules, why):
    with pytest.raises(LayoutError, match=why):
        _job(config, selective=modules)


def _times(job: Job, kind: str, recompute: str = "selective", **layout):
    """One layer's F, I, W on one GPU of the job's 16 (dp the rest of tp)."""
    return layer_times(job, Layout(dp=16 // layout.get("tp", 1), recompute=recompute, **layout), kind)


def test_each_module_adds_its_forward_to_the_backward():
    job = _job(MOE)
    none = _times(job, "moe", "none", ep=8)
    added = {modules: _times(dataclasses.replace(job, selective=modules), "moe", ep=8).i - none.i
             for modules in ("core_attn", "layernorm", "moe_act", "moe", "core_attn,layernorm,moe_act")}
    spec = job.spec
    # the pre-MLP norm: read h, write h on the micro-batch's 4096 tokens, one kernel
    assert added["layernorm"] == pytest.approx(memory_seconds(job.hw, 4.0 * spec.hidden * 4096)
                                               + job.hw.kernel_overhead)
    assert added["moe_act"] == pytest.approx(memory_seconds(job.hw, 6.0 * 8 * spec.experts.intermediate * 4096))
    assert added["core_attn,layernorm,moe_act"] == pytest.approx(
        added["core_attn"] + added["layernorm"] + added["moe_act"])
    # the MoE MLP again, its all-to-alls included: more than its activation alone, and the all-to-alls are
    # what an overlapped pair may hide
    moe = _times(dataclasses.replace(job, selective="moe"), "moe", ep=8)
    assert added["moe"] > added["moe_act"] and none.f_comm > 0
    assert moe.i_comm == pytest.approx(none.i_comm + none.f_comm)
    assert all(_times(dataclasses.replace(job, selective=m), "moe", ep=8).f == none.f for m in added)


def test_dense_mlp_and_mla_up_projections_rerun_their_gemms():
    dense = _job(DENSE)
    none = _times(dense, "dense", "none", tp=2)
    mlp = _times(dataclasses.replace(dense, selective="mlp"), "dense", tp=2)
    h, inter = dense.spec.hidden, dense.spec.intermediate // 2  # the MLP's GEMMs on a tp rank: gate, up, down
    gemms = 2 * gemm_seconds(dense.hw, 4096, inter, h) + gemm_seconds(dense.hw, 4096, h, inter)
    assert gemms < mlp.i - none.i < none.f
    mla = _job(MLA, dtype="fp8")
    base = _times(mla, "dense", "none", tp=2)
    up = _times(dataclasses.replace(mla, selective="mla_up_proj"), "dense", tp=2)
    assert 0 < up.i - base.i < base.f / 4


def test_recomputing_the_mlp_under_one_shared_norm_keeps_that_norms_output():
    """Cohere's attention and MLP read one norm's output: recomputing the MLP frees its intermediates only, where
    under a norm of its own (LLaMA's) it frees that norm's output and statistic too."""
    from pipeloom.plan.cluster.counts import layer_counts, mlp_activations, norm_stats
    from pipeloom.plan.cluster.recompute import megatron_activations

    for config, shared in ((dict(DENSE, model_type="cohere"), True), (DENSE, False)):
        spec = model_spec(config)
        none = layer_counts(spec, "dense", 1).activations["none"]
        mlp = megatron_activations(spec, "dense", ("mlp",))
        assert spec.shared_norm is shared
        assert none.tensor - mlp.tensor == mlp_activations(spec.intermediate, gated=True, width=2)
        assert none.sequence - mlp.sequence == (0 if shared else 2 * spec.hidden + norm_stats(spec))


def test_more_modules_keep_less_and_cost_more():
    job = _job(MOE)
    layout = Layout(dp=16, ep=8, recompute="selective")
    plans = {m: Estimator(dataclasses.replace(job, selective=m)).estimate(layout)
             for m in ("core_attn", "core_attn,layernorm,moe_act", "core_attn,layernorm,moe")}
    none = Estimator(job).estimate(dataclasses.replace(layout, recompute="none"))
    order = [none, *plans.values()]
    assert all(a.memory.activations > b.memory.activations for a, b in zip(order, order[1:]))
    assert all(a.step_time < b.step_time for a, b in zip(order, order[1:]))


def test_the_command_takes_megatron_modules(tmp_path, capsys):
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(MOE))
    layout = "dp=16,tp=1,pp=1,vp=1,cp=1,ep=8,mbs=1,fsdp=0,recompute=selective,schedule=1f1b"
    common = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "16", "--global-batch", "64", "--seq",
              "4096", "--layout", layout]
    assert main([*common, "--selective", "layernorm,moe_act", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["best"]
    assert main([*common, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)["best"]
    assert ours["memory_per_gpu"]["activations"] < default["memory_per_gpu"]["activations"]
    assert main([*common, "--selective", "moe_act,layernorm"]) == 0
    assert "selective recomputation: layernorm,moe_act (--selective)" in capsys.readouterr().out
    assert main([*common, "--selective", "mla_up_proj"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no multi-head latent attention" in err, err


def test_the_sets_a_search_tries_add_the_cheapest_recomputation_first():
    assert module_sets(model_spec(DENSE)) == [("core_attn",), ("mlp",), ("core_attn", "mlp")]
    assert module_sets(model_spec(MOE)) == [("core_attn",), ("layernorm",), ("layernorm", "moe_act"),
                                            ("core_attn", "layernorm", "moe_act"),
                                            ("core_attn", "layernorm", "moe_act", "moe")]
    assert module_sets(model_spec(MLA))[-1] == MEGATRON_MODULES and len(module_sets(model_spec(MLA))) == 8


DUALPIPE = "dp=128,tp=1,pp=16,vp=1,cp=1,ep=64,mbs=1,fsdp=0,schedule=dualpipe"  # recompute searched


def _deepseek(selective: str, limit: str = "70GiB"):
    return plan_cluster(MLA, "h100", gpus=2048, global_batch=15360, seq=4096, dtype="fp8", layout=DUALPIPE,
                        selective=selective, memory_limit=limit, runners_up=0)


def test_a_module_search_keeps_the_fastest_set_that_fits():
    """DeepSeek-V3 as it ran, within 70 GiB: Megatron-Core's default (the attention core) keeps too much, so only
    full recomputation fits; recomputing every module selectively fits and is faster."""
    searched = _deepseek("search")
    each = {",".join(modules): _deepseek(",".join(modules)) for modules in module_sets(model_spec(MLA))}
    fitting = [plan.best.step_time for plan in each.values() if plan.best.memory.total <= plan.memory_limit]
    assert searched.best.step_time == min(fitting) < each["core_attn"].best.step_time
    assert each["core_attn"].best.layout.recompute == "full" and searched.best.layout.recompute == "selective"
    assert searched.job.selective == ",".join(MEGATRON_MODULES)
    assert (searched.searched, searched.variants) == (("selective",), 8)
    found = searched.as_dict()
    assert (found["selective"], found["searched"], found["variants"]) == (searched.job.selective, ["selective"], 8)
    assert (_deepseek("core_attn").as_dict()["searched"], _deepseek("core_attn").as_dict()["variants"]) == ([], 0)


def test_when_no_set_fits_the_refusal_names_the_least_memory_of_any():
    with pytest.raises(NoLayoutFits) as searched:
        _deepseek("search", "20GiB")
    least = []
    for modules in module_sets(model_spec(MLA)):
        with pytest.raises(NoLayoutFits) as one:
            _deepseek(",".join(modules), "20GiB")
        least.append(one.value.smallest_limit)
    assert searched.value.smallest_limit == min(least)


def test_the_command_says_which_set_a_search_chose(tmp_path, capsys):
    path = tmp_path / "deepseek.json"
    path.write_text(json.dumps(MLA))
    assert main(["plan", "--model", str(path), "--hardware", "h100", "--gpus", "2048", "--global-batch", "15360",
                 "--seq", "4096", "--dtype", "fp8", "--layout", DUALPIPE, "--memory-limit", "70GiB",
                 "--selective", "search"]) == 0
    out = capsys.readouterr().out
    assert (f"selective recomputation: {','.join(MEGATRON_MODULES)} (--selective search: the fastest of 8 "
            "plans)") in out


def _block(n: int, recompute: str = "full"):
    job = Job(spec=model_spec(DENSE), hw=hardware("h100"), gpus=16, global_batch=64, seq=8192, stage_cut="even",
              recompute_layers=n, blocking_1f1b=False)  # a stage's times are its layers' (no blocking sends in them)
    return Estimator(job), Layout(dp=4, pp=4, recompute=recompute, schedule="1f1b")  # 8 layers per stage


def test_block_recompute_reruns_the_first_layers_of_each_stage():
    """Megatron-Core's block method: 2 of each stage's 8 layers recomputed whole, 6 keeping everything."""
    estimator, layout = _block(2)
    times, acts, layers = estimator.stages(layout)
    none, full = (dataclasses.replace(layout, recompute=mode) for mode in ("none", "full"))
    assert [len(held) for held in layers] == [8] * 4
    for j, held in enumerate(layers):
        extra = [k for k in ("embedding",) if j == 0] + [k for k in ("head",) if j == 3]
        assert acts[j] == pytest.approx(sum(estimator.activation(full, k) for k in held[:2])
                                        + sum(estimator.activation(none, k) for k in (*held[2:], *extra)))
        assert times[j].i == pytest.approx(sum(estimator.times(full, k).i for k in held[:2])
                                           + sum(estimator.times(none, k).i for k in (*held[2:], *extra)))
    plans = [_block(n)[0].estimate(layout) for n in (1, 2, 3)]
    plain = _block(0)[0].estimate(layout)
    kept = _block(0)[0].estimate(dataclasses.replace(layout, recompute="none"))
    assert kept.step_time < plans[0].step_time < plans[1].step_time < plans[2].step_time < plain.step_time
    assert kept.memory.total > plans[0].memory.total > plans[1].memory.total > plans[2].memory.total \
        > plain.memory.total


def test_block_recompute_of_every_layer_is_full_recompute_and_other_modes_are_untouched():
    estimator, layout = _block(8)
    plain, _ = _block(0)
    assert estimator.estimate(layout) == plain.estimate(layout)
    assert _block(9)[0].estimate(layout) == plain.estimate(layout)
    for mode in ("none", "selective"):
        other = dataclasses.replace(layout, recompute=mode)
        assert _block(2)[0].estimate(other) == plain.estimate(other)
    for bad in (-1, True, 1.5):
        with pytest.raises(LayoutError, match="recompute_layers must be a whole number"):
            _block(bad)


def test_the_command_takes_recompute_layers(tmp_path, capsys):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(DENSE))
    common = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "16", "--global-batch", "64", "--seq",
              "8192", "--stage-cut", "even", "--recompute-layers", "2", "--no-blocking-1f1b", "--layout"]
    layout = "dp=4,tp=1,pp=4,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute={},schedule=1f1b"
    assert main([*common, layout.format("full")]) == 0
    assert "full recomputation of the first 2 layers of each stage (--recompute-layers)" in capsys.readouterr().out
    assert main([*common, layout.format("full"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["recompute_layers"] == 2
    assert found["best"]["step_time"] == pytest.approx(_block(2)[0].estimate(_block(2)[1]).step_time)
    assert main([*common, layout.format("none")]) == 0
    assert "note: --recompute-layers 2 does not apply to the chosen layout, which runs recompute=none" in \
        capsys.readouterr().out


def test_a_depth_search_keeps_the_fewest_recomputed_layers_that_fit():
    """Llama 3 8B on pp 4 (8 layers a stage) within 45 GiB: recomputing 1 layer of each stage needs 47.9 GiB, 2
    need 43.9: the search keeps 2, the fastest that fits, and says so."""
    layout = "dp=4,tp=1,pp=4,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=full,schedule=1f1b"

    def plan(depth):
        return plan_cluster(DENSE, "h100", gpus=16, global_batch=64, seq=8192, stage_cut="even", layout=layout,
                            recompute_layers=depth, memory_limit="45GiB")

    assert recompute_depths(model_spec(DENSE)) == [0, 1, 2, 4, 8, 16]
    searched = plan("search")
    each = {depth: plan(depth) for depth in recompute_depths(model_spec(DENSE))}
    fitting = {depth: p.best.step_time for depth, p in each.items() if p.best.memory.total <= p.memory_limit}
    assert min(fitting, key=fitting.get) == 2 and 1 not in fitting
    assert searched.job.recompute_layers == 2 and searched.best.step_time == fitting[2]
    assert (searched.searched, searched.variants) == (("recompute_layers",), 6)
    assert "full recomputation of the first 2 layers of each stage (--recompute-layers search: the fastest of 6 " \
           "plans)" in report(searched)
    both = plan_cluster(DENSE, "h100", gpus=16, global_batch=64, seq=8192, stage_cut="even", layout=layout,
                        recompute_layers="search", selective="search", memory_limit="45GiB")
    # the layout recomputes fully: the selective sets change nothing on it, so only the depths are planned
    assert (both.searched, both.variants) == (("selective", "recompute_layers"), 6)
    assert both.best.step_time == searched.best.step_time and both.job.recompute_layers == 2


def test_searching_both_choices_finds_the_fastest_of_every_pair_planning_fewer():
    """Llama 3 8B on 16 H100s with pp 4 held, within 45 GiB: the two searches together plan the first set and depth
    over every layout and each other value over its mode's layouts (1 + 2 + 5 plans, not 3 x 6), and find the
    fastest plan of all 18 pairs, each planned alone."""
    def plan(selective, depth):
        return plan_cluster(DENSE, "h100", gpus=16, global_batch=64, seq=8192, stage_cut="even", layout="pp=4",
                            selective=selective, recompute_layers=depth, memory_limit="45GiB", runners_up=3)

    both = plan("search", "search")
    pairs = [plan(",".join(modules), depth) for modules in module_sets(model_spec(DENSE))
             for depth in recompute_depths(model_spec(DENSE))]
    fastest = min(pairs, key=lambda p: p.best.step_time)  # every pair's plan fits: the search refuses otherwise
    assert both.variants == 1 + 2 + 5 and both.searched == ("selective", "recompute_layers")
    assert both.best.step_time == fastest.best.step_time and both.best.layout == fastest.best.layout
    assert both.best.memory.total <= both.memory_limit
    slower = [est.step_time for est, why in both.runners_up if "slower" in why]
    assert slower == sorted(slower) and all(t >= both.best.step_time for t in slower)
    assert len({str(est.layout) for est, _ in both.runners_up}) == len(both.runners_up)


def test_transformer_engine_fp8_keeps_the_inputs_it_quantized():
    """Transformer Engine's FP8 GEMMs keep the input they quantized (1 byte; MXFP8 and its block scale 1 + 1/32) in
    place of the BF16 input where only the GEMM needs it, by hand per token on Llama 3 8B and Qwen3-30B-A3B:
    the attention norm's output and, in a dense layer, the MLP norm's output (sequence) and the down projection's
    input (tensor); in an MoE layer each routed copy's expert input and activation (less the activation under
    moe_act, whose BF16 input Megatron-Core discards). Under delayed scaling the output projection keeps its own
    copy beside the core's BF16 output (more), or in its place where the core runs again (less). Nothing for
    torchao's casts, BF16, full recomputation, latent attention's half of a layer, or a policy of torchtitan's."""
    from pipeloom.plan.cluster.counts import Activations
    from pipeloom.plan.cluster.recompute import fp8_saved_inputs, kept_activations

    dense = model_spec(DENSE)
    h, i, out = dense.hidden, dense.intermediate, dense.attention.heads * dense.attention.v_dim
    for modules, delayed, tensor in (((), False, -i), ((), True, out - i), (("core_attn",), True, -out - i),
                                     (("core_attn",), False, -i)):
        more = fp8_saved_inputs(dense, "dense", modules, quantized=1.0, delayed=delayed)
        assert (more.sequence, more.tensor) == (-2 * h, tensor), (modules, delayed)
    mx = fp8_saved_inputs(dense, "dense", (), quantized=1 + 1 / 32, delayed=False)
    assert mx.sequence == pytest.approx(-2 * h * (1 - 1 / 32)) and mx.tensor == pytest.approx(-i * (1 - 1 / 32))
    moe = model_spec(MOE)
    ex, hm = moe.experts, moe.hidden
    assert fp8_saved_inputs(moe, "moe", (), quantized=1.0, delayed=False).tensor == -ex.top_k * (hm + ex.intermediate)
    assert fp8_saved_inputs(moe, "moe", ("moe_act",), quantized=1.0, delayed=False).tensor == -ex.top_k * hm
    assert fp8_saved_inputs(moe, "moe", ("moe",), quantized=1.0, delayed=False).tensor == 0
    shared = model_spec({"model_type": "qwen2_moe"})  # a shared expert: its down projection's input in FP8, its
    se, hs = shared.experts, shared.hidden  # first projection's own copy of the norm output (not under layernorm)
    more = fp8_saved_inputs(shared, "moe", (), quantized=1.0, delayed=False)
    assert (more.sequence, more.tensor) == (0.0, -se.top_k * (hs + se.intermediate) - se.shared_intermediate)
    assert fp8_saved_inputs(shared, "moe", ("layernorm",), quantized=1.0, delayed=False).sequence == -hs
    mla = model_spec(MLA)  # latent attention's half left as counted, its MLP's not
    assert fp8_saved_inputs(mla, "dense", (), quantized=1.0, delayed=True) == Activations(
        sequence=-mla.hidden, tensor=-mla.intermediate)
    assert fp8_saved_inputs(mla, "moe", ("moe",), quantized=1.0, delayed=True) == fp8_saved_inputs(
        mla, "embedding", (), quantized=1.0, delayed=False) == Activations(sequence=0.0, tensor=0.0)
    job = Job(spec=moe, hw=hardware("h100"), gpus=8, global_batch=64, seq=4096, dtype="fp8", fp8_cast="current")
    assert job.saved_fp8() == (1.0, False)
    assert dataclasses.replace(job, fp8_cast="dynamic").saved_fp8() is None
    assert dataclasses.replace(job, hw=hardware("gb200"), fp8_cast="mxfp8").saved_fp8() == (1 + 1 / 32, False)
    layout = Layout(dp=8, ep=8, mbs=1, recompute="none", schedule="1f1b")
    fp8, torchao = Estimator(job), Estimator(dataclasses.replace(job, fp8_cast="dynamic"))
    assert fp8.activation(layout, "moe") == pytest.approx(  # the attention norm's output, the routed copies'
        torchao.activation(layout, "moe") - 4096 * (hm + ex.top_k * (hm + ex.intermediate)))
    counts = fp8.counts["moe"]
    assert kept_activations("layer", moe, counts, "selective", fp8=(1.0, True)) == kept_activations(
        "layer", moe, counts, "selective")
    assert fp8.activation(dataclasses.replace(layout, recompute="full"), "moe") == torchao.activation(
        dataclasses.replace(layout, recompute="full"), "moe")
