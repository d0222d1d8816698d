"""Gradient-norm clipping over all ranks, bitwise equal to ``torch.nn.utils.clip_grad_norm_`` on one
device: every parameter's norm is computed where it lives, gathered, and combined in the model's order."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import reduce
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.state.state_dict import Wait, plain_wait

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "is_sharded"]


def _norms(grads: list[torch.Tensor], norm_type: float, foreach: bool | None,
           gather_over: DeviceMesh | None = None) -> list[torch.Tensor]:
    """Each gradient's norm computed as ``torch.nn.utils.get_total_norm`` computes it (the foreach kernel
    where torch uses it: on a GPU its sums differ from ``vector_norm``'s in the last bits). A gradient sharded over
    ``gather_over`` (FSDP's "dp" mesh) is gathered whole for it, so the norm is "replicate"'s bitwise (the shards'
    norms combined round differently); one sharded otherwise (ep's experts, tp's shards, sharded in every mode) from
    its shards' norms."""
    from torch.utils._foreach_utils import (
        _device_has_foreach_support,
        _group_tensors_by_device_and_dtype,
        _has_foreach_support,
    )

    def kernel_norms(tensors: list[torch.Tensor], device: torch.device) -> Sequence[torch.Tensor]:
        if (foreach is None and _has_foreach_support(tensors, device)
                or foreach and _device_has_foreach_support(device)):
            return torch._foreach_norm(tensors, norm_type)
        if foreach:
            raise PipelineError(f"foreach=True, but the foreach API does not run on {device.type} tensors; "
                                "pass foreach=None")
        return [torch.linalg.vector_norm(g, norm_type) for g in tensors]

    norms: list = [None] * len(grads)
    plain = [i for i, g in enumerate(grads) if not is_sharded(g)]
    for i in sorted(set(range(len(grads))) - set(plain)):  # DTensors: a collective each, in the model's order
        grad = grads[i]
        assert is_sharded(grad)
        if gather_over is None or grad.device_mesh != gather_over:  # ep's experts, tp's shards: their shards' norms
            norms[i] = torch.linalg.vector_norm(grad, norm_type).full_tensor()
            continue
        whole = grad.full_tensor()  # FSDP's: the norm of the shards' norms differs from the whole's in the last bits
        norms[i] = kernel_norms([whole], whole.device)[0]
        del whole
    if not plain:
        return norms
    groups = _group_tensors_by_device_and_dtype([[grads[i] for i in plain]], with_indices=True)
    for (device, _), ([group], indices) in groups.items():
        tensors = cast("list[torch.Tensor]", group)  # gradients (torch types the grouped entries optional)
        for i, norm in zip(indices, kernel_norms(tensors, device)):
            norms[plain[i]] = norm
    return norms


def is_sharded(tensor: torch.Tensor | None) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a ``DTensor`` (an FSDP-sharded parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _scale(params: list[nn.Parameter], max_norm: float, total: torch.Tensor, foreach: bool | None) -> None:
    """Scale the gradients by ``max_norm / (total + 1e-6)`` clamped to 1, as torch does; a sharded
    gradient's local shard is scaled in place with the same factor."""
    torch.nn.utils.clip_grads_with_norm_([p for p in params if not is_sharded(p.grad)], max_norm, total, foreach)
    sharded = [p.grad.to_local() for p in params if is_sharded(p.grad)]
    if sharded:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for local in sharded:
            local.mul_(coefficient.to(local.device))


def _stack_order(dtypes: list[torch.dtype], device: torch.device) -> list[int]:
    """The order in which torch's clip stacks the norms of gradients of these dtypes (grouped by dtype)."""
    if len(set(dtypes)) <= 1:
        return list(range(len(dtypes)))
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    placeholders: list[torch.Tensor | None] = [torch.empty(0, dtype=dtype, device=device) for dtype in dtypes]
    groups = _group_tensors_by_device_and_dtype([placeholders], with_indices=True)
    return [i for _, indices in groups.values() for i in indices]


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128)


def _gathered_norms(named: list[tuple[str, nn.Parameter]], order: Sequence[str], norm_type: float,
                    foreach: bool | None, group: dist.ProcessGroup | None, device: torch.device,
                    wait: Wait, gather_over: DeviceMesh | None) -> torch.Tensor:
    """``[code; norm]`` (2 × parameters, float64) of every model parameter, each from the lowest rank
    holding it. Code 0: held by no rank, 1: no gradient, 2 + k: a gradient of dtype ``_DTYPES[k]``.
    float64 holds every norm exactly."""
    position = {name: i for i, name in enumerate(order)}
    local = [(position[name], p.grad) for name, p in named if p.grad is not None]
    for _, grad in local:
        if grad.dtype not in _DTYPES:
            raise PipelineError(f"clip_grad_norm_ handles gradients of dtypes {list(_DTYPES)}, "
                                f"not {grad.dtype}")
    codes = [0] * len(order)
    for name, _ in named:
        codes[position[name]] = 1
    for i, grad in local:
        codes[i] = 2 + _DTYPES.index(grad.dtype)
    table = torch.zeros(2, len(order), dtype=torch.float64, device=device)
    table[0] = torch.tensor(codes, dtype=torch.float64)
    if local:
        norms = _norms([grad for _, grad in local], norm_type, foreach, gather_over)
        where = torch.tensor([i for i, _ in local], device=device)
        table[1].index_copy_(0, where, torch.stack([n.to(device, torch.float64) for n in norms]))
    if group is None:
        return table
    tables = [torch.empty_like(table) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(tables, table, group=group, async_op=True), "exchanging gradient norms")
    every = torch.stack(tables)  # [world, 2, parameters]
    owner = (every[:, 0] != 0).to(torch.uint8).argmax(dim=0)  # the first maximum: the lowest holding rank
    return every.gather(0, owner.view(1, 1, -1).expand(1, 2, len(order)))[0]


def clip_grad_norm_(named: Iterable[tuple[str, nn.Parameter]], order: Sequence[str], max_norm: float, *,
                    norm_type: float | str = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, group: dist.ProcessGroup | None, device: torch.device,
                    wait: Wait = plain_wait, gather_over: DeviceMesh | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the parameters of every rank, bitwise.

    ``named`` are this rank's parameters, ``order`` every parameter name of the model in its order.
    Each rank computes its gradients' norms as torch does; one all-gather gives every rank every
    parameter's norm, counted once (from the lowest rank holding it); the norms are stacked in the order
    torch stacks them and finished as torch finishes. Scales the local gradients; returns the total norm,
    the same on every rank. ``gather_over``: the mesh FSDP shards the gradients over, whose gradients are gathered
    whole for their norms (:func:`_norms`).
    """
    norm_type = float(norm_type)
    named = list(named)
    with torch.no_grad():
        table = _gathered_norms(named, order, norm_type, foreach, group, device, wait, gather_over)
        codes = [int(c) for c in table[0].tolist()]
        with_grad = [i for i, code in enumerate(codes) if code >= 2]  # model order, as torch lists the grads
        if not with_grad:
            return torch.tensor(0.0)  # torch's norm of no gradients; nothing to scale
        grad_dtypes = [_DTYPES[codes[i] - 2] for i in with_grad]
        stacked_order = [with_grad[k] for k in _stack_order(grad_dtypes, device)]
        # torch.stack promotes the norms to one dtype; each is exact in float64 and in its own dtype, so
        # float64 -> the promoted dtype gives the elements torch stacks
        promoted = reduce(torch.promote_types, (_DTYPES[codes[i] - 2].to_real() for i in stacked_order))
        total = torch.linalg.vector_norm(table[1][stacked_order].to(promoted), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise PipelineError(f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                                "cannot be clipped; pass error_if_nonfinite=False to scale by it anyway")
        _scale([p for _, p in named], max_norm, total, foreach)
    return total


# ------------------------------------------------------------------------------ distributed checkpoints
