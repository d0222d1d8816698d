"""Measured tensor-parallel costs (no torch): a piece's times on one tensor-parallel rank and the profile of
one size (:class:`MeasuredPiece`, :class:`TensorProfile`, as ``profile_in_engine`` writes them), the table
they give, the engine's fitted cost per collective (:func:`fit_overhead`) and their ``profiled`` JSON."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeloom.plan.errors import TensorParallelError
from pipeloom.plan.tp.collectives import Collective, CollectiveFit, collective_seconds

if TYPE_CHECKING:
    from pipeloom.plan.costs.table import CostTable

__all__ = ["PROFILE_RUNTIME", "MeasuredPiece", "TensorProfile", "fit_overhead", "measured_table",
           "profile_from_json", "profile_to_json"]


def _seconds(what: str, value: object) -> float:
    """``value`` as seconds (or bytes) >= 0, else a TensorParallelError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TensorParallelError(f"{what} must be a number of seconds >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredPiece:
    """One piece on one rank of a tensor-parallel group, measured inside the engine
    (:func:`pipeloom.profile.in_engine.profile_in_engine` on a ``"tp"`` mesh); per micro-batch of the table's size."""

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
"""The runtime corrections (:class:`pipeloom.plan.costs.parts.RuntimeCorrections`) a tensor-parallel profile holds."""


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



def measured_table(table: CostTable, profile: TensorProfile) -> CostTable:
    """``table`` with ``profile``'s measured piece times, link latency and runtime corrections: one rank of
    ``profile.size`` (its pieces in the table's order). The bytes stay as they are: dividing them is
    Megatron's split (:func:`~pipeloom.plan.tp.megatron.tensor_parallel_table`)."""
    pieces = tuple(dataclasses.replace(piece, f=timed.f, i=timed.i, w=timed.w,
                                       measured_full_backward=timed.full_backward)
                   for piece, timed in zip(table.pieces, profile.pieces))
    link = dataclasses.replace(table.link, latency=profile.latency)
    measured: dict[str, Any] = dict(profile.runtime)
    return dataclasses.replace(table, pieces=pieces, link=link,
                               runtime=dataclasses.replace(table.runtime, **measured),
                               device=f"{table.device} (tp {profile.size}, measured)".strip())


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

_PROFILE_KEYS = {"tp", "latency", "runtime", "pieces"}
_MEASURED_KEYS = {"name", "f", "i", "w", "measured_full_backward", "collectives"}
_COUNTED_KEYS = {"kind", "phase", "bytes", "count"}


def profile_to_json(profile: TensorProfile) -> dict:
    """One entry of a cost table's ``tensor.profiled`` list: equal collectives of a piece written once with
    their ``count``."""
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


def profile_from_json(entry: object, k: int) -> TensorProfile:
    """Read entry ``k`` of ``tensor.profiled`` (:func:`profile_to_json`'s form; unknown keys are errors)."""
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
