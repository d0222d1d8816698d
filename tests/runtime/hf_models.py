"""Tiny random-init ``transformers`` models for the runtime tests (no downloads), their split points
and a language-model loss; importable by spawned ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 96
LAYERS = 4


def build_hf(name: str, *, dropout: float = 0.0, seed: int = 0) -> torch.nn.Module:
    """GPT-2 and BERT-MLM tie their head to the embedding; Qwen2 is built tied too; LLaMA is not.

    LLaMA and Qwen2 use eager attention: with SDPA, transformers skips the causal mask when it runs
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
    raise ValueError(name)


_BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer", "qwen2": "model.layers"}


def hf_splits(name: str, pieces: int) -> list[str]:
    """Split points cutting the model's 4 blocks into ``pieces`` pieces (1, 2 or 4)."""
    step = LAYERS // pieces
    return [f"{_BLOCKS[name]}.{k}" for k in range(step, LAYERS, step)]


def lm_loss(output: object, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of every position's logits (a ModelOutput's ``.logits``)."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def tokens(rows: int = 8, seq: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(1, VOCAB, (rows, seq), generator=generator),
            torch.randint(0, VOCAB, (rows, seq), generator=generator))
