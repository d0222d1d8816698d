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
its weight (h elements per norm, per q/k norm its head dims; Gemma's also keeps the ``1 + weight`` it computes
per call, per layer not per token), and the gated MLP keeps act(gate) * up, the
down projection's input, apart from act(gate) (I elements; a fused SwiGLU recomputes it). LayerNorm (GPT-NeoX,
StarCoder2) is one kernel in eager PyTorch too, and a GELU MLP keeps the same as a fused one. Where rotary
embeddings go through ``torch.cat`` (Phi-3, GLM-4.5 and GPT-NeoX: partial rotary), q is contiguous per head, so
sdpa's output is too and the copy into the output projection's layout is a second tensor (h elements, without
the core's recomputation).

MoE layers (Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5) run transformers' eager experts (a loop over the experts hit).
Which expert a token picks depends on the data, but each token picks top_k distinct experts, so the copies
add up to exactly tokens x top_k and the per-layer totals are exact. Eager keeps per routed copy, beyond the
model's, act(gate) * up (I), the weighted output that ``index_add_`` keeps as its source (h), and a second
int64 (``nonzero`` gives the token and its top-k slot); per token, its router's own extras (:func:`_router_extra`;
GLM-4.5's router is DeepSeek-V3's). Only what the graph still holds once the forward is done counts: a branch
nothing reads afterwards (a top-k whose values are dropped) frees what it saved, and its addresses go to later
tensors.
gpt-oss's clamped SwiGLU (``(clamp(up) + 1) * clamp(gate) * sigmoid(alpha * clamp(gate))``) keeps three more
I-wide tensors per copy in eager code (the clamped gate, the sigmoid, ``clamp(up) + 1``), and its eager attention
with sinks keeps the probabilities with the sink column (s + 1 per query and head) and the int64 argmax of the
max it subtracts first.
DeepSeek-V3's MLA (q and kv latents of different head dims) and Gemma 2 (no sdpa path) run eager attention,
which keeps the s x s softmax probabilities where flash attention keeps one log-sum-exp per head, and K and V
repeated to every query head under grouped-query attention (Gemma 2) where flash attention keeps them once; MLA's
kv latent's norm takes a slice of the kv down-projection's output, whose storage (with the rope part) autograd
keeps whole; and with the core checkpointed, v is a view of the kv up-projection's output, so the checkpoint
keeps that whole storage (k's no-rope part too).
"""

from __future__ import annotations

import weakref

import pytest
from tests.plan.cluster.tiny import tiny_config

from pipeloom.plan.cluster import layer_counts, model_spec
from pipeloom.plan.cluster.runtime_plan import LAYER_PREFIX

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BATCH, SEQ, WIDTH = 2, 16, 4
FAMILIES = {"llama": "sdpa", "mistral": "sdpa", "qwen2": "sdpa", "qwen3": "sdpa", "gemma": "sdpa",
            "gemma2": "eager", "gemma3_text": "sdpa", "granite": "sdpa", "phi3": "sdpa", "olmo2": "sdpa",
            "olmo3": "sdpa", "starcoder2": "sdpa", "gpt_neox": "sdpa"}  # the attention each runs (Gemma 2 has
# no sdpa path); GPT-2 is left out: its eager GELU ("gelu_new", written out op by op) and fused c_attn split keep
# several more copies than any kernel a framework would train it with
# Gemma 2 / 3 with every layer global: a sliding-window mask makes CPU sdpa keep its scores (not flash-like);
# the window changes no kept tensor of a flash kernel
_GLOBAL = {"gemma2": ["full_attention"] * 2, "gemma3_text": ["full_attention"] * 2, "olmo3": ["full_attention"] * 2}
MOE_FAMILIES = {"qwen3_moe": "sdpa", "mixtral": "sdpa", "deepseek_v3": "eager", "glm4_moe": "sdpa",
                "gpt_oss": "eager"}  # the attention each runs (gpt-oss's sinks: no sdpa path)
_STAT, _INDEX = 4, 8  # bytes of an fp32 statistic, of an int64 index
_ROTARY_CAT = ("phi3", "glm4_moe", "gpt_neox")  # rotary through torch.cat: q contiguous per head, and so sdpa's output


def _checkpointed(family, attention):
    """An attention function: transformers' sdpa (or the family's eager) one inside a reentrant checkpoint (the
    core recomputed)."""
    from importlib import import_module

    from torch.utils.checkpoint import checkpoint
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    forward = (sdpa_attention_forward if attention == "sdpa" else
               import_module(f"transformers.models.{family}.modeling_{family}").eager_attention_forward)

    def wrapped(module, query, key, value, attention_mask, **kwargs):
        def core(q, k, v):
            return forward(module, q, k, v, attention_mask, **kwargs)[0]
        return checkpoint(core, query, key, value, use_reentrant=True), None

    name = f"pipeloom_selective_{family}_{attention}"
    transformers.AttentionInterface.register(name, wrapped)
    return name


def _saved_per_layer(family, mode, attention="sdpa", **overrides):
    """Bytes of unique non-parameter storages each decoder layer saves, shared ones left out."""
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    if family in _GLOBAL:
        config.layer_types = _GLOBAL[family]
    torch.manual_seed(0)
    impl = _checkpointed(family, attention) if mode == "selective" else attention
    experts = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl, **experts)
    if mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    current = [None]
    packed: list[tuple[int | None, weakref.ref]] = []

    def pack(tensor):  # counted once the forward is done, among the tensors the graph still holds: a graph branch
        packed.append((current[0], weakref.ref(tensor)))  # nothing reads (a top-k's unused values) frees what it
        return tensor  # saved, and its addresses go to later tensors

    for n, layer in enumerate(model.get_submodule(LAYER_PREFIX.get(family, "model.layers"))):
        layer.register_forward_pre_hook(lambda module, args, n=n: current.__setitem__(0, n))
        layer.register_forward_hook(lambda module, args, out: current.__setitem__(0, None))
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    x = model.get_input_embeddings()(ids).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(inputs_embeds=x, labels=ids)  # the graph, and what it saved, alive while counted
    saved: dict[int | None, dict[int, int]] = {}
    for n, ref in packed:
        tensor = ref()
        if tensor is not None and tensor.untyped_storage().data_ptr() not in fixed:
            storage = tensor.untyped_storage()
            saved.setdefault(n, {})[storage.data_ptr()] = storage.nbytes()
    del output
    layers = [saved.get(n, {}) for n in range(config.num_hidden_layers)]
    shared = {key for n, one in enumerate(layers) for m, other in enumerate(layers) if m != n for key in one
              if key in other}
    return config, [sum(size for key, size in one.items() if key not in shared) for one in layers]


def _eager_extra(spec, mode, kind="dense", config=None, attention="sdpa"):
    """Bytes per token transformers' eager layer keeps beyond the fused kernels' (see the module doc)."""
    if mode == "full":
        return 0
    a = spec.attention
    norms = (0 if spec.layer_norm else spec.layer_norms * spec.hidden) + ((a.heads + a.kv_heads) * a.qk_dim
                                                                         if a.qk_norm else 0)
    extra = 0
    if spec.family in _ROTARY_CAT and mode == "none":  # the attention output copied out of q's layout
        extra += WIDTH * a.heads * a.v_dim
    if a.latent:  # the latents' normalised inputs; the kv down-projection's rope part, in the kept storage
        norms += a.q_rank + a.kv_rank
        extra += WIDTH * a.rope_dim
    if attention == "eager" and mode == "none":  # s x s probabilities instead of the log-sum-exp; grouped K, V
        # repeated to every query head (repeat_kv), the matmuls keeping the copies instead of K and V
        extra += WIDTH * a.heads * SEQ - _STAT * a.heads + WIDTH * (a.heads - a.kv_heads) * (a.qk_dim + a.v_dim)
        if a.sinks:  # the probabilities' sink column, and the int64 argmax of the logits' max subtracted first
            extra += (WIDTH + _INDEX) * a.heads
    if a.latent and mode == "selective":  # the checkpoint's v: a view of the kv up-projection's output (+ k's)
        extra += WIDTH * a.heads * (a.qk_dim - a.rope_dim)
    if kind == "dense":
        return extra + WIDTH * (norms + (spec.intermediate if spec.gated else 0))
    ex = spec.experts
    routed = ex.top_k * (WIDTH * (ex.intermediate + spec.hidden) + _INDEX)
    if config.model_type == "gpt_oss":  # the clamped SwiGLU's clamped gate, clamped up + 1 and sigmoid, per copy
        routed += ex.top_k * WIDTH * 3 * ex.intermediate
    return extra + WIDTH * (norms + ex.shared_intermediate) + routed + _router_extra(config)


def _router_extra(config):
    """Bytes per token a router of transformers keeps beyond the probabilities and the top-k indices: the top-k
    values and their sum where it renormalises them (Mixtral always). DeepSeek-V3's and GLM-4.5's group-limited
    choice saves its top-2 indices within each group, the chosen groups and the experts' mask while it runs, but
    nothing reads that branch's values afterwards, so the graph frees them with it: not kept."""
    k = config.num_experts_per_tok
    return _STAT * (k + 1) if config.model_type == "mixtral" or getattr(config, "norm_topk_prob", False) else 0


def _gemma_scales(spec, mode):
    """Bytes per layer (not per token) Gemma's eager RMSNorm keeps: each call computes ``1 + weight`` anew and the
    product with it keeps that tensor, over h (over the head dim for Gemma 3's q and k norms)."""
    if mode == "full" or not spec.family.startswith("gemma"):
        return 0
    a = spec.attention
    return WIDTH * (spec.layer_norms * spec.hidden + (2 * a.qk_dim if a.qk_norm else 0))


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_activation_bytes_equal_saved_tensors(family, mode):
    config, per_layer = _saved_per_layer(family, mode, FAMILIES[family])
    spec = model_spec(config)
    keep = layer_counts(spec, "dense", SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
    expected = BATCH * SEQ * (keep + _eager_extra(spec, mode, attention=FAMILIES[family])) + _gemma_scales(spec, mode)
    assert per_layer == [expected] * spec.layers


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_gpt_neox_sequential_residual_keeps_the_mlp_norm_input(mode):
    config, per_layer = _saved_per_layer("gpt_neox", mode, use_parallel_residual=False)
    spec = model_spec(config)
    parallel = model_spec(dict(config.to_dict(), use_parallel_residual=True))
    keep, shared = (layer_counts(s, "dense", SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
                    for s in (spec, parallel))
    assert not spec.parallel_residual and keep == shared + WIDTH * spec.hidden
    assert per_layer == [BATCH * SEQ * (keep + _eager_extra(spec, mode))] * spec.layers


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_and_mla_activation_bytes_equal_saved_tensors(family, mode):
    attention = MOE_FAMILIES[family]
    config, per_layer = _saved_per_layer(family, mode, attention)
    spec = model_spec(config)
    expected = []
    for n in range(spec.layers):
        kind = "moe" if n in spec.moe_layers else "dense"
        keep = layer_counts(spec, kind, SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
        expected.append(BATCH * SEQ * (keep + _eager_extra(spec, mode, kind, config, attention)))
    assert spec.moe_layers and per_layer == expected


def test_modes_are_ordered_and_divided():
    spec = model_spec(tiny_config("llama"))
    acts = layer_counts(spec, "dense", 4096).activations
    none, selective, full = (acts[m].per_gpu(tp=1, cp=1, sp=False) for m in ("none", "selective", "full"))
    assert none > selective > full == 2 * spec.hidden
    one = acts["none"]
    assert one.per_gpu(tp=4, cp=1, sp=True) == pytest.approx(none / 4)
    assert one.per_gpu(tp=4, cp=2, sp=False) == pytest.approx((one.sequence + one.tensor / 4) / 2)
