"""Tensor parallelism in the cost model: collectives priced by a latency-bandwidth fit per kind on the
``"tp"`` mesh dimension, Megatron's formulas for a column->row transformer layer, and the cost table one
tensor-parallel rank sees (no torch here).

A Megatron layer (Shoeybi et al. 2019; Korthikanti et al. 2022) on ``t`` ranks: every linear layer's
weight, FLOPs and gradient are divided by ``t``; each row-parallel output is all-reduced in the forward
and each column-parallel input gradient in the backward, each over the ``(b, s, h)`` activation (the
layer's output bytes); of the ``34·s·b·h`` bytes of activations a layer keeps, ``10·s·b·h`` (norm and
column inputs, dropout masks) stay whole and ``24·s·b·h`` (and the attention scores) are divided.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeloom.errors import PipeloomError

__all__ = ["COLLECTIVES", "Collective", "CollectiveFit", "TensorInfo", "TensorParallelError", "collective_seconds",
           "fit_collectives", "layer_collectives", "tensor_from_json", "tensor_parallel_table", "tensor_to_json",
           "tp_sizes"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
"""Collective kinds priced; ``bytes`` is always the whole (unsharded) tensor's."""

KEPT_WHOLE = 10 / 34
"""Share of a layer's activation bytes that tensor parallelism does not divide (Korthikanti et al.)."""


class TensorParallelError(PipeloomError):
    """A tensor-parallel size or description that does not fit the model (heads, layers, fits)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective a piece runs per micro-batch."""

    kind: str
    """One of :data:`COLLECTIVES`."""
    phase: str
    """``"F"`` (forward) or ``"I"`` (the input-gradient backward) or ``"W"``."""
    bytes: float
    """The whole tensor's bytes (an all-gather's output, a reduce-scatter's input)."""

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise TensorParallelError(f"collective kind {self.kind!r} is not one of {', '.join(COLLECTIVES)}")
        if self.phase not in ("F", "I", "W"):
            raise TensorParallelError(f"collective phase must be F, I or W, got {self.phase!r}")


def _steps_and_share(kind: str, size: int) -> tuple[int, float]:
    """Ring messages per rank and the share of the tensor each rank moves: an all-reduce is a
    reduce-scatter then an all-gather, ``2(n-1)`` messages and ``2(n-1)/n`` of the bytes."""
    twice = 2 if kind == "all_reduce" else 1
    return twice * (size - 1), twice * (size - 1) / size


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveFit:
    """Seconds of a collective of ``S`` bytes over ``n`` ranks of one mesh dimension:
    ``overhead + steps(n)·latency + share(n)·S / bandwidth`` with the kind's latency and bandwidth."""

    latency: Mapping[str, float] = field(default_factory=dict)
    """Seconds per ring message, by kind (0 where absent)."""
    bandwidth: Mapping[str, float | None] = field(default_factory=dict)
    """Bytes per second on the link, by kind (None or absent: unlimited)."""
    overhead: Mapping[str, float] = field(default_factory=dict)
    """Seconds each collective of that kind costs whatever its size (launch, the DTensor redistribution)."""

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth", "overhead"):
            values = dict(getattr(self, name))
            for kind, value in values.items():
                if kind not in COLLECTIVES:
                    raise TensorParallelError(f"collective fit {name}: unknown kind {kind!r}; use "
                                              f"{', '.join(COLLECTIVES)}")
                if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)
                                          or value < 0 or (name == "bandwidth" and value == 0)):
                    raise TensorParallelError(f"collective fit {name}[{kind!r}] must be a number >= 0 (> 0 for a "
                                              f"bandwidth), got {value!r}")
            object.__setattr__(self, name, values)

    @classmethod
    def from_link(cls, latency: float, bandwidth: float | None) -> CollectiveFit:
        """Every kind on one point-to-point link (the table's), no overhead."""
        return cls(latency=dict.fromkeys(COLLECTIVES, latency), bandwidth=dict.fromkeys(COLLECTIVES, bandwidth))

    def seconds(self, kind: str, nbytes: float, size: int) -> float:
        if size <= 1 or nbytes <= 0:
            return 0.0
        steps, share = _steps_and_share(kind, size)
        bandwidth = self.bandwidth.get(kind)
        return (self.overhead.get(kind, 0.0) + steps * self.latency.get(kind, 0.0)
                + (0.0 if bandwidth is None else share * nbytes / bandwidth))


def collective_seconds(collectives: Sequence[Collective], fit: CollectiveFit, size: int, phase: str) -> float:
    """Seconds the ``phase`` collectives of one micro-batch take on ``size`` ranks (run one after the other)."""
    return sum(fit.seconds(c.kind, c.bytes, size) for c in collectives if c.phase == phase)


def fit_collectives(samples: Sequence[tuple[str, int, float, float]]) -> CollectiveFit:
    """Least-squares fit of ``(kind, ranks, bytes, seconds)`` measurements, per kind, of
    ``seconds = overhead + steps·latency + share·bytes / bandwidth`` (negative parts clamped to 0; the
    latency is only separable from the overhead when several group sizes were measured)."""
    latency, bandwidth, overhead = {}, {}, {}
    for kind in COLLECTIVES:
        rows = [(1.0, *_steps_and_share(kind, n)[:1], _steps_and_share(kind, n)[1] * b, t)
                for k, n, b, t in samples if k == kind and n > 1]
        if not rows:
            continue
        columns = [0, 2] if len({r[1] for r in rows}) == 1 else [0, 1, 2]
        solution = _least_squares([[r[c] for c in columns] for r in rows], [r[3] for r in rows])
        coef = dict(zip(columns, solution))
        overhead[kind] = max(coef[0], 0.0)
        latency[kind] = max(coef.get(1, 0.0), 0.0)
        bandwidth[kind] = 1.0 / coef[2] if coef[2] > 0 else None
    return CollectiveFit(latency=latency, bandwidth=bandwidth, overhead=overhead)


def _least_squares(a: list[list[float]], y: list[float]) -> list[float]:
    """The x minimising |a·x - y| (normal equations, Gaussian elimination; a tiny ridge keeps it solvable)."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) + (1e-30 if i == j else 0.0) for j in range(n)]
         + [sum(r[i] * v for r, v in zip(a, y))] for i in range(n)]
    for i in range(n):
        pivot = max(range(i, n), key=lambda k: abs(m[k][i]))
        m[i], m[pivot] = m[pivot], m[i]
        for k in range(n):
            if k != i and m[i][i]:
                factor = m[k][i] / m[i][i]
                m[k] = [u - factor * v for u, v in zip(m[k], m[i])]
    return [m[i][n] / m[i][i] if m[i][i] else 0.0 for i in range(n)]


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
    fit: CollectiveFit = CollectiveFit()
    """Collective prices on the ``"tp"`` dimension (empty: the table's link, no overhead)."""

    def __post_init__(self) -> None:
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise TensorParallelError(f"tensor.heads must be a positive integer, got {self.heads!r}")
        for name in ("layers", "column", "row"):
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) and v for v in values):
                raise TensorParallelError(f"tensor.{name} must be a list of names, got {values!r}")
            object.__setattr__(self, name, tuple(values))

    def recipe(self) -> dict:
        """The saved plan's ``tp_plan``: the built-in ``"megatron"`` recipe over every layer's modules."""
        return {"recipe": "megatron", "column": [f"{layer}.{m}" for layer in self.layers for m in self.column],
                "row": [f"{layer}.{m}" for layer in self.layers for m in self.row]}


def layer_collectives(info: TensorInfo, activation_bytes: float) -> tuple[Collective, ...]:
    """Megatron's collectives of one layer per micro-batch: an all-reduce of the ``(b, s, h)`` activation
    after each row-parallel module (forward) and of each column-parallel module's input gradient
    (backward, in I); with one prepared input per region that is 2 and 2 (Shoeybi et al.)."""
    rows = len(info.row) or 2
    columns = len(info.column) or 2
    return (tuple(Collective(kind="all_reduce", phase="F", bytes=activation_bytes) for _ in range(rows))
            + tuple(Collective(kind="all_reduce", phase="I", bytes=activation_bytes) for _ in range(columns)))


def tp_sizes(table, num_ranks: int, asked: Sequence[int] | None = None) -> list[int]:
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
            raise TensorParallelError(f"tensor-parallel size {t!r} does not divide {num_ranks} ranks")
        if t > 1 and (info is None or not info.layers):
            raise TensorParallelError(
                f"tensor-parallel size {t}: the cost table has no 'tensor' field (head count and the pieces that "
                "are transformer layers); add one (docs/format.md) or use analytical_gpt_costs")
        if t > 1 and info.heads % t:
            raise TensorParallelError(f"tensor-parallel size {t} does not divide the model's {info.heads} heads; "
                                      f"choose among {[d for d in range(1, info.heads + 1) if info.heads % d == 0]}")
    return sizes


def tensor_parallel_table(table, tp: int):
    """The cost table of one rank of a ``tp``-rank tensor-parallel group (Megatron's formulas, see the
    module doc): layer pieces' times divided by ``tp`` plus their collectives (forward all-reduces in
    ``f``, backward ones in ``i`` and ``b``), weights divided by ``tp``, activations by the Korthikanti
    split; other pieces whole. ``tp`` 1 returns ``table``."""
    if tp == 1:
        return table
    info = table.tensor
    tp_sizes(table, tp, [tp])
    fit = info.fit if info.fit.latency or info.fit.bandwidth or info.fit.overhead else \
        CollectiveFit.from_link(table.link.latency, table.link.bandwidth)
    layers = set(info.layers)
    unknown = layers - set(table.names)
    if unknown:
        raise TensorParallelError(f"tensor.layers names {sorted(unknown)}, which the table has no piece for")
    kept = KEPT_WHOLE + (1 - KEPT_WHOLE) / tp
    pieces = []
    for piece in table.pieces:
        if piece.name not in layers:
            pieces.append(piece)
            continue
        comms = layer_collectives(info, piece.output_bytes)
        forward, backward = (collective_seconds(comms, fit, tp, phase) for phase in ("F", "I"))
        pieces.append(dataclasses.replace(
            piece, f=piece.f / tp + forward, i=piece.i / tp + backward, w=piece.w / tp,
            measured_full_backward=None if piece.measured_full_backward is None
            else piece.measured_full_backward / tp + backward, param_bytes=piece.param_bytes / tp,
            activation_bytes=piece.activation_bytes * kept, w_activation_bytes=piece.w_activation_bytes * kept))
    return dataclasses.replace(table, pieces=tuple(pieces), device=f"{table.device} (tp {tp})".strip())


_TENSOR_KEYS = {"heads", "layers", "column", "row", "collectives"}
_FIT_KEYS = {"latency", "bandwidth", "overhead"}


def tensor_to_json(info: TensorInfo) -> dict:
    """The cost table's ``tensor`` object."""
    fit = info.fit
    kinds = sorted(set(fit.latency) | set(fit.bandwidth) | set(fit.overhead), key=COLLECTIVES.index)
    return {"heads": info.heads, "layers": list(info.layers), "column": list(info.column), "row": list(info.row),
            "collectives": {k: {"latency": fit.latency.get(k, 0.0), "bandwidth": fit.bandwidth.get(k),
                                "overhead": fit.overhead.get(k, 0.0)} for k in kinds}}


def tensor_from_json(entry: object) -> TensorInfo:
    """Read a cost table's ``tensor`` object: ``heads`` (required), ``layers``, ``column``, ``row`` (lists
    of names) and ``collectives`` ({kind: {latency, bandwidth, overhead}}, optional); unknown keys are errors."""
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
    for key in ("layers", "column", "row"):
        value = entry.get(key, [])
        if not isinstance(value, list):
            raise TensorParallelError(f"{key} must be a list of names, got {value!r}")
        lists[key] = tuple(value)
    return TensorInfo(heads=entry.get("heads"), fit=CollectiveFit(latency=latency, bandwidth=bandwidth,
                                                                   overhead=overhead), **lists)
