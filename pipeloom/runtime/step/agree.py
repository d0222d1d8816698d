"""Every rank takes the same step: before any tensor moves, the ranks compare a digest of what
``step``/``eval_step`` was given (micro-batch count, kind of step, shapes and dtypes of inputs and
target) and, where it differs, every rank raises :class:`StepMismatchError` naming the ranks and values.

Cost per step: one all-gather of ``len(FIELDS)`` int64 per rank; the readable descriptions travel
only after a mismatch. A world of one rank compares nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from pipeloom.runtime.comm.packed import gather_objects
from pipeloom.runtime.errors import PipelineError, StepMismatchError

__all__ = ["FIELDS", "agree_on_step", "describe_step", "describe_value"]

FIELDS = ("micro-batch count", "kind of step", "inputs", "target")  # what describe_step returns, in order
_SAME_BATCH = "give every rank the same global batch (shapes, dtypes); each rank cuts it into micro-batches"
_FIXES = {
    "micro-batch count": "build every rank's engine with the same microbatches= and schedule",
    "kind of step": "call step() (or eval_step()) on every rank alike, with or without target=",
    "inputs": _SAME_BATCH,
    "target": _SAME_BATCH,
}


def describe_value(value: object) -> str:
    """``float32[16, 8]`` for a tensor, ``(a, b)``/``[a, b]`` for a tuple/list, ``none``, else the type."""
    if value is None:
        return "none"
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(describe_value(v) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(describe_value(v) for v in value) + "]"
    return type(value).__name__


def describe_step(*, microbatches: int, training: bool, inputs: object, target: object) -> tuple[str, ...]:
    """This rank's step, one text per entry of ``FIELDS``."""
    kind = "step()" if training else ("eval_step() with target" if target is not None else "eval_step()")
    return str(microbatches), kind, describe_value(inputs), describe_value(target)


def _digest(texts: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """One signed 64-bit hash per text: int64[len(texts)]."""
    values = [int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little", signed=True)
              for t in texts]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _who(values: list[str]) -> str:
    """``rank 0 has 8; ranks 1, 2 have 4``: ranks grouped by value, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return "; ".join(f"rank {ranks[0]} has {value}" if len(ranks) == 1
                     else f"ranks {', '.join(map(str, ranks))} have {value}"
                     for value, ranks in groups.items())


def agree_on_step(inputs: object, target: object, *, training: bool, microbatches: int, group: object,
                  world: int, rank: int, device: torch.device, wait: Callable[[object, str], None],
                  local: str = "") -> tuple[int, ...]:
    """Raise :class:`StepMismatchError` on every rank of ``group`` (``world`` ranks) unless all describe this
    step alike (:func:`describe_step`); a failed exchange raises ``wait``'s PipelineError. Returns every rank's
    digest of its ``local`` text, which may differ between ranks (in the same all-gather: what each rank's stages
    train, so that all learn of a piece frozen on one)."""
    if world <= 1:
        return tuple(_digest((local,), torch.device("cpu")).tolist())
    mine = describe_step(microbatches=microbatches, training=training, inputs=inputs, target=target)
    digest = _digest((*mine, local), device)
    gathered = [torch.empty_like(digest) for _ in range(world)]
    doing = "comparing this step's inputs across ranks"
    try:
        work = dist.all_gather(gathered, digest, group=group, async_op=True)
    except Exception as error:  # noqa: BLE001 (a broken group can refuse the post itself)
        raise PipelineError(f"rank {rank}: {doing} failed: {type(error).__name__}: {error}") from error
    wait(work, doing)
    rows = [row.tolist()[:-1] for row in gathered]
    if all(row == rows[0] for row in rows):
        return tuple(int(row[-1]) for row in gathered)
    texts = gather_objects(list(mine), group, world, rank, device, wait, doing)  # every rank saw the mismatch
    for index, field in enumerate(FIELDS):
        values = [t[index] for t in texts]
        if any(v != values[0] for v in values):
            raise StepMismatchError(f"ranks disagree on this step's {field}: {_who(values)}; {_FIXES[field]} "
                                    "(nothing was sent)")
    return tuple(int(row[-1]) for row in gathered)  # digests differed, texts not: nothing to refuse
