"""Writes the model configs (transformers ``config.json`` files) of the published runs in
``benchmarks/data/published_runs.json``, every size taken from the paper or model card named beside it.

Run: ``python benchmarks/data/configs/make_configs.py`` (needs transformers; rewrites the JSON files here).
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

# Llama 3 family (Llama 3 paper, arXiv:2407.21783, Table 3; the Llama 3.1 model cards' config.json):
# layers, hidden, FFN, heads, KV heads; vocabulary 128,256, RoPE theta 500,000, untied embeddings.
_LLAMA3 = {"8b": (32, 4096, 14336, 32, 8), "70b": (80, 8192, 28672, 64, 8), "405b": (126, 16384, 53248, 128, 8)}


def _gpt(heads: int, hidden: int, layers: int) -> dict:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=51200, n_positions=2048, n_embd=hidden, n_layer=layers, n_head=heads,
                      activation_function="gelu", tie_word_embeddings=True).to_dict()


def _llama(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int) -> dict:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                       hidden_act="silu").to_dict()


def _deepseek_v3() -> dict:
    # DeepSeek-V3 technical report (arXiv:2412.19437) sec. 4.2: 61 layers, hidden 7168, 128 heads of 128, KV
    # compression 512, query compression 1536, decoupled RoPE 64; first 3 layers dense (FFN 18432); MoE layers:
    # 1 shared + 256 routed experts of 2048, 8 routed per token, at most 4 nodes per token (8 groups, top 4);
    # vocabulary 129,280; multi-token prediction depth 1. These are transformers' DeepseekV3Config defaults.
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, max_position_embeddings=4096, tie_word_embeddings=False)
    return config.to_dict()


CONFIGS = {
    **{f"megatron-gpt-{size}": (lambda spec=spec: _gpt(*spec)) for size, spec in _MEGATRON_2021.items()},
    **{f"llama3-{size}": (lambda spec=spec: _llama(*spec)) for size, spec in _LLAMA3.items()},
    "deepseek-v3": _deepseek_v3,
}
"""File stem -> function building the config dict."""


def main() -> None:
    for stem, build in CONFIGS.items():
        data = build()
        data.pop("transformers_version", None)  # the numbers, not the writer's version
        (HERE / f"{stem}.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
