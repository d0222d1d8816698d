"""What one rank runs, fixed when its engine is built: the value a step and the replica exchange read,
so that neither reaches into the engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeloom.runtime.parallel.dp import DataParallel
from pipeloom.runtime.parallel.fsdp import whole_parameters
from pipeloom.runtime.program import Lowering, Step
from pipeloom.runtime.step.shared import SharedParameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RankPieces"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPieces:
    """One rank's stages, programs and the constants of every step."""

    lowering: Lowering
    rank: int
    device: torch.device
    modules: Mapping[int, nn.Module]  # local schedule stage -> its piece's module
    program: tuple[Step, ...]  # the training step's actions, in order
    eval_program: tuple[Step, ...]  # the forward actions only
    num_outputs: tuple[int, ...]  # per model piece: how many values its module returns
    output: object  # the model output's structure, its leaves ValueRefs (split.StageGraph.output)
    loss_fn: Callable
    seed: int  # every forward's random numbers derive from it (rng.forward_seed)
    shared: SharedParameters
    dp: DataParallel
    sharded: bool  # pieces sharded over "dp" with FSDP2
    gradients_done: Mapping[int, int]  # program index -> the stage whose last gradient action it is
    tp_mesh: DeviceMesh | None = None  # the "tp" sub-mesh: DTensors arriving at a boundary are rebuilt on it
    joined: frozenset[int] = frozenset()  # program indices of I steps whose W is the next step
    """Such an I runs as one full backward (B) and its W does nothing: the same gradients bit for bit
    (each autograd node runs the same kernels), in one pass over the graph instead of one for I and
    one per weight group for W. Steps traced for their action times keep I and W apart."""

    @property
    def last_piece(self) -> int:
        return self.lowering.num_pieces - 1

    @property
    def num_microbatches(self) -> int:
        """Micro-batches of one step of this pipeline."""
        return self.lowering.num_microbatches

    @property
    def total_microbatches(self) -> int:
        """Micro-batches of the global batch (over the data-parallel replicas)."""
        return self.lowering.num_microbatches * self.dp.size

    @property
    def first_microbatch(self) -> int:
        """The global index of this replica's first micro-batch."""
        return self.dp.rank * self.lowering.num_microbatches

    def trainable(self) -> dict[int, list[nn.Parameter]]:
        """Per local stage, its parameters that require a gradient now."""
        return {s: [p for p in module.parameters() if p.requires_grad] for s, module in self.modules.items()}

    def weight_parameters(self, stage: int, params: Mapping[int, list[nn.Parameter]]) -> list[nn.Parameter]:
        """The parameters ``stage`` computes gradients for: ``params[stage]``, or the whole ones of a
        sharded piece (the leaves of its autograd graph)."""
        if self.sharded:
            return [p for p in whole_parameters(self.modules[stage]) if p.requires_grad]
        return params[stage]
