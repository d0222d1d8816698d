"""The ``pipeloom.costs/2`` JSON form of a cost table, which users can read and edit: write it, read
it (``/1`` files too: runtime corrections at the top level, a piece's full backward as ``b``), load, save."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pipeloom.errors import shown
from pipeloom.ir.jsonfields import check_keys, integer, json_object, number, read_json_file, string, strings
from pipeloom.plan.costs.parts import RUNTIME_FIELDS, Link, Piece, RuntimeCorrections, SharedParam
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import CostTableError

if TYPE_CHECKING:
    from pipeloom.plan.tp.megatron import TensorInfo

__all__ = ["COSTS_FORMAT", "COSTS_FORMAT_V1", "MAX_PIECES", "check_piece_count", "costs_from_json", "costs_to_json",
           "load_costs", "save_costs"]

MAX_PIECES = 10_000
"""Pieces of a cost table at most: the planner cuts the model for every candidate in time linear in the
pieces (5,000 pieces: about 0.3 s a candidate, some fifty candidates a plan), and a table is read at about
0.1 ms a piece; a model profiled finer than this is better profiled by blocks."""


def check_piece_count(count: int) -> None:
    """CostTableError when a table of ``count`` pieces is above :data:`MAX_PIECES`."""
    if count > MAX_PIECES:
        raise CostTableError(f"the cost table has {count:,} pieces, above the limit of {MAX_PIECES:,}; profile "
                             "coarser pieces (whole blocks: pipeloom profile --pieces ...) or merge them")

COSTS_FORMAT = "pipeloom.costs/2"
"""The format :func:`save_costs` writes: runtime corrections in their own ``runtime`` section."""
COSTS_FORMAT_V1 = "pipeloom.costs/1"
"""The first format, still read: runtime corrections as top-level keys, a piece's full backward as ``b``."""

_TOP_KEYS = {"format", "device", "source", "microbatch_size", "optimizer_factor", "link", "runtime", "pieces",
             "shared", "tensor"}
_TOP_KEYS_V1 = _TOP_KEYS - {"runtime"} | set(RUNTIME_FIELDS)
_SHARED_KEYS = {"name", "bytes", "pieces"}
_LINK_KEYS = {"latency", "bandwidth"}
_PIECE_KEYS = {"name", "f", "i", "w", "measured_full_backward", "activation_bytes", "w_activation_bytes",
               "param_bytes", "output_bytes", "inputs", "running_stats"}
_PIECE_KEYS_V1 = _PIECE_KEYS - {"measured_full_backward", "running_stats"} | {"b"}


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
        "runtime": {**{key: getattr(runtime, key) for key in RUNTIME_FIELDS[:-1]}, "replica_link":
                    None if runtime.replica_link is None else _link_to_json(runtime.replica_link)},
        "pieces": [
            {"name": p.name, "f": p.f, "i": p.i, "w": p.w, "measured_full_backward": p.measured_full_backward,
             "activation_bytes": p.activation_bytes, "w_activation_bytes": p.w_activation_bytes,
             "param_bytes": p.param_bytes, "output_bytes": p.output_bytes, "inputs": list(p.inputs or ()),
             **({"running_stats": True} if p.running_stats else {})}  # optional: written only where true
            for p in table.pieces
        ],
    }
    if table.shared:  # optional: tables without shared parameters read as before
        document["shared"] = [{"name": e.name, "bytes": e.bytes, "pieces": list(e.pieces)} for e in table.shared]
    if table.tensor is not None:  # optional, as "shared"
        from pipeloom.plan.tp.megatron import tensor_to_json

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
    measured = number(entry, "b" if old else "measured_full_backward", where=where, error=CostTableError,
                      default=None, null=True)
    inputs = None if entry.get("inputs") is None else strings(entry, "inputs", where=where, error=CostTableError)
    running = entry.get("running_stats", False)
    if not isinstance(running, bool):
        raise CostTableError(f"{where}.running_stats: expected true or false, got {shown(running)}")
    return Piece(name=string(entry, "name", where=where, error=CostTableError), inputs=inputs,
                 measured_full_backward=measured, running_stats=running, **values)


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
        check_keys(entry, set(RUNTIME_FIELDS), where=where, error=CostTableError)
    replica_link = entry.get("replica_link")
    return RuntimeCorrections(
        replica_link=None if replica_link is None else _link_from_json(replica_link, f"{where}.replica_link"),
        **{key: number(entry, key, where=where, error=CostTableError, default=0.0)
           for key in RUNTIME_FIELDS[:-1]})


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
    "pieces"}``; ``tensor`` (null: no tensor parallelism), see :func:`pipeloom.plan.tp.megatron.tensor_from_json`.
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
    check_piece_count(len(entries))  # before building one
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
    from pipeloom.plan.errors import TensorParallelError
    from pipeloom.plan.tp.megatron import tensor_from_json

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
