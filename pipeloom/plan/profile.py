"""Measure a model's cost table on this machine: cut it at every piece with ``split_model``, then time
each piece's forward, its full backward and its input/weight-gradient split as the engine runs them,
and count its bytes.

The one planner module that imports torch (DESIGN §4).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import fx, nn

from pipeloom.plan.costs import CostTable, Link, Piece
from pipeloom.plan.plan import PlanError
from pipeloom.runtime import MODEL_INPUT, split_model
from pipeloom.runtime.backward import backward_full, backward_input
from pipeloom.runtime.split import StagedModel

__all__ = ["default_pieces", "profile_model"]

_FREE_LINK = Link()


def default_pieces(model: nn.Module) -> list[str]:
    """The model's top-level children, ModuleLists and Sequentials expanded into their elements, in
    the order the traced model first calls them (children it never calls are left out)."""
    names = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            names.extend(f"{name}.{sub}" for sub, _ in child.named_children())
        else:
            names.append(name)
    return _call_order(model, names)


def _call_order(model: nn.Module, names: Sequence[str]) -> list[str]:
    """``names`` the traced model calls, sorted by their first call."""
    first: dict[str, int] = {}
    for position, node in enumerate(fx.symbolic_trace(model).graph.nodes):
        if node.op == "call_module":
            target = str(node.target)
            for name in names:
                if name not in first and (target == name or target.startswith(name + ".")):
                    first[name] = position
    return sorted(first, key=first.__getitem__)


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors of a tensor or a (nested) tuple/list/dict, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _leaves(value: object) -> object:
    """``value`` with every tensor detached; floating ones require grad (the stage's input leaves)."""
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        return leaf.requires_grad_(leaf.is_floating_point())
    if isinstance(value, (tuple, list)):
        return type(value)(_leaves(item) for item in value)
    if isinstance(value, dict):
        return {key: _leaves(item) for key, item in value.items()}
    return value


def _nbytes(tensors: Sequence[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


class _StageRun:
    """One stage of the cut model with its real inputs: runs F, then I and W (or a full B), and times them."""

    def __init__(self, module: nn.Module, inputs: Sequence[object], *, sync: Callable[[], None],
                 loss: Callable[[object], torch.Tensor] | None) -> None:
        self.module, self.inputs, self.sync, self.loss = module, list(inputs), sync, loss
        self.params = [p for p in module.parameters() if p.requires_grad]

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], float]:
        """``(input leaves, outputs to differentiate, their gradients, seconds)``."""
        args = [_leaves(value) for value in self.inputs]
        self.sync()
        start = time.perf_counter()
        out = self.module(*args)
        if self.loss is not None:
            out = self.loss(out)
        self.sync()
        seconds = time.perf_counter() - start
        outs = [t for t in _tensors(out) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        return [t for t in _tensors(args) if t.requires_grad], outs, grads, seconds

    def saved_bytes(self) -> float:
        """Bytes of the tensors the forward saves for backward (parameters and buffers excluded)."""
        own = {t.untyped_storage().data_ptr() for t in [*self.module.parameters(), *self.module.buffers()]}
        seen: set[int] = set()
        total = 0.0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in own and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            self.forward()
        return total

    def times(self, *, warmup: int, repeats: int) -> tuple[float, float, float, float]:
        """Median ``(F, I, W, B)`` seconds over ``repeats`` runs after ``warmup`` (each run does F with the
        split backward, then F with the full one; F is the median over both)."""
        runs = [self._one_run() for _ in range(warmup + repeats)][warmup:]
        forward = statistics.median(f for run in runs for f in (run[0], run[3]))
        return (forward, *(statistics.median(run[k] for run in runs) for k in (1, 2, 4)))  # type: ignore[return-value]

    def _one_run(self) -> tuple[float, float, float, float, float]:
        """F, I and W, then F and B, as the engine runs them (``pipeloom.runtime.backward``); gradients
        cleared after each backward. ``(F, I, W, F, B)`` seconds."""
        leaves, outs, grads, forward = self.forward()
        inputs, (_, pending) = self._timed(backward_input, outs, grads, leaves, self.params)
        weights, _ = self._timed(pending.weight)
        self._clear()
        leaves, outs, grads, forward_again = self.forward()
        full, _ = self._timed(backward_full, outs, grads, leaves)
        self._clear()
        return forward, inputs, weights, forward_again, full

    def _timed(self, work: Callable[..., object], *args: object) -> tuple[float, object]:
        """``(seconds, work(*args))``, synchronised on both ends."""
        self.sync()
        start = time.perf_counter()
        result = work(*args)
        self.sync()
        return time.perf_counter() - start, result

    def _clear(self) -> None:
        for param in self.params:
            param.grad = None


def _stage_inputs(staged: StagedModel, inputs: tuple) -> list[list[object]]:
    """Per stage: the values it reads, from one no-grad run of all stages."""
    outputs: list[tuple] = []
    per_stage = []
    with torch.no_grad():
        for spec, module in zip(staged.graph.stages, staged.stages):
            values = [inputs[ref.index] if ref.stage == MODEL_INPUT else outputs[ref.stage][ref.index]
                      for ref in spec.inputs]
            per_stage.append(values)
            result = module(*values)
            outputs.append((result,) if spec.num_outputs == 1 else tuple(result))
    return per_stage


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} threads)"


def profile_model(
    model: nn.Module,
    example_inputs: torch.Tensor | tuple,
    *,
    pieces: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    warmup: int = 2,
    repeats: int = 5,
    loss_fn: Callable[[object, object], torch.Tensor] | None = None,
    target: object = None,
    optimizer_factor: float = 2.0,
    link: Link = _FREE_LINK,
    action_overhead: float = 0.0,
    step_overhead: float = 0.0,
) -> CostTable:
    """The cost table of ``model`` measured on ``device`` for one micro-batch ``example_inputs``.

    ``pieces`` (default :func:`default_pieces`) are module names in call order; the model is cut at
    every one with ``pipeloom.runtime.split_model``, so piece k is everything from the first call of
    piece k to the first call of piece k+1. Per piece: F is the forward; I and W are
    ``pipeloom.runtime.backward.backward_input`` and then the pending ``weight()``, and B the full
    backward ``backward_full`` (one ``autograd.backward``, usually cheaper than I + W), timed as the
    engine runs them (not rescaled); each a median of ``repeats`` runs after ``warmup``, with CUDA
    synchronisation around each. Floating-point inputs of a piece are taken to carry a gradient;
    integer ones (token ids) do not, so such a piece's I is about 0 and W holds its whole backward
    (the planner moves the I of any stage reading only model inputs to W). Activation bytes are the
    storages the forward saves for backward (``saved_tensors_hooks``; parameters excluded); W-kept
    bytes are not measured (0). The last piece includes ``loss_fn(output, target)`` when both are
    given, else its backward starts from gradients of ones. ``model`` is moved to ``device`` (default:
    where its parameters are) and left in training mode; parameter gradients are cleared after.
    ``link``, ``action_overhead`` (seconds the runtime adds per action) and ``step_overhead`` (seconds
    it adds once per step) are copied into the table.
    """
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    first = next(iter(model.parameters()), None)
    device = _device(device) if device is not None else (first.device if first is not None else
                                                          torch.device("cpu"))
    model.to(device).train()
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    target = target.to(device) if isinstance(target, torch.Tensor) else target
    names = list(pieces) if pieces is not None else default_pieces(model)
    unknown = [name for name in names if not _has_module(model, name)]
    if unknown:
        raise PlanError(f"piece(s) {unknown} name no module of {type(model).__name__}; pieces are module names "
                        f"in call order, e.g. {default_pieces(model)[:4]}")
    staged = split_model(model, names[1:], example_inputs=inputs)  # torch.export where torch.fx fails
    sync = _sync_for(device)
    stage_inputs = _stage_inputs(staged, inputs)
    last = len(names) - 1
    profiled = []
    for k, (name, module, spec) in enumerate(zip(names, staged.stages, staged.graph.stages)):
        loss = (lambda out: loss_fn(out, target)) if k == last and loss_fn is not None and target is not None \
            else None
        run = _StageRun(module, stage_inputs[k], sync=sync, loss=loss)
        forward, i, w, b = run.times(warmup=warmup, repeats=repeats)
        with torch.no_grad():
            out = module(*stage_inputs[k])
        params = {id(p): p for p in module.parameters()}
        profiled.append(Piece(
            name=name, f=forward, i=i, w=w, b=b, activation_bytes=run.saved_bytes(),
            param_bytes=_nbytes(list(params.values())), output_bytes=_nbytes(_tensors(out)),
            inputs=tuple(names[j] for j in sorted({ref.stage for ref in spec.inputs if ref.stage != MODEL_INPUT})),
        ))
    size = next((t.size(0) for t in _tensors(inputs) if t.dim() > 0), 1)
    return CostTable(pieces=tuple(profiled), microbatch_size=int(size), device=_device_name(device), link=link,
                     optimizer_factor=optimizer_factor, source="profile", action_overhead=action_overhead,
                     step_overhead=step_overhead)


def _device(name: str | torch.device) -> torch.device:
    """``torch.device(name)``, with errors that say what to pass instead."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise PlanError(f"unknown device {name!r} ({error}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PlanError(f"device {name!r} asked for, but this torch sees no CUDA device; use --device cpu")
    return device


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
