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
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeloom.errors import PipeloomError

if TYPE_CHECKING:
    from pipeloom.plan.costs import CostTable

__all__ = ["COLLECTIVES", "Collective", "CollectiveFit", "MeasuredPiece", "TensorInfo", "TensorParallelError",
           "TensorProfile", "collective_seconds", "fit_collectives", "fit_overhead", "layer_collectives",
           "tensor_from_json", "tensor_parallel_table", "tensor_to_json", "tp_sizes"]

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


def _seconds(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TensorParallelError(f"{what} must be a number of seconds >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredPiece:
    """One piece on one rank of a tensor-parallel group, measured inside the engine
    (:func:`pipeloom.plan.profile_in_engine` on a ``"tp"`` mesh); per micro-batch of the table's size."""

    name: str
    """The table's piece."""
    f: float
    """Forward seconds, its collectives included."""
    i: float
    """Input-gradient backward seconds, its collectives included."""
    w: float
    """Weight-gradient backward seconds."""
    full_backward: float | None = None
    """Full backward (B) seconds; None: not measured (priced ``i + w``)."""
    collectives: tuple[Collective, ...] = ()
    """The collectives it ran per micro-batch, as counted (a full backward's under phase ``I``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TensorParallelError(f"a measured piece needs a name, got {self.name!r}")
        for key in ("f", "i", "w"):
            object.__setattr__(self, key, _seconds(f"piece {self.name!r} {key}", getattr(self, key)))
        if self.full_backward is not None:
            object.__setattr__(self, "full_backward", _seconds(f"piece {self.name!r} full_backward",
                                                               self.full_backward))
        if not all(isinstance(c, Collective) for c in self.collectives):
            raise TensorParallelError(f"piece {self.name!r}: collectives must be Collective records")
        object.__setattr__(self, "collectives", tuple(self.collectives))


PROFILE_RUNTIME = ("action_overhead", "message_cost", "step_overhead", "time_spread")
"""The runtime corrections (:class:`pipeloom.plan.costs.RuntimeCorrections`) a tensor-parallel profile holds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorProfile:
    """What the engine measured with ``size`` tensor-parallel ranks per stage: every piece's times on one of
    them, and the runtime's costs around the pieces in those pipelines. The planner uses them, not Megatron's
    formulas, for this size (:func:`tensor_parallel_table`)."""

    size: int
    """Tensor-parallel ranks per stage it was measured on (>= 2)."""
    pieces: tuple[MeasuredPiece, ...]
    """Every piece of the table, in its order."""
    latency: float = 0.0
    """The link latency under load between pipeline ranks, measured in the same pipelines."""
    runtime: Mapping[str, float] = field(default_factory=dict)
    """The runtime corrections measured in the same pipelines, keyed by :data:`PROFILE_RUNTIME` (absent: the
    table's own)."""

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 2:
            raise TensorParallelError(f"a tensor-parallel profile's size must be an integer >= 2, got {self.size!r}")
        if isinstance(self.pieces, (str, MeasuredPiece)) or not all(isinstance(p, MeasuredPiece)
                                                                     for p in self.pieces):
            raise TensorParallelError("a tensor-parallel profile's pieces must be a list of MeasuredPiece")
        object.__setattr__(self, "pieces", tuple(self.pieces))
        object.__setattr__(self, "latency", _seconds("profile latency", self.latency))
        unknown = sorted(set(self.runtime) - set(PROFILE_RUNTIME))
        if unknown:
            raise TensorParallelError(f"profile runtime: unknown key(s) {unknown}; known: {list(PROFILE_RUNTIME)}")
        object.__setattr__(self, "runtime", {k: _seconds(f"profile runtime {k}", v) for k, v in self.runtime.items()})


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
    profiles: tuple[TensorProfile, ...] = ()
    """Measured tensor-parallel sizes (at most one each); a size without one is priced by the formulas."""

    def __post_init__(self) -> None:
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise TensorParallelError(f"tensor.heads must be a positive integer, got {self.heads!r}")
        for name in ("layers", "column", "row"):
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
            raise TensorParallelError(f"tensor-parallel size {t!r} does not divide {num_ranks} ranks")
        if t > 1 and (info is None or not info.layers):
            raise TensorParallelError(
                f"tensor-parallel size {t}: the cost table has no 'tensor' field (head count and the pieces that "
                "are transformer layers); add one (docs/format.md) or use analytical_gpt_costs")
        if t > 1 and info is not None and info.heads % t:
            raise TensorParallelError(f"tensor-parallel size {t} does not divide the model's {info.heads} heads; "
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
    if measured is not None:
        return _measured_table(table, measured, layers)
    fit = info.fit if info.fit.latency or info.fit.bandwidth or info.fit.overhead else \
        CollectiveFit.from_link(table.link.latency, table.link.bandwidth)
    kept = KEPT_WHOLE + (1 - KEPT_WHOLE) / tp
    pieces = []
    for piece in table.pieces:
        if piece.name not in layers:
            pieces.append(piece)
            continue
        counted = info.counted(piece.name)
        comms = counted if counted is not None else layer_collectives(info, piece.output_bytes)
        forward, backward, weight = (collective_seconds(comms, fit, tp, phase) for phase in ("F", "I", "W"))
        pieces.append(dataclasses.replace(
            piece, f=piece.f / tp + forward, i=piece.i / tp + backward, w=piece.w / tp + weight,
            measured_full_backward=None if piece.measured_full_backward is None
            else piece.measured_full_backward / tp + backward + weight, param_bytes=piece.param_bytes / tp,
            activation_bytes=piece.activation_bytes * kept, w_activation_bytes=piece.w_activation_bytes * kept))
    return dataclasses.replace(table, pieces=tuple(pieces), device=f"{table.device} (tp {tp})".strip())


def _measured_table(table: CostTable, profile: TensorProfile, layers: set[str]) -> CostTable:
    """``table`` for one rank of ``profile.size``: the measured times, latency and runtime corrections; bytes
    by Megatron's split (weights of layer pieces divided, activations by Korthikanti's share)."""
    tp = profile.size
    kept = KEPT_WHOLE + (1 - KEPT_WHOLE) / tp
    pieces = []
    for piece, timed in zip(table.pieces, profile.pieces):
        sharded = piece.name in layers
        pieces.append(dataclasses.replace(
            piece, f=timed.f, i=timed.i, w=timed.w, measured_full_backward=timed.full_backward,
            param_bytes=piece.param_bytes / tp if sharded else piece.param_bytes,
            activation_bytes=piece.activation_bytes * (kept if sharded else 1.0),
            w_activation_bytes=piece.w_activation_bytes * (kept if sharded else 1.0)))
    link = dataclasses.replace(table.link, latency=profile.latency)
    measured: dict[str, Any] = dict(profile.runtime)
    return dataclasses.replace(table, pieces=tuple(pieces), link=link,
                               runtime=dataclasses.replace(table.runtime, **measured),
                               device=f"{table.device} (tp {tp}, measured)".strip())


def fit_overhead(table: CostTable, profile: TensorProfile, fit: CollectiveFit) -> CollectiveFit:
    """``fit`` with the engine's own cost per collective added to each counted kind's overhead, for the sizes
    no profile measured: over the pieces that ran collectives and their F and I, the measured time less the
    one-rank time (``table``'s) divided by the size less the counted collectives priced by ``fit``, per
    collective; the median, at least 0. It holds what a bare collective does not: DTensor's redistribution,
    waiting for the slower peer, and the compute that does not divide by the size."""
    by_name = {p.name: p for p in table.pieces}
    samples = []
    kinds: set[str] = set()
    for timed in profile.pieces:
        whole = by_name.get(timed.name)
        if whole is None:
            raise TensorParallelError(f"the profile measures piece {timed.name!r}, which the table does not have")
        for phase, measured, alone in (("F", timed.f, whole.f), ("I", timed.i, whole.i)):
            comms = [c for c in timed.collectives if c.phase == phase]
            if comms:
                kinds.update(c.kind for c in comms)
                priced = collective_seconds(comms, fit, profile.size, phase)
                samples.append((measured - alone / profile.size - priced) / len(comms))
    if not samples:
        return fit
    extra = max(0.0, statistics.median(samples))
    overhead = {**fit.overhead, **{k: fit.overhead.get(k, 0.0) + extra for k in kinds}}
    return dataclasses.replace(fit, overhead=overhead)


# ------------------------------------------------------------------------------------------------ JSON

_TENSOR_KEYS = {"heads", "layers", "column", "row", "collectives", "profiled"}
_FIT_KEYS = {"latency", "bandwidth", "overhead"}
_PROFILE_KEYS = {"tp", "latency", "runtime", "pieces"}
_MEASURED_KEYS = {"name", "f", "i", "w", "measured_full_backward", "collectives"}
_COUNTED_KEYS = {"kind", "phase", "bytes", "count"}


def tensor_to_json(info: TensorInfo) -> dict:
    """The cost table's ``tensor`` object (``profiled`` only where a size was measured)."""
    fit = info.fit
    kinds = sorted(set(fit.latency) | set(fit.bandwidth) | set(fit.overhead), key=COLLECTIVES.index)
    document = {"heads": info.heads, "layers": list(info.layers), "column": list(info.column), "row": list(info.row),
                "collectives": {k: {"latency": fit.latency.get(k, 0.0), "bandwidth": fit.bandwidth.get(k),
                                    "overhead": fit.overhead.get(k, 0.0)} for k in kinds}}
    if info.profiles:
        document["profiled"] = [_profile_to_json(p) for p in info.profiles]
    return document


def _profile_to_json(profile: TensorProfile) -> dict:
    def counted(piece: MeasuredPiece) -> list[dict]:
        tally = Counter((c.kind, c.phase, c.bytes) for c in piece.collectives)
        return [{"kind": k, "phase": ph, "bytes": b, "count": n} for (k, ph, b), n in tally.items()]

    return {"tp": profile.size, "latency": profile.latency, "runtime": dict(profile.runtime),
            "pieces": [{"name": p.name, "f": p.f, "i": p.i, "w": p.w, "measured_full_backward": p.full_backward,
                        "collectives": counted(p)} for p in profile.pieces]}


def _object(entry: object, keys: set[str], where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise TensorParallelError(f"{where} must be an object with keys {sorted(keys)}, got {entry!r}")
    unknown = sorted(set(entry) - keys)
    if unknown:
        raise TensorParallelError(f"{where}: unknown key(s) {unknown}; known: {sorted(keys)}")
    return entry


def _profile_from_json(entry: object, k: int) -> TensorProfile:
    where = f"profiled[{k}]"
    entry = _object(entry, _PROFILE_KEYS, where)
    pieces = entry.get("pieces")
    if not isinstance(pieces, list):
        raise TensorParallelError(f"{where}.pieces must be a list of measured pieces, got {pieces!r}")
    measured = []
    for j, piece in enumerate(pieces):
        piece = _object(piece, _MEASURED_KEYS, f"{where}.pieces[{j}]")
        collectives: list[Collective] = []
        counted = piece.get("collectives", [])
        if not isinstance(counted, list):
            raise TensorParallelError(f"{where}.pieces[{j}].collectives must be a list, got {counted!r}")
        for c in counted:
            c = _object(c, _COUNTED_KEYS, f"{where}.pieces[{j}].collectives")
            count = c.get("count", 1)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise TensorParallelError(f"{where}.pieces[{j}].collectives: count must be a positive integer, "
                                          f"got {count!r}")
            nbytes = _seconds(f"{where}.pieces[{j}].collectives bytes", c.get("bytes"))
            kind: Any = c.get("kind")
            phase: Any = c.get("phase")
            collectives += [Collective(kind=kind, phase=phase, bytes=nbytes)] * count
        values: dict[str, Any] = {key: piece.get(key) for key in ("name", "f", "i", "w")}
        try:
            measured.append(MeasuredPiece(**values, full_backward=piece.get("measured_full_backward"),
                                          collectives=tuple(collectives)))
        except TensorParallelError as error:
            raise TensorParallelError(f"{where}.pieces[{j}]: {error}") from None
    runtime = entry.get("runtime", {})
    if not isinstance(runtime, dict):
        raise TensorParallelError(f"{where}.runtime must be an object, got {runtime!r}")
    size: Any = entry.get("tp")
    return TensorProfile(size=size, pieces=tuple(measured), latency=entry.get("latency", 0.0), runtime=runtime)


def tensor_from_json(entry: object) -> TensorInfo:
    """Read a cost table's ``tensor`` object: ``heads`` (required), ``layers``, ``column``, ``row`` (lists
    of names), ``collectives`` ({kind: {latency, bandwidth, overhead}}, optional) and ``profiled`` (optional:
    per measured size ``{"tp", "latency", "runtime", "pieces": [{"name", "f", "i", "w",
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
    for key in ("layers", "column", "row"):
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
                      profiles=tuple(_profile_from_json(p, k) for k, p in enumerate(profiled)), **lists)
