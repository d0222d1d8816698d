"""Expert parallelism: the mesh's ``"ep"`` dimension shares each mixture-of-experts layer's experts out over
the ranks of one pipeline stage, which otherwise act as data-parallel replicas (Megatron's and torchtitan's
placement: ep inside the data-parallel ranks).

With a mesh ``("dp", "pp", "ep")`` (``"dp"`` optional) the ``dp × ep`` ranks of one ``"pp"`` coordinate are
the pipeline's replicas: each runs its contiguous share of the global batch, and every parameter but the
experts' (attention, router, shared experts, dense layers) is replicated and has its gradient summed over
all of them, as :mod:`pipeloom.runtime.parallel.dp` does over ``"dp"``. An experts module keeps ``experts / ep`` of
its experts: its parameters become ``DTensor``\\ s sharded ``Shard(0)`` over the ``"ep"`` sub-mesh (so
clipping, state dicts and checkpoints see the whole tensor), and its gradient is summed over ``"dp"`` only.
Tokens reach their experts' ranks and come back with all-to-all (:mod:`pipeloom.runtime.parallel.ep_dispatch`).

With ``data_parallel="fsdp"`` the dense parameters are FSDP-sharded over the replicas (their flattened
``"replicas"`` mesh) and each experts module over ``"dp"`` within its ep shard
(:mod:`pipeloom.runtime.parallel.fsdp`). With a ``"tp"`` dimension too, the replicas are those of one
(``"pp"``, ``"tp"``) coordinate and the experts are replicated over ``"tp"``: after a row-parallel layer every
tp rank holds the same tokens, dispatches them over its own ``"ep"`` group and computes the same outputs
(:func:`check_tp_with_experts` refuses the plans for which that does not hold).

**The experts interface** (what ``transformers``' grouped experts modules — Qwen2/3-MoE, Mixtral, OLMoE,
DeepSeek-V3, ... — already are, and what a user's own MoE layer provides to be sharded): a module with

- ``num_experts: int``, and every parameter it holds directly stacked over the experts on dim 0
  (``[num_experts, ...]``);
- ``forward(hidden_states [T, H], top_k_index [T, k] int, top_k_weights [T, k]) -> [T, H]`` returning, for
  each token t, ``Σ_j f(x_t, e_tj, w_tj)`` where ``f`` uses only expert ``e_tj``'s slice of the parameters
  (an index equal to ``num_experts`` means "no expert" and contributes nothing).

``pipeline(..., experts=None)`` finds every such module of the model; ``experts=[names]`` names them (fnmatch
patterns per dot-separated part, as ``tp_plan`` keys).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.parallel.tp import resolve
from pipeloom.runtime.parallel.tp_heads import per_head_modules, splits_heads

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipeloom.runtime.options import Parallelism
    from pipeloom.runtime.parallel.link import SimulatedLink

__all__ = ["REPLICAS", "ExpertParallel", "check_options_agree", "check_experts_agree", "check_tp_with_experts",
           "expert_groups", "expert_layout", "experts_for", "find_experts", "is_expert", "is_experts_module",
           "moe_layers", "shard_experts"]


REPLICAS = "replicas"  # the name of the replicas' flattened mesh dimension (every one but "pp" and "tp")


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """This rank's place in its expert-parallel group (size 1 and no group without an ``"ep"`` dimension)."""

    group: dist.ProcessGroup | None = None  # the "ep" group: the ranks one stage's experts are shared out over
    rank: int = 0  # this rank's index in it: it holds experts rank·E/ep … (rank+1)·E/ep − 1 of each layer
    size: int = 1
    mesh: DeviceMesh | None = None  # the 1-D "ep" sub-mesh the experts' DTensors are sharded over
    dp_group: dist.ProcessGroup | None = None  # the "dp" group the experts' gradients are summed over
    dp_size: int = 1
    dp_mesh: DeviceMesh | None = None  # the "dp" sub-mesh FSDP shards each rank's experts over (size > 1 only)


def expert_layout(mesh: DeviceMesh, names: Sequence[str]) -> tuple[ExpertParallel, DeviceMesh]:
    """(the ``"ep"`` place, the replicas' 1-D mesh) on a mesh with ``"ep"``: the replicas are every rank of
    this rank's ``"pp"`` (and ``"tp"``) coordinate, numbered in the order of the mesh's other dimensions
    (``("dp", "pp", "ep")``: replica = dp index × ep + ep index); their mesh (``"replicas"``, those dimensions
    flattened) is what the dense parameters' gradients are summed, or FSDP-sharded, over. Every rank calls it."""
    if mesh.size() != dist.get_world_size():  # before flattening, whose groups every rank creates
        raise PipelineError(f"the mesh holds {mesh.size()} of the {dist.get_world_size()} ranks; with \"ep\" "
                            "pipeloom needs a mesh over every rank of the default process group")
    ep_group = mesh.get_group("ep")
    dp_group, dp_size, dp_mesh = None, 1, None
    if "dp" in names and mesh.size(list(names).index("dp")) > 1:
        dp_group, dp_mesh = mesh.get_group("dp"), mesh["dp"]
        dp_size = dist.get_world_size(dp_group)
    ep = ExpertParallel(group=ep_group, rank=dist.get_rank(ep_group), size=dist.get_world_size(ep_group),
                        mesh=mesh["ep"], dp_group=dp_group, dp_size=dp_size, dp_mesh=dp_mesh)
    others = tuple(name for name in names if name not in ("pp", "tp"))  # in the mesh's order
    replicas = (mesh[others] if len(others) > 1 else mesh[others[0]])._flatten(REPLICAS)
    return ep, replicas


# ------------------------------------------------------------------------------------- finding experts


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` has the experts interface's shape (see the module doc): ``num_experts``, parameters
    stacked over the experts on dim 0, and a forward of (hidden_states, top_k_index, top_k_weights)."""
    count = getattr(module, "num_experts", None)
    params = list(module.named_parameters(recurse=False))
    if isinstance(count, bool) or not isinstance(count, int) or count < 1 or not params:
        return False
    if any(p.dim() < 1 or p.shape[0] != count for _, p in params):
        return False
    try:
        taken = [p for p in inspect.signature(module.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(taken) == 3


def find_experts(model: nn.Module, given: Sequence[str] | None) -> list[str]:
    """Names of ``model``'s experts modules: those ``given`` names (checked against the interface), or every
    module with the interface's shape."""
    if given is None:
        found = [name for name, module in model.named_modules() if name and is_experts_module(module)]
        if not found:
            raise PipelineError(f"the mesh has an \"ep\" dimension but {type(model).__name__} has no experts module "
                                "(num_experts, parameters stacked over the experts on dim 0, forward(hidden_states, "
                                "top_k_index, top_k_weights)); name yours with experts=[...] or drop \"ep\"")
        return found
    names: list[str] = []
    for key in given:
        matched = resolve(model, key)
        if not matched:
            raise PipelineError(f"experts= entry {key!r} names no module of {type(model).__name__}; use names of "
                                "model.named_modules() (fnmatch patterns per dot-separated part)")
        for name in matched:
            if not is_experts_module(model.get_submodule(name)):
                raise PipelineError(f"experts= names {name!r} ({type(model.get_submodule(name)).__name__}), which "
                                    "lacks the experts interface: num_experts, every parameter stacked over the "
                                    "experts on dim 0, forward(hidden_states, top_k_index, top_k_weights) "
                                    "(docs/parallelism.md)")
            names.append(name)
    return names


def _held(stages: Mapping[int, nn.Module], names: Sequence[str]) -> list[tuple[int, str, nn.Module]]:
    """(piece, name, module) of every experts module the stages hold (an fx/export stage keeps the model's
    module paths)."""
    found = []
    for piece, stage in sorted(stages.items()):
        for name in names:
            try:
                module = stage.get_submodule(name)
            except AttributeError:
                continue
            found.append((piece, name, module))
    return found


def check_options_agree(options: Mapping[str, object], ep: ExpertParallel, *, stage_rank: int,
                        everyone: dist.ProcessGroup | None) -> None:
    """Before the model is traced (a large model's trace takes long): every rank of the mesh passed the same
    ``Parallelism`` fields that order the expert exchange (``capacity_factor``, ``overlap_pairs``: ranks that differ
    would mismatch their all-to-alls, which gloo answers by aborting a process); else every rank raises the same
    error (gathered over ``everyone``), naming each rank's value."""
    everything: list = [None] * dist.get_world_size(everyone)
    dist.all_gather_object(everything, (stage_rank, ep.rank, dict(options)), group=everyone)
    for name in options:
        if any(told[name] != everything[0][2][name] for *_, told in everything):  # 1 and 1.0 agree
            told = ", ".join(f"pipeline rank {where} ep rank {ep_rank}: {value[name]}"
                             for where, ep_rank, value in everything)
            raise PipelineError(f"the ranks disagree on Parallelism({name}=) ({told}); pass the same value on every "
                                "rank")


def check_experts_agree(stages: Mapping[int, nn.Module], names: Sequence[str], ep: ExpertParallel, *,
                        stage_rank: int, everyone: dist.ProcessGroup | None) -> None:
    """Before any tensor moves: the ranks of every ``"ep"`` group hold the same experts modules with the same
    expert counts and shapes, and the counts divide by the group's size; else every rank of the mesh raises the
    same error (gathered over ``everyone``), naming the ranks and their values."""
    mine = [(name, _count(module), [tuple(p.shape) for p in module.parameters(recurse=False)])
            for _, name, module in _held(stages, names)]
    everything: list = [None] * dist.get_world_size(everyone)
    dist.all_gather_object(everything, (stage_rank, ep.rank, mine), group=everyone)
    first: dict[int, tuple[int, list]] = {}
    for where, ep_rank, held in everything:
        if where in first and first[where][1] != held:
            raise PipelineError(
                f"the ranks of one \"ep\" group (pipeline rank {where}) disagree on their experts: ep rank "
                f"{first[where][0]} holds {_describe(first[where][1])}, ep rank {ep_rank} holds {_describe(held)}; "
                "build the same model (the same num_experts) on every rank")
        first.setdefault(where, (ep_rank, held))
        for name, count, _ in held:
            if count % ep.size:
                raise PipelineError(f"{name!r} has {count} experts, which do not divide over \"ep\" of size "
                                    f"{ep.size}; choose an ep size that divides the expert count")


def _count(module: nn.Module) -> int:
    return int(getattr(module, "num_experts"))  # noqa: B009 (checked by is_experts_module)


def _describe(held: list) -> str:
    return ", ".join(f"{name} ({count} experts)" for name, count, _ in held) or "no experts module"


# ------------------------------------------------------------------------------------- sharding


def shard_experts(stages: Mapping[int, nn.Module], names: Sequence[str], ep: ExpertParallel, *,
                  link: SimulatedLink | None = None, capacity_factor: float | None = None) -> list[nn.Module]:
    """Keep this rank's ``E / ep`` experts of every experts module the stages hold, as ``DTensor`` parameters
    sharded ``Shard(0)`` over the ``"ep"`` sub-mesh, and route the module's forward through the all-to-all
    dispatch (its all-to-alls held to ``link``, a simulated slower link, when given; with ``capacity_factor``:
    :func:`~pipeloom.runtime.parallel.ep_dispatch.over_capacity`). Returns the modules sharded. Call after the
    pieces are on their device."""
    from torch.distributed.tensor import DTensor, Shard

    from pipeloom.runtime.parallel.ep_dispatch import ExpertDispatch

    held = _held(stages, names)
    for _, _, module in held:
        count = _count(module)
        per = count // ep.size
        local = copy.copy(module)  # the same module over this rank's experts only; computes what arrives
        local._parameters = {}
        setattr(local, "num_experts", per)  # noqa: B010 (an nn.Module attribute mypy types as Tensor | Module)
        for pname, param in list(module.named_parameters(recurse=False)):
            piece = param.detach()[ep.rank * per:(ep.rank + 1) * per].clone()
            sharded = DTensor.from_local(piece, ep.mesh, [Shard(0)], run_check=False, shape=param.shape,
                                         stride=param.stride())
            module._parameters[pname] = nn.Parameter(sharded, requires_grad=param.requires_grad)
        module.forward = ExpertDispatch(module=module, local=local, ep=ep, num_experts=count, link=link,
                                        capacity_factor=capacity_factor)
    return [module for _, _, module in held]


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` is a sharded expert parameter: a DTensor over the ``"ep"`` sub-mesh, or over
    ``("dp", "ep")`` once FSDP shards it (the dense parameters' FSDP mesh is the flattened ``"replicas"``)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())


def expert_groups(stage_params: Mapping[int, Sequence[nn.Parameter]], ep: ExpertParallel) -> dict[int, tuple]:
    """Parameter id -> (group, size) its gradient is summed over instead of the replicas: an expert's over
    ``"dp"`` alone (size 1: not summed; every ep rank's own experts already saw every replica's tokens)."""
    return {id(p): (ep.dp_group, ep.dp_size) for ps in stage_params.values() for p in ps if is_expert(p)}


def experts_for(model: nn.Module | None, stages: object, ep: ExpertParallel, parallel: Parallelism) -> list[str]:
    """The experts modules ``pipeline()`` shards over ``"ep"`` (none without it): found in ``model``, or in
    the user's own ``stages`` when no model is given; refuses ``experts=`` or ``capacity_factor=`` without
    ``"ep"`` (``parallel``: the options, whose ``experts`` name the modules)."""
    given, capacity_factor = parallel.experts, parallel.capacity_factor
    if ep.size <= 1:
        if capacity_factor is not None:
            raise PipelineError(f"Parallelism(capacity_factor={capacity_factor}) bounds the tokens the \"ep\" "
                                "dispatch sends each expert; pass Parallelism(mesh=) a mesh with mesh_dim_names "
                                "holding \"pp\" and \"ep\", or leave capacity_factor out")
        if given is not None:
            raise PipelineError("experts= names the modules sharded over the mesh's \"ep\" dimension; pass "
                                "Parallelism(mesh=) a mesh with mesh_dim_names holding \"pp\" and \"ep\", or leave "
                                "experts= out")
        return []
    if model is not None:
        return find_experts(model, given)
    held = stages.stages if hasattr(stages, "stages") else stages
    if not isinstance(held, Sequence):
        raise PipelineError("an \"ep\" mesh needs the model (pipeline(model, ...)) or stages=[modules]")
    names: list[str] = []
    for stage in held:
        found = find_experts(stage, given) if given is not None else [
            n for n, m in stage.named_modules() if n and is_experts_module(m)]
        names += [n for n in found if n not in names]
    if not names:
        raise PipelineError("the mesh has an \"ep\" dimension but the stages hold no experts module; name yours "
                            "with experts=[...] (docs/parallelism.md: the experts interface)")
    return names


def check_tp_with_experts(plan: Mapping[str, object] | str | object, stages: Mapping[int, nn.Module],
                          names: Sequence[str]) -> None:
    """With "ep" and "tp" together the experts are sharded over "ep" only and replicated over "tp" (every tp
    rank of a replica dispatches the same tokens and computes the same experts): refuse a plan that would shard
    an experts module (or anything inside it), sequence parallelism (each tp rank would route different
    tokens) and ``tp_plan="auto"`` (its search does not know the experts)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    what = "works: attention and dense MLPs tensor-parallel, the experts over \"ep\" only (docs/parallelism.md)"
    if not isinstance(plan, Mapping):
        raise PipelineError(f"tp_plan={plan!r} with an \"ep\" dimension is not built yet; pass torch's "
                            f"parallelize_module plan as a dict that leaves the experts modules out ({what})")
    for key, style in plan.items():
        if isinstance(style, SequenceParallel) and not _head_norms_only(plan, stages, key):
            raise PipelineError(f"tp_plan key {key!r} is SequenceParallel, which with an \"ep\" dimension is not "
                                f"built yet (each tp rank would route other tokens); leave it out ({what})")
        for stage in stages.values():
            for name in resolve(stage, key):
                hit = next((e for e in names if name == e or name.startswith(e + ".") or e.startswith(name + ".")),
                           None)
                if hit is not None:
                    raise PipelineError(f"tp_plan key {key!r} names {name!r}, which is or holds the experts module "
                                        f"{hit!r}; with \"ep\" the experts are sharded over \"ep\" and replicated "
                                        f"over \"tp\": leave them out of tp_plan ({what})")


def _head_norms_only(plan: Mapping[str, object], stages: Mapping[int, nn.Module], key: str) -> bool:
    """Whether ``key`` names only per-head norms beside the plan's column-split projections (Qwen3's q/k norms:
    their SequenceParallel splits the heads axis, not the tokens, so every tp rank still routes the same ones)."""
    found = False
    for stage in stages.values():
        resolved = {name: style for k, style in plan.items() for name in resolve(stage, k)}
        heads = {name for name, _ in per_head_modules(stage, [n for n, s in resolved.items() if splits_heads(s)])}
        names = resolve(stage, key)
        if any(name not in heads for name in names):
            return False
        found = found or bool(names)
    return found


def moe_layers(names: Sequence[str]) -> list[str]:
    """The modules torch.export keeps whole so that each experts module runs as a call of itself: the layer
    around it (``model.layers.1.mlp`` for ``model.layers.1.mlp.experts``; export shares index arithmetic
    between the experts and the routing around them, so the experts alone cannot be cut out)."""
    layers: list[str] = []
    for name in names:
        layer = name.rpartition(".")[0] or name
        if layer not in layers:
            layers.append(layer)
    return layers
