"""Training-loop helpers across ranks, each with its single-device meaning: parameters under the original
model's names, global gradient-norm clipping, state dicts, and ``torch.distributed.checkpoint`` save/load.

Every rank knows the whole model's names (:class:`ModelNames`, built once from the model's names and
shapes, never its values); each helper takes the pieces its rank holds, ``{piece: module}``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.lower import PipelineError

__all__ = [
    "LoadResult",
    "ModelNames",
    "PieceNames",
    "StateTensor",
    "clip_grad_norm_",
    "full_state_dict",
    "load_checkpoint",
    "load_state_dict",
    "model_names",
    "named_parameters",
    "save_checkpoint",
    "state_dict",
]

Wait = Callable[[object, str], None]  # (work, what it does) -> None; raises when the work fails


def _plain_wait(work: object, what: str) -> None:
    work.wait()


@dataclass(frozen=True, kw_only=True, slots=True)
class StateTensor:
    """One tensor of the model's ``state_dict()``: its keys (several for a tied one), shape and dtype."""

    keys: tuple[str, ...]  # in state_dict order; keys[0] names it
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class PieceNames:
    """How one model piece's own names map to the model's."""

    parameters: dict[str, str]  # the piece module's named_parameters() name -> the model's parameter name
    tensors: dict[str, int]  # the piece module's state_dict() key -> index into ModelNames.tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelNames:
    """The original model's names for every piece's tensors (names, shapes and dtypes, never values)."""

    parameters: tuple[str, ...]  # model.named_parameters() names in its order (a tied parameter once)
    tensors: tuple[StateTensor, ...]  # model.state_dict() tensors, in the order of their first key
    state_keys: tuple[str, ...]  # model.state_dict() keys of tensors, in its order
    pieces: tuple[PieceNames, ...]  # per model piece

    def __post_init__(self) -> None:
        if len(set(self.parameters)) != len(self.parameters):
            raise PipelineError(f"parameter names must be unique, got {list(self.parameters)}")

    def in_state_order(self, found: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{index into tensors: value}`` -> ``{key: value}`` for all their keys, in state_dict order."""
        keys = {key: i for i, tensor in enumerate(self.tensors) for key in tensor.keys}
        return {key: found[keys[key]] for key in self.state_keys if keys[key] in found}


class LoadResult(NamedTuple):
    """What :func:`load_state_dict` did not match, as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class _Stages(nn.Module):
    """Manual mode's naming root: piece k's tensors are ``stages.{k}.{name}``."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)


def model_names(model: nn.Module | None, stages: Sequence[nn.Module]) -> ModelNames:
    """Names of every piece's tensors as ``model`` gives them (``stages.{k}.{name}`` without a model).

    Matched by identity, so call it before any tensor of ``model`` or ``stages`` is replaced (a move to
    another device replaces buffers). A piece parameter that the model does not have is named as in
    manual mode and put after the model's parameters.
    """
    root = model if model is not None else _Stages(stages)
    canonical = {id(p): name for name, p in root.named_parameters()}  # first name of a tied one
    order = list(canonical.values())
    model_state = root.state_dict(keep_vars=True)
    keys_of: dict[int, list[str]] = {}  # id(tensor) -> its state_dict keys
    metas: dict[int, torch.Tensor] = {}
    for key, value in model_state.items():
        if isinstance(value, torch.Tensor):
            keys_of.setdefault(id(value), []).append(key)
            metas.setdefault(id(value), value)
    for k, module in enumerate(stages):
        for local, param in module.named_parameters():
            if id(param) not in canonical:
                canonical[id(param)] = f"stages.{k}.{local}"
                order.append(canonical[id(param)])
                keys_of[id(param)] = [canonical[id(param)]]
                metas[id(param)] = param
    index = {tensor_id: i for i, tensor_id in enumerate(keys_of)}
    pieces = tuple(
        PieceNames(parameters={local: canonical[id(p)] for local, p in module.named_parameters()},
                   tensors={local: index[id(v)] for local, v in module.state_dict(keep_vars=True).items()
                            if isinstance(v, torch.Tensor) and id(v) in index})
        for module in stages)
    tensors = tuple(StateTensor(keys=tuple(keys), shape=tuple(metas[i].shape), dtype=metas[i].dtype)
                    for i, keys in keys_of.items())
    position = {key: i for i, key in enumerate(model_state)}  # parameters the model lacks: last
    state_keys = tuple(sorted((key for keys in keys_of.values() for key in keys),
                              key=lambda key: position.get(key, len(position))))
    return ModelNames(parameters=tuple(order), tensors=tensors, state_keys=state_keys, pieces=pieces)


# ------------------------------------------------------------------------------ names and state dicts


def named_parameters(names: ModelNames, pieces: Mapping[int, nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters with the model's names, each once, in the model's order."""
    found: dict[str, nn.Parameter] = {}
    for piece, module in sorted(pieces.items()):
        table = names.pieces[piece].parameters
        for local, param in module.named_parameters():
            if local not in table:
                raise PipelineError(f"model piece {piece} has a parameter {local!r} that it did not have "
                                    "when the engine was built; build the engine after changing the model")
            found.setdefault(table[local], param)
    position = {name: i for i, name in enumerate(names.parameters)}
    return sorted(found.items(), key=lambda item: position[item[0]])


def _held(names: ModelNames, pieces: Mapping[int, nn.Module]) -> dict[int, torch.Tensor]:
    """Index into ``names.tensors`` -> this rank's tensor, for every model tensor its pieces hold."""
    held: dict[int, torch.Tensor] = {}
    for piece, module in sorted(pieces.items()):
        table = names.pieces[piece].tensors
        for local, value in module.state_dict(keep_vars=True).items():
            if local in table:
                held.setdefault(table[local], value)
    return dict(sorted(held.items()))


def state_dict(names: ModelNames, pieces: Mapping[int, nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers (detached, sharing storage) under every key the model's
    ``state_dict()`` gives them, in its order."""
    return names.in_state_order({i: tensor.detach() for i, tensor in _held(names, pieces).items()})


def load_state_dict(names: ModelNames, pieces: Mapping[int, nn.Module], values: Mapping[str, torch.Tensor], *,
                    strict: bool = True) -> LoadResult:
    """Copy ``values`` into this rank's tensors (a tied tensor from the first of its keys present).

    Keys of tensors other ranks hold are skipped, so a whole single-device state dict loads on every
    rank; ``missing_keys`` are this rank's keys absent from ``values``, ``unexpected_keys`` the keys the
    model does not have. With ``strict`` either raises before anything is copied.
    """
    known = {key for tensor in names.tensors for key in tensor.keys}
    unexpected = [key for key in values if key not in known]
    held = _held(names, pieces)
    missing = [key for i in held for key in names.tensors[i].keys if key not in values]
    if strict and (missing or unexpected):
        raise PipelineError(f"load_state_dict(strict=True): missing keys {missing}, unexpected keys "
                            f"{unexpected}; pass strict=False to load the keys that match")
    sources = {}
    for i, tensor in held.items():
        key = next((k for k in names.tensors[i].keys if k in values), None)
        if key is None:
            continue
        if tuple(values[key].shape) != tuple(tensor.shape):
            raise PipelineError(f"{key!r} has shape {list(values[key].shape)} in the state dict but "
                                f"{list(tensor.shape)} in the model; load a state dict of this model")
        sources[key] = tensor
    with torch.no_grad():
        for key, tensor in sources.items():
            tensor.copy_(values[key])
    return LoadResult(missing, unexpected)


def full_state_dict(names: ModelNames, pieces: Mapping[int, nn.Module], *, dst: int, rank: int,
                    group: object, device: torch.device, wait: Wait = _plain_wait) -> dict[str, torch.Tensor]:
    """A copy of the whole model's state dict, on the CPU, on group rank ``dst`` (``{}`` on the others):
    every tensor comes from the lowest rank holding it. ``group`` None means a world of one rank.

    Keys no rank holds (tensors no piece uses) are left out.
    """
    held = _held(names, pieces)
    if group is None:
        return names.in_state_order({i: _snapshot(tensor) for i, tensor in held.items()})
    world = dist.get_world_size(group)
    if not 0 <= dst < world:
        raise PipelineError(f"rank={dst} is not a rank of this {world}-rank process group; "
                            f"use 0..{world - 1}")
    mask = torch.zeros(len(names.tensors), dtype=torch.uint8, device=device)
    mask[list(held)] = 1
    masks = [torch.empty_like(mask) for _ in range(world)]
    wait(dist.all_gather(masks, mask, group=group, async_op=True), "exchanging which rank holds which tensor")
    table = torch.stack(masks).cpu()  # [world, tensors]
    owners = [int(column.argmax()) if bool(column.any()) else -1 for column in table.T]  # lowest holder
    works, buffers = [], {}
    for i, owner in enumerate(owners):  # both sides post in tensor order: NCCL matches in posting order
        if rank == dst and owner not in (-1, dst):
            meta = names.tensors[i]
            buffers[i] = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            works.append((dist.irecv(buffers[i], group=group, tag=i, group_src=owner), owner))
        elif rank != dst and owner == rank:
            tensor = held[i].detach().to(device).contiguous()
            works.append((dist.isend(tensor, group=group, tag=i, group_dst=dst), tensor))
    doing = f"sending the full state dict to rank {dst}" if rank != dst else "gathering the full state dict"
    for work, _ in works:
        wait(work, doing)
    if rank != dst:
        return {}
    found = {i: _snapshot(tensor) for i, tensor in held.items()}
    return names.in_state_order(found | {i: tensor.cpu() for i, tensor in buffers.items()})


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy, so that training on leaves it as it was."""
    return tensor.detach().to("cpu", copy=True)


# ------------------------------------------------------------------------------ gradient clipping


def _norms(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """Each gradient's norm computed as ``torch.nn.utils.get_total_norm`` computes it (the foreach kernel
    where torch uses it: on a GPU its sums differ from ``vector_norm``'s in the last bits)."""
    from torch.utils._foreach_utils import (
        _device_has_foreach_support,
        _group_tensors_by_device_and_dtype,
        _has_foreach_support,
    )

    norms: list = [None] * len(grads)
    groups = _group_tensors_by_device_and_dtype([grads], with_indices=True)
    for (device, _), ([tensors], indices) in groups.items():
        if (foreach is None and _has_foreach_support(tensors, device)
                or foreach and _device_has_foreach_support(device)):
            found = torch._foreach_norm(tensors, norm_type)
        elif foreach:
            raise PipelineError(f"foreach=True, but the foreach API does not run on {device.type} tensors; "
                                "pass foreach=None")
        else:
            found = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        for i, norm in zip(indices, found):
            norms[i] = norm
    return norms


def _stack_order(dtypes: list[torch.dtype], device: torch.device) -> list[int]:
    """The order in which torch's clip stacks the norms of gradients of these dtypes (grouped by dtype)."""
    if len(set(dtypes)) <= 1:
        return list(range(len(dtypes)))
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    placeholders = [torch.empty(0, dtype=dtype, device=device) for dtype in dtypes]
    groups = _group_tensors_by_device_and_dtype([placeholders], with_indices=True)
    return [i for _, indices in groups.values() for i in indices]


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128)


def _gathered_norms(named: list[tuple[str, nn.Parameter]], order: Sequence[str], norm_type: float,
                    foreach: bool | None, group: object, device: torch.device, wait: Wait) -> torch.Tensor:
    """``[code; norm]`` (2 × parameters, float64) of every model parameter, each from the lowest rank
    holding it. Code 0: held by no rank, 1: no gradient, 2 + k: a gradient of dtype ``_DTYPES[k]``.
    float64 holds every norm exactly."""
    position = {name: i for i, name in enumerate(order)}
    local = [(position[name], p.grad) for name, p in named if p.grad is not None]
    for _, grad in local:
        if grad.dtype not in _DTYPES:
            raise PipelineError(f"clip_grad_norm_ handles gradients of dtypes {list(_DTYPES)}, "
                                f"not {grad.dtype}")
    codes = [0] * len(order)
    for name, _ in named:
        codes[position[name]] = 1
    for i, grad in local:
        codes[i] = 2 + _DTYPES.index(grad.dtype)
    table = torch.zeros(2, len(order), dtype=torch.float64, device=device)
    table[0] = torch.tensor(codes, dtype=torch.float64)
    if local:
        norms = _norms([grad for _, grad in local], norm_type, foreach)
        where = torch.tensor([i for i, _ in local], device=device)
        table[1].index_copy_(0, where, torch.stack([n.to(device, torch.float64) for n in norms]))
    if group is None:
        return table
    tables = [torch.empty_like(table) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(tables, table, group=group, async_op=True), "exchanging gradient norms")
    every = torch.stack(tables)  # [world, 2, parameters]
    owner = (every[:, 0] != 0).to(torch.uint8).argmax(dim=0)  # the first maximum: the lowest holding rank
    return every.gather(0, owner.view(1, 1, -1).expand(1, 2, len(order)))[0]


def clip_grad_norm_(named: Iterable[tuple[str, nn.Parameter]], order: Sequence[str], max_norm: float, *,
                    norm_type: float | str = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, group: object, device: torch.device,
                    wait: Wait = _plain_wait) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the parameters of every rank, bitwise.

    ``named`` are this rank's parameters, ``order`` every parameter name of the model in its order.
    Each rank computes its gradients' norms as torch does; one all-gather gives every rank every
    parameter's norm, counted once (from the lowest rank holding it); the norms are stacked in the order
    torch stacks them and finished as torch finishes. Scales the local gradients; returns the total norm,
    the same on every rank.
    """
    norm_type = float(norm_type)
    named = list(named)
    with torch.no_grad():
        table = _gathered_norms(named, order, norm_type, foreach, group, device, wait)
        codes = [int(c) for c in table[0].tolist()]
        with_grad = [i for i, code in enumerate(codes) if code >= 2]  # model order, as torch lists the grads
        if not with_grad:
            return torch.tensor(0.0)  # torch's norm of no gradients; nothing to scale
        grad_dtypes = [_DTYPES[codes[i] - 2] for i in with_grad]
        stacked_order = [with_grad[k] for k in _stack_order(grad_dtypes, device)]
        # torch.stack promotes the norms to one dtype; each is exact in float64 and in its own dtype, so
        # float64 -> the promoted dtype gives the elements torch stacks
        promoted = reduce(torch.promote_types, (_DTYPES[codes[i] - 2].to_real() for i in stacked_order))
        total = torch.linalg.vector_norm(table[1][stacked_order].to(promoted), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise PipelineError(f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                                "cannot be clipped; pass error_if_nonfinite=False to scale by it anyway")
        torch.nn.utils.clip_grads_with_norm_([p for _, p in named], max_norm, total, foreach)
    return total


# ------------------------------------------------------------------------------ distributed checkpoints


def _tree(named: Iterable[tuple[str, nn.Parameter]]) -> nn.Module:
    """A module whose ``named_parameters()`` are ``named`` (dotted names become submodules)."""
    root = nn.Module()
    for name, param in named:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, param)
    return root


@contextlib.contextmanager
def _no_grads(params: list[nn.Parameter]) -> Iterator[None]:
    """Gradients set aside: torch initialises a fresh optimizer's state (a zero step) only without them."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


def _optimizer_state(tree: nn.Module, optimizer: torch.optim.Optimizer, *, saving: bool) -> dict:
    """The optimizer's state keyed by parameter names, flat (``state.{name}.exp_avg``,
    ``param_groups.{name}.lr``: ranks holding different parameters never share a key), from torch's
    ``get_optimizer_state_dict``. That allocates a fresh optimizer's state with a step at lr=0 when no
    parameter has a gradient (gradients are set aside for it): what loading needs, but saving such a
    state would resume from a step that never ran, so saving a stateful optimizer before its first step
    is refused."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    mine = {id(p) for p in tree.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(id(p) not in mine for p in params)
    if foreign:
        raise PipelineError(f"the optimizer holds {foreign} parameter(s) that this rank's stages do not; "
                            "build it from engine.parameters()")
    fresh = not optimizer.state
    with _no_grads(params):
        flat = get_optimizer_state_dict(tree, optimizer, options=options)
    if saving and fresh and optimizer.state:
        optimizer.state.clear()  # as it was
        raise PipelineError("save_checkpoint: the optimizer has no state yet (it has not stepped); save "
                            "after optimizer.step(), or without optimizer= and build a fresh one to resume")
    return flat


@contextlib.contextmanager
def _one_process(group: object) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is what is meant here."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(path: str | os.PathLike, names: ModelNames, pieces: Mapping[int, nn.Module], *,
                    optimizer: torch.optim.Optimizer | None = None, group: object = None,
                    counters: dict[str, int] | None = None) -> None:
    """Save this rank's share with ``torch.distributed.checkpoint`` (every rank calls it with the same
    ``path``): ``model`` holds :func:`state_dict`, ``optim`` the optimizer's state by parameter name.
    Keys are the model's names, so any pipeline of the same model (or one device) can load it."""
    import torch.distributed.checkpoint as dcp

    content: dict = {"model": state_dict(names, pieces)}
    if optimizer is not None:
        content["optim"] = _optimizer_state(_tree(named_parameters(names, pieces)), optimizer, saving=True)
    if counters:  # the engine's own state (its training-step count seeds the random numbers)
        content["engine"] = {key: torch.tensor(value, dtype=torch.int64) for key, value in counters.items()}
    with _one_process(group):
        dcp.save(content, checkpoint_id=path, process_group=group, no_dist=group is None)


def load_checkpoint(path: str | os.PathLike, names: ModelNames, pieces: Mapping[int, nn.Module], *,
                    optimizer: torch.optim.Optimizer | None = None, group: object = None,
                    counters: dict[str, int] | None = None) -> dict[str, int]:
    """Load what :func:`save_checkpoint` saved into this rank's tensors and ``optimizer``; returns the
    saved ``counters`` (those named in ``counters``, whose values are the defaults when absent)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    content: dict = {"model": state_dict(names, pieces)}
    tree = _tree(named_parameters(names, pieces)) if optimizer is not None else None
    if optimizer is not None:
        content["optim"] = _optimizer_state(tree, optimizer, saving=False)  # the state DCP loads into
    found = dict(counters or {})
    if counters:
        metadata = dcp.FileSystemReader(path).read_metadata()
        if any(key.startswith("engine.") for key in metadata.state_dict_metadata):
            content["engine"] = {key: torch.tensor(0, dtype=torch.int64) for key in counters}
    with _one_process(group):
        dcp.load(content, checkpoint_id=path, process_group=group, no_dist=group is None)
    found.update({key: int(value) for key, value in content.get("engine", {}).items()})
    load_state_dict(names, pieces, content["model"])  # DCP loads in place; this covers copies it made
    if optimizer is not None:
        set_optimizer_state_dict(tree, optimizer, content["optim"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    return found
