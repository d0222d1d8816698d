"""Operations that follow the stage's train/eval mode, whatever the traced code baked in.

Tracing fixes ``self.training`` at trace time: torch.fx turns ``F.dropout(x, training=self.training)``
into a call with ``training=True``; torch.export does the same to ``nn.Dropout``, to the dropout of
``scaled_dot_product_attention`` and to ``nn.BatchNorm``'s batch statistics. Every such call of a stage
graph becomes a call of a small submodule that passes the traced value in train mode (the very same
call, the same random numbers) and the operation's own eval value in eval mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["MODE_ARGUMENTS", "ModeArgument", "TrainOnly", "switch_modes", "train_mode"]


@dataclass(frozen=True, slots=True)
class ModeArgument:
    """The argument of an operation that says whether it trains, and its value in eval mode."""

    index: int  # position of the argument
    name: str  # its keyword name
    eval_value: object  # what eval mode passes
    needs: int | None = None  # position of an argument that must not be None for eval mode (running stats)


_DROP: dict[object, ModeArgument] = {**dict.fromkeys((F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                          F.feature_alpha_dropout), ModeArgument(2, "training", False)),
         **dict.fromkeys((torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default,
                          torch.ops.aten.feature_dropout.default, torch.ops.aten.alpha_dropout.default,
                          torch.ops.aten.feature_alpha_dropout.default, torch.dropout, torch.alpha_dropout,
                          torch.feature_dropout, torch.feature_alpha_dropout, torch.ops.aten.dropout_.default,
                          torch.ops.aten.feature_dropout_.default, torch.ops.aten.alpha_dropout_.default,
                          torch.ops.aten.feature_alpha_dropout_.default), ModeArgument(2, "train", False))}

MODE_ARGUMENTS: dict[object, ModeArgument] = {
    **_DROP,
    F.scaled_dot_product_attention: ModeArgument(4, "dropout_p", 0.0),
    torch.ops.aten.scaled_dot_product_attention.default: ModeArgument(4, "dropout_p", 0.0),
    F.batch_norm: ModeArgument(5, "training", False, needs=1),
    torch.ops.aten.batch_norm.default: ModeArgument(5, "training", False, needs=3),
}
"""Operations a stage graph may call with a train/eval argument baked in."""


class TrainOnly(nn.Module):
    """Calls ``function`` as traced in train mode, with its mode argument set to eval in eval mode."""

    def __init__(self, function: Callable[..., object], argument: ModeArgument) -> None:
        super().__init__()
        self.function = function
        self.argument = argument

    def forward(self, *args: object, **kwargs: object) -> object:
        argument = self.argument
        if self.training or (argument.needs is not None and len(args) > argument.needs
                             and args[argument.needs] is None):
            return self.function(*args, **kwargs)
        if len(args) > argument.index:
            args = (*args[:argument.index], argument.eval_value, *args[argument.index + 1:])
        else:
            kwargs = {**kwargs, argument.name: argument.eval_value}
        return self.function(*args, **kwargs)


def switch_modes(module: fx.GraphModule) -> int:
    """Make every call in ``module``'s graph that has a train/eval argument follow ``module.training``;
    returns how many calls changed."""
    count = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target not in MODE_ARGUMENTS:
            continue
        name = f"_pipeloom_mode_{count}"
        module.add_submodule(name, TrainOnly(node.target, MODE_ARGUMENTS[node.target]))
        node.op, node.target = "call_module", name
        count += 1
    if count:
        module.recompile()
    return count


@contextlib.contextmanager
def train_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in train mode while it is traced, each module's own mode restored after: the graph holds the
    train-mode code (dropout, batch statistics), which the stages switch off in eval mode (:func:`switch_modes`).
    Traced in eval mode, a model (``from_pretrained`` returns one) had no dropout for ``engine.train()`` to switch
    on."""
    flags = {module: module.training for module in model.modules()}
    model.train()
    try:
        yield
    finally:
        for module, training in flags.items():
            module.training = training
