"""Per-head modules under tensor parallelism: Qwen3's ``q_norm``/``k_norm`` (a norm over ``head_dim`` applied
to ``q_proj(x).view(B, T, H, D)``) see only their tp rank's heads once the projections are column-parallel, so
their replicated weight's gradient is a partial sum. :func:`head_norm_style` is the style that sums it over
``"tp"``; :func:`check_head_norms` refuses a plan that splits the heads and leaves such a module plain, and
:func:`check_head_counts` a tp size that would split a head (found at the first forward as a failed reshape).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from pipeloom.runtime.errors import PipelineError

__all__ = ["HEAD_NORM_FIX", "check_head_counts", "check_head_norms", "head_modules", "head_norm_style",
           "per_head_modules", "splits_heads"]

_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "wq", "wk", "wv",
                          "wqkv", "qkv", "query", "key", "value"})
"""The last name of a plan key that shards an attention's query, key or value projection (transformers' and
torchtitan's names): such a plan splits the heads."""

HEAD_NORM_FIX = ("pipeloom.runtime.parallel.tp_heads.head_norm_style(), i.e. torch's SequenceParallel("
                 "sequence_dim=-2, use_local_output=True); transformers calls it 'replicated_with_grad_allreduce', "
                 "a saved recipe lists it under 'head_norm'")
"""The fix named by the refusal: the style to give a per-head module."""


def head_norm_style() -> object:
    """torch's style for a norm over the last dimension of ``(..., heads, head_dim)`` whose heads axis (-2) is
    split over ``"tp"``: ``SequenceParallel(sequence_dim=-2, use_local_output=True)``. The input (this rank's
    heads, a local tensor) becomes a DTensor sharded on dim -2 (``DTensor.from_local`` turns -2 into ``ndim -
    2``), the weight a Replicate DTensor, so DTensor's backward sums the weight's gradient over ``"tp"`` (what
    transformers' ``ReplicatedWithGradAllReduce`` does with a gradient hook, here once per backward, so it
    stays right when micro-batches accumulate); the forward needs no collective and returns the local tensor.
    torchtitan gives Qwen3's ``q_norm``/``k_norm`` the same style (``sequence_dim=2``)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel(sequence_dim=-2, use_local_output=True)


def splits_heads(style: object) -> bool:
    """Whether ``style`` leaves a linear's output split over its features, as a column-parallel projection
    whose heads are split (``ColwiseParallel`` with a ``Shard`` output, its default)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return isinstance(style, ColwiseParallel) and any(isinstance(p, Shard) for p in style.output_layouts)


def head_modules(parent: nn.Module, columns: Sequence[nn.Module]) -> list[str]:
    """Names of ``parent``'s children that act per head beside its column-split projections ``columns``: not a
    linear, with parameters, every one 1-D of one size ``d`` dividing each projection's output width into
    several heads, and ``d`` is ``parent.head_dim`` where the module has that attribute, else smaller than each
    projection's input width (a norm over the hidden width, e.g. a final norm beside a split head, is not per
    head)."""
    linears = [m for m in columns if isinstance(m, nn.Linear)]
    if not linears:
        return []
    head_dim = getattr(parent, "head_dim", None)
    found = []
    for name, child in parent.named_children():
        if isinstance(child, nn.Linear):
            continue
        sizes = {p.numel() if p.dim() == 1 else -1 for p in child.parameters()}
        if len(sizes) != 1:
            continue
        d = sizes.pop()
        known = d == head_dim if isinstance(head_dim, int) else all(d < m.in_features for m in linears)
        if d > 0 and known and all(m.out_features % d == 0 and m.out_features > d for m in linears):
            found.append(name)
    return found


def per_head_modules(root: nn.Module, columns: Sequence[str]) -> list[tuple[str, str]]:
    """(name, parent's name) of every module of ``root`` that :func:`head_modules` finds beside the
    column-split projections named ``columns`` (names under ``root``), grouped by their parent."""
    parents: dict[str, list[nn.Module]] = {}
    for name in columns:
        parents.setdefault(name.rpartition(".")[0], []).append(root.get_submodule(name))
    return [(f"{parent}.{child}" if parent else child, parent)
            for parent, modules in parents.items() for child in head_modules(root.get_submodule(parent), modules)]


def check_head_norms(stage: nn.Module, resolved: Mapping[str, object], piece: int) -> None:
    """Refuse a plan that splits the heads of a module of ``stage`` and leaves a per-head module beside them
    (:func:`head_modules`) out of the plan: each tp rank would sum its gradient over its own heads only, the
    replicas' gradients would differ and the replicas drift apart after the first optimizer step.
    ``resolved``: every module name the plan names in this stage -> its style.

    Checked here, when the plan is applied, from the modules' structure, rather than by comparing the
    replicated gradients over ``"tp"`` after the first step: it costs no collective, refuses before any compute
    (not after a step a user may have logged), holds under FSDP (whose parameters are all DTensors) and names
    the module and the fix. What it does not see: a per-head parameter held by the attention module itself
    rather than by a child, or a per-head module not beside the projections (docs/parallelism.md)."""
    columns = [name for name, style in resolved.items() if splits_heads(style)]
    for name, parent in per_head_modules(stage, columns):
        if name in resolved:
            continue
        module = stage.get_submodule(name)
        size = next(module.parameters()).numel()
        split = [n for n in columns if n.rpartition(".")[0] == parent]
        raise PipelineError(
            f"tp_plan splits the heads of {parent or type(stage).__name__!r} (column-parallel {split}) but leaves "
            f"{name!r} ({type(module).__name__}, {size} parameters per head) a plain module in model piece "
            f"{piece}: each tp rank would sum its gradient over its own heads only, so the replicas' gradients "
            f"would differ and drift apart after the optimizer step; give {name!r} (or a pattern naming it) the "
            f"style {HEAD_NORM_FIX}")


def check_head_counts(model: nn.Module, plan: Mapping[str, object], tp: int) -> None:
    """Refuse a plan that shards an attention's projections (a key ending in one of :data:`_PROJECTIONS`) over ``tp``
    ranks where ``tp`` does not divide the model's query or key-value heads (its config's, or its text config's,
    ``num_attention_heads`` and ``num_key_value_heads`` or another name for them): each rank must take whole heads."""
    config = getattr(model, "config", None)
    config = next((c for c in (config, getattr(config, "text_config", None))
                   if isinstance(getattr(c, "num_attention_heads", None), int)), None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return
    named = (getattr(config, name, None) for name in ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"))
    groups = next((value for value in named if isinstance(value, int) and value > 0), heads)
    attention = next((key for key in plan if key.rsplit(".", 1)[-1].lower() in _PROJECTIONS), None)
    if attention is None or (heads % tp == 0 and groups % tp == 0):
        return
    fits = [size for size in range(1, min(heads, groups) + 1) if heads % size == 0 and groups % size == 0]
    said = f"{heads} query / {groups} key-value heads" if groups != heads else f"{heads} heads"
    fix = (f"use a \"tp\" mesh dimension of {', '.join(map(str, fits[:-1]))} or {fits[-1]}" if len(fits) > 1
           else "leave the attention out of tp_plan, or use a mesh without \"tp\"")
    raise PipelineError(f"tp {tp} does not split {type(model).__name__}'s {said} evenly (tp_plan shards the "
                        f"attention: {attention!r}; each tp rank takes whole heads); {fix}")
