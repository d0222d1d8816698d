"""``torch.distributed.checkpoint`` save and load of a pipelined model, its optimizer and the training loop's
other stateful objects (an LR scheduler, ...), keyed by the model's parameter names, so a checkpoint of any
pipeline (or of one device) loads into any other."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.errors import shown_list
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.state.state_dict import ModelNames, load_state_dict, named_parameters, state_dict

T = TypeVar("T")

__all__ = ["Stateful", "check_saved_model", "checkpoint_keys", "load_checkpoint", "one_process", "save_checkpoint"]


@runtime_checkable
class Stateful(Protocol):
    """What ``extra=`` takes: an object with torch's ``state_dict()`` / ``load_state_dict(state)`` pair,
    such as an LR scheduler (``torch.optim.lr_scheduler``), a gradient scaler or a data loader position."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


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

    params = [p for group in optimizer.param_groups for p in group["params"]]
    fresh = not optimizer.state
    with _no_grads(params):
        flat = get_optimizer_state_dict(tree, optimizer, options=options)
    if saving and fresh and optimizer.state:
        optimizer.state.clear()  # as it was
        raise PipelineError("save_checkpoint: the optimizer has no state yet (it has not stepped); save "
                            "after optimizer.step(), or without optimizer= and build a fresh one to resume")
    return flat


def _check_own(tree: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """PipelineError where ``optimizer`` holds state for a parameter this rank's stages (``tree``) do not (it was
    stepped elsewhere: another rank's optimizer), or none of this rank's trainable parameters."""
    mine = {id(p) for p in tree.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    stepped = sum(id(p) not in mine and bool(optimizer.state.get(p)) for p in held)
    if stepped or (any(p.requires_grad for p in tree.parameters()) and not any(id(p) in mine for p in held)):
        said = f"state for {stepped} parameter(s)" if stepped else "none of the parameters"
        raise PipelineError(f"the optimizer holds {said} that this rank's stages hold; build it from "
                            "engine.parameters()")


@contextlib.contextmanager
def own_parameters(tree: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """``optimizer``'s groups holding only this rank's parameters (``tree``'s) meanwhile, their lists restored
    after: one built before the first step on every parameter of the model (as docs/runtime.md allows; the others
    never get a gradient, so it never steps them) had been refused (:func:`_check_own` refuses the rest)."""
    if optimizer is None or tree is None:
        yield
        return
    mine = {id(p) for p in tree.parameters()}
    kept = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in mine]
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, kept):
            group["params"] = params


@contextlib.contextmanager
def one_process(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is what is meant here."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _checked_extra(extra: Mapping[str, object] | None) -> dict[str, Stateful]:
    """``extra`` with its names and objects checked: names are non-empty strings without dots (they become
    checkpoint keys ``extra.{name}``), objects have ``state_dict`` and ``load_state_dict``."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise PipelineError(f"extra must map names to stateful objects, e.g. extra={{'scheduler': scheduler}}; "
                            f"got {type(extra).__name__}")
    checked: dict[str, Stateful] = {}
    for name, value in extra.items():
        if not isinstance(name, str) or not name or "." in name:
            raise PipelineError(f"extra: names are non-empty strings without dots (checkpoint keys), got {name!r}")
        if not isinstance(value, Stateful):
            raise PipelineError(f"extra[{name!r}]: a {type(value).__name__} has no state_dict()/load_state_dict(); "
                                "pass objects such as an LR scheduler, or wrap yours in a class with both methods")
        checked[name] = value
    return checked


def _extra_states(extra: dict[str, Stateful], group: dist.ProcessGroup | None) -> dict[str, bytes]:
    """Each object's ``state_dict()`` serialised with ``torch.save`` (one opaque value per name, so a state
    of any shape loads into a fresh object). DCP keeps one copy of a value that several ranks save under one
    key, so the states must agree across ranks: compared by hash here, before anything is written."""
    states = {}
    for name, value in extra.items():
        buffer = io.BytesIO()
        torch.save(value.state_dict(), buffer)
        states[name] = buffer.getvalue()
    if group is not None and states and dist.get_world_size(group) > 1:
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in states.items()}
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, digests, group=group)
        differ = sorted(name for name in digests if len({str(d.get(name)) for d in gathered}) > 1)
        if differ:
            raise PipelineError(f"save_checkpoint: the state of extra {differ} differs between ranks, and a "
                                "checkpoint keeps one copy; step it the same way on every rank, or save per-rank "
                                "state yourself (torch.save to a file per rank)")
    return states


@contextlib.contextmanager
def _dcp_errors(what: str, path: str | os.PathLike) -> Iterator[None]:
    """torch's ``CheckpointException`` (a ``BaseException``: ``except Exception`` misses it, and its text is
    every rank's traceback) as a :class:`PipelineError` naming the first failure in one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        failure = next(iter(error.failures.values()), (error, None))[0]
        cause = str(failure).strip().splitlines()
        raise PipelineError(f"{what} {str(path)!r}: {type(failure).__name__}: "
                            f"{cause[0] if cause else 'failed'}") from None


def checkpoint_keys(path: str | os.PathLike, what: str) -> dict:
    """The checkpoint folder's saved keys and their storage metadata (a tensor's has its ``size``), read from
    its metadata file; PipelineError naming the fix for a path that is not such a folder."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(path):
        state = "is a file" if os.path.exists(path) else "does not exist"
        raise PipelineError(f"{what}: {str(path)!r} {state}, not a checkpoint folder (save_checkpoint writes one); "
                            "for a file of torch.save(model.state_dict()), use model.load_state_dict or "
                            "Weights(state_dict=PATH)")
    try:
        return dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception as error:  # noqa: BLE001 - any unreadable metadata is the same fault
        raise PipelineError(f"{what}: {str(path)!r} is a folder but not a torch.distributed.checkpoint "
                            f"({type(error).__name__}: {error})") from None


def check_saved_model(saved: Mapping[str, Any], mine: Mapping[str, Any], names: ModelNames, *,
                      prefix: str, what: str, path: str | os.PathLike) -> None:
    """PipelineError, before anything is loaded, for a checkpoint of another model: a key of this rank's
    tensors (``mine``) it lacks, a model key the model does not have, or a tensor saved in another shape."""
    model = {key[len(prefix):]: meta for key, meta in saved.items() if key.startswith(prefix)}
    missing = [key for key in mine if key not in model]
    known = set(names.state_keys)
    unexpected = [key for key in model if key not in known]
    shapes = [f"{key} {tuple(model[key].size)} saved, {tuple(tensor.shape)} here" for key, tensor in mine.items()
              if key in model and hasattr(model[key], "size") and tuple(model[key].size) != tuple(tensor.shape)]
    faults = [f"{label} {shown_list(keys, 3)}" for label, keys in (
        ("lacks", missing), ("holds keys the model does not have:", unexpected), ("has other shapes:", shapes)) if keys]
    if faults:
        raise PipelineError(f"{what}: {str(path)!r} is not a checkpoint of this model: it {'; it '.join(faults)}; "
                            "build the model the checkpoint was saved from (its config, layers and sizes)")


def _check_saved_optimizer(saved: Mapping[str, object], mine: Mapping[str, object],
                           path: str | os.PathLike) -> None:
    """PipelineError for an optimizer whose state the checkpoint does not hold (another optimizer class, or
    saved without optimizer=), naming the state each has."""
    held = {key[len("optim."):] for key in saved if key.startswith("optim.")}
    missing = [key for key in mine if key not in held]
    if not missing:
        return

    def kinds(keys: Iterable[str]) -> list[str]:
        return sorted({key.rsplit(".", 1)[-1] for key in keys})

    if not held:
        raise PipelineError(f"load_checkpoint: {str(path)!r} holds no optimizer state (saved without optimizer=); "
                            "load without optimizer= and start the optimizer afresh")
    raise PipelineError(f"load_checkpoint: {str(path)!r} holds optimizer state {kinds(held)}, and this optimizer "
                        f"needs {kinds(mine)} (it lacks {shown_list(missing, 2)}); load with the optimizer class and "
                        "parameter groups it was saved with")


def _check_groups(path: str | os.PathLike, group: dist.ProcessGroup | None, tree: nn.Module,
                  optimizer: torch.optim.Optimizer, flat: Mapping[str, Any]) -> None:
    """PipelineError, before anything is loaded, where the checkpoint's settings (``lr``, ``weight_decay``, ...)
    differ between parameters that ``optimizer`` holds in one group: loading would give them all one value (weight
    decay on the biases a group of their own had kept without). The settings are read first, on their own."""
    import torch.distributed.checkpoint as dcp

    settings = {"optim": {key: value for key, value in flat.items() if key.startswith("param_groups.")}}
    with one_process(group), _dcp_errors("load_checkpoint", path):  # every rank, as every rank loads after
        dcp.load(settings, checkpoint_id=path, process_group=group, no_dist=group is None)
    name_of = {id(param): name for name, param in tree.named_parameters()}
    keys = sorted({key.rsplit(".", 1)[1] for key in settings["optim"]})

    def same_in_each_group() -> None:
        for index, held in enumerate(optimizer.param_groups):
            names = [name_of[id(param)] for param in held["params"] if id(param) in name_of]
            for key in keys:
                values: dict[str, str] = {}
                for name in names:
                    values.setdefault(repr(settings["optim"].get(f"param_groups.{name}.{key}")), name)
                if len(values) > 1:
                    shown = ", ".join(f"{value} ({name})" for value, name in list(values.items())[:3])
                    raise PipelineError(f"load_checkpoint: {str(path)!r} saved {key} {shown} for parameters this "
                                        f"optimizer holds in one group (param_groups[{index}]); build it with the "
                                        "groups it was saved with, or load without optimizer= to start it afresh")

    _agreed(group, same_in_each_group)


def _agreed(group: dist.ProcessGroup | None, check: Callable[[], T]) -> T:
    """``check()`` on every rank of ``group``; where it fails on any rank, each rank raises (its own error, or a
    PipelineError naming the rank that failed and why): a rank refusing alone would leave the others waiting in the
    load's collectives."""
    fault: Exception | None = None
    value = None
    try:
        value = check()
    except Exception as error:  # noqa: BLE001 - any failure: the other ranks must hear of it, not wait
        fault = error
    if group is not None and dist.get_world_size(group) > 1:
        faults: list = [None] * dist.get_world_size(group)
        said = None if fault is None else str(fault) if isinstance(fault, PipelineError) else \
            f"{type(fault).__name__}: {fault}"
        dist.all_gather_object(faults, said, group=group)
        failed = next(((rank, text) for rank, text in enumerate(faults) if text is not None), None)
        if fault is None and failed is not None:
            raise PipelineError(f"rank {failed[0]} of the checkpoint's group: {failed[1]}")
    if fault is not None:
        raise fault
    return cast(T, value)


def save_checkpoint(path: str | os.PathLike, names: ModelNames, pieces: Mapping[int, nn.Module], *,
                    optimizer: torch.optim.Optimizer | None = None, group: dist.ProcessGroup | None = None,
                    counters: dict[str, int] | None = None, extra: Mapping[str, object] | None = None) -> None:
    """Save this rank's share with ``torch.distributed.checkpoint`` (every rank calls it with the same
    ``path``): ``model`` holds :func:`state_dict`, ``optim`` the optimizer's state by parameter name,
    ``extra.{name}`` the ``state_dict()`` of each of ``extra``'s objects (the same on every rank: an LR
    scheduler, ...). Keys are the model's names, so any pipeline of the same model (or one device) can load it."""
    import torch.distributed.checkpoint as dcp

    states = _extra_states(_checked_extra(extra), group)
    content: dict = {"model": state_dict(names, pieces)}
    if optimizer is not None:
        tree = _tree(named_parameters(names, pieces))
        _agreed(group, lambda: _check_own(tree, optimizer))
        with own_parameters(tree, optimizer):
            content["optim"] = _optimizer_state(tree, optimizer, saving=True)
    if counters:  # the engine's own state (its training-step count and seed make the random numbers)
        content["engine"] = {key: torch.tensor(value, dtype=torch.int64) for key, value in counters.items()}
    if states:
        content["extra"] = states
    if os.path.exists(path) and not os.path.isdir(path):
        raise PipelineError(f"save_checkpoint: {str(path)!r} is a file; a checkpoint is a folder: give a new path")
    with one_process(group), _dcp_errors("save_checkpoint", path):
        dcp.save(content, checkpoint_id=path, process_group=group, no_dist=group is None)


def _warn_left_behind(path: str | os.PathLike, saved: Mapping[str, object], group: dist.ProcessGroup | None, *,
                      optimizer: bool, extra: Iterable[str]) -> None:
    """Warn (once, on the group's first rank) that ``path`` holds state this load leaves behind: an optimizer's
    state without ``optimizer=``, or ``extra`` objects not asked for. Loading the model alone is meant for
    evaluation or a fresh fine-tune; a resumed run that forgot them would quietly restart its optimizer."""
    left = []
    if not optimizer and _saved_keys(saved, "optim"):
        left.append("an optimizer's state (pass optimizer=)")
    unasked = sorted({key.split(".", 1)[0] for key in _saved_keys(saved, "extra")} - set(extra))
    if unasked:
        left.append(f"extra {unasked} (pass extra={{name: object}})")
    if left and (group is None or dist.get_rank(group) == 0):
        warnings.warn(f"load_checkpoint: {str(path)!r} also holds {' and '.join(left)}, not loaded: the model "
                      "alone was; to resume training, load them too", UserWarning, stacklevel=4)


def _saved_keys(saved: Mapping[str, object], prefix: str) -> set[str]:
    """The names saved under ``prefix.``."""
    return {key[len(prefix) + 1:] for key in saved if key.startswith(prefix + ".")}


def load_checkpoint(path: str | os.PathLike, names: ModelNames, pieces: Mapping[int, nn.Module], *,
                    optimizer: torch.optim.Optimizer | None = None, group: dist.ProcessGroup | None = None,
                    counters: dict[str, int] | None = None,
                    extra: Mapping[str, object] | None = None) -> dict[str, int]:
    """Load what :func:`save_checkpoint` saved into this rank's tensors, ``optimizer`` and each of ``extra``'s
    objects (``load_state_dict``; a name the checkpoint lacks is refused before anything is loaded); returns
    the saved ``counters`` (those named in ``counters``, whose values are the defaults when absent)."""

    objects = _checked_extra(extra)
    content: dict = {"model": state_dict(names, pieces)}

    def model_checks() -> dict:
        saved = checkpoint_keys(path, "load_checkpoint")
        check_saved_model(saved, content["model"], names, prefix="model.", what="load_checkpoint", path=path)
        held = _saved_keys(saved, "extra")
        missing = sorted(objects.keys() - held)
        if missing:
            raise PipelineError(f"load_checkpoint: {path} holds no state for extra {missing} (it holds "
                                f"{sorted(held) or 'none'}); save it with save_checkpoint(..., extra=...) "
                                "or leave it out of extra= here")
        return saved

    saved = _agreed(group, model_checks)
    _warn_left_behind(path, saved, group, optimizer=optimizer is not None, extra=objects.keys())
    tree = None
    if optimizer is not None:
        tree = _tree(named_parameters(names, pieces))
        _agreed(group, lambda: _check_own(tree, optimizer))
    with own_parameters(tree, optimizer):
        _load_all(path, group, names, pieces, content, saved, tree, optimizer, counters, objects)
    return dict(counters or {}, **{key: int(value) for key, value in content.get("engine", {}).items()})


def _load_all(path: str | os.PathLike, group: dist.ProcessGroup | None, names: ModelNames,
              pieces: Mapping[int, nn.Module], content: dict, saved: Mapping[str, object], tree: nn.Module | None,
              optimizer: torch.optim.Optimizer | None, counters: dict[str, int] | None,
              objects: Mapping[str, Stateful]) -> None:
    """:func:`load_checkpoint`'s load, its checks passed: the model's tensors, the optimizer's state (of this rank's
    parameters), the engine's counters into ``content["engine"]`` and ``objects``' states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if optimizer is not None and tree is not None:
        content["optim"] = _optimizer_state(tree, optimizer, saving=False)  # the state DCP loads into
        flat = content["optim"]
        _agreed(group, lambda: _check_saved_optimizer(saved, flat, path))
        _check_groups(path, group, tree, optimizer, flat)
    wanted = dict(counters or {})
    saved_counters = _saved_keys(saved, "engine") if counters else set()
    if saved_counters & wanted.keys():  # older checkpoints lack some counters: their defaults stay
        content["engine"] = {key: torch.tensor(0, dtype=torch.int64) for key in wanted if key in saved_counters}
    if objects:
        content["extra"] = {name: b"" for name in objects}  # DCP replaces each with the saved bytes
    with one_process(group), _dcp_errors("load_checkpoint", path):
        dcp.load(content, checkpoint_id=path, process_group=group, no_dist=group is None)
    load_state_dict(names, pieces, content["model"])  # DCP loads in place; this covers copies it made
    if optimizer is not None and tree is not None:  # tree: built with the optimizer above
        set_optimizer_state_dict(tree, optimizer, content["optim"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    for name, value in objects.items():  # the user's own pickled state: loaded as torch.save wrote it
        value.load_state_dict(torch.load(io.BytesIO(content["extra"][name]), weights_only=False))
