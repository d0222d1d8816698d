"""Activation bytes per recomputation mode against the tensors autograd saves, on tiny instances on CPU.

What is compared: every tensor autograd saves during the forward is seen through
``torch.autograd.graph.saved_tensors_hooks`` and attributed to the decoder layer running at the time; per
layer we add up the bytes of the unique storages it saves that are not parameters and not shared with another
layer (the rotary cos/sin tables, computed once per model). sdpa attention on CPU is flash-like (it keeps q, k,
v, the output and the log-sum-exp, no s x s scores), in float32. Modes: none (plain); selective: the attention
function wrapped in a (reentrant) checkpoint, so autograd sees what the checkpoint keeps; full: every layer
checkpointed (``gradient_checkpointing_enable`` with ``use_reentrant=True``).

The model counts fused kernels (Megatron with Transformer Engine); transformers' eager PyTorch keeps exactly two
things more, which the expected value adds: each RMSNorm keeps its normalised input before the scale by its weight
(h elements per norm, per q/k norm its head dims; Gemma's also keeps the ``1 + weight`` it computes per call, per
layer not per token), and the gated MLP keeps act(gate) * up, the down projection's input, apart from act(gate) (I
elements; a fused SwiGLU recomputes it). LayerNorm (GPT-NeoX, StarCoder2) is one kernel in eager PyTorch too, and a
GELU MLP keeps the same as a fused one. Cohere's LayerNorm (without a bias; over h, and with ``use_qk_norm`` over
each head) is written out op by op: it keeps x - mean twice (the variance's square and the scaling each compute it)
and the normalised tensor before the weight, with one 1/std, where a fused kernel keeps its input, its mean and its
1/std: per norm over d, 2d elements more and one statistic fewer. ERNIE 4.5's, GLM-4's and Helium's interleaved
rotary embeddings make each layer's cos and sin anew from a half of the model's tables, and their products keep
those copies (half the rotated dimensions each). Ministral 3 scales its queries by position as Mistral 4 does
(:func:`_query_scale`). Arcee's ReLU² MLP keeps what a GELU one keeps (the up-projection's ReLU output, for the
square and for its own gradient, and the square, the down projection's input), and Hunyuan's q/k norms, after its
rotary, the same as Qwen3's before it. Falcon's model hands its attention an explicit (b, 1, s, s) causal mask,
under which transformers' sdpa repeats K and V to every query head: without the core's recomputation the layer keeps
the mask (s elements per token) and the repeated K and V in place of K and V. Cohere 2 and EXAONE 4 run rotary
embeddings on their sliding-window layers only, so their tiny instances have every layer global (no mask, no rotary
tables kept by one layer alone). Where rotary embeddings go through ``torch.cat`` (Phi-3, GLM-4.5, MiniMax-M2 and
GPT-NeoX: partial rotary), q is contiguous per head, so sdpa's output is too and the copy into the output
projection's layout is a second tensor (h elements, without the core's recomputation).

MoE layers (Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5) run transformers' eager experts (a loop over the experts hit).
Which expert a token picks depends on the data, but each token picks top_k distinct experts, so the copies
add up to exactly tokens x top_k and the per-layer totals are exact. Eager keeps per routed copy, beyond the
model's, act(gate) * up (I), the weighted output that ``index_add_`` keeps as its source (h), and a second
int64 (``nonzero`` gives the token and its top-k slot); per token, its router's own extras (:func:`_router_extra`;
GLM-4.5's router is DeepSeek-V3's). Only what the graph still holds once the forward is done counts: a branch
nothing reads afterwards (a top-k whose values are dropped) frees what it saved, and its addresses go to later
tensors.
Llama 4 runs every expert on every token (its tiny instance routes each token to all four, so the copies are the
model's), scaling each copy's input by its score: per copy it keeps, beyond the model's, act(gate) * up (I) and no
int64 place in a permutation; its weightless q/k norms keep no normalised tensor before a weight, and its NoPE
layers keep their queries' temperature per position (:func:`_query_scale`).
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

import dataclasses
import weakref

import pytest
from tests.plan.cluster.tiny import TINY, tiny_config, tiny_model

from pipeloom.plan.cluster import layer_counts, model_spec
from pipeloom.plan.cluster.counts import MASK_BYTES
from pipeloom.plan.cluster.model.kinds import block_kind, is_linear, layer_kinds
from pipeloom.plan.cluster.runtime_plan import LAYER_PREFIX

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BATCH, SEQ, WIDTH = 2, 16, 4
FAMILIES = {"llama": "sdpa", "mistral": "sdpa", "qwen2": "sdpa", "qwen3": "sdpa", "gemma": "sdpa",
            "gemma2": "eager", "gemma3_text": "sdpa", "granite": "sdpa", "phi3": "sdpa", "olmo": "sdpa",
            "olmo2": "sdpa", "olmo3": "sdpa", "smollm3": "sdpa", "starcoder2": "sdpa", "cohere": "sdpa",
            "cohere2": "sdpa", "ernie4_5": "sdpa", "glm4": "sdpa", "seed_oss": "sdpa", "exaone4": "sdpa",
            "falcon": "sdpa", "gpt_neox": "sdpa", "ministral": "sdpa", "ministral3": "sdpa", "helium": "sdpa",
            "arcee": "sdpa", "hunyuan_v1_dense": "sdpa"}  # the attention each
# runs (Gemma 2 has no sdpa path; SmolLM3's tiny instance has rotary on both layers, so that its rotary's cos and
# sin are shared as in the other families: a layer without keeps the same bytes less those); GPT-2 is left out:
# its eager GELU ("gelu_new", written out op by op) and fused c_attn split keep several more copies than any kernel
# a framework would train it with
# Gemma 2 / 3 with every layer global: a sliding-window mask makes CPU sdpa keep its scores (not flash-like);
# the window changes no kept tensor of a flash kernel
_GLOBAL = {"gemma2": ["full_attention"] * 2, "gemma3_text": ["full_attention"] * 2, "olmo3": ["full_attention"] * 2,
           "cohere2": ["full_attention"] * 2, "exaone4": ["full_attention"] * 2,
           "llama4_text": ["full_attention"] * 4}
MOE_FAMILIES = {"qwen3_moe": "sdpa", "mixtral": "sdpa", "olmoe": "sdpa", "deepseek_v3": "eager", "glm4_moe": "sdpa",
                "gpt_oss": "eager", "ernie4_5_moe": "sdpa", "minimax_m2": "sdpa", "dots1": "sdpa",
                "glm4_moe_lite": "eager", "mistral4": "eager", "phimoe": "sdpa",
                "granitemoe": "sdpa", "granitemoeshared": "sdpa", "llama4_text": "sdpa",
                "hunyuan_v1_moe": "sdpa", "deepseek_v32": "eager", "glm_moe_dsa": "eager",
                "qwen2_moe": "sdpa"}  # the attention each
# runs (gpt-oss's sinks, MLA's head dims: no sdpa path)
_SPARSE = ("deepseek_v32", "glm_moe_dsa")  # DeepSeek's sparse attention: transformers keeps none of its indexer's
# work (its forward runs under no_grad, its top-k only masks the scores) and runs MLA as DeepSeek-V3 does, where the
# model counts the sparse kernel's MQA mode and the top-k indices it reads again in the backward
_STAT, _INDEX = 4, 8  # bytes of an fp32 statistic, of an int64 index
_ROTARY_CAT = ("phi3", "glm4", "glm4_moe", "gpt_neox", "minimax_m2", "phi")
_INTERLEAVED_ROTARY = {"ernie4_5": 1.0, "ernie4_5_moe": 1.0, "glm4": 0.5, "helium": 1.0, "gptj": 1.0}  # the share of
# qk_dim rotated (GLM-4's transformers default partial_rotary_factor; GPT-J's cos and sin, each rotary_dim wide: the
# tiny's 8 of 16); _ROTARY_CAT: rotary through torch.cat, so q is contiguous per head, and so is sdpa's output


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
    if family in _SPARSE:  # their indexer reads the causal mask, which transformers builds only for known kernels
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        transformers.AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[attention])
    return name


def _saved_per_layer(family, mode, attention="sdpa", **overrides):
    """Bytes of unique non-parameter storages each decoder layer saves, shared ones left out."""
    config, layers = _saved_storages(family, mode, attention, **overrides)
    return config, [sum(layer.values()) for layer in layers]


def _saved_storages(family, mode, attention="sdpa", prepare=None, outside=None, **overrides):
    """Per decoder layer, the unique non-parameter storages it saves (address: bytes), shared ones left out;
    ``prepare(model)`` changes the model before its forward (``mode`` ``none``); ``outside``, a dict: filled with
    the storages saved outside the decoder layers (the embedding's, the head's and the loss's)."""
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    if family in _GLOBAL:
        config.layer_types = _GLOBAL[family]
    torch.manual_seed(0)
    impl = _checkpointed(family, attention) if mode == "selective" else attention
    experts = {"experts_implementation": "eager"} if family in MOE_FAMILIES or family in _GDN_MOE else {}
    model = tiny_model(config, attn_implementation=impl, **experts)
    if mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if prepare is not None:
        prepare(model)
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
    if outside is not None:
        outside.update(saved.get(None, {}))
    layers = [saved.get(n, {}) for n in range(config.num_hidden_layers)]
    shared = {key for n, one in enumerate(layers) for m, other in enumerate(layers) if m != n for key in one
              if key in other}
    return config, [{key: size for key, size in one.items() if key not in shared} for one in layers]


def _eager_extra(spec, mode, kind="dense", config=None, attention="sdpa"):
    """Bytes per token transformers' eager layer keeps beyond the fused kernels' (see the module doc)."""
    if mode == "full":
        return 0
    a = spec.attention
    extra = 0
    if spec.family in ("cohere", "cohere2"):  # LayerNorm op by op: 2d more per norm over d, one statistic fewer
        per_head = (a.heads + a.kv_heads) if a.qk_norm else 0
        norms = 2 * (spec.layer_norms * spec.hidden + per_head * a.qk_dim)
        extra -= _STAT * (spec.layer_norms + per_head)
    else:
        norms = (0 if spec.layer_norm else spec.layer_norms * spec.hidden) + ((a.heads + a.kv_heads) * a.qk_dim
                                                                             if a.qk_norm and not
                                                                             a.qk_norm_weightless else 0)
    if spec.family in _INTERLEAVED_ROTARY:  # each layer's interleaved cos and sin, made from halves of the model's
        extra += WIDTH * int(a.qk_dim * _INTERLEAVED_ROTARY[spec.family])  # tables: copies the products keep
    if spec.family == "falcon" and mode == "none":  # sdpa under Falcon's explicit (b, 1, s, s) mask: the mask, and
        extra += WIDTH * (SEQ + (a.heads - a.kv_heads) * (a.qk_dim + a.v_dim))  # K and V repeated to every head
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
    return extra + WIDTH * (norms + spec.experts.shared_intermediate) + _routed_extra(spec) + _router_extra(config)


def _routed_extra(spec):
    """Bytes per token transformers' eager experts keep beyond the model's routed copies (see the module doc)."""
    ex = spec.experts
    if spec.family == "llama4_text":  # every expert on every token, the input scaled (no index, no combine)
        return ex.top_k * (WIDTH * ex.intermediate - _INDEX)
    routed = ex.top_k * (WIDTH * (ex.intermediate + spec.hidden) + _INDEX)
    if spec.family == "gpt_oss":  # the clamped SwiGLU's clamped gate, clamped up + 1 and sigmoid, per copy
        routed += ex.top_k * WIDTH * 3 * ex.intermediate
    return routed


def _router_extra(config):
    """Bytes per token a router of transformers keeps beyond the probabilities and the top-k indices: the top-k values
    and their sum where it renormalises them (Mixtral, MiniMax-M2, Hunyuan MoE and Qwen3.5-MoE always; ERNIE 4.5
    also the sum clamped away from zero, the division's denominator). DeepSeek-V3's and GLM-4.5's group-limited choice
    saves its top-2 indices within each group, the chosen groups and the experts' mask while it runs, but nothing
    reads that branch's values afterwards, so the graph frees them with it: not kept. Phi-3.5-MoE's sparsemixer masks
    the scores twice with ``masked_fill``, which keeps its bool mask over the experts each time (its Gumbel draws' and
    its midpoint masks' branches are freed likewise)."""
    k = config.num_experts_per_tok
    if config.model_type == "phimoe":
        return 2 * config.num_local_experts
    if config.model_type == "ernie4_5_moe":
        return _STAT * (k + 2)
    always = ("mixtral", "minimax_m2", "hunyuan_v1_moe", "qwen3_5_moe_text")
    renormalised = config.model_type in always or getattr(config, "norm_topk_prob", False)
    return _STAT * (k + 1) if renormalised else 0


def _gemma_scales(spec, mode):
    """Bytes per layer (not per token) Gemma's eager RMSNorm keeps: each call computes ``1 + weight`` anew and the
    product with it keeps that tensor, over h (over the head dim for Gemma 3's q and k norms)."""
    if mode == "full" or not spec.family.startswith("gemma"):
        return 0
    a = spec.attention
    return WIDTH * (spec.layer_norms * spec.hidden + (2 * a.qk_dim if a.qk_norm else 0))


def _query_scale(spec, mode, layer):
    """Bytes per layer (not per token) Mistral 4's, Ministral 3's and Llama 4's eager attention keeps: the queries'
    position-dependent scale (Mistral 4's and Ministral 3's ``1 + beta * log(1 + floor(position /
    original_max_position_embeddings))`` in every layer,
    Llama 4's temperature ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))`` in its NoPE layers), one
    fp32 per position, a tensor of its own that the product with the queries keeps; a fused kernel folds it into
    the queries' scaling."""
    scaled = spec.family in ("mistral4", "ministral3") or (spec.family == "llama4_text" and layer in spec.nope_layers)
    return WIDTH * SEQ if scaled and mode != "full" else 0


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_activation_bytes_equal_saved_tensors(family, mode):
    config, per_layer = _saved_per_layer(family, mode, FAMILIES[family])
    spec = model_spec(config)
    keep = layer_counts(spec, "dense", SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
    expected = BATCH * SEQ * (keep + _eager_extra(spec, mode, attention=FAMILIES[family])) + _gemma_scales(spec, mode)
    assert per_layer == [expected + _query_scale(spec, mode, n) for n in range(spec.layers)]


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
    # DeepSeek's sparse attention: transformers runs its MLA as DeepSeek-V3's (the model's MQA-mode kernel and its
    # kept choice are checked in test_cluster_sparse against these counts)
    counted = dataclasses.replace(spec, indexer=None, indexer_layers=()) if family in _SPARSE else spec
    for n, kind in enumerate(layer_kinds(counted)):
        keep = layer_counts(counted, kind, SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
        expected.append(BATCH * SEQ * (keep + _eager_extra(spec, mode, block_kind(kind), config, attention))
                        + _query_scale(spec, mode, n))
    assert spec.moe_layers and per_layer == expected


# Gated DeltaNet (Qwen3-Next, Qwen3.5 dense and MoE, OLMo hybrid). Its kernel runs as flash-linear-attention's does
# (:class:`_ChunkKernel`: the reference's output, keeping exactly the tensors fla's ChunkGatedDeltaRuleFunction saves
# for its backward, as CPU sdpa stands in for flash attention above); what the eager layer keeps around it is counted.
# The model counts Megatron-Core's layer, which hands the kernel its queries and keys repeated to every value head,
# where transformers hands them over per key head (fla repeats nothing itself). Eager keeps more
# (:func:`_gdn_eager_extra`): the convolution's output before its SiLU, K - 1 positions longer than the sequence (it
# pads both sides and keeps the first L outputs); the values as a view of the SiLU's output, whose storage autograd
# keeps whole (the queries and keys too, fla's input guard makes a contiguous copy); in the gated RMSNorm, the
# normalised input before the weight and silu(gate) (the product keeps it); the decay's softplus output (its product
# with -exp(A_log) keeps it); per layer, exp(A_log) and -exp(A_log), and each RMSNorm's 1 + weight (Gemma's norm). The
# attention layers: q and its output gate come from one projection, interleaved per head, so q's norm keeps the
# gate half of that storage too; the partial rotary goes through torch.cat (_ROTARY_CAT); sigmoid(gate) times the
# attention output keeps the model's two tensors. OLMo hybrid's attention layers are OLMo 3's (its eager extras), its
# norms scale by their weight (no 1 + weight), and it doubles the write strength after its sigmoid: the kernel keeps
# the doubled copy, the sigmoid its output, both counted by the model; with as many key heads as value heads
# (transformers' OLMo hybrid repeats none) Megatron-Core's repeat keeps nothing more than eager.
_GDN_FAMILIES = {"qwen3_next": "sdpa", "qwen3_5_text": "sdpa", "qwen3_5_moe_text": "sdpa", "olmo_hybrid": "sdpa"}
_GDN_MODULES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")
_GDN_MOE = ("qwen3_next", "qwen3_5_moe_text")  # their MoE layers run transformers' eager experts, as MOE_FAMILIES'
# (each with Qwen2-MoE's sigmoid gate on its shared expert)


class _ChunkKernel(torch.autograd.Function):
    """transformers' reference gated delta rule's output, keeping what fla's chunk kernel keeps
    (``ChunkGatedDeltaRuleFunction.forward``'s ``save_for_backward``, fla v0.5.1, with ``use_qk_l2norm_in_kernel``): the
    L2-normalised queries and keys with an fp32 1/norm per head, the values, the chunked cumulative decay in fp32, the
    write strength and each chunk's solved ``(I + A)^{-1}``, 64 per value head. The test never runs its backward."""

    reference = None

    @staticmethod
    def forward(ctx, query, key, value, g, beta):
        from pipeloom.plan.cluster.model.spec import GDN_CHUNK

        with torch.no_grad():
            out, _ = _ChunkKernel.reference(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            normalised = [x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key)]
            norms = [torch.empty(x.shape[:-1], dtype=torch.float32) for x in (query, key)]
            decay = torch.empty(g.shape, dtype=torch.float32)
            solved = torch.empty(*value.shape[:-1], GDN_CHUNK, dtype=value.dtype)
        ctx.save_for_backward(normalised[0], norms[0], normalised[1], norms[1], value, decay, beta, solved)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("the stand-in keeps what fla keeps; it is never differentiated")


def _with_chunk_kernel(monkeypatch):
    """transformers' Gated DeltaNet layers call :class:`_ChunkKernel` for their gated delta rule."""
    from importlib import import_module

    modules = [import_module(f"transformers.models.{name}.modeling_{name}") for name in _GDN_MODULES]
    _ChunkKernel.reference = modules[0].torch_chunk_gated_delta_rule
    for module in modules:
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule",
                            lambda query, key, value, g, beta, **_: (_ChunkKernel.apply(query, key, value, g, beta),
                                                                     None))


def _gdn_eager_extra(spec, kind, config, mode):
    """Bytes per token a Qwen3-Next / Qwen3.5 layer of ``kind`` keeps in eager code beyond the model's (see above)."""
    if mode == "full":
        return 0.0
    a, g = spec.attention, spec.linear
    if not is_linear(kind) and not a.output_gate:  # OLMo hybrid's attention layers: OLMo 3's eager extras
        return _eager_extra(spec, mode, block_kind(kind), config)
    if not is_linear(kind):  # the attention layers: the family's eager extras, the gate half of q's storage, the
        copy = a.heads * a.v_dim if mode == "none" else 0  # output copied out of q's layout (rotary via torch.cat)
        return _eager_extra(spec, mode, block_kind(kind), config) + WIDTH * (a.heads * a.v_dim + copy)
    mlp = _eager_extra(dataclasses.replace(spec, attention=dataclasses.replace(a, qk_norm=False)), mode,
                       block_kind(kind), config)  # the layer norms' normalised inputs, the MLP's extras
    convolved = g.mixed * (SEQ + g.conv_kernel - 1) / SEQ
    return mlp + WIDTH * (convolved + 2 * g.keys - 2 * g.value_heads * g.key_dim + 2 * g.values + g.value_heads)


def _gdn_per_layer(spec, kind, mode):
    """Bytes per layer (not per token) a Gated DeltaNet hybrid's layer keeps in eager code: Qwen3-Next's / Qwen3.5's
    RMSNorms' 1 + weight (the q and k norms' over a head; OLMo hybrid's norms scale by their weight), a Gated DeltaNet
    layer's exp(A_log) and -exp(A_log)."""
    if mode == "full":
        return 0
    qwen = spec.family != "olmo_hybrid"
    norms = spec.layer_norms * spec.hidden if qwen else 0
    if is_linear(kind):
        return WIDTH * (norms + 2 * spec.linear.value_heads)
    return WIDTH * (norms + 2 * spec.attention.qk_dim) if qwen else 0


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("family", sorted(_GDN_FAMILIES))
def test_gated_deltanet_activation_bytes_equal_saved_tensors(family, mode, monkeypatch):
    _with_chunk_kernel(monkeypatch)
    config, per_layer = _saved_per_layer(family, mode, _GDN_FAMILIES[family], use_cache=False)
    spec = model_spec(config)
    expected = []
    for kind in layer_kinds(spec):
        keep = layer_counts(spec, kind, SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
        expected.append(BATCH * SEQ * (keep + _gdn_eager_extra(spec, kind, config, mode))
                        + _gdn_per_layer(spec, kind, mode))
    assert spec.linear_layers and per_layer == pytest.approx(expected, rel=1e-12)


# Residual dropouts (a config that trains with them: ModelSpec.residual_dropouts), each family's own way (GPT-NeoX
# after both branches, StarCoder2 on the attention's and the MLP's outputs, Phi-3 and Seed-OSS likewise, Falcon once
# on the sum of its parallel branches and once after the MLP in its sequential layout, whose attention dropout is
# 0 here). A GPU keeps a one-byte mask per element (native_dropout, as the model counts: MASK_BYTES); PyTorch on the
# CPU drops out unfused, multiplying by noise in the activations' dtype and keeping that: WIDTH bytes per element
# here. So the masks are counted per element of h: as many as the model says, and none under full recomputation.
_DROPOUTS = {"gpt_neox": dict(hidden_dropout=0.1), "starcoder2": dict(residual_dropout=0.1),
             "phi3": dict(resid_pdrop=0.1), "seed_oss": dict(residual_dropout=0.1),
             "falcon": dict(hidden_dropout=0.1),
             "falcon-sequential": dict(hidden_dropout=0.1, parallel_attn=False, new_decoder_architecture=False)}


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("case", sorted(_DROPOUTS))
def test_residual_dropouts_keep_a_mask_per_element_of_h(case, mode):
    family, on = case.split("-")[0], _DROPOUTS[case]
    off = {key: 0.0 if "dropout" in key or "pdrop" in key else value for key, value in on.items()}
    config, without = _saved_per_layer(family, mode, FAMILIES[family], **off)
    dropped, with_masks = _saved_per_layer(family, mode, FAMILIES[family], **on)
    spec, plain = model_spec(dropped), model_spec(config)
    masks = spec.residual_dropouts if mode != "full" else 0
    assert spec.residual_dropouts == (1 if family == "falcon" else 2) and plain.residual_dropouts == 0
    assert [b - a for a, b in zip(without, with_masks)] == [BATCH * SEQ * spec.hidden * WIDTH * masks] * spec.layers
    keep = {s: layer_counts(s, "dense", SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
            for s in (spec, plain)}
    assert keep[spec] - keep[plain] == MASK_BYTES * spec.hidden * masks


def test_an_embedding_dropout_keeps_a_mask_per_element_of_h():
    """StarCoder2's embedding_dropout, on the embedding's output before the first layer (counted per element, as
    above); the model keeps it in the embedding whatever the recomputation."""
    saved = []
    for rate in (0.0, 0.1):
        outside: dict[int, int] = {}
        _saved_storages("starcoder2", "none", outside=outside, embedding_dropout=rate)
        saved.append(sum(outside.values()))
    spec = model_spec(dict(TINY["starcoder2"], model_type="starcoder2", embedding_dropout=0.1))
    assert spec.embedding_dropout and saved[1] - saved[0] == BATCH * SEQ * spec.hidden * WIDTH
    for mode in ("none", "selective", "full"):
        kept = layer_counts(spec, "embedding", SEQ).activations[mode].per_gpu(tp=1, cp=1, sp=False)
        assert kept == MASK_BYTES * spec.hidden


def test_the_logits_softcap_keeps_its_tanh_output():
    """Gemma 2's final_logit_softcapping (c · tanh(logits / c) before the loss) keeps the tanh's output outside the
    decoder layers, one logits-sized tensor, whatever the recomputation; priced in the head, each way."""
    saved = []
    for cap in (None, 30.0):
        outside: dict[int, int] = {}
        _saved_storages("gemma2", "none", attention="eager", outside=outside, final_logit_softcapping=cap)
        saved.append(sum(outside.values()))
    capped = model_spec(dict(TINY["gemma2"], model_type="gemma2", final_logit_softcapping=30.0))
    plain = model_spec(dict(TINY["gemma2"], model_type="gemma2"))
    assert capped.logit_softcap and not plain.logit_softcap
    # transformers' defaults: Gemma 2 caps at 30, Gemma 3 does not
    defaults = [model_spec({"model_type": family}).logit_softcap for family in ("gemma2", "gemma3_text")]
    assert defaults == [True, False]
    assert saved[1] - saved[0] == BATCH * SEQ * capped.vocab * WIDTH
    for mode in ("none", "selective", "full"):
        kept = [layer_counts(s, "head", SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
                for s in (capped, plain)]
        assert kept[0] - kept[1] == WIDTH * capped.vocab


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_phimoe_input_jitter_keeps_its_two_noise_tensors(mode):
    """Phi-3.5-MoE's input_jitter_noise multiplies the MoE block's input by noise in training, in the block and
    again in its router, in place: each product keeps its noise, h per token (the checkpoints' configs set 0.01)."""
    config, without = _saved_per_layer("phimoe", mode, "sdpa", input_jitter_noise=0.0)
    jittered, with_noise = _saved_per_layer("phimoe", mode, "sdpa", input_jitter_noise=0.01)
    spec, plain = model_spec(jittered), model_spec(config)
    assert spec.experts.input_jitter and not plain.experts.input_jitter
    assert [b - a for a, b in zip(without, with_noise)] == [BATCH * SEQ * 2 * WIDTH * spec.hidden] * spec.layers
    keep = {s: layer_counts(s, "moe", SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
            for s in (spec, plain)}
    assert keep[spec] - keep[plain] == 2 * WIDTH * spec.hidden


def test_a_gpu_dropout_keeps_a_one_byte_mask():
    """What MASK_BYTES stands for: the fused dropout a GPU runs (torch.native_dropout, which CUDA's F.dropout
    calls) returns a bool mask, the tensor its backward keeps."""
    _, mask = torch.native_dropout(torch.ones(4, 8), 0.1, True)
    assert mask.dtype == torch.bool and mask.element_size() == MASK_BYTES


def test_modes_are_ordered_and_divided():
    spec = model_spec(tiny_config("llama"))
    acts = layer_counts(spec, "dense", 4096).activations
    none, selective, full = (acts[m].per_gpu(tp=1, cp=1, sp=False) for m in ("none", "selective", "full"))
    assert none > selective > full == 2 * spec.hidden
    one = acts["none"]
    assert one.per_gpu(tp=4, cp=1, sp=True) == pytest.approx(none / 4)
    assert one.per_gpu(tp=4, cp=2, sp=False) == pytest.approx((one.sequence + one.tensor / 4) / 2)


# Megatron-Core's recompute_modules (pipeloom.plan.cluster.recompute). A module under normal checkpointing (mlp,
# moe, shared_experts) is wrapped in a reentrant checkpoint as Megatron-Core's layer spec draws its bounds (the
# dense MLP with its norm, fused into its first linear layer by Transformer Engine; the MoE MLP without its norm,
# which runs as a module of its own): what the layer saves less is compared with what the model says it keeps
# less, plus the eager extras that go with it (_eager_extra). An output-discarding module (layernorm, moe_act,
# mla_up_proj) frees exactly the storage of its output that autograd saves: those storages, found by address, are
# compared with what the model says it keeps less.
_PRE_NORM = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "starcoder2", "gpt_neox")  # a pre-MLP norm
# named post_attention_layernorm before the MLP (Gemma's and OLMo's norms sit elsewhere)


def _layers(model, family):
    return list(model.get_submodule(LAYER_PREFIX.get(family, "model.layers")))


def _moe_block(layer):
    """The layer's MoE MLP (the child holding the experts), None in a dense layer."""
    return next((child for child in layer.children() if hasattr(child, "experts")), None)


def _checkpoint(module, before=None):
    """Run ``module`` (after ``before``, a module taken out of the layer's forward) inside a reentrant checkpoint."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward
    if before is not None:
        module.add_module("pipeloom_before", before)

    def wrapped(hidden, *args, **kwargs):
        def run(x):
            return forward(before(x) if before is not None else x, *args, **kwargs)
        return checkpoint(run, hidden, use_reentrant=True)

    module.forward = wrapped


def _fewer(spec, kind, modules):
    """Bytes per token the model says a layer of ``kind`` keeps less under ``modules`` (one GPU, no tp)."""
    from pipeloom.plan.cluster.recompute import megatron_activations

    none = layer_counts(spec, kind, SEQ, width=WIDTH).activations["none"].per_gpu(tp=1, cp=1, sp=False)
    return none - megatron_activations(spec, kind, modules, width=WIDTH).per_gpu(tp=1, cp=1, sp=False)


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(MOE_FAMILIES))
def test_megatron_core_attn_is_the_selective_mode(family):
    from pipeloom.plan.cluster.recompute import megatron_activations

    spec = model_spec(tiny_config(family))
    for kind in set(layer_kinds(spec)):
        assert megatron_activations(spec, kind, ("core_attn",)) == layer_counts(spec, kind, SEQ).activations[
            "selective"]


@pytest.mark.parametrize("family", _PRE_NORM)
def test_megatron_mlp_recompute_frees_what_autograd_saved(family):
    def prepare(model):
        for layer in _layers(model, family):
            norm, layer.post_attention_layernorm = layer.post_attention_layernorm, torch.nn.Identity()
            _checkpoint(layer.mlp, before=norm)

    config, none = _saved_per_layer(family, "none", FAMILIES[family])
    _, layers = _saved_storages(family, "none", FAMILIES[family], prepare=prepare)
    spec = model_spec(config)
    eager = WIDTH * ((0 if spec.layer_norm else spec.hidden) + (spec.intermediate if spec.gated else 0))
    assert [n - sum(m.values()) for n, m in zip(none, layers)] == [
        BATCH * SEQ * (_fewer(spec, "dense", ("mlp",)) + eager)] * spec.layers


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_megatron_moe_recompute_frees_what_autograd_saved(family):
    def prepare(model):
        for layer in _layers(model, family):
            if _moe_block(layer) is not None:
                _checkpoint(_moe_block(layer))
                if getattr(layer, "shared_mlp", None) is not None:  # Granite MoE's shared MLP, the MoE block's
                    _checkpoint(layer.shared_mlp)  # sibling there, is in Megatron-Core's MoE layer

    config, none = _saved_per_layer(family, "none", MOE_FAMILIES[family])
    _, layers = _saved_storages(family, "none", MOE_FAMILIES[family], prepare=prepare)
    spec = model_spec(config)
    eager = _routed_extra(spec) + WIDTH * spec.experts.shared_intermediate + _router_extra(config)
    expected = [BATCH * SEQ * (_fewer(spec, "moe", ("moe",)) + eager) if n in spec.moe_layers else 0
                for n in range(spec.layers)]
    assert [n - sum(m.values()) for n, m in zip(none, layers)] == expected and any(expected)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_megatron_shared_experts_recompute_frees_what_autograd_saved(family):
    def prepare(model):
        for layer in _layers(model, family):
            if _moe_block(layer) is not None:
                _checkpoint(_moe_block(layer).shared_experts)

    config, none = _saved_per_layer(family, "none", MOE_FAMILIES[family])
    _, layers = _saved_storages(family, "none", MOE_FAMILIES[family], prepare=prepare)
    spec = model_spec(config)
    eager = WIDTH * spec.experts.shared_intermediate  # act(gate), kept apart from act(gate) * up
    expected = [BATCH * SEQ * (_fewer(spec, "moe", ("shared_experts",)) + eager) if n in spec.moe_layers else 0
                for n in range(spec.layers)]
    assert [n - sum(m.values()) for n, m in zip(none, layers)] == expected and any(expected)


def _tagged(family, attention, tag):
    """Per layer, the bytes autograd saves of the storages ``tag(model, found)`` adds to ``found`` (a list of
    tensors, held until counted so that no other tensor takes their addresses)."""
    found: list = []
    config, layers = _saved_storages(family, "none", attention, prepare=lambda model: tag(model, found))
    addresses = {t.untyped_storage().data_ptr() for t in found}
    return config, [sum(size for key, size in layer.items() if key in addresses) for layer in layers]


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_megatron_layernorm_recompute_frees_the_separate_norms_outputs(family):
    """The MoE layers' pre-MLP norms and, under latent attention, every attention norm."""
    def tag(model, found):
        for layer in _layers(model, family):
            norms = [layer.post_attention_layernorm] if _moe_block(layer) is not None else []
            if config_latent:
                norms.append(layer.input_layernorm)
            for norm in norms:
                norm.register_forward_hook(lambda module, args, out: found.append(out))

    spec = model_spec(tiny_config(family))
    config_latent = spec.attention.latent
    _, freed = _tagged(family, MOE_FAMILIES[family], tag)
    kinds = ["moe" if n in spec.moe_layers else "dense" for n in range(spec.layers)]
    expected = [BATCH * SEQ * _fewer(spec, kind, ("layernorm",)) for kind in kinds]
    assert freed == expected and all(expected[n] for n in spec.moe_layers)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_megatron_moe_act_recompute_frees_the_experts_activation_outputs(family):
    """The input of each expert's down projection, whatever way the family multiplies by it."""
    from torch.overrides import TorchFunctionMode

    class Downs(TorchFunctionMode):
        def __init__(self, weights, found):
            super().__init__()
            self.weights, self.found = weights, found

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.bmm) and len(args) > 1 \
                    and args[1].untyped_storage().data_ptr() in self.weights:
                self.found.append(args[0])
            return func(*args, **(kwargs or {}))

    def tag(model, found):
        weights = {block.experts.down_proj.untyped_storage().data_ptr()
                   for block in map(_moe_block, _layers(model, family)) if block is not None}
        for block in filter(None, map(_moe_block, _layers(model, family))):
            forward = block.experts.forward

            def watched(*args, forward=forward, **kwargs):
                with Downs(weights, found):
                    return forward(*args, **kwargs)
            block.experts.forward = watched

    config, freed = _tagged(family, MOE_FAMILIES[family], tag)
    spec = model_spec(config)
    expected = [BATCH * SEQ * _fewer(spec, "moe", ("moe_act",)) if n in spec.moe_layers else 0
                for n in range(spec.layers)]
    assert freed == expected and any(expected)


def test_megatron_mla_up_proj_recompute_frees_q_k_and_v():
    """q, k and v as the attention core receives them (v made contiguous, as the eager core's batched matmul
    copies it: what it saves is then the tensor received)."""
    from importlib import import_module

    eager = import_module("transformers.models.deepseek_v3.modeling_deepseek_v3").eager_attention_forward
    found: list = []

    def recorded(module, query, key, value, attention_mask, **kwargs):
        value = value.contiguous()
        found.extend((query, key, value))
        return eager(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("pipeloom_recorded_deepseek_v3", recorded)
    config, layers = _saved_storages("deepseek_v3", "none", "pipeloom_recorded_deepseek_v3")
    addresses = {t.untyped_storage().data_ptr() for t in found}
    freed = [sum(size for key, size in layer.items() if key in addresses) for layer in layers]
    spec = model_spec(config)
    kinds = ["moe" if n in spec.moe_layers else "dense" for n in range(spec.layers)]
    assert freed == [BATCH * SEQ * _fewer(spec, kind, ("mla_up_proj",)) for kind in kinds] and all(freed)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("family, gelu", [("phi", {"hidden_act": "gelu"}), ("gptj", {"activation_function": "gelu"})])
def test_phi_and_gptj_keep_what_the_model_counts(family, gelu, mode):
    """Phi-1/2 and GPT-J (one LayerNorm before attention and a GELU MLP side by side, their biases), with torch's own
    GELU where their configs name "gelu_new" (transformers writes it out op by op, each op keeping a copy no kernel a
    framework would train them with keeps: as GPT-2, left out of FAMILIES)."""
    config, per_layer = _saved_per_layer(family, mode, "sdpa", **gelu)
    spec = model_spec(config)
    keep = layer_counts(spec, "dense", SEQ, width=WIDTH).activations[mode].per_gpu(tp=1, cp=1, sp=False)
    assert per_layer == [BATCH * SEQ * (keep + _eager_extra(spec, mode, attention="sdpa"))] * spec.layers
