"""What transformers assumes for a config field a config.json leaves out, per ``model_type``: the defaults of its
configuration classes (transformers 5.x; ``tests/plan/cluster/test_params.py`` checks each against the installed
version's default config), for the fields :func:`pipeloom.plan.cluster.config.model_spec` reads where the class
default is not what the reader would otherwise assume (the query heads' count for ``num_key_value_heads``,
``hidden_size / num_attention_heads`` for ``head_dim``, no window, no experts, no multi-token prediction, a full q
projection). A field the config gives, ``null`` included, is read as given. A config still lacking a field the
reader needs (the published multimodal checkpoints' ``text_config`` give only what differs from the defaults)
takes every default from transformers itself where it is installed (:func:`transformers_defaults`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FAMILY_DEFAULTS", "transformers_defaults"]

_QWEN = {"sliding_window": 4096, "max_window_layers": 28}  # read only with use_sliding_window
_GEMMA = {"num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096}

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {**_QWEN, "num_key_value_heads": 32},
    "qwen3": {**_QWEN, "num_key_value_heads": 32, "head_dim": 128},
    "gemma": {"num_key_value_heads": 16, "head_dim": 256},
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "olmo3": {"sliding_window": 4096},
    "starcoder2": {"num_key_value_heads": 2},
    "mixtral": {"num_key_value_heads": 8},
    "qwen2_moe": {**_QWEN, "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"sliding_window": 4096, "num_key_value_heads": 4},  # every layer windowed: no max_window_layers
    "deepseek_v2": {"n_routed_experts": 64, "n_shared_experts": 2, "q_lora_rank": 1536},
    "deepseek_v3": {"num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "q_lora_rank": 1536,
                    "num_nextn_predict_layers": 1},
    "glm4_moe": {"num_key_value_heads": 8, "n_routed_experts": 128, "n_shared_experts": 1, "first_k_dense_replace": 1,
                 "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 1},
    "gpt_oss": {"num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128},
}
"""Per ``model_type``, the defaults a missing field takes (the families not listed have none that matter)."""


def transformers_defaults(data: Mapping[str, Any], family: str) -> dict[str, Any] | None:
    """``data`` with every field it leaves out as transformers' configuration class for ``family`` sets it (the
    published multimodal checkpoints' ``text_config`` give only what differs from those defaults); None without
    transformers, or where it refuses the fields."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        full = AutoConfig.for_model(family, **{k: v for k, v in data.items() if k != "model_type"}).to_dict()
    except Exception:  # noqa: BLE001 - whatever transformers refuses, the reader's own message stands
        return None
    return {**full, **data}
