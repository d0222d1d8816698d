"""The expert-parallel all-to-all traffic of one mixture-of-experts layer (no torch): the buffers each rank
exchanges in one micro-batch's dispatch and combine, forward and backward, as pipeloom's runtime sends them
(:mod:`pipeloom.runtime.parallel.ep_dispatch`), and their time over a link. The one formula of the cost model
for ep: the cluster planner prices the ``ep`` dimension with it, and the profiler's counted bytes equal it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeloom.plan.errors import TensorParallelError

__all__ = ["EXCHANGES", "Exchange", "all_to_all_seconds", "expert_capacity", "moe_exchanges", "routed_pairs"]

EXCHANGES = ("counts", "rows", "weights", "ids", "combine")
"""What one all-to-all of a MoE layer moves: the pair counts per destination, the tokens' rows, their routing
weights, their expert ids (local to the destination), and the experts' results back."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Exchange:
    """One all-to-all of one MoE layer in one micro-batch, seen from one rank."""

    what: str
    """One of :data:`EXCHANGES`."""
    phase: str
    """``"F"`` (forward) or ``"I"`` (the input-gradient backward: each differentiable exchange reversed)."""
    bytes: float
    """This rank's send buffer: in the dispatch exactly every pair it routes (those to its own experts
    included); in the combine and the reverses what its experts received, the same size under balanced routing
    and on average over the ep group whatever the routing (each pair arrives once)."""


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TensorParallelError(f"{name} must be a positive integer, got {value!r}")
    return value


def expert_capacity(factor: float, *, tokens: int, top_k: int, experts: int) -> int:
    """Pairs each expert takes from one rank's ``tokens`` under a capacity factor:
    ``ceil(factor · tokens · top_k / experts)`` (Switch, GShard, Megatron's ``moe_expert_capacity_factor``)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise TensorParallelError(f"capacity factor must be a finite number > 0, got {factor!r}")
    return math.ceil(factor * tokens * top_k / experts)


def routed_pairs(*, tokens: int, top_k: int, experts: int, capacity_factor: float | None = None) -> float:
    """(token, choice) pairs one rank sends in one MoE layer under balanced routing: ``tokens · top_k``, or
    with a capacity factor ``experts · min(tokens · top_k / experts, capacity)`` (the pairs beyond an
    expert's capacity are dropped before the dispatch)."""
    pairs = _positive("tokens", tokens) * _positive("top_k", top_k)
    if capacity_factor is None:
        return float(pairs)
    capacity = expert_capacity(capacity_factor, tokens=tokens, top_k=top_k, experts=_positive("experts", experts))
    return float(min(pairs, experts * capacity))


def moe_exchanges(*, tokens: int, hidden: int, top_k: int, ep: int, dtype_bytes: int, experts: int = 1,
                  capacity_factor: float | None = None, weight_bytes: int | None = None,
                  index_bytes: int = 8) -> tuple[Exchange, ...]:
    """The all-to-alls one rank runs in one MoE layer for one micro-batch of ``tokens`` tokens (those this rank
    routes) over ``ep`` ranks; none when ``ep`` is 1. With ``p`` = :func:`routed_pairs`:

    - F: ``counts`` (``ep`` integers of ``index_bytes``), ``rows`` ``p·hidden·dtype_bytes``, ``weights``
      ``p·weight_bytes``, ``ids`` ``p·index_bytes``, ``combine`` ``p·hidden·dtype_bytes``;
    - I: the reverse of each differentiable one, in the order autograd runs them: ``combine``, then ``rows``
      and ``weights`` (one autograd node).

    ``weight_bytes`` defaults to ``dtype_bytes`` (the routing weights in the activations' dtype)."""
    _positive("ep", ep)
    _positive("hidden", hidden)
    _positive("dtype_bytes", dtype_bytes)
    if ep == 1:
        return ()
    pairs = routed_pairs(tokens=tokens, top_k=top_k, experts=experts, capacity_factor=capacity_factor)
    weight = dtype_bytes if weight_bytes is None else _positive("weight_bytes", weight_bytes)
    row = pairs * hidden * dtype_bytes
    forward = {"counts": float(ep * _positive("index_bytes", index_bytes)), "rows": row, "weights": pairs * weight,
               "ids": pairs * index_bytes, "combine": row}
    backward = {"combine": row, "rows": row, "weights": pairs * weight}
    return (*(Exchange(what=w, phase="F", bytes=b) for w, b in forward.items()),
            *(Exchange(what=w, phase="I", bytes=b) for w, b in backward.items()))


def all_to_all_seconds(nbytes: float, ranks: int, *, peers: int | None = None, latency: float,
                       bandwidth: float | None) -> float:
    """Seconds of one all-to-all of ``nbytes`` per rank over ``ranks`` ranks, for the part of it that crosses
    one link: balanced routing sends ``peers / ranks`` of the buffer to ``peers`` other ranks (default: all
    ``ranks - 1`` of them), every message posted at once, so one latency and that share at ``bandwidth``
    (None: unlimited): ``latency + peers/ranks · nbytes / bandwidth`` (0 with no peer or no bytes)."""
    _positive("ranks", ranks)
    peers = ranks - 1 if peers is None else peers
    if isinstance(peers, bool) or not isinstance(peers, int) or not 0 <= peers < ranks:
        raise TensorParallelError(f"peers must be an integer in [0, {ranks}), got {peers!r}")
    if peers == 0 or nbytes <= 0:
        return 0.0
    return latency + (0.0 if bandwidth is None else peers / ranks * nbytes / bandwidth)
