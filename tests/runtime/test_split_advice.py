"""What the split's errors say: the names they offer are the model's modules (no torch.export internals), and
a model torch.export cannot follow (a data-dependent Python loop) is told what works."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import fx

from pipeloom.runtime import ModelTraceError, split_model
from pipeloom.runtime.model.tracing import module_scopes


def test_exports_stand_in_scope_is_no_module_name():
    graph = fx.Graph()
    node = graph.placeholder("x")
    key = "_empty_nn_module_stack_from_metadata_hook"  # what torch.export's passes put on nodes they add
    node.meta["nn_module_stack"] = {key: (key, key), "L__self___layers_0": ("layers.0", "Linear")}
    assert module_scopes(node) == ["layers.0"]


def test_a_mixture_of_experts_looping_in_python_is_told_what_works():
    transformers = pytest.importorskip("transformers")

    def mixtral(**options):
        torch.manual_seed(0)
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False,
            attn_implementation="eager", **options))

    x = torch.randint(1, 96, (8, 12))
    with pytest.raises(ModelTraceError, match="experts_implementation unset") as refused:
        split_model(mixtral(experts_implementation="eager"), ["model.layers.1"], example_inputs=(x,))
    assert "stages_from_modules" in str(refused.value) and "grouped_mm" in str(refused.value)
    staged = split_model(mixtral(), ["model.layers.1"], example_inputs=(x,))  # what the advice says works
    assert staged.num_stages == 2


def test_a_dense_model_looping_in_python_is_not_told_about_experts():
    """transformers 5 sets experts_implementation on every model: a dense Llama whose dynamic RoPE branches on the
    sequence length had been told to change its (absent) experts' kernel (a new user's trial, 2026-12-07)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    x = torch.randint(1, 96, (4, 12))
    with pytest.raises(ModelTraceError, match="loops in Python on tensor values") as refused:
        split_model(model, ["model.layers.1"], example_inputs=(x,))
    assert "experts" not in str(refused.value).split("Split it by hand")[0]


def test_inputs_passed_by_position_are_named_with_the_parameters_they_reach():
    """GPT-2 given (ids, mask) takes the mask as its cache: the refusal had offered a hand split alone (a new
    user's trial, 2026-12-07); it names where the inputs went and how to pass a mask."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96,
                                                                 n_positions=32, bos_token_id=0, eos_token_id=0))
    x = torch.randint(1, 96, (4, 12))
    with pytest.raises(ModelTraceError, match=r"The inputs go to forward's input_ids, \w+ by position; to pass "
                                              r"others \(an attention mask\), wrap the model"):
        split_model(model, ["transformer.h.1"], example_inputs=(x, torch.ones_like(x)))
