"""DeepSeek's sparse attention (DeepSeek-V3.2, GLM-5) in the cluster planner: which layers run an indexer, what
the indexer adds to a layer's counts and price, the top-k attention's band, GLM-5's shared layers, and what the
command says. Parameters, FLOPs and saved tensors against transformers are in test_params, test_flops and
test_activations (their tiny instances)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tests.plan.cluster.tiny import TINY

from pipeloom.cli import main
from pipeloom.plan.cluster import model_spec
from pipeloom.plan.cluster.counts import attended_fraction, layer_counts
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.kinds import layer_kinds
from pipeloom.plan.cluster.placement import stage_send_seconds

# DeepSeek-V3.2-Exp's attention and indexer (its config.json), 4 layers: one dense, three MoE of 16 experts
V32 = dict(model_type="deepseek_v32", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
           num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
           q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
           n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1, vocab_size=129280, index_topk=2048,
           index_head_dim=128, index_n_heads=64)
LAYOUT = Layout(dp=8, mbs=1, recompute="none", schedule="1f1b")


def _dense(spec):
    """``spec`` with dense attention: no indexer, every layer attending to its whole causal prefix."""
    return dataclasses.replace(spec, indexer=None, indexer_layers=())


@pytest.mark.parametrize("fields", [{}, {"index_topk_pattern": "FSSFSF"}, {"index_topk_pattern": ["full"] * 6},
                                    {"index_topk_freq": 3}, {"index_topk_freq": 2, "index_skip_topk_offset": 4},
                                    {"indexer_types": ["full", "full", "shared", "full", "shared", "shared"]}])
def test_indexer_layers_are_transformers_own(fields):
    """GLM-5's layers that run an indexer: those transformers' config marks ``"full"`` (from ``indexer_types``, its
    ``index_topk_pattern`` or its frequency and offset), read from the config object and from a bare config.json."""
    transformers = pytest.importorskip("transformers")
    kwargs = dict(TINY["glm_moe_dsa"], num_hidden_layers=6, **fields)
    if "indexer_types" not in fields:
        del kwargs["indexer_types"]
    config = transformers.AutoConfig.for_model("glm_moe_dsa", **kwargs)
    full = tuple(n for n, kind in enumerate(config.indexer_types) if kind == "full")
    assert model_spec(config).indexer_layers == full
    assert model_spec(dict(kwargs, model_type="glm_moe_dsa")).indexer_layers == full
    v32 = dict(TINY["deepseek_v32"], model_type="deepseek_v32", num_hidden_layers=6)
    assert model_spec(v32).indexer_layers == tuple(range(6))  # DeepSeek-V3.2: every layer its own


def test_the_indexer_adds_its_weights_forward_and_choice():
    """A layer with an indexer: its weights (``wq_b``, ``wk``, ``weights_proj`` and the key's LayerNorm), its
    forward's projections and scores over the full square (none of it in I or W), and the int32 top-k it keeps
    except under full recomputation; a GLM-5 layer that reuses the choice adds none of that. Both attend to the
    top-k band and run their core in MLA's MQA mode (DeepSeek-V3.2 report sec. 2.1), which keeps the absorbed
    queries, the latent output, the no-rope queries and the output per head, and the one latent key with its rope
    part."""
    spec = model_spec(V32)
    seq, ix, h, a = 4096, spec.indexer, spec.hidden, spec.attention
    assert layer_kinds(spec) == ("dense-sparse",) + ("moe-sparse",) * 3
    sparse, dense = layer_counts(spec, "moe-sparse", seq), layer_counts(_dense(spec), "moe", seq)
    weights = a.q_rank * ix.heads * ix.dim + h * ix.dim + h * ix.heads
    assert sparse.params - dense.params == weights + 2 * ix.dim
    assert sparse.f - dense.f == 2 * seq * weights + 2 * seq * seq * ix.heads * (ix.dim + 1)
    assert (sparse.i, sparse.w, sparse.attention_f) == (dense.i, dense.w, dense.attention_f)
    # the model FLOPs count MLA's per-head products over the top-k band (the MQA mode's are priced, not counted)
    assert sparse.attended_f == dense.attention_f * attended_fraction(seq, ix.topk) < dense.attended_f
    kept = 2 * a.heads * ((a.kv_rank + a.rope_dim) + a.kv_rank + (a.qk_dim - a.rope_dim) + a.v_dim)
    transformers_kept = 2 * a.heads * (2 * a.qk_dim + 2 * a.v_dim)  # q, k, v, the output
    for mode in ("none", "selective"):
        got, base = sparse.activations[mode], dense.activations[mode]
        assert got.tensor - base.tensor == kept - transformers_kept
        assert got.replicated - base.replicated == 4 * ix.topk + 2 * a.rope_dim
    assert sparse.activations["full"] == dense.activations["full"]
    reused = layer_counts(spec, "moe-reused", seq)
    assert (reused.params, reused.f, reused.attended_f) == (dense.params, dense.f, sparse.attended_f)
    assert reused.activations["none"].replicated == sparse.activations["none"].replicated - 4 * ix.topk


def test_sparse_layers_cost_more_at_short_sequences_and_less_at_long_ones():
    """Up to ``index_topk`` tokens the top-k attention reads every earlier key, in the MQA mode's wider heads, so a
    sparse layer costs more than the dense one both ways, its indexer on top; far beyond it the band it attends to
    is a fraction of the triangle and the layer is faster, the indexer's scores included, and so are its model
    FLOPs. A layer reusing the choice runs no indexer."""
    spec = model_spec(V32)
    for seq, faster in ((2048, False), (32768, True)):
        job = Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=8, seq=seq)
        plain = dataclasses.replace(job, spec=_dense(spec))
        sparse, dense = layer_times(job, LAYOUT, "moe-sparse"), layer_times(plain, LAYOUT, "moe")
        assert (sparse.f + sparse.i < dense.f + dense.i) is faster
        if not faster:
            assert sparse.f > dense.f and sparse.i > dense.i
        reused = layer_times(job, LAYOUT, "moe-reused")
        assert reused.f < sparse.f and reused.i == sparse.i
    long = Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=8, seq=32768)
    assert Estimator(long).model_flops < Estimator(dataclasses.replace(long, spec=_dense(spec))).model_flops


def test_context_parallelism_gathers_the_latent_keys():
    """Under cp a sparse layer gathers the whole sequence's latent and indexer keys (``kv_rank + rope + dim`` a
    token) before its kernels and reduce-scatters the latent keys' gradients, where a dense MLA layer passes every
    head's keys and values around a ring: the sparse layer's exchange is priced on the gather, the same in every
    rotation."""
    spec = model_spec(V32)
    job = Job(spec=spec, hw=hardware("h100"), gpus=16, global_batch=16, seq=32768)
    one, two = (Layout(dp=16 // cp, cp=cp, mbs=1, recompute="none", schedule="1f1b") for cp in (1, 2))
    whole, shard = layer_times(job, one, "moe-reused"), layer_times(job, two, "moe-reused")
    allgather = dataclasses.replace(job, cp_rotate="allgather")
    assert layer_times(allgather, two, "moe-reused") == shard
    assert shard.f < whole.f and shard.i < whole.i
    assert layer_times(dataclasses.replace(job, spec=_dense(spec)), two, "moe") != \
        layer_times(dataclasses.replace(allgather, spec=_dense(spec)), two, "moe")


def test_shared_layers_send_their_choice_between_stages():
    """Where a layer reuses an earlier layer's choice (GLM-5), a stage's send carries the int32 top-k beside the
    hidden state: 4 x topk bytes a token, against 2 x hidden."""
    glm = dict(V32, model_type="glm_moe_dsa", indexer_types=["full", "shared", "full", "shared"])
    spec, every = model_spec(glm), model_spec(dict(glm, indexer_types=["full"] * 4))
    assert layer_kinds(spec) == ("dense-sparse", "moe-reused", "moe-sparse", "moe-reused")
    layout = Layout(dp=2, pp=4, mbs=1, recompute="none", schedule="1f1b")
    sends = [stage_send_seconds(Job(spec=s, hw=hardware("h100"), gpus=8, global_batch=8, seq=8192), layout)
             for s in (spec, every)]
    assert sends[0] > sends[1]


def test_the_command_says_which_layers_run_an_indexer(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(V32, model_type="glm_moe_dsa", indexer_types=["full", "shared", "full", "shared"])))
    argv = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "16", "--global-batch", "16", "--seq",
            "8192"]
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("sparse attention to the 2,048 keys an indexer (64 heads of 128) picks per query: an "
                           "indexer on 2 of 4 layers, the other 2 reusing the last one's choice")
    assert main([*argv, "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["sparse_attention"] == {"topk": 2048, "index_heads": 64, "index_head_dim": 128,
                                         "indexer_layers": [0, 2]}
    v3 = {key: value for key, value in V32.items() if not key.startswith("index_")}
    path.write_text(json.dumps(dict(v3, model_type="deepseek_v3")))
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["sparse_attention"] is None


def test_the_command_says_how_context_parallelism_exchanges_the_keys(tmp_path, capsys):
    """Under cp the report's assumptions name the latent keys' all-gather, and a --cp-rotate given (which prices
    dense attention's exchange) is noted as changing nothing."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V32))
    argv = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "16", "--global-batch", "16", "--seq",
            "32768", "--layout", "cp=2,tp=1,pp=1"]
    assert main([*argv, "--cp-rotate", "ring"]) == 0
    out = capsys.readouterr().out
    assert "context parallelism by all-gather of the latent keys (DeepSeek's sparse attention)" in out
    assert ("note: --cp-rotate ring does not apply to the chosen layout, which runs DeepSeek's sparse attention, "
            "which all-gathers its latent keys") in out
    assert main(argv) == 0
    assert "note: --cp-rotate" not in capsys.readouterr().out


def test_deepseeks_recomputation_keeps_the_latent_output_and_the_choice():
    """Under DeepSeek-V3's recomputation (``--selective deepseek``) a sparse layer keeps the MQA kernel's latent
    output in E5M6 (``kv_rank`` a head, where DeepSeek-V3's layer keeps its ``v_dim`` output; the output projection's
    input is recomputed from it) and, where it runs an indexer, the top-k indices."""
    from pipeloom.plan.cluster.recompute import deepseek_activations

    spec = model_spec(V32)
    a, dense = spec.attention, deepseek_activations(_dense(spec), "moe")
    sparse, reused = deepseek_activations(spec, "moe-sparse"), deepseek_activations(spec, "moe-reused")
    e5m6 = 1.5  # bytes of DeepSeek-V3's 12-bit activation format
    assert sparse.tensor - dense.tensor == reused.tensor - dense.tensor == e5m6 * a.heads * (a.kv_rank - a.v_dim)
    assert (sparse.replicated, reused.replicated, dense.replicated) == (4 * spec.indexer.topk, 0, 0)
    assert sparse.sequence == dense.sequence
