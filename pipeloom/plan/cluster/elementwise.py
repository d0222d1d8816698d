"""The memory-bound (elementwise) work of one decoder layer, counted kernel by kernel: the bytes each kernel
reads plus writes per token, and how many kernels run, in the forward and in the backward. The estimator
prices them at the GPU's HBM bandwidth (:func:`pipeloom.plan.cluster.efficiency.memory_seconds`) plus one
kernel overhead per kernel.

Two implementations are counted, because frameworks differ by a factor of three here:

- ``fused`` (Megatron-LM / Transformer Engine, or ``torch.compile``): one kernel per operation, reading its
  inputs and writing its output once. Forward per token: two RMSNorm/LayerNorms (read h, write h each; four
with Gemma 2/3's norms after each branch), two
  residual adds (read 2h, write h; under GPT-NeoX's parallel residual one add of the two branches and the
  input, read 3h, write h), rotary embedding of q and k (read and write them; absent with learned
  positions), the MLP activation (SwiGLU: read gate and up, 2I, write I; GELU: read I, write I). Bias adds
  ride in the GEMM epilogues and softmax inside flash attention: no traffic of their own. Backward: a norm
  reads its input and the output gradient and writes the input gradient (3h); each residual add sums the
  branch and skip gradients (read 2h, write h); rotary is its own transpose (same bytes as the forward); the
  activation reads its inputs and the output gradient and writes the inputs' gradients (SwiGLU 5I, GELU 3I).
- ``eager`` (PyTorch without compilation, as torchtitan's Llama is written: ``torchtitan/models/norms.py`` and
  ``torchtitan/models/llama/model.py``, Dec 2024): RMSNorm as ``x.float()``, ``pow(2)``, ``mean``, ``mul`` by
  the ``rsqrt``, ``type_as``, ``mul`` by the weight (6 + 8 + 4 + 8 + 6 + 4 = 36 bytes per element of h, 6
  kernels); rotary through complex numbers (``float()`` 6, complex ``mul`` 8, ``type_as`` 6: 20 bytes per element
  of q and k, 3 kernels each); ``repeat_kv`` copying K and V out to every query head (grouped-query attention:
  read the kv heads, write the query heads' worth); the attention output's ``transpose().contiguous()``
  (read and write it); ``silu(gate) * up`` as two kernels (4 + 6 = 10 bytes per element of I); the two
  residual adds (6 bytes per element of h). LayerNorm is one fused kernel even in eager PyTorch. The backward
  of an unfused op reads its saved inputs and the output gradient and writes the input gradient(s): twice
  the forward's bytes and kernels (autograd runs one backward kernel per forward kernel, most reading two
  tensors where the forward read one).

A MoE layer also permutes each token's top-k copies to their experts and back (read h, write k·h; then read
k·h, write h), in both passes, in either implementation.

A Gated DeltaNet layer (``linear``: Qwen3-Next, Qwen3.5, OLMo hybrid) has no rotary; its mixer's own kernels, in either
implementation (Megatron-Core's, the only training framework with the layer): the causal convolution with its SiLU
(read and write the queries, keys and values: ``2C`` for ``C`` channels; backward read the input and the output
gradient, write the input gradient: ``3C``), the queries' and keys' L2 norm (``2·2K``; backward ``3·2K``) and their
repeat to every value head (read ``2K``, write ``2 Hv dk``; backward the sum back), the decay and the write strength
(read the two scalars per value head, write them: ``4 Hv``; backward ``6 Hv``; OLMo hybrid's doubled write strength
one more written: ``5 Hv``, its gradient in the same backward), the gated RMSNorm with its
``silu(gate)`` product (read the kernel's output and the gate, write the product: ``3V``; backward read those and
the output gradient, write two gradients: ``5V``): five kernels each way. An attention layer with an output gate
(Qwen3-Next, Qwen3.5) multiplies the attention's output by ``sigmoid(gate)`` (read two, write one per element;
backward read three, write two): one kernel each way.

A residual dropout (a config that trains with one: ``ModelSpec.residual_dropouts``) writes a one-byte mask per
element of h and its backward reads it: fused, inside the residual add (Megatron's bias-dropout-add: 1 byte more
each way, no kernel of its own); eager, ``F.dropout`` as a kernel of its own (read 2, write 2 and the mask: 5 bytes
per element each way). Phi-3.5-MoE's input jitter (``Experts.input_jitter``) multiplies the MoE block's input by
noise twice: fused, a kernel each that draws and writes the noise and scales the input in place (3 elements of h
each way); eager, ``uniform_`` then ``mul_`` (4 forward, 3 backward, in 2 and 1 kernels).

Not counted: casts around FP8 GEMMs (Float8 scaling reads and writes each GEMM input
once more: counted by the estimator with the GEMM, not here), and the loss (priced with the head).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeloom.plan.cluster.counts import MASK_BYTES
from pipeloom.plan.cluster.model.spec import ModelSpec
from pipeloom.plan.errors import LayoutError

__all__ = ["DROPOUT_BYTES", "KERNELS", "Elementwise", "layer_elementwise"]

KERNELS = ("fused", "eager")
"""How the elementwise operations run: one fused kernel each, or PyTorch's eager ops one by one."""

_W = 2  # bf16 activations
_EAGER_RMSNORM = 36  # bytes per element of h (module docstring)
_EAGER_RMSNORM_KERNELS = 6
_EAGER_ROTARY = 20  # bytes per element of q and of k
_EAGER_ROTARY_KERNELS = 3
DROPOUT_BYTES = 2 * _W + MASK_BYTES
"""Bytes per element of a dropout run as a kernel of its own (read and write the bf16 tensor, write or read its
mask), forward and backward alike: eager residual dropouts, and the embedding's dropout in either kernel mode."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Elementwise:
    """One layer's memory-bound traffic per token on one GPU, and its kernel count per micro-batch."""

    f_bytes: float
    """Forward bytes read plus written per token."""
    b_bytes: float
    """Backward bytes read plus written per token."""
    f_kernels: int
    """Forward kernels."""
    b_kernels: int
    """Backward kernels."""


def layer_elementwise(spec: ModelSpec, kind: str, *, tp: int = 1, sp: bool = False, kernels: str = "fused",
                      rotary: bool = True, linear: bool = False) -> Elementwise:
    """The elementwise traffic of one ``dense`` or ``moe`` layer per token of the micro-batch on one GPU of a
    tp group: the residual stream's ops (norms, adds) divided by tp under sequence parallelism, the head and
    MLP-width ops (rotary, activation) by tp always. A MoE layer's activation runs on each token's top-k
    experts plus the shared expert(s). ``rotary``: False for a NoPE layer (no rotary kernels); a model with
    learned positions has none either way. ``linear``: a Gated DeltaNet layer (its mixer's kernels, :func:`_mixer`,
    in place of the attention's rotary, output gate and eager copies)."""
    if kernels not in KERNELS:
        raise LayoutError(f"kernels={kernels!r}: use {' or '.join(map(repr, KERNELS))}")
    if kind not in ("dense", "moe"):
        raise LayoutError(f"layer kind {kind!r} has no elementwise count; use dense or moe")
    a, h = spec.attention, spec.hidden
    if kind == "dense":
        width, gated = spec.intermediate, spec.gated
    else:
        assert spec.experts is not None, "moe layer of a dense model"
        width, gated = spec.experts.top_k * spec.experts.intermediate + spec.experts.shared_intermediate, True
    # a MoE layer permutes each token's k copies to its experts and back (read h, write k·h; read k·h, write h)
    route = 2 * (1 + spec.experts.top_k) * h if kind == "moe" and spec.experts is not None else 0
    qk = (a.heads + a.kv_heads) * a.qk_dim  # the rotated q and k elements
    rotary = rotary and spec.positions == 0 and not linear
    jitters = 2 if kind == "moe" and spec.experts is not None and spec.experts.input_jitter else 0
    # the token mixer's own kernels beside the attention core: Gated DeltaNet's, or an output gate's product
    mix_f, mix_b, mix_kernels = _mixer(spec) if linear else (3 * a.gate, 5 * a.gate, 1 if a.gate else 0)
    if kernels == "fused":
        norms = spec.layer_norms
        adds, add_kernels = (4 * h, 1) if spec.parallel_residual else (2 * 3 * h, 2)  # one add of 3, or two of 2
        seq_f, seq_b = norms * 2 * h + adds, norms * 3 * h + adds  # norms, residual adds
        act_f, act_b = (3 * width, 5 * width) if gated else (2 * width, 3 * width)
        rot = 2 * qk if rotary else 0
        ten_f, ten_b = act_f + rot + route + mix_f, act_b + rot + route + mix_b
        masks = MASK_BYTES * spec.residual_dropouts * h / (tp if sp else 1)  # in the residual adds
        seq_f, seq_b = seq_f + jitters * 3 * h, seq_b + jitters * 3 * h
        f = _W * (seq_f / (tp if sp else 1) + ten_f / tp) + masks
        b = _W * (seq_b / (tp if sp else 1) + ten_b / tp) + masks
        count = norms + add_kernels + (1 if rotary else 0) + 1 + (2 if route else 0) + jitters + mix_kernels
        return Elementwise(f_bytes=f, b_bytes=b, f_kernels=count, b_kernels=count)
    norm = _EAGER_RMSNORM * h if not spec.layer_norm else 2 * _W * h
    norm_kernels = _EAGER_RMSNORM_KERNELS if not spec.layer_norm else 1
    seq_f = spec.layer_norms * norm + 2 * 3 * _W * h  # the norms, two residual adds
    repeat = _W * (a.kv_heads + a.heads) * (a.qk_dim + a.v_dim) if a.kv_heads < a.heads and not linear else 0
    transpose = 0 if linear else 2 * _W * a.heads * a.v_dim  # the attention output's layout copy
    ten_f = ((_EAGER_ROTARY * qk if rotary else 0) + repeat + transpose + (10 if gated else 4) * width + _W * route)
    f = seq_f / (tp if sp else 1) + ten_f / tp
    count_f = (spec.layer_norms * norm_kernels + 2 + (2 * _EAGER_ROTARY_KERNELS if rotary else 0)
               + (2 if repeat else 0) + (0 if linear else 1) + (2 if gated else 1) + (2 if route else 0))
    dropout = DROPOUT_BYTES * spec.residual_dropouts * h / (tp if sp else 1)  # each way, a kernel each
    jitter_f, jitter_b = (_W * jitters * n * h / (tp if sp else 1) for n in (4, 3))
    return Elementwise(f_bytes=f + dropout + jitter_f + _W * mix_f / tp, b_bytes=2 * f + dropout + jitter_b
                       + _W * mix_b / tp, f_kernels=count_f + spec.residual_dropouts + 2 * jitters + mix_kernels,
                       b_kernels=2 * count_f + spec.residual_dropouts + jitters + mix_kernels)


def _mixer(spec: ModelSpec) -> tuple[int, int, int]:
    """``(forward elements, backward elements, kernels)`` per token of a Gated DeltaNet layer's own elementwise kernels
    (module docstring), over the whole layer (tensor parallelism divides them)."""
    g = spec.linear
    assert g is not None, "a linear-attention layer of a model without Gated DeltaNet"
    repeat = 2 * g.keys + 2 * g.value_heads * g.key_dim
    gates = (5 if g.negative_eigenvalues else 4) * g.value_heads  # the decay, the write strength (and its double)
    forward = 2 * g.mixed + 2 * 2 * g.keys + repeat + gates + 3 * g.values
    backward = 3 * g.mixed + 3 * 2 * g.keys + repeat + 6 * g.value_heads + 5 * g.values
    return forward, backward, 5
