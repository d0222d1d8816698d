"""The search for a runtime (``plan_cluster(runs_on=...)``; ``pipeloom plan --model ... --save``): only the layouts
that runtime runs, priced as it holds their state, and the command's note when the fastest layout is not one of
them."""

from __future__ import annotations

import json
import re

import pytest

from pipeloom.cli import main
from pipeloom.errors import ArgumentError
from pipeloom.plan.cluster import plan_cluster
from pipeloom.plan.cluster.api import framework_options
from pipeloom.plan.cluster.layout import FRAMEWORK_SCHEDULES
from pipeloom.plan.cluster.runtime_plan import runtime_notes
from pipeloom.plan.cluster.step import optimizer_bytes
from pipeloom.plan.errors import NoLayoutFits, PlanError
from pipeloom.plan.plan import load_plan

LLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "moe_intermediate_size": 512,
             "num_experts": 16, "num_experts_per_tok": 2}
JOB = {"gpus": 8, "global_batch": 32, "seq": 8192, "memory_limit": "12GiB"}
"""A job whose fastest layout runs context parallelism (cp=2), which neither runtime is given."""


def test_the_fastest_layout_a_runtime_runs_is_searched_for_it():
    anywhere = plan_cluster(LLAMA, "h100", **JOB)
    assert anywhere.best.layout.cp == 2 and anywhere.runs_on is None
    for runs_on in ("pipeloom", "torchtitan"):
        result = plan_cluster(LLAMA, "h100", **JOB, runs_on=runs_on)
        assert result.runs_on == runs_on and result.as_dict()["runs_on"] == runs_on
        for est in (result.best, *(est for est, _ in result.runners_up)):
            assert est.layout.cp == 1, (runs_on, est.layout)
            assert runs_on == "torchtitan" or est.layout.recompute == "none", est.layout
        assert anywhere.best.step_time < result.best.step_time
        assert result.best.memory.total <= 12 * 2**30


def test_pipeloom_s_runtime_is_priced_as_it_holds_the_state():
    """Without FSDP it keeps Adam's state whole on every replica; its FSDP keeps a stage's weights and gradients whole
    from the first forward to the step's end, one stage too: the memory the saved plan's note gives for the
    planned layout is what the search for the runtime prices."""
    for layout in ("dp=4,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b",
                   "dp=8,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=1,recompute=none,schedule=1f1b"):
        planned = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=layout)
        runtime = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=layout, runs_on="pipeloom")
        [note] = [note for note in runtime_notes(planned) if "GiB per GPU there" in note]
        need = float(re.search(r"it needs ([\d.]+) GiB per GPU there", note).group(1))
        assert runtime.best.memory.total / 2**30 == pytest.approx(need, abs=0.05), layout
        assert runtime.best.memory.total > planned.best.memory.total
        assert not [note for note in runtime_notes(runtime) if "GiB per GPU there" in note]
    layout = "dp=4,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    whole = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, layout=layout, runs_on="torchtitan")
    state = optimizer_bytes(1.0)[2]  # torchtitan without FSDP: DDP, Adam's 12 bytes a parameter on every replica
    assert whole.best.memory.optimizer == pytest.approx(state / 2 * whole.best.memory.weights)


def test_what_a_runtime_cannot_run_is_refused_when_the_keys_ask_for_it():
    with pytest.raises(PlanError, match=r"cannot run there: cp=2 \(pipeloom's runtime does not run context"):
        plan_cluster(LLAMA, "h100", **JOB, runs_on="pipeloom",
                     layout="dp=4,tp=1,pp=1,vp=1,cp=2,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b")
    with pytest.raises(NoLayoutFits, match=r"recompute=full \(pipeloom's runtime keeps every activation; --export "
                                           r"torchtitan recomputes as planned\); change or drop the --layout keys"):
        plan_cluster(LLAMA, "h100", **JOB, runs_on="pipeloom", layout="recompute=full")
    assert plan_cluster(LLAMA, "h100", **JOB, runs_on="torchtitan", layout="recompute=full,cp=1").best.layout.cp == 1
    moe = plan_cluster(QWEN3_MOE, "h100", gpus=8, global_batch=32, seq=4096, runs_on="torchtitan")
    assert moe.best.layout.ep == 1 and moe.best.layout.copies == 1
    with pytest.raises(NoLayoutFits, match="ep=2 for torchtitan"):
        plan_cluster(QWEN3_MOE, "h100", gpus=8, global_batch=32, seq=4096, runs_on="torchtitan", layout="ep=2")
    qwen2 = dict(LLAMA, model_type="qwen2")  # a family torchtitan has no model of: said without a layout
    with pytest.raises(PlanError, match=r"^qwen2 for torchtitan, which has no such model \(the export covers llama"):
        plan_cluster(qwen2, "h100", **JOB, runs_on="torchtitan")
    with pytest.raises(ArgumentError, match="runs_on must be one of pipeloom, torchtitan, megatron, got 'deepspeed'"):
        plan_cluster(LLAMA, "h100", **JOB, runs_on="deepspeed")


def _command(tmp_path, *extra: str) -> tuple[list[str], object]:
    config, save = tmp_path / "config.json", tmp_path / "plan.json"
    config.write_text(json.dumps(LLAMA))
    return ["plan", "--model", str(config), "--hardware", "h100", "--gpus", "8", "--global-batch", "32", "--seq",
            "8192", "--memory-limit", "12GiB", "--save", str(save), *extra], save


@pytest.mark.parametrize("export", [[], ["--export", "torchtitan"]], ids=["pipeloom", "torchtitan"])
def test_save_plans_for_the_runtime_and_says_what_was_faster(tmp_path, capsys, export):
    command, save = _command(tmp_path, *export)
    assert main(command) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"^layout: (\S+)$", out, re.MULTILINE).group(1)
    # the export prices as torchtitan runs it (--framework torchtitan), as planned and for the runtime alike
    preset = {**framework_options("torchtitan"), "schedules": FRAMEWORK_SCHEDULES["torchtitan"]} if export else {}
    fastest = plan_cluster(LLAMA, "h100", **JOB, **preset).best
    runtime = plan_cluster(LLAMA, "h100", **JOB, **preset, runs_on="torchtitan" if export else "pipeloom").best
    if export:  # torchtitan's preset prices what torchtitan runs as it holds it: nothing faster to tell of
        assert chosen == str(runtime.layout) == str(fastest.layout) and "planned as asked" not in out
    else:  # pipeloom's runtime runs no cp
        assert chosen == str(runtime.layout) != str(fastest.layout)
        assert (f"note: planned as asked, the fastest layout is {fastest.layout} ({fastest.step_time:.3f} s a step); "
                "in pipeloom's runtime it cannot run: cp=2 (pipeloom's runtime does not run context parallelism yet)"
                ) in out
        assert (f"; the plan printed is the fastest there ({runtime.step_time:.3f} s a step as pipeloom's runtime runs "
                "it)") in out
    plan = load_plan(save)
    assert (plan.num_ranks, plan.data_parallel, plan.tensor_parallel) == (runtime.layout.pp, runtime.layout.dp,
                                                                          runtime.layout.tp)
    assert max(plan.peak_memory) <= 12 * 2**30
    # the model it was made for, as its config gives it (pipeline(model, plan=) warns for another)
    assert plan.model == {"model_type": "llama", "num_hidden_layers": LLAMA["num_hidden_layers"],
                          "hidden_size": LLAMA["hidden_size"]}


def test_save_refuses_in_one_line_when_no_layout_the_runtime_runs_can(tmp_path, capsys):
    command, save = _command(tmp_path, "--layout", "cp=2")
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipeloom: error: cannot save a plan pipeloom's runtime runs: ")
    assert "cp=2 (pipeloom's runtime does not run context parallelism yet)" in err[0] and not save.exists()
    fastest = plan_cluster(LLAMA, "h100", **JOB, layout="cp=2").best
    assert err[0].endswith(f"(planned for any runtime, the fastest layout is {fastest.layout}, "
                           f"{fastest.step_time:.3f} s a step)")
    # keys no runtime can run are refused as without --save: the runtime is not the cause (it had been named)
    command, save = _command(tmp_path, "--layout", "pp=3")
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pipeloom: error: no layout of llama on {JOB['gpus']} GPUs can run with pp=3 (global batch "
                   f"{JOB['global_batch']}, sequence {JOB['seq']}) (the first refused: tp=1 x cp=1 x pp=3 does not "
                   f"divide the {JOB['gpus']} GPUs); change the fixed keys, pick a GPU count that is a multiple of 3"]
    assert not save.exists()


def test_fsdp_under_a_pipeline_is_searched_where_only_it_shards_the_optimizer():
    """Planned as Megatron does, FSDP under a pipeline holds what the distributed optimizer does and is not searched
    twice; for pipeloom's runtime, which has no distributed optimizer, only FSDP shards Adam's state there."""
    memory = {fsdp: plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, runs_on="pipeloom",
                                 layout=f"dp=4,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp={fsdp},recompute=none,schedule=1f1b",
                                 memory_limit="1000GiB").best.memory.total for fsdp in (0, 1)}
    assert memory[1] < 9 * 2**30 < memory[0]
    best = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=2048, runs_on="pipeloom", layout="pp=2,tp=1,cp=1",
                        memory_limit="9GiB").best
    assert best.layout.fsdp and best.memory.total <= 9 * 2**30


def test_save_names_the_least_memory_its_runtime_needs_when_nothing_fits(tmp_path, capsys):
    """Where no layout fits as planned either, the refusal is the runtime's search's: the least memory it names
    fits a plan the command then saves."""
    command, save = _command(tmp_path)
    command[command.index("12GiB")] = "3GiB"
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipeloom: error: cannot save a plan pipeloom's runtime runs: no "
                                               "layout fits 3.0 GiB per GPU")
    # and what any runtime would need (it had been left unsaid, as if the runtime alone were the cause)
    with pytest.raises(NoLayoutFits) as planned:
        plan_cluster(LLAMA, "h100", **{**JOB, "memory_limit": "3GiB"})
    assert err[0].endswith(f" (planned for any runtime, none fits either: the least memory any layout needs is "
                           f"{planned.value.smallest_limit / 2**30:.2f} GiB, by {planned.value.smallest_layout})")
    least = re.search(r"\((\d+) bytes\)", err[0]).group(1)
    command[command.index("3GiB")] = least
    assert main(command) == 0 and save.exists()


_UNSAID = [(["--dtype", "fp8"], "float8"), (["--recompute-layers", "2"], "recomputation depth"),
           (["--grad-reduce", "bf16"], "bf16 gradient reduce"), (["--attention", "flash"], "attention kernel"),
           (["--adam-moments", "bf16"], "optimizer moment dtype"), (["--shard-gradients"], "gradient sharding"),
           (["--no-sequence-parallel"], "tensor parallelism without sequence parallelism"),
           (["--no-overlap-grad-reduce"], "exposed gradient reduce")]


@pytest.mark.parametrize(("flag", "what"), _UNSAID)
def test_the_torchtitan_export_refuses_what_it_would_not_write(tmp_path, capsys, flag, what):
    """Each refusal names what was given and only that (fp8 alone had been told of async TP and a depth too). A new
    user's trial found --attention flash, --adam-moments bf16 and --shard-gradients priced (3.80 s and 52.9 GB a rank
    where torchtitan's defaults give 4.10 s and 64.1 GiB) and written nowhere."""
    command, save = _command(tmp_path, "--export", "torchtitan", *flag)
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"a plan priced with {' '.join(flag)}: the export writes no {what}" in err[0], err
    assert not any(other in err[0] for _, other in _UNSAID if other != what), err
    assert not save.exists()


def test_torchtitans_preset_holds_adams_state_as_torchtitan_does():
    """``--framework torchtitan`` (its preset) keeps Adam's state whole on every replica without FSDP, as torchtitan's
    torch optimizer beside DDP does and as the export prices it: a new user's Llama 3 70B on 64 H100s had been
    recommended at 74.7 GiB a layout torchtitan holds in 89.6."""
    fixed = "dp=4,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    job = {"gpus": 8, "global_batch": 32, "seq": 4096, "layout": fixed, "memory_limit": "1TiB"}
    preset = plan_cluster(LLAMA, "h100", **job, **framework_options("torchtitan")).best.memory
    exported = plan_cluster(LLAMA, "h100", **job, **framework_options("torchtitan"), runs_on="torchtitan").best.memory
    megatron = plan_cluster(LLAMA, "h100", **job).best.memory
    assert preset.optimizer == exported.optimizer == 6 * preset.weights  # 12 bytes a parameter whole (weights: 2)
    assert megatron.optimizer == 6 * megatron.weights / 4  # Megatron-Core's distributed optimizer: over dp=4


def test_the_torchtitan_export_is_priced_as_torchtitan_runs_it(tmp_path, capsys):
    """``--export torchtitan`` prices the plan with torchtitan's defaults (``--framework torchtitan``: eager kernels,
    its SDPA, gradients reduced in fp32, which is all its ``mixed_precision_reduce`` takes), not Megatron-Core's: a
    new user's Qwen3-32B plan had been quoted 12.0 s a step for a job torchtitan runs in 15.1 s as priced. The files
    carry the sequence the plan is priced for (``training.seq_len``, the plan's ``sequence_length``) and, where the
    plan is priced with fused kernels (``--kernels fused``), ``torch.compile``; another framework is refused."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    base = ["plan", "--model", str(config), "--hardware", "h100", "--gpus", "8", "--global-batch", "32", "--seq",
            "4096", "--json"]

    def step(*extra: str) -> float:
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)["best"]["step_time"]

    exported = step("--save", str(tmp_path / "a.json"), "--export", "torchtitan")
    preset = {**framework_options("torchtitan"), "schedules": FRAMEWORK_SCHEDULES["torchtitan"]}
    job = {"gpus": 8, "global_batch": 32, "seq": 4096, "runs_on": "torchtitan"}
    assert exported == plan_cluster(LLAMA, "h100", **job, **preset).best.step_time
    assert exported > plan_cluster(LLAMA, "h100", **job).best.step_time  # Megatron-Core's choices, as it had been
    args = (tmp_path / "a.torchtitan.args").read_text()
    assert "--training.seq_len 4096" in args and "compile" not in args
    assert "seq_len = 4096" in (tmp_path / "a.torchtitan.toml").read_text()
    assert load_plan(tmp_path / "a.json").sequence_length == 4096
    assert step("--save", str(tmp_path / "b.json"), "--export", "torchtitan", "--kernels", "fused") < exported
    assert "--compile.enable" in (tmp_path / "b.torchtitan.args").read_text()
    assert "[compile]\nenable = true" in (tmp_path / "b.torchtitan.toml").read_text()
    # async TP (--tp-overlap) runs in torchtitan only compiled: written with --kernels fused, refused without
    tp = ["--layout", "tp=2", "--tp-overlap"]
    assert main([*base, "--save", str(tmp_path / "d.json"), "--export", "torchtitan", *tp]) == 2
    assert "only under torch.compile: add --kernels fused" in capsys.readouterr().err
    assert step("--save", str(tmp_path / "d.json"), "--export", "torchtitan", *tp, "--kernels", "fused") > 0
    assert "--compile.enable_async_tensor_parallel" in (tmp_path / "d.torchtitan.args").read_text()
    assert main([*base, "--save", str(tmp_path / "c.json"), "--export", "torchtitan", "--framework",
                 "megatron-bridge"]) == 2
    assert "not as --framework megatron-bridge; drop --framework" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_a_torchtitan_plan_runs_context_parallelism(tmp_path, capsys):
    """torchtitan runs context parallelism (all-gathering K/V, as it is priced for it): the export writes its
    degree, the batch per context-parallel group; pipeloom's runtime does not run it, as the plan file's line says."""
    config, save = tmp_path / "config.json", tmp_path / "plan.json"
    config.write_text(json.dumps(LLAMA))
    layout = "dp=2,tp=1,pp=1,vp=1,cp=4,ep=1,mbs=1,fsdp=1,recompute=none,schedule=1f1b"
    assert main(["plan", "--model", str(config), "--hardware", "h100", "--gpus", "8", "--global-batch", "16", "--seq",
                 "32768", "--layout", layout, "--save", str(save), "--export", "torchtitan"]) == 0
    out = capsys.readouterr().out
    args = (tmp_path / "plan.torchtitan.args").read_text()
    assert "--parallelism.context_parallel_degree 4" in args and "--parallelism.data_parallel_shard_degree 2" in args
    assert "--training.local_batch_size 1 --training.global_batch_size 16" in args
    assert f"wrote plan {save} (for torchtitan; pipeloom's runtime won't run it as planned)" in out
    assert "note: pipeloom's runtime does not run this layout: cp=4" in out
    result = plan_cluster(LLAMA, "h100", gpus=8, global_batch=16, seq=32768, layout=layout, runs_on="torchtitan")
    assert result.job.cp_rotate == "allgather"


def test_a_saved_plan_with_bf16_adam_moments_says_what_torchs_adamw_needs():
    """pipeloom's runtime trains with the optimizer it is given: a plan priced with bf16 moments says so and what
    torch's AdamW (fp32 moments) needs there (a trial's saved plan fitted only with bf16 moments, unsaid)."""
    from pipeloom.plan.cluster.runtime_plan import pipeloom_memory

    fixed = "dp=4,tp=1,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    result = plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=4096, layout=fixed, adam_moments="bf16",
                          runs_on="pipeloom")
    fp32 = pipeloom_memory(plan_cluster(LLAMA, "h100", gpus=8, global_batch=32, seq=4096, layout=fixed).job,
                           result.best.layout)
    assert fp32 > result.best.memory.total
    assert (f"the plan holds Adam's moments in bf16 (--adam-moments bf16): train it with an optimizer that keeps them "
            f"so; torch's AdamW keeps them in fp32, {fp32 / 2**30:.1f} GiB per GPU in pipeloom's runtime"
            ) in runtime_notes(result)
    assert not any("moments" in note for note in runtime_notes(plan_cluster(LLAMA, "h100", gpus=8, global_batch=32,
                                                                              seq=4096, layout=fixed)))


def test_where_no_layout_runs_the_refusal_says_what_stops_them_and_why_the_rest_cannot_run():
    """GPT-2 on 16 GPUs with 8 sequences for pipeloom's runtime: every layout needs tp (no recipe for gpt2), cp or
    recomputation, none of which the runtime runs, and without them fewer micro-batches than stages are left.
    The refusal had named one layout's problem alone ("dp=...,cp=2: cp=2 (...)"), which read as the only one."""
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
            "n_positions": 1024}
    with pytest.raises(NoLayoutFits) as refused:
        plan_cluster(gpt2, "h100", gpus=16, global_batch=8, seq=1024, runs_on="pipeloom")
    said = str(refused.value)
    assert said.startswith("no layout of gpt2 on 16 GPUs runs there; what stops them, by layouts: cp in "), said
    for part in ("(e.g. cp=2 (pipeloom's runtime does not run context parallelism yet))",
                 "recompute in ", "tp in ", "(e.g. tp=2 on gpt2 (the tensor-parallel recipe",
                 "; and with tp=1,cp=1,fsdp=0,recompute=none none can run (",
                 "need at least pp (lower dp or mbs); pick a global batch of at least 16)"):
        assert part in said, (part, said)
    plan_cluster(gpt2, "h100", gpus=16, global_batch=16, seq=1024, runs_on="pipeloom")  # the count it names runs
    with pytest.raises(NoLayoutFits) as refused:  # one problem stops all: said alone, and why the rest cannot run
        plan_cluster(gpt2, "h100", gpus=3, global_batch=1, seq=1024, runs_on="pipeloom")
    said = str(refused.value)
    assert said.startswith("no layout of gpt2 on 3 GPUs runs there: tp=3 on gpt2 (the tensor-parallel recipe"), said
    assert said.endswith("1 micro-batch for pp=3: need at least pp (a larger global batch or a lower pp); pick a "
                         "global batch of at least 3)"), said


def test_the_api_refuses_for_torchtitan_what_the_export_drops():
    """plan_cluster(runs_on="torchtitan") with a choice the export cannot carry is refused, as the CLI refuses its flag
    with --export torchtitan (the API had repriced it as torchtitan runs without a word); its defaults are repriced."""
    from pipeloom.errors import ArgumentError

    for choice, said in (({"shard_gradients": True}, "shard_gradients=True"), ({"dtype": "fp8"}, "dtype='fp8'"),
                         ({"adam_moments": "bf16", "recompute_layers": 2}, "recompute_layers=2 (a recomputation "
                                                                            "depth) and adam_moments='bf16'")):
        with pytest.raises(ArgumentError, match=rf"runs_on='torchtitan' cannot carry {re.escape(said)}"):
            plan_cluster(LLAMA, "h100", **JOB, **choice, runs_on="torchtitan")
    assert plan_cluster(LLAMA, "h100", **JOB, shard_gradients=True, runs_on="pipeloom").best
