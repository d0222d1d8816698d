"""Replicated stage-boundary tensors cross once per tensor-parallel group (Megatron's scatter-gather): each
``"tp"`` rank sends its 1/tp slice of the tensor's bytes and the receiving ranks all-gather the slices over
their ``"tp"`` group, which reassembles the exact bits.

Which tensors are replicated is found, not assumed: on a step that discovers shapes, the sending ranks
all-gather each tensor's bytes over ``"tp"`` and split those equal on every tp rank (a plain tensor after a
row-parallel layer, a ``Replicate()`` DTensor's local tensor); the decision rides in the tensor's
:class:`~pipeloom.runtime.comm.step_messages.LeafMeta` (``split``), so later steps move only slices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeloom.runtime.parallel.tp import TensorParallel

__all__ = ["Traffic", "gather_slices", "identical_over_tp", "slice_of", "wire_bytes"]

Await = Callable[[object], "tuple[str, Exception | None] | None"]  # Messenger.await_work


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one rank's step moved between stages, in bytes (descriptions of a discovering step included)."""

    sent_bytes: int = 0  # point-to-point bytes this rank sent
    unsplit_bytes: int = 0  # what it would have sent with every tensor whole (no scatter-gather)
    gathered_bytes: int = 0  # bytes this rank received from its "tp" peers by all-gathers of slices


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (uint8): slices of it split any dtype evenly."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def wire_bytes(nbytes: int, split: int) -> int:
    """Bytes of one slice of an ``nbytes`` tensor cut in ``split`` (the last zero-padded): ceil(nbytes / split)."""
    return -(-nbytes // split)


def slice_of(local: torch.Tensor, split: int, rank: int) -> torch.Tensor:
    """Slice ``rank`` of ``split`` of ``local``'s bytes (uint8, ``wire_bytes`` long)."""
    flat = _bytes(local)
    chunk = wire_bytes(flat.numel(), split)
    part = flat[rank * chunk:(rank + 1) * chunk]
    if part.numel() < chunk:  # the tail of a tensor whose bytes do not divide evenly
        part = torch.cat([part, part.new_zeros(chunk - part.numel())])
    return part.contiguous()


def identical_over_tp(locals_: Sequence[torch.Tensor], tp: TensorParallel, wait: Await,
                      device: torch.device) -> list[bool]:
    """Per tensor, whether its bytes are the same on every rank of ``tp`` (one all-gather of sizes, one of
    the bytes of the tensors whose sizes agree); every rank of the group gets the same answer. ``wait``
    bounds the waits; it returns a failure, which is raised as RuntimeError for the caller to name."""
    sizes = torch.tensor([_bytes(t).numel() for t in locals_], dtype=torch.int64, device=device)
    every = _all_gather(sizes, tp, wait)
    same_size = [bool((column == column[0]).all()) for column in torch.stack(every).T.cpu()]
    candidates = [i for i, ok in enumerate(same_size) if ok and int(sizes[i]) >= tp.size]
    if not candidates:
        return [False] * len(locals_)
    mine = torch.cat([_bytes(locals_[i]) for i in candidates])
    theirs = _all_gather(mine, tp, wait)
    found = [False] * len(locals_)
    offset = 0
    for i in candidates:
        n = int(sizes[i])
        found[i] = all(torch.equal(other[offset:offset + n], mine[offset:offset + n]) for other in theirs)
        offset += n
    return found


def gather_slices(slices: Sequence[torch.Tensor], like: Sequence[tuple[tuple[int, ...], torch.dtype]],
                  tp: TensorParallel, wait: Await) -> list[torch.Tensor]:
    """The whole tensors (``like``: shape and dtype of each) from this rank's ``slices`` of their bytes and
    those of its ``"tp"`` peers: one all-gather for all of them; the bytes come back exactly."""
    if not slices:
        return []
    mine = torch.cat(list(slices))
    parts = _all_gather(mine, tp, wait)
    out = []
    offset = 0
    for piece, (shape, dtype) in zip(slices, like):
        n = piece.numel()
        whole = torch.cat([part[offset:offset + n] for part in parts])
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(whole[:nbytes].view(dtype).view(shape))
        offset += n
    return out


def _all_gather(tensor: torch.Tensor, tp: TensorParallel, wait: Await) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(tp.size)]
    failed = wait(dist.all_gather(parts, tensor, group=tp.group, async_op=True))
    if failed is not None:
        raise RuntimeError(f"all-gather over the \"tp\" group failed: {failed[0]}") from failed[1]
    return parts
