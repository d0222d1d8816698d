"""Activation bytes per recomputation mode against the tensors autograd saves, on tiny instances on CPU.

What is compared: every tensor autograd saves during the forward is seen through
``torch.autograd.graph.saved_tensors_hooks`` and attributed to the decoder layer running at the time; per
layer we add up the bytes of the unique storages it saves that are not parameters and not shared with another
layer (the rotary cos/sin tables, computed once per model). sdpa attention on CPU is flash-like (it keeps q, k,
v, the output and the log-sum-exp, no s x s scores), in float32. Modes: none (plain); selective: the attention
function wrapped in a (reentrant) checkpoint, so autograd sees what the checkpoint keeps; full: every layer
checkpointed (``gradient_checkpointing_enable`` with ``use_reentrant=True``).

The model counts fused kernels (Megatron with Transformer Engine); transformers' eager PyTorch keeps exactly
two things more, which the expected value adds: each RMSNorm keeps its normalised input before the scale by
its weight (h elements per norm, per q/k norm its head dims), and the gated MLP keeps act(gate) * up, the
down projection's input, apart from act(gate) (I elements; a fused SwiGLU recomputes it).
"""

from __future__ import annotations

import pytest
from tests.plan.cluster.tiny import tiny_config

from pipeloom.plan.cluster import layer_counts, model_spec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BATCH, SEQ, WIDTH = 2, 16, 4
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _checkpointed_sdpa():
    """An attention function: transformers' sdpa one inside a reentrant checkpoint (the core recomputed)."""
    from torch.utils.checkpoint import checkpoint
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        def core(q, k, v):
            return sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)[0]
        return checkpoint(core, query, key, value, use_reentrant=True), None

    transformers.AttentionInterface.register("pipeloom_selective", attention)
    return "pipeloom_selective"


def _saved_per_layer(family, mode):
    """Bytes of unique non-parameter storages each decoder layer saves, shared ones left out."""
    config = tiny_config(family)
    torch.manual_seed(0)
    impl = _checkpointed_sdpa() if mode == "selective" else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    if mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    current = [None]
    saved: dict[int | None, dict[int, int]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in fixed:
            saved.setdefault(current[0], {})[storage.data_ptr()] = storage.nbytes()
        return tensor

    for n, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda module, args, n=n: current.__setitem__(0, n))
        layer.register_forward_hook(lambda module, args, out: current.__setitem__(0, None))
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    x = model.get_input_embeddings()(ids).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs_embeds=x, labels=ids)
    layers = [saved.get(n, {}) for n in range(config.num_hidden_layers)]
    shared = {key for n, one in enumerate(layers) for m, other in enumerate(layers) if m != n for key in one
              if key in other}
    return config, [sum(size for key, size in one.items() if key not in shared) for one in layers]


def _eager_extra(spec, mode):
    """Bytes per token transformers' eager layer keeps beyond the fused kernels' (see the module doc)."""
    if mode == "full":
        return 0
    a = spec.attention
    norms = 2 * spec.hidden + ((a.heads + a.kv_heads) * a.qk_dim if a.qk_norm else 0)
    return WIDTH * (norms + spec.intermediate)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_bytes_equal_saved_tensors(family, mode):
    config, per_layer = _saved_per_layer(family, mode)
    spec = model_spec(config)
    keep = layer_counts(spec, "dense", SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
    expected = BATCH * SEQ * (keep + _eager_extra(spec, mode))
    assert per_layer == [expected] * spec.layers


def test_modes_are_ordered_and_divided():
    spec = model_spec(tiny_config("llama"))
    acts = layer_counts(spec, "dense", 4096).activations
    none, selective, full = (acts[m].per_gpu(tp=1, cp=1, sp=False) for m in ("none", "selective", "full"))
    assert none > selective > full == 2 * spec.hidden
    one = acts["none"]
    assert one.per_gpu(tp=4, cp=1, sp=True) == pytest.approx(none / 4)
    assert one.per_gpu(tp=4, cp=2, sp=False) == pytest.approx((one.sequence + one.tensor / 4) / 2)
