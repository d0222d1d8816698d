"""The GPT-2 lineage's readers (:func:`~pipeloom.plan.cluster.model.reader.model_spec` calls them by ``model_type``):
GPT-2, GPT-J, Phi-1 / 1.5 / 2 and Falcon, decoders of LayerNorms, biased projections and GELU MLPs, the last three
with attention and MLP side by side."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeloom.plan.cluster.model.fields import get_field, head_size
from pipeloom.plan.cluster.model.spec import Attention, ModelSpec
from pipeloom.plan.errors import ModelConfigError

__all__ = ["falcon_spec", "gpt2_spec", "gptj_spec", "phi_spec"]


def gpt2_spec(data: Mapping[str, Any]) -> ModelSpec:
    """GPT-2: learned positions, LayerNorm, biased Conv1D projections, a 4h (or n_inner) GELU MLP, tied head."""
    hidden = int(get_field(data, "n_embd", "hidden_size"))
    heads = int(get_field(data, "n_head", "num_attention_heads"))
    attention = Attention(heads=heads, kv_heads=heads, qk_dim=head_size(data, hidden, heads, "gpt2", field=False),
                          v_dim=hidden // heads, qkv_bias=True, o_bias=True)
    return ModelSpec(family="gpt2", hidden=hidden, layers=int(get_field(data, "n_layer", "num_hidden_layers")),
                     vocab=int(get_field(data, "vocab_size")), attention=attention,
                     intermediate=int(data.get("n_inner") or 4 * hidden), gated=False, mlp_bias=True,
                     layer_norm=True, tied=bool(data.get("tie_word_embeddings", False)),
                     positions=int(get_field(data, "n_positions", "max_position_embeddings")))


def phi_spec(data: Mapping[str, Any]) -> ModelSpec:
    """Phi-1 / 1.5 / 2 (``phi``): :func:`_parallel_gelu` with biased q/k/v and dense projections, grouped-query
    attention where ``num_key_value_heads`` says so, an MLP of ``intermediate_size``. Its ``qk_layernorm`` (a
    LayerNorm over each head's queries and keys, off in Phi-1.5 and Phi-2) is refused."""
    if data.get("qk_layernorm"):
        raise ModelConfigError("a phi config with qk_layernorm=true is not modelled (a LayerNorm with a bias over "
                               "each head's queries and keys); plan it with qk_layernorm false, as Phi-1.5 and Phi-2 "
                               "are, which leaves out 4 x head_dim parameters per layer")
    heads = int(get_field(data, "num_attention_heads"))
    return _parallel_gelu(data, "phi", kv_heads=int(data.get("num_key_value_heads") or heads), bias=True,
                          intermediate=int(get_field(data, "intermediate_size")))


def gptj_spec(data: Mapping[str, Any]) -> ModelSpec:
    """GPT-J (``gptj``): :func:`_parallel_gelu` with unbiased q/k/v and output projections, every head its own key
    and value, an MLP of ``n_inner`` (4h when null)."""
    heads = int(get_field(data, "n_head", "num_attention_heads"))
    hidden = int(get_field(data, "n_embd", "hidden_size"))
    return _parallel_gelu(data, "gptj", kv_heads=heads, bias=False, intermediate=int(data.get("n_inner") or 4 * hidden))


def _parallel_gelu(data: Mapping[str, Any], family: str, *, kv_heads: int, bias: bool,
                   intermediate: int) -> ModelSpec:
    """Phi's and GPT-J's layer: one LayerNorm before attention and a GELU MLP side by side, both added to the
    residual stream; biased MLP projections (``fc1``/``fc2``, ``fc_in``/``fc_out``), the attention's under ``bias``,
    a final LayerNorm and a head with a bias of its own, untied unless the config ties it; rotary on part of each head
    (no parameters)."""
    hidden = int(get_field(data, "hidden_size", "n_embd"))
    heads = int(get_field(data, "num_attention_heads", "n_head"))
    width = head_size(data, hidden, heads, family, field=family == "phi")  # Phi reads head_dim, GPT-J does not
    attention = Attention(heads=heads, kv_heads=kv_heads, qk_dim=width, v_dim=width, qkv_bias=bias, o_bias=bias)
    return ModelSpec(family=family, hidden=hidden, layers=int(get_field(data, "num_hidden_layers", "n_layer")),
                     vocab=int(get_field(data, "vocab_size")), attention=attention, intermediate=intermediate,
                     gated=False, mlp_bias=True, layer_norm=True, parallel_residual=True, shared_norm=True,
                     head_bias=True, tied=bool(data.get("tie_word_embeddings", False)))


def falcon_spec(data: Mapping[str, Any]) -> ModelSpec:
    """Falcon: LayerNorm, one fused q/k/v projection, a GELU MLP of ``ffn_hidden_size`` (4h), biases on every
    projection under ``bias``, a tied head. Attention and MLP side by side under ``parallel_attn`` (or the new
    decoder architecture of Falcon 40B / 180B), each after a LayerNorm of its own there (``num_ln_in_parallel_attn``
    2, its default) or after one shared LayerNorm (1; the 7B's); one query-shared key/value head under
    ``multi_query`` in the old architecture, ``num_kv_heads`` in the new. ALiBi (``alibi``) is refused: its
    attention adds a bias per head to the scores, which the flash-attention pricing does not model."""
    if data.get("alibi"):
        raise ModelConfigError("a Falcon config with alibi=true is not modelled (its attention adds a bias per head to "
                               "the scores, which the planner's flash-attention pricing does not cover); plan a "
                               "rotary Falcon (alibi false) of the same sizes instead")
    hidden = int(get_field(data, "hidden_size", "n_embed"))
    heads = int(get_field(data, "num_attention_heads"))
    new = bool(data.get("new_decoder_architecture", False))
    # the old architecture's fused projection gives every head its key and value, or one for all (multi_query)
    kv_heads = int(data.get("num_kv_heads") or heads) if new else 1 if data.get("multi_query", True) else heads
    bias = bool(data.get("bias", False))
    parallel = bool(data.get("parallel_attn", True)) or new
    norms = int(data.get("num_ln_in_parallel_attn") or (2 if new else 1))
    attention = Attention(heads=heads, kv_heads=kv_heads, qk_dim=head_size(data, hidden, heads, "falcon", field=False),
                          v_dim=hidden // heads, qkv_bias=bias, o_bias=bias)
    return ModelSpec(family="falcon", hidden=hidden, layers=int(get_field(data, "num_hidden_layers")),
                     vocab=int(get_field(data, "vocab_size")), attention=attention,
                     intermediate=int(data.get("ffn_hidden_size") or 4 * hidden), gated=False, mlp_bias=bias,
                     layer_norm=True, parallel_residual=parallel, shared_norm=parallel and norms == 1,
                     tied=bool(data.get("tie_word_embeddings", True)))
