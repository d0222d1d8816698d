"""Tensor parallelism inside pipeline stages: the mesh's ``"tp"`` dimension, torch's own
``parallelize_module`` applied to each rank's stages before the engine captures their parameters, and
DTensors at stage boundaries (they travel as their local tensor; the placements ride in the message's
description and the receiver rebuilds the DTensor on its own ``"tp"`` sub-mesh).

No tensor-parallel layer lives here: a plan is torch's ``{module name or pattern: ParallelStyle}`` dict
(or ``"hf"``: a ``transformers`` model's own plan, its style names translated to torch's), resolved against
the model's module names (the fx stages keep them) and applied unchanged.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import fx, nn

from pipeloom.plan.tp.recipes import check_recipe
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.parallel.tp_heads import check_head_counts, check_head_norms, head_norm_style

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "HF_STYLES",
    "TensorParallel",
    "apply_tp_plan",
    "captured_parameters",
    "changed_parameter",
    "check_tied_untouched",
    "check_tp_plan",
    "hf_plan",
    "is_dtensor",
    "leaf_modules_for",
    "local_of",
    "mesh_coordinates",
    "plan_blocks",
    "recipe_styles",
    "resolve",
    "set_group_timeout",
    "with_local",
]


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (size 1 and no group without a ``"tp"`` dimension)."""

    group: ProcessGroup | None = None  # the "tp" process group
    rank: int = 0
    size: int = 1
    mesh: DeviceMesh | None = None  # the 1-D "tp" sub-mesh parallelize_module shards over; None without "tp"


def is_dtensor(value: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def with_local(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``like``'s kind: a DTensor with ``like``'s mesh, placements and shape."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def set_group_timeout(groups: Sequence[object], timeout: float) -> None:
    """Give ``groups`` (the mesh's sub-groups) the engine's timeout, so that a collective inside a
    stage's forward (a tensor-parallel all-reduce) ends within it instead of torch's default 30 minutes."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for group in groups:
        if group is not None:
            _set_pg_timeout(datetime.timedelta(seconds=timeout), cast("ProcessGroup", group))


# ------------------------------------------------------------------------------------- plans


def check_tp_plan(tp_plan: object, tp: TensorParallel, *, model: nn.Module | None = None) -> dict | None:
    """The plan as a dict (None for no plan; ``"hf"``: :func:`hf_plan` of ``model``), refusing what is not
    built yet or does not fit the mesh. (``"auto"`` is resolved before: :mod:`pipeloom.runtime.parallel.tp_auto`.)"""
    if tp_plan is None:
        if tp.size > 1:
            raise PipelineError(f"the mesh has a \"tp\" dimension of size {tp.size} but no tp_plan= was given; pass "
                                "tp_plan={'layers.*.q': ColwiseParallel(), ...} (torch's parallelize_module plan) "
                                "or a mesh without \"tp\"")
        return None
    if tp_plan == "hf":
        if model is None:
            raise PipelineError("tp_plan='hf' reads the model's own plan: pass the model too (pipeline(model, "
                                "stages=[...]) with stages of your own), or torch's parallelize_module plan as a dict")
        tp_plan = hf_plan(model)
    if isinstance(tp_plan, str):
        raise PipelineError(f"tp_plan={tp_plan!r} is not a plan pipeloom knows; pass 'hf' (a transformers model's "
                            "own plan), 'auto' (the sharding search) or torch's parallelize_module plan as a dict "
                            "{module name or pattern: ParallelStyle}")
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise PipelineError(f"tp_plan must be a non-empty dict {{module name or pattern: ParallelStyle}} as "
                            f"torch's parallelize_module takes, got {type(tp_plan).__name__}")
    from torch.distributed.tensor.parallel import ParallelStyle

    for key, style in tp_plan.items():
        if not isinstance(key, str) or not key or not isinstance(style, ParallelStyle):
            raise PipelineError(f"tp_plan entry {key!r}: {type(style).__name__} must map a module name or pattern "
                                "to a ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...)")
    if tp.mesh is None:
        raise PipelineError("tp_plan= shards over the mesh's \"tp\" dimension: pass Parallelism(mesh=) a mesh with "
                            "mesh_dim_names holding \"pp\" and \"tp\", e.g. init_device_mesh('cpu', (2, 2), "
                            "mesh_dim_names=('pp', 'tp'))")
    if model is not None and tp.size > 1:
        check_head_counts(model, tp_plan, tp.size)
    return dict(tp_plan)


def resolve(root: nn.Module, key: str) -> list[str]:
    """The qualified names of ``root``'s modules that plan key ``key`` names: each dot-separated token
    matched with ``fnmatch`` against child names, as torch's ``parallelize_module`` does."""
    found = [("", root)]
    for token in key.split("."):
        found = [(f"{name}.{child}" if name else child, module)
                 for name, parent in found for child, module in parent.named_children() if fnmatch(child, token)]
    return [name for name, _ in found]


def leaf_modules_for(model: nn.Module, plan: Mapping[str, object], given: Sequence[str]) -> list[str]:
    """``given`` plus every module a plan key names that torch.fx would inline (not a ``torch.nn`` module):
    a style's hooks fire only on a module the stage calls, so such a region stays whole in the split."""
    leaves = list(given)
    for key in plan:
        names = resolve(model, key)
        if not names:
            raise PipelineError(f"tp_plan key {key!r} names no module of {type(model).__name__}; use module "
                                "names of model.named_modules() (fnmatch patterns per dot-separated part)")
        for name in names:
            module = model.get_submodule(name)
            _check_shardable(key, name, module, plan[key])
            builtin = type(module).__module__.startswith(("torch.nn", "torch.ao.nn"))
            if not builtin and name not in leaves:
                leaves.append(name)
    return leaves


def _check_shardable(key: str, name: str, module: nn.Module, style: object) -> None:
    """PipelineError where ``key`` gives ``name`` a column- or row-wise style that torch applies only to
    ``nn.Linear`` and ``nn.Embedding`` (an MoE router, a custom module): torch had raised NotImplementedError from
    deep inside ``parallelize_module`` at the first forward, naming neither."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # a subclass with an _apply of its own may take other modules: left to it
    torch_own = getattr(type(style), "_apply", None) in (ColwiseParallel._apply, RowwiseParallel._apply)
    if torch_own and isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(
            module, (nn.Linear, nn.Embedding)):
        raise PipelineError(f"tp_plan key {key!r} gives {name!r} ({type(module).__name__}) {type(style).__name__}, "
                            "which torch applies only to nn.Linear and nn.Embedding; name its Linear children "
                            "instead, or leave it out of the plan (replicated)")


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)  # children of these are the repeated blocks


def _repeated_parts(model: nn.Module, tokens: list[str]) -> list[int]:
    """Indices of the key parts that stand for a repeated block: a pattern (``*``, ``?``, ``[``), or a child of
    a container of blocks (``layers.0`` of a ``ModuleList``: the explicit name of one repeat)."""
    found: list[int] = []
    parent: nn.Module | None = model
    for k, token in enumerate(tokens):
        if any(c in token for c in "*?["):
            found.append(k)
            parent = None  # a pattern's children are several modules: no single parent to look into
            continue
        if parent is not None and isinstance(parent, _CONTAINERS):
            found.append(k)
        child = getattr(parent, token, None) if parent is not None else None
        parent = child if isinstance(child, nn.Module) else None
    return found


def plan_blocks(model: nn.Module, plan: Mapping[str, object]) -> list[str]:
    """The modules a plan's styles need whole when torch.export traces: for a key with a repeated part before
    its last part, the module the key names up to the last such part, whether written as a pattern or as an
    explicit name (``model.layers.*.self_attn.q_proj``, ``model.layers.0.self_attn.q_proj`` and
    ``model.layers.0.self_attn.*`` -> ``model.layers.N``, the block the plan repeats: its forward reshapes the
    sharded outputs by head counts, which torch.export would bake in from the whole model); for a key without
    one (``lm_head``, ``layers.*``), the modules it names."""
    blocks: list[str] = []
    for key in plan:
        tokens = key.split(".")
        repeated = [k for k in _repeated_parts(model, tokens) if k < len(tokens) - 1]
        prefix = ".".join(tokens[:repeated[-1] + 1]) if repeated else key
        for name in resolve(model, prefix):
            if name not in blocks and not any(name.startswith(outer + ".") for outer in blocks):
                blocks = [b for b in blocks if not b.startswith(name + ".")] + [name]
    return blocks


def _called(stage: nn.Module) -> set[str] | None:
    """Names of the modules an fx stage calls (None for a stage that is not a GraphModule: all count)."""
    if not isinstance(stage, fx.GraphModule):
        return None
    return {str(node.target) for node in stage.graph.nodes if node.op == "call_module"}


def check_tied_untouched(stages: Sequence[nn.Module], plan: Mapping[str, Any], shared: Mapping[int, str]) -> None:
    """Refuse, the same way on every rank (every piece looked at, held or not), a plan that gives a style to a
    module whose own parameters include one several pieces use (``shared``: id -> name): torch would shard or
    replicate it as a DTensor, while its gradients are exchanged between ranks as plain tensors. Styles that
    only prepare a module's inputs or outputs touch no parameter."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput

    for stage in stages:
        for key, style in plan.items():
            if isinstance(style, (PrepareModuleInput, PrepareModuleOutput)):
                continue
            for name in resolve(stage, key):
                own = stage.get_submodule(name).parameters(recurse=False)
                tied = next((shared[id(p)] for p in own if id(p) in shared), None)
                if tied is not None:
                    raise PipelineError(
                        f"parameter {tied!r} is used by several pieces (tied) and tp_plan shards it (key {key!r}); "
                        f"sharding a tied parameter is not built yet: leave {key!r} out of tp_plan (for "
                        "tp_plan='hf': pass pipeloom.runtime.parallel.tp.hf_plan(model) without it) or split so "
                        "that all its uses fall in one piece")


def apply_tp_plan(stages: Mapping[int, nn.Module], plan: Mapping[str, Any], tp: TensorParallel) -> None:
    """Apply ``plan`` with ``parallelize_module`` to each stage (``{piece: module}``) over the ``"tp"``
    sub-mesh: every key to the modules of that stage it names (the model's names, which fx stages keep).
    A key that names a module a stage holds but never calls (torch.fx inlined it, or torch.export
    flattened it) is refused: its style would never fire; so is a plan that splits a module's heads and leaves
    a per-head norm beside them plain (:func:`pipeloom.runtime.parallel.tp_heads.check_head_norms`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for piece, stage in stages.items():
        called = _called(stage)
        applied: list[tuple[str, Any]] = []  # (module, style) in the plan's order, each key resolved once
        for key, style in plan.items():
            for name in resolve(stage, key):
                if called is not None and not any(name == c or name.startswith(c + ".") for c in called):
                    raise PipelineError(
                        f"tp_plan key {key!r} names module {name!r}, which model piece {piece} does not call as a "
                        "module (the tracer inlined or flattened it), so its style would never run; keep it (or the "
                        f"block around it) whole with leaf_modules=[{name!r}]")
                applied.append((name, style))
        check_head_norms(stage, dict(applied), piece)
        for name, style in applied:
            parallelize_module(stage, cast("DeviceMesh", tp.mesh), {name: style})


def captured_parameters(modules: Mapping[int, nn.Module]) -> dict[int, tuple[tuple[str, int], ...]]:
    """Per stage, its parameters' names and identities, as the engine captured them."""
    return {s: tuple((name, id(p)) for name, p in module.named_parameters()) for s, module in modules.items()}


def changed_parameter(modules: Mapping[int, nn.Module],
                      captured: Mapping[int, tuple[tuple[str, int], ...]]) -> tuple[int, str] | None:
    """(stage, parameter name) of the first parameter that is not the object the engine captured."""
    for s, module in modules.items():
        now = tuple((name, id(p)) for name, p in module.named_parameters())
        if now != captured[s]:
            before = dict(captured[s])
            for name, ident in now:
                if before.get(name) != ident:
                    return s, name
            return s, next(name for name, _ in captured[s] if name not in dict(now))
    return None


def mesh_coordinates(mesh: DeviceMesh) -> dict[int, str]:
    """Every global rank of ``mesh`` -> its coordinates, e.g. ``"pp 1, tp 0"``."""
    names = mesh.mesh_dim_names or tuple(f"dim {k}" for k in range(mesh.ndim))
    grid = mesh.mesh
    found = {}
    for index in torch.cartesian_prod(*(torch.arange(n) for n in grid.shape)).reshape(-1, grid.dim()).tolist():
        found[int(grid[tuple(index)])] = ", ".join(f"{n} {c}" for n, c in zip(names, index))
    return found


# ------------------------------------------------------------------------------ transformers' own plans

# transformers' style names -> torch ParallelStyles doing what transformers' own layer of that name does
# (transformers/distributed/tensor_parallel.py registers its own classes with these layouts)
HF_STYLES: dict[str, Callable[[], object]] = {
    "colwise": lambda: _styles().ColwiseParallel(),  # Replicate -> Shard(-1)
    "rowwise": lambda: _styles().RowwiseParallel(),  # Shard(-1) -> Replicate (an all-reduce)
    "colwise_rep": lambda: _styles().ColwiseParallel(output_layouts=_replicate()),  # output all-gathered
    "colwise_gather_output": lambda: _styles().ColwiseParallel(output_layouts=_replicate()),
    "rowwise_rep": lambda: _styles().RowwiseParallel(input_layouts=_replicate()),  # input split here
    "rowwise_split_input": lambda: _styles().RowwiseParallel(input_layouts=_replicate()),
    "embedding_rowwise": lambda: _styles().RowwiseParallel(input_layouts=_replicate()),  # vocabulary-parallel
    "sequence_parallel": lambda: _styles().SequenceParallel(),
    # a per-head norm (Qwen3's q_norm/k_norm) after column-split heads: its weight's gradient summed over "tp"
    "replicated_with_grad_allreduce": head_norm_style,
}
_HF_NO_OP = ("replicate",)  # every rank keeps the whole parameter: nothing to apply


def _styles():
    import torch.distributed.tensor.parallel as styles

    return styles


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


def hf_plan(model: nn.Module) -> dict[str, object]:
    """A ``transformers`` model's own tensor-parallel plan as torch's: its config's ``base_model_tp_plan``
    (keys under the base model, e.g. ``model.layers.*.self_attn.q_proj``) and its class's ``_tp_plan`` (the
    head: ``lm_head``), each style name translated by :data:`HF_STYLES`."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    kind = type(model).__name__
    if config is None or not base:
        what = (f"{kind}'s config ({type(config).__name__}) has no" if config is not None
                else f"{kind} has no config, so no")
        raise PipelineError(f"tp_plan='hf': {what} base_model_tp_plan (transformers gives one to LLaMA, Qwen2, "
                            "Mistral and other models, not to this one); pass torch's parallelize_module plan as a "
                            "dict {module name or pattern: ParallelStyle}")
    prefix = getattr(model, "base_model_prefix", "")
    under = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""  # a head around it
    named = {f"{under}.{key}" if under else key: style for key, style in base.items()}
    named.update(getattr(type(model), "_tp_plan", None) or {})
    plan = {}
    for key, style in named.items():
        if style in _HF_NO_OP:
            continue
        if style not in HF_STYLES:
            raise PipelineError(f"tp_plan='hf': {kind}'s plan gives {key!r} the style {style!r}, which pipeloom does "
                                f"not translate to torch (it translates {sorted(HF_STYLES)}); pass torch's "
                                "parallelize_module plan as a dict")
        if resolve(model, key):  # else a module of another variant: Qwen3-MoE's plan names the dense MLP its
            plan[key] = HF_STYLES[style]()  # mlp_only_layers have, transformers skipping it where no module matches
    base_keys = [key for key in plan if key not in (getattr(type(model), "_tp_plan", None) or {})]
    if not base_keys:  # the base model not found where its prefix says: its whole plan dropped, not a variant's
        raise PipelineError(f"tp_plan='hf': no key of {kind}'s base_model_tp_plan names one of its modules (e.g. "
                            f"{next(iter(named))!r}); pass torch's parallelize_module plan as a dict")
    return plan


def recipe_styles(recipe: Mapping) -> dict:
    """torch's ``parallelize_module`` plan for ``recipe`` (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    recipe = check_recipe(recipe)
    sp = recipe["recipe"] == "megatron-sp"
    styles: dict = {}
    for name in recipe["sequence"]:
        styles[name] = SequenceParallel(use_local_output=True)  # the residual stream stays a local shard
    for name in recipe["gather"]:  # (B, T/tp, h) shard -> (B, T, h): one all-gather for the whole region
        styles[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for name in recipe["column"]:
        inside = any(name.startswith(region + ".") for region in recipe["gather"])
        styles[name] = ColwiseParallel(input_layouts=Shard(1)) if sp and not inside else ColwiseParallel()
    for name in recipe["row"]:
        styles[name] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    for name in recipe["vocab_embedding"]:
        styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    for name in recipe["vocab_head"]:
        styles[name] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    for name in recipe["head_norm"]:  # a norm over head_dim of (B, T, heads/tp, head_dim): gradient summed
        styles[name] = head_norm_style()
    for name in recipe["loss_head"]:
        styles[name] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                       use_local_output=False)
    return styles
