"""The forward of a sharded experts module: each (token, choice) pair goes to the rank holding its expert
with an all-to-all, that rank's experts compute it with the module's own forward, an all-to-all brings the
results back, and each token's contributions are summed in the order the unsharded module sums them.

Per (token, choice) pair the values are those of one device: the module's own code computes ``f(x, e, w)``
for one row (a matmul row does not depend on the other rows of its batch on the CPU kernels the tests run;
docs/parallelism.md), and the per-token sum keeps the unsharded order — expert index order for
``transformers``' ``eager`` experts (an ``index_add_`` per expert), choice order otherwise (the
``grouped_mm`` kernel's ``view(T, k, H).sum(1)``, and the interface's rule for a user's module).
Gradients: each expert's weight gradient sums its rows from every replica of the ep group, in another
order and grouping than one device (docs/parallelism.md states which sums change).

A capacity factor (``Parallelism(capacity_factor=f)``) bounds the pairs each expert takes from one rank's
micro-batch to ``ceil(f · T · k / E)`` (:func:`pipeloom.plan.tp.all_to_all.expert_capacity`); the pairs beyond
it, in (token, choice) order, are dropped before the dispatch (:func:`over_capacity`): they contribute nothing,
as the interface's "no expert" index, and the token keeps its other choices and the residual. None (the
default) drops nothing, and the dispatch runs exactly as without the option.

gloo runs ``all_to_all_single`` (``ProcessGroupGloo::alltoall_base``), as NCCL does; a peer that never joins
makes it raise after the group's timeout, which ``pipeline()`` sets to the engine's.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.plan.tp.all_to_all import expert_capacity
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.parallel.link import SimulatedLink, link_bytes
from pipeloom.runtime.parallel.overlap import current_baton, post_collective
from pipeloom.runtime.parallel.tp import local_of

if TYPE_CHECKING:
    from pipeloom.runtime.parallel.ep import ExpertParallel

__all__ = ["ExpertDispatch", "all_to_all", "over_capacity"]


class _AllToAll(torch.autograd.Function):
    """Tensors of rows ``[sum(send), ...]`` -> ``[sum(recv), ...]`` over the group, one exchange each in order; its
    backward is the reverse exchanges in the same order. One autograd node for all of them: every rank's backward
    then runs them in one order, whatever else its graph holds (two nodes could run in either order)."""

    @staticmethod
    def forward(send: list[int], recv: list[int], group: dist.ProcessGroup, link: SimulatedLink | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_exchange(t, send, recv, group, link) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        outputs = ctx.saved_shapes
        filled = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                  for g, (shape, dtype, device) in zip(grads, outputs)]
        return None, None, None, None, *(_exchange(g, ctx.recv, ctx.send, ctx.group, ctx.link) for g in filled)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.send, ctx.recv, ctx.group, ctx.link = inputs[0], inputs[1], inputs[2], inputs[3]
        ctx.saved_shapes = [(t.shape, t.dtype, t.device) for t in output]


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,
              link: SimulatedLink | None = None) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    payload = rows.contiguous()
    pair = current_baton()  # inside an overlapped pair: the other part computes while this one is in flight
    issued = time.perf_counter()
    try:
        if pair is None:
            dist.all_to_all_single(out, payload, output_split_sizes=recv, input_split_sizes=send, group=group)
        else:
            wait = post_collective(partial(dist.all_to_all_single, out, payload, output_split_sizes=recv,
                                           input_split_sizes=send, group=group, async_op=True), (payload, out), pair)
            pair[0].pass_on(pair[1])
            wait()
    except RuntimeError as error:  # gloo's timeout or a closed connection: say which exchange and with whom
        raise PipelineError(f"the experts' all-to-all over \"ep\" (global ranks "
                            f"{dist.get_process_group_ranks(group)}) failed: an ep peer failed or stopped before "
                            f"joining it (its own error names the cause): {error}") from error
    if link is not None:  # a simulated slower link: complete no earlier than its time after issuing (link.py)
        row_bytes = math.prod(payload.shape[1:]) * payload.element_size()
        link.hold(issued, link_bytes(send, recv, dist.get_rank(group), row_bytes))
    return out


def all_to_all(tensors: tuple[torch.Tensor, ...], send: list[int], recv: list[int], group: dist.ProcessGroup,
               link: SimulatedLink | None = None) -> tuple[torch.Tensor, ...]:
    """Differentiable ``all_to_all_single`` of each of ``tensors`` (``send[r]`` rows to rank r, ``recv[r]`` from
    it), as one autograd node; ``link``: each exchange (and its backward's) held to a simulated link (link.py)."""
    return _AllToAll.apply(send, recv, group, link, *tensors)


def over_capacity(top_k_index: torch.Tensor, num_experts: int, factor: float) -> torch.Tensor:
    """``top_k_index`` ``[T, k]`` with every pair beyond its expert's capacity ``ceil(factor · T · k / E)`` set to
    ``num_experts`` ("no expert"): pairs are taken in (token, choice) order, each expert keeping its first
    ``capacity`` (Switch's and GShard's position order). Pairs already at ``num_experts`` count for no expert."""
    tokens, k = top_k_index.shape
    capacity = expert_capacity(factor, tokens=tokens, top_k=k, experts=num_experts)
    flat = top_k_index.reshape(-1)  # [T·k], token-major
    valid = flat < num_experts
    chosen = torch.nn.functional.one_hot(flat.clamp(max=num_experts - 1), num_experts) * valid[:, None]  # [T·k, E]
    earlier = ((chosen.cumsum(0) - chosen) * chosen).sum(1)  # pairs before this one that chose its expert
    return torch.where(valid & (earlier >= capacity), num_experts, flat).view_as(top_k_index)


class ExpertDispatch:
    """The forward of one sharded experts module (installed as its ``forward``; see the module doc)."""

    def __init__(self, *, module: nn.Module, local: nn.Module, ep: ExpertParallel, num_experts: int,
                 link: SimulatedLink | None = None, capacity_factor: float | None = None) -> None:
        self.module = module  # the model's module, holding the DTensor parameters
        self.local = local  # a shallow copy over this rank's experts: its own forward computes what arrives
        self.ep = ep
        self.num_experts = num_experts
        self.link = link  # a simulated slower link every all-to-all is held to (benchmarks and tests), or None
        self.capacity_factor = capacity_factor  # None: no capacity, nothing dropped
        config = getattr(module, "config", None)
        # transformers' eager experts add one expert at a time (index_add_): contributions in expert order
        self.expert_order = getattr(config, "_experts_implementation", None) == "eager"

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, width = hidden_states.shape[0], hidden_states.shape[-1]
        k = top_k_index.shape[-1]
        if self.capacity_factor is not None:
            top_k_index = over_capacity(top_k_index.reshape(tokens, k), self.num_experts, self.capacity_factor)
        per = self.num_experts // self.ep.size
        ids = top_k_index.reshape(-1)
        kept = (ids < self.num_experts).nonzero().squeeze(1)  # index num_experts: "no expert" (transformers')
        destination = torch.div(ids[kept], per, rounding_mode="floor")
        order = kept[torch.argsort(destination, stable=True)]  # pairs grouped by the rank holding their expert
        send = torch.bincount(destination, minlength=self.ep.size)
        group, link = self.ep.group, self.link
        assert group is not None  # sharded only with an "ep" group
        ones = [1] * self.ep.size
        recv = _exchange(send, ones, ones, group, link)  # how many rows each rank sends here
        send_list, recv_list = send.tolist(), recv.tolist()
        rows, weights = all_to_all((hidden_states.reshape(tokens, width)[torch.div(order, k, rounding_mode="floor")],
                                    top_k_weights.reshape(-1)[order]), send_list, recv_list, group, link)
        local_ids = _exchange(ids[order] % per, send_list, recv_list, group, link)  # index among its rank's experts
        done = self._per_source(rows, local_ids, weights, recv_list)
        (back,) = all_to_all((done,), recv_list, send_list, group, link)
        pairs = torch.index_copy(back.new_zeros(tokens * k, width), 0, order, back).view(tokens, k, width)
        if not self.expert_order:
            return pairs.sum(dim=1).to(hidden_states.dtype)
        ranked = torch.argsort(top_k_index.reshape(tokens, k), dim=1, stable=True)
        pairs = pairs.gather(1, ranked[..., None].expand(tokens, k, width))
        total = hidden_states.new_zeros(tokens, width)
        for j in range(k):  # zeros + first + second ...: the unsharded module's index_add_ order per token
            total = total + pairs[:, j].to(total.dtype)
        return total

    def _per_source(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    recv: list[int]) -> torch.Tensor:
        """:meth:`_compute` on the rows from each source rank apart, in rank order: an expert's matmul then has
        the height it has on that rank without ep (its rows of that rank's micro-batch), so its rows are the
        reference's on a BLAS whose rows depend on the matmul's height (MKL on an AVX2 CPU: below 12 rows)."""
        parts = [part for part in zip(rows.split(recv), ids.split(recv), weights.split(recv)) if part[0].shape[0]]
        if len(parts) <= 1:
            return self._compute(rows, ids[:, None], weights[:, None])
        return torch.cat([self._compute(r, i[:, None], w[:, None]) for r, i, w in parts])

    def _compute(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The module's own forward over this rank's experts, on the rows that arrived (one choice each)."""
        names = [name for name, _ in self.module.named_parameters(recurse=False)]
        if rows.shape[0] == 0:  # no token chose these experts: zero gradients, as on one device; and the received
            # (empty) rows stay in the graph, so that this rank's backward joins the dispatch's reverse all-to-all
            anchor = sum((local_of(p) * 0).sum() for _, p in self.module.named_parameters(recurse=False))  # a
            # gradient of its own (a sum's is a stride-0 view, which accumulating into later refuses)
            return rows.new_zeros(rows.shape) + 0 * (anchor + rows.sum() + weights.sum())
        for name, param in self.module.named_parameters(recurse=False):  # the local shards, differentiable
            object.__setattr__(self.local, name, local_of(param))
        try:
            return self.local.forward(rows, ids, weights)  # forward, not __call__: the hooks ran on the module
        finally:
            for name in names:
                del self.local.__dict__[name]
