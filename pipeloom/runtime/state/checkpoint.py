"""``torch.distributed.checkpoint`` save and load of a pipelined model and its optimizer, keyed by the
model's parameter names, so a checkpoint of any pipeline (or of one device) loads into any other."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.state.state_dict import ModelNames, load_state_dict, named_parameters, state_dict

__all__ = ["load_checkpoint", "save_checkpoint"]


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
def _one_process(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is what is meant here."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(path: str | os.PathLike, names: ModelNames, pieces: Mapping[int, nn.Module], *,
                    optimizer: torch.optim.Optimizer | None = None, group: dist.ProcessGroup | None = None,
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
                    optimizer: torch.optim.Optimizer | None = None, group: dist.ProcessGroup | None = None,
                    counters: dict[str, int] | None = None) -> dict[str, int]:
    """Load what :func:`save_checkpoint` saved into this rank's tensors and ``optimizer``; returns the
    saved ``counters`` (those named in ``counters``, whose values are the defaults when absent)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    content: dict = {"model": state_dict(names, pieces)}
    tree = None
    if optimizer is not None:
        tree = _tree(named_parameters(names, pieces))
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
    if optimizer is not None and tree is not None:  # tree: built with the optimizer above
        set_optimizer_state_dict(tree, optimizer, content["optim"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    return found
