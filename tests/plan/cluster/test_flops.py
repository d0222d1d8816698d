"""Matmul FLOPs per layer kind and phase against ``torch.utils.flop_counter.FlopCounterMode`` on tiny instances.

What is compared: FlopCounterMode counts mm/addmm/bmm (2 per multiply-add), i.e. every linear layer, the router, the lm
head and eager attention's QK^T and PV products over the full s x s square, as :mod:`pipeloom.plan.cluster.counts` does.
The forward is compared per decoder layer and for the head (the counter's per-module totals); the backward per phase
over the whole model: I is ``autograd.grad`` of the loss with respect to the layers' input only (every dX, the attention
core's backward, no dW), I + W the grad with respect to the input and every parameter. DeepSeek's sparse attention
(DeepSeek-V3.2, GLM-5) runs its indexer under ``no_grad``: its projections and score products count in the forward of
the layers that run one, in no backward, and transformers' eager attention still multiplies the whole square (the top-k
choice masks it). Routed experts see every token top-k times whatever the routing, so the MoE counts do not depend on
the random router (experts_implementation="eager": the per-expert loop of linear layers; the grouped-matmul kernel is
not seen by the counter).
"""

from __future__ import annotations

import pytest
from tests.plan.cluster.tiny import TINY, tiny_config, tiny_model

from pipeloom.plan.cluster import layer_counts, model_spec
from pipeloom.plan.cluster.model.kinds import layer_kinds

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
flop_counter = pytest.importorskip("torch.utils.flop_counter")

BATCH, SEQ = 2, 16


def _measure(family):
    config = tiny_config(family)
    torch.manual_seed(0)
    model = tiny_model(config, attn_implementation="eager", experts_implementation="eager")
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    x = model.get_input_embeddings()(ids).detach().requires_grad_()
    with flop_counter.FlopCounterMode(display=False) as counter:
        loss = model(inputs_embeds=x, labels=ids).loss
    forward = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    with flop_counter.FlopCounterMode(display=False) as counter:
        torch.autograd.grad(loss, [x], retain_graph=True)
    i = counter.get_total_flops()
    params = [p for p in model.parameters() if p.requires_grad]
    with flop_counter.FlopCounterMode(display=False) as counter:
        torch.autograd.grad(loss, [x, *params], allow_unused=True)
    return config, forward, i, counter.get_total_flops() - i


@pytest.mark.parametrize("family", sorted(TINY))
def test_flops_per_kind_and_phase(family):
    config, forward, i, w = _measure(family)
    spec = model_spec(config)
    kinds = list(layer_kinds(spec))  # DeepSeek's sparse attention: its indexer layers count its forward
    counts = {kind: layer_counts(spec, kind, SEQ) for kind in {*kinds, "head", "embedding"}}
    prefix = next(name for name in forward if name.endswith(".lm_head")).removesuffix(".lm_head")
    for n, kind in enumerate(kinds):
        layer = next(v for name, v in forward.items() if name.endswith(f".layers.{n}") or name.endswith(f".h.{n}"))
        assert layer == BATCH * counts[kind].f, (n, kind)
    assert forward[f"{prefix}.lm_head"] == BATCH * counts["head"].f
    assert counts["embedding"].f == 0
    assert i == BATCH * (sum(counts[k].i for k in kinds) + counts["head"].i)
    assert w == BATCH * (sum(counts[k].w for k in kinds) + counts["head"].w)
