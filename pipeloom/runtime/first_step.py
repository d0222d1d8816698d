"""An engine whose model is split at its first step: :func:`~pipeloom.runtime.pipeline` got no
``example_inputs`` and only torch.export can trace the model (``transformers`` models, which torch.fx
cannot), so the first batch given to ``step()`` (or ``eval_step()``) is the example it is traced on.

Everything :func:`~pipeloom.runtime.pipeline` checks without the graph (the arguments, the mesh, the
schedule's name and options, the random seed) it checks at once; what needs the graph (the split points,
the lowering, the placement of tied parameters, tensor parallelism) is checked at the first step, with the
same errors. Before then ``parameters()`` gives every parameter of the model (those another rank will
hold never get a gradient, so torch's optimizers skip them), ``train()``/``eval()``/``close()`` work, and
anything else that needs the split says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from pipeloom.runtime.engine import PipelineEngine
from pipeloom.runtime.errors import NotSplitYetError, PipelineError
from pipeloom.runtime.step.batch import tensors

if TYPE_CHECKING:
    from pipeloom.runtime.options import Parallelism
    from pipeloom.runtime.parallel.dp import Layout
    from pipeloom.runtime.parallel.tp_auto import AutoSharding

__all__ = ["FirstStepEngine", "replaced_by"]

_BEFORE_SPLIT = ("the model is split at the first step() (pipeline() got no example_inputs and only torch.export "
                 "traces it, on that step's batch)")
_SPLIT_NOW = "pipeloom.runtime.Tracing(example_inputs=(a batch like the ones step() takes))"


class FirstStepEngine(PipelineEngine):
    """A :class:`PipelineEngine` built at its first ``step()``/``eval_step()`` from that batch; from then on
    it is the engine ``pipeline(..., tracing=Tracing(example_inputs=batch))`` would have built."""

    def __init__(self, *, model: nn.Module, build: Callable[[object], dict],
                 sharding: AutoSharding | None = None, replaced: str | None = None) -> None:
        """``build(batch)``: the keyword arguments of :class:`PipelineEngine` for the model traced on ``batch``
        (``pipeline()``'s own steps from the split on). ``replaced``: why the split puts new parameter objects in
        the place of the model's (FSDP, a tp plan, expert parallelism), so that :meth:`parameters` refuses before
        it; None where the pieces hold the model's own."""
        self._replaced = replaced
        # PipelineEngine.__init__ runs at the first step, when the pieces exist
        self._pending: Callable[[object], dict] | None = build
        self._model = model
        self.tp_sharding = sharding  # tp_plan="auto": chosen at pipeline(), as for a split engine
        self._mode: bool | None = None  # train()/eval() before the split, applied to the engine after it
        self._closed_early = False
        self.training = True  # as after the split: engine.training had raised NotSplitYetError before it

    def __getattr__(self, name: str) -> object:
        """Only reached for what the split sets (the pieces, the lowering, the names...): before it, say why."""
        if self.__dict__.get("_pending") is not None and not name.startswith("__"):
            raise NotSplitYetError(f"engine.{name} is not known yet: {_BEFORE_SPLIT}; use it after the first step, "
                                   f"or pass tracing={_SPLIT_NOW} to pipeline() to split the model there")
        raise AttributeError(name)

    @property
    def split(self) -> bool:
        """Whether the model has been split (the first step has begun)."""
        return self._pending is None

    def step(self, inputs: object, *, target: object = None) -> torch.Tensor:
        self._split(inputs)
        return super().step(inputs, target=target)

    def eval_step(self, inputs: object, *, target: object = None) -> object:
        self._split(inputs)
        return super().eval_step(inputs, target=target)

    def parameters(self) -> list[nn.Parameter]:
        """After the split, this rank's parameters; before it, every parameter of the model (the objects the
        pieces will hold, so an optimizer built on them now trains this rank's share), refused where the split
        replaces them (``replaced``)."""
        if self._pending is None:
            return super().parameters()
        if self._replaced is not None:
            raise PipelineError(f"engine.parameters() before the first step would give the model's parameters, but "
                                f"{_BEFORE_SPLIT} and {self._replaced} in new parameter objects then, which an "
                                "optimizer built now would never update: build the optimizer after the first step, "
                                f"or pass tracing={_SPLIT_NOW} to pipeline() to split the model there")
        params = list(self._model.parameters())
        if any(p.is_meta for p in params):
            raise PipelineError(f"the model is on the meta device and {_BEFORE_SPLIT}, where this rank's parameters "
                                "are allocated: build the optimizer after the first step, or pass "
                                f"tracing={_SPLIT_NOW} to pipeline()")
        return params

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """After the split, this rank's parameters by name; before it, every parameter of the model under its name
        (what :meth:`parameters` gives, refused where it is)."""
        if self._pending is None:
            return super().named_parameters()
        self.parameters()  # its refusals (parameters replaced at the split, a meta model) hold here too
        return self._model.named_parameters()

    def train(self, mode: bool = True) -> PipelineEngine:
        if self._pending is None:
            return super().train(mode)
        self._mode = bool(mode)
        self._model.train(self._mode)
        self.training = self._mode
        return self

    def save_checkpoint(self, path: str | Path, **kwargs: Any) -> None:
        self._checkpoint_before_split("save_checkpoint")
        super().save_checkpoint(path, **kwargs)

    def load_checkpoint(self, path: str | Path, **kwargs: Any) -> None:
        self._checkpoint_before_split("load_checkpoint")
        super().load_checkpoint(path, **kwargs)

    def _checkpoint_before_split(self, what: str) -> None:
        """PipelineError naming the fix for a checkpoint call before the split (it had named ``engine.names``)."""
        if self._pending is not None:
            raise PipelineError(f"{what}: the model is split at the first step, so no rank holds its pieces yet; "
                                f"pass tracing={_SPLIT_NOW} to pipeline() to split it there (then {what} before "
                                "training: the way to resume)")

    def close(self) -> None:
        if self._pending is None:
            super().close()
        else:
            self._closed_early = True

    def _split(self, inputs: object) -> None:
        """Trace the model on ``inputs`` (on the model's device), cut it and build the engine, once."""
        build = self._pending
        if build is None:
            return
        if self._closed_early:
            raise PipelineError("this engine was closed (close()); build a new one to take more steps")
        example = tensors(inputs, "inputs")
        where = next((t.device for t in self._model.parameters() if not t.is_meta), None)
        if where is not None:  # a batch on the host traced with a model on a GPU: export refuses mixed devices
            example = pytree.tree_map(lambda t: t.to(where) if isinstance(t, torch.Tensor) else t, example)
        parts = build(example)  # raises what pipeline(example_inputs=...) would have; the engine stays unsplit
        PipelineEngine.__init__(self, **parts)
        self._pending = None
        if self._mode is not None:
            super().train(self._mode)


def replaced_by(parallel: Parallelism, layout: Layout, tp_plan: object, expert_names: object) -> str | None:
    """What, at the split, puts new parameter objects in the place of the model's (so that an optimizer built on
    them before would train nothing): FSDP's shards, a tp plan's DTensors, this rank's experts; None where the
    pieces hold the model's own parameters."""
    reasons = []
    if parallel.data_parallel == "fsdp" and layout.dp.size > 1:
        reasons.append("data_parallel='fsdp' shards them")
    if tp_plan is not None and layout.tp.size > 1:
        reasons.append("tensor parallelism (the tp_plan) shards them")
    if expert_names and layout.ep.size > 1:
        reasons.append("expert parallelism keeps this rank's experts")
    return " and ".join(reasons) or None
