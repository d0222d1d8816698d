"""Tracing front ends, kept modules, dropout's train/eval switch and the runtime's random numbers, in one
process. Oracles: the unsplit model (bitwise), and torch's own dropout with the same generator state."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F
from torch import nn

from pipeloom.runtime import (
    ModelTraceError,
    SplitOrderError,
    Tracing,
    UnknownSplitPointError,
    forward_seed,
    pipeline,
    reference_step,
    split_model,
)
from pipeloom.runtime.errors import SplitError


class Dropper(nn.Module):
    """Dropout written the way torch.fx bakes in: ``F.dropout(x, training=self.training)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = F.dropout(torch.tanh(self.a(x)), p=0.5, training=self.training)
        h = self.drop(torch.tanh(self.b(h)))
        return self.head(h)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_eval_step_runs_without_dropout_whatever_the_code_says():
    torch.manual_seed(0)
    model = Dropper()
    engine = pipeline(model, schedule="interleaved-1f1b", split_points=["b"], loss_fn=F.cross_entropy,
                      microbatches=2)
    x = torch.randn(4, 8)
    expected = copy.deepcopy(model).eval()(x)
    assert torch.equal(engine.eval_step(x), expected)
    assert torch.equal(engine.eval_step(x), expected)
    assert all(module.training for module in engine.modules.values())  # eval_step restores the mode


def test_engine_eval_turns_dropout_off_in_step_and_train_back_on():
    torch.manual_seed(0)
    model = Dropper()
    reference = copy.deepcopy(model)
    engine = pipeline(model, schedule="interleaved-1f1b", split_points=["b"], loss_fn=F.cross_entropy,
                      microbatches=2)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    plain = sum(F.cross_entropy(reference.eval()(xm), ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2)))
    assert engine.eval() is engine
    assert torch.equal(engine.step(x, target=y), plain)
    engine.train()
    assert not torch.equal(engine.step(x, target=y), plain)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("first", ["traced in eval mode", "eval_step first"])
def test_a_model_traced_in_eval_mode_still_drops_out_when_it_trains(tracer, first):
    """A model in eval mode when it is traced (from_pretrained returns one; or an eval_step before any training
    step) had been traced without its dropout: engine.train() had nothing to switch on, and every training loss was
    the no-dropout one (a new user's trial, 2026-12-07). Traced in train mode, it draws what the reference draws."""
    torch.manual_seed(0)
    model = Dropper()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    if first == "traced in eval mode":
        model.eval()
        engine = pipeline(model, schedule="interleaved-1f1b", split_points=["b"], loss_fn=F.cross_entropy,
                          microbatches=4, seed=3, tracing=Tracing(tracer=tracer, example_inputs=(x,)))
    else:
        engine = pipeline(model, schedule="interleaved-1f1b", split_points=["b"], loss_fn=F.cross_entropy,
                          microbatches=4, seed=3, tracing=Tracing(tracer=tracer))
        engine.eval()
        plain = copy.deepcopy(reference).eval()
        with torch.no_grad():  # micro-batch by micro-batch, as the engine runs them
            assert torch.equal(engine.eval_step(x), torch.cat([plain(part) for part in x.chunk(4)]))
    assert not any(module.training for module in model.modules()) or first != "traced in eval mode"
    engine.train()
    staged = split_model(reference, ["b"], tracer=tracer, example_inputs=(x,))
    assert torch.equal(engine.step(x, target=y), reference_step(staged, x, y, loss_fn=F.cross_entropy,
                                                                microbatches=4, seed=3))


def test_a_training_step_leaves_the_callers_random_state_alone():
    torch.manual_seed(0)
    engine = pipeline(Dropper(), schedule="interleaved-1f1b", split_points=["b"], loss_fn=F.cross_entropy,
                      microbatches=2, seed=7)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    state = torch.get_rng_state()
    engine.step(x, target=y)
    assert torch.equal(torch.get_rng_state(), state)


def test_step_draws_what_the_single_process_reference_draws():
    torch.manual_seed(0)
    model = Dropper()
    reference = copy.deepcopy(model)
    staged = split_model(reference, ["b"])
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    engine = pipeline(model, schedule="looped-bfs", split_points=["b"], loss_fn=F.cross_entropy, microbatches=4,
                      seed=11)
    for step in range(2):
        loss = engine.step(x, target=y)
        assert torch.equal(loss, reference_step(staged, x, y, loss_fn=F.cross_entropy, microbatches=4, seed=11,
                                                step=step))
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
    # the seed decides the draws: another seed gives another loss
    other = pipeline(copy.deepcopy(reference), schedule="looped-bfs", split_points=["b"], loss_fn=F.cross_entropy,
                     microbatches=4, seed=12)
    assert not torch.equal(other.step(x, target=y), reference_step(staged, x, y, loss_fn=F.cross_entropy,
                                                                   microbatches=4, seed=11, step=0))


def test_forward_seeds_differ_per_step_piece_and_microbatch():
    seeds = {forward_seed(1, step, piece, mb) for step in range(3) for piece in range(3) for mb in range(3)}
    assert len(seeds) == 27 and all(0 <= s < 2**63 for s in seeds)
    assert forward_seed(1, 0, 0, 0) != forward_seed(2, 0, 0, 0)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_both_tracers_cut_the_same_model_bitwise(tracer):
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(5, 4)
    staged = split_model(model, ["blocks.1", "blocks.2"], tracer=tracer, example_inputs=(x,))
    assert staged.num_stages == 3
    for rows in (5, 2):  # export keeps the batch dimension symbolic
        x = torch.randn(rows, 4)
        assert torch.equal(staged.run(x), model(x))


def test_export_runs_under_its_settings_and_restores_them():
    """torch.export runs without fake-tensor caching and node stack traces (benchmarks/export_time.py: the same
    graph, faster); torch's settings are as they were afterwards, after a failed export too."""
    import torch._dynamo.config as dynamo_config

    from pipeloom.runtime.model import tracing

    seen = []
    export = torch.export.export

    def watching(*args, **kwargs):
        seen.append((dynamo_config.fake_tensor_cache_enabled, torch.fx.config.do_not_emit_stack_traces))
        return export(*args, **kwargs)

    before = (dynamo_config.fake_tensor_cache_enabled, torch.fx.config.do_not_emit_stack_traces)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.export, "export", watching)
        split_model(Blocks(), ["blocks.1"], tracer="export", example_inputs=(torch.randn(5, 4),))
        with pytest.raises(ModelTraceError):  # a scalar is not an input torch.export takes: refused by pipeloom
            tracing.exported_program(Blocks(), (torch.randn(5, 4), 3))
        patch.setattr(torch.export, "export", lambda *args, **kwargs: 1 / 0)
        with pytest.raises(ModelTraceError, match="ZeroDivisionError"):
            split_model(Blocks(), ["blocks.1"], tracer="export", example_inputs=(torch.randn(5, 4),))
    assert seen == [(False, True)]
    assert (dynamo_config.fake_tensor_cache_enabled, torch.fx.config.do_not_emit_stack_traces) == before


def test_export_takes_the_eager_branch_of_the_gated_delta_rule():
    """transformers' Qwen3-Next builds each chunk's inverse another way when it is exported (export_env.EAGER_BRANCHES):
    under pipeloom's export its module's is_torchdynamo_exporting answers False, so the trace runs the eager code's
    solve_triangular (and the model runs bitwise on ranks: tests/runtime/test_hf_models.py); the flag is restored
    afterwards, after a failed export too, and a module that is not listed keeps its own."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as next_module

    config = transformers.AutoConfig.for_model(
        "qwen3_next", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"], use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    flag, seen = next_module.is_torchdynamo_exporting, []
    solve = torch.linalg.solve_triangular

    def watching(*args, **kwargs):
        seen.append(torch.compiler.is_exporting())
        return solve(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.linalg, "solve_triangular", watching)
        staged = split_model(model, ["model.layers.1"], tracer="export",
                             example_inputs=(torch.randint(0, 64, (2, 9)),))
        assert next_module.is_torchdynamo_exporting is flag and seen and all(seen)  # traced through the solver
        patch.setattr(torch.export, "export", lambda *args, **kwargs: 1 / 0)
        with pytest.raises(ModelTraceError):
            split_model(model, ["model.layers.1"], tracer="export", example_inputs=(torch.randint(0, 64, (2, 9)),))
    assert next_module.is_torchdynamo_exporting is flag
    ids = torch.randint(0, 64, (2, 9))
    assert torch.equal(staged.run(ids).logits, model(ids).logits)


def test_leaf_modules_stay_whole():
    staged = split_model(Blocks(), ["blocks.1"], tracer="fx", leaf_modules=["blocks.0"])
    calls = [n.target for n in staged.stages[0].graph.nodes if n.op == "call_module"]
    assert calls == ["blocks.0"]
    with pytest.raises(UnknownSplitPointError, match="inside leaf_modules"):
        split_model(Blocks(), ["blocks.0.2"], tracer="fx", leaf_modules=["blocks.0"])
    with pytest.raises(UnknownSplitPointError, match="inside leaf_modules"):
        split_model(Blocks(), ["blocks.0.2"], tracer="export", leaf_modules=["blocks.0"],
                    example_inputs=(torch.randn(2, 4),))
    with pytest.raises(SplitError, match="not submodules"):
        split_model(Blocks(), ["blocks.1"], leaf_modules=["nowhere"])


def test_tracer_errors_say_what_to_do():
    pytest.importorskip("transformers")
    from hf_models import build_hf, tokens

    model = build_hf("gpt2")
    with pytest.raises(ModelTraceError, match="example_inputs="):
        split_model(model, ["transformer.h.2"])
    with pytest.raises(ModelTraceError, match="torch.fx cannot trace GPT2LMHeadModel"):
        split_model(model, ["transformer.h.2"], tracer="fx", example_inputs=(tokens()[0],))
    with pytest.raises(ModelTraceError, match="needs example_inputs"):
        split_model(model, ["transformer.h.2"], tracer="export")
    with pytest.raises(SplitError, match="tracer must be one of"):
        split_model(model, ["transformer.h.2"], tracer="jit")
    with pytest.raises(SplitOrderError):
        split_model(model, ["transformer.h.2", "transformer.h.1"], example_inputs=(tokens()[0],))


def test_a_transformers_model_runs_on_one_rank_and_eval_step_returns_its_output():
    """GPT-2 (tied head) on one rank, split by auto-traced torch.export; eval_step joins the micro-batches'
    ModelOutputs into one."""
    pytest.importorskip("transformers")
    from hf_models import build_hf, lm_loss, tokens

    model = build_hf("gpt2", dropout=0.1)
    reference = copy.deepcopy(model).eval()
    x, y = tokens()
    engine = pipeline(
        model,
        schedule="zbv",
        split_points=["transformer.h.2"],
        loss_fn=lm_loss,
        microbatches=4,
        tracing=Tracing(example_inputs=(x,)),
    )
    assert engine.staged.num_stages == 2 and len(engine.shared.params) == 1
    out = engine.eval_step(x)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert torch.equal(out.logits, torch.cat([reference(xm).logits for xm in x.chunk(4)]))
    assert torch.isfinite(engine.step(x, target=y))


class Convs(nn.Module):
    """BatchNorm and in-place ReLU, as in torchvision's ResNets (torchvision itself is not installable here)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        h = self.relu(self.bn2(self.conv2(h)) + h)
        return self.fc(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_batch_norm_trains_and_evaluates_like_the_model(tracer):
    """Oracle: the unsplit model in train mode (outputs and running statistics) and in eval mode."""
    torch.manual_seed(0)
    model = Convs()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))
    engine = pipeline(
        model,
        schedule="interleaved-1f1b",
        split_points=["relu", "conv2"],
        loss_fn=F.cross_entropy,
        microbatches=2,
        schedule_options={"stages_per_rank": 3},
        tracing=Tracing(tracer=tracer, example_inputs=(x,)),
    )
    loss = engine.step(x, target=y)
    expected = sum(F.cross_entropy(reference(xm), ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2)))
    assert torch.equal(loss, expected)
    assert torch.equal(model.bn1.running_mean, reference.bn1.running_mean)
    assert torch.equal(model.bn2.running_var, reference.bn2.running_var)
    assert torch.equal(engine.eval_step(x), reference.eval()(x))


def test_a_checkpoint_resumes_dropout_bitwise(tmp_path):
    """The training-step count that seeds the random numbers travels with the checkpoint."""

    def engine_for(seed: int):
        torch.manual_seed(seed)
        engine = pipeline(Dropper(), schedule="looped-bfs", split_points=["b"], loss_fn=F.cross_entropy,
                          microbatches=2, seed=5)
        return engine, torch.optim.AdamW(engine.parameters(), lr=0.01)

    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

    def train(engine, optimizer, steps):
        losses = []
        for _ in range(steps):
            losses.append(engine.step(x, target=y))
            optimizer.step()
            optimizer.zero_grad()
        return losses

    engine, optimizer = engine_for(0)
    train(engine, optimizer, 2)
    engine.save_checkpoint(tmp_path / "ckpt", optimizer=optimizer)
    expected = train(engine, optimizer, 2)
    resumed, optimizer = engine_for(1)
    resumed.load_checkpoint(tmp_path / "ckpt", optimizer=optimizer)
    assert resumed.training_steps == 2
    assert [torch.equal(a, b) for a, b in zip(train(resumed, optimizer, 2), expected)] == [True, True]


def test_the_trace_device_is_replaced_by_the_device_a_stage_runs_on():
    """torch.export writes the example's device into LLaMA's rotary embedding (``aten.to.device``); a stage
    moved elsewhere (here: the meta device, standing in for a GPU) must not send tensors back to it."""
    pytest.importorskip("transformers")
    from hf_models import build_hf, tokens

    from pipeloom.runtime.model.passes import retarget_devices

    x, _ = tokens()
    staged = split_model(build_hf("llama"), ["model.layers.2"], tracer="export", example_inputs=(x,))
    first = staged.stages[0]
    baked = [n for n in first.graph.nodes if torch.device("cpu") in (*n.args, *n.kwargs.values())]
    assert baked  # the graph names the trace device
    first.to("meta")
    assert retarget_devices(first, torch.device("meta")) >= len(baked)
    outputs = first(x.to("meta"))
    assert all(t.device.type == "meta" for t in (outputs if isinstance(outputs, tuple) else (outputs,)))
    assert retarget_devices(first, torch.device("meta")) == 0  # once is enough


def test_the_shape_solvers_warnings_are_quieted_unless_torch_logs_asks_for_them(monkeypatch):
    """Its whole-graph warning is quieted while pipeloom exports; a user's TORCH_LOGS had been overridden too."""
    import logging

    from pipeloom.runtime.model.export_env import QUIET_LOGGERS, export_settings

    logger = logging.getLogger(QUIET_LOGGERS[0])
    monkeypatch.setattr(logger, "level", logging.INFO)
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    with export_settings():
        assert logger.level == logging.ERROR
    assert logger.level == logging.INFO
    monkeypatch.setenv("TORCH_LOGS", "+dynamic")
    with export_settings():
        assert logger.level == logging.INFO


class _NoGradStat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():  # a statistic that carries no gradient
            stat = h.mean(-1, keepdim=True)
        return self.b(h) + stat


class _Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
        return self.b(h.float())


def test_a_forward_that_changes_grad_mode_or_autocast_is_not_traced_by_fx():
    """torch.fx records neither: the default tracer had silently given a no_grad statistic's gradient (0.196 off on
    a's weight) and run an autocast block in float32. Now torch.fx refuses them and the default traces with
    torch.export, bitwise."""
    torch.manual_seed(0)
    model = _NoGradStat()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    engine = pipeline(model, schedule="zbv", split_points=["b"], loss_fn=F.mse_loss, microbatches=2)
    engine.step(x, target=y)
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        (F.mse_loss(reference(xm), ym) / 2).backward()
    for name, param in engine.named_parameters():
        assert torch.equal(param.grad, dict(reference.named_parameters())[name].grad), name
    for module in (_NoGradStat(), _Autocast()):
        with pytest.raises(ModelTraceError, match="which a torch.fx graph does not record.*tracer='export'"):
            split_model(module, ["b"], tracer="fx")
    cast = _Autocast()
    inputs = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(split_model(cast, ["b"], example_inputs=(inputs,)).run(inputs), cast(inputs))


class _Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def inner(self, x):
        return torch.tanh(self.a(x))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.b(x + checkpoint(self.inner, x, use_reentrant=True))


def test_a_reentrant_checkpoint_is_traced_by_fx_and_refused_by_export():
    """Its torch.no_grad(): torch.fx drops it (the graph is the function's, exact), torch.export records it, and
    everything after it had been traced without gradients (the engine then blamed loss_fn)."""
    x = torch.randn(4, 8)
    model = _Reentrant()
    staged = split_model(model, ["b"], tracer="fx")  # the checkpoint's own no_grad is not the model's
    out = staged.run(x)
    assert out.requires_grad and torch.equal(out, model(x))
    with pytest.raises(ModelTraceError, match=r"reentrant activation checkpoint \(_Reentrant.inner, "
                                              r"use_reentrant=True\).*use_reentrant=False"):
        split_model(model, ["b"], tracer="export", example_inputs=(x,))


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        return {"logits": self.b(h), "hidden": [h, h * 2]}


def test_a_dict_output_reaches_the_loss_as_the_model_returns_it():
    """torch.fx's graph holds immutable dicts and lists: a loss_fn popping a key had failed (torch.fx's message about
    node.args) and broken the engine."""
    def popping(out, target):
        out.pop("hidden")
        return F.cross_entropy(out["logits"], target)

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    torch.manual_seed(0)
    model = _DictOut()
    out = split_model(model, ["b"], tracer="fx").run(x)
    assert type(out) is dict and type(out["hidden"]) is list
    engine = pipeline(model, schedule="zbv", split_points=["b"], loss_fn=popping, microbatches=2,
                      tracing=Tracing(tracer="fx"))
    reference = sum(popping(copy.deepcopy(model)(a), b) / 2 for a, b in zip(x.chunk(2), y.chunk(2)))
    assert torch.equal(engine.step(x, target=y), reference)


class _HarmlessModes(nn.Module):
    """A table computed from a buffer under no_grad (a rotary cache) and an enable_grad() that changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0))

    def forward(self, x):
        with torch.no_grad():
            table = torch.cos(self.freq * x.size(0))
        with torch.enable_grad():
            h = self.a(x) * table
        return self.b(h)


class _NoGradInCheckpoint(_Reentrant):
    def inner(self, x):
        with torch.no_grad():
            mean = x.mean()
        return torch.tanh(self.a(x)) - mean


def test_only_mode_changes_that_matter_keep_torch_fx_away():
    """A no_grad over values without a gradient, and an enable_grad() already in force, trace with torch.fx (a first
    version had refused every grad-mode call); a no_grad inside a reentrant checkpoint's function is refused (a
    first version had passed over the whole function, the checkpoint's own no_grad with it)."""
    x = torch.randn(4, 4)
    model = _HarmlessModes()
    out = split_model(model, ["b"], tracer="fx").run(x)
    assert torch.equal(out, model(x)) and out.requires_grad
    with pytest.raises(ModelTraceError, match=r"no_grad\(\) .* over a value with a gradient"):
        split_model(_NoGradInCheckpoint(), ["b"], tracer="fx")


class _Cases(nn.Module):
    """One forward per case of the second review: the module's ``case`` picks it."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.a, self.b, self.pos = nn.Linear(4, 4), nn.Linear(4, 4), nn.Embedding(8, 4)

    def forward(self, x):
        if self.case == "module":  # a trained module called under no_grad on values without a gradient
            with torch.no_grad():
                table = self.pos(torch.arange(4))
            return self.b(self.a(x) + table)
        if self.case == "in-place":  # a gradient written into a fresh tensor in place, then read under no_grad
            out = torch.zeros_like(x.detach())  # a detached copy's zeros: no gradient until add_
            out.add_(self.a(x))
            with torch.no_grad():
                mean = out.mean()
            return self.b(out - mean)
        if self.case == "checkpoint":  # a reentrant checkpoint called under the caller's no_grad
            from torch.utils.checkpoint import checkpoint

            with torch.no_grad():
                side = checkpoint(self.a, x, use_reentrant=True)
            return self.b(x + side)
        with torch.no_grad():  # "sizes": the shape and device read under no_grad, buffers only
            ramp = torch.arange(x.shape[0], device=x.device, dtype=x.dtype).unsqueeze(1)
        return self.b(self.a(x) * ramp)


@pytest.mark.parametrize("case, refused", [("module", True), ("in-place", True), ("checkpoint", True),
                                           ("sizes", False)])
def test_the_grad_mode_check_on_the_second_reviews_cases(case, refused):
    """Each of the first three had been traced by torch.fx with other gradients than eager (the module's weight, a's
    through the in-place write, a's under the caller's no_grad); the fourth had been refused (x.shape read)."""
    model = _Cases(case)
    if refused:
        with pytest.raises(ModelTraceError, match="over a value with a gradient"):
            split_model(model, ["b"], tracer="fx")
        return
    x = torch.randn(4, 4)
    out = split_model(model, ["b"], tracer="fx").run(x)
    assert torch.equal(out, model(x))
