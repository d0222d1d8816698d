"""Writes the model configs (transformers ``config.json`` files, only the keys that size the model; the
rest take transformers' defaults) of the published runs in ``benchmarks/data/published_runs.json``, every
size taken from the paper or model card named beside it.

Run: ``python benchmarks/data/configs/make_configs.py`` (no dependencies; rewrites the JSON files here).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CONFIGS", "main"]

HERE = Path(__file__).parent

# Narayanan et al. 2021 (arXiv:2104.04473), Table 1 and sec. 5.2: GPT models, vocabulary 51,200, sequence 2,048,
# (heads, hidden, layers) per published size; Megatron's GPT ties the input and output embeddings (Eq. 2 counts
# V·h once) and uses a 4h MLP with GeLU.
_MEGATRON_2021 = {
    "1.7b": (24, 2304, 24), "3.6b": (32, 3072, 30), "7.5b": (32, 4096, 36), "18.4b": (48, 6144, 40),
    "39.1b": (64, 8192, 48), "76.1b": (80, 10240, 60), "145.6b": (96, 12288, 80), "310.1b": (128, 16384, 96),
    "529.6b": (128, 20480, 105), "1008b": (160, 25600, 128),
    # sec. 5.2 / Table 2: the GPT-3 175B configuration (174.6B with this vocabulary)
    "174.6b": (96, 12288, 96),
}
# The paper states no dropout rates: Megatron-LM's defaults (``--hidden-dropout 0.1`` on each branch's output and on
# the embedding, ``--attention-dropout 0.1``), as the benchmark's materialized attention prices its dropout.
_MEGATRON_DROPOUT = 0.1

# Llama 3 family (Llama 3 paper, arXiv:2407.21783, Table 3; the Llama 3.1 model cards' config.json):
# layers, hidden, FFN, heads, KV heads; vocabulary 128,256, untied embeddings, 128k positions.
_LLAMA3 = {"8b": (32, 4096, 14336, 32, 8), "70b": (80, 8192, 28672, 64, 8), "405b": (126, 16384, 53248, 128, 8)}


def _gpt(heads: int, hidden: int, layers: int) -> dict:
    return {"model_type": "gpt2", "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_inner": 4 * hidden,
            "n_positions": 2048, "vocab_size": 51200, "activation_function": "gelu", "tie_word_embeddings": True,
            "resid_pdrop": _MEGATRON_DROPOUT, "embd_pdrop": _MEGATRON_DROPOUT, "attn_pdrop": _MEGATRON_DROPOUT}


def _llama(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": 128256,
            "tie_word_embeddings": False, "max_position_embeddings": 131072}


def _deepseek_v3() -> dict:
    # DeepSeek-V3 technical report (arXiv:2412.19437) sec. 4.2 and the model card's config.json: 61 layers,
    # hidden 7168, 128 heads (MLA: query compression 1536, KV compression 512, 128 + 64 rotary per head, values
    # 128); first 3 layers dense (FFN 18432); MoE layers: 1 shared + 256 routed experts of 2048, 8 routed per
    # token, at most 4 nodes per token (8 groups, top 4); vocabulary 129,280. The multi-token-prediction module
    # is not among the 61 layers: one module (num_nextn_predict_layers 1, report sec. 2.2).
    return {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
            "tie_word_embeddings": False, "n_group": 8, "topk_group": 4, "max_position_embeddings": 163840,
            "num_nextn_predict_layers": 1}


def _mlperf_gpt3() -> dict:
    # MLPerf Training's GPT-3 175B as NVIDIA's NeMo submissions configure it (mlcommons/training_results_v3.1 to
    # v4.1, NVIDIA/benchmarks/gpt3/implementations/*/conf/custom.yaml and NeMo's base megatron_gpt_config.yaml):
    # 96 layers, hidden 12288, 96 heads, FFN 49152, sequence 2048, learned absolute positions, GeLU, biases,
    # LayerNorm, tied embeddings; the SentencePiece vocabulary of 50,257 padded to a multiple of 128 x tp 4
    # (NeMo's make_vocab_size_divisible_by) = 50,688, the GEMMs' width; custom.yaml's hidden_dropout and
    # attention_dropout 0.0 (no dropout).
    return {"model_type": "gpt2", "n_embd": 12288, "n_layer": 96, "n_head": 96, "n_inner": 49152, "n_positions": 2048,
            "vocab_size": 50688, "activation_function": "gelu", "tie_word_embeddings": True, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _qwen3_moe(layers: int, hidden: int, ffn: int, expert_ffn: int, heads: int) -> dict:
    # Qwen3 MoE (the Qwen/Qwen3-235B-A22B and Qwen/Qwen3-30B-A3B model cards' config.json): every layer an MoE
    # of 128 experts, 8 routed per token (no shared expert), 4 key/value heads of 128, q/k norms, vocabulary
    # 151,936, untied embeddings; the dense FFN size is unused (no mlp_only_layers).
    return {"model_type": "qwen3_moe", "hidden_size": hidden, "intermediate_size": ffn,
            "moe_intermediate_size": expert_ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
            "tie_word_embeddings": False, "max_position_embeddings": 40960}


def _gpt_oss_120b() -> dict:
    # openai/gpt-oss-120b's config.json (and OpenAI's model card, 116.8B parameters): 36 layers, hidden 2880, 64
    # query and 8 key/value heads of 64 with a sink per head, every layer an MoE of 128 experts of 2880, 4 per
    # token, every second layer (the even ones) a 128-token window, vocabulary 201,088, untied embeddings.
    return {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
            "num_experts_per_tok": 4, "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 18, "vocab_size": 201088,
            "tie_word_embeddings": False, "max_position_embeddings": 131072}


def _llama4_scout() -> dict:
    # meta-llama/Llama-4-Scout-17B-16E's text_config (transformers' Llama4TextConfig defaults are this checkpoint's):
    # 48 layers, hidden 5120, 40 query and 8 key/value heads of 128, 16 experts of 8192 and a shared one on every
    # layer, 1 per token, dense MLP 16384 (no dense layer here), rotary and 8192-token chunks on three layers of
    # four, q/k L2 norms, vocabulary 202,048, untied embeddings; its language model counts 107.8 B (17.2 B active).
    return {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 4,
            "attention_chunk_size": 8192, "vocab_size": 202048, "tie_word_embeddings": False}


CONFIGS = {
    **{f"megatron-gpt-{size}": _gpt(*spec) for size, spec in _MEGATRON_2021.items()},
    **{f"llama3-{size}": _llama(*spec) for size, spec in _LLAMA3.items()},
    "deepseek-v3": _deepseek_v3(),
    "mlperf-gpt3-175b": _mlperf_gpt3(),
    "qwen3-235b-a22b": _qwen3_moe(94, 4096, 12288, 1536, 64),
    "qwen3-30b-a3b": _qwen3_moe(48, 2048, 6144, 768, 32),
    "gpt-oss-120b": _gpt_oss_120b(),
    "llama4-scout": _llama4_scout(),
}
"""File stem -> config dict."""


def main() -> None:
    for stem, data in CONFIGS.items():
        (HERE / f"{stem}.json").write_text(json.dumps(data) + "\n")
        print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
