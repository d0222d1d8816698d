"""What a rank says when an action of its step fails: another rank's failure where a collective inside the action
broke off because of it, and under a tensor-parallel plan what a shape error most often means; which ranks share
the failure board of a mesh."""

from __future__ import annotations

import torch.distributed as dist

from pipeloom.runtime.comm.messenger import FailureScope, Messenger
from pipeloom.runtime.parallel.dp import Layout

__all__ = ["broken_off", "mesh_failure_scope", "tp_shape_hint"]

_BACKEND = ("Connection closed by peer", "Connection reset by peer", "[gloo", "gloo/transport", "NCCL")
"""The backends' own words for a collective whose peer went away (gloo's transport, NCCL's errors)."""

_SHAPE_ERRORS = ("shapes cannot be multiplied", "must match the size", "is invalid for input of size")
"""torch's words for a matmul, a broadcast or a view given a tensor of another size."""


def broken_off(error: Exception, messenger: Messenger) -> str | None:
    """Where a collective inside an action (a "tp" all-reduce, an "ep" all-to-all) broke off because another rank
    failed: that rank's own failure, as the failure board holds it (None otherwise). Its peer had reported the
    backend's 'Connection closed by peer' as its own failure."""
    if not isinstance(error, dist.DistBackendError) and not any(words in str(error) for words in _BACKEND):
        return None  # the rank's own error (a user's ConnectionError too): said as it is
    return messenger.failure_reason(None)


def tp_shape_hint(error: Exception, tp_size: int) -> str:
    """Under a tensor-parallel plan (``tp_size`` > 1), what a shape error inside an action most often is: a
    hand-written plan that splits a projection's output and leaves the next one whole (q/k/v column-parallel,
    o_proj left out); '' otherwise."""
    if tp_size <= 1 or not any(words in str(error) for words in _SHAPE_ERRORS):
        return ""
    return ("; under tp_plan this is most often the plan: each column-parallel projection needs the row-parallel "
            "one that takes its output (q/k/v_proj with o_proj, gate/up_proj with down_proj), and the modules "
            "between them must take split inputs")


def mesh_failure_scope(layout: Layout) -> FailureScope | None:
    """With data-parallel replicas or a "tp" dimension, one failure board over every rank of the mesh
    (global numbers; a rank of another pipeline is named so, with its mesh coordinates on a "tp" mesh),
    whose failures also wake waits on the "dp" group."""
    if layout.dp.size <= 1 and layout.tp.size <= 1:
        return None
    group, dp = layout.group, layout.dp.group
    mine = {dist.get_global_rank(group, r): r for r in range(layout.world)} if group is not None else {}

    def name(number: int) -> str:
        if layout.coordinates is not None:
            return f"{mine[number]} ({layout.where(number)})" if number in mine else layout.where(number)
        return str(mine[number]) if number in mine else f"{number} (global; another data-parallel replica)"

    return FailureScope(rank=dist.get_rank(), world=dist.get_world_size(), name=name,
                        wake=(dp,) if dp is not None else (),
                        of_peer=(lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r))
