"""Per-head norms under tensor parallelism (docs/parallelism.md): tiny random-init Qwen3 (float64), whose
``q_norm``/``k_norm`` (weight of size head_dim) normalise ``q_proj(x).view(B, T, H, D)``. With the heads split
over "tp" by ``tp_plan="hf"`` (transformers' ``replicated_with_grad_allreduce``), a dict plan naming the norms,
a saved recipe's ``head_norm`` and ``tp_plan="auto"`` (made to shard attention), on pp 1 x tp 2 (the model as
one stage), and by ``tp_plan="hf"`` on pp 2 x tp 2 (pipeloom's split): every rank's gradients (whole tensors)
against one device, within test_tp.py's LLaMA tolerance, and the norms' gradients bitwise equal over the tp
ranks. The hand plan that leaves the norms plain (each tp rank would sum their gradients over its own heads)
is refused by message."""

from __future__ import annotations

import numpy as np
import pytest
from ranks import run_ranks
from tp_heads_jobs import HEAD_NORMS, hand_plan, qwen3_job

from pipeloom.runtime.errors import PipelineError

HF_TOLERANCE = 1e-7  # test_tp.py's float64 LLaMA (float32 softmax and rotary tables; Qwen3's norms cast too)
STEPS = 2
CASES = ["hf", "dict", "recipe", "auto"]


def _ok(results: dict) -> dict:
    bad = {rank: value for rank, value in results.items() if value[0] != "ok"}
    assert not bad, bad
    return {rank: value for rank, (_, value) in results.items()}


def _check(runs: dict, cases: list[str]) -> float:
    """Every rank's whole gradients against one device; the head norms' local gradients equal over "tp"; the
    projections sharded. The largest difference to one device."""
    reference = runs[0]["one_device"]
    worst = 0.0
    for case in cases:
        seen: set[str] = set()
        for rank, found in runs.items():
            mine = found[case]
            for step in range(STEPS):
                assert mine["full"][step] and not mine["missing"][step], (case, rank, step, mine["missing"][step])
                for name, grad in mine["full"][step].items():
                    seen.add(name)
                    worst = max(worst, float(np.abs(grad - reference[step][name]).max()))
                    assert np.abs(grad - reference[step][name]).max() < HF_TOLERANCE, (case, rank, step, name)
            assert any(name.endswith("q_proj.weight") and grad.shape[0] * 2 == reference[0][name].shape[0]
                       for name, grad in mine["local"][0].items()), (case, rank)  # the heads are split
        assert seen == set(reference[0]), (case, sorted(set(reference[0]) ^ seen))
        groups: dict[int, list[dict]] = {}
        for found in runs.values():
            groups.setdefault(found["coordinates"]["pp"], []).append(found[case])
        for pp, (first, second) in groups.items():
            norms = sorted(first["norm_params"])
            assert norms and norms == sorted(second["norm_params"]), (case, pp, norms)
            for name in norms:  # the gradient's value (each rank's shards summed), and the replicas after the steps
                for step in range(STEPS):
                    assert np.array_equal(first["full"][step][name], second["full"][step][name]), (case, pp, step, name)
                assert np.array_equal(first["norm_params"][name], second["norm_params"][name]), (case, pp, name)
            assert first["norm_grads"] == ["(Partial(sum),)"], (case, first["norm_grads"])
    return worst


def test_qwen3_head_norms_on_pp1_tp2_match_one_device():
    runs = _ok(run_ranks(2, qwen3_job, 1, CASES, STEPS, timeout=420))
    worst = _check(runs, CASES)
    print(f"Qwen3 pp 1 x tp 2, {STEPS} steps, plans {CASES}: largest difference to one device {worst:.3g}")
    for found in runs.values():
        assert found["auto"]["choice"]["attention"] == "megatron", found["auto"]["choice"]
        assert found["auto"]["head_norm"] == [f"model.layers.*.{n}" for n in HEAD_NORMS], found["auto"]["head_norm"]
        refused = found["refused"]
        assert refused.startswith("PipelineError: tp_plan splits the heads of 'model.layers.0.self_attn'"), refused
        assert "leaves 'model.layers.0.self_attn.q_norm' (Qwen3RMSNorm, 8 parameters per head)" in refused, refused
        assert "SequenceParallel(sequence_dim=-2, use_local_output=True)" in refused, refused
        assert "replicated_with_grad_allreduce" in refused and "'head_norm'" in refused, refused


@pytest.mark.timeout(600)
def test_qwen3_hf_plan_on_pp2_tp2_matches_one_device():
    runs = _ok(run_ranks(4, qwen3_job, 2, ["hf"], STEPS, timeout=540))
    worst = _check(runs, ["hf"])
    print(f"Qwen3 tp_plan='hf' pp 2 x tp 2 (1f1b, {STEPS} steps): largest difference to one device {worst:.3g}")


def test_the_hf_plan_translates_the_head_norms():
    from hf_models import build_hf

    from pipeloom.runtime.parallel.tp import hf_plan

    plan = hf_plan(build_hf("qwen3"))
    for name in HEAD_NORMS:
        style = plan[f"model.layers.*.{name}"]
        assert type(style).__name__ == "SequenceParallel" and style.use_local_output, style
        assert style.sequence_sharding[0].dim == -2, style  # the heads axis of (B, T, heads, head_dim)


def test_a_plan_that_leaves_the_head_norms_plain_is_refused_by_name():
    """check_head_norms on the whole model (what pipeline() runs per stage before parallelize_module)."""
    from hf_models import build_hf

    from pipeloom.runtime.parallel.tp import resolve
    from pipeloom.runtime.parallel.tp_heads import check_head_norms

    model = build_hf("qwen3")

    def resolved(plan: dict) -> dict:
        return {name: style for key, style in plan.items() for name in resolve(model, key)}

    with pytest.raises(PipelineError, match=r"leaves 'model\.layers\.0\.self_attn\.q_norm' \(Qwen3RMSNorm"):
        check_head_norms(model, resolved(hand_plan(norms=False)), 0)
    check_head_norms(model, resolved(hand_plan(norms=True)), 0)  # the fix: accepted
    only_mlp = {k: v for k, v in hand_plan(norms=False).items() if ".mlp." in k}
    check_head_norms(model, resolved(only_mlp), 0)  # heads not split: nothing to sum
    llama = build_hf("llama")  # no per-head modules beside its projections (nor its final norm by the head)
    from pipeloom.runtime.parallel.tp import hf_plan

    check_head_norms(llama, {name: style for key, style in hf_plan(llama).items() for name in resolve(llama, key)}, 0)


def test_auto_finds_the_head_norms():
    """The search's regions of Qwen3: q_norm/k_norm are its attention's head norms (not sequence-parallel norms),
    in the recipe whenever attention is sharded, and the recipe's styles pass the check."""
    from hf_models import build_hf

    from pipeloom.plan.tp.sharding import recipe_for
    from pipeloom.runtime.parallel.tp import recipe_styles, resolve
    from pipeloom.runtime.parallel.tp_auto import find_regions
    from pipeloom.runtime.parallel.tp_heads import check_head_norms

    model = build_hf("qwen3")
    modules = find_regions(model).modules
    expected = [f"model.layers.*.{n}" for n in HEAD_NORMS]
    assert list(modules.head_norms) == expected
    assert not set(expected) & set(modules.norms) and "model.layers.*.input_layernorm" in modules.norms
    for option in ("megatron", "megatron-sp"):
        recipe = recipe_for({"attention": option, "mlp": option}, modules)
        assert recipe is not None and recipe["head_norm"] == expected, (option, recipe)
        styles = recipe_styles(recipe)
        check_head_norms(model, {n: s for k, s in styles.items() for n in resolve(model, k)}, 0)
    assert recipe_for({"attention": "replicate", "mlp": "megatron"}, modules)["head_norm"] == []
    assert find_regions(build_hf("llama")).modules.head_norms == ()


def test_head_norms_may_be_sequence_parallel_beside_experts():
    """With "ep", SequenceParallel is refused (each tp rank would route other tokens) except on per-head norms,
    whose style splits the heads axis: Qwen3-MoE's attention plan with its q/k norms passes the check."""
    from ep_jobs import build_moe
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from pipeloom.runtime.parallel.ep import check_tp_with_experts

    model = build_moe("qwen3_moe")
    experts = [f"model.layers.{k}.mlp.experts" for k in range(4)]
    plan: dict = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    plan.update({f"model.layers.*.{n}": SequenceParallel(sequence_dim=-2, use_local_output=True) for n in HEAD_NORMS})
    check_tp_with_experts(plan, {0: model}, experts)
    with pytest.raises(PipelineError, match="'model.layers.*.input_layernorm' is SequenceParallel"):
        check_tp_with_experts({**plan, "model.layers.*.input_layernorm": SequenceParallel()}, {0: model}, experts)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "granite", "smollm3"])
def test_a_cluster_plan_with_tp_matches_one_device(tmp_path, name):
    """``pipeloom plan --model ... --save`` with tp 2 for Gemma 2 (four norms a layer, soft-capped scores), Gemma 3
    (its per-head q/k norms in the recipe's ``head_norm``), Granite (its multipliers) and SmolLM3 (layers without
    rotary embedding) runs through ``pipeline(model, plan=...)`` on 2 ranks,
    every rank's whole gradients within the LLaMA tolerance of one device."""
    from hf_models import build_hf
    from tp_heads_jobs import planned_tp_job

    from pipeloom.plan.cluster import plan_cluster
    from pipeloom.plan.cluster.runtime_plan import runtime_plan
    from pipeloom.plan.plan import save_plan

    result = plan_cluster(build_hf(name).config, "h100", gpus=2, global_batch=8, seq=12,
                          layout="dp=1,tp=2,pp=1,vp=1,cp=1,ep=1,mbs=4,fsdp=0,recompute=none,schedule=1f1b")
    plan = runtime_plan(result)
    assert bool(plan.tp_plan.get("head_norm")) == (name == "gemma3_text"), plan.tp_plan
    save_plan(plan, tmp_path / "plan.json")
    runs = _ok(run_ranks(2, planned_tp_job, name, str(tmp_path / "plan.json"), STEPS, timeout=360))
    reference = runs[0]["one_device"]
    for rank, found in runs.items():
        for step in range(STEPS):
            full = found["run"]["full"][step]
            assert not found["run"]["missing"][step] and set(full) == set(reference[step]), (rank, step)
            for grad_name, grad in full.items():
                assert np.abs(grad - reference[step][grad_name]).max() < HF_TOLERANCE, (rank, step, grad_name)
        assert any(n.endswith("q_proj.weight") and g.shape[0] * 2 == reference[0][n].shape[0]
                   for n, g in found["run"]["local"][0].items()), rank  # the heads are split
