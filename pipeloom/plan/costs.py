"""Cost tables: per-piece times and bytes of a model, the link between ranks, the runtime's fitted
corrections, and the ``pipeloom.costs/2`` JSON form users can read and edit (``/1`` files still load;
no torch here).

A *piece* is a part of the model the runtime can cut at: its name is a module name that
``pipeloom.runtime.split_model`` accepts as a split point (e.g. ``blocks.3``). Pieces are listed in
call order; each names the pieces whose outputs it reads (``inputs``), so they form a DAG, normally
a chain.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeloom.errors import PipeloomError
from pipeloom.formatting import format_bytes
from pipeloom.ir.core import shown
from pipeloom.ir.jsonfields import check_keys, integer, json_object, number, read_json_file, string, strings

if TYPE_CHECKING:
    from pipeloom.plan.tensor import TensorInfo

__all__ = [
    "COSTS_FORMAT",
    "COSTS_FORMAT_V1",
    "CostTable",
    "CostTableError",
    "Link",
    "Piece",
    "RuntimeCorrections",
    "SharedParam",
    "costs_from_json",
    "costs_to_json",
    "format_bytes",
    "load_costs",
    "parse_bytes",
    "save_costs",
    "table_for_size",
]

COSTS_FORMAT = "pipeloom.costs/2"
"""The format :func:`save_costs` writes: runtime corrections in their own ``runtime`` section."""
COSTS_FORMAT_V1 = "pipeloom.costs/1"
"""The first format, still read: runtime corrections as top-level keys, a piece's full backward as ``b``."""


class CostTableError(PipeloomError):
    """A cost table or its file is malformed (unknown key, bad number, unknown piece name...)."""


def _check(what: str, value: object, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CostTableError(f"{what} must be a finite number, got {shown(value)}")
    if value < minimum:
        raise CostTableError(f"{what} must be >= {minimum:g}, got {value!r}")
    return float(value)


def _old_keywords(fold: Callable[[dict], dict]) -> Callable[[type], type]:
    """Let a dataclass's constructor (and so ``dataclasses.replace``) also take the keyword names of
    ``pipeloom.costs/1``'s Python API, rewritten to the current fields by ``fold``."""

    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: object, **kwargs: object) -> None:
            init(self, **fold(kwargs))

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return decorate


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """Communication between two ranks: ``time(bytes) = latency + bytes / bandwidth``."""

    latency: float = 0.0
    """Seconds per message."""
    bandwidth: float | None = None
    """Bytes per second; None means unlimited (only the latency counts)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency", _check("link latency", self.latency))
        if self.bandwidth is not None:
            bandwidth = _check("link bandwidth", self.bandwidth)
            if bandwidth <= 0:
                raise CostTableError("link bandwidth must be > 0 bytes/s (or None for unlimited)")
            object.__setattr__(self, "bandwidth", bandwidth)

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` (0 when there is nothing to send)."""
        if nbytes <= 0:
            return 0.0
        return self.latency + (0.0 if self.bandwidth is None else nbytes / self.bandwidth)


def _piece_keywords(kwargs: dict) -> dict:
    """``b`` (the first name of :attr:`Piece.measured_full_backward`) replaces it when given."""
    if "b" in kwargs:
        value = kwargs.pop("b")
        where = f"piece {kwargs.get('name')!r} b"
        kwargs["measured_full_backward"] = None if value is None else _check(where, value)
    return kwargs


@_old_keywords(_piece_keywords)
@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """One cuttable part of the model; times are per micro-batch of the table's ``microbatch_size``."""

    name: str
    """A module name the runtime accepts as a split point, e.g. ``blocks.3``."""
    f: float
    """Forward seconds."""
    i: float
    """Input-gradient backward seconds (zero-bubble I: ``pipeloom.runtime.backward.backward_input``)."""
    w: float
    """Weight-gradient backward seconds (zero-bubble W: the ``weight()`` that I leaves pending). Where a
    stage's inputs are only model inputs (which carry no gradient), the engine's I computes nothing and W
    does the whole backward: the planner then counts the stage's ``i`` as W (:func:`pipeloom.plan.recost`)."""
    measured_full_backward: float | None = None
    """Full backward seconds (input and weight gradients in one ``autograd.backward``, as the engine runs a
    ``B``: ``pipeloom.runtime.backward.backward_full``); None means not measured, priced ``i + w``
    (:attr:`full_backward`). One backward pass is usually cheaper than the split's two. (Called ``b``
    in ``pipeloom.costs/1``; ``Piece(b=...)`` and :attr:`b` still work. In :class:`pipeloom.problem.Costs`
    and ``Stage``, ``b`` is the input-gradient time, this table's ``i``.)"""
    activation_bytes: float = 0.0
    """Bytes the forward keeps for the backward (saved tensors), released by the backward."""
    w_activation_bytes: float = 0.0
    """Part of ``activation_bytes`` still needed by W after I (e.g. the inputs of linear layers)."""
    param_bytes: float = 0.0
    """Bytes of the piece's parameters. A parameter several pieces use (a tied embedding and LM head) is
    counted once, in the first of them; :attr:`CostTable.shared` lists it with all its users."""
    output_bytes: float = 0.0
    """Bytes of the values the piece passes on (sent when a stage boundary follows it)."""
    inputs: tuple[str, ...] | None = None
    """Pieces whose outputs it reads; None means the piece before it (a chain), () the model inputs only."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise CostTableError(f"a piece name must be a non-empty string, got {shown(self.name)}")
        for key in ("f", "i", "w", "activation_bytes", "w_activation_bytes", "param_bytes", "output_bytes"):
            object.__setattr__(self, key, _check(f"piece {self.name!r} {key}", getattr(self, key)))
        if self.measured_full_backward is not None:
            object.__setattr__(self, "measured_full_backward", _check(
                f"piece {self.name!r} measured_full_backward", self.measured_full_backward))
        if self.w_activation_bytes > self.activation_bytes:
            raise CostTableError(
                f"piece {self.name!r}: w_activation_bytes {self.w_activation_bytes:g} exceeds activation_bytes "
                f"{self.activation_bytes:g}; W can only keep part of what the forward saved"
            )
        if self.inputs is not None:
            if isinstance(self.inputs, str) or not all(isinstance(n, str) for n in self.inputs):
                raise CostTableError(f"piece {self.name!r}: inputs must be a list of piece names")
            object.__setattr__(self, "inputs", tuple(dict.fromkeys(self.inputs)))

    @property
    def time(self) -> float:
        """``f + i + w``: the piece's compute per micro-batch."""
        return self.f + self.i + self.w

    @property
    def full_backward(self) -> float:
        """Seconds of a full backward B: :attr:`measured_full_backward` where measured, else ``i + w``."""
        return self.i + self.w if self.measured_full_backward is None else self.measured_full_backward

    @property
    def b(self) -> float | None:
        """``pipeloom.costs/1``'s name of :attr:`measured_full_backward` (read it there)."""
        return self.measured_full_backward


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedParam:
    """A parameter several pieces use (a tied embedding and LM head): every rank holding one of those
    pieces keeps it, and their gradients are combined after the step (:mod:`pipeloom.plan.shared`)."""

    name: str
    """The parameter's name in the model, for messages (e.g. ``transformer.wte.weight``)."""
    bytes: float
    """Its bytes (counted once in the ``param_bytes`` of its first user, ``pieces[0]``)."""
    pieces: tuple[str, ...]
    """The pieces using it, in call order (two or more)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise CostTableError(f"a shared parameter's name must be a string, got {shown(self.name)}")
        object.__setattr__(self, "bytes", _check(f"shared parameter {self.name!r} bytes", self.bytes))
        if isinstance(self.pieces, str) or not all(isinstance(n, str) for n in self.pieces):
            raise CostTableError(f"shared parameter {self.name!r}: pieces must be a list of piece names")
        object.__setattr__(self, "pieces", tuple(dict.fromkeys(self.pieces)))
        if len(self.pieces) < 2:
            raise CostTableError(f"shared parameter {self.name!r} names {len(self.pieces)} piece(s); a shared "
                                 "parameter is used by two or more pieces (leave one-piece parameters out)")


_RUNTIME_FIELDS = ("action_overhead", "message_cost", "step_overhead", "time_spread", "start_skew",
                   "replica_link")
"""The fields of :class:`RuntimeCorrections`: top-level keys and keywords of a ``pipeloom.costs/1`` table."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeCorrections:
    """What a runtime costs beyond the pieces' own times: per action, per message, per step, how much
    times vary, and the replica-gradient exchange. All are fitted by running the engine
    (:func:`pipeloom.plan.profile_in_engine`); every default means "none measured", so a cost source
    that times the pieces alone (:func:`pipeloom.plan.profile_model`,
    :func:`pipeloom.plan.analytical_gpt_costs`, a hand-written table) owes nothing here. None of them
    scales with the micro-batch size."""

    action_overhead: float = 0.0
    """Seconds the runtime spends per action beyond the piece times (dispatch, bookkeeping; its
    messages are :attr:`message_cost`); the simulator adds it to every task (F, B, I and W alike).
    Not scaled with the micro-batch size."""
    message_cost: float = 0.0
    """Seconds an action spends per message to or from another rank: posting the send, or the
    receive ahead of the action that needs it (the runtime's own work, and on a busy machine the
    transport's stalls). :func:`~pipeloom.plan.recost` adds it to a stage's F and its B or I once
    per edge of the stage that crosses ranks: the piece times themselves hold no messages. Not
    scaled with the micro-batch size. Measured by :func:`pipeloom.plan.profile_in_engine`."""
    step_overhead: float = 0.0
    """Seconds the runtime spends once per step outside the actions (the step's preamble, the loss
    all-reduce, waiting for the last sends); added to every predicted step time. Not scaled with the
    micro-batch size."""
    time_spread: float = 0.0
    """How much one action's time varies around its piece's between micro-batches and steps: the
    coefficient of variation (0: not at all). The plan search predicts the mean step time over
    replays whose action times vary this much (:func:`pipeloom.plan.noise.expected_makespan`): where a
    rank waits for the later of two paths, variation costs time on average. Measured by
    :func:`pipeloom.plan.profile_in_engine`."""
    start_skew: float = 0.0
    """Seconds: how far apart ranks that start a step at once (the first stage of each replica in a
    two-replica schedule) begin their first actions, on average. Each draws an exponential delay of
    this mean in :func:`pipeloom.plan.noise.expected_makespan`; the later one holds up what depends on it.
    Measured by :func:`pipeloom.plan.profile_in_engine` on its two-replica profiling pipeline (on
    gloo with every core busy, a rank posting its first messages can stall for a scheduler slice)."""
    replica_link: Link | None = None
    """The two-replica schedules' gradient exchange as the engine runs it, per packed message (see
    :func:`pipeloom.plan.replica_sync_time`): packing, adding and sending back, under the load of the
    step's last messages. Fitted by :func:`pipeloom.plan.profile_in_engine` from a two-replica
    profiling pipeline; None prices the exchange with :attr:`CostTable.link`."""

    def __post_init__(self) -> None:
        for key in _RUNTIME_FIELDS[:-1]:
            object.__setattr__(self, key, _check(key, getattr(self, key)))
        if self.replica_link is not None and not isinstance(self.replica_link, Link):
            raise CostTableError(
                f"replica_link is {type(self.replica_link).__name__}, expected a Link or None")


def _table_keywords(kwargs: dict) -> dict:
    """``pipeloom.costs/1``'s flat keywords (``action_overhead=...``) go into ``runtime``, over its values."""
    flat = {key: kwargs.pop(key) for key in _RUNTIME_FIELDS if key in kwargs}
    if flat:
        runtime = kwargs.get("runtime", RuntimeCorrections())
        if not isinstance(runtime, RuntimeCorrections):
            raise CostTableError(f"runtime is {type(runtime).__name__}, expected a RuntimeCorrections")
        kwargs["runtime"] = dataclasses.replace(runtime, **flat)
    return kwargs


@_old_keywords(_table_keywords)
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
    :mod:`pipeloom.plan.shared` counts them on every rank holding a user and prices their gradients'
    combination after the step. Empty: no piece shares a parameter (or the table does not say)."""
    tensor: TensorInfo | None = None
    """What tensor parallelism needs (:class:`pipeloom.plan.tensor.TensorInfo`: head count, the pieces that
    are transformer layers, their column/row modules, collective prices); None: the planner tries tp 1 only."""

    def __post_init__(self) -> None:
        pieces = tuple(self.pieces)
        if not pieces:
            raise CostTableError("the cost table has no pieces; give at least one")
        if isinstance(self.microbatch_size, bool) or not isinstance(self.microbatch_size, int) \
                or self.microbatch_size < 1:
            raise CostTableError(f"microbatch_size must be a positive integer, got {shown(self.microbatch_size)}")
        object.__setattr__(self, "optimizer_factor", _check("optimizer_factor", self.optimizer_factor))
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
                    later = "a later piece" if any(p.name == name for p in pieces) else "no piece of the table"
                    raise CostTableError(
                        f"piece {piece.name!r} reads from {name!r}, which is {later}; list pieces in call "
                        f"order and name only earlier pieces in inputs"
                    )
            seen[piece.name] = k
            normal.append(piece if piece.inputs == inputs else dataclasses.replace(piece, inputs=inputs))
        object.__setattr__(self, "pieces", tuple(normal))
        object.__setattr__(self, "shared", _checked_shared(self.shared, seen))
        if self.tensor is not None:
            from pipeloom.plan.tensor import TensorInfo

            if not isinstance(self.tensor, TensorInfo):
                raise CostTableError(f"tensor is {type(self.tensor).__name__}, expected a TensorInfo or None")
            unknown = [name for name in self.tensor.layers if name not in seen]
            if unknown:
                raise CostTableError(f"tensor.layers names {unknown}, which the table has no piece for; name pieces")

    # pipeloom.costs/1's flat names of the runtime corrections, kept for callers: read ``runtime``.
    action_overhead = property(lambda self: self.runtime.action_overhead,
                               doc=":attr:`RuntimeCorrections.action_overhead` of :attr:`runtime`.")
    message_cost = property(lambda self: self.runtime.message_cost,
                            doc=":attr:`RuntimeCorrections.message_cost` of :attr:`runtime`.")
    step_overhead = property(lambda self: self.runtime.step_overhead,
                             doc=":attr:`RuntimeCorrections.step_overhead` of :attr:`runtime`.")
    time_spread = property(lambda self: self.runtime.time_spread,
                           doc=":attr:`RuntimeCorrections.time_spread` of :attr:`runtime`.")
    start_skew = property(lambda self: self.runtime.start_skew,
                          doc=":attr:`RuntimeCorrections.start_skew` of :attr:`runtime`.")
    replica_link = property(lambda self: self.runtime.replica_link,
                            doc=":attr:`RuntimeCorrections.replica_link` of :attr:`runtime`.")

    @property
    def names(self) -> tuple[str, ...]:
        """Piece names in call order."""
        return tuple(piece.name for piece in self.pieces)

    @property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """``(producer, consumer)`` piece indices, producer < consumer."""
        index = {name: k for k, name in enumerate(self.names)}
        return tuple((index[name], k) for k, piece in enumerate(self.pieces) for name in piece.inputs)

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


_SCALED = ("f", "i", "w", "activation_bytes", "w_activation_bytes", "output_bytes")


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
        dataclasses.replace(a, **{key: between(a, b, key) for key in _SCALED},
                            measured_full_backward=None if a.measured_full_backward is None
                            and b.measured_full_backward is None else between(a, b, "full_backward"))
        for a, b in zip(low.pieces, high.pieces)
    )
    runtime = dataclasses.replace(
        first.runtime, replica_link=replica_link,
        **{key: between(low.runtime, high.runtime, key)
           for key in ("action_overhead", "message_cost", "time_spread", "start_skew")})
    return dataclasses.replace(first, pieces=pieces, microbatch_size=microbatch_size, runtime=runtime)


# ------------------------------------------------------------------------------------------ JSON

_TOP_KEYS = {"format", "device", "source", "microbatch_size", "optimizer_factor", "link", "runtime", "pieces",
             "shared", "tensor"}
_TOP_KEYS_V1 = _TOP_KEYS - {"runtime"} | set(_RUNTIME_FIELDS)
_SHARED_KEYS = {"name", "bytes", "pieces"}
_LINK_KEYS = {"latency", "bandwidth"}
_PIECE_KEYS = {"name", "f", "i", "w", "measured_full_backward", "activation_bytes", "w_activation_bytes",
               "param_bytes", "output_bytes", "inputs"}
_PIECE_KEYS_V1 = _PIECE_KEYS - {"measured_full_backward"} | {"b"}


def costs_to_json(table: CostTable, *, indent: int | None = 1) -> str:
    """The ``pipeloom.costs/2`` JSON text of ``table`` (every key written, inputs explicit)."""
    runtime = table.runtime
    document = {
        "format": COSTS_FORMAT,
        "device": table.device,
        "source": table.source,
        "microbatch_size": table.microbatch_size,
        "optimizer_factor": table.optimizer_factor,
        "link": _link_to_json(table.link),
        "runtime": {**{key: getattr(runtime, key) for key in _RUNTIME_FIELDS[:-1]}, "replica_link":
                    None if runtime.replica_link is None else _link_to_json(runtime.replica_link)},
        "pieces": [
            {"name": p.name, "f": p.f, "i": p.i, "w": p.w, "measured_full_backward": p.measured_full_backward,
             "activation_bytes": p.activation_bytes, "w_activation_bytes": p.w_activation_bytes,
             "param_bytes": p.param_bytes, "output_bytes": p.output_bytes, "inputs": list(p.inputs or ())}
            for p in table.pieces
        ],
    }
    if table.shared:  # optional: tables without shared parameters read as before
        document["shared"] = [{"name": e.name, "bytes": e.bytes, "pieces": list(e.pieces)} for e in table.shared]
    if table.tensor is not None:  # optional, as "shared"
        from pipeloom.plan.tensor import tensor_to_json

        document["tensor"] = tensor_to_json(table.tensor)
    return json.dumps(document, indent=indent)


def _link_to_json(link: Link) -> dict:
    return {"latency": link.latency, "bandwidth": link.bandwidth}


def _piece_from_json(entry: object, k: int, *, old: bool) -> Piece:
    """A piece; ``old``: of a ``/1`` file, which names its measured full backward ``b``."""
    where = f"pieces[{k}]"
    if not isinstance(entry, dict):
        raise CostTableError(f"{where}: expected an object, got {shown(entry)}")
    check_keys(entry, _PIECE_KEYS_V1 if old else _PIECE_KEYS, where=where, error=CostTableError)
    values = {key: number(entry, key, where=where, error=CostTableError) for key in ("f", "i", "w")}
    for key in ("activation_bytes", "w_activation_bytes", "param_bytes", "output_bytes"):
        values[key] = number(entry, key, where=where, error=CostTableError, default=0.0)
    values["measured_full_backward"] = number(entry, "b" if old else "measured_full_backward", where=where,
                                              error=CostTableError, default=None, null=True)
    inputs = None if entry.get("inputs") is None else strings(entry, "inputs", where=where, error=CostTableError)
    return Piece(name=string(entry, "name", where=where, error=CostTableError), inputs=inputs, **values)


def _shared_from_json(entries: object) -> tuple[SharedParam, ...]:
    if not isinstance(entries, list):
        raise CostTableError(f"costs.shared: expected a list of shared parameters, got {shown(entries)}")
    found = []
    for k, entry in enumerate(entries):
        where = f"shared[{k}]"
        if not isinstance(entry, dict):
            raise CostTableError(f"{where}: expected an object with name, bytes and pieces, got {shown(entry)}")
        check_keys(entry, _SHARED_KEYS, where=where, error=CostTableError)
        found.append(SharedParam(name=string(entry, "name", where=where, error=CostTableError, default=""),
                                 bytes=number(entry, "bytes", where=where, error=CostTableError),
                                 pieces=tuple(strings(entry, "pieces", where=where, error=CostTableError))))
    return tuple(found)


def _runtime_from_json(entry: object, where: str) -> RuntimeCorrections:
    """The runtime corrections in ``entry`` (the ``runtime`` section, or a ``/1`` file's top level)."""
    if not isinstance(entry, dict):
        raise CostTableError(f"{where}: expected an object of runtime corrections, got {shown(entry)}")
    if where != "costs":  # the runtime section of a /2 file (a /1 file's top level is checked whole)
        check_keys(entry, set(_RUNTIME_FIELDS), where=where, error=CostTableError)
    replica_link = entry.get("replica_link")
    return RuntimeCorrections(
        replica_link=None if replica_link is None else _link_from_json(replica_link, f"{where}.replica_link"),
        **{key: number(entry, key, where=where, error=CostTableError, default=0.0)
           for key in _RUNTIME_FIELDS[:-1]})


def _format_of(text: str) -> str:
    """The format a cost table's text declares, checked to be one this reader knows (else ``/2``, so
    that :func:`~pipeloom.ir.jsonfields.json_object` reports malformed text against the current one)."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return COSTS_FORMAT
    if not isinstance(document, dict) or "format" not in document:
        return COSTS_FORMAT
    if document["format"] not in (COSTS_FORMAT_V1, COSTS_FORMAT):
        raise CostTableError(f"format {shown(document['format'])} is not supported; expected "
                             f"{COSTS_FORMAT_V1!r} or {COSTS_FORMAT!r}")
    return document["format"]


def costs_from_json(text: str) -> CostTable:
    """Parse ``pipeloom.costs/2`` (or ``/1``) JSON; unknown keys, another format or a wrong type are errors.

    Optional keys: ``device`` (""), ``source`` ("manual"), ``optimizer_factor`` (2), ``link`` (no
    latency, unlimited bandwidth), ``runtime`` (none measured) and in it ``action_overhead``,
    ``message_cost``, ``step_overhead`` and ``start_skew`` (0 seconds), ``time_spread`` (0),
    ``replica_link`` (null: the exchange is priced with ``link``); per piece ``measured_full_backward``
    (null: the full backward is priced ``i + w``), the byte counts (0) and ``inputs`` (the piece
    before it); ``shared`` (none: no piece shares a parameter), a list of ``{"name", "bytes",
    "pieces"}``; ``tensor`` (null: no tensor parallelism), see :func:`pipeloom.plan.tensor.tensor_from_json`.
    A ``pipeloom.costs/1`` file has the runtime corrections as top-level keys and a piece's
    measured full backward as ``b``.
    """
    fmt = _format_of(text)
    old = fmt == COSTS_FORMAT_V1
    document = json_object(text, fmt=fmt, keys=_TOP_KEYS_V1 if old else _TOP_KEYS, error=CostTableError,
                           what="cost table")
    where = "costs"
    link = _link_from_json(document.get("link") or {}, f"{where}.link")
    runtime = _runtime_from_json(document, where) if old else \
        _runtime_from_json(document.get("runtime", {}), f"{where}.runtime")
    entries = document.get("pieces")
    if not isinstance(entries, list):
        raise CostTableError(f"{where}.pieces: expected a list of pieces, got {shown(entries)}")
    return CostTable(
        pieces=tuple(_piece_from_json(entry, k, old=old) for k, entry in enumerate(entries)),
        microbatch_size=integer(document, "microbatch_size", where=where, error=CostTableError),
        device=string(document, "device", where=where, error=CostTableError, default=""),
        source=string(document, "source", where=where, error=CostTableError, default="manual"),
        optimizer_factor=number(document, "optimizer_factor", where=where, error=CostTableError, default=2.0),
        link=link, runtime=runtime, shared=_shared_from_json(document.get("shared", [])),
        tensor=_tensor_from_json(document.get("tensor")),
    )


def _tensor_from_json(entry: object) -> TensorInfo | None:
    if entry is None:
        return None
    from pipeloom.plan.tensor import TensorParallelError, tensor_from_json

    try:
        return tensor_from_json(entry)
    except TensorParallelError as error:
        raise CostTableError(f"costs.tensor: {error}") from None


def _link_from_json(entry: object, where: str) -> Link:
    if not isinstance(entry, dict):
        raise CostTableError(f"{where}: expected an object with latency and bandwidth, got {shown(entry)}")
    check_keys(entry, _LINK_KEYS, where=where, error=CostTableError)
    return Link(latency=number(entry, "latency", where=where, error=CostTableError, default=0.0),
                bandwidth=number(entry, "bandwidth", where=where, error=CostTableError, default=None, null=True))


def load_costs(path: str | Path) -> CostTable:
    """Read a ``pipeloom.costs/2`` (or ``/1``) file; CostTableError naming the file and the problem."""
    try:
        return costs_from_json(read_json_file(path, CostTableError))
    except CostTableError as error:
        if str(path) in str(error):
            raise
        raise CostTableError(f"{path}: {error}") from None


def save_costs(table: CostTable, path: str | Path) -> None:
    """Write ``table`` as ``pipeloom.costs/2`` JSON."""
    Path(path).write_text(costs_to_json(table) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------- bytes

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | float) -> float:
    """``"80GiB" -> 85899345920.0``: a number with an optional unit B, KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024), any case; a bare number is bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return _check("a byte count", text)
    match = _SIZE.match(text) if isinstance(text, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise CostTableError(
            f"bad size {shown(text)}: write a number and a unit such as 80GiB, 512MiB, 16GB or 1e9 (bytes)"
        )
    return _check("a byte count", float(match.group(1)) * _UNITS[unit])
