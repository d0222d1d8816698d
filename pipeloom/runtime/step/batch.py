"""A step's batch cut into micro-batches along dim 0: this data-parallel replica's share of every model input and of
the target, refused where it cannot be cut into the step's micro-batches; and the sizes a step ran with, the key of
what the engine learned on its first step of those sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeloom.runtime.errors import PipelineError

__all__ = ["BatchCut", "batch_rows", "joined_outputs", "part_rows", "row_count_fix", "signature", "tensors"]


class BatchCut:
    """How a step's batch is cut: ``total`` micro-batches over ``replicas`` data-parallel replicas, of which this
    rank's replica (``replica``) takes the ``total / replicas`` from ``replica × that`` on, moved to ``device``."""

    def __init__(self, *, total: int, replicas: int, replica: int, device: torch.device) -> None:
        self.total, self.replicas, self.device = total, replicas, device
        self.per_replica = total // replicas
        self.first = replica * self.per_replica

    def cut(self, value: object, what: str) -> list[list[torch.Tensor]]:
        """``value`` (a tensor or a tuple of tensors) -> per tensor, this replica's micro-batches."""
        values = tensors(value, what)
        m, total = self.per_replica, self.total
        out = []
        for i, v in enumerate(values):
            if v.dim() == 0:
                raise PipelineError(f"{what}[{i}] is a 0-d tensor; micro-batches are cut along dim 0, so give one "
                                    "row per sample")
            parts = list(torch.chunk(v, total, dim=0))
            if len(parts) != total:
                per = f" ({m} per replica × {self.replicas} replicas)" if self.replicas > 1 else ""
                raise PipelineError(f"{what} has {v.shape[0]} rows along dim 0, which torch.chunk cuts into "
                                    f"{len(parts)} pieces, not the {total} micro-batches{per}; "
                                    f"{row_count_fix(v.shape[0], total)}")
            out.append([part.to(self.device) for part in parts[self.first:self.first + m]])
        return out

    def step_inputs(self, inputs: object, target: object, training: bool,
                    input_names: Sequence[str]) -> tuple[list, list]:
        """This replica's micro-batches of the inputs (one list per model input) and of the target."""
        chunks = self.cut(inputs, "inputs")
        if len(chunks) != len(input_names):
            raise PipelineError(f"the model takes {len(input_names)} input(s) ({', '.join(input_names)}), step() got "
                                f"{len(chunks)}; pass a tuple with one tensor per input (for optional or non-tensor "
                                "parameters, wrap the model in a module whose forward takes the tensors you pass)")
        if training and target is None:
            raise PipelineError("step() needs target= (passed to loss_fn with each micro-batch's output)")
        return chunks, self.cut(target, "target") if target is not None else []


def tensors(value: object, what: str) -> tuple[torch.Tensor, ...]:
    """``value`` (a tensor, or a tuple or list of them: the model's positional inputs, or the target) as a tuple;
    PipelineError naming an item of another type, and how to pass optional inputs."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    odd = next(((k, v) for k, v in enumerate(values) if not isinstance(v, torch.Tensor)), None)
    if not values or odd is not None:
        item = f" whose item {odd[0]} is {type(odd[1]).__name__}" if odd and isinstance(value, (tuple, list)) else ""
        raise PipelineError(f"step()'s {what} must be a tensor or a tuple of tensors, got {type(value).__name__}"
                            f"{item}; for keyword or optional inputs (an attention mask after a cache argument), wrap "
                            "the model in a module whose forward takes tensors and calls it: forward(ids, mask): "
                            "return model(input_ids=ids, attention_mask=mask)")
    return values


def joined_outputs(values: list, microbatches: int, rows: Sequence[set[int]] | None) -> object:
    """The micro-batches' model outputs (``values``) joined along dim 0 when all ``microbatches`` of them have one
    structure (a tensor, a tuple, a ModelOutput...) whose tensors have a batch dimension first: where known, a dim 0
    among ``rows[k]`` (micro-batch k's rows, or rows x tokens flattened); else the list (an output whose dim 0 is a
    sequence's, batch second, had been joined along the sequence)."""
    import torch.utils._pytree as pytree

    if len(values) != microbatches:
        return values
    flat = [pytree.tree_flatten(v) for v in values]
    spec = flat[0][1]
    columns = list(zip(*(leaves for leaves, _ in flat)))  # each leaf position over the micro-batches

    def joinable(parts: tuple) -> bool:  # tensors with a batch dimension, or the same non-tensor
        if all(isinstance(t, torch.Tensor) for t in parts):
            return all(t.dim() > 0 and (rows is None or t.shape[0] in rows[k]) for k, t in enumerate(parts))
        return all(not isinstance(t, torch.Tensor) and t == parts[0] for t in parts)

    if not all(s == spec for _, s in flat) or not all(joinable(parts) for parts in columns):
        return values
    joined = [torch.cat(parts, dim=0) if isinstance(parts[0], torch.Tensor) else parts[0] for parts in columns]
    return pytree.tree_unflatten(joined, spec)


def batch_rows(inputs: object, microbatches: int) -> list[set[int]] | None:
    """Each of ``microbatches`` micro-batches' rows (and rows x tokens flattened) as ``torch.chunk`` cuts the whole
    batch's first input tensor (``inputs``, the same on every rank): what :func:`joined_outputs` accepts as a batch
    dimension where outputs of other ranks (replicas) were gathered. None without such a tensor."""
    import torch.utils._pytree as pytree

    first = next((t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    parts = [] if first is None else torch.chunk(first, microbatches, dim=0)
    return part_rows(parts) if len(parts) == microbatches else None


def part_rows(parts: Sequence[torch.Tensor]) -> list[set[int]]:
    """Each micro-batch's (``parts``, of the first input) batch dimension as :func:`joined_outputs` takes it: its rows,
    or rows x tokens flattened."""
    return [{len(part), part.shape[:2].numel()} for part in parts]


def row_count_fix(rows: int, microbatches: int) -> str:
    """What to give where ``torch.chunk`` cuts ``rows`` into fewer than ``microbatches`` pieces: the next row count it
    cuts into that many (uneven micro-batches), or a multiple of them."""
    fits = next(n for n in range(rows, rows + microbatches + 1) if -(-n // -(-n // microbatches)) == microbatches)
    uneven = f"{fits} rows, uneven micro-batches, or " if fits % microbatches else ""
    return f"use a row count it cuts into {microbatches} ({uneven}a multiple of {microbatches})"


def signature(chunks: list[list[torch.Tensor]], targets: list[list[torch.Tensor]], training: bool) -> tuple:
    """The shapes and dtypes of a step's micro-batches, and whether it trains."""
    return (training, tuple(tuple((tuple(t.shape), t.dtype) for t in per) for per in chunks),
            tuple(tuple((tuple(t.shape), t.dtype) for t in per) for per in targets))
