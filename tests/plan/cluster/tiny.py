"""Tiny random-init configs of every family the cluster planner reads (shared by its tests)."""

from __future__ import annotations

from typing import Any

__all__ = ["TINY", "tiny_config", "tiny_model", "local_layers"]

_COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               vocab_size=128, max_position_embeddings=64)
_GDN: dict[str, Any] = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=12, linear_conv_kernel_dim=4,
                            layer_types=["linear_attention", "full_attention"] * 2)
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, num_key_value_heads=2),
    "mistral": dict(_COMMON, num_key_value_heads=2, head_dim=24),
    "qwen2": dict(_COMMON, num_key_value_heads=2),
    "qwen3": dict(_COMMON, num_key_value_heads=2, head_dim=32),
    "gemma": dict(_COMMON, num_key_value_heads=1, head_dim=16),
    "gemma2": dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=None,
                   final_logit_softcapping=None),
    "gemma3_text": dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=[
        "sliding_attention", "full_attention"]),
    "granite": dict(_COMMON, num_key_value_heads=2, embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.1, logits_scaling=4.0),
    "phi3": dict(_COMMON, num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2),
    "olmo": dict(_COMMON, num_key_value_heads=2, pad_token_id=0, eos_token_id=2),
    "olmo2": dict(_COMMON, num_key_value_heads=2, pad_token_id=0, eos_token_id=2),
    "olmo3": dict(_COMMON, num_key_value_heads=2, pad_token_id=0, eos_token_id=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"]),
    "smollm3": dict(_COMMON, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "starcoder2": dict(_COMMON, num_key_value_heads=2, bos_token_id=1, eos_token_id=2),
    "cohere": dict(_COMMON, num_key_value_heads=2, use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "cohere2": dict(_COMMON, num_key_value_heads=2, sliding_window=8, layer_types=["sliding_attention",
                    "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "ernie4_5": dict(_COMMON, num_key_value_heads=2, head_dim=16, use_bias=True),
    "ernie4_5_moe": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, use_bias=True, moe_num_experts=4,
                         moe_k=2, moe_intermediate_size=24, moe_num_shared_experts=1, moe_layer_start_index=1),
    "glm": dict(_COMMON, num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=2),
    "glm4": dict(_COMMON, num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=2),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, num_kv_heads=2,
                   new_decoder_architecture=True, ffn_hidden_size=96, bias=True, max_position_embeddings=64),
    "seed_oss": dict(_COMMON, num_key_value_heads=2, head_dim=16, attention_out_bias=True, mlp_bias=True,
                     residual_dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "exaone4": dict(_COMMON, num_key_value_heads=2, sliding_window=8, layer_types=["sliding_attention",
                    "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "ministral": dict(_COMMON, num_key_value_heads=2, head_dim=16),
    "ministral3": dict(_COMMON, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "helium": dict(_COMMON, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "arcee": dict(_COMMON, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "hunyuan_v1_dense": dict(_COMMON, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
    "gpt_neox": dict(_COMMON, tie_word_embeddings=False),
    "phi": dict(_COMMON, num_key_value_heads=2, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, rotary_dim=8, n_inner=96,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "mixtral": dict(_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                       embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
    "granitemoeshared": dict(_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=48, embedding_multiplier=2.0, residual_multiplier=0.5,
                             attention_multiplier=0.1, logits_scaling=4.0),
    "phimoe": dict(_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                   lm_head_bias=True),
    "olmoe": dict(_COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=2),
    "minimax_m2": dict(_COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[0]),
    "hunyuan_v1_moe": dict(_COMMON, num_key_value_heads=2, head_dim=16, num_experts=4, moe_topk=2, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2),
    "qwen3_moe": dict(_COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16),
    "glm4_moe": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, moe_intermediate_size=24,
                     n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                     topk_group=1, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                     pad_token_id=0, eos_token_id=2),
    "gpt_oss": dict(_COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8),
    "deepseek_v2": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, n_shared_experts=2,
                        moe_intermediate_size=24, first_k_dense_replace=1, num_experts_per_tok=2,
                        topk_method="greedy", n_group=1, topk_group=1),
    "deepseek_v3": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24,
                        kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, n_shared_experts=1,
                        moe_intermediate_size=24, first_k_dense_replace=1, num_experts_per_tok=2, n_group=1,
                        topk_group=1),
    "glm4_moe_lite": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                          qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4,
                          n_shared_experts=1, moe_intermediate_size=24, num_experts_per_tok=2, n_group=1, topk_group=1,
                          mlp_layer_types=["dense", "sparse", "sparse"]),
    # DeepSeek's sparse attention: 8 of the 16 test tokens' keys per query; GLM-5's second layer reuses the first's
    "deepseek_v32": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, n_shared_experts=1,
                         moe_intermediate_size=24, num_experts_per_tok=2, n_group=1, topk_group=1,
                         first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=2),
    "glm_moe_dsa": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, n_shared_experts=1,
                        moe_intermediate_size=24, num_experts_per_tok=2, n_group=1, topk_group=1,
                        first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=2,
                        indexer_types=["full", "shared", "full"]),
    "dots1": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, moe_intermediate_size=24,
                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                  topk_group=1),
    "mistral4": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                     qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, n_shared_experts=1,
                     moe_intermediate_size=24, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2,
                     topk_group=1),
    # transformers runs every expert on every token: with top_k = the experts, that is what the planner counts; the
    # four layers are dense-window (rotary, chunked), moe-nope, moe-window and dense-nope
    "llama4_text": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                        intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=4, moe_layers=[1, 2],
                        no_rope_layer_interval=2, attention_chunk_size=8, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2),
    # Gated DeltaNet on the first and third layers, attention on the second and fourth; Qwen3-Next's second layer
    # dense (mlp_only_layers)
    "qwen3_next": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                       mlp_only_layers=[1], **_GDN),
    "qwen3_5_text": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, **_GDN),
    "qwen3_5_moe_text": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                             **_GDN),
    # OLMo hybrid: its Gated DeltaNet's sizes left to transformers (four key and value heads of 12 and 24), attention
    # (OLMo 3's) on the second and fourth layers
    "olmo_hybrid": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, layer_types=_GDN["layer_types"],
                        pad_token_id=0, eos_token_id=1),
}
"""Config keywords per ``model_type``: 2-4 layers, hidden 64, GQA where the family has it."""


def tiny_config(family: str) -> Any:
    """A transformers config of ``family`` with :data:`TINY`'s sizes (imports transformers)."""
    import transformers

    return transformers.AutoConfig.for_model(family, **TINY[family])


_CAUSAL_LM = {"mistral4": "Mistral4ForCausalLM"}
"""Families transformers registers no ``AutoModelForCausalLM`` class for (Mistral 4's checkpoints are multimodal
models around it): their causal-LM class by name."""


def tiny_model(config: Any, **kwargs: Any) -> Any:
    """The causal language model of ``config`` (``kwargs``: ``attn_implementation`` and the like), random init."""
    import transformers

    name = _CAUSAL_LM.get(config.model_type)
    if name is None:
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    return getattr(transformers, name)._from_config(config, **kwargs)


def local_layers(model: Any) -> tuple[int, ...]:
    """The decoder layers whose attention transformers masks to a window or a chunk: a 16-token forward (``model`` on
    eager attention), each layer's mask seen by a hook; a layer is local when its last query may not see the first
    key."""
    import torch

    masks = {}
    for n, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda module, args, kwargs, n=n: masks.__setitem__(n, kwargs["attention_mask"]), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 16, dtype=torch.long))
    seen = {n: bool(mask[0, 0, 15, 0]) if mask.dtype == torch.bool else bool(mask[0, 0, 15, 0] == 0)
            for n, mask in masks.items()}
    return tuple(n for n in sorted(seen) if not seen[n])
