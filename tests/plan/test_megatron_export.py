"""``pipeloom plan --export megatron``: a cluster plan as Megatron-LM's arguments (pipeloom.plan.export.megatron).

The arguments are compared with the plan they come from (its degrees, stage cut, batch, recomputation, optimizer and
precision choices), the stage layout is read back by the planner's own reader of Megatron-Core's layouts
(``layout_cut``), and what Megatron-LM cannot run is refused naming the fix. Megatron-LM's own parser and checks are
run on the exports by ``benchmarks/megatron_export_check.py`` (it needs a Megatron-LM checkout; docs/cluster-plan.md
has its result)."""

from __future__ import annotations

import json
import random
import shlex

import pytest

from pipeloom.cli import main
from pipeloom.errors import ArgumentError
from pipeloom.plan.cluster import plan_cluster
from pipeloom.plan.cluster.job import layout_cut
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.errors import NoLayoutFits, PlanError
from pipeloom.plan.export.megatron import (
    MEGATRON_SCHEDULES,
    megatron_args,
    megatron_layout,
    megatron_problems,
    unwritten,
)
from pipeloom.plan.plan import load_plan

LLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "moe_intermediate_size": 512,
             "num_experts": 16, "num_experts_per_tok": 2}
DEEPSEEK_MTP = {"model_type": "deepseek_v3", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 6,
                "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000, "moe_intermediate_size": 256,
                "n_routed_experts": 16, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
                "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                "v_head_dim": 32, "num_nextn_predict_layers": 1, "n_group": 1, "topk_group": 1}


def _flags(args: list[str]) -> dict[str, list[str]]:
    """``--flag value...`` as {flag: values} (a flag given twice would be a bug: refused here)."""
    found: dict[str, list[str]] = {}
    flag = None
    for word in args:
        if word.startswith("--"):
            assert word not in found, f"{word} twice"
            flag = word
            found[flag] = []
        else:
            assert flag is not None
            found[flag].append(word)
    return found


@pytest.mark.parametrize("counts", [(4,), (2, 3, 3, 3, 3, 2), (0, 4, 4, 0), (1, 2), (5, 5, 5, 5, 5, 4, 4, 3)])
@pytest.mark.parametrize("mtp", [0, 1])
def test_the_stage_layout_reads_back_as_the_plan_s_cut(counts, mtp):
    text = megatron_layout(counts, mtp)
    assert text.startswith("E") and text.endswith("m" * mtp + "L") and text.count("|") <= len(counts) - 1
    assert layout_cut(text, sum(counts), mtp) == counts


def test_the_stage_layout_writes_runs_of_alike_stages_once():
    assert megatron_layout((2, 3, 3, 3, 3, 2, 3, 1)) == "Ett|(t*3|)*4tt|t*3|tL"
    assert megatron_layout((4, 4, 4, 4), 1) == "Et*4|(t*4|)*2t*4mL"
    rng = random.Random(0)
    for _ in range(500):  # any cut whose stages all hold something reads back
        counts = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 24)))
        assert layout_cut(megatron_layout(counts), sum(counts), 0) == counts


def test_the_arguments_carry_the_plan():
    layout = "dp=1,tp=2,pp=2,vp=2,cp=2,ep=1,mbs=2,fsdp=0,recompute=selective,schedule=interleaved-1f1b"
    result = plan_cluster(LLAMA, "h100", gpus=8, global_batch=16, seq=8192, dtype="fp8", layout=layout,
                          fp8_cast="current", tp_overlap=True, cp_rotate="allgather", adam_moments="bf16")
    args = megatron_args(result.job, result.best.layout, result.best.stage_layers)
    flags = _flags(args)
    assert flags["--tensor-model-parallel-size"] == ["2"] and flags["--pipeline-model-parallel-size"] == ["2"]
    assert flags["--context-parallel-size"] == ["2"] and flags["--cp-comm-type"] == ["all_gather"]
    assert flags["--sequence-parallel"] == flags["--tp-comm-overlap"] == []
    cut = layout_cut(flags["--pipeline-model-parallel-layout"][0], 16, 0)
    assert cut == result.best.stage_layers and len(cut) == 4  # pp x vp stages, as priced
    assert (flags["--micro-batch-size"], flags["--global-batch-size"], flags["--seq-length"]) == (["2"], ["16"],
                                                                                                   ["8192"])
    assert flags["--recompute-granularity"] == ["selective"] and flags["--recompute-modules"] == ["core_attn"]
    assert flags["--fp8-format"] == ["hybrid"] and flags["--fp8-recipe"] == ["tensorwise"]
    assert flags["--exp-avg-dtype"] == flags["--exp-avg-sq-dtype"] == ["bf16"]
    assert "--use-precision-aware-optimizer" in flags and "--use-distributed-optimizer" in flags
    assert "--grad-reduce-in-bf16" in flags and "--bf16" in flags
    assert not {"--expert-model-parallel-size", "--recompute-method"} & set(flags)
    # Megatron ties the head unless told: an untied config says so, a tied one does not
    assert "--untie-embeddings-and-output-weights" in flags
    tied = plan_cluster(dict(LLAMA, tie_word_embeddings=True), "h100", gpus=8, global_batch=16, seq=8192, dtype="fp8",
                        layout=layout, adam_moments="bf16", runs_on="megatron")
    assert "--untie-embeddings-and-output-weights" not in megatron_args(tied.job, tied.best.layout,
                                                                        tied.best.stage_layers)
    # what the planner's defaults and other choices become
    plain = plan_cluster(LLAMA, "h100", gpus=8, global_batch=16, seq=4096, grad_reduce="fp32",
                         overlap_grad_reduce=False, recompute_layers=2,
                         layout="dp=8,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=full,schedule=1f1b")
    flags = _flags(megatron_args(plain.job, plain.best.layout, plain.best.stage_layers))
    assert not {"--pipeline-model-parallel-layout", "--sequence-parallel", "--cp-comm-type", "--grad-reduce-in-bf16",
                "--overlap-grad-reduce", "--overlap-param-gather", "--fp8-format"} & set(flags)
    assert (flags["--recompute-method"], flags["--recompute-num-layers"]) == (["block"], ["2"])


def test_experts_take_megatron_s_dispatcher_and_overlap():
    layout = "dp=4,tp=1,pp=2,vp=2,cp=1,ep=4,mbs=1,fsdp=0,recompute=none,schedule=interleaved-1f1b"
    result = plan_cluster(QWEN3_MOE, "h100", gpus=8, global_batch=32, seq=4096, layout=layout, moe_comm="hybridep",
                          moe_overlap=True)
    flags = _flags(megatron_args(result.job, result.best.layout, result.best.stage_layers))
    assert flags["--expert-model-parallel-size"] == ["4"] and flags["--expert-tensor-parallel-size"] == ["1"]
    assert flags["--moe-token-dispatcher-type"] == ["flex"] and flags["--moe-flex-dispatcher-backend"] == ["hybridep"]
    assert "--overlap-moe-expert-parallel-comm" in flags and "--moe-grouped-gemm" in flags
    plain = plan_cluster(QWEN3_MOE, "h100", gpus=8, global_batch=32, seq=4096, moe_overlap=True,
                         layout=layout.replace("interleaved-1f1b", "1f1b").replace("vp=2", "vp=1"))
    flags = _flags(megatron_args(plain.job, plain.best.layout, plain.best.stage_layers))
    # 1F1B over two stages pairs nothing (Megatron requires virtual stages for the overlap): priced and written so
    assert flags["--moe-token-dispatcher-type"] == ["alltoall"] and "--overlap-moe-expert-parallel-comm" not in flags
    mtp = plan_cluster(DEEPSEEK_MTP, "h100", gpus=8, global_batch=16, seq=2048,
                       layout="dp=4,tp=1,pp=2,vp=1,cp=1,ep=4,mbs=1,fsdp=0,recompute=none,schedule=1f1b")
    layout_text = _flags(megatron_args(mtp.job, mtp.best.layout, mtp.best.stage_layers))[
        "--pipeline-model-parallel-layout"][0]
    assert layout_text.endswith("mL") and layout_cut(layout_text, 6, 1) == mtp.best.stage_layers


def test_what_megatron_cannot_run_is_named_with_its_fix():
    job = plan_cluster(LLAMA, "h100", gpus=8, global_batch=16, seq=4096, selective="op",
                       layout="dp=2,tp=1,pp=4,vp=2,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=zbv").job
    [(text, fix)] = megatron_problems(job, Layout(dp=2, pp=4, vp=2, schedule="zbv"))
    assert "schedule=zbv for Megatron-LM, which runs 1F1B and interleaved 1F1B only" in text
    assert fix == {"schedule": "interleaved-1f1b"}
    assert megatron_problems(job, Layout(dp=2, pp=4, schedule="dualpipe"))[0][1] == {"schedule": "1f1b"}
    [(text, fix)] = megatron_problems(job, Layout(dp=8, fsdp=True))
    assert "Megatron-FSDP is not exported" in text and fix == {"fsdp": 0}
    [(text, fix)] = megatron_problems(job, Layout(dp=8, recompute="selective"))
    assert "--selective op for Megatron-LM" in text and fix == {}
    assert unwritten({"kernels": "eager", "attention": "flash", "shard_gradients": True, "p2p_overlap": True}) == [
        "--kernels eager (Megatron-Core fuses its elementwise kernels)",
        "--shard-gradients (the distributed optimizer reduce-scatters once a step)"]
    assert unwritten({"shard_gradients": 1}) == []  # only the value itself, not one equal to it
    with pytest.raises(ArgumentError, match=r"runs_on='megatron' cannot carry --kernels eager"):
        plan_cluster(LLAMA, "h100", gpus=8, global_batch=16, seq=4096, kernels="eager", runs_on="megatron")
    hybrid = {"model_type": "qwen3_next", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000, "head_dim": 64,
              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
              "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
              "linear_value_head_dim": 32}
    with pytest.raises(PlanError, match=r"Gated DeltaNet layers for Megatron-LM"):
        plan_cluster(hybrid, "h100", gpus=8, global_batch=16, seq=4096, runs_on="megatron")


def test_the_search_for_megatron_keeps_to_what_it_runs():
    """A DualPipe layout is the fastest as planned; for Megatron-LM the search keeps to 1F1B and interleaved 1F1B."""
    anywhere = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=4096, layout="pp=4")
    there = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=4096, layout="pp=4", runs_on="megatron")
    assert anywhere.best.layout.schedule not in MEGATRON_SCHEDULES
    for est in (there.best, *(est for est, _ in there.runners_up)):
        assert est.layout.schedule in MEGATRON_SCHEDULES and not est.layout.fsdp, est.layout
    assert there.best.step_time > anywhere.best.step_time
    with pytest.raises(NoLayoutFits, match="schedule=zbv for Megatron-LM"):
        plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=4096, layout="pp=4,schedule=zbv", runs_on="megatron")


def _command(tmp_path, config: dict, *extra: str) -> list[str]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "8", "--global-batch", "32", "--seq", "4096",
            "--save", str(tmp_path / "plan.json"), "--export", "megatron", *extra]


def test_the_command_writes_the_arguments_beside_the_plan(tmp_path, capsys):
    assert main(_command(tmp_path, LLAMA, "--layout", "pp=4")) == 0
    out = capsys.readouterr().out
    text = (tmp_path / "plan.megatron.args").read_text()
    head, line = text.rstrip("\n").rsplit("\n", 1)
    assert head.startswith("# pipeloom plan for Megatron-LM") and "launch on 8 GPUs" in head
    assert f"Megatron-LM: {line}" in out and f"wrote Megatron-LM arguments {tmp_path / 'plan.megatron.args'}" in out
    plan = load_plan(tmp_path / "plan.json")
    flags = _flags(shlex.split(line))
    assert flags["--pipeline-model-parallel-size"] == [str(plan.num_ranks)] == ["4"]
    assert plan.schedule in MEGATRON_SCHEDULES and "in Megatron-LM it cannot run: schedule=dualpipe" in out
    there = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=4096, layout="pp=4", runs_on="megatron")
    assert flags == _flags(megatron_args(there.job, there.best.layout, there.best.stage_layers))


def test_a_layout_pipeloom_s_plan_file_cannot_hold_writes_the_arguments_alone(tmp_path, capsys):
    layout = "dp=4,tp=2,pp=1,vp=1,cp=1,ep=4,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    assert main(_command(tmp_path, QWEN3_MOE, "--layout", layout)) == 0
    out = capsys.readouterr().out
    assert "note: no pipeloom plan file written at" in out and "pipeloom runs ep with tensor_parallel 1" in out
    assert (tmp_path / "plan.megatron.args").is_file() and not (tmp_path / "plan.json").exists()
    assert not list(tmp_path.glob(".plan.json*"))  # no staged file left behind


@pytest.mark.parametrize(("extra", "message"), [
    (["--framework", "torchtitan"], "--export megatron writes Megatron-LM's arguments, and --framework torchtitan"),
    (["--kernels", "eager"], "cannot export for Megatron-LM a plan priced with --kernels eager (Megatron-Core fuses"),
    (["--layout", "pp=4,schedule=zbv"], "cannot save a plan Megatron-LM runs: no layout of llama on 8 GPUs with "
                                        "pp=4,schedule=zbv runs there: schedule=zbv for Megatron-LM, which runs 1F1B"),
    (["--layout", "dp=2,tp=1,pp=4,vp=2,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=zbv"],
     "cannot save the chosen layout for Megatron-LM: schedule=zbv for Megatron-LM, which runs 1F1B and interleaved "
     "1F1B only; fix it with schedule=interleaved-1f1b: --layout dp=2,tp=1,pp=4,vp=2"),
])
def test_the_command_refuses_what_the_arguments_cannot_carry(tmp_path, capsys, extra, message):
    assert main(_command(tmp_path, LLAMA, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "plan.megatron.args").exists() and not (tmp_path / "plan.json").exists()


def test_a_cost_table_s_plan_is_not_exported_to_megatron(tmp_path, capsys):
    assert main(["plan", "--costs", str(tmp_path / "costs.json"), "--ranks", "2", "--global-batch", "4", "--save",
                 str(tmp_path / "plan.json"), "--export", "megatron"]) == 2
    assert "--export megatron writes the arguments of a cluster plan: plan with --model" in capsys.readouterr().err


def test_what_megatron_refuses_beside_the_expert_overlap_is_named():
    """Megatron-LM's TransformerConfig refuses, beside --overlap-moe-expert-parallel-comm, the moe module recomputed
    and a multi-token-prediction module on one pipeline stage (a review ran core 0.17.1's checks on the exports)."""
    moe = plan_cluster(QWEN3_MOE, "h100", gpus=8, global_batch=32, seq=4096, moe_overlap=True, selective="moe",
                       layout="dp=8,tp=1,pp=1,vp=1,cp=1,ep=4,mbs=1,fsdp=0,recompute=none,schedule=1f1b").job
    [(text, fix)] = megatron_problems(moe, Layout(dp=8, ep=4, recompute="selective"))
    assert "the moe module recomputed beside --overlap-moe-expert-parallel-comm" in text
    assert fix == {"recompute": "none"}
    [(text, fix)] = megatron_problems(moe, Layout(dp=8, ep=4, recompute="full"))
    assert "full recomputation" in text and fix == {"recompute": "none"}  # not into the moe module's refusal
    mtp = plan_cluster(DEEPSEEK_MTP, "h100", gpus=8, global_batch=16, seq=2048, moe_overlap=True,
                       layout="dp=8,tp=1,pp=1,vp=1,cp=1,ep=4,mbs=1,fsdp=0,recompute=none,schedule=1f1b").job
    [(text, _)] = megatron_problems(mtp, Layout(dp=8, ep=4))
    assert "1 multi-token-prediction module(s) with --moe-overlap" in text and "single pipeline stage" in text
    assert not megatron_problems(mtp, Layout(dp=4, ep=4, pp=2, vp=2, schedule="interleaved-1f1b"))
    assert unwritten({"adam_moments": "bf16", "distributed_optimizer": False}) == [
        "adam_moments='bf16' without the distributed optimizer (Megatron's precision-aware optimizer runs with it "
        "only)"]


def test_a_layout_without_expert_parallelism_writes_no_flex_dispatcher():
    """With ep=1 no all-to-all is priced; --moe-comm deepseek had still written DeepEP's flex dispatcher, which
    Megatron's dispatcher refuses under tp x ep = 1."""
    result = plan_cluster(QWEN3_MOE, "h100", gpus=8, global_batch=32, seq=4096, moe_comm="deepseek",
                          layout="dp=8,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b")
    flags = _flags(megatron_args(result.job, result.best.layout, result.best.stage_layers))
    assert flags["--moe-token-dispatcher-type"] == ["alltoall"] and "--moe-flex-dispatcher-backend" not in flags


def test_megatron_s_1f1b_sends_block_and_its_interleaved_sends_overlap():
    """Megatron-Core turns overlap_p2p_comm off without virtual stages (validate_args, core 0.17.1): 1F1B over pp > 1
    waits for each send; torch's pipelining (torchtitan, pipeloom's runtime) sends beside the compute."""
    common = dict(gpus=8, global_batch=32, seq=4096)
    for schedule, vp, blocks in (("1f1b", 1, True), ("interleaved-1f1b", 2, False)):
        layout = f"dp=2,tp=1,pp=4,vp={vp},cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule={schedule}"
        megatron = plan_cluster(LLAMA, "h100", layout=layout, **common).best.step_time
        torch_style = plan_cluster(LLAMA, "h100", layout=layout, blocking_1f1b=False, **common).best.step_time
        assert (megatron > torch_style) if blocks else (megatron == torch_style), schedule
    from pipeloom.plan.cluster.api import framework_options

    assert framework_options("torchtitan")["blocking_1f1b"] is False
