"""The shape of a decoder-only language model, as the cluster planner counts it: :class:`ModelSpec` with its
:class:`Attention` and, for a mixture of experts, its :class:`Experts` (read from a transformers config by
:func:`pipeloom.plan.cluster.model.reader.model_spec`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeloom.plan.errors import ModelConfigError

__all__ = ["Attention", "Experts", "Indexer", "LinearAttention", "ModelSpec"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Attention:
    """One layer's attention: grouped-query (``latent`` False) or DeepSeek's multi-head latent attention."""

    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention; = heads for MHA; = heads for MLA after its up-projection)."""
    qk_dim: int
    """Per-head dimension of queries and keys (MLA: nope + rope dims)."""
    v_dim: int
    """Per-head dimension of values."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections."""
    o_bias: bool = False
    """Bias on the output projection."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k (Qwen3, GLM-4.5): 2 x qk_dim parameters; over the whole q and k
    projections with :attr:`qk_norm_full`."""
    qk_norm_full: bool = False
    """The q and k norms span each projection's whole output (OLMo 2 and 3): (heads + kv_heads) x qk_dim
    parameters, one 1/rms for q and one for k per token."""
    qk_norm_head_weights: bool = False
    """Each head's q and k norm has weights of its own (Cohere's ``use_qk_norm``): (heads + kv_heads) x qk_dim
    parameters, the statistics still per head."""
    qk_norm_weightless: bool = False
    """The q and k norms have no weights (Llama 4's L2 norm per head): no parameters, the statistics per head."""
    qk_norm_with_rope: bool = False
    """The q and k norms run only in the layers with rotary embeddings (Llama 4 normalises after its rotary, and
    its NoPE layers, :attr:`ModelSpec.nope_layers`, have neither)."""
    sinks: bool = False
    """A learned sink logit per query head, in every softmax's denominator (gpt-oss): ``heads`` parameters."""
    output_gate: bool = False
    """The q projection also gives a gate per element of the attention's output, ``sigmoid(gate)`` multiplying it
    before the output projection (Qwen3-Next, Qwen3.5): ``heads x v_dim`` more output columns."""
    latent: bool = False
    """Multi-head latent attention (DeepSeek-V2/V3)."""
    q_rank: int = 0
    """MLA: rank of the query's low-rank projection (0: a full q projection)."""
    kv_rank: int = 0
    """MLA: rank of the compressed key/value."""
    rope_dim: int = 0
    """MLA: the decoupled rotary key dimension (shared by all heads)."""

    @property
    def gate(self) -> int:
        """Elements of the output gate per token: ``heads x v_dim`` with :attr:`output_gate`, else 0."""
        return self.heads * self.v_dim if self.output_gate else 0

    def splits(self, tp: int) -> bool:
        """Whether ``tp`` ranks each hold whole query and key/value heads (Megatron-Core and torchtitan divide both
        by tp)."""
        return self.heads % tp == 0 and self.kv_heads % tp == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Experts:
    """The mixture-of-experts MLP of the MoE layers."""

    count: int
    """Routed experts."""
    top_k: int
    """Experts each token is routed to."""
    intermediate: int
    """Intermediate size of one routed expert (gated MLP)."""
    shared_intermediate: int = 0
    """Intermediate size of the shared expert(s) together, run on every token (0: none)."""
    shared_gate: bool = False
    """A sigmoid gate (hidden -> 1) on the shared expert's output (Qwen2-MoE)."""
    shared_bias: bool = False
    """Biases on the shared expert's projections (ERNIE 4.5 with ``use_bias``)."""
    router_correction: bool = False
    """A per-expert bias added to the router's scores for the choice only, a parameter not trained (ERNIE 4.5's
    ``e_score_correction_bias``): ``count`` parameters."""
    groups: int = 1
    """Groups the routed experts are split into for group-limited routing (DeepSeek's ``n_group``)."""
    group_top_k: int = 0
    """Groups a token may be routed into (DeepSeek's ``topk_group``); 0: routing not group-limited."""
    bias: bool = False
    """Biases on each routed expert's gate/up and down projections, and on the router (gpt-oss)."""
    sparsemixer: bool = False
    """Phi-3.5-MoE's router (transformers' ``sparsemixer``): the top 2 by two masked softmaxes over every expert,
    each kept with its chosen probability: a second softmax and two fp32 multipliers beyond a softmax router's."""
    input_jitter: bool = False
    """A multiplicative noise on the MoE block's input in training, drawn twice (the block's and its router's:
    Phi-3.5-MoE's ``input_jitter_noise``), each noise tensor kept for the backward (h elements per token each)."""
    softmax_after_top_k: bool = False
    """The router takes the top-k logits, then a softmax over those k (gpt-oss, Granite MoE) or a sigmoid of each
    (Llama 4): k probabilities kept per token; else its probabilities are over every expert (a softmax or sigmoid,
    then the top k)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.count:
            raise ModelConfigError(f"each token is routed to {self.top_k} of {self.count} experts: the config's "
                                   "num_experts_per_tok must be between 1 and its expert count")


@dataclass(frozen=True, kw_only=True, slots=True)
class Indexer:
    """DeepSeek's sparse attention (DSA: DeepSeek-V3.2, GLM-5): a lightning indexer scores every earlier key for each
    query, ``sum_j w_j · relu(q_j · k)`` over its heads, and the layer's attention reads only the ``topk`` best keys
    (min(i + 1, topk) for query i, as many as a sliding window of ``topk`` holds). As transformers runs it, the indexer
    takes no gradient (its forward runs under ``no_grad``); its parameters are the model's."""

    heads: int
    """The indexer's query heads (``index_n_heads``)."""
    dim: int
    """Its head dimension, shared by its one key head (``index_head_dim``)."""
    topk: int
    """Keys each query attends to (``index_topk``)."""

    def __post_init__(self) -> None:
        for name, field in (("heads", "index_n_heads"), ("dim", "index_head_dim"), ("topk", "index_topk")):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{field} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearAttention:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid: transformers' ``GatedDeltaNet``), the token mixer of the
    layers :attr:`ModelSpec.linear_layers` names in place of attention: projections of the layer's input to the queries
    and keys (``key_heads`` heads of ``key_dim``), the values and an output gate (``value_heads`` of ``value_dim``)
    and each value head's decay and write strength (two scalars); a causal depthwise convolution of ``conv_kernel``
    taps over the queries, keys and values, then SiLU; the gated delta rule, a recurrent ``key_dim x value_dim``
    state per value head, run in chunks of :data:`GDN_CHUNK` tokens (each query and key head serves
    ``value_heads / key_heads`` value heads); an RMSNorm per value head gated by ``silu(gate)``; the output
    projection."""

    key_heads: int
    """Query and key heads (``linear_num_key_heads``)."""
    value_heads: int
    """Value heads (``linear_num_value_heads``), a multiple of ``key_heads``."""
    key_dim: int
    """Query and key head dimension (``linear_key_head_dim``)."""
    value_dim: int
    """Value head dimension (``linear_value_head_dim``)."""
    conv_kernel: int
    """Taps of the causal convolution (``linear_conv_kernel_dim``)."""
    negative_eigenvalues: bool = False
    """The write strength doubled after its sigmoid, to (0, 2) (OLMo hybrid's ``linear_allow_neg_eigval``): the kernel
    is handed the doubled copy, kept beside the sigmoid's output."""

    def __post_init__(self) -> None:
        for name, field in (("key_heads", "linear_num_key_heads"), ("value_heads", "linear_num_value_heads"),
                            ("key_dim", "linear_key_head_dim"), ("value_dim", "linear_value_head_dim"),
                            ("conv_kernel", "linear_conv_kernel_dim")):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{field} must be positive, got {getattr(self, name)}")
        if self.value_heads % self.key_heads:
            raise ModelConfigError(f"linear_num_value_heads ({self.value_heads}) must be a multiple of "
                                   f"linear_num_key_heads ({self.key_heads}): each key head serves whole value heads")

    @property
    def keys(self) -> int:
        """Elements of the queries (and of the keys) per token: ``key_heads x key_dim``."""
        return self.key_heads * self.key_dim

    @property
    def values(self) -> int:
        """Elements of the values (and of the output gate) per token: ``value_heads x value_dim``."""
        return self.value_heads * self.value_dim

    @property
    def mixed(self) -> int:
        """Channels of the convolution: the queries, keys and values."""
        return 2 * self.keys + self.values

    def splits(self, tp: int) -> bool:
        """Whether ``tp`` ranks each hold whole key heads (and so whole value heads)."""
        return self.key_heads % tp == 0


GDN_CHUNK = 64
"""Tokens per chunk of the gated delta rule: transformers' ``torch_chunk_gated_delta_rule`` and flash-linear-attention's
``chunk_gated_delta_rule`` (its ``BT``) both take 64; a sequence is padded to whole chunks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only language model, enough to count its parameters, FLOPs and memory."""

    family: str
    """The config's ``model_type``."""
    hidden: int
    """Hidden size h."""
    layers: int
    """Decoder layers L."""
    vocab: int
    """Vocabulary size V."""
    attention: Attention
    """Every layer's attention."""
    intermediate: int
    """Intermediate size of a dense layer's MLP."""
    gated: bool = True
    """A gated MLP (SwiGLU/GeGLU: gate, up, down) rather than two projections."""
    mlp_bias: bool = False
    """Biases on the MLP projections."""
    layer_norm: bool = False
    """LayerNorm (mean and variance: GPT-2, GPT-NeoX, StarCoder2, Cohere) rather than RMSNorm."""
    norm_bias: bool = True
    """A LayerNorm's bias (Cohere's LayerNorms have none)."""
    norm_weights: bool = True
    """The norms over h have weights (OLMo 1's LayerNorms have neither weight nor bias: no parameters)."""
    post_norms: bool = False
    """Norms after attention and after the MLP too, on each branch's output before the residual add (Gemma 2
    and 3: four norms per layer)."""
    parallel_residual: bool = False
    """Attention and MLP both read the layer's input, and one add sums the two branches into it (GPT-NeoX's
    ``use_parallel_residual``, its default; Cohere)."""
    shared_norm: bool = False
    """Under :attr:`parallel_residual`, one norm feeds both branches (Cohere) instead of one each (GPT-NeoX)."""
    tied: bool = False
    """The output head shares the embedding's weight."""
    head_bias: bool = False
    """A bias on the output head (ERNIE 4.5 MoE with ``use_bias``): ``vocab`` parameters, its own even when tied."""
    logit_softcap: bool = False
    """The logits capped as ``c · tanh(logits / c)`` before the loss (Gemma 2's and Gemma 3's
    ``final_logit_softcapping``): the tanh's output kept for the backward, three elementwise kernels over the logits
    each way (one fused)."""
    positions: int = 0
    """Rows of a learned position embedding (GPT-2), 0 for rotary models."""
    residual_dropouts: int = 0
    """Dropouts on the residual stream in each decoder layer (a branch's output before its residual add: GPT-2's
    ``resid_pdrop``, GPT-NeoX's ``hidden_dropout``, ...), each keeping a one-byte mask per element of h for the
    backward; 0 where the config trains without."""
    embedding_dropout: bool = False
    """A dropout on the embedding's output (GPT-2's ``embd_pdrop``, ...): a one-byte mask per element of h kept."""
    experts: Experts | None = None
    """The MoE MLP, None for a dense model."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the layers whose MLP is the MoE one (the others are dense)."""
    window: int = 0
    """Sliding-window attention's window in tokens (a query attends to itself and the ``window - 1`` tokens
    before it, as transformers' sliding-window mask), 0: none."""
    window_layers: tuple[int, ...] = ()
    """Indices of the layers whose attention is windowed (the others attend to the whole causal prefix)."""
    chunked: bool = False
    """The windowed layers attend in chunks of ``window`` tokens (Llama 4's ``attention_chunk_size``): a query attends
    to the tokens of its own chunk up to itself, where a sliding window would reach back ``window - 1`` tokens."""
    nope_layers: tuple[int, ...] = ()
    """Indices of the layers without rotary embeddings (NoPE: Llama 4's and SmolLM3's every fourth layer): no rotary
    kernels, and no q/k norm where :attr:`Attention.qk_norm_with_rope`."""
    text_of: str = ""
    """The ``model_type`` of the multimodal config whose ``text_config`` this is ('' for a language model's own
    config): the planner plans its language model; the vision tower and the image tokens are not counted."""
    indexer: Indexer | None = None
    """DeepSeek's sparse attention on every layer (None: dense attention)."""
    indexer_layers: tuple[int, ...] = ()
    """Indices of the layers that run an indexer of their own; under :attr:`indexer` the others reuse the top-k keys
    of the last indexer layer before them (GLM-5's ``"shared"`` ``indexer_types``)."""
    linear: LinearAttention | None = None
    """Gated DeltaNet, on the layers :attr:`linear_layers` names (None: every layer attends)."""
    linear_layers: tuple[int, ...] = ()
    """Indices of the layers whose token mixer is :attr:`linear` instead of attention (the
    ``"linear_attention"`` layers of Qwen3-Next, Qwen3.5 and OLMo hybrid)."""
    context: int = dataclasses.field(default=0, compare=False)
    """The config's ``max_position_embeddings`` where its positions are rotary or none (0: not given): the length it
    was trained to, which a longer ``--seq`` passes (the report says so; a learned table, :attr:`positions`, refuses
    it)."""
    defaulted: tuple[tuple[str, object], ...] = dataclasses.field(default=(), compare=False)
    """The size fields the config left out, each with transformers' default for the family that was read in its place
    (the planner says so: a field misspelled or forgotten plans another model); not part of the shape."""
    mtp: int = 0
    """Multi-token-prediction modules after the last layer (DeepSeek-V3's ``num_nextn_predict_layers``; report
    arXiv:2412.19437 sec. 2.2): each normalises the last hidden state and the next token's embedding,
    projects their concatenation 2h -> h, runs one decoder block of the last layer's kind and the shared head
    with a second loss (:func:`pipeloom.plan.cluster.counts.layer_counts` kind ``mtp``)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "vocab", "intermediate"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.residual_dropouts <= 2:
            raise ModelConfigError(f"residual_dropouts is 0, 1 or 2 per layer (one per branch), got "
                                   f"{self.residual_dropouts}")
        if self.mtp < 0:
            raise ModelConfigError(f"num_nextn_predict_layers must be >= 0, got {self.mtp}")
        if self.window < 0 or (self.window_layers and not self.window):
            raise ModelConfigError(f"sliding_window must be a positive number of tokens, got {self.window}")
        if self.chunked and not self.window_layers:
            raise ModelConfigError("chunked attention needs the layers it runs on (window_layers) and a chunk size")
        for what, indices in (("MoE", self.moe_layers), ("NoPE", self.nope_layers),
                              ("sliding-window", self.window_layers), ("indexer", self.indexer_layers),
                              ("linear-attention", self.linear_layers)):
            if any(not 0 <= n < self.layers for n in indices):
                raise ModelConfigError(f"{what} layers {list(indices)} are not all among the {self.layers} layers")
        if self.indexer is not None:
            if not (self.attention.latent and self.attention.q_rank):
                raise ModelConfigError("DeepSeek's sparse attention reads the query latent: it needs multi-head latent "
                                       "attention with q_lora_rank set")
            if self.window_layers:
                raise ModelConfigError("a model with DeepSeek's sparse attention has no sliding-window layers")
            if not self.indexer_layers or self.indexer_layers[0] != 0:
                raise ModelConfigError("the first layer of a model with DeepSeek's sparse attention must run an "
                                       "indexer (indexer_types[0] \"full\"): the layers after it reuse its top-k")
        elif self.indexer_layers:
            raise ModelConfigError("indexer layers need an indexer (index_n_heads, index_head_dim, index_topk)")
        if self.linear_layers and self.linear is None:
            raise ModelConfigError("linear-attention layers need their Gated DeltaNet's sizes (linear_num_key_heads, "
                                   "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim)")
        if self.shared_norm and not self.parallel_residual:
            raise ModelConfigError("shared_norm (one norm before both branches) needs parallel_residual: a layer "
                                   "whose MLP follows its attention normalises the MLP's own input")
        if self.attention.heads % self.attention.kv_heads:
            fits = [k for k in range(1, self.attention.heads + 1) if self.attention.heads % k == 0]
            near = min(fits, key=lambda k: (abs(k - self.attention.kv_heads), k))
            raise ModelConfigError(f"{self.attention.heads} query heads are not a multiple of "
                                   f"{self.attention.kv_heads} key/value heads (each key/value head serves a whole "
                                   f"group of query heads); check num_key_value_heads, e.g. {near}, which divides "
                                   f"{self.attention.heads}")

    @property
    def layer_norms(self) -> int:
        """Norms over h in one decoder layer: before attention and before the MLP (one before both with
        :attr:`shared_norm`), and after each with :attr:`post_norms`."""
        return 1 if self.shared_norm else 4 if self.post_norms else 2

    @property
    def dense_layers(self) -> int:
        """Layers with a dense MLP."""
        return self.layers - len(self.moe_layers)

    def as_dict(self) -> dict:
        """The ``--json`` model (its counts are the planner's to add): family, ``text_of`` (the multimodal model_type
        whose language model it is, else empty), layers, hidden, experts, the attention variants, the dropouts and
        the fields a config left out (``defaulted``). ``sparse_attention``: the indexer's keys per query, heads, head
        dimension and layers (None without); ``linear_attention``: Gated DeltaNet's heads, head dimensions,
        convolution taps, layers and doubled write strength (None without)."""
        ix, g = self.indexer, self.linear
        return {"family": self.family, "text_of": self.text_of, "layers": self.layers, "hidden": self.hidden,
                "experts": self.experts.count if self.experts else 0,
                "experts_per_token": self.experts.top_k if self.experts else 0,
                "sliding_window": self.window, "sliding_window_layers": list(self.window_layers),
                "chunked_attention": self.chunked, "nope_layers": list(self.nope_layers),
                "sparse_attention": None if ix is None else {
                    "topk": ix.topk, "index_heads": ix.heads, "index_head_dim": ix.dim,
                    "indexer_layers": list(self.indexer_layers)},
                "linear_attention": None if g is None else {
                    "kind": "gated_deltanet", "key_heads": g.key_heads, "value_heads": g.value_heads,
                    "key_dim": g.key_dim, "value_dim": g.value_dim, "conv_kernel": g.conv_kernel,
                    "negative_eigenvalues": g.negative_eigenvalues, "layers": list(self.linear_layers)},
                "residual_dropouts": self.residual_dropouts, "embedding_dropout": self.embedding_dropout,
                "logit_softcap": self.logit_softcap, "defaulted": dict(self.defaulted)}
