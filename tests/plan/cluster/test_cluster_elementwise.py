"""The memory-bound kernels of a layer (:mod:`pipeloom.plan.cluster.elementwise`) against hand counts of the
bytes each kernel reads and writes, and their place in the layer times."""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.plan.cluster.elementwise import layer_elementwise
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.errors import LayoutError

# h 64, 4 heads of 16 (2 kv heads), intermediate 160: small round numbers for the hand counts
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 100}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 128,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0}


def test_fused_llama_layer_equals_hand_count():
    e = layer_elementwise(model_spec(LLAMA), "dense")
    h, i, qk = 64, 160, (4 + 2) * 16
    # forward: 2 norms (read h, write h), 2 residual adds (read 2h, write h), rotary (read+write q and k),
    # SwiGLU (read gate and up, write one): bf16
    assert e.f_bytes == 2 * (2 * 2 * h + 2 * 3 * h + 2 * qk + 3 * i)
    # backward: norms read x and dy and write dx; adds sum two gradients; rotary as forward; SwiGLU 5I
    assert e.b_bytes == 2 * (2 * 3 * h + 2 * 3 * h + 2 * qk + 5 * i)
    assert (e.f_kernels, e.b_kernels) == (6, 6)


def test_eager_llama_layer_equals_hand_count():
    e = layer_elementwise(model_spec(LLAMA), "dense", kernels="eager")
    h, i, qk = 64, 160, (4 + 2) * 16
    norms = 2 * (6 + 8 + 4 + 8 + 6 + 4) * h  # float, pow, mean, mul rsqrt, type_as, mul weight
    adds = 2 * 3 * 2 * h
    rotary = (6 + 8 + 6) * qk  # float, complex mul, type_as
    repeat_kv = 2 * (2 + 4) * (16 + 16)  # read 2 kv heads of k and v, write 4 heads' worth
    out = 2 * 2 * 4 * 16  # transpose().contiguous() of the attention output
    swiglu = (4 + 6) * i  # silu, then * up
    assert e.f_bytes == norms + adds + rotary + repeat_kv + out + swiglu
    assert e.b_bytes == 2 * e.f_bytes
    assert e.f_kernels == 2 * 6 + 2 + 2 * 3 + 2 + 1 + 2
    assert e.b_kernels == 2 * e.f_kernels


def test_gpt2_learned_positions_and_layer_norm():
    spec = model_spec(GPT2)
    h, i = 64, 256
    fused = layer_elementwise(spec, "dense")
    assert fused.f_bytes == 2 * (2 * 2 * h + 2 * 3 * h + 2 * i)  # no rotary; GELU reads I, writes I
    assert fused.b_bytes == 2 * (2 * 3 * h + 2 * 3 * h + 3 * i)
    eager = layer_elementwise(spec, "dense", kernels="eager")
    # LayerNorm is one kernel even in eager PyTorch; no repeat_kv (multi-head attention)
    assert eager.f_bytes == 2 * 2 * 2 * h + 2 * 3 * 2 * h + 2 * 2 * 4 * 16 + 4 * i


def test_residual_dropouts_write_and_read_their_masks():
    """GPT-2's resid_pdrop (transformers' default 0.1) on both branches: fused into the residual adds, a one-byte
    mask per element written forward and read backward; eager, a kernel each way reading and writing h and the
    mask; divided by tp under sequence parallelism, as the residual stream."""
    plain, dropped = model_spec(GPT2), model_spec({**GPT2, "resid_pdrop": 0.1})
    assert (plain.residual_dropouts, dropped.residual_dropouts) == (0, 2)
    h = 64
    for tp, sp in ((1, False), (2, True)):
        base, more = (layer_elementwise(spec, "dense", tp=tp, sp=sp) for spec in (plain, dropped))
        assert more.f_bytes - base.f_bytes == pytest.approx(2 * h / tp)
        assert more.b_bytes - base.b_bytes == pytest.approx(2 * h / tp)
        assert (more.f_kernels, more.b_kernels) == (base.f_kernels, base.b_kernels)
        base, more = (layer_elementwise(spec, "dense", tp=tp, sp=sp, kernels="eager") for spec in (plain, dropped))
        assert more.f_bytes - base.f_bytes == pytest.approx(2 * (2 + 2 + 1) * h / tp)
        assert more.b_bytes - base.b_bytes == pytest.approx(2 * (2 + 2 + 1) * h / tp)
        assert (more.f_kernels - base.f_kernels, more.b_kernels - base.b_kernels) == (2, 2)


def test_phimoe_input_jitter_is_two_passes_over_the_moe_input():
    """Its two noise draws and in-place products: fused 3 elements of h each way per draw, a kernel each; eager
    uniform_ and mul_ (4 forward, 3 backward, 2 + 1 kernels each); dense layers and no jitter: nothing."""
    phimoe = {"model_type": "phimoe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100, "num_local_experts": 4}
    plain, jittered = model_spec(phimoe), model_spec({**phimoe, "input_jitter_noise": 0.01})
    h = 64
    base, more = (layer_elementwise(spec, "moe") for spec in (plain, jittered))
    assert (more.f_bytes - base.f_bytes, more.b_bytes - base.b_bytes) == (2 * 2 * 3 * h, 2 * 2 * 3 * h)
    assert (more.f_kernels - base.f_kernels, more.b_kernels - base.b_kernels) == (2, 2)
    base, more = (layer_elementwise(spec, "moe", kernels="eager") for spec in (plain, jittered))
    assert (more.f_bytes - base.f_bytes, more.b_bytes - base.b_bytes) == (2 * 2 * 4 * h, 2 * 2 * 3 * h)
    assert (more.f_kernels - base.f_kernels, more.b_kernels - base.b_kernels) == (4, 2)
    sp = [layer_elementwise(spec, "moe", tp=2, sp=True) for spec in (plain, jittered)]
    assert sp[1].f_bytes - sp[0].f_bytes == pytest.approx(2 * 2 * 3 * h / 2)


def test_an_embedding_dropout_is_priced_in_the_embedding():
    """Its hidden state read and written and its mask written forward, the reverse backward (the embedding's
    backward is all weight gradient)."""
    hw = hardware("h100")
    layout = Layout(dp=1, tp=1, pp=1, mbs=1, recompute="none", schedule="1f1b")
    plain, dropped = (Job(spec=model_spec({**GPT2, "embd_pdrop": rate}), hw=hw, gpus=1, global_batch=8, seq=128)
                      for rate in (0.0, 0.1))
    base, more = (layer_times(job, layout, "embedding") for job in (plain, dropped))
    assert more.f > base.f and more.w > base.w and more.i == base.i == 0.0
    assert more.f - base.f == pytest.approx(more.w - base.w)


@pytest.mark.parametrize(("kernels", "forward", "backward", "kernels_each_way"),
                         [("fused", 2, 3, 1), ("eager", 6, 7, 3)])
def test_the_logits_softcap_is_priced_in_the_head(kernels, forward, backward, kernels_each_way):
    """Gemma 2's softcap over the logits (vocab split by tp): divide, tanh, multiply each reading and writing them
    (fused: once); backward their gradients and the tanh's kept output, 2 of whose passes the head's kept bytes price
    already."""
    gemma = {"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 160, "vocab_size": 1000}
    hw = hardware("h100")
    layout = Layout(dp=1, tp=2, pp=1, mbs=2, recompute="none", schedule="1f1b")
    plain, capped = (Job(spec=model_spec({**gemma, "final_logit_softcapping": cap}), hw=hw, gpus=2, global_batch=4,
                         seq=512, kernels=kernels) for cap in (None, 30.0))
    base, more = (layer_times(job, layout, "head") for job in (plain, capped))
    logits = 2 * 512 * 1000 / 2 * 2  # tokens x vocab / tp, bf16
    rate = hw.memory_bandwidth * hw.memory_efficiency
    overhead = kernels_each_way * hw.kernel_overhead
    kept = 2 * logits / rate  # the tanh's output, priced with the head's other kept bytes
    assert more.f - base.f == pytest.approx(forward * logits / rate + overhead)
    assert more.i - base.i == pytest.approx(backward * logits / rate + overhead - 2 * logits / rate + kept)
    assert more.w == base.w
    added = dict(more.parts)["elementwise"] - dict(base.parts)["elementwise"]
    assert added == pytest.approx(more.f + more.i - base.f - base.i)


def test_sequence_parallel_divides_only_the_residual_stream():
    spec = model_spec(LLAMA)
    one = layer_elementwise(spec, "dense")
    tp = layer_elementwise(spec, "dense", tp=2)
    sp = layer_elementwise(spec, "dense", tp=2, sp=True)
    h = 64
    seq_part = 2 * (2 * 2 * h + 2 * 3 * h)
    assert tp.f_bytes == pytest.approx(seq_part + (one.f_bytes - seq_part) / 2)
    assert sp.f_bytes == pytest.approx(one.f_bytes / 2)


def test_moe_layer_counts_top_k_experts_and_permutes():
    spec = model_spec({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "intermediate_size": 160, "num_local_experts": 8,
                       "num_experts_per_tok": 2, "vocab_size": 100})
    e = layer_elementwise(spec, "moe")
    h, i, qk = 64, 2 * 160, (4 + 2) * 16
    route = 2 * (1 + 2) * h
    assert e.f_bytes == 2 * (2 * 2 * h + 2 * 3 * h + 2 * qk + 3 * i + route)


def test_bad_kernels_named():
    with pytest.raises(LayoutError, match="eager"):
        layer_elementwise(model_spec(LLAMA), "dense", kernels="compiled")


def test_eager_layer_is_slower_in_both_passes():
    spec = model_spec(LLAMA)
    job = Job(spec=spec, hw=hardware("h100"), gpus=8, global_batch=8, seq=4096)
    layout = Layout(dp=8, tp=1, pp=1, vp=1, cp=1, ep=1, mbs=1, fsdp=False, recompute="none", schedule="1f1b")
    fused = layer_times(job, layout, "dense")
    eager = layer_times(dataclasses.replace(job, kernels="eager"), layout, "dense")
    assert eager.f > fused.f and eager.i > fused.i and eager.w == fused.w
