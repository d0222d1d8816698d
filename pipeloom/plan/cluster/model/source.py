"""Where a model config comes from, and what it leaves out.

:func:`read_config` gives the config as a dict from what a user has at hand: a ``config.json``, the folder of a
downloaded model (its ``config.json``), a Hugging Face model id whose config is in the local Hugging Face cache
(``hf download ID config.json`` or any earlier download put it there; nothing is fetched: the planner plans
clusters from any machine, often one without the network), a dict, or a ``PretrainedConfig``.

:data:`FAMILY_DEFAULTS` is what transformers assumes for a config field a config.json leaves out, per
``model_type``: the defaults of its configuration classes (transformers 5.x; ``tests/plan/cluster/test_params.py``
checks each against the installed version), for every field :func:`pipeloom.plan.cluster.model.reader.model_spec` reads
that the class sets (a field the class leaves to its post-init, such as ``num_key_value_heads`` = the query heads
or ``head_dim`` = hidden / heads, the reader derives the same way). The published multimodal checkpoints'
``text_config`` give only what differs from these. A field the config gives, ``null`` included, is read as given.
The planner reads configs without importing transformers (it plans clusters it does not run on), so the defaults
are data here."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeloom.ir.jsonfields import DuplicateKeyError, json_failure, unique_keys
from pipeloom.plan.errors import ModelConfigError

__all__ = ["FAMILY_DEFAULTS", "read_config", "hub_cache"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""A Hugging Face model id: ``name`` or ``owner/name``."""


def read_config(config: object) -> dict[str, Any]:
    """The config as a dict: from a path to a config.json, a model folder holding one, a Hugging Face model id
    whose config is in the local cache (:func:`hub_cache`), a mapping, or anything with ``to_dict()``."""
    if isinstance(config, (str, Path)):
        path = _config_path(str(config))
        try:  # a byte-order mark, as some editors write, allowed; a key given twice refused (json keeps the last)
            data = json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=unique_keys)
        except OSError as error:
            raise ModelConfigError(f"cannot read model config {str(path)!r}: {error.strerror}; pass the path of a "
                                   "transformers config.json") from None
        except DuplicateKeyError as error:
            raise ModelConfigError(f"model config {str(path)!r} gives {error.args[0]!r} twice; keep one") from None
        except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, a number past Python's digits
            raise ModelConfigError(f"model config {str(path)!r} is not JSON ({json_failure(error)})") from None
    elif isinstance(config, Mapping):
        data = dict(config)
    elif callable(getattr(config, "to_dict", None)):
        data = config.to_dict()  # type: ignore[attr-defined]
    else:
        raise ModelConfigError(f"a model config must be a config.json path, a model folder, a Hugging Face model "
                               f"id, a dict or a PretrainedConfig, got {type(config).__name__}")
    if not isinstance(data, dict):
        raise ModelConfigError("a model config must be a JSON object")
    return data


def _config_path(name: str) -> Path:
    """The config.json ``name`` stands for: the file itself, a folder's config.json, or a model id's cached one."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelConfigError(f"model folder {name!r} has no config.json; pass the path of a transformers "
                                   "config.json")
        return path / "config.json"
    if path.exists() or name.endswith(".json") or not _HUB_ID.fullmatch(name):
        return path  # a file (or a path that is not there: read_config says so)
    cache = hub_cache()
    found = _cached_config(cache / f"models--{name.replace('/', '--')}")
    if found is None:
        raise ModelConfigError(f"cannot read model config {name!r}: no such file or folder, and the local Hugging "
                               f"Face cache ({cache}) holds no config of a model {name!r}; download it (hf download "
                               f"{name} config.json) or pass the path of a transformers config.json")
    return found


def hub_cache() -> Path:
    """The local Hugging Face cache, where ``huggingface_hub`` puts it: ``$HF_HUB_CACHE``, else
    ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, ``$HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface``
    (``~/.cache/huggingface``)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _cached_config(repo: Path) -> Path | None:
    """A cached model's config.json: the snapshot ``refs/main`` names, else the only snapshot that has one."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        chosen = repo / "snapshots" / ref.read_text().strip() / "config.json"
        if chosen.is_file():
            return chosen
    snapshots = sorted((repo / "snapshots").glob("*/config.json")) if (repo / "snapshots").is_dir() else []
    if len(snapshots) > 1:
        main = "whose refs/main names none of them" if ref.is_file() else "and no refs/main"
        raise ModelConfigError(f"the local Hugging Face cache holds {len(snapshots)} revisions of {repo.name} {main}; "
                               "pass the path of the config.json to plan")
    return snapshots[0] if snapshots else None


_DEEPSEEK_V32: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "attention_bias": False, "tie_word_embeddings": False, "index_topk": 2048, "index_head_dim": 128,
    "index_n_heads": 64}
"""transformers' DeepSeek-V3.2 configuration defaults, which GLM-5's (``glm_moe_dsa``) derive from."""

_GATED_DELTANET: dict[str, Any] = {
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attention_bias": False,
    "tie_word_embeddings": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32}
"""transformers' defaults common to Qwen3-Next's and Qwen3.5's configurations (each family sets the rest)."""

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "vocab_size": 32000, "attention_bias": False, "mlp_bias": False},
    "mistral": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096},
    "qwen2": {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": 151936, "sliding_window": 4096, "use_sliding_window": False,
              "max_window_layers": 28},
    "qwen3": {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 151936, "sliding_window": 4096,
              "use_sliding_window": False, "max_window_layers": 28, "attention_bias": False},
    "gemma": {"hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000, "attention_bias": False,
              "tie_word_embeddings": True},
    "gemma2": {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
               "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000, "sliding_window": 4096,
               "attention_bias": False, "tie_word_embeddings": True, "final_logit_softcapping": 30.0},
    "gemma3_text": {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208, "sliding_window": 4096,
                    "attention_bias": False, "tie_word_embeddings": True},
    "granite": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                "vocab_size": 32000, "attention_bias": False, "mlp_bias": False},
    "phi3": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
             "vocab_size": 32064, "resid_pdrop": 0.0},
    "olmo": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "vocab_size": 50304, "attention_bias": False, "clip_qkv": None},
    "olmo2": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "vocab_size": 50304, "attention_bias": False},
    "olmo3": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "vocab_size": 50304, "sliding_window": 4096, "attention_bias": False},
    "smollm3": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
                "num_key_value_heads": 4, "vocab_size": 128256, "attention_bias": False, "mlp_bias": False,
                "tie_word_embeddings": True},
    "starcoder2": {"hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30, "num_attention_heads": 24,
                   "num_key_value_heads": 2, "vocab_size": 49152, "use_bias": True, "tie_word_embeddings": True,
                   "residual_dropout": 0.0, "embedding_dropout": 0.0},
    "cohere": {"hidden_size": 8192, "intermediate_size": 22528, "num_hidden_layers": 40, "num_attention_heads": 64,
               "num_key_value_heads": 64, "vocab_size": 256000, "attention_bias": False, "use_qk_norm": False,
               "tie_word_embeddings": True},
    "cohere2": {"hidden_size": 8192, "intermediate_size": 22528, "num_hidden_layers": 40, "num_attention_heads": 64,
                "num_key_value_heads": 64, "vocab_size": 256000, "attention_bias": False, "sliding_window": 4096,
                "tie_word_embeddings": True},
    "ernie4_5": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 103424, "use_bias": False,
                 "tie_word_embeddings": True},
    "ernie4_5_moe": {"hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 28,
                     "num_attention_heads": 20, "num_key_value_heads": 4, "vocab_size": 103424, "use_bias": False,
                     "tie_word_embeddings": True, "moe_intermediate_size": 1536, "moe_k": 6, "moe_num_experts": 64,
                     "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": -1,
                     "moe_layer_interval": 1},
    "glm": {"hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32,
            "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151552, "attention_bias": True,
            "tie_word_embeddings": False},
    "glm4": {"hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32,
             "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151552, "attention_bias": True,
             "tie_word_embeddings": False},
    "falcon": {"vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
               "alibi": False, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
               "bias": False, "tie_word_embeddings": True, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "minimax_m2": {"vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
                   "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "num_experts_per_tok": 8,
                   "num_local_experts": 256, "tie_word_embeddings": False},
    "seed_oss": {"vocab_size": 155136, "hidden_size": 4096, "intermediate_size": 27648, "num_hidden_layers": 64,
                 "num_attention_heads": 80, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True,
                 "attention_out_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "residual_dropout": 0.1},
    "exaone4": {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 32, "sliding_window": 4096,
                "sliding_window_pattern": 4, "tie_word_embeddings": False},
    "glm4_moe_lite": {"vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
                      "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                      "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64, "kv_lora_rank": 512,
                      "q_lora_rank": 768, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
                      "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4, "attention_bias": False,
                      "tie_word_embeddings": False},
    "deepseek_v32": _DEEPSEEK_V32,
    # GLM-5: transformers' configuration class derives from DeepSeek-V3.2's, these the fields it sets anew
    "glm_moe_dsa": {**_DEEPSEEK_V32, "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
                    "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
                    "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "index_n_heads": 32},
    "dots1": {"vocab_size": 152064, "hidden_size": 4608, "intermediate_size": 10944, "moe_intermediate_size": 1408,
              "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 32, "n_group": 1,
              "topk_group": 1, "first_k_dense_replace": 0, "attention_bias": False, "tie_word_embeddings": False},
    "mistral4": {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 32, "n_shared_experts": 1,
                 "n_routed_experts": 128, "kv_lora_rank": 256, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
                 "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4,
                 "first_k_dense_replace": 0, "attention_bias": False, "tie_word_embeddings": False},
    "ministral": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096, "tie_word_embeddings": False},
    "ministral3": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
                   "tie_word_embeddings": False},
    "helium": {"hidden_size": 2560, "intermediate_size": 7040, "num_hidden_layers": 24, "num_attention_heads": 20,
               "num_key_value_heads": 20, "head_dim": 128, "vocab_size": 48000, "attention_bias": False,
               "mlp_bias": False, "tie_word_embeddings": False},
    "arcee": {"hidden_size": 2560, "intermediate_size": 18432, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "head_dim": 80, "vocab_size": 32000, "attention_bias": False,
              "mlp_bias": False, "tie_word_embeddings": False},
    "hunyuan_v1_dense": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                         "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 290943,
                         "attention_bias": False, "tie_word_embeddings": False},
    "hunyuan_v1_moe": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                       "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 290943, "num_experts": 1,
                       "moe_topk": 1, "attention_bias": False, "tie_word_embeddings": False},
    "gpt2": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
             "tie_word_embeddings": True, "resid_pdrop": 0.1, "embd_pdrop": 0.1},
    "phi": {"vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
            "num_attention_heads": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "qk_layernorm": False},
    "gptj": {"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "tie_word_embeddings": False},
    "gpt_neox": {"hidden_size": 6144, "intermediate_size": 24576, "num_hidden_layers": 44, "num_attention_heads": 64,
                 "vocab_size": 50432, "attention_bias": True, "use_parallel_residual": True, "hidden_dropout": 0.0},
    "mixtral": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2},
    "granitemoe": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "attention_bias": False,
                   "tie_word_embeddings": False},
    "granitemoeshared": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_local_experts": 8,
                         "num_experts_per_tok": 2, "attention_bias": False, "shared_intermediate_size": 0,
                         "tie_word_embeddings": False},
    "phimoe": {"vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "num_experts_per_tok": 2, "num_local_experts": 16,
               "attention_bias": False, "lm_head_bias": False, "input_jitter_noise": 0.0, "tie_word_embeddings": False},
    "olmoe": {"hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
              "vocab_size": 50304, "attention_bias": False, "num_experts": 64, "num_experts_per_tok": 8,
              "tie_word_embeddings": False},
    "qwen2_moe": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "vocab_size": 151936, "sliding_window": 4096, "use_sliding_window": False,
                  "max_window_layers": 28, "qkv_bias": True, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1},
    "qwen2_vl_text": {"hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064, "sliding_window": 4096,
                      "use_sliding_window": False, "max_window_layers": 80},
    "qwen2_5_vl_text": {"hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                        "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 80},
    "qwen3_vl_text": {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 151936,
                      "attention_bias": False},
    "qwen3_vl_moe_text": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 151936,
                          "attention_bias": False, "moe_intermediate_size": 1408, "num_experts": 60,
                          "num_experts_per_tok": 4, "decoder_sparse_step": 1, "tie_word_embeddings": True},
    "qwen3_moe": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "vocab_size": 151936, "sliding_window": 4096, "use_sliding_window": False,
                  "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "decoder_sparse_step": 1},
    "deepseek_v2": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "vocab_size": 102400, "attention_bias": False, "mlp_bias": False, "moe_intermediate_size": 1407,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "q_lora_rank": 1536,
                    "kv_lora_rank": 512, "n_routed_experts": 64, "n_shared_experts": 2, "first_k_dense_replace": 0},
    "deepseek_v3": {"hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
                    "attention_bias": False, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "q_lora_rank": 1536,
                    "kv_lora_rank": 512, "n_routed_experts": 256, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
                    "first_k_dense_replace": 3, "num_nextn_predict_layers": 1},
    "glm4_moe": {"hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46, "num_attention_heads": 96,
                 "num_key_value_heads": 8, "vocab_size": 151552, "attention_bias": False, "use_qk_norm": False,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "n_routed_experts": 128,
                 "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                 "num_nextn_predict_layers": 1},
    "gpt_oss": {"hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "sliding_window": 128,
                "attention_bias": True, "num_local_experts": 128, "num_experts_per_tok": 4},
    "llama4_text": {"hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 202048, "tie_word_embeddings": False, "attention_bias": False,
                    "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                    "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192},
    "qwen3_next": {**_GATED_DELTANET, "vocab_size": 151936, "intermediate_size": 5632, "num_hidden_layers": 48,
                   "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                   "num_experts_per_tok": 10, "num_experts": 512},
    "qwen3_5_text": {**_GATED_DELTANET, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                     "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4},
    "qwen3_5_moe_text": {**_GATED_DELTANET, "vocab_size": 248320, "num_hidden_layers": 40,
                         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                         "num_experts_per_tok": 8, "num_experts": 256},
    "olmo_hybrid": {"vocab_size": 100352, "hidden_size": 3840, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 30, "attention_bias": False, "tie_word_embeddings": False,
                    "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True},
}
"""Per ``model_type``, the value a field the config leaves out takes."""
