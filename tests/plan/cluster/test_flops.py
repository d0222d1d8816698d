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

Gated DeltaNet (Qwen3-Next, Qwen3.5) runs transformers' PyTorch reference of the chunked kernel and of the causal
convolution, which count more than the model in three places (:func:`_reference_extra`): the convolution pads K - 1
positions on both sides and keeps the first L outputs, so it computes K - 1 outputs more, forward and for the input's
gradient; the counter takes a depthwise convolution's weight gradient for a dense one's (torch's
``conv_backward_flop`` ignores its groups: C times the work of C channels); and the backward of the two triangular
solves per chunk each multiplies the solution's gradient by the solution (``2 C² dv`` and ``2 C² dk``), where the
model counts the two gradient products of each of the forward's matmuls, less the products the reference never
makes: none with the zero initial state's gradient (first chunk) and none through the unused last state update.
"""

from __future__ import annotations

import pytest
from tests.plan.cluster.tiny import TINY, tiny_config, tiny_model

from pipeloom.plan.cluster import layer_counts, model_spec
from pipeloom.plan.cluster.model.kinds import is_linear, layer_kinds
from pipeloom.plan.cluster.model.spec import GDN_CHUNK

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


def _reference_extra(spec, kind):
    """``(F, I, W)`` FLOPs per sequence transformers' PyTorch reference of a Gated DeltaNet layer counts beyond the
    model (module docstring); zeros for other kinds."""
    g = spec.linear
    if not is_linear(kind):
        return 0, 0, 0
    padded = -(-SEQ // GDN_CHUNK) * GDN_CHUNK
    chunks, c, dk, dv = padded // GDN_CHUNK, GDN_CHUNK, g.key_dim, g.value_dim
    conv = 2 * g.mixed * (SEQ + g.conv_kernel - 1) * g.conv_kernel  # the padded convolution, as counted
    exact = 2 * g.mixed * SEQ * g.conv_kernel
    solves = g.value_heads * (chunks * 2 * c * c * (dk + dv) - 8 * c * dk * dv)
    return conv - exact, conv - exact + solves, g.mixed * conv - exact


@pytest.mark.parametrize("family", sorted(TINY))
def test_flops_per_kind_and_phase(family):
    config, forward, i, w = _measure(family)
    spec = model_spec(config)
    kinds = list(layer_kinds(spec))  # DeepSeek's sparse attention: its indexer layers count its forward
    counts = {kind: layer_counts(spec, kind, SEQ) for kind in {*kinds, "head", "embedding"}}
    extra = {kind: _reference_extra(spec, kind) for kind in kinds}
    prefix = next(name for name in forward if name.endswith(".lm_head")).removesuffix(".lm_head")
    for n, kind in enumerate(kinds):
        layer = next(v for name, v in forward.items() if name.endswith(f".layers.{n}") or name.endswith(f".h.{n}"))
        assert layer == BATCH * (counts[kind].f + extra[kind][0]), (n, kind)
    assert forward[f"{prefix}.lm_head"] == BATCH * counts["head"].f
    assert counts["embedding"].f == 0
    assert i == BATCH * (sum(counts[k].i + extra[k][1] for k in kinds) + counts["head"].i)
    assert w == BATCH * (sum(counts[k].w + extra[k][2] for k in kinds) + counts["head"].w)
