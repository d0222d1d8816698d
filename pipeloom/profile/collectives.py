"""Count and time the collectives tensor-parallel code runs (imports torch): a dispatch mode that records
every functional collective DTensor issues (kind, whole-tensor bytes and when it began, so that each can be
put down to the action running then), and timed collectives on a real group for
:func:`pipeloom.plan.tp.collectives.fit_collectives`."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeloom.plan.errors import PlanError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["CollectiveCounter", "by_interval", "group_mean", "time_collectives"]

_KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
_C10D_KINDS = {"alltoall_base_": "all_to_all"}
"""The process-group ops counted besides DTensor's functional ones: the expert-parallel dispatch's
``dist.all_to_all_single`` (gloo's and NCCL's ``alltoall_base``); the data-parallel gradient all-reduces, which
run between and beside the actions, are not counted."""


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as counter: ...``; ``counter.records`` lists ``(kind, bytes)`` per collective
    (bytes of the whole tensor: an all-reduce's input, an all-gather's output, a reduce-scatter's input, an
    all-to-all's send buffer),
    ``counter.counts()`` sums them by kind, ``counter.stamps`` holds when each began (``time.time_ns()``, the
    clock of the runtime's traces). The same ops torch's ``CommDebugMode`` counts."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int]] = []
        self.stamps: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        qualified = packet._qualified_op_name
        kind = (_KINDS.get(packet.__name__) if "c10d_functional" in qualified
                else _C10D_KINDS.get(packet.__name__) if qualified.startswith("c10d::") else None)
        started = time.time_ns()
        out = func(*args, **kwargs)
        if kind is not None:
            tensor = args[1] if qualified == "c10d::alltoall_base_" else args[0]  # (output, input, ...)
            nbytes = tensor.numel() * tensor.element_size()
            if kind == "all_gather":
                nbytes = out.numel() * out.element_size()
            self.records.append((kind, int(nbytes)))
            self.stamps.append(started)
        return out

    def counts(self) -> dict[tuple[str, int], int]:
        """``{(kind, bytes): how many}``."""
        return dict(Counter(self.records))


def by_interval(counter: CollectiveCounter, intervals: Sequence[tuple[Hashable, int, int]]
                ) -> dict[Hashable, list[tuple[str, float]]]:
    """The counter's ``(kind, bytes)`` records grouped by the interval ``(key, start_ns, end_ns)`` each began
    in (the runtime's traced actions of this rank); a record in none of them goes under None."""
    found: dict[Hashable, list[tuple[str, float]]] = {key: [] for key, _, _ in intervals}
    found.setdefault(None, [])
    ordered = sorted(intervals, key=lambda interval: interval[1])
    for record, stamp in zip(counter.records, counter.stamps):
        key = next((k for k, start, end in ordered if start <= stamp <= end), None)
        found[key].append(record)
    return found


def group_mean(found: dict[object, list[tuple[str, float]]], group: ProcessGroup
               ) -> dict[object, list[tuple[str, float]]]:
    """``found`` with each all-to-all's bytes the mean over the ``"ep"`` group (every rank of it runs the same
    exchanges in the same order): a rank's dispatch sends all its pairs, but what it sends back in the combine (and
    in the dispatch's reverse) is what its experts received, which depends on the routing; over the group each pair
    arrives once, so the mean is the balanced size :func:`pipeloom.plan.tp.all_to_all.moe_exchanges` gives."""
    import torch.distributed as dist

    ranks: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, found, group=group)
    mean: dict[object, list[tuple[str, float]]] = {}
    for key, records in found.items():
        columns = list(zip(*(part[key] for part in ranks if part is not None)))
        if len(columns) != len(records):
            raise PlanError(f"the ranks of one \"ep\" group ran different collectives in {key}; profile again")
        mean[key] = [(kind, statistics.fmean(b for _, b in column) if kind == "all_to_all" else nbytes)
                     for (kind, nbytes), column in zip(records, columns)]
    return mean


def time_collectives(group: ProcessGroup | None, sizes: Sequence[int], *, repeats: int = 5,
                     dtype: torch.dtype = torch.float32) -> list[tuple[str, int, float, float]]:
    """``(kind, ranks, bytes, seconds)`` samples (the median of ``repeats``) of each collective kind at each
    whole-tensor size in ``sizes`` bytes on ``group``, for :func:`pipeloom.plan.tp.collectives.fit_collectives`."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    element = torch.tensor([], dtype=dtype).element_size()
    samples = []
    for nbytes in sizes:
        count = max(n, nbytes // element // n * n)
        whole = torch.ones(count, dtype=dtype)
        part = torch.ones(count // n, dtype=dtype)
        # partial binds this size's tensors now (a lambda would see the loop variables late).
        # the *_single names where this torch has them (2.13 deprecates the *_tensor ones)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        runs = {"all_reduce": partial(dist.all_reduce, whole, group=group),
                "all_gather": partial(gather, whole, part, group=group),
                "reduce_scatter": partial(scatter, part, whole, group=group)}
        for kind, run in runs.items():
            run()  # warm up
            seconds = []
            for _ in range(repeats):
                dist.barrier(group=group)
                started = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - started)
            samples.append((kind, n, float(count * element), sorted(seconds)[len(seconds) // 2]))
    return samples
