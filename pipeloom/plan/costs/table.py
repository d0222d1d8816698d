"""A model's cost table (:class:`CostTable`: its pieces in call order for one micro-batch size, the
link, the runtime corrections) and the table for another micro-batch size (:func:`table_for_size`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeloom.errors import shown
from pipeloom.plan.costs.parts import (
    Link,
    Piece,
    RuntimeCorrections,
    SharedParam,
    check_number,
)
from pipeloom.plan.errors import CostTableError

if TYPE_CHECKING:
    from pipeloom.plan.tp.megatron import TensorInfo

__all__ = ["CostTable", "table_for_size"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CostTable:
    """The pieces of one model in call order, measured (or estimated) for one micro-batch size."""

    pieces: tuple[Piece, ...]
    """In call order; ``inputs`` name only earlier pieces (normalised: never None here)."""
    microbatch_size: int
    """Samples per micro-batch the times and activation/output bytes are for."""
    device: str = ""
    """Where the costs come from, e.g. ``cuda:0 (NVIDIA H100)``, ``cpu``, ``analytical``."""
    link: Link = Link()
    """Communication between ranks."""
    optimizer_factor: float = 2.0
    """Optimizer-state bytes per parameter byte (2 for Adam's two moments in the parameters' dtype).

    A rank holding a piece keeps ``param_bytes * (2 + optimizer_factor)``: weights, gradients, state."""
    source: str = "manual"
    """``profile``, ``analytical`` or ``manual``."""
    runtime: RuntimeCorrections = RuntimeCorrections()
    """What the runtime costs beyond the piece times, fitted by running it; the defaults mean none
    measured (a source that times pieces alone leaves them, and the planner adds nothing)."""
    shared: tuple[SharedParam, ...] = ()
    """Parameters several pieces use, each listed with its users (each counted once in ``param_bytes``);
    :mod:`pipeloom.plan.costs.shared` counts them on every rank holding a user and prices their gradients'
    combination after the step. Empty: no piece shares a parameter (or the table does not say)."""
    tensor: TensorInfo | None = None
    """What tensor parallelism needs (:class:`pipeloom.plan.tp.megatron.TensorInfo`: head count, the pieces that
    are transformer layers, their column/row modules, collective prices); None: the planner tries tp 1 only."""

    def __post_init__(self) -> None:
        pieces = tuple(self.pieces)
        if not pieces:
            raise CostTableError("the cost table has no pieces; give at least one")
        if isinstance(self.microbatch_size, bool) or not isinstance(self.microbatch_size, int) \
                or self.microbatch_size < 1:
            raise CostTableError(f"microbatch_size must be a positive integer, got {shown(self.microbatch_size)}")
        object.__setattr__(self, "optimizer_factor", check_number("optimizer_factor", self.optimizer_factor))
        if not isinstance(self.runtime, RuntimeCorrections):
            raise CostTableError(f"runtime is {type(self.runtime).__name__}, expected a RuntimeCorrections")
        seen: dict[str, int] = {}
        normal = []
        for k, piece in enumerate(pieces):
            if not isinstance(piece, Piece):
                raise CostTableError(f"pieces[{k}] is {type(piece).__name__}, expected a Piece")
            if piece.name in seen:
                raise CostTableError(f"piece name {piece.name!r} appears twice; names must be unique")
            inputs = piece.inputs if piece.inputs is not None else ((pieces[k - 1].name,) if k else ())
            for name in inputs:
                if name not in seen:
                    later = ("itself" if name == piece.name else "a later piece" if any(p.name == name for p in pieces)
                             else "no piece of the table")
                    raise CostTableError(
                        f"piece {piece.name!r} reads from {name!r}, which is {later}; list pieces in call "
                        f"order and name only earlier pieces in inputs"
                    )
            seen[piece.name] = k
            normal.append(piece if piece.inputs == inputs else dataclasses.replace(piece, inputs=inputs))
        object.__setattr__(self, "pieces", tuple(normal))
        object.__setattr__(self, "shared", _checked_shared(self.shared, seen))
        if self.tensor is not None:
            from pipeloom.plan.tp.megatron import TensorInfo

            if not isinstance(self.tensor, TensorInfo):
                raise CostTableError(f"tensor is {type(self.tensor).__name__}, expected a TensorInfo or None")
            unknown = [name for name in self.tensor.layers if name not in seen]
            if unknown:
                raise CostTableError(f"tensor.layers names {unknown}, which the table has no piece for; name pieces")

    @property
    def names(self) -> tuple[str, ...]:
        """Piece names in call order."""
        return tuple(piece.name for piece in self.pieces)

    @property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """``(producer, consumer)`` piece indices, producer < consumer."""
        index = {name: k for k, name in enumerate(self.names)}
        return tuple((index[name], k) for k, piece in enumerate(self.pieces) for name in piece.inputs or ())

    @property
    def is_chain(self) -> bool:
        """True when every piece reads exactly the one before it (and the first reads the model inputs)."""
        return all(piece.inputs == ((self.pieces[k - 1].name,) if k else ()) for k, piece in enumerate(self.pieces))

    def static_bytes(self, piece: Piece) -> float:
        """Bytes a rank holds for ``piece`` whatever runs: weights, gradients and optimizer state."""
        return piece.param_bytes * (2.0 + self.optimizer_factor)

    def scaled(self, microbatch_size: int) -> CostTable:
        """The table for another micro-batch size, assuming every cost is linear in the size.

        Times, activation and output bytes scale by ``microbatch_size / self.microbatch_size``;
        parameter bytes do not. (Real kernels have a fixed part, so small sizes cost more than this.)
        """
        if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
            raise CostTableError(f"microbatch_size must be a positive integer, got {shown(microbatch_size)}")
        if microbatch_size == self.microbatch_size:
            return self
        factor = microbatch_size / self.microbatch_size
        largest = max((max(p.f, p.i, p.w, p.measured_full_backward or 0.0, p.activation_bytes, p.w_activation_bytes,
                            p.output_bytes) for p in self.pieces), default=0.0)
        if not math.isfinite(largest * factor):
            raise CostTableError(f"a piece's costs times {factor:g} (micro-batches of {microbatch_size} sequences "
                                 f"against the table's {self.microbatch_size}) pass a float's range: its costs are "
                                 f"up to {largest:.3g}; check the table's units")
        pieces = tuple(
            dataclasses.replace(
                piece, f=piece.f * factor, i=piece.i * factor, w=piece.w * factor,
                measured_full_backward=None if piece.measured_full_backward is None
                else piece.measured_full_backward * factor,
                activation_bytes=piece.activation_bytes * factor,
                w_activation_bytes=piece.w_activation_bytes * factor,
                output_bytes=piece.output_bytes * factor,
            )
            for piece in self.pieces
        )
        return dataclasses.replace(self, pieces=pieces, microbatch_size=microbatch_size)


def _checked_shared(shared: Sequence[SharedParam], order: dict[str, int]) -> tuple[SharedParam, ...]:
    """``shared`` as a tuple, each naming known pieces, listed in call order."""
    if isinstance(shared, (str, SharedParam)):
        raise CostTableError("shared must be a list of SharedParam")
    checked = []
    for k, entry in enumerate(shared):
        if not isinstance(entry, SharedParam):
            raise CostTableError(f"shared[{k}] is {type(entry).__name__}, expected a SharedParam")
        unknown = [name for name in entry.pieces if name not in order]
        if unknown:
            raise CostTableError(f"shared parameter {entry.name!r} names piece(s) {unknown}, which the table does "
                                 f"not have; name pieces of the table")
        in_order = tuple(sorted(entry.pieces, key=order.__getitem__))
        checked.append(entry if in_order == entry.pieces else dataclasses.replace(entry, pieces=in_order))
    return tuple(checked)


def _one_per_size(tables: CostTable | Sequence[CostTable]) -> list[CostTable]:
    """``tables`` as a list, checked: at least one, the same pieces in each, one table per micro-batch size."""
    tables = [tables] if isinstance(tables, CostTable) else list(tables)
    if not tables:
        raise CostTableError("give at least one cost table")
    first = tables[0]
    for other in tables[1:]:
        if [(p.name, p.inputs) for p in other.pieces] != [(p.name, p.inputs) for p in first.pieces]:
            raise CostTableError(
                f"the cost tables for micro-batch sizes {first.microbatch_size} and {other.microbatch_size} list "
                f"different pieces; profile the same model with the same pieces at every size"
            )
    sizes = [table.microbatch_size for table in tables]
    twice = sorted({size for size in sizes if sizes.count(size) > 1})
    if twice:
        raise CostTableError(
            f"two cost tables are for micro-batch size {twice[0]}; give one table per size (each "
            f"`pipeloom profile --batch N` run measures one size)"
        )
    return tables


def table_for_size(tables: CostTable | Sequence[CostTable], microbatch_size: int) -> CostTable:
    """The cost table for ``microbatch_size`` from tables measured at one or more sizes.

    A measured size is used as it is; between two measured sizes every time and byte count is
    interpolated linearly (an affine model, fixed costs included, between the two); below the
    smallest or above the largest the nearest table is scaled in proportion (:meth:`CostTable.scaled`).
    The tables must list the same pieces (same names and inputs); the first one's device, link,
    optimizer factor and runtime step overhead are kept, and the first runtime ``replica_link`` any of
    them has. The runtime's action overhead, message cost, time spread and start skew, fitted with each
    table's pieces, are interpolated with them. A measured full backward missing from one of two tables
    is taken as its ``i + w``.
    """
    tables = _one_per_size(tables)
    first = tables[0]
    by_size = {table.microbatch_size: table for table in tables}
    replica_link = next((t.runtime.replica_link for t in tables if t.runtime.replica_link is not None), None)

    def linked(table: CostTable) -> CostTable:
        """``table``, given the replica link another table measured where it has none."""
        if table.runtime.replica_link is not None or replica_link is None:
            return table
        runtime = dataclasses.replace(table.runtime, replica_link=replica_link)
        return dataclasses.replace(table, runtime=runtime)

    if microbatch_size in by_size:
        return linked(by_size[microbatch_size])
    below = [size for size in by_size if size < microbatch_size]
    above = [size for size in by_size if size > microbatch_size]
    if not below or not above:
        return linked(by_size[max(below) if below else min(above)].scaled(microbatch_size))
    low, high = by_size[max(below)], by_size[min(above)]
    share = (microbatch_size - low.microbatch_size) / (high.microbatch_size - low.microbatch_size)

    def between(a: object, b: object, key: str) -> float:
        return getattr(a, key) + share * (getattr(b, key) - getattr(a, key))

    pieces = tuple(
        dataclasses.replace(
            a, f=between(a, b, "f"), i=between(a, b, "i"), w=between(a, b, "w"),
            measured_full_backward=None if a.measured_full_backward is None
            and b.measured_full_backward is None else between(a, b, "full_backward"),
            activation_bytes=between(a, b, "activation_bytes"),
            w_activation_bytes=between(a, b, "w_activation_bytes"),
            output_bytes=between(a, b, "output_bytes"),
        )
        for a, b in zip(low.pieces, high.pieces)
    )
    runtime = dataclasses.replace(
        first.runtime, replica_link=replica_link,
        **{key: between(low.runtime, high.runtime, key)
           for key in ("action_overhead", "message_cost", "time_spread", "start_skew")})
    return dataclasses.replace(first, pieces=pieces, microbatch_size=microbatch_size, runtime=runtime)
