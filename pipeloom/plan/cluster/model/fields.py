"""Reading one field of a transformers config dict: :func:`get_field` (the first of its names given, or a
default), :func:`same_per_layer` (a number given once or per layer), :func:`rate_on` (whether a dropout or noise rate
is on, checked), :func:`nope_layers` (the layers without rotary embeddings), :func:`head_size` (an attention head's
width) and :func:`check_fields` (the sizes and switches every family reads, checked for their type before any is
used)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeloom.plan.errors import ModelConfigError

__all__ = ["get_field", "same_per_layer", "rate_on", "nope_layers", "head_size", "WHOLE_HEADS", "check_fields"]

_COUNTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_key_value_heads", "head_dim",
           "n_embd", "n_head", "n_layer", "n_positions", "max_position_embeddings", "n_inner",
           "num_experts_per_tok", "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
           "moe_topk", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "interleave_moe_layer_step",
           "decoder_sparse_step", "moe_layer_freq", "intermediate_size")
"""Sizes that are whole numbers of at least 1 wherever a config gives them (a few may be one per layer:
:func:`same_per_layer`)."""
_SIZES = ("moe_intermediate_size", "shared_expert_intermediate_size", "first_k_dense_replace",
          "n_shared_experts", "num_nextn_predict_layers", "qk_nope_head_dim", "q_lora_rank")
"""Sizes that are whole numbers, 0 allowed (0: the part is absent)."""
_PER_LAYER = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_topk", "moe_intermediate_size")
"""Sizes a config may give once per layer (Hunyuan MoE: :func:`same_per_layer`)."""
_SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "use_parallel_residual",
             "use_bias", "qkv_bias", "attention_out_bias")
"""Switches, true or false."""
_OBJECTS = ("rope_scaling", "rope_parameters")
"""Objects (a rotary embedding's scaling: a JSON object or null)."""


def check_fields(data: Mapping[str, Any]) -> None:
    """ModelConfigError naming the field where a size of :data:`_COUNTS` or :data:`_SIZES` is not a whole number in
    range (a list of them where one per layer may be given), or a switch of :data:`_SWITCHES` not true or false;
    null is a field left out. Checked before any is read, so that a wrong type is named, not met as a crash."""
    for names, least in ((_COUNTS, 1), (_SIZES, 0)):
        for name in names:
            value = data.get(name)
            values = value if isinstance(value, (list, tuple)) and name in _PER_LAYER else [value]
            if value is not None and not all(isinstance(v, int) and not isinstance(v, bool) and v >= least
                                             for v in values):
                raise ModelConfigError(f"{name} must be a whole number >= {least}, got {value!r}: fix the config's "
                                       f"\"{name}\"")
    for name in _SWITCHES:
        value = data.get(name)
        if value is not None and not isinstance(value, bool):
            raise ModelConfigError(f"{name} must be true or false, got {value!r}: fix the config's \"{name}\"")
    for name in _OBJECTS:  # not priced (rotary embeddings are elementwise work), but transformers refuses these too
        value = data.get(name)
        if value is not None and not isinstance(value, Mapping):
            raise ModelConfigError(f"{name} must be an object such as {{\"rope_type\": \"yarn\", \"factor\": 4.0}} or "
                                   f"null, got {value!r}: fix the config's \"{name}\"")



def get_field(data: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (and not None) in ``data``; ModelConfigError if none is and no default."""
    for name in names:
        if data.get(name) is not None:
            return data[name]
    if default is None:
        given = [other for name in names for other in _OTHER_NAMES.get(name, ()) if data.get(other) is not None]
        hint = (f" (it gives {' and '.join(given)}, a name {data.get('model_type')} configs do not read: rename it "
                f"{names[0]})" if given else "")
        raise ModelConfigError(f"model config ({data.get('model_type')}) has no {' / '.join(names)}{hint}")
    return default


_OTHER_NAMES = {"num_attention_heads": ("n_head", "n_heads", "num_heads"),
                "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
                "hidden_size": ("n_embd", "n_embed", "d_model"),
                "intermediate_size": ("n_inner", "ffn_hidden_size", "ffn_dim", "d_ff"),
                "vocab_size": ("n_vocab", "padded_vocab_size")}
"""Names other model families (GPT-2, BLOOM, Falcon, T5, OPT, Megatron) give a field, named where a family that reads
the field by its own name finds only one of them."""


def same_per_layer(data: Mapping[str, Any], *names: str) -> int:
    """:func:`get_field` of a whole number a config may give per layer (Hunyuan MoE's ``num_experts`` and ``moe_topk``):
    one value, or a list of one value repeated; a list of different values is refused (the planner's MoE layers are
    all alike)."""
    value = get_field(data, *names)
    values = set(value) if isinstance(value, (list, tuple)) else {value}
    if len(values) != 1 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ModelConfigError(f"{' / '.join(names)} must be one positive whole number, or the same one for every "
                               f"layer (the planner's MoE layers are all alike), got {value!r}")
    return int(values.pop())


def rate_on(data: Mapping[str, Any], name: str, what: str = "a dropout probability") -> bool:
    """Whether the config's dropout (or other training noise) ``name`` is on: a value in (0, 1); absent, null or 0:
    off; anything else refused, saying it must be ``what``."""
    value = data.get(name)
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ModelConfigError(f"{name} must be {what} in [0, 1), got {value!r}")
    return value > 0


def nope_layers(data: Mapping[str, Any], layers: int, *, empty_is_default: bool = False) -> tuple[int, ...]:
    """The layers without rotary embeddings: those the config's ``no_rope_layers`` marks 0 (1: rotary), by default
    every ``no_rope_layer_interval``-th (Llama 4's and SmolLM3's 4); an empty list is the default where
    ``empty_is_default`` (Llama 4's configuration class reads it so)."""
    rope = data.get("no_rope_layers")
    if rope is None or (empty_is_default and not rope):
        interval = data.get("no_rope_layer_interval")
        interval = 4 if interval is None else interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ModelConfigError(f"no_rope_layer_interval must be a positive whole number of layers, got "
                                   f"{interval!r}")
        rope = [int((n + 1) % interval != 0) for n in range(layers)]
    if not isinstance(rope, (list, tuple)) or len(rope) < layers or any(value not in (0, 1) for value in rope):
        raise ModelConfigError(f"no_rope_layers must give 1 (rotary) or 0 (NoPE) for each of the {layers} layers, "
                               f"got {rope!r}")
    return tuple(n for n in range(layers) if not rope[n])


WHOLE_HEADS = frozenset({"llama", "arcee", "gemma2", "gemma3_text", "gpt_neox", "deepseek_v2", "gpt2", "gptj",
                         "falcon"})
"""Families whose transformers classes (5.x: the config's checks or the attention's) refuse a hidden size the attention
heads do not divide where no ``head_dim`` is given; the others build heads of ``hidden // heads`` (Mistral, Qwen2,
Phi, GLM-4.5 with its default 4096 / 96), as the planner then counts them."""


def head_size(data: Mapping[str, Any], hidden: int, heads: int, family: str, *, field: bool = True) -> int:
    """An attention head's width: the config's ``head_dim`` (where the family has the ``field``), or the hidden size
    over the heads, refused where :data:`WHOLE_HEADS`' transformers classes refuse it: ModelConfigError naming the
    near counts."""
    if field and data.get("head_dim"):
        return int(data["head_dim"])
    if hidden % heads and family in WHOLE_HEADS:
        fits = [k for k in range(1, hidden + 1) if hidden % k == 0]
        near = sorted(sorted(fits, key=lambda k: (abs(k - heads), k))[:2])
        raise ModelConfigError(f"the hidden size {hidden} is not a multiple of {heads} attention heads"
                               f"{', and the config gives no head_dim' if field else ''} (transformers refuses it "
                               f"too): check the attention heads' count, e.g. {' or '.join(map(str, near))}, which "
                               f"divide {hidden}{', or give head_dim' if field else ''}")
    return hidden // heads
