"""The kinds of a model's decoder layers as the cluster planner counts and prices them (:func:`layer_kinds`): the
MLP's (``dense``, ``moe``) with suffixes for what changes the attention (:data:`WINDOWED`, :data:`SPARSE`,
:data:`REUSED`, :data:`NOPE`) or takes its place (:data:`LINEAR`), and the predicates that read a kind back."""

from __future__ import annotations

from pipeloom.plan.cluster.model.spec import ModelSpec

__all__ = ["WINDOWED", "NOPE", "SPARSE", "REUSED", "LINEAR", "layer_kinds", "block_kind", "is_windowed", "is_nope",
           "is_sparse", "is_linear", "has_indexer", "attended_window"]

WINDOWED = "-window"
"""The suffix of a decoder layer kind whose attention is windowed (``dense-window``, ``moe-window``): a sliding
window, or chunks (:attr:`~pipeloom.plan.cluster.model.spec.ModelSpec.chunked`)."""
NOPE = "-nope"
"""The suffix of a decoder layer kind without rotary embeddings (``dense-nope``, ``moe-window-nope``)."""
SPARSE = "-sparse"
"""The suffix of a decoder layer kind with DeepSeek's sparse attention that runs an indexer of its own
(``moe-sparse``)."""
REUSED = "-reused"
"""The suffix of a decoder layer kind with DeepSeek's sparse attention that reuses the top-k keys of the last indexer
layer before it (GLM-5's ``"shared"`` layers: ``moe-reused``)."""

LINEAR = "-linear"
"""The suffix of a decoder layer kind whose token mixer is Gated DeltaNet instead of attention (the
``"linear_attention"`` layers of Qwen3-Next, Qwen3.5 and OLMo hybrid: ``moe-linear``, ``dense-linear``)."""


def _attention_kind(kind: str) -> str:
    """``kind`` without :data:`NOPE`, :data:`SPARSE` and :data:`REUSED`."""
    return kind.removesuffix(NOPE).removesuffix(SPARSE).removesuffix(REUSED)


def block_kind(kind: str) -> str:
    """The kind of a layer's MLP: ``kind`` without :data:`WINDOWED`, :data:`SPARSE`, :data:`REUSED`, :data:`NOPE`
    and :data:`LINEAR`."""
    return _attention_kind(kind.removesuffix(LINEAR)).removesuffix(WINDOWED)


def is_linear(kind: str) -> bool:
    """Whether a layer of ``kind`` mixes its tokens by Gated DeltaNet: a :data:`LINEAR` kind."""
    return kind.endswith(LINEAR)


def is_windowed(kind: str) -> bool:
    """Whether a layer of ``kind`` attends in a window (or chunks): a :data:`WINDOWED` kind."""
    return _attention_kind(kind).endswith(WINDOWED)


def is_sparse(kind: str) -> bool:
    """Whether a layer of ``kind`` attends to the top-k keys an indexer selects: a :data:`SPARSE` or :data:`REUSED`
    kind."""
    return kind.removesuffix(NOPE).endswith((SPARSE, REUSED))


def has_indexer(kind: str) -> bool:
    """Whether a layer of ``kind`` runs an indexer of its own: a :data:`SPARSE` kind."""
    return kind.removesuffix(NOPE).endswith(SPARSE)


def attended_window(spec: ModelSpec, kind: str) -> int:
    """The keys a query of a layer of ``kind`` attends to at most, 0 for its whole causal prefix: its sliding window
    (or chunk), or under DeepSeek's sparse attention the indexer's ``topk`` (query i attends min(i + 1, topk) keys, as
    many as a sliding window of ``topk`` holds)."""
    if is_windowed(kind):
        return spec.window
    return spec.indexer.topk if spec.indexer is not None and is_sparse(kind) else 0


def is_nope(kind: str) -> bool:
    """Whether a layer of ``kind`` runs without rotary embeddings: a :data:`NOPE` kind."""
    return kind.endswith(NOPE)


def layer_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """The kind of each decoder layer in model order: ``dense`` or ``moe``, with :data:`WINDOWED` where its attention
    is a sliding window (or chunks) shorter than the sequence may be, :data:`SPARSE` or :data:`REUSED` under DeepSeek's
    sparse attention, then :data:`NOPE` where it has no rotary embeddings; :data:`LINEAR` alone where Gated DeltaNet
    takes the attention's place."""
    moe, windowed, nope = set(spec.moe_layers), set(spec.window_layers), set(spec.nope_layers)
    indexed, linear = set(spec.indexer_layers), set(spec.linear_layers)
    sparse = ["" if spec.indexer is None else SPARSE if n in indexed else REUSED for n in range(spec.layers)]
    return tuple(("moe" if n in moe else "dense") + (LINEAR if n in linear else (WINDOWED if n in windowed else "")
                                                    + sparse[n] + (NOPE if n in nope else ""))
                 for n in range(spec.layers))
