"""A cluster plan saved for the runtime (``pipeloom plan --model ... --save``): the plan file's sizes, split points
and tensor-parallel recipe follow the chosen layout; the dimensions the runtime does not run are refused by
name; and a saved plan runs through ``pipeline(model, plan=...)`` on a tiny LLaMA, bitwise equal to one device."""

from __future__ import annotations

import json

import pytest
from tests.plan.cluster.tiny import TINY, tiny_config, tiny_model

from pipeloom.cli import main
from pipeloom.plan.cluster import model_spec, plan_cluster
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.runtime_plan import (
    pipeloom_memory,
    runtime_notes,
    runtime_plan,
    save_blockers,
    split_point,
)
from pipeloom.plan.errors import PlanError
from pipeloom.plan.export.torchtitan import torchtitan_plan
from pipeloom.plan.plan import load_plan, save_plan

LLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
FIXED = "dp=2,tp=2,pp=2,vp=2,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=interleaved-1f1b"


def test_the_plan_file_follows_the_layout():
    result = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=FIXED, stage_cut="even")
    plan = runtime_plan(result)
    assert (plan.num_ranks, plan.data_parallel, plan.tensor_parallel, plan.sharding) == (2, 2, 2, "replicate")
    fsdp = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, stage_cut="even",
                        layout=FIXED.replace("dp=2,tp=2", "dp=4,tp=1").replace("fsdp=0", "fsdp=1"))
    assert runtime_plan(fsdp).sharding == "fsdp"
    assert plan.split_points == ("model.layers.4", "model.layers.8", "model.layers.12")  # 16 layers, 4 stages
    assert plan.schedule == "interleaved-1f1b" and plan.schedule_options == {"stages_per_rank": 2}
    assert plan.microbatches == 16 and plan.global_batch == 32  # 32 samples over 2 replicas of micro-batch 1
    assert plan.tp_plan["column"][0] == "model.layers.*.self_attn.q_proj"
    assert plan.predicted_step_time == result.best.step_time
    # every stage's F + I + W; the first and last carry the embedding and the head on top of 4 equal layers
    assert len(plan.stage_times) == 4 and plan.stage_times[1] == pytest.approx(plan.stage_times[2])
    assert min(plan.stage_times[0], plan.stage_times[3]) > plan.stage_times[1] > 0
    renamed, modules = torchtitan_plan(plan, 16)
    assert renamed.split_points == ("layers.4", "layers.8", "layers.12") and modules[-2:] == ["norm", "output"]


def test_the_plan_file_gives_each_rank_its_own_memory():
    """Under 1F1B rank r holds pp - r micro-batches of its stage at its peak: ranks holding the same layers differ by
    one stage's activations each; none is above the estimate's memory (the busiest rank's static memory with the
    busiest rank's activations): here the last rank's static memory (its head has the final norm on top of a matrix
    the size of rank 0's embedding) with rank 0's activations, the final norm's 16 bytes per weight above rank 0."""
    layout = "dp=1,tp=1,pp=4,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    result = plan_cluster(LLAMA, "h100", gpus=4, global_batch=16, seq=2048, layout=layout, stage_cut="even",
                          memory_limit=1e15)
    plan = runtime_plan(result)
    _, acts, _ = Estimator(result.job).stages(result.best.layout)
    assert len(plan.peak_memory) == 4 and acts[1] == acts[2]
    assert plan.peak_memory[1] - plan.peak_memory[2] == pytest.approx(acts[1])
    assert max(plan.peak_memory) == plan.peak_memory[0] == result.best.memory.total - 16 * LLAMA["hidden_size"]
    assert min(plan.peak_memory) < 0.8 * plan.peak_memory[0]


def test_the_plan_file_cuts_where_the_planner_priced():
    """The balanced cut (the default) moves layers off the rank holding the 32K-vocabulary head: the saved split
    points are the estimate's cut, not an even one."""
    result = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=FIXED)
    counts = result.best.stage_layers
    assert sum(counts) == 16 and counts != (4, 4, 4, 4)
    starts = [sum(counts[:j]) for j in range(1, 4)]
    assert runtime_plan(result).split_points == tuple(f"model.layers.{k}" for k in starts)


def test_a_qwen3_plan_gives_its_head_norms_their_style(tmp_path):
    """Qwen3's per-head q_norm/k_norm (qk_norm) ride in the recipe's head_norm, saved and loaded back; LLaMA has
    none and its saved plan carries no head_norm key (a file older readers still read)."""
    qwen3 = dict(LLAMA, model_type="qwen3", head_dim=128)
    plan = runtime_plan(plan_cluster(qwen3, "h100", gpus=8, global_batch=32, seq=2048, layout=FIXED))
    assert plan.tp_plan["head_norm"] == ["model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"]
    save_plan(plan, tmp_path / "qwen3.json")
    assert load_plan(tmp_path / "qwen3.json").tp_plan == plan.tp_plan
    llama = runtime_plan(plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=FIXED))
    assert llama.tp_plan["head_norm"] == []
    save_plan(llama, tmp_path / "llama.json")
    assert "head_norm" not in json.loads((tmp_path / "llama.json").read_text())["tp_plan"]
    assert load_plan(tmp_path / "llama.json").tp_plan == llama.tp_plan


def test_what_the_runtime_cannot_run_is_refused_by_name():
    cp = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=FIXED.replace("dp=2", "dp=1")
                      .replace("cp=1", "cp=2"))
    with pytest.raises(PlanError, match=r"cp=2 \(pipeloom's runtime does not run context parallelism yet\); fix it "
                                        "with cp=1,dp=2: --layout dp=2,tp=2,pp=2,vp=2,cp=1,ep=1,mbs=1,fsdp=0,"
                                        "recompute=none,schedule=interleaved-1f1b$"):
        runtime_plan(cp)
    gpt2 = {"model_type": "gpt2", "n_embd": 1024, "n_layer": 8, "n_head": 16, "vocab_size": 50257,
            "n_positions": 1024}
    tp = plan_cluster(gpt2, "h100", gpus=4, global_batch=8, seq=1024,
                      layout="dp=1,tp=2,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b")
    with pytest.raises(PlanError, match="recipe by module name is written for"):
        runtime_plan(tp)


def test_an_ep_layout_saves_its_expert_parallel_size():
    """ep sits inside dp (the layout's dp replicas hold ep groups): the plan keeps dp as its replicas and ep as
    expert_parallel (a pipeloom.plan/2 file); ep with fsdp or tp, which the runtime does not run, is refused."""
    moe = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "moe_intermediate_size": 128,
           "num_experts": 8, "num_experts_per_tok": 2}
    layout = "dp=4,tp=1,pp=2,vp=1,cp=1,ep=2,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    plan = runtime_plan(plan_cluster(moe, "h100", gpus=8, global_batch=16, seq=512, layout=layout))
    assert (plan.num_ranks, plan.data_parallel, plan.expert_parallel, plan.world_size) == (2, 4, 2, 8)
    assert plan.split_points == ("model.layers.4",) and plan.microbatches == 4
    with pytest.raises(PlanError, match="ep=2 with fsdp=1 .*; fix it with fsdp=0: --layout "
                                        f"{layout.replace('fsdp=1', 'fsdp=0')}$"):
        runtime_plan(plan_cluster(moe, "h100", gpus=8, global_batch=16, seq=512,
                                  layout=layout.replace("fsdp=0", "fsdp=1")))


def test_a_plan_priced_with_megatrons_overlapped_all_to_all_says_the_runtime_runs_it_exposed():
    moe = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "moe_intermediate_size": 128,
           "num_experts": 8, "num_experts_per_tok": 2}
    note = "the runtime runs them one after the other, the all-to-all exposed"
    for schedule, vp, said in (("interleaved-1f1b", 2, True), ("1f1b", 1, False)):
        layout = f"dp=4,tp=1,pp=2,vp={vp},cp=1,ep=2,mbs=1,fsdp=0,recompute=none,schedule={schedule}"
        result = plan_cluster(moe, "h100", gpus=8, global_batch=16, seq=512, layout=layout, moe_overlap=True)
        assert any(note in line for line in runtime_notes(result)) == said, schedule
    # DualPipe's pairs hide it as priced where the runtime is told to interleave them
    pairs = "run it with pipeline(..., parallel=Parallelism(overlap_pairs=True))"
    for ep, said in ((2, True), (1, False)):
        layout = f"dp=4,tp=1,pp=2,vp=2,cp=1,ep={ep},mbs=1,fsdp=0,recompute=none,schedule=dualpipev"
        result = plan_cluster(moe, "h100", gpus=8, global_batch=16, seq=512, layout=layout)
        assert any(pairs in line for line in runtime_notes(result)) == said, ep


def test_a_multimodal_models_plan_says_it_cuts_the_language_model_alone():
    text = {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000}
    layout = "dp=4,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    note = "the plan cuts the language model of the gemma3 config at its decoder layers: run it on that language model"
    for config, said in (({"model_type": "gemma3", "text_config": text}, True), (text, False)):
        result = plan_cluster(config, "h100", gpus=8, global_batch=16, seq=512, layout=layout)
        assert runtime_plan(result).split_points == ("model.layers.4",)
        assert any(note in line for line in runtime_notes(result)) == said


def test_a_tied_model_over_pipeline_stages_is_not_exported_to_torchtitan():
    """torchtitan ties no weight across pipeline stages: the two ends would train copies apart. The export refuses
    it with pp=1 as the fix, and a search for torchtitan keeps both ends on one stage."""
    tied = dict(LLAMA, tie_word_embeddings=True)
    fixed = "dp=2,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    message = save_blockers(plan_cluster(tied, "h100", gpus=4, global_batch=8, seq=512, layout=fixed),
                            export="torchtitan")
    assert "a tied embedding and head over pp=2 for torchtitan" in message and "pp=1" in message, message
    assert save_blockers(plan_cluster(LLAMA, "h100", gpus=4, global_batch=8, seq=512, layout=fixed),
                         export="torchtitan") is None  # untied: taken
    best = plan_cluster(tied, "h100", gpus=4, global_batch=8, seq=512, runs_on="torchtitan").best
    assert best.layout.pp == 1, best.layout


def test_every_reason_a_layout_cannot_be_saved_is_named_at_once():
    """cp, ep with fsdp, fsdp and ep under DualPipe's two copies, and the export's own limits come in one message
    with one --layout fix (for torchtitan its own: it runs cp and ep with FSDP, which its export refuses as ep); a
    layout over the memory limit is refused
    before anything else: a saved plan would not run."""
    moe = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "num_local_experts": 8,
           "num_experts_per_tok": 2}
    layout = "dp=2,tp=1,pp=2,vp=1,cp=2,ep=2,mbs=1,fsdp=1,recompute=none,schedule=dualpipe"
    result = plan_cluster(moe, "h100", gpus=8, global_batch=16, seq=512, layout=layout)
    message = save_blockers(result, export="torchtitan")
    for part in ("schedule=dualpipe for torchtitan", "ep=2 for torchtitan", "mixtral for torchtitan, which has no such "
                 "model", "fix the others with schedule=dualpipev,ep=1,vp=2: --layout dp=2,tp=1,pp=2,vp=2,cp=2,ep=1,"
                 "mbs=1,fsdp=1,recompute=none,schedule=dualpipev"):
        assert part in message, part
    assert "ep=2 with fsdp=1" not in message and "cp=2 (" not in message
    message = save_blockers(result)
    assert "torchtitan" not in message and "ep=2 with fsdp=1" in message
    assert "fsdp=1 with schedule=dualpipe" in message and "schedule=dualpipe with ep=2" in message
    assert message.endswith("fix them with cp=1,fsdp=0,schedule=dualpipev,vp=2,dp=4: --layout dp=4,tp=1,pp=2,vp=2,"
                            "cp=1,ep=2,mbs=1,fsdp=0,recompute=none,schedule=dualpipev")
    small = dict(LLAMA, num_hidden_layers=4)
    over = plan_cluster(small, "h100", gpus=8, global_batch=32, seq=2048, layout=FIXED.replace("pp=2", "pp=1")
                        .replace("vp=2", "vp=1").replace("interleaved-1f1b", "1f1b").replace("dp=2", "dp=4"),
                        memory_limit=2**30)
    with pytest.raises(PlanError, match=r"needs .* GiB per GPU, over the 1.0 GiB limit, so a saved plan would not run"):
        runtime_plan(over)
    both = plan_cluster(small, "h100", gpus=8, global_batch=32, seq=2048, memory_limit=2**30,
                        layout=FIXED.replace("dp=2", "dp=1").replace("cp=1", "cp=2"))
    message = save_blockers(both)  # over the limit and cp: both named, the key fixing the one it fixes
    assert "over the 1.0 GiB limit" in message and message.endswith("; fix the others with --layout cp=1,dp=2")


def test_a_suggested_fix_of_a_fixed_layout_is_a_layout_that_runs():
    """A fully fixed layout's fix is the whole layout to give in its place (appending the keys had met 'given twice'),
    with a smaller mbs where the fix leaves too few micro-batches (dp 1 -> 2 at mbs 4 left one for pp 2): the
    layout suggested saves."""
    tiny = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000}
    layout = "dp=1,tp=1,pp=2,vp=1,cp=2,ep=1,mbs=4,fsdp=0,recompute=full,schedule=1f1b"
    message = save_blockers(plan_cluster(tiny, "h100", gpus=4, global_batch=8, seq=128, layout=layout))
    fixed = "dp=2,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=2,fsdp=0,recompute=none,schedule=1f1b"
    assert message.endswith(f"fix them with cp=1,recompute=none,dp=2,mbs=2: --layout {fixed}"), message
    assert runtime_plan(plan_cluster(tiny, "h100", gpus=4, global_batch=8, seq=128, layout=fixed)).num_ranks == 2


def test_a_suggested_fix_says_when_the_fixed_layout_would_not_fit():
    """The --layout keys that fix what the runtime cannot run are priced as the runtime would hold the fixed layout:
    where it is over the limit (here keeping every activation instead of recomputing) the refusal says so, rather
    than leading to a memory refusal; within the limit it says nothing more."""
    layout = FIXED.replace("recompute=none", "recompute=full")
    roomy = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=layout)
    assert save_blockers(roomy).endswith(f"fix it with recompute=none: --layout {FIXED}")
    needs = pipeloom_memory(roomy.job, roomy.best.layout)
    limit = (roomy.best.memory.total + needs) / 2  # the layout as planned fits, the fixed one does not
    tight = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=layout, memory_limit=limit)
    assert save_blockers(tight).endswith(
        f"fix it with recompute=none: --layout {FIXED} (that layout needs {needs / 2**30:.1f} GiB per GPU as "
        f"pipeloom's runtime holds it, over the {limit / 2**30:.1f} GiB limit: give --layout fewer keys and let the "
        "search choose the others)")


def _plan_and_save(tmp_path, *extra):
    """``pipeloom plan`` on LLAMA with FIXED and ``extra`` flags, saved to ``tmp_path/plan.json``: (status, path)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    save = tmp_path / "plan.json"
    return main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "8", "--global-batch", "32",
                 "--seq", "2048", "--layout", FIXED, *extra, "--save", str(save)]), save


def test_save_writes_a_plan_and_names_what_runs_differently(tmp_path, capsys):
    status, save = _plan_and_save(tmp_path, "--stage-cut", "even")
    assert status == 0
    out = capsys.readouterr().out
    assert f"wrote plan {save} (pipeline(model, plan=...) runs it)" in out and "layers per stage: 4 x4" in out
    assert "as planned" not in out  # a whole layout is priced as the runtime holds it: no memory it did not count
    assert load_plan(save).split_points == ("model.layers.4", "model.layers.8", "model.layers.12")


def test_save_of_a_layout_over_the_limit_writes_nothing(tmp_path, capsys):
    status, save = _plan_and_save(tmp_path, "--memory-limit", "1GiB")
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "over the 1.0 GiB limit, so a saved plan would not run" in err[0]
    assert not save.exists()


def test_a_saved_plan_runs_in_the_engine(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F

    from pipeloom.runtime import pipeline

    tiny = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    result = plan_cluster(tiny, "h100", gpus=1, global_batch=4, seq=16,
                          layout="dp=1,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b")
    save = tmp_path / "plan.json"
    save_plan(runtime_plan(result), save)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in tiny.items() if k != "model_type"}, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    reference = transformers.LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())

    def loss_fn(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    x = torch.randint(0, 128, (4, 16))
    engine = pipeline(model, plan=save, loss_fn=loss_fn)
    loss = engine.step(x, target=x)
    expected = sum(loss_fn(reference(x[k:k + 1]), x[k:k + 1]) / 4 for k in range(4))
    assert engine.lowering.schedule.num_microbatches == 4 and torch.equal(loss.detach(), expected.detach())



def test_the_readme_command_plans_llama3_70b_on_64_h100s(capsys):
    """README.md's example, run on the repository's config (the doc-block test skips it: its cwd lacks the file)."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "configs" / "llama3-70b.json"
    assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "64", "--global-batch", "128",
                 "--seq", "8192", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["fits"] and best["memory_per_gpu"]["total"] <= 80 * 2**30
    layout = best["layout"]
    assert layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"] == 64


def test_a_layout_that_recomputes_is_not_saved_for_the_runtime():
    """pipeloom's runtime keeps every activation: a layout that recomputes is refused for it, with the key that fixes
    it and the export that runs it as planned; torchtitan takes it. The same layout without recomputation is saved."""
    layout = "dp=2,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=1,recompute=full,schedule=1f1b"
    full = plan_cluster(LLAMA, "h100", gpus=2, global_batch=8, seq=8192, layout=layout, memory_limit="12GiB")
    assert save_blockers(full).startswith("cannot save the chosen layout as a plan the runtime runs: recompute=full "
                                          "(pipeloom's runtime keeps every activation; --export torchtitan recomputes "
                                          "as planned); fix it with recompute=none: --layout "
                                          f"{layout.replace('full', 'none')} (that layout needs ")
    assert save_blockers(full, export="torchtitan") is None
    none = plan_cluster(LLAMA, "h100", gpus=2, global_batch=8, seq=8192, layout=layout.replace("full", "none"))
    assert save_blockers(none) is None and runtime_plan(none).num_ranks == 1


def test_a_layout_that_fits_only_by_recomputing_is_exported_for_torchtitan(tmp_path, capsys):
    """The torchtitan export tells torchtitan to recompute as planned: with --export torchtitan the same layout is
    saved, the plan file and torchtitan's files both written, and the note says how much pipeloom's own runtime
    would need; without the export the command refuses it and writes nothing."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    save = tmp_path / "plan.json"
    command = ["plan", "--model", str(config), "--hardware", "h100", "--gpus", "2", "--global-batch", "8", "--seq",
               "8192", "--layout", "dp=2,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=1,recompute=full,schedule=1f1b",
               "--memory-limit", "12GiB", "--save", str(save)]
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--export torchtitan recomputes as planned" in err[0] and not save.exists()
    assert main([*command, "--export", "torchtitan"]) == 0
    out = capsys.readouterr().out
    planned = plan_cluster(LLAMA, "h100", gpus=2, global_batch=8, seq=8192, memory_limit="12GiB", runs_on="torchtitan",
                           layout="dp=2,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=1,recompute=full,schedule=1f1b")
    need = pipeloom_memory(planned.job, planned.best.layout)  # no recomputation, FSDP's stage whole through the step
    assert ("note: pipeloom's runtime keeps every activation, where the plan recomputes (full); it gathers each "
            "stage's FSDP parameters") in out
    assert (f"it needs {need / 2**30:.1f} GiB per GPU there, {planned.best.memory.total / 2**30:.1f} GiB as planned, "
            "over the 12.0 GiB limit") in out
    assert f"wrote plan {save} (for torchtitan; pipeloom's runtime won't run it as planned)" in out
    assert load_plan(save).num_ranks == 1
    # torchtitan told to recompute as planned: 0.2.x's section (TOML and its own overrides), 0.3.x's subcommand last
    assert '[activation_checkpoint]\nmode = "full"' in (tmp_path / "plan.torchtitan.toml").read_text()
    lines = (tmp_path / "plan.torchtitan.args").read_text().splitlines()
    # one stage: no pipeline settings, nor 0.3.x's --training.disable_cuda_graphs (CUDA graphs refuse a pipeline only)
    assert "--activation_checkpoint.mode full" in lines and lines[-1] == "activation_checkpoint:full"
    assert "pipeline_parallel_schedule" not in lines[1] and "disable_cuda_graphs" not in "\n".join(lines)
    assert "torchtitan 0.2.x also: --activation_checkpoint.mode full" in out


@pytest.mark.parametrize(("recompute", "selective", "older", "newer"), [
    ("none", "op", "--activation_checkpoint.mode none", "activation_checkpoint:none"),
    ("selective", "op", "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op",
     "activation_checkpoint:selective")])
def test_the_torchtitan_export_carries_the_recomputation(tmp_path, capsys, recompute, selective, older, newer):
    """Whatever the layout recomputes, torchtitan is told (its own default is selective recomputation); the
    planner's op-level selective policy is torchtitan's."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    layout = f"dp=2,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute={recompute},schedule=1f1b"
    assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "4", "--global-batch", "8", "--seq",
                 "2048", "--layout", layout, "--selective", selective, "--save", str(tmp_path / "plan.json"),
                 "--export", "torchtitan"]) == 0
    out = capsys.readouterr().out
    assert f"torchtitan 0.2.x also: {older}\n" in out and out.split("torchtitan 0.3.x also: ")[1].split("\n")[0] \
        == f"--training.disable_cuda_graphs {newer}"


def test_a_recomputation_torchtitan_has_not_is_refused_for_it():
    """The planner's default selective recomputation (the attention core, Megatron's) has no torchtitan setting:
    the export is refused, and a runtime refusal of a layout that fits only by recomputing does not send the
    user to it (nor where torchtitan has no such model)."""
    layout = "dp=2,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=1,recompute=selective,schedule=1f1b"
    attention = plan_cluster(LLAMA, "h100", gpus=2, global_batch=8, seq=8192, layout=layout)
    assert "whose selective recomputation is its op-level policy (plan with --selective op" in save_blockers(
        attention, export="torchtitan")
    assert save_blockers(plan_cluster(LLAMA, "h100", gpus=2, global_batch=8, seq=8192, layout=layout,
                                      selective="op"), export="torchtitan") is None
    full = layout.replace("selective", "full")
    llama = plan_cluster(LLAMA, "h100", gpus=2, global_batch=8, seq=8192, layout=full, memory_limit="12GiB")
    mistral = plan_cluster(dict(LLAMA, model_type="mistral", sliding_window=None), "h100", gpus=2, global_batch=8,
                           seq=8192, layout=full, memory_limit="12GiB")
    assert "--export torchtitan recomputes as planned" in save_blockers(llama)
    assert "recompute=full (pipeloom's runtime keeps every activation)" in save_blockers(mistral)
    assert "--export torchtitan" not in save_blockers(mistral)


def test_stages_of_the_embedding_or_the_head_alone_are_saved_and_exported(tmp_path, capsys):
    """A cut with more stages than layers: the plan file's split points start stage 1 at the first layer and the
    last stage at the final norm (the runtime runs it bitwise: tests/runtime/test_hf_models.py), and torchtitan's
    model parts are the embedding alone, a layer each, and the final norm with the output."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(LLAMA, num_hidden_layers=4)))
    save = tmp_path / "plan.json"
    assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "2", "--global-batch", "8", "--seq",
                 "2048", "--layout", "dp=1,tp=1,pp=2,vp=3,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,"
                 "schedule=interleaved-1f1b", "--save", str(save), "--export", "torchtitan"]) == 0
    assert "layers per stage: 0, 1 x4, 0" in capsys.readouterr().out
    assert load_plan(save).split_points == ("model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
                                            "model.norm")
    toml = (tmp_path / "plan.torchtitan.toml").read_text()
    assert ('module_fqns_per_model_part = [["tok_embeddings"], ["layers.0"], ["layers.1"], ["layers.2"], '
            '["layers.3"], ["norm", "output"]]') in toml
    assert split_point("gpt2", 12, 12) == "transformer.ln_f" and split_point("gpt2", 3, 12) == "transformer.h.3"


@pytest.mark.parametrize("family", sorted(TINY))
def test_every_family_names_the_modules_its_stages_start_at(family):
    """The split points a plan gives (a decoder layer, or the final norm for a stage of the head alone) are modules of
    every family's transformers model."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config = tiny_config(family)
    names = {name for name, _ in tiny_model(config).named_modules()}
    layers = model_spec(config).layers
    assert {split_point(family, layer, layers) for layer in (0, layers - 1, layers)} <= names


def test_a_plan_says_what_the_runtimes_optimizer_and_fsdp_hold_beyond_it():
    """The plan shards the optimizer state over the replicas (a distributed optimizer) and, under FSDP on one stage,
    gathers a layer at a time; pipeloom's runtime keeps the optimizer whole on every replica and FSDP's parameters
    and gradients whole through the step: the note says how much more that is (12 bytes per parameter against the
    plan's share; the same layout's weights and gradients without FSDP), and nothing with one replica or for FSDP
    under a pipeline, which the plan prices as the runtime runs it."""
    layout = "dp=4,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp={},recompute=none,schedule=1f1b"
    replicated = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=layout.format(0))
    memory = replicated.best.memory
    extra = 6 * memory.weights - memory.optimizer
    assert extra == pytest.approx(12 * memory.weights / 2 * 3 / 4)  # 3 of the 4 replicas' shares of the state
    said = [note for note in runtime_notes(replicated) if "whole on every data-parallel replica" in note]
    assert len(said) == 1 and "over the 4 replicas" in said[0]
    assert (f"it needs {(memory.total + extra) / 2**30:.1f} GiB per GPU there, {memory.total / 2**30:.1f} GiB as "
            "planned") in said[0]
    # FSDP on one stage reshards between micro-batches (ZeRO-3) in the plan; under a pipeline it is priced as the
    # runtime runs it (Layout.reshards), so only the first says more
    one_stage = "dp=8,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp={},recompute=none,schedule=1f1b"
    whole, planned = (plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=one_stage.format(fsdp))
                      .best.memory for fsdp in (0, 1))
    extra = whole.total - planned.total  # the same activations and optimizer shard: weights, gradients, buffers
    assert extra > 0 and whole.optimizer == pytest.approx(planned.optimizer)
    sharded = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=one_stage.format(1))
    assert any("keeps them and their gradients whole until the step ends" in note
               and f"it needs {whole.total / 2**30:.1f} GiB per GPU there" in note for note in runtime_notes(sharded))
    piped = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=layout.format(1))
    assert piped.best.memory == replicated.best.memory
    assert not any("pipeloom's runtime" in note for note in runtime_notes(piped))
    zero2 = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=layout.format(1),
                         shard_gradients=True)  # the runtime's FSDP keeps the gradients whole through the step
    extra = replicated.best.memory.gradients - zero2.best.memory.gradients - (zero2.best.memory.buffers
                                                                                - replicated.best.memory.buffers)
    assert any("keeps the gradients whole until the step ends" in note and
               f"it needs {(zero2.best.memory.total + extra) / 2**30:.1f} GiB per GPU there" in note
               for note in runtime_notes(zero2))
    alone = plan_cluster(LLAMA, "h100", gpus=2, global_batch=32, seq=2048, layout=layout.format(0).replace("dp=4",
                                                                                                          "dp=1"))
    assert not any("pipeloom's runtime" in note for note in runtime_notes(alone))


def test_the_torchtitan_export_of_one_stage_accumulates_micro_batches(tmp_path, capsys):
    """Without pipeline parallelism torchtitan runs a rank's local batch whole and accumulates gradients over
    global / (local x dp) of them: a one-stage plan's local batch is its micro-batch, where a pipeline's is a rank's
    micro-batches together (its schedule splits them)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    for pp, local in ((1, 1), (2, 8)):
        layout = f"dp={4 // pp},tp=1,pp={pp},vp=1,cp=1,ep=1,mbs=1,fsdp=1,recompute=none,schedule=1f1b"
        assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "4", "--global-batch", "16",
                     "--seq", "2048", "--layout", layout, "--save", str(tmp_path / f"pp{pp}.json"),
                     "--export", "torchtitan"]) == 0
        capsys.readouterr()
        args = (tmp_path / f"pp{pp}.torchtitan.args").read_text()
        assert f"--training.local_batch_size {local} --training.global_batch_size 16" in args, args


@pytest.mark.parametrize("config, gpus, layout, said, fix", [
    (LLAMA, 2, "dp=1,tp=1,pp=2,fsdp=1,schedule=1f1b", "fsdp=1 with dp=1", "fsdp=0"),
    (LLAMA, 4, "dp=2,tp=2,pp=1,fsdp=1,schedule=1f1b", "fsdp=1 with tp=2", "fsdp=0"),
    (LLAMA, 4, "dp=2,tp=1,pp=2,fsdp=1,schedule=dualpipe", "fsdp=1 with schedule=dualpipe", "fsdp=0"),
    (dict(LLAMA, tie_word_embeddings=True), 4, "dp=2,tp=1,pp=2,fsdp=1,schedule=1f1b",
     "fsdp=1 with the embedding tied to the head across stages", "fsdp=0"),
    (dict(LLAMA, tie_word_embeddings=True), 4, "dp=1,tp=2,pp=2,fsdp=1,schedule=1f1b",  # every conflict named
     "fsdp=1 with dp=1 (its FSDP shards over dp replicas: none to shard over) and with tp=2 (FSDP with a tp plan, "
     "2-D sharding, is not built in the runtime) and with the embedding tied to the head across stages", "fsdp=0"),
    (LLAMA, 4, "dp=1,tp=2,pp=2,fsdp=0,schedule=dualpipe", "schedule=dualpipe with tp=2", "schedule=dualpipev,vp=2")])
def test_what_the_runtime_does_not_compose_is_refused_with_its_fix(config, gpus, layout, said, fix):
    """What pipeloom's runtime refuses at its first step (its FSDP over no dp replicas, with a tp plan, under
    DualPipe's two copies or across a tied embedding; DualPipe's copies with tp) is refused at save with the --layout
    keys that fix it, and a search for that runtime leaves it out."""
    fixed = f"{layout},vp=1,cp=1,ep=1,mbs=1,recompute=none"
    message = save_blockers(plan_cluster(config, "h100", gpus=gpus, global_batch=8, seq=512, layout=fixed))
    assert said in message and f"fix it with {fix}: --layout dp=" in message, message
    keys = dict(pair.split("=") for pair in layout.split(","))
    free = {key: keys[key] for key in ("tp", "pp")}  # the rest to the search
    best = plan_cluster(config, "h100", gpus=gpus, global_batch=8, seq=512, layout=free, runs_on="pipeloom").best
    assert save_blockers(plan_cluster(config, "h100", gpus=gpus, global_batch=8, seq=512,
                                      layout=str(best.layout))) is None, best.layout
