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

With an ``"ep"`` dimension (:mod:`pipeloom.runtime.parallel.ep`) the piece is sharded over every replica (the
flattened ``"replicas"`` mesh, dp × ep ranks) and each experts module first on its own: its parameters, already
DTensors over ``"ep"``, are sharded again over ``"dp"`` (torch's FSDP + EP placement, the "dp_shard_mod_ep"
of torchtitan), so its gradient is reduce-scattered over ``"dp"`` alone; without ``"dp"`` the experts are kept
out of FSDP (their gradient needs no reduction). The steps above then run over every FSDP module of the piece.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    """The FSDP parameter groups of ``module``'s own state and of every sharded module inside it."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        groups = getattr(_state(sub), "_fsdp_param_groups", None)
        if groups is None:
            raise PipelineError("data_parallel='fsdp' needs FSDP2's parameter groups (torch >= 2.6); upgrade torch "
                                "or use data_parallel='replicate'")
        found += groups
    return found


def shard_pieces(pieces: Mapping[int, nn.Module], mesh: DeviceMesh | None,
                 inner: Sequence[tuple[nn.Module, DeviceMesh | None]] = ()) -> None:
    """``fully_shard`` every local piece over ``mesh`` (the "dp" sub-mesh), gradients summed. ``inner``: modules
    of the pieces sharded first, each over its own mesh (an experts module, whose parameters are already sharded
    over "ep", over "dp"), or, with None, kept out of FSDP (their gradients need no reduction)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kept_out: set[int] = set()
    for module, own in inner:
        if own is None:
            kept_out.update(id(p) for p in module.parameters())
        else:
            fully_shard(module, mesh=own, reshard_after_forward=False)
    for module in pieces.values():
        ignored = {p for p in module.parameters() if id(p) in kept_out}
        fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=ignored or None)
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def whole_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters a sharded piece computes with (the leaves of its autograd graph): the unsharded ones
    FSDP gathers, and the ones kept out of FSDP as they are."""
    whole, managed = [], set()
    for group in _groups(module):
        for param in group.fsdp_params:
            whole.append(param._unsharded_param)
            managed.update({id(param._unsharded_param), id(param.sharded_param)})
    return whole + [p for p in module.parameters() if id(p) not in managed]


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
