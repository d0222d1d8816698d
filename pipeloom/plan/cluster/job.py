"""What is trained where, and how its framework runs it: :class:`Job` (the model, the GPU type, the step's
size, and the framework's choices the planner does not search: kernels, attention, overlaps, recomputation
policy, exchanges, stage cut), checked when made."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from pipeloom.plan.cluster.efficiency import (
    ATTENTION_KINDS,
    CURRENT_CAST_BYTES,
    DYNAMIC_CAST_BYTES,
    FUSED_CAST_BYTES,
    MXFP8_CAST_BYTES,
    fp8_weight_copy_bytes,
)
from pipeloom.plan.cluster.elementwise import KERNELS
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.cluster.layout import PAIRED, SCHEDULES, Layout
from pipeloom.plan.cluster.model.spec import ModelSpec
from pipeloom.plan.cluster.recompute import idle_modules, megatron_modules
from pipeloom.plan.errors import LayoutError

__all__ = ["Job", "CP_ROTATE", "MOE_COMM", "GRAD_REDUCE", "ADAM_MOMENTS", "STAGE_CUTS", "FP8_CASTS", "layout_cut"]

FP8_CASTS = ("cached", "dynamic", "current", "mxfp8")
"""How FP8 GEMMs cast their inputs (:attr:`Job.fp8_cast`)."""
CP_ROTATE = ("ring", "allgather")
"""How context parallelism exchanges K/V (:attr:`Job.cp_rotate`)."""
MOE_COMM = ("plain", "deepseek", "hybridep", "hybridep-sync-free")
"""How the expert all-to-all is run (:attr:`Job.moe_comm`)."""
GRAD_REDUCE = {"bf16": 2, "fp32": 4}
"""The data types the gradient reduce-scatter may move (:attr:`Job.grad_reduce`), and their bytes."""
ADAM_MOMENTS = {"fp32": 4, "bf16": 2}
"""The data types Adam's two moments may be held in (:attr:`Job.adam_moments`), and their bytes."""

STAGE_CUTS = ("balanced", "even")
"""How decoder layers may be cut into stages (:attr:`Job.stage_cut`), besides an explicit cut (:func:`layout_cut`)."""

_LAYOUT_PARTS = "EtmL"
"""What a stage of an explicit cut holds (:func:`layout_cut`): the embedding, decoder layers, multi-token-prediction
modules, the loss."""


def _unrolled(text: str) -> str:
    """``text`` with every ``x*N`` and ``(...)*N`` written out (nested groups allowed)."""
    out: list[list[str]] = [[]]
    i = 0
    while i < len(text):
        c = text[i]
        i += 1
        if c == "(":
            out.append([])
            continue
        if c == ")":
            if len(out) == 1:
                raise ValueError("a ')' with no '(' before it")
            group = "".join(out.pop())
            out[-1].append(group)
        elif c == "*":
            raise ValueError("a '*' after nothing to repeat")
        elif c in _LAYOUT_PARTS or c == "|":
            out[-1].append(c)
        else:
            raise ValueError(f"{c!r} is not a part of a stage")
        digits = ""
        if i < len(text) and text[i] == "*":
            while i + 1 < len(text) and text[i + 1].isdigit():
                digits += text[i + 1]
                i += 1
            if not digits:
                raise ValueError("a '*' with no count after it")
            i += 1
            out[-1][-1] *= int(digits)
    if len(out) > 1:
        raise ValueError("a '(' that is never closed")
    return "".join(out[0])


@functools.lru_cache(maxsize=64)
def layout_cut(text: str, layers: int, mtp: int) -> tuple[int, ...]:
    """Decoder layers per pipeline stage of an explicit cut written as Megatron-Core's
    ``--pipeline-model-parallel-layout`` writes one: the stages in model order (where each runs is the schedule's:
    interleaved 1F1B's stage ``k`` on pipeline rank ``k % pp``, as Megatron-Core's) separated by ``|``, each a run
    of ``E`` (the embedding), ``t`` (a decoder layer), ``m`` (a multi-token-prediction module) and ``L`` (the head
    and the loss); ``x*N`` and ``(...)*N`` repeat, commas and spaces are ignored. DeepSeek-V3's 16 virtual stages
    in Megatron-Bridge's recipes: ``Et*4|(t*4|)*14tmL``. The embedding opens the first stage, the loss closes the
    last, and the multi-token-prediction modules (``mtp`` of them, as many as the model has) sit between the last
    stage's decoder layers and its loss, where the planner prices them; ``layers`` decoder layers in all.
    LayoutError naming what is wrong otherwise."""
    def refuse(why: str) -> LayoutError:
        return LayoutError(f"stage cut {text!r}: {why}; write the stages as Megatron-Core's pipeline layout does, "
                           "e.g. Et*4|(t*4|)*14tmL (E embedding, t decoder layer, m multi-token prediction, L loss, | "
                           "between stages)")

    try:
        stages = _unrolled(text.replace(",", "").replace(" ", "")).split("|")
    except ValueError as error:
        raise refuse(str(error)) from None
    flat = "".join(stages)
    for j, stage in enumerate(stages):
        if not stage:
            raise refuse(f"stage {j} holds nothing")
    if flat.count("E") != 1 or not flat.startswith("E"):
        raise refuse("the embedding (E) must come once, first")
    if flat.count("L") != 1 or not flat.endswith("L"):
        raise refuse("the loss (L) must come once, last")
    if flat.count("t") != layers:
        raise refuse(f"it holds {flat.count('t')} decoder layers (t); the model has {layers}")
    if flat.count("m") != mtp:
        raise refuse(f"it holds {flat.count('m')} multi-token-prediction modules (m); the model has {mtp}")
    if mtp and not stages[-1].endswith("m" * mtp + "L"):
        raise refuse("the multi-token-prediction modules are priced beside the loss, after the last decoder layer: "
                     "put them all just before the L")
    return tuple(stage.count("t") for stage in stages)


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """What is trained where: the model, the GPU type and the step's size."""

    spec: ModelSpec
    """The model."""
    hw: Hardware
    """The GPU type (a job of fewer GPUs than a scale-up domain holds sits in one: its ``scale_up_placed``)."""
    gpus: int
    """GPUs of the job."""
    global_batch: int
    """Sequences per step."""
    seq: int
    """Tokens per sequence."""
    dtype: str = "bf16"
    """GEMM precision (bf16 or fp8; attention runs in bf16 either way)."""
    kernels: str = "fused"
    """Elementwise kernels: ``fused`` (Megatron, Transformer Engine, torch.compile) or ``eager`` (PyTorch op by
    op): :mod:`pipeloom.plan.cluster.elementwise`."""
    attention: str = "flash"
    """Attention core: ``flash`` (the GPU's best kernel), ``flash2`` (FlashAttention-2) or ``materialized`` scores
    (Megatron-LM 2021): :func:`~pipeloom.plan.cluster.efficiency.materialized_attention_seconds`."""
    selective: str = "core_attn"
    """What ``recompute=selective`` recomputes (:mod:`pipeloom.plan.cluster.recompute`): Megatron-Core's
    ``recompute_modules``, comma-separated, from ``core_attn`` (its default: the attention core), ``layernorm``,
    ``moe_act``, ``mla_up_proj``, ``mlp``, ``moe`` and ``shared_experts`` (written back in that order); or ``op``
    (torchtitan's op-level policy: every op but the matmuls and the attention kernel, and every second matmul of
    a layer: :func:`~pipeloom.plan.cluster.layer_time._op_recompute`) or ``layer`` (torchtitan's
    ``selective_ac_option = "2"``: every second layer recomputed whole) or ``deepseek`` (DeepSeek-V3's: every
    RMSNorm, MLA's up-projections and the MoE SwiGLU run again; linear inputs cached in FP8:
    :func:`~pipeloom.plan.cluster.recompute.deepseek_activations`)."""
    cp_rotate: str = "ring"
    """How context parallelism exchanges K/V: ``ring`` (each block's K/V sent to the next rank beside the current
    block's compute: Megatron-Core / Transformer Engine) or ``allgather`` (PyTorch's ``context_parallel`` as
    torchtitan ran it: :func:`pipeloom.plan.cluster.mixers.context_parallel_core`)."""
    moe_comm: str = "plain"
    """The expert all-to-all: ``plain`` (every routed copy of a token sent in bf16 to its expert's GPU), ``deepseek``
    (DeepSeek-V3's kernels, 20 SMs reserved: :func:`~pipeloom.plan.cluster.dispatch.deepseek_all_to_all`),
    ``hybridep`` (NVIDIA's Hybrid-EP, Megatron-Core's flex dispatcher: :func:`~pipeloom.plan.cluster.dispatch.
    hybridep_all_to_all`) or ``hybridep-sync-free`` (without its calls' host synchronization: Megatron-Core's
    sync-free experts, ``moe_expert_rank_capacity_factor``)."""
    p2p_overlap: bool = True
    """Pipeline sends run beside the ranks' compute (Megatron-Core's interleaved 1F1B, torch.distributed.pipelining:
    the replay's latency between stages); False: each stage's output and input-gradient exchange blocks the rank for
    the transfer (Megatron-LM 2021's ``_communicate``: ``batch_isend_irecv``, wait, ``cuda.synchronize``), added
    to the stage's F and I by the estimator (:meth:`blocking_sends`)."""
    blocking_1f1b: bool = True
    """Megatron-Core's 1F1B without virtual stages sends blocking, as above: its ``validate_args`` turns
    ``overlap_p2p_comm`` off without interleaving (core 0.17.1). False: beside the compute (torchtitan's and pipeloom's
    ``torch.distributed.pipelining``-style sends)."""
    overlap_grad_reduce: bool = True
    """The data-parallel gradient exchange overlaps the backward bucket by bucket (Megatron-Core's
    ``--overlap-grad-reduce``, FSDP, DDP); False: one all-reduce after the last backward (Megatron-LM 2021)."""
    shard_gradients: bool = False
    """ZeRO-2: gradients whole only while a micro-batch's backward makes them, reduce-scattered after it and kept
    sharded over the data-parallel ranks (DeepSpeed's stage 2; Llama 3's FSDP, report sec. 3.3.2), a reduce-scatter
    per micro-batch; for the layouts whose gradients are otherwise whole (the distributed optimizer's, FSDP's under
    a pipeline). False: whole until the step's one reduce-scatter (Megatron-Core, torch.distributed.pipelining)."""
    distributed_optimizer: bool = True
    """Adam's state sharded over :attr:`Layout.state_groups` (Megatron-Core's distributed optimizer; FSDP shards it
    anyway). False: whole on every replica, as torch's optimizers beside DDP (pipeloom's runtime, torchtitan)."""
    fsdp_per_layer: bool = True
    """FSDP on one stage gathers each layer for every micro-batch (:meth:`reshards`). False: as under a pipeline, the
    stage gathered at its first forward and kept whole with its gradients until the step ends (pipeloom's runtime)."""
    fp8_cast: str = "cached"
    """How FP8 GEMMs (``dtype="fp8"``) cast their inputs (:data:`FP8_CASTS`): ``cached``, Transformer Engine's
    delayed scaling as Megatron-Core runs it (its default ``--fp8-recipe delayed``): the amax taken in the cast
    kernel, each weight's FP8 copy made on a step's first micro-batch and reused (``is_first_microbatch``), the
    forward's FP8 input and the input gradient's FP8 output gradient reused by the weight gradient, so a
    micro-batch casts only the forward's and the input gradient's activation operand; ``dynamic``, per-tensor
    dynamic scaling (torchao's tensor-wise Float8, torchtitan's): both inputs of every FP8 GEMM, an amax pass
    first (:data:`~pipeloom.plan.cluster.efficiency.DYNAMIC_CAST_BYTES`); ``current``, Transformer Engine's current
    scaling (``Float8CurrentScaling``, Megatron-Bridge's FP8-CS): the casts of ``cached``, each after an amax
    pass of its own (:data:`~pipeloom.plan.cluster.efficiency.CURRENT_CAST_BYTES`)."""
    tp_overlap: bool = False
    """Each tensor-parallel all-gather and reduce-scatter runs beside the GEMM next to it (under sequence
    parallelism): Transformer Engine's userbuffers (Megatron-Core / NeMo ``tp_comm_overlap``), PyTorch's async
    tensor parallelism (torchtitan ``enable_async_tensor_parallel``); each then adds to its GEMM what
    :func:`~pipeloom.plan.cluster.efficiency.overlapped_seconds` says. False (or without sequence parallelism):
    they run between the GEMMs, exposed."""
    moe_overlap: bool = False
    """Megatron-Core's ``overlap_moe_expert_parallel_comm``: each backward runs with the forward of another
    micro-batch that its rank runs next, each part's expert all-to-all under the other part's compute, as in
    DualPipe's pairs (:meth:`pairs`): on one pipeline stage, or under interleaved 1F1B (Megatron requires virtual
    stages where pp > 1). False (Megatron's default): the all-to-alls are exposed outside DualPipe(V)."""
    sequence_parallel: bool = True
    """With tp > 1, the norms, dropouts and residual adds run on the tp rank's 1/tp of the tokens and the tp
    exchanges are all-gathers and reduce-scatters (Megatron-Core, torchtitan); False: every tp rank runs them
    on all the tokens and keeps their activations whole, the exchanges being all-reduces of the same bytes
    (Megatron-LM before sequence parallelism: Korthikanti et al. 2022, arXiv:2205.05198, sec. 4.2.2)."""
    grad_reduce: str = "bf16"
    """The data type of the data-parallel gradient reduce-scatter: ``bf16`` (the weights' width) or ``fp32``
    (torchtitan's default ``mixed_precision_reduce = "float32"``; Megatron-LM with bf16, which turns on
    ``accumulate_allreduce_grads_in_fp32``; Llama 3's FSDP, report sec. 3.3.2 "Numerical stability")."""
    adam_moments: str = "fp32"
    """The data type of Adam's two moments (:data:`ADAM_MOMENTS`): ``fp32`` (Megatron-Core's and torch's default) or
    ``bf16`` (Megatron-Core's precision-aware optimizer with ``exp_avg_dtype`` and ``exp_avg_sq_dtype`` bf16, as
    Megatron-Bridge's DeepSeek-V3 recipes set it): 8 bytes of optimizer state a parameter, not 12, and less traffic
    in the optimizer step. The master weights stay fp32."""
    stage_cut: str = "balanced"
    """How the decoder layers are cut into pipeline stages: ``balanced`` (layers moved off the busiest pipeline
    rank, the embedding, the head and the multi-token-prediction modules counted:
    :func:`~pipeloom.plan.cluster.placement.balanced_counts`; Megatron-Core's ``--decoder-first/last-pipeline-
    num-layers``, torchtitan's ``module_fqns_per_model_part`` run such cuts) or ``even`` (as many layers per
    stage as divide, the remainder to the middle stages: Megatron-LM 2021, which required the layers to divide
    evenly; torchtitan's 2024 ``generate_split_points``; Llama 3's one layer less on the first and last stages),
    or the stages themselves as Megatron-Core's ``--pipeline-model-parallel-layout`` writes them
    (:func:`layout_cut`, e.g. ``Et*4|(t*4|)*14tmL``): then only layouts of that many stages (pp x vp) run."""
    schedules: tuple[str, ...] = ()
    """The pipeline schedules the search tries where pp > 1 (:data:`~pipeloom.plan.cluster.layout.SCHEDULES`);
    empty: every one but :data:`~pipeloom.plan.cluster.layout.ON_REQUEST`'s (a layout fixed to one still runs)."""
    recompute_layers: int = 0
    """Which decoder layers ``recompute=full`` recomputes: 0, every one (Megatron-Core's ``recompute_method
    "uniform"`` with one layer per unit, torchtitan's full checkpointing); N > 0, the first N of each stage (a
    virtual stage under interleaving: Megatron-Core's model chunk), the stage's other layers keeping everything
    (Megatron-Core's ``recompute_method "block"`` with ``recompute_num_layers`` N, as Megatron-Bridge's
    ``recompute_num_layers`` sets it): :meth:`~pipeloom.plan.cluster.estimate.Estimator.stages`."""
    described: Hardware | None = field(default=None, compare=False, repr=False)
    """The GPU type as given, before a job smaller than a scale-up domain was placed in one (:attr:`hw`'s
    ``scale_up_placed``): what the ``--json`` object writes, so that a larger job read from it is placed as the
    description says (set when the job is made; kept by ``dataclasses.replace``)."""

    def __post_init__(self) -> None:
        modules = megatron_modules(self.selective)
        if modules:  # one spelling per set of modules
            object.__setattr__(self, "selective", ",".join(modules))
        choices = (("kernels", KERNELS, "elementwise kernels: fused (Megatron, Transformer Engine, torch.compile) or "
                                        "eager (PyTorch op by op)"),
                   ("attention", ATTENTION_KINDS, "the attention core's kernels"),
                   ("cp_rotate", CP_ROTATE, "'ring' (Megatron-Core's K/V ring) or 'allgather' (PyTorch's "
                                            "context_parallel, as torchtitan runs it)"),
                   ("moe_comm", MOE_COMM, "'plain', 'deepseek' (DeepSeek-V3's all-to-all kernels) or 'hybridep' "
                    "(NVIDIA's Hybrid-EP kernels; 'hybridep-sync-free' without their host synchronization)"),
                   ("grad_reduce", tuple(GRAD_REDUCE), "'bf16' or 'fp32' (gradients reduce-scattered in float32, "
                                                       "torchtitan's default)"),
                   ("adam_moments", tuple(ADAM_MOMENTS), "'fp32' or 'bf16' (Megatron-Core's precision-aware "
                                                         "optimizer's moments)"),
                   ("fp8_cast", FP8_CASTS, "'cached' (Transformer Engine's delayed scaling: FP8 weights and "
                                           "activations reused), 'dynamic' (torchao's per-tensor dynamic "
                                           "scaling: both inputs cast for every GEMM), 'current' (Transformer "
                                           "Engine's current scaling: as cached, an amax pass first) or 'mxfp8' "
                                           "(Transformer Engine's MXFP8 block scaling, Blackwell: as cached, a "
                                           "copy per direction)"),
                   ("stage_cut", STAGE_CUTS, "'balanced' (layers moved off the busiest pipeline rank), 'even' "
                                             "(as many layers per stage as divide) or the stages themselves, as "
                                             "Megatron-Core's pipeline layout writes them (e.g. Et*4|(t*4|)*14tmL)"))
        for name, allowed, what in choices:
            value = getattr(self, name)
            if name == "stage_cut" and isinstance(value, str) and set(value) & set("EL|"):
                self.cut()  # an explicit cut: refused here if it does not cut this model
            elif value not in allowed:
                raise LayoutError(f"{name}={value!r}: use one of {', '.join(map(repr, allowed))}: {what}")
        unknown = [name for name in self.schedules if name not in SCHEDULES]
        if unknown or not isinstance(self.schedules, tuple):
            raise LayoutError(f"schedules={self.schedules!r}: the cluster planner prices {', '.join(SCHEDULES)}")
        for name in ("gpus", "global_batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        layers = self.recompute_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            raise LayoutError(f"recompute_layers must be a whole number of layers per stage >= 0 (0: every layer), "
                              f"got {layers!r}")
        self.hw.peak(self.dtype)
        if self.described is None:
            object.__setattr__(self, "described", self.hw)
        if self.gpus < self.hw.domain_gpus:  # a job smaller than a scale-up domain sits in one
            object.__setattr__(self, "hw", replace(self.hw, scale_up_placed=self.gpus))
        self._check_applies()
        positions = self.spec.positions
        if positions and self.seq > positions:
            raise LayoutError(f"seq={self.seq}: this {self.spec.family} model's learned position embedding has "
                              f"{positions} rows, so it takes sequences of at most {positions} tokens; use --seq "
                              f"{positions} or less (seq={positions} in Python)")

    def cut(self) -> tuple[int, ...] | None:
        """Decoder layers per pipeline stage of an explicit :attr:`stage_cut` (:func:`layout_cut`); None for
        ``balanced`` and ``even``, whose cut depends on the layout."""
        return None if self.stage_cut in STAGE_CUTS else layout_cut(self.stage_cut, self.spec.layers, self.spec.mtp)

    def fp8_casts(self) -> tuple[tuple[float, float], ...]:
        """Bytes per element an FP8 GEMM moves to cast its two inputs, in F (activation, weight), I (output gradient,
        weight) and W (output gradient, activation), under :attr:`fp8_cast`: ``dynamic`` casts every input with an amax
        pass first; ``cached`` casts only F's activation and I's output gradient, the amax in the cast kernel (the
        weights' FP8 copies are made once a step, and W reuses the FP8 copies F and I made); ``current`` casts the same
        two with an amax pass first (Transformer Engine's current scaling); ``mxfp8`` the same two into a block-scaled
        copy per direction (:data:`MXFP8_CAST_BYTES`). On a GPU whose FP8 GEMMs take either layout
        (``hw.fp8_any_layout``: Blackwell) ``cached`` and ``current`` write no transposed copy, a byte less per element.
        """
        if self.fp8_cast == "dynamic":
            return ((DYNAMIC_CAST_BYTES, DYNAMIC_CAST_BYTES),) * 3
        made = {"current": CURRENT_CAST_BYTES, "mxfp8": MXFP8_CAST_BYTES}.get(self.fp8_cast, FUSED_CAST_BYTES)
        if self.hw.fp8_any_layout and self.fp8_cast in ("cached", "current"):
            made -= 1  # the one copy serves both GEMMs: no transpose written
        return (made, 0.0), (made, 0.0), (0.0, 0.0)

    def saved_fp8(self) -> tuple[float, bool] | None:
        """How Transformer Engine's FP8 GEMMs keep the inputs they quantized for the weight gradient
        (:func:`~pipeloom.plan.cluster.recompute.fp8_saved_inputs`): ``(bytes per element, delayed scaling)`` under its
        casts (``cached``: delayed scaling, 1 byte; ``current``: 1; ``mxfp8``: 1 and a block scale per 32), None
        otherwise (BF16 GEMMs; torchao's ``dynamic`` casts keep the BF16 inputs)."""
        if self.dtype != "fp8" or self.fp8_cast == "dynamic":
            return None
        return (1 + 1 / 32 if self.fp8_cast == "mxfp8" else 1.0), self.fp8_cast == "cached"

    def blocking_sends(self, layout: Layout) -> bool:
        """Whether ``layout``'s stages wait for their sends (:attr:`p2p_overlap`, :attr:`blocking_1f1b`)."""
        return layout.stages > 1 and (not self.p2p_overlap or self.blocking_1f1b and layout.schedule == "1f1b")

    def pairs(self, layout: Layout) -> bool:
        """Whether ``layout`` runs forward-backward pairs whose parts hide each other's expert all-to-all: DualPipe(V)
        always, the others where :meth:`overlap_pairs`."""
        return layout.schedule in PAIRED or self.overlap_pairs(layout)

    def reshards(self, layout: Layout) -> bool:
        """Whether FSDP holds ``layout``'s weights and gradients sharded while the step runs, a layer gathered for every
        micro-batch (:attr:`Layout.reshards`, where :attr:`fsdp_per_layer`)."""
        return layout.reshards and self.fsdp_per_layer

    def zero2(self, layout: Layout) -> bool:
        """Whether :attr:`shard_gradients` shards ``layout``'s gradients: they are otherwise whole (not FSDP on one
        stage, which shards them already) and other ranks hold the same parameters (:attr:`Layout.state_groups`, the
        experts' only where the model has experts)."""
        dense, experts = layout.state_groups
        shared = max(dense, experts if self.spec.experts else 1) > 1
        return self.shard_gradients and not self.reshards(layout) and shared

    def param_state(self, layout: Layout, dense: float, expert: float, *, ends: float = 0.0) -> tuple[float, ...]:
        """``(weights, gradients, optimizer)`` bytes per GPU of the ``dense`` and ``expert`` parameters a rank of
        ``layout`` holds (:meth:`Layout.param_state`): whole gradients in the reduce's dtype (:attr:`grad_reduce`),
        sharded where :meth:`zero2`; the optimizer state sharded by FSDP or the distributed optimizer
        (:attr:`distributed_optimizer`). In FP8 the weights of the layers' GEMMs, all but the ``ends`` (the embedding
        and head, BF16 GEMMs), also have the FP8 copies Transformer Engine keeps through the step
        (:func:`~pipeloom.plan.cluster.efficiency.fp8_weight_copy_bytes`), unless FSDP gathers each layer for every
        micro-batch (then they are made per gather, in the gathered layer's buffer)."""
        weights, gradients, states = layout.param_state(
            dense, expert, GRAD_REDUCE[self.grad_reduce], self.zero2(layout), ADAM_MOMENTS[self.adam_moments],
            reshards=self.reshards(layout), shard_optimizer=self.distributed_optimizer or layout.fsdp)
        if self.dtype == "fp8" and not self.reshards(layout):
            weights += fp8_weight_copy_bytes(self.fp8_cast, any_layout=self.hw.fp8_any_layout) * (dense + expert - ends)
        return weights, gradients, states

    def overlap_pairs(self, layout: Layout) -> bool:
        """Whether :attr:`moe_overlap` pairs ``layout``'s forwards and backwards: with ep > 1, on one pipeline stage or
        under interleaved 1F1B (DualPipe(V) pairs without it)."""
        return self.moe_overlap and layout.ep > 1 and (layout.pp == 1 or layout.schedule == "interleaved-1f1b")

    def _check_applies(self) -> None:
        """LayoutError for a framework choice with nothing to apply to here, or that this GPU cannot run."""
        idle = idle_modules(self.spec, megatron_modules(self.selective))
        if idle:
            raise LayoutError(f"selective={self.selective!r}: " + "; ".join(
                f"{module} recomputes nothing in the {self.spec.family} model, which {why}" for module, why in idle)
                + f": leave {'it' if len(idle) == 1 else 'them'} out")
        if self.selective == "deepseek":
            reasons = [why for why, wrong in (
                (f"the {self.spec.family} model has no multi-head latent attention, whose up-projections it "
                 "recomputes", not self.spec.attention.latent),
                (f"it caches activations in FP8, as DeepSeek-V3's FP8 training does, and the GEMMs are {self.dtype}: "
                 "add --dtype fp8 (dtype='fp8')", self.dtype != "fp8")) if wrong]
            if reasons:
                raise LayoutError("selective='deepseek' is DeepSeek-V3's recipe: " + "; ".join(reasons)
                                  + "; use selective 'core_attn' or 'op' otherwise")
        if self.fp8_cast != "cached" and self.dtype != "fp8":
            raise LayoutError(f"fp8_cast={self.fp8_cast!r} prices FP8 GEMMs' casts; with dtype {self.dtype!r} there "
                              "are none: plan with --dtype fp8 (dtype='fp8' in Python) or leave --fp8-cast "
                              "(fp8_cast) out")
        if self.fp8_cast == "mxfp8" and not self.hw.mxfp8:
            raise LayoutError(f"fp8_cast='mxfp8' needs tensor cores that scale FP8 per block of 32 (Blackwell: b200, "
                              f"gb200, gb300); {self.hw.name} has none (its hardware description's mxfp8 is false): "
                              "use --fp8-cast current or cached there (fp8_cast= in Python)")
        for flag, on, what in (("moe-overlap", self.moe_overlap, "moe_overlap overlaps"),
                               ("moe-comm", self.moe_comm != "plain", f"moe_comm={self.moe_comm!r} prices")):
            if on and self.spec.experts is None:
                raise LayoutError(f"{what} the expert all-to-all; the {self.spec.family} model has no experts: "
                                  f"leave --{flag} ({flag.replace('-', '_')}) out")
        if self.moe_comm != "plain" and self.hw.name in ("a100-40gb", "a100-80gb", "mi300x"):
            raise LayoutError(f"moe_comm={self.moe_comm!r}: DeepEP's and Hybrid-EP's kernels need NVIDIA Hopper or "
                              f"Blackwell GPUs (h100, h200, b200, gb200, gb300), not {self.hw.name}: use 'plain' there")
