"""Tiny random-init ``transformers`` models for the runtime tests (no downloads), their split points
and a language-model loss; importable by spawned ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeloom.plan.cluster.runtime_plan import LAYER_PREFIX

VOCAB = 96
LAYERS = 4


def build_hf(name: str, *, dropout: float = 0.0, seed: int = 0) -> torch.nn.Module:
    """GPT-2 and BERT-MLM tie their head to the embedding; Qwen2 is built tied too; LLaMA and Qwen3 are not.
    BART and T5 share one embedding between the encoder, the decoder and the head; Whisper ties its decoder's
    embedding to its head (encoder-decoder models: ``ENCODER_DECODER``, 2 encoder and 4 decoder layers).

    LLaMA, Qwen2 and Qwen3 use eager attention: with SDPA, transformers skips the causal mask when it runs
    untraced but builds it under tracing, so the traced program runs another attention kernel
    (docs/runtime.md)."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "gpt2":
        config = T.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, n_positions=64, resid_pdrop=dropout,
                              embd_pdrop=dropout, attn_pdrop=dropout, **common)
        return T.GPT2LMHeadModel(config)
    if name == "llama":
        config = T.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, attention_dropout=dropout, attn_implementation="eager",
                               **common)
        return T.LlamaForCausalLM(config)
    if name == "bert":
        config = T.BertConfig(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                              vocab_size=VOCAB, pad_token_id=0)
        return T.BertForMaskedLM(config)
    if name == "qwen2":
        config = T.Qwen2Config(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, tie_word_embeddings=True, attention_dropout=dropout,
                               attn_implementation="eager", **common)
        return T.Qwen2ForCausalLM(config)
    if name == "qwen3":  # per-head q_norm/k_norm over head_dim 8 (4 query heads, 2 key/value heads)
        config = T.Qwen3Config(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                               attention_dropout=dropout, attn_implementation="eager", **common)
        return T.Qwen3ForCausalLM(config)
    if name in PLANNED or name in RANDOM:  # the families the cluster planner reads beyond these (eager attention)
        config = T.AutoConfig.for_model(name, **{**PLANNED, **RANDOM}[name], attention_dropout=dropout,
                                        attn_implementation="eager", **common)
        if name == "mistral4":  # no AutoModelForCausalLM class: its checkpoints are multimodal models around it
            return T.Mistral4ForCausalLM._from_config(config, attn_implementation="eager")
        return T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if name in ENCODER_DECODER:
        return _encoder_decoder(name, dropout, common)
    raise ValueError(name)


_SMALL = dict(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2)
_LINEAR = dict(head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention"] * (LAYERS // 2))  # Qwen3-Next and Qwen3.5
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
PLANNED = {
    "granite": dict(_SMALL, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1,
                    logits_scaling=4.0),
    "phi3": dict(_SMALL, partial_rotary_factor=0.5),  # fused qkv and gate-up projections, rotary on half
    "olmo2": dict(_SMALL),  # norms after attention and the MLP, q/k norms over the whole projections
    "olmo3": dict(_SMALL, sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "smollm3": dict(_SMALL, no_rope_layer_interval=2),  # every second layer without rotary embedding
    "starcoder2": dict(_SMALL),  # LayerNorm, biased projections, a GELU MLP, tied head
    "cohere": dict(_SMALL, use_qk_norm=True),  # one LayerNorm before both branches, a LayerNorm per head, scaled logits
    "cohere2": dict(_SMALL, sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "gemma": dict(_SMALL, head_dim=8),  # a tied head, embeddings scaled by sqrt(hidden), norms of (1 + weight)
    "gemma2": dict(_SMALL, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,  # four norms a layer, soft-capped
                   layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)),  # scores and logits
    "gemma3_text": dict(_SMALL, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,  # q/k norms per head, a
                        layer_types=["sliding_attention"] * 3 + ["full_attention"]),  # local rotary base
    "glm4": dict(_SMALL, head_dim=8),  # norms after attention and the MLP too, interleaved rotary on half the dims
    "falcon": dict(num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_kv_heads=2, bias=True,
                   new_decoder_architecture=True, ffn_hidden_size=64),  # fused q/k/v, two norms side by side
    "olmoe": dict(_SMALL, num_experts=4, num_experts_per_tok=2),  # OLMo's q/k norms, every layer sparse
    "minimax_m2": dict(_SMALL, head_dim=8, num_local_experts=4, num_experts_per_tok=2),  # a sigmoid router
    "ernie4_5_moe": dict(_SMALL, use_bias=True, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                         moe_num_shared_experts=1, moe_layer_start_index=1),  # a shared expert, biased head
    "glm4_moe": dict(_SMALL, head_dim=8, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True,
                     attention_bias=True, partial_rotary_factor=0.5),
    "granitemoeshared": dict(_SMALL, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
                             embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1,
                             logits_scaling=4.0),  # a softmax over the top-k logits, a shared MLP beside the experts
    "mistral4": dict(_SMALL, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                     qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                     num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1),  # MLA, softmax router,
    # the queries scaled by their position (position_ids reach every layer)
    "deepseek_v32": dict(_SMALL, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, n_shared_experts=1,
                         moe_intermediate_size=16, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                         topk_group=1, index_topk=4, index_head_dim=8, index_n_heads=2),  # DeepSeek's sparse
    # attention: an indexer under no_grad picks 4 keys per query, its top-k masking the scores
    "glm_moe_dsa": dict(_SMALL, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, n_shared_experts=1,
                        moe_intermediate_size=16, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                        topk_group=1, index_topk=4, index_head_dim=8, index_n_heads=2,
                        indexer_types=["full", "shared", "full", "shared"]),  # layers 1 and 3 reuse the choice
    # of the layer before: the int32 top-k crosses the pieces' cut with the hidden state
    "llama4_text": dict(_SMALL, head_dim=8, intermediate_size=16, intermediate_size_mlp=64, num_local_experts=4,
                        num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2,
                        attention_chunk_size=4),  # chunked attention on the rotary layers, NoPE layers with the
    # queries' temperature, every expert run on every token under a sigmoid router, a shared expert
    "qwen3_next": dict(_SMALL, **_LINEAR, **_QWEN_MOE),  # Gated DeltaNet layers (a causal conv, the chunked delta
    # rule's reference) between gated attention layers, so each cut falls between kinds; a sigmoid-gated shared expert
    "qwen3_5_moe_text": dict(_SMALL, **_LINEAR, **_QWEN_MOE),  # Qwen3-Next's layers with separate projections
    "qwen3_5_text": dict(_SMALL, **_LINEAR),  # Qwen3.5's dense model
    "olmo_hybrid": dict(_SMALL, layer_types=_LINEAR["layer_types"]),  # OLMo 3's
    # attention layers (norms after each branch) between Gated DeltaNet layers normed before each (sizes derived)
}
"""Tiny configs of the families ``pipeloom plan --model`` reads that the cases above do not cover (ERNIE 4.5's dense
model is covered by its MoE model's dense first layer; Seed-OSS is LLaMA's layer with the biased projections of
Qwen2 and StarCoder2; EXAONE 4 has OLMo 2's norms, Qwen3's q/k norms and Cohere 2's windows; GLM-4.7-Flash is
DeepSeek-V3's architecture, which the expert-parallel tests run; dots.llm1 is GLM-4.5's with q/k norms always)."""
RANDOM = {
    "phimoe": dict(_SMALL, num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                   input_jitter_noise=0.01, router_jitter_noise=0.01),
}
"""Families whose training forward draws random numbers beyond dropout (Phi-3.5-MoE: its sparsemixer samples each
token's experts, and its input jitter multiplies by noise), checked against the runtime's seeded reference
(``pipeloom.runtime.reference_step``) as dropout is, not against the unsplit model."""


ENCODER_DECODER = {"bart": ("model.encoder.layers", "model.decoder.layers"),  # model -> its blocks' names
                   "t5": ("encoder.block", "decoder.block"),
                   "whisper": ("model.encoder.layers", "model.decoder.layers")}
MELS, FRAMES = 8, 32  # Whisper's input features: (rows, MELS, FRAMES), FRAMES = 2 × max_source_positions


def _encoder_decoder(name: str, dropout: float, common: dict) -> torch.nn.Module:
    """Eager attention: the traced program then runs the untraced one's kernels (docs/runtime.md)."""
    import transformers as T

    common = dict(common, decoder_start_token_id=0, attn_implementation="eager")
    sizes = dict(d_model=32, encoder_layers=2, decoder_layers=LAYERS, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=dropout,
                 attention_dropout=dropout, activation_dropout=dropout)
    if name == "bart":
        return T.BartForConditionalGeneration(T.BartConfig(max_position_embeddings=64, **sizes, **common))
    if name == "whisper":
        return T.WhisperForConditionalGeneration(T.WhisperConfig(num_mel_bins=MELS, max_source_positions=FRAMES // 2,
                                                                 max_target_positions=32, **sizes, **common))
    return T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=LAYERS,
                                                   num_heads=4, dropout_rate=dropout, **common))


_BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer", "qwen2": "model.layers",
           "qwen3": "model.layers", **{name: LAYER_PREFIX.get(name, "model.layers") for name in (*PLANNED, *RANDOM)}}


def hf_splits(name: str, pieces: int) -> list[str]:
    """Split points cutting the model's 4 blocks into ``pieces`` pieces (1, 2 or 4). An encoder-decoder
    model: 2 pieces cut its decoder in half (the encoder and the first half in piece 0, which uses the shared
    embedding twice when it has one); 4 pieces cut after the first encoder layer and the first and third
    decoder layers (the encoder's output then feeds decoder layers in pieces 1, 2 and 3)."""
    if name in ENCODER_DECODER:
        encoder, decoder = ENCODER_DECODER[name]
        return {1: [], 2: [f"{decoder}.2"], 4: [f"{encoder}.1", f"{decoder}.1", f"{decoder}.3"]}[pieces]
    step = LAYERS // pieces
    return [f"{_BLOCKS[name]}.{k}" for k in range(step, LAYERS, step)]


def lm_loss(output: object, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of every position's logits (a ModelOutput's ``.logits``)."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def accumulated_step(model, x: torch.Tensor, y: torch.Tensor, microbatches: int) -> float:
    """One step of ``model`` on one device as a pipeline runs it: the batch cut into ``microbatches``, each
    micro-batch's loss over their count back-propagated in turn; the summed loss."""
    total = 0.0
    for xm, ym in zip(torch.chunk(x, microbatches), torch.chunk(y, microbatches)):
        value = lm_loss(model(xm), ym) / microbatches
        value.backward()
        total += float(value.detach())
    return total


def tokens(rows: int = 8, seq: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(1, VOCAB, (rows, seq), generator=generator),
            torch.randint(0, VOCAB, (rows, seq), generator=generator))


def hf_batch(name: str, rows: int = 8, seq: int = 12, seed: int = 1) -> tuple[object, torch.Tensor]:
    """``name``'s inputs and targets: token ids; T5 and Whisper take the decoder's ids too, as their third
    positional input after an attention mask (all ones); Whisper's encoder reads (rows, MELS, FRAMES)
    features instead of ids."""
    x, y = tokens(rows, seq, seed)
    if name == "t5":
        return (x, torch.ones_like(x), torch.roll(y, 1, dims=1)), y
    if name == "whisper":
        features = torch.randn(rows, MELS, FRAMES, generator=torch.Generator().manual_seed(seed))
        return (features, torch.ones(rows, FRAMES, dtype=torch.long), torch.roll(y, 1, dims=1)), y
    return x, y
