"""Measure a model's cost table on this machine: cut it at every piece as the runtime does (its tracer,
``torch.fx`` or ``torch.export``, and ``split_model``; or pieces given as modules), then time each piece's
forward, its full backward and its input/weight-gradient split as the engine runs them, and count its
bytes, each parameter once. Torch runs here (the profilers live above the runtime, docs/design.md §4); the
torch-free planner reads the table it writes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import nn

from pipeloom.errors import PipeloomError
from pipeloom.plan.costs.parts import Link, Piece, RuntimeCorrections, SharedParam
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import PlanError
from pipeloom.profile.errors import PieceError
from pipeloom.profile.pieces import Model, cut_into_pieces
from pipeloom.runtime import (
    MODEL_INPUT,
    StagedModel,
)
from pipeloom.runtime.step.backward import backward_full, backward_input
from pipeloom.runtime.step.shared import shared_parameters

__all__ = ["profile_model", "updates_running_stats"]

_FREE_LINK = Link()
_R = TypeVar("_R")

logger = logging.getLogger(__name__)



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
        inputs, weights, full = (statistics.median(run[k] for run in runs) for k in (1, 2, 4))
        return forward, inputs, weights, full

    def _one_run(self) -> tuple[float, float, float, float, float]:
        """F, I and W, then F and B, as the engine runs them (``pipeloom.runtime.step.backward``); gradients
        cleared after each backward. ``(F, I, W, F, B)`` seconds."""
        leaves, outs, grads, forward = self.forward()
        inputs, (_, pending) = self._timed(backward_input, outs, grads, leaves, self.params)
        weights, _ = self._timed(pending.weight)
        self._clear()
        leaves, outs, grads, forward_again = self.forward()
        full, _ = self._timed(backward_full, outs, grads, leaves)
        self._clear()
        return forward, inputs, weights, forward_again, full

    def _timed(self, work: Callable[..., _R], *args: object) -> tuple[float, _R]:
        """``(seconds, work(*args))``, synchronised on both ends."""
        self.sync()
        start = time.perf_counter()
        result = work(*args)
        self.sync()
        return time.perf_counter() - start, result

    def _clear(self) -> None:
        for param in self.params:
            param.grad = None


def _stage_values(staged: StagedModel, inputs: tuple, names: Sequence[str]) -> tuple[list[list[object]], list[tuple]]:
    """Per stage: the values it reads and the values it returns, from one no-grad run of all stages
    (:meth:`StagedModel.run`, which checks the values crossing stages as the runtime does)."""
    per_stage: list[list[object]] = []
    outputs: list[tuple] = []

    def record(k: int, args: list[object], result: tuple[object, ...]) -> None:
        per_stage.append(args)
        outputs.append(result)

    with torch.no_grad():
        staged.run(*inputs, around=lambda k: _piece_errors(names, k), record=record)
    return per_stage, outputs


def _model_output(staged: StagedModel, last: object, outputs: list[tuple], inputs: tuple) -> object:
    """The model's output structure around the last stage's values ``last`` and the other stages'
    ``outputs``: what the engine hands the loss."""
    index = len(staged.stages) - 1
    if staged.graph.stages[index].num_outputs == 1:
        values: tuple[object, ...] = (last,)
    else:
        assert isinstance(last, Iterable), "a stage of several outputs returns them in a sequence"
        values = tuple(last)
    return staged.model_output([*outputs[:index], values], inputs)


def _loss(loss_fn: Callable[[object, object], torch.Tensor] | None, target: object, staged: StagedModel,
          outputs: list[tuple], inputs: tuple) -> Callable[[object], torch.Tensor] | None:
    """The last piece's loss: ``loss_fn`` of the model's output around its values (None without a loss
    function or a target)."""
    if loss_fn is None or target is None:
        return None
    return lambda last: loss_fn(_model_output(staged, last, outputs, inputs), target)


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} threads)"


def profile_model(
    model: Model,
    example_inputs: torch.Tensor | tuple,
    *,
    pieces: Sequence[str] | None = None,
    tracer: str = "auto",
    leaf_modules: Sequence[str] = (),
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

    ``pieces`` (default :func:`default_pieces`) are module names in call order; the model is traced
    as the runtime traces it (``tracer``: ``"auto"`` tries torch.fx, then torch.export on the example
    inputs; ``leaf_modules`` kept whole) and cut at every piece with ``pipeloom.runtime.split_model``,
    so piece k is everything from the first call of piece k to the first call of piece k+1. ``model``
    may instead be its pieces as modules (a list or ``nn.ModuleList``: piece k takes piece k-1's output,
    piece 0 the inputs, as ``pipeline(stages=[...])`` runs them; or a ``StagedModel``), named ``0``, ``1``...
    unless ``pieces`` names them. Per piece: F is the forward; I and W are
    ``pipeloom.runtime.step.backward.backward_input`` and then the pending ``weight()``, and B the full
    backward ``backward_full`` (one ``autograd.backward``, usually cheaper than I + W), timed as the
    engine runs them (not rescaled); each a median of ``repeats`` runs after ``warmup``, with CUDA
    synchronisation around each. Floating-point inputs of a piece are taken to carry a gradient;
    integer ones (token ids) do not, so such a piece's I is about 0 and W holds its whole backward
    (the planner moves the I of any stage reading only model inputs to W). Activation bytes are the
    storages the forward saves for backward (``saved_tensors_hooks``; parameters excluded); W-kept
    bytes are not measured (0). Parameter bytes count every parameter once, in the first piece using
    it; a parameter several pieces use (a tied embedding and LM head) is listed in the table's
    ``shared`` with its users. The last piece includes ``loss_fn(output, target)`` when both are
    given (``output`` the model's output structure, as the engine passes it), else its backward starts
    from gradients of ones. ``model`` is moved to ``device`` (default: where its parameters are) and
    left in training mode; parameter gradients are cleared after. A piece that fails when run on its
    own raises :class:`PieceError` naming it and a fix. ``link``, ``action_overhead`` (seconds the
    runtime adds per action) and ``step_overhead`` (seconds it adds once per step) are copied into the
    table (its ``runtime`` corrections).
    """
    device, inputs, target = _on_device(model, example_inputs, target, device)
    staged, names = cut_into_pieces(model, inputs, pieces, tracer=tracer, leaf_modules=leaf_modules)
    sync = _sync_for(device)
    stage_inputs, stage_outputs = _stage_values(staged, inputs, names)
    last = len(names) - 1
    profiled = []
    counted: set[int] = set()  # parameters already in an earlier piece's bytes
    for k, (name, module, spec) in enumerate(zip(names, staged.stages, staged.graph.stages)):
        loss = _loss(loss_fn, target, staged, stage_outputs, inputs) if k == last else None
        with _piece_errors(names, k):
            run = _StageRun(module, stage_inputs[k], sync=sync, loss=loss)
            forward, i, w, b = run.times(warmup=warmup, repeats=repeats)
            saved = run.saved_bytes()
        own = [p for p in module.parameters() if id(p) not in counted]
        counted.update(id(p) for p in own)
        logger.debug("piece %s: F %.3g s, I %.3g s, W %.3g s, B %.3g s, %d activation bytes", name, forward, i, w, b,
                     saved)
        profiled.append(Piece(
            name=name, f=forward, i=i, w=w, measured_full_backward=b, activation_bytes=saved,
            param_bytes=_nbytes(own),
            output_bytes=_nbytes(_tensors(stage_outputs[k])),
            inputs=tuple(names[j] for j in sorted({ref.stage for ref in spec.inputs if ref.stage != MODEL_INPUT})),
            running_stats=updates_running_stats(module),
        ))
    size = next((t.size(0) for t in _tensors(inputs) if t.dim() > 0), 1)
    logger.info("profiled %d pieces on %s, micro-batch size %d", len(profiled), _device_name(device), size)
    return CostTable(pieces=tuple(profiled), microbatch_size=int(size), device=_device_name(device), link=link,
                     optimizer_factor=optimizer_factor, source="profile",
                     shared=_shared(model, staged, names),
                     runtime=RuntimeCorrections(action_overhead=action_overhead, step_overhead=step_overhead))


def updates_running_stats(module: nn.Module) -> bool:
    """Whether a training step of ``module`` updates buffers of its own (a BatchNorm's running statistics, any module
    with ``track_running_stats`` in training mode): two replicas of it would update them apart."""
    return any(getattr(m, "track_running_stats", False) and m.training for m in module.modules())


def _on_device(model: Model, example_inputs: torch.Tensor | tuple, target: object,
               device: str | torch.device | None) -> tuple[torch.device, tuple, object]:
    """The device (given, or where the model's parameters are), with the model moved there in training mode,
    and the inputs and target on it."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    modules = _modules(model)
    first = next((p for module in modules for p in module.parameters()), None)
    if device is not None:
        found = _device(device)
    else:
        found = first.device if first is not None else torch.device("cpu")
    for module in modules:
        module.to(found).train()
    inputs = tuple(t.to(found) if isinstance(t, torch.Tensor) else t for t in inputs)
    return found, inputs, target.to(found) if isinstance(target, torch.Tensor) else target


def _modules(model: Model) -> list[nn.Module]:
    """The modules holding ``model``'s parameters (the model, or its given pieces)."""
    if isinstance(model, StagedModel):
        return list(model.stages)
    if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        return [model]
    if isinstance(model, (list, tuple, nn.ModuleList)) and model and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise PlanError(f"profile an nn.Module, or its pieces as a non-empty list of modules; got {type(model).__name__}")


def _shared(model: Model, staged: StagedModel, names: Sequence[str]) -> tuple[SharedParam, ...]:
    """The parameters several pieces use, with the model's names for them (as the runtime finds them)."""
    found = shared_parameters(staged.stages)
    known = {id(p): n for n, p in model.named_parameters()} if isinstance(model, nn.Module) else {}
    return tuple(SharedParam(name=known.get(id(param), name), bytes=_nbytes([param]),
                             pieces=tuple(names[k] for k in users))
                 for param, users, name in zip(found.params, found.pieces, found.names))


_IN_PLACE = ("leaf Variable that requires grad is being used in an in-place operation",
             "a view of a leaf Variable that requires grad is being used in an in-place operation")


@contextlib.contextmanager
def _piece_errors(names: Sequence[str], k: int) -> Iterator[None]:
    """An error of piece ``k`` (its forward, backward or loss) as one :class:`PieceError` line naming
    it and a fix. What is printed to stderr meanwhile (torch.fx prints its own traceback of a failing
    generated forward) is dropped on failure and passed on on success."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except (PipeloomError, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001 (whatever the piece's code raises is reported as one line)
        name = names[k]
        detail = (str(error).strip().splitlines() or [""])[0]
        joined = [n for n in names if n != name]
        if k > 0 and any(text in str(error) for text in _IN_PLACE):
            raise PieceError(
                f"piece {name!r} changes its input in place ({type(error).__name__}: {detail}), which the runtime "
                f"cannot do to a value made by another stage; move the boundary: leave {name!r} out of the "
                f"pieces so that it runs in {names[k - 1]!r} (pieces {','.join(joined)}), or make that "
                "operation out of place (e.g. inplace=False)") from error
        fix = (f"leave {name!r} out of the pieces so that it runs in {names[k - 1]!r} (pieces {','.join(joined)})"
               if k > 0 else "check that the inputs fit the model (shape, dtype, device)")
        raise PieceError(f"piece {name!r} fails when run on its own ({type(error).__name__}: {detail}); "
                         f"{fix}") from error
    else:
        sys.stderr.write(printed.getvalue())


def _device(name: str | torch.device) -> torch.device:
    """``torch.device(name)``, with errors that say what to pass instead."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise PlanError(f"unknown device {name!r} ({error}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PlanError(f"device {name!r} asked for, but this torch sees no CUDA device; use --device cpu")
    return device
