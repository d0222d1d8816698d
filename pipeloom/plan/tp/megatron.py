"""Tensor parallelism in the cost model: collectives priced by a latency-bandwidth fit per kind on the
``"tp"`` mesh dimension, Megatron's formulas for a column->row transformer layer, and the cost table one
tensor-parallel rank sees (no torch here).

A Megatron layer (Shoeybi et al. 2019; Korthikanti et al. 2022) on ``t`` ranks: every linear layer's
weight, FLOPs and gradient are divided by ``t``; each row-parallel output is all-reduced in the forward
and each column-parallel input gradient in the backward, each over the ``(b, s, h)`` activation (the
layer's output bytes); of the ``34·s·b·h`` bytes of activations a layer keeps, ``10·s·b·h`` (norm and
column inputs, dropout masks) stay whole and ``24·s·b·h`` (and the attention scores) are divided.

The collectives' records and prices are :mod:`pipeloom.plan.tp.collectives`, the measured sizes
:mod:`pipeloom.plan.tp.measured`; their names import from here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeloom.plan.errors import TensorParallelError, TensorParallelSizeError
from pipeloom.plan.tp.collectives import COLLECTIVES, Collective, CollectiveFit, collective_seconds
from pipeloom.plan.tp.measured import (
    TensorProfile,
    measured_table,
    profile_from_json,
    profile_to_json,
)

if TYPE_CHECKING:
    from pipeloom.plan.costs.parts import Piece
    from pipeloom.plan.costs.table import CostTable

__all__ = ["TensorInfo", "layer_collectives", "tensor_from_json", "tensor_parallel_table", "tensor_to_json", "tp_sizes"]

KEPT_WHOLE = 10 / 34
"""Share of a layer's activation bytes that tensor parallelism does not divide (Korthikanti et al.)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    """What a cost table knows about tensor parallelism (its optional ``tensor`` field)."""

    heads: int
    """Attention heads per layer: the tensor-parallel size must divide them."""
    layers: tuple[str, ...] = ()
    """Pieces that are Megatron transformer layers (sharded column->row); the others stay whole."""
    column: tuple[str, ...] = ()
    """Module names inside a layer made column-parallel (e.g. ``attn.qkv``, ``mlp.0``)."""
    row: tuple[str, ...] = ()
    """Module names inside a layer made row-parallel (e.g. ``attn.proj``, ``mlp.2``)."""
    head_norm: tuple[str, ...] = ()
    """Module names inside a layer that normalize each head of what the columns split (Qwen3's
    ``self_attn.q_norm``, ``self_attn.k_norm``): their weights' gradients are summed over the tp ranks."""
    fit: CollectiveFit = CollectiveFit()
    """Collective prices on the ``"tp"`` dimension (empty: the table's link, no overhead)."""
    profiles: tuple[TensorProfile, ...] = ()
    """Measured tensor-parallel sizes (at most one each); a size without one is priced by the formulas."""

    def __post_init__(self) -> None:
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise TensorParallelError(f"tensor.heads must be a positive integer, got {self.heads!r}")
        for name in ("layers", "column", "row", "head_norm"):
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) and v for v in values):
                raise TensorParallelError(f"tensor.{name} must be a list of names, got {values!r}")
            object.__setattr__(self, name, tuple(values))
        if not isinstance(self.fit, CollectiveFit):
            raise TensorParallelError(f"tensor.fit is {type(self.fit).__name__}, expected a CollectiveFit")
        profiles = tuple(self.profiles)
        if not all(isinstance(p, TensorProfile) for p in profiles):
            raise TensorParallelError("tensor.profiles must be a list of TensorProfile")
        sizes = [p.size for p in profiles]
        if len(set(sizes)) != len(sizes):
            raise TensorParallelError(f"tensor.profiles measures a size twice ({sorted(sizes)}); keep one per size")
        object.__setattr__(self, "profiles", profiles)

    def profile(self, size: int) -> TensorProfile | None:
        """The measured profile of ``size`` tensor-parallel ranks, if any."""
        return next((p for p in self.profiles if p.size == size), None)

    def counted(self, name: str) -> tuple[Collective, ...] | None:
        """The collectives piece ``name`` was counted running per micro-batch (any profile: the kinds and the
        whole-tensor bytes do not depend on the size), or None where no profile measured it."""
        for profile in self.profiles:
            for piece in profile.pieces:
                if piece.name == name:
                    return piece.collectives
        return None

    def recipe(self) -> dict:
        """The saved plan's ``tp_plan``: the built-in ``"megatron"`` recipe over every layer's modules."""
        recipe = {"recipe": "megatron", "column": [f"{layer}.{m}" for layer in self.layers for m in self.column],
                  "row": [f"{layer}.{m}" for layer in self.layers for m in self.row]}
        if self.head_norm:
            recipe["head_norm"] = [f"{layer}.{m}" for layer in self.layers for m in self.head_norm]
        return recipe


def layer_collectives(info: TensorInfo, activation_bytes: float) -> tuple[Collective, ...]:
    """Megatron's collectives of one layer per micro-batch: an all-reduce of the ``(b, s, h)`` activation
    after each row-parallel module (forward) and of each column-parallel module's input gradient
    (backward, in I); with one prepared input per region that is 2 and 2 (Shoeybi et al.)."""
    rows = len(info.row) or 2
    columns = len(info.column) or 2
    return (tuple(Collective(kind="all_reduce", phase="F", bytes=activation_bytes) for _ in range(rows))
            + tuple(Collective(kind="all_reduce", phase="I", bytes=activation_bytes) for _ in range(columns)))


def tp_sizes(table: CostTable, num_ranks: int, asked: Sequence[int] | None = None) -> list[int]:
    """The tensor-parallel sizes to try: those asked (each checked), else every divisor of ``num_ranks``
    dividing the table's head count (just 1 for a table that knows no heads)."""
    info = getattr(table, "tensor", None)
    if asked is None:
        if info is None or not info.layers:
            return [1]
        return [t for t in range(1, num_ranks + 1) if num_ranks % t == 0 and info.heads % t == 0]
    sizes = sorted(set(asked))
    for t in sizes:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1 or num_ranks % t:
            raise TensorParallelSizeError(f"tensor-parallel size {t!r} does not divide {num_ranks} ranks")
        if t > 1 and (info is None or not info.layers):
            raise TensorParallelError(
                f"tensor-parallel size {t}: the cost table has no 'tensor' field (head count and the pieces that "
                "are transformer layers); add one (docs/format.md) or use analytical_gpt_costs")
        if t > 1 and info is not None and info.heads % t:
            raise TensorParallelSizeError(f"tensor-parallel size {t} does not divide the model's {info.heads} heads; "
                                      f"choose among {[d for d in range(1, info.heads + 1) if info.heads % d == 0]}")
    return sizes


def tensor_parallel_table(table: CostTable, tp: int) -> CostTable:
    """The cost table of one rank of a ``tp``-rank tensor-parallel group. Where the table's ``tensor`` field
    holds a profile measured with ``tp`` ranks, its piece times, link latency and runtime corrections (the
    bytes still by the formulas below). Otherwise Megatron's formulas (see the module doc): layer pieces'
    times divided by ``tp`` plus their collectives (forward ones in ``f``, backward ones in ``i`` and ``b``;
    the collectives counted by any profile where there is one, else :func:`layer_collectives`) priced by the
    fit. Weights are divided by ``tp``, activations by the Korthikanti split; other pieces whole. ``tp`` 1
    returns ``table``."""
    if tp == 1:
        return table
    info = table.tensor
    tp_sizes(table, tp, [tp])
    assert info is not None  # tp_sizes refuses tp > 1 without one
    layers = set(info.layers)
    unknown = layers - set(table.names)
    if unknown:
        raise TensorParallelError(f"tensor.layers names {sorted(unknown)}, which the table has no piece for")
    for profile in info.profiles:
        if tuple(p.name for p in profile.pieces) != table.names:
            names = [p.name for p in profile.pieces]
            raise TensorParallelError(f"the tp {profile.size} profile measures pieces {names}, not the table's "
                                      f"{list(table.names)}; profile the same pieces")
    measured = info.profile(tp)
    if measured is not None:  # the measured times; the bytes by the split below
        timed = measured_table(table, measured)
        return dataclasses.replace(timed, pieces=tuple(_sharded(p, tp) if p.name in layers else p
                                                       for p in timed.pieces))
    fit = info.fit if info.fit.latency or info.fit.bandwidth or info.fit.overhead else \
        CollectiveFit.from_link(table.link.latency, table.link.bandwidth)
    pieces = []
    for piece in table.pieces:
        if piece.name not in layers:
            pieces.append(piece)
            continue
        counted = info.counted(piece.name)
        comms = counted if counted is not None else layer_collectives(info, piece.output_bytes)
        forward, backward, weight = (collective_seconds(comms, fit, tp, phase) for phase in ("F", "I", "W"))
        pieces.append(_sharded(dataclasses.replace(
            piece, f=piece.f / tp + forward, i=piece.i / tp + backward, w=piece.w / tp + weight,
            measured_full_backward=None if piece.measured_full_backward is None
            else piece.measured_full_backward / tp + backward + weight), tp))
    return dataclasses.replace(table, pieces=tuple(pieces), device=f"{table.device} (tp {tp})".strip())


def _sharded(piece: Piece, tp: int) -> Piece:
    """A layer piece's bytes on one of ``tp`` ranks: its weights divided by ``tp``, its activations by
    Korthikanti's split (:data:`KEPT_WHOLE` of them whole, the rest divided)."""
    kept = KEPT_WHOLE + (1 - KEPT_WHOLE) / tp
    return dataclasses.replace(piece, param_bytes=piece.param_bytes / tp,
                               activation_bytes=piece.activation_bytes * kept,
                               w_activation_bytes=piece.w_activation_bytes * kept)


# ------------------------------------------------------------------------------------------------ JSON

_TENSOR_KEYS = {"heads", "layers", "column", "row", "head_norm", "collectives", "profiled"}
_FIT_KEYS = {"latency", "bandwidth", "overhead"}


def tensor_to_json(info: TensorInfo) -> dict:
    """The cost table's ``tensor`` object (``head_norm`` only where given, ``profiled`` only where a size was
    measured)."""
    fit = info.fit
    kinds = sorted(set(fit.latency) | set(fit.bandwidth) | set(fit.overhead), key=COLLECTIVES.index)
    document = {"heads": info.heads, "layers": list(info.layers), "column": list(info.column), "row": list(info.row),
                "collectives": {k: {"latency": fit.latency.get(k, 0.0), "bandwidth": fit.bandwidth.get(k),
                                    "overhead": fit.overhead.get(k, 0.0)} for k in kinds}}
    if info.head_norm:
        document["head_norm"] = list(info.head_norm)
    if info.profiles:
        document["profiled"] = [profile_to_json(p) for p in info.profiles]
    return document


def tensor_from_json(entry: object) -> TensorInfo:
    """Read a cost table's ``tensor`` object: ``heads`` (required), ``layers``, ``column``, ``row``, ``head_norm``
    (lists of names; ``head_norm`` optional), ``collectives`` ({kind: {latency, bandwidth, overhead}}, optional) and
    ``profiled`` (optional: per measured size ``{"tp", "latency", "runtime", "pieces": [{"name", "f", "i", "w",
    "measured_full_backward", "collectives": [{"kind", "phase", "bytes", "count"}]}]}``); unknown keys are
    errors."""
    if not isinstance(entry, dict):
        raise TensorParallelError(f"expected an object with heads, layers, column, row, got {entry!r}")
    unknown = sorted(set(entry) - _TENSOR_KEYS)
    if unknown:
        raise TensorParallelError(f"unknown key(s) {unknown}; known: {sorted(_TENSOR_KEYS)}")
    collectives = entry.get("collectives") or {}
    if not isinstance(collectives, dict):
        raise TensorParallelError("collectives must be an object {kind: {latency, bandwidth, overhead}}")
    latency, bandwidth, overhead = {}, {}, {}
    for kind, values in collectives.items():
        if not isinstance(values, dict) or set(values) - _FIT_KEYS:
            raise TensorParallelError(f"collectives.{kind} must be an object with keys {sorted(_FIT_KEYS)}")
        latency[kind] = values.get("latency", 0.0)
        bandwidth[kind] = values.get("bandwidth")
        overhead[kind] = values.get("overhead", 0.0)
    lists = {}
    for key in ("layers", "column", "row", "head_norm"):
        value = entry.get(key, [])
        if not isinstance(value, list):
            raise TensorParallelError(f"{key} must be a list of names, got {value!r}")
        lists[key] = tuple(value)
    profiled = entry.get("profiled", [])
    if not isinstance(profiled, list):
        raise TensorParallelError(f"profiled must be a list of measured sizes, got {profiled!r}")
    heads: Any = entry.get("heads")
    return TensorInfo(heads=heads, fit=CollectiveFit(latency=latency, bandwidth=bandwidth,
                                                                   overhead=overhead),
                      profiles=tuple(profile_from_json(p, k) for k, p in enumerate(profiled)), **lists)
