"""Pipeline × FSDP2: ``pipeline(..., mesh=mesh, data_parallel="fsdp")`` shards each local piece's
parameters, gradients and optimizer state over the mesh's ``"dp"`` dimension with torch's
``fully_shard`` instead of replicating them.

A pipeline calls each piece once per micro-batch and splits backward into I and W, which FSDP's own
hooks do not expect; this follows torch.distributed.pipelining's recipe. Each piece is sharded with
``reshard_after_forward=False`` (its parameters are gathered at its first forward of the step and stay
whole until the step ends), and during the step gradient reduction and resharding are off
(``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``), so B, I and W accumulate
into the whole parameters' ``.grad`` exactly as without FSDP. As soon as a stage's last gradient action
ran, its gradients are reduce-scattered into the sharded parameters (FSDP's ``post_backward``, summed:
``set_gradient_divide_factor(1.0)``, since each micro-batch's loss is already divided by M × dp); at
the end of the step FSDP's final callback reshards. ``post_backward`` and the parameter groups are FSDP
internals (torch's own pipelining calls them the same way); a torch without them is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, cast

from torch import nn

from pipeloom.runtime.errors import PipelineError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

__all__ = ["ShardedGradients", "shard_pieces", "whole_parameters"]


class _FSDPState(Protocol):
    """What is called here of FSDP2's state of a module (an internal, as torch's own pipelining calls it)."""

    def _root_post_backward_final_callback(self) -> None: ...


def _state(module: nn.Module) -> _FSDPState:
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(module)  # type: ignore[attr-defined]  # contract() adds .state; the stubs lack it


def _sharded(module: nn.Module) -> FSDPModule:
    """``module`` as the FSDPModule that ``fully_shard`` made it (it swaps the module's class)."""
    return cast("FSDPModule", module)


def _groups(module: nn.Module) -> list:
    state = _state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        raise PipelineError("data_parallel='fsdp' needs FSDP2's parameter groups (torch >= 2.6); upgrade torch or "
                            "use data_parallel='replicate'")
    return list(groups)


def shard_pieces(pieces: Mapping[int, nn.Module], mesh: DeviceMesh | None) -> None:
    """``fully_shard`` every local piece over ``mesh`` (the "dp" sub-mesh), gradients summed."""
    from torch.distributed.fsdp import fully_shard

    for module in pieces.values():
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        sharded = _sharded(module)
        sharded.set_gradient_divide_factor(1.0)
        sharded.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def whole_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The unsharded parameters a sharded piece computes with (the leaves of its autograd graph)."""
    return [param._unsharded_param for group in _groups(module) for param in group.fsdp_params]


class ShardedGradients:
    """One training step's gradient handling for sharded pieces (see the module doc)."""

    def __init__(self, modules: Mapping[int, nn.Module]) -> None:
        self.modules = dict(modules)  # local stage -> its sharded piece
        self.done: set[int] = set()

    def begin(self) -> None:
        for module in self.modules.values():
            sharded = _sharded(module)
            sharded.set_requires_gradient_sync(False)
            sharded.set_reshard_after_backward(False)
            sharded.set_is_last_backward(False)

    def stage_done(self, stage: int) -> None:
        """The stage's last gradient action ran: reduce-scatter its gradients into the shards."""
        if stage in self.done:
            return
        self.done.add(stage)
        module = self.modules[stage]
        sharded = _sharded(module)
        sharded.set_requires_gradient_sync(True)
        sharded.set_reshard_after_backward(True)
        sharded.set_is_last_backward(True)
        for group in _groups(module):
            group.post_backward()

    def finish(self) -> None:
        """Reduce what is left and let FSDP end its backward (reshard, wait for the reductions)."""
        for stage in self.modules:
            self.stage_done(stage)
        for module in self.modules.values():
            _state(module)._root_post_backward_final_callback()
