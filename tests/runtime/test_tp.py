"""Tensor parallelism inside pipeline stages (docs/parallelism.md), on gloo ranks: ``pipeline(model, mesh=,
tp_plan=)`` against the same torch ``parallelize_module`` plan run without pipelining (bitwise) and against
one device (within ``TOLERANCE``: a row-parallel layer sums in another order); replicated boundary tensors
sent once per tp group (the bytes counted); boundary DTensors, a DTensor loss, a transformers model's own
plan, clipping, state dicts and checkpoints of sharded parameters, a hung tp peer, 8 ranks (dp x pp x tp),
and what is refused, by message. One start of the ranks per mesh shape (2, 4 and 8 ranks), forked from the
tests' rank server (ranks.run_ranks)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from ranks import run_ranks
from tp_jobs import (
    CLIP,
    MICROBATCHES,
    STEPS,
    alone_key,
    batch,
    build,
    loss_fn,
    mesh3d,
    tp_peer_fails,
    tp_pipelines,
    tp_plan_without_rows,
    two_ranks,
)

from pipeloom.runtime import PipelineError

TOLERANCE = 1e-12  # float64 models: measured at most ~1e-16 against one device (docs/parallelism.md)
# float64 LLaMA whose eager attention takes its softmax (and rotary tables) in float32: measured 3.7e-9
HF_TOLERANCE = 1e-7
HF_STEPS = 2

PIPELINED = [("tiny", "1f1b", 2, ""), ("tiny", "zb-h1", 2, ""), ("tiny", "zbv", 4, ""),
             ("tiny", "1f1b", 2, "boundary"), ("tiny", "1f1b", 2, "whole")]
TP_ONLY = [("mlp", "1f1b", 1, ""), ("mlp", "1f1b", 1, "loss_parallel")]


def _ok(results: dict) -> dict:
    bad = {rank: value for rank, value in results.items() if value[0] != "ok"}
    assert not bad, bad
    return {rank: value for rank, (_, value) in results.items()}


@functools.cache
def one_device(model_name: str, steps: int = STEPS) -> tuple[list[dict], dict]:
    """The single-device reference of docs/design.md §5, ``steps`` SGD steps: each step's gradients by name, and
    the state dict after them. One thread: tiny float64 kernels run ~10x slower on two busy ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_device(model_name, steps)
    finally:
        torch.set_num_threads(threads)


def _one_device(model_name: str, steps: int) -> tuple[list[dict], dict]:
    model = build(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step)
        for xm, ym in zip(torch.chunk(x, MICROBATCHES), torch.chunk(y, MICROBATCHES)):
            (loss_fn(model(xm), ym) / MICROBATCHES).backward()
        grads.append({name: p.grad.numpy().copy() for name, p in model.named_parameters()})
        optimizer.step()
    return grads, {key: value.numpy().copy() for key, value in model.state_dict().items()}



@pytest.fixture(scope="module")
def two_rank_runs():
    return _ok(run_ranks(2, two_ranks, TP_ONLY, HF_STEPS, timeout=150))


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tp") / "checkpoint"


@pytest.fixture(scope="module")
def pipelined_runs(checkpoint_folder):
    # names in another order than ("pp", "tp"): any order of the mesh's dimensions works
    return _ok(run_ranks(4, tp_pipelines, PIPELINED, (2, 2), ("tp", "pp"), str(checkpoint_folder), timeout=240))


def _check(runs: dict, case: tuple) -> float:
    """Every rank: gradients bitwise equal to the plan without pipelining, none missing, the same loss on
    every rank; the ranks together hold every parameter. Returns the largest difference to one device."""
    model_name, variant = case[0], case[3]
    reference, _ = one_device(model_name)
    seen: set[str] = set()
    worst = 0.0
    losses = {tuple(runs[rank][case]["loss"]) for rank in runs}
    assert len(losses) == 1, losses
    for rank, found in runs.items():
        mine, alone = found[case], found[alone_key(model_name, variant)]
        assert mine["loss"] == alone["loss"]
        for step in range(STEPS):
            assert mine["missing"][step] == [], (rank, step)
            assert mine["local"][step], (rank, step)
            for name, grad in mine["local"][step].items():
                assert np.array_equal(grad, alone["local"][step][name]), (rank, step, name)
            for name, grad in mine["full"][step].items():
                worst = max(worst, float(np.abs(grad - reference[step][name]).max()))
        seen.update(mine["local"][0])
    assert seen == set(reference[0])
    assert worst <= TOLERANCE
    print(f"{case}: largest difference to one device {worst:.3g}")
    return worst


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", TP_ONLY, ids=lambda c: c[3] or "mlp")
def test_tp_alone_on_two_ranks_matches_torch_and_one_device(two_rank_runs, case):
    """pp 1 x tp 2: the engine adds nothing to torch's own TP (bitwise), also with a DTensor loss
    (loss_parallel over class-sharded logits)."""
    _check(two_rank_runs, case)


@pytest.mark.timeout(200)
def test_hf_plan_runs_llama_as_torch_and_one_device(two_rank_runs):
    """``tp_plan="hf"`` on tiny random-init LLaMA (float64), pp 1 x tp 2: its config's base_model_tp_plan and
    the head's plan, translated to torch styles, give gradients bitwise equal to torch's parallelize_module
    with that plan and within HF_TOLERANCE of one device (its softmax runs in float32)."""
    reference = two_rank_runs[0]["hf"]["one_device"]
    worst = 0.0
    for rank, found in two_rank_runs.items():
        hf = found["hf"]
        assert "model.layers.*.self_attn.q_proj" in hf["plan"] and "lm_head" in hf["plan"], hf["plan"]
        mine, alone = hf["pipeline"], hf["alone"]
        assert mine["loss"] == alone["loss"]
        for step in range(HF_STEPS):
            assert mine["missing"][step] == []
            assert set(mine["full"][step]) == set(reference[step])
            for name, grad in mine["local"][step].items():
                assert np.array_equal(grad, alone["local"][step][name]), (rank, step, name)
            for name, grad in mine["full"][step].items():
                worst = max(worst, float(np.abs(grad - reference[step][name]).max()))
    assert worst <= HF_TOLERANCE
    print(f"LLaMA tp_plan='hf': largest difference to one device {worst:.3g}")


def test_refusals_without_a_tp_mesh_or_a_plan(two_rank_runs):
    """Raised before anything moves (on a rank of a 2-rank world, without a mesh): GPT-2 has no
    base_model_tp_plan; a tp_plan needs a mesh with "tp", tp_plan="auto" too."""
    for refused in (runs["refusals"] for runs in two_rank_runs.values()):
        assert ("tp_plan='hf': GPT2LMHeadModel's config (GPT2Config) has no base_model_tp_plan"
                in refused["gpt2"]), refused["gpt2"]
        assert "shards over the mesh's \"tp\" dimension" in refused["no mesh"], refused["no mesh"]
        assert "tp_plan='auto' shards over the mesh's \"tp\" dimension" in refused["auto"], refused["auto"]
        assert ("the style 'moe_tp_experts', which pipeloom does not translate" in refused["untranslated"]
                ), refused["untranslated"]


def test_hf_style_names_translate_to_torch_styles(two_rank_runs):
    """transformers' names -> torch's styles with transformers' layouts (its registry in
    transformers/distributed/tensor_parallel.py); "replicate" applies nothing."""
    translated = two_rank_runs[0]["refusals"]["translated"]
    assert translated == {
        "a": ("ColwiseParallel", "(Replicate(),)", "(Shard(dim=-1),)"),
        "b": ("RowwiseParallel", "(Shard(dim=-1),)", "(Replicate(),)"),
        "c": ("ColwiseParallel", "(Replicate(),)", "(Replicate(),)"),
        "d": ("RowwiseParallel", "(Replicate(),)", "(Replicate(),)"),
        "e": ("SequenceParallel", "None", "None"),
        "f": ("RowwiseParallel", "(Replicate(),)", "(Replicate(),)"),
    }, translated


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", PIPELINED, ids=lambda c: f"{c[1]}-{c[3] or 'plain'}")
def test_pipelined_tp_is_bitwise_tp_alone(pipelined_runs, case):
    """pp 2 x tp 2 with a Megatron plan, 3 optimizer steps: every rank's local gradients bitwise equal to
    the same plan without pipelining, within TOLERANCE of one device, no parameter without a gradient.
    ``boundary``: a Shard(-1) DTensor crosses the stage boundary as its local tensor and is rebuilt;
    ``whole``: replicated boundary tensors sent whole by every tp rank (``scatter_boundaries=False``)."""
    _check(pipelined_runs, case)


@pytest.mark.timeout(300)
def test_replicated_boundaries_cross_once_per_tp_group(pipelined_runs):
    """Counted bytes: with the Megatron plan every boundary tensor (activations and their gradients) is
    replicated over "tp", so after the first step each rank sends exactly 1/tp of what it would send whole,
    and receives the rest from its tp peer; a Shard(-1) DTensor (``boundary``) differs per rank and travels
    whole; with ``scatter_boundaries=False`` every byte is sent. Gradients stay bitwise either way
    (test_pipelined_tp_is_bitwise_tp_alone)."""
    whole = pipelined_runs[0][("tiny", "1f1b", 2, "whole")]["traffic"]
    split = pipelined_runs[0][("tiny", "1f1b", 2, "")]["traffic"]
    assert [sent for sent, _, _ in whole[1:]] == [unsplit for _, unsplit, _ in split[1:]]
    for rank, runs in pipelined_runs.items():
        for case in PIPELINED:
            for sent, unsplit, gathered in runs[case]["traffic"][1:]:  # the first step also sends descriptions
                assert unsplit > 0, (rank, case)
                if case[3] == "boundary":  # the residual stream splits, the Shard(-1) DTensor travels whole
                    assert unsplit / 2 < sent < unsplit and gathered == unsplit - sent, (rank, case, sent, unsplit)
                elif case[3] == "whole":  # scatter_boundaries=False: what every tp rank sent before
                    assert sent == unsplit and gathered == 0, (rank, case, sent, unsplit)
                else:
                    assert sent * 2 == unsplit and gathered == sent, (rank, case, sent, unsplit, gathered)
        print(f"rank {rank}: {runs['seconds']}")
        print(f"rank {rank}: bytes sent per step (sent, whole, gathered) 1f1b {runs[PIPELINED[0]]['traffic']}, "
              f"zbv {runs[PIPELINED[2]]['traffic']}")


@pytest.mark.timeout(300)
def test_helpers_with_sharded_parameters(pipelined_runs):
    """pp 2 x tp 2, 1f1b after 3 steps: eval_step gives one device's loss; state_dict holds the sharded
    parameters as DTensors; full_state_dict is the whole model within TOLERANCE of one device's; a DCP
    checkpoint (DTensors saved as they are) loads into a fresh engine bitwise and into one device's model
    within TOLERANCE; clip_grad_norm_ of a 4th step gives one device's total norm and clipped gradients
    within TOLERANCE, the same total on every rank."""
    grads, _ = one_device("tiny", STEPS + 1)
    _, after = one_device("tiny", STEPS)
    model = build("tiny")
    for name, p in model.named_parameters():
        p.grad = torch.from_numpy(grads[STEPS][name].copy())
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    clipped = {name: p.grad.numpy() for name, p in model.named_parameters()}
    assert total > CLIP  # clipping scales
    totals = set()
    wholes = {}
    for rank, runs in pipelined_runs.items():
        found = runs["helpers"]
        assert any(key.endswith("q.weight") for key in found["dtensors"]), found["dtensors"]
        assert found["loaded_equal"] and all(found["loaded_equal"].values()), found["loaded_equal"]
        wholes.update(found["full_state"])
        totals.add(found["clip_total"])
        assert abs(found["clip_total"] - total) <= TOLERANCE
        for name, grad in found["clipped"].items():
            assert np.abs(grad - clipped[name]).max() <= TOLERANCE, (rank, name)
    assert len(totals) == 1, totals
    model.load_state_dict({key: torch.from_numpy(value) for key, value in after.items()})
    with torch.no_grad():
        x, y = batch(0)
        expected = sum(float(loss_fn(model(xm), ym)) / MICROBATCHES
                       for xm, ym in zip(torch.chunk(x, MICROBATCHES), torch.chunk(y, MICROBATCHES)))
    for rank, runs in pipelined_runs.items():
        assert abs(runs["helpers"]["eval_loss"] - expected) <= TOLERANCE, (rank, runs["helpers"]["eval_loss"])
    assert set(wholes) == set(after)
    for key, value in wholes.items():
        assert np.abs(value - after[key]).max() <= TOLERANCE, key
    loaded = pipelined_runs[0]["helpers"]["one_device_load"]  # the checkpoint loaded into one model by DCP
    assert set(loaded) == set(after)
    for key, value in loaded.items():
        assert np.abs(value - after[key]).max() <= TOLERANCE, key


@pytest.mark.timeout(300)
def test_a_hung_tp_peer_makes_every_rank_raise(pipelined_runs):
    """Global rank 3 sleeps 1.5 x timeout inside a tensor-parallel region (its tp peer waits in the
    row-parallel all-reduce): every other rank raises within 2 x timeout (plus a loaded machine's slack), naming a
    global rank and its mesh coordinates; the sleeper raises within as long of waking."""
    for rank, runs in pipelined_runs.items():
        hang = runs["hang"]
        assert hang["error"].startswith("PipelineError: "), (rank, hang)
        assert "global rank" in hang["error"], (rank, hang["error"])
        limit = 2 * hang["timeout"] + 10  # the slack of a loaded 2-core machine; without the engine's timeout the
        taken = hang["after_waking"] if rank == 3 else hang["seconds"]  # others would not raise at all ("stepped")
        assert taken < limit, (rank, taken, hang["error"])
        print(f"rank {rank}: raised after {hang['seconds']:.1f} s: {hang['error'][:160]}")


@pytest.mark.timeout(120)
def test_a_plan_without_its_row_parallel_projections_is_pointed_at():
    """A hand-written plan with q/k/v column-parallel and the out-projection left whole fails at the first forward
    with torch's shape error, which named neither the plan nor the fix; the error now says what to look for."""
    said = {rank: message for rank, (status, message) in run_ranks(2, tp_plan_without_rows, timeout=100).items()}
    for message in said.values():
        assert message.startswith("PipelineError: "), said
        assert "under tp_plan this is most often the plan: each column-parallel projection needs the row-parallel" \
            in message, message


@pytest.mark.timeout(120)
def test_a_failing_tp_peer_is_named_by_the_rank_its_collective_broke_off_on():
    """Global rank 3 raises inside a tensor-parallel region: its "tp" peer (global rank 1), waiting in the
    row-parallel all-reduce, had reported gloo's 'Connection closed by peer' as its own failure; it names rank 3's
    failure, and no message reads 'rank global rank'."""
    said = {rank: message for rank, (status, message) in run_ranks(4, tp_peer_fails, timeout=100).items()}
    assert all(message.startswith("PipelineError: ") for message in said.values()), said
    assert "the user's layer failed" in said[3], said
    assert ("a collective broke off because global rank 3 (tp 1, pp 1) failed: " in said[1]
            and "the user's layer failed" in said[1]), said[1]
    assert not any("rank global rank" in message for message in said.values()), said


@pytest.mark.timeout(300)
def test_what_a_tp_mesh_refuses_says_so_by_name(pipelined_runs):
    found = {rank: runs["refusals"] for rank, runs in pipelined_runs.items()}
    for refused in found.values():
        assert "schedule 'dualpipe' holds two replicas" in refused["dualpipe"], refused["dualpipe"]
        assert "no tp_plan= was given" in refused["no plan"], refused["no plan"]
        assert "tp_plan='hf': Tiny has no config" in refused["hf"], refused["hf"]
        assert "tp_plan key 'layers.*.nope' names no module" in refused["unknown key"], refused["unknown key"]
        # every rank says why (the ranks without the head had been told to keep a module whole, or nothing)
        assert ("parameter 'head.weight' is used by several pieces (tied) and tp_plan shards it (key 'head')"
                in refused["tied"]) or "parameter 'embed.weight'" in refused["tied"], refused["tied"]
        assert "the mesh holds 3 of the 4 ranks; with \"dp\"" in refused["three replicas"], refused["three replicas"]
    assert found[3]["outside"] == ("PipelineError: global rank 3 is not in mesh= (it holds ranks 0-2 of 4); call "
                                   "pipeline() only on the mesh's ranks, or give a mesh over every rank")
    assert all(found[rank]["outside"] == "not called" for rank in range(3))
    for refused in found.values():
        late = refused["late"]
        assert "is not the object pipeline() captured" in late and "pass tp_plan= to pipeline()" in late, late
        assert "global rank" in late and "tp " in late, late  # the global rank and its mesh coordinates
        assert refused["late_s"] < 10


@pytest.mark.timeout(300)
def test_eight_ranks_dp_pp_tp_replicas_identical():
    """dp 2 x pp 2 x tp 2, 1f1b, one step: the two replicas' local gradients bitwise equal, the same loss on
    every rank, within TOLERANCE of one device over the global batch, every parameter held."""
    runs = _ok(run_ranks(8, mesh3d, timeout=240))
    reference, _ = one_device("tiny", 1)
    by_place: dict[tuple, dict] = {}
    losses = set()
    worst = 0.0
    for rank, found in runs.items():
        where = found["coordinates"]
        losses.add(found["loss"][0])
        assert found["missing"][0] == [], rank
        place = (where["pp"], where["tp"])
        if place in by_place:
            other = by_place[place]
            assert set(other) == set(found["local"][0])
            for name, grad in found["local"][0].items():
                assert np.array_equal(grad, other[name]), (rank, name)
        by_place[place] = found["local"][0]
        for name, grad in found["full"][0].items():
            worst = max(worst, float(np.abs(grad - reference[0][name]).max()))
    assert len(by_place) == 4 and len(losses) == 1, (by_place.keys(), losses)
    assert {name for grads in by_place.values() for name in grads} == set(reference[0])
    assert worst <= TOLERANCE
    print(f"dp 2 x pp 2 x tp 2: largest difference to one device {worst:.3g}")


def test_a_tp_size_that_splits_a_head_is_refused_before_the_first_forward():
    """LLaMA with 4 query / 2 key-value heads under tp_plan="hf" on tp 4 failed at its first forward ("shape '[4,
    10, -1, 16]' is invalid"); 3 heads on tp 2 alike. Refused with the tp sizes that work; a plan leaving the
    attention whole is not refused."""
    from hf_models import build_hf

    from pipeloom.runtime.parallel.tp import hf_plan
    from pipeloom.runtime.parallel.tp_heads import check_head_counts

    model = build_hf("llama")
    with pytest.raises(PipelineError, match=r"tp 4 does not split LlamaForCausalLM's 4 query / 2 key-value heads "
                                            r"evenly \(tp_plan shards the attention: "
                                            r"'model.layers.\*.self_attn.q_proj'; each tp rank takes whole heads\); "
                                            r"use a \"tp\" mesh dimension of 1 or 2"):
        check_head_counts(model, hf_plan(model), 4)
    check_head_counts(model, hf_plan(model), 2)
    check_head_counts(model, {"model.layers.*.mlp.up_proj": object()}, 4)  # the MLP alone: heads whole
    check_head_counts(model, {"model.layers.*.post_attention_layernorm": object()}, 4)  # a norm, not a projection
    model.config.num_attention_heads = model.config.num_key_value_heads = 3
    with pytest.raises(PipelineError, match=r"3 heads evenly .* of 1 or 3"):
        check_head_counts(model, hf_plan(model), 2)


def test_the_hf_plan_of_an_all_sparse_moe_leaves_out_the_dense_mlp_it_lacks():
    """transformers' Qwen2-MoE and Qwen3-MoE plans name mlp.gate_proj / up_proj / down_proj, which only their dense
    (mlp_only_layers) layers have: tp_plan="hf" on an all-sparse model had been refused for a key the user never
    wrote. The keys naming no module are left out, as transformers leaves them; the attention's stay."""
    from ep_jobs import build_moe

    from pipeloom.runtime.parallel.tp import hf_plan, leaf_modules_for

    for name in ("qwen3_moe", "qwen2_moe"):
        model = build_moe(name)
        plan = hf_plan(model)
        assert not any(".mlp." in key for key in plan), (name, sorted(plan))
        assert {"model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.o_proj"} <= set(plan), (name, plan)
        leaf_modules_for(model, plan, [])  # every key names a module


def test_a_column_or_row_style_on_a_module_torch_cannot_shard_is_refused_naming_it():
    """ColwiseParallel on Mixtral's router (a MixtralTopKRouter) had raised torch's NotImplementedError from deep in
    parallelize_module at the first forward, naming neither the key nor the module."""
    import transformers as T
    from torch.distributed.tensor.parallel import ColwiseParallel

    from pipeloom.runtime.parallel.tp import leaf_modules_for

    config = T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = T.MixtralForCausalLM(config)
    router = type(model.model.layers[0].mlp.gate).__name__
    with pytest.raises(PipelineError, match=rf"tp_plan key 'model.layers.\*.mlp.gate' gives 'model.layers.0.mlp.gate' "
                                            rf"\({router}\) ColwiseParallel, which torch applies only to nn.Linear"):
        leaf_modules_for(model, {"model.layers.*.mlp.gate": ColwiseParallel()}, [])
    leaf_modules_for(model, {"model.layers.*.self_attn.q_proj": ColwiseParallel()}, [])


def test_a_users_own_connection_error_is_not_taken_for_a_broken_collective():
    """Only the backends' own words for a peer gone (gloo's transport, NCCL) are read as a collective broken off by
    another rank's failure; a user's ConnectionError is said as it is (a review found it replaced by another
    replica's failure)."""
    from pipeloom.runtime.step.failure import broken_off

    class Board:
        def failure_reason(self, peer):
            return "rank 0 failed: boom"

    assert broken_off(ConnectionError("my feature store refused the connection"), Board()) is None
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert broken_off(gloo, Board()) == "rank 0 failed: boom"


def test_the_hf_plan_is_refused_where_none_of_its_base_keys_names_a_module():
    """Keys of another variant are left out, but a plan none of whose base keys names a module (the base model not
    where base_model_prefix says) would shard nothing: refused, as before the variants were left out."""
    from types import SimpleNamespace

    from torch import nn

    from pipeloom.runtime.parallel.tp import hf_plan

    model = nn.Module()
    model.add_module("body", nn.ModuleList([nn.Linear(2, 2)]))
    model.config = SimpleNamespace(base_model_tp_plan={"layers.*.q_proj": "colwise"})
    with pytest.raises(PipelineError, match=r"no key of Module's base_model_tp_plan names one of its modules"):
        hf_plan(model)


def test_a_style_subclass_with_its_own_apply_is_left_to_shard_what_it_takes():
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel

    from pipeloom.runtime.parallel.tp import leaf_modules_for

    class Own(ColwiseParallel):
        def _apply(self, module, device_mesh):
            return module

    model = nn.Sequential(nn.LayerNorm(4))
    leaf_modules_for(model, {"0": Own()}, [])
    with pytest.raises(PipelineError, match=r"'0' \(LayerNorm\) ColwiseParallel, which torch applies only to"):
        leaf_modules_for(model, {"0": ColwiseParallel()}, [])
