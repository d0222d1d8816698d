"""Sliding-window attention in the cluster planner: which layers transformers windows, what a windowed causal
kernel computes, and the price and model FLOPs of windowed layers."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tests.plan.cluster.tiny import TINY, local_layers

from pipeloom.cli import main
from pipeloom.plan.cluster import ModelConfigError, model_spec
from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.cluster.counts import attended_fraction, layer_counts
from pipeloom.plan.cluster.efficiency import attention_seconds
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.kinds import layer_kinds

# Mistral 7B v0.1's shape (its model card's config.json: sliding_window 4096 on every layer)
MISTRAL = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=4096)
LAYOUT = Layout(dp=8, mbs=1, recompute="selective", schedule="1f1b")

# windowed tiny configs of every family transformers windows, and which layers it windows (4 layers each)
WINDOWED = {
    "mistral": dict(sliding_window=8),
    "mixtral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=8, max_window_layers=3),
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=8, max_window_layers=3, mlp_only_layers=[]),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=8),
    "gemma2": dict(sliding_window=8),
    "gpt_oss": dict(sliding_window=8),
    "gemma3_text": dict(sliding_window=8, layer_types=None, sliding_window_pattern=3),
    "phi3": dict(sliding_window=8),
    "starcoder2": dict(sliding_window=8),
    "olmo3": dict(sliding_window=8, layer_types=None),
    "cohere2": dict(sliding_window=8, layer_types=None, sliding_window_pattern=3),
    "exaone4": dict(sliding_window=8, layer_types=None, sliding_window_pattern=3),
    "ministral": dict(sliding_window=8, layer_types=None),
    "ministral3": dict(sliding_window=8),
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_layers_are_transformers_own(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kwargs = dict(TINY[family], num_hidden_layers=4, **WINDOWED[family])
    config = transformers.AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    expected = local_layers(model)
    assert expected, family  # the case windows something
    for source in (config, config.to_dict(), dict(kwargs, model_type=family)):  # layer_types read, or derived
        spec = model_spec(source)
        assert spec.window_layers == expected, (family, type(source))
        assert spec.window == 8
    off = {k: v for k, v in kwargs.items() if k not in ("use_sliding_window", "sliding_window")}
    assert model_spec(dict(off, model_type=family, sliding_window=None)).window_layers == ()


def test_families_without_windows_ignore_sliding_window_fields():
    spec = model_spec(dict(TINY["llama"], model_type="llama", sliding_window=8))
    assert (spec.window, spec.window_layers) == (0, ())
    layers = TINY["llama"].get("num_hidden_layers", 2)
    typed = dict(TINY["llama"], model_type="llama", sliding_window=8, layer_types=["sliding_attention"] * layers)
    assert model_spec(typed).window_layers == ()  # Llama never reads layer_types: they had been windowed
    qwen = model_spec(dict(TINY["qwen2"], model_type="qwen2", sliding_window=8))  # use_sliding_window not set
    assert qwen.window_layers == ()


def test_bad_windows():
    with pytest.raises(ModelConfigError, match="sliding-window layers"):
        dataclasses.replace(model_spec(MISTRAL), window_layers=(40,))
    with pytest.raises(ModelConfigError, match="sliding_window"):
        dataclasses.replace(model_spec(MISTRAL), window=0)
    letters = dict(TINY["exaone4"], model_type="exaone4", layer_types=None, sliding_window_pattern="LLLG")
    with pytest.raises(ModelConfigError, match="sliding_window_pattern must be a positive whole number.*layer_types"):
        model_spec(letters)


@pytest.mark.parametrize("seq, window", [(16, 4), (16, 15), (16, 16), (16, 40), (64, 1), (33, 7)])
def test_attended_fraction_is_the_mask_less_half_its_diagonal(seq, window):
    """transformers' sliding-window causal mask keeps ``w·s - w²/2 + w/2`` score pairs for ``w < s`` (``s²/2 +
    s/2`` for the triangle): the fraction is that count less half the diagonal's ``min(s, w)`` pairs."""
    torch = pytest.importorskip("torch")
    masking = pytest.importorskip("transformers.masking_utils")
    allowed = masking.sliding_window_causal_mask_function(window)
    q, k = (torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1))
    kept = int(allowed(torch.tensor(0), torch.tensor(0), q, k).sum())
    assert attended_fraction(seq, window) * seq * seq == pytest.approx(kept - min(seq, window) / 2)
    assert attended_fraction(seq) == 0.5


def test_windowed_attention_is_priced_on_its_band():
    hw = hardware("h100")
    shape = dict(batch=1, heads=32, seq=32768, head_dim=128)
    full, band = attention_seconds(hw, **shape), attention_seconds(hw, **shape, window=4096)
    # the band holds 0.234 of the square against the triangle's 0.5, at a rate a 4,096-key loop reaches
    assert full / band == pytest.approx(attended_fraction(32768) / attended_fraction(32768, 4096)
                                        * (4096 / (4096 + hw.attention_half_seq))
                                        / (32768 / (32768 + hw.attention_half_seq)), rel=1e-3)
    assert attention_seconds(hw, **shape, window=32768) == full


def test_windowed_layers_cost_less_only_past_the_window():
    spec = model_spec(MISTRAL)
    assert layer_kinds(spec) == ("dense-window",) * 32
    whole = dataclasses.replace(spec, window=0, window_layers=())
    for seq, faster in ((4096, False), (32768, True)):
        job = Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=8, seq=seq)
        windowed, plain = layer_times(job, LAYOUT, "dense-window"), layer_times(job, LAYOUT, "dense")
        assert (windowed.f < plain.f and windowed.i < plain.i) is faster
        assert windowed.w == plain.w
        if not faster:
            assert windowed == plain
        eager = dataclasses.replace(job, attention="materialized")  # scores in HBM: the mask saves nothing
        assert layer_times(eager, LAYOUT, "dense-window") == layer_times(eager, LAYOUT, "dense")
        counts, base = layer_counts(spec, "dense-window", seq), layer_counts(spec, "dense", seq)
        assert (counts.params, counts.f, counts.i, counts.attention_f) == (base.params, base.f, base.i,
                                                                           base.attention_f)
        assert Estimator(job).model_flops <= Estimator(dataclasses.replace(job, spec=whole)).model_flops


def test_model_flops_count_causal_attention_forward_and_backward():
    """Per token: 6 x the matmul weights (embedding excluded) and 3 x the attended scores' 2·heads·(qk + v) FLOPs
    (the forward once, the backward twice): Llama 3 8B at 8K, and Mistral's band at 32K."""
    for config, seq in (("benchmarks/data/configs/llama3-8b.json", 8192), (MISTRAL, 32768)):
        spec = model_spec(config)
        a = spec.attention
        job = Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=2, seq=seq)
        layer = layer_counts(spec, layer_kinds(spec)[0], seq)
        matmuls = (layer.f - layer.attention_f) / (2 * seq)
        window = spec.window if spec.window_layers else 0
        attended = attended_fraction(seq, window) * seq * 2 * a.heads * (a.qk_dim + a.v_dim)
        per_token = 6 * (spec.layers * matmuls + spec.hidden * spec.vocab) + 3 * spec.layers * attended
        assert Estimator(job).model_flops / (2 * seq) == pytest.approx(per_token, rel=1e-12)


def test_a_window_makes_long_sequences_faster_in_the_plan():
    short = plan_cluster(MISTRAL, "h100", gpus=8, global_batch=8, seq=4096, layout="tp=1,pp=1,cp=1,mbs=1")
    whole = dict(MISTRAL, sliding_window=None)
    assert short.best.step_time == plan_cluster(whole, "h100", gpus=8, global_batch=8, seq=4096,
                                                layout="tp=1,pp=1,cp=1,mbs=1").best.step_time
    long_window = plan_cluster(MISTRAL, "h100", gpus=8, global_batch=8, seq=32768, layout="tp=2,cp=1")
    long_whole = plan_cluster(whole, "h100", gpus=8, global_batch=8, seq=32768, layout="tp=2,cp=1")
    assert long_window.best.step_time < long_whole.best.step_time


def test_the_command_says_which_layers_are_windowed(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(MISTRAL, num_hidden_layers=8)))
    argv = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "8", "--global-batch", "8", "--seq", "8192"]
    assert main(argv) == 0
    assert "sliding window 4,096 tokens on 8 of 8 layers" in capsys.readouterr().out.splitlines()[0]
    assert main([*argv, "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["sliding_window"], model["sliding_window_layers"]) == (4096, list(range(8)))
    argv[-1] = "4096"  # a window no shorter than the sequence: said to change nothing
    assert main(argv) == 0
    assert ("4,096 tokens on 8 of 8 layers (no shorter than the 4,096-token sequence: full attention there)"
            in capsys.readouterr().out.splitlines()[0])


def test_the_command_says_which_dropouts_the_config_trains_with(tmp_path, capsys):
    """GPT-2's resid_pdrop and embd_pdrop (transformers' defaults, 0.1): named in the header and in --json, and
    their masks in the memory: more activation memory than the same config without dropout."""
    gpt2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 1000, "n_positions": 1024}
    path, plain = tmp_path / "config.json", tmp_path / "plain.json"
    path.write_text(json.dumps(gpt2))
    plain.write_text(json.dumps(dict(gpt2, resid_pdrop=0.0, embd_pdrop=0.0)))
    argv = ["--hardware", "h100", "--gpus", "8", "--global-batch", "8", "--seq", "1024", "--layout",
            "tp=1,pp=1,cp=1,mbs=1,recompute=none"]
    assert main(["plan", "--model", str(path), *argv]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith(", 2 residual dropouts per layer and an embedding dropout (the config's: their masks kept)")
    assert main(["plan", "--model", str(plain), *argv]) == 0
    assert "dropout" not in capsys.readouterr().out.splitlines()[0]
    found = []
    for config in (path, plain):
        assert main(["plan", "--model", str(config), *argv, "--json"]) == 0
        found.append(json.loads(capsys.readouterr().out))
    assert (found[0]["model"]["residual_dropouts"], found[0]["model"]["embedding_dropout"]) == (2, True)
    assert (found[1]["model"]["residual_dropouts"], found[1]["model"]["embedding_dropout"]) == (0, False)
    kept = [one["best"]["memory_per_gpu"]["activations"] for one in found]
    assert kept[0] - kept[1] == 1024 * 256 * (2 * 4 + 1)  # a byte per element of h: 2 per layer, 1 in the embedding
