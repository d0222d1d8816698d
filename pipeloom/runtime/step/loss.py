"""The step's loss on every rank: the sum of the global batch's micro-batch losses in micro-batch order.

Only ranks holding the model's last piece compute losses. Each rank packs its losses into a float64
vector of M slots plus one slot for the loss dtype's code (float64 holds every float loss exactly);
the vectors are all-reduced over the pipeline's ranks, then gathered over the data-parallel replicas.

The all-reduce is also the step's last meeting point: a rank returns from a step only once every
rank of its pipeline has reached the end of it, so a rank failing during the step fails the step on
every rank. (Sending the loss from the one rank holding the last piece would save one collective
latency, 0.5-1.5 ms on the development machine's gloo, but a rank failing after its last send
would then leave the others returning normally: tried, and kept out for that reason.)
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pipeloom.runtime.comm.messenger import Messenger
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.parallel.dp import Layout
from pipeloom.runtime.step.backward import add_in_order

__all__ = ["LossSum", "checked_loss"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # codes agreed on across ranks


def checked_loss(value: object, *, training: bool) -> torch.Tensor:
    """``loss_fn``'s value for one micro-batch, refused with the fix where one device's ``.backward()`` would refuse
    it or train nothing: not a tensor, not a scalar, or (training) without a gradient (it had run the step and
    trained nothing, or failed in the backward naming neither the loss nor its shape)."""
    if not isinstance(value, torch.Tensor):
        raise PipelineError(f"loss_fn returned {type(value).__name__} {value!r:.60}; return a scalar tensor computed "
                            "from the output (e.g. F.cross_entropy(output, target))")
    if value.dim() != 0:
        raise PipelineError(f"loss_fn returned a tensor of shape {tuple(value.shape)}; return a scalar (reduce it "
                            "with .mean() or .sum(), or reduction='mean')")
    if training and not value.requires_grad:
        raise PipelineError("loss_fn returned a loss that does not require grad (the output detached, or a count "
                            "such as (output.argmax(-1) == target).sum()): its backward would train nothing; return "
                            "a loss computed from the output")
    return value


class LossSum:
    """Sums the step's loss over the mesh (see the module doc)."""

    def __init__(self, *, layout: Layout, messenger: Messenger, loss_ranks: int, num_microbatches: int,
                 device: torch.device) -> None:
        self.layout = layout
        self.messenger = messenger
        self.loss_ranks = loss_ranks  # how many pipeline ranks hold a last piece
        self.m = num_microbatches
        self.device = device

    def total(self, losses: dict[int, torch.Tensor], events: list | None) -> torch.Tensor:
        """The summed loss, the same on every rank (``losses``: this rank's, by micro-batch)."""
        m, layout = self.m, self.layout
        sample = next(iter(losses.values()), None)
        dtype = sample.dtype if sample is not None else torch.float32
        vector = torch.zeros(m, dtype=dtype, device=self.device)
        for mb, value in losses.items():
            vector[mb] = value
        if layout.world == 1 and layout.dp.size == 1:
            return add_in_order(list(vector))
        start = time.time_ns()
        vector = torch.cat([vector.to(torch.float64), torch.zeros(1, dtype=torch.float64, device=self.device)])
        if sample is not None:
            vector[m] = _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0
        if layout.world > 1:
            self.messenger.wait_work(dist.all_reduce(vector, group=layout.group, async_op=True),
                                     "summing the loss across ranks")
        code = round(float(vector[m]) / self.loss_ranks) - 1
        if layout.dp.size > 1:  # the replicas' micro-batches, in global order
            gathered = [torch.empty_like(vector) for _ in range(layout.dp.size)]
            self.messenger.wait_work(dist.all_gather(gathered, vector, group=layout.dp.group, async_op=True),
                                     "gathering the loss of every data-parallel replica")
            vector = torch.cat([part[:m] for part in gathered] + [vector[m:]])
        if events is not None:
            events.append(("loss all-reduce", "sync", start, time.time_ns()))
        return add_in_order(list(vector[:-1].to(_DTYPES[code] if code >= 0 else dtype)))
