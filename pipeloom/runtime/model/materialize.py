"""Put this rank's model pieces on its device: moved there, or, for a model built on the meta device,
allocated there (``to_empty``) and filled from a state dict, a file, a ``torch.distributed.checkpoint``
folder or an ``init_weights`` function. Another rank's tensors are never allocated.

A tensor is replaced by its allocated copy everywhere it appears — in every local piece and in the
original model — so tied tensors stay tied and ``model`` itself holds this rank's tensors afterwards
(the rest stay on the meta device).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import fx, nn

from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.model.passes import retarget_devices
from pipeloom.runtime.state.state_dict import ModelNames, load_state_dict

__all__ = ["is_meta", "place_pieces"]

StateSource = Mapping[str, torch.Tensor] | str | os.PathLike


def is_meta(modules: Sequence[nn.Module]) -> bool:
    """Whether any parameter or buffer of ``modules`` is on the meta device."""
    return any(t.is_meta for module in modules for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from (b for b in module.buffers() if b is not None)


def _slots(module: nn.Module) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """(the dict holding it, its key, the tensor) for every parameter and buffer of every submodule."""
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for key, value in table.items():
                if value is not None:
                    yield table, key, value


def place_pieces(pieces: Mapping[int, nn.Module], device: torch.device, *, model: nn.Module | None,
                 names: ModelNames, state_dict: StateSource | None = None,
                 init_weights: Callable[[nn.Module], object] | None = None) -> dict[int, torch.Tensor]:
    """Move (or, from the meta device, allocate and fill) this rank's ``pieces`` on ``device``.

    Returns ``{id(old tensor): new tensor}`` for every tensor that was replaced by a new object (callers
    holding the old objects, such as the shared-parameter table, map them through it).
    """
    meta = is_meta(list(pieces.values()))
    if not meta:
        if state_dict is not None or init_weights is not None:
            raise PipelineError("state_dict= and init_weights= fill a model built on the meta device; this model "
                                "has its values already (load them with engine.load_state_dict instead)")
        return _move(pieces, device)
    if state_dict is None and init_weights is None:
        raise PipelineError("the model is on the meta device (no values): pass state_dict= (a state dict, a file, "
                            "or a torch.distributed.checkpoint folder) or init_weights= (called on every module "
                            "this rank holds) to fill this rank's pieces")
    replaced = _allocate(pieces, device, model)
    if init_weights is not None:
        _initialize(pieces, model, replaced, init_weights)
    filled: set[int] = set()
    if state_dict is not None:
        filled = _load(pieces, names, state_dict, device)
    if init_weights is None:
        unfilled = [name for name, tensor in _local_buffers(pieces) if id(tensor) in _new_ids(replaced)
                    and id(tensor) not in filled]
        if unfilled:
            raise PipelineError(
                f"buffer(s) {unfilled[:4]} are on the meta device and not in the state dict (non-persistent "
                "buffers such as rotary frequencies or position ids); pass init_weights= as well (for a "
                "transformers model: init_weights=model._init_weights), or build the model with its buffers off "
                "the meta device")
    return replaced


def _move(pieces: Mapping[int, nn.Module], device: torch.device) -> dict[int, torch.Tensor]:
    """``module.to(device)`` for every piece (parameters keep their identity; nothing to map)."""
    for module in pieces.values():
        module.to(device)
        if isinstance(module, fx.GraphModule):
            retarget_devices(module, device)
    return {}


def _allocate(pieces: Mapping[int, nn.Module], device: torch.device,
              model: nn.Module | None) -> dict[int, torch.Tensor]:
    """Replace every tensor of ``pieces`` by an uninitialised one on ``device`` (meta ones) or a copy there
    (the others), in the pieces and in ``model``; tied tensors get one replacement."""
    replaced: dict[int, torch.Tensor] = {}
    for module in pieces.values():
        for _, _, tensor in _slots(module):
            if id(tensor) in replaced:
                continue
            with torch.no_grad():
                new = (torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.to(device))
            if isinstance(tensor, nn.Parameter):
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            replaced[id(tensor)] = new
    roots = list(pieces.values()) + ([model] if model is not None else [])
    for root in roots:
        for table, key, tensor in _slots(root):
            if id(tensor) in replaced:
                table[key] = replaced[id(tensor)]
    for module in pieces.values():
        if isinstance(module, fx.GraphModule):
            retarget_devices(module, device)
    return replaced


def _new_ids(replaced: dict[int, torch.Tensor]) -> set[int]:
    return {id(t) for t in replaced.values()}


def _local_buffers(pieces: Mapping[int, nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    for k, module in sorted(pieces.items()):
        for name, buffer in module.named_buffers():
            yield f"piece {k}: {name}", buffer


def _initialize(pieces: Mapping[int, nn.Module], model: nn.Module | None, replaced: dict[int, torch.Tensor],
                init_weights: Callable[[nn.Module], object]) -> None:
    """Call ``init_weights`` on every module of the model (or of the pieces, without one) that owns a
    tensor this rank allocated, in the model's module order, without autograd."""
    mine = _new_ids(replaced)
    roots = [model] if model is not None else [pieces[k] for k in sorted(pieces)]
    seen: set[int] = set()
    with torch.no_grad():
        for root in roots:
            for module in root.modules():
                own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
                if id(module) in seen or not any(id(t) in mine for t in own):
                    continue
                seen.add(id(module))
                init_weights(module)


def _load(pieces: Mapping[int, nn.Module], names: ModelNames, source: StateSource,
          device: torch.device) -> set[int]:
    """Fill this rank's tensors from ``source``; returns the ids of the tensors filled."""
    if isinstance(source, Mapping):
        values = source
    else:
        path = Path(source)
        if path.is_dir():
            values = _read_checkpoint(path, names, pieces)
        elif path.is_file():
            try:
                values = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as error:  # noqa: BLE001 (any unreadable file gets one message)
                raise PipelineError(f"state_dict={str(path)!r} is not a torch.save'd state dict: "
                                    f"{type(error).__name__}: {error}") from error
            if not isinstance(values, Mapping):
                raise PipelineError(f"state_dict={str(path)!r} holds a {type(values).__name__}, not a state dict "
                                    "(save model.state_dict())")
        else:
            raise PipelineError(f"state_dict={str(path)!r} does not exist; give a state dict, a file saved with "
                                "torch.save(model.state_dict(), path) or a torch.distributed.checkpoint folder")
    load_state_dict(names, pieces, values, strict=True)
    filled: set[int] = set()
    for k, module in pieces.items():
        table = names.pieces[k].tensors  # the piece's keys of the model's state_dict tensors
        for local, tensor in module.state_dict(keep_vars=True).items():
            if local in table and any(key in values for key in names.tensors[table[local]].keys):
                filled.add(id(tensor))
    return filled


def _read_checkpoint(path: Path, names: ModelNames, pieces: Mapping[int, nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's tensors from a ``torch.distributed.checkpoint`` folder: one saved from a model's state dict
    (``dcp.save(model.state_dict())``) or by ``engine.save_checkpoint`` (keys under ``model.``)."""
    import torch.distributed.checkpoint as dcp

    from pipeloom.runtime.state.checkpoint import check_saved_model, checkpoint_keys, one_process
    from pipeloom.runtime.state.state_dict import state_dict as local_state

    saved = checkpoint_keys(path, "Weights(state_dict=)")
    mine = local_state(names, pieces)
    prefixed = any(key.startswith("model.") for key in saved) and not any(key in saved for key in mine)
    prefix = "model." if prefixed else ""
    content: dict = {"model": dict(mine)} if prefixed else dict(mine)
    table = content["model"] if prefixed else content
    absent = [key for key in table if prefix + key not in saved]
    for key in absent:  # the strict load after this names them
        del table[key]
    saved_model = saved if prefixed else {key: meta for key, meta in saved.items()
                                          if not key.startswith(("optim.", "engine.", "extra."))}
    check_saved_model(saved_model, table, names, prefix=prefix, what="Weights(state_dict=)", path=path)
    with one_process(None):  # one process reading a folder: what DCP's warning assumes
        dcp.load(content, checkpoint_id=str(path), no_dist=True)
    return table
