"""Training-loop helpers across ranks, each with its single-device meaning: parameters under the original
model's names and state dicts (gradient clipping: ``clip.py``; checkpoints: ``checkpoint.py``).

Every rank knows the whole model's names (:class:`ModelNames`, built once from the model's names and
shapes, never its values); each helper takes the pieces its rank holds, ``{piece: module}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.errors import PipelineError

__all__ = [
    "LoadResult",
    "ModelNames",
    "PieceNames",
    "StateTensor",
    "Wait",
    "full_state_dict",
    "load_state_dict",
    "model_names",
    "named_parameters",
    "state_dict",
]

Wait = Callable[["dist.Work", str], None]  # (work, what it does) -> None; raises when the work fails


def plain_wait(work: dist.Work, what: str) -> None:
    """A :data:`Wait` without a deadline (one process, or tests)."""
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
    rank; ``missing_keys`` are the keys of this rank's tensors none of whose keys ``values`` holds (a tied
    tensor with one key present is not missing: a Hugging Face checkpoint of a tied model leaves out the
    head's key), ``unexpected_keys`` the keys the model does not have. With ``strict`` either raises before
    anything is copied.
    """
    known = {key for tensor in names.tensors for key in tensor.keys}
    unexpected = [key for key in values if key not in known]
    held = _held(names, pieces)
    # a tied tensor loads from any of its keys: Hugging Face's save_pretrained leaves out the tied head's
    missing = [key for i in held if not any(k in values for k in names.tensors[i].keys)
               for key in names.tensors[i].keys]
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
            _copy_into(tensor, values[key])
    return LoadResult(missing, unexpected)


def _copy_into(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.copy_(value)``; into an FSDP-sharded tensor, this rank's shard of ``value``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(tensor, DTensor) and not isinstance(value, DTensor):
        shard = distribute_tensor(value.detach().to(tensor.device), tensor.device_mesh, tensor.placements,
                                  src_data_rank=None)
        tensor.to_local().copy_(shard.to_local())
    else:
        tensor.copy_(value)


def full_state_dict(names: ModelNames, pieces: Mapping[int, nn.Module], *, dst: int, rank: int,
                    group: dist.ProcessGroup | None, device: torch.device,
                    wait: Wait = plain_wait) -> dict[str, torch.Tensor]:
    """A copy of the whole model's state dict, on the CPU, on group rank ``dst`` (``{}`` on the others):
    every tensor comes from the lowest rank holding it. ``group`` None means a world of one rank.

    Keys no rank holds (tensors no piece uses) are left out.
    """
    held = {i: _whole(tensor) for i, tensor in _held(names, pieces).items()}
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
    works: list[tuple[dist.Work | None, int | torch.Tensor]] = []  # with the sent tensor, kept alive
    buffers: dict[int, torch.Tensor] = {}
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
        assert work is not None  # isend and irecv return None only on a group without this rank
        wait(work, doing)
    if rank != dst:
        return {}
    found = {i: _snapshot(tensor) for i, tensor in held.items()}
    return names.in_state_order(found | {i: tensor.cpu() for i, tensor in buffers.items()})


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of an FSDP-sharded tensor (a collective over its shards), else the tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    return cast(DTensor, tensor.detach()).full_tensor()  # a DTensor's detach() is one (torch types it Tensor)


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy, so that training on leaves it as it was."""
    return tensor.detach().to("cpu", copy=True)


# ------------------------------------------------------------------------------ gradient clipping
