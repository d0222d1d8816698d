"""The API's request readers and the quick answers (simulate, compare, schedule files), in plain
Python: strict like the file readers (unknown keys, wrong types and oversized schedules are errors
that say how to fix them), JSON only, never pickle. Searches and plans run in worker processes
(:mod:`pipeloom.serve.jobs`); this module checks their requests."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pipeloom.errors import PipeloomError
from pipeloom.ir.jsonfields import check_keys, integer, json_failure, number, string
from pipeloom.plan.costs.file import MAX_PIECES
from pipeloom.serve.config import ServeConfig
from pipeloom.serve.errors import RequestError
from pipeloom.serve.limits import (
    MAX_LIST,
    MAX_SEARCH_RANKS,
    MAX_TABLES,
    check_count,
    check_work,
    plan_work,
    schedule_work,
    uploaded_work,
)
from pipeloom.stages import Costs

__all__ = [
    "compare",
    "plan_request",
    "query_document",
    "read_object",
    "schedule_file",
    "search_request",
    "simulate",
]


def _count(document: dict, key: str, where: str, default: object = ...) -> int:
    """The positive integer ``document[key]``, capped (:data:`~pipeloom.serve.limits.MAX_COUNT`: 413)."""
    if default is not ... and document.get(key) is None:
        return default  # type: ignore[return-value]
    return check_count(integer(document, key, where=where, error=RequestError), f"{where}.{key}")


_COST_KEYS = {"f", "b", "w", "comm", "memory_limit"}
_SHAPE_KEYS = {"ranks", "microbatches", "stages_per_rank"}
_INTEGERS = {"ranks", "microbatches", "stages_per_rank", "global_batch"}


def read_object(body: bytes, *, what: str = "request") -> dict:
    """The JSON object of a request body (UTF-8)."""
    try:
        document = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise RequestError(f"malformed JSON in the {what}: {json_failure(error)}") from None
    if not isinstance(document, dict):
        raise RequestError(f"the {what} must be a JSON object, got {type(document).__name__}")
    return document


def query_document(params: Iterable[tuple[str, str]]) -> dict:
    """A download's query string (``?ranks=4&microbatches=8&f=1``: its pairs) as the JSON request it stands for;
    RequestError for a key given twice (the last had won) or a value that is not a number (a whole number for the
    counts)."""
    document: dict[str, Any] = {}
    for key, text in params:
        if key in document:
            raise RequestError(f"query {key} is given twice; give it once")
        whole = key in _INTEGERS
        try:
            if "_" in text:  # Python reads 4_0 as 40: a typo here, not a digit separator
                raise ValueError(text)
            document[key] = int(text) if whole else float(text)
        except ValueError:
            raise RequestError(f"query {key}={text!r}: expected {'a whole number' if whole else 'a number'}") from None
    return document


def _costs(document: dict, where: str) -> Costs:
    values = {key: number(document, key, where=where, error=RequestError) for key in ("f", "b", "w", "comm")
              if document.get(key) is not None}
    try:
        return Costs(**values)
    except PipeloomError as error:
        raise RequestError(f"{where}: {error}") from None


def _limit(document: dict, where: str) -> float | None:
    return number(document, "memory_limit", where=where, error=RequestError, default=None, null=True)


def _shape(document: dict, names: list[str], config: ServeConfig, where: str) -> tuple[int, int, int | None]:
    """The request's ranks, micro-batches and stages per rank, its ``names`` known and their summed work within
    ``config.max_actions`` (413 otherwise, before anything is built)."""
    from pipeloom.schedules import REGISTRY

    for name in names:
        if name not in REGISTRY:
            raise RequestError(f"{where}: unknown schedule {name!r}; choose one of: {', '.join(REGISTRY)}", 404)
    ranks, microbatches = _count(document, "ranks", where), _count(document, "microbatches", where)
    stages = _count(document, "stages_per_rank", where, None)
    work = sum(schedule_work(name, ranks, microbatches, stages) for name in names)
    check_work(work, f"{where} of {', '.join(names)} with p={ranks}, m={microbatches}", config.max_actions)
    return ranks, microbatches, stages


def _one_shape(document: dict, name: str, config: ServeConfig, where: str) -> tuple[int, int, int | None]:
    """:func:`_shape` of the one schedule ``name``, which must take ``stages_per_rank`` where it is given (422 else,
    as ``pipeloom show`` refuses it; ``compare`` gives it to the schedules that take it)."""
    from pipeloom.schedules import REGISTRY

    taken = name not in REGISTRY or "stages_per_rank" in REGISTRY[name].options  # an unknown name: _shape's 404
    if not taken and _count(document, "stages_per_rank", where, None) is not None:  # before the size check's 413
        takers = [other for other, info in REGISTRY.items() if "stages_per_rank" in info.options]
        raise RequestError(f"{where}: schedule {name!r} does not take stages_per_rank; drop it, or use one that "
                           f"does: {', '.join(takers)}", 422)
    return _shape(document, [name], config, where)


def _named(document: dict, name: str, where: str, shape: tuple[int, int, int | None]):
    """Build and validate the registered schedule ``name`` of ``shape`` (checked by :func:`_shape`); its timeline.
    A generator's refusal (ValueError: odd micro-batches for dualpipe, a memory limit below one micro-batch) is a
    RequestError 422 with its message."""
    from pipeloom.schedules import REGISTRY, build_schedule
    from pipeloom.validate import validate

    ranks, microbatches, stages = shape
    options = {"stages_per_rank": stages} if stages is not None and "stages_per_rank" in REGISTRY[name].options else {}
    costs, limit = _costs(document, where), _limit(document, where)  # the request's own faults: said as they are
    try:
        schedule = build_schedule(name, ranks, microbatches, costs=costs, memory_limit=limit, **options)
    except ValueError as error:
        raise RequestError(f"{where}: {(str(error).strip().splitlines() or ['refused'])[0]}", 422) from None
    return validate(schedule, ordered=True)


def _given(value: Any, config: ServeConfig):
    """Simulate an uploaded ``pipeloom.schedule/1`` object, read as strictly as a file."""
    from pipeloom.ir import schedule_from_json
    from pipeloom.validate import validate

    check_work(uploaded_work(value), "the uploaded schedule", config.max_actions)
    schedule = schedule_from_json(json.dumps(value))
    check_work(schedule.num_actions + schedule.num_ranks, "the uploaded schedule", config.max_actions)
    return validate(schedule, ordered=False)


def simulate(document: dict, config: ServeConfig) -> dict:
    """``POST /api/simulate``: ``{"schedule": NAME, "ranks", "microbatches", "stages_per_rank"?, "f"?, "b"?,
    "w"?, "comm"?, "memory_limit"?}`` or ``{"schedule": <a pipeloom.schedule/1 object>}``; answers the
    report (as ``pipeloom show --json``), the view's data and the schedule as ``pipeloom.schedule/1``."""
    from pipeloom.ir import schedule_to_json
    from pipeloom.viz.html import timeline_data
    from pipeloom.viz.report import timeline_report

    where = "simulate"
    value = document.get("schedule")
    if isinstance(value, dict):
        check_keys(document, {"schedule"}, where=where, error=RequestError)
        timeline = _given(value, config)
        report = timeline_report(timeline)
    else:
        check_keys(document, {"schedule"} | _SHAPE_KEYS | _COST_KEYS, where=where, error=RequestError)
        name = string(document, "schedule", where=where, error=RequestError)
        shape = _one_shape(document, name, config, where)
        timeline = _named(document, name, where, shape)
        report = timeline_report(timeline, microbatches=shape[1], costs=_costs(document, where))
    return {"report": report, "view": timeline_data(timeline),
            "schedule": json.loads(schedule_to_json(timeline.schedule))}


def compare(document: dict, config: ServeConfig) -> dict:
    """``POST /api/compare``: ``{"names": [...], "ranks", "microbatches", costs..., "memory_limit"?}``;
    answers ``rows`` (as ``pipeloom compare --json``; a schedule that cannot be built is a row with an
    ``error``) and one view per schedule built."""
    from pipeloom.viz.html import timeline_data
    from pipeloom.viz.report import comparison_rows

    where = "compare"
    check_keys(document, {"names"} | _SHAPE_KEYS | _COST_KEYS, where=where, error=RequestError)
    names = document.get("names")
    if (not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names)
            or len(set(names)) < len(names) or len(names) > MAX_LIST):
        raise RequestError(f"{where}.names: expected a list of distinct schedule names, got {names!r:.80}")
    shape = _shape(document, names, config, where)
    outcomes = []
    for name in names:
        try:
            outcomes.append((name, _named(document, name, where, shape)))
        except RequestError as error:
            if error.status != 422:
                raise
            outcomes.append((name, str(error).removeprefix(f"{where}: ")))
        except PipeloomError as error:
            outcomes.append((name, (str(error).strip().splitlines() or ["failed"])[0]))
    built = [outcome for _, outcome in outcomes if not isinstance(outcome, str)]
    rows = comparison_rows(outcomes, microbatches=shape[1], costs=_costs(document, where))  # each row's costs too
    return {"rows": rows, "views": [timeline_data(t, title=t.schedule.name) for t in built]}


def schedule_file(name: str, fmt: str, document: dict, config: ServeConfig) -> str:
    """``GET /api/schedules/NAME.json`` or ``.csv`` (torch's CSV) with the shape and costs in the query."""
    from pipeloom.ir import schedule_to_csv, schedule_to_json

    check_keys(document, _SHAPE_KEYS | _COST_KEYS, where="download", error=RequestError)
    schedule = _named(document, name, "download", _one_shape(document, name, config, "download")).schedule
    return schedule_to_json(schedule, indent=1) + "\n" if fmt == "json" else schedule_to_csv(schedule)


_SEARCH_KEYS = {"placement", "ranks", "microbatches", "time_limit", "memory_limit", "split_backward", "f", "b", "w",
                "comm", "mode"}


def search_request(document: dict, config: ServeConfig) -> dict:
    """Check ``POST /api/searches``: ``{"placement", "ranks", "microbatches", "time_limit"?, "memory_limit"?,
    "split_backward"?, "f"?, "b"?, "w"?, "comm"?, "mode"?}``; the checked request, plain JSON values."""
    from pipeloom.search import PLACEMENTS, placement

    where = "search"
    check_keys(document, _SEARCH_KEYS, where=where, error=RequestError)
    name = string(document, "placement", where=where, error=RequestError)
    if name not in PLACEMENTS:
        raise RequestError(f"{where}: unknown placement {name!r}; choose one of: {', '.join(PLACEMENTS)}", 404)
    mode = document.get("mode", "auto")
    if mode not in ("auto", "exact", "periodic"):
        raise RequestError(f"{where}.mode: expected 'auto', 'exact' or 'periodic', got {mode!r:.40}")
    split = document.get("split_backward", False)
    if not isinstance(split, bool):
        raise RequestError(f"{where}.split_backward: expected true or false, got {split!r:.40}")
    limit = number(document, "time_limit", where=where, error=RequestError, default=10.0, minimum=0.01)
    if limit > config.max_search_seconds:
        raise RequestError(f"{where}.time_limit {limit:g} s is above this server's limit of "
                           f"{config.max_search_seconds:g} s; ask for less")
    # building a placement (to count its tasks) takes time that grows as ranks squared: capped lower
    ranks = check_count(integer(document, "ranks", where=where, error=RequestError), f"{where}.ranks",
                        cap=MAX_SEARCH_RANKS)
    microbatches = _count(document, "microbatches", where)
    try:
        tasks = len(placement(name, ranks, split_backward=split).tasks)
    except (PipeloomError, ValueError) as error:
        raise RequestError(f"{where}: {(str(error).strip().splitlines() or ['refused'])[0]}", 422) from None
    check_work(tasks * microbatches + ranks, f"{where} of {name} with p={ranks}, m={microbatches}",
               config.max_actions)
    costs = {key: number(document, key, where=where, error=RequestError) for key in ("f", "b", "w")
             if document.get(key) is not None}
    return {"placement": name, "ranks": ranks, "microbatches": microbatches, "time_limit": limit, "mode": mode,
            "memory_limit": _limit(document, where), "split_backward": split,
            "comm": number(document, "comm", where=where, error=RequestError, default=0.0), "costs": costs}


_PLAN_KEYS = {"costs", "ranks", "global_batch", "memory_limit", "data_parallel", "tensor_parallel", "sharding",
              "schedules", "stages_per_rank", "microbatches", "search"}


def _counts(document: dict, key: str, where: str) -> list[int] | None:
    value = document.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(type(v) is int and v >= 1 for v in value):
        raise RequestError(f"{where}.{key}: expected a list of positive integers, got {value!r:.80}")
    if len(value) > MAX_LIST:
        raise RequestError(f"{where}.{key}: {len(value)} entries, above this server's limit of {MAX_LIST}", 413)
    for v in value:
        check_count(v, f"{where}.{key} entry")
    return value


def _plan_tables(tables: object, where: str, *, read_tables: bool) -> tuple[list[str], int]:
    """A plan request's cost tables (one object or a list): ``(their JSON texts, the most pieces any has)``, each
    read with the file reader (``read_tables``) or only its pieces counted; RequestError naming the bad one."""
    from pipeloom.plan.costs.file import costs_from_json

    tables = tables if isinstance(tables, list) else [tables]
    if not tables:  # the planner's own refusal had surfaced as a 500 (an IndexError before it)
        raise RequestError(f"{where}.costs: an empty list; give a pipeloom.costs/2 object or a list of them")
    if len(tables) > MAX_TABLES:
        raise RequestError(f"{where}.costs: {len(tables)} tables, above this server's limit of {MAX_TABLES}", 413)
    texts, pieces = [], 1
    for k, table in enumerate(tables):
        if not isinstance(table, dict):
            raise RequestError(f"{where}.costs: expected a pipeloom.costs/2 (or /1) object (or a list of them), got "
                               f"{type(table).__name__}")
        if isinstance(table.get("pieces"), list) and len(table["pieces"]) > MAX_PIECES:
            raise RequestError(f"{where}.costs[{k}]: {len(table['pieces']):,} pieces, above this server's limit of "
                               f"{MAX_PIECES:,}", 413)
        if not read_tables:
            pieces = max(pieces, len(table["pieces"]) if isinstance(table.get("pieces"), list) else 1)
            continue
        text = json.dumps(table)
        try:
            pieces = max(pieces, len(costs_from_json(text).pieces))
        except PipeloomError as error:
            raise RequestError(f"{where}.costs[{k}]: {error}") from None
        texts.append(text)
    return texts, pieces


def _memory_limit(document: dict, where: str) -> float | None:
    """A request's ``memory_limit`` as :func:`_limit` reads it (bytes, or None), or a size like ``"16GiB"``."""
    from pipeloom.plan.costs.parts import parse_bytes

    limit = document.get("memory_limit")
    if not isinstance(limit, str):
        return _limit(document, where)
    try:
        return parse_bytes(limit)
    except PipeloomError as error:
        raise RequestError(f"{where}.memory_limit: {error}") from None


def plan_request(document: dict, config: ServeConfig, *, read_tables: bool = True) -> dict:
    """Check ``POST /api/plans``: ``{"costs": <pipeloom.costs/2 (or /1) object, or a list of them>, "ranks",
    "global_batch", "memory_limit"? (bytes, or a size like "16GiB"), "data_parallel"?, "tensor_parallel"?,
    "sharding"?, "schedules"?, "stages_per_rank"?, "microbatches"?, "search"? (seconds)}``. The cost tables
    are read here with the file reader, so a bad one is refused before the plan is queued; with
    ``read_tables=False`` they are only counted (the quick check of every other field and of the work, which
    the server runs before it hands the full check to a worker)."""
    from pipeloom.schedules import REGISTRY

    where = "plan"
    check_keys(document, _PLAN_KEYS, where=where, error=RequestError)
    texts, pieces = _plan_tables(document.get("costs"), where, read_tables=read_tables)
    limit = _memory_limit(document, where)
    schedules = document.get("schedules")
    if schedules is not None and (not isinstance(schedules, list) or not schedules or len(schedules) > MAX_LIST
                                  or any(not isinstance(name, str) or name not in REGISTRY for name in schedules)):
        raise RequestError(f"{where}.schedules: expected a list of schedule names among {', '.join(REGISTRY)}; "
                           f"got {schedules!r:.80}")
    sharding = document.get("sharding", "replicate")
    if sharding not in ("replicate", "fsdp"):
        raise RequestError(f"{where}.sharding: expected 'replicate' or 'fsdp', got {sharding!r:.40}")
    search = number(document, "search", where=where, error=RequestError, default=0.0)
    if search > config.max_search_seconds:
        raise RequestError(f"{where}.search {search:g} s is above this server's limit of "
                           f"{config.max_search_seconds:g} s")
    checked = {"costs": texts, "ranks": _count(document, "ranks", where),
               "global_batch": _count(document, "global_batch", where),
               "memory_limit": limit, "data_parallel": _counts(document, "data_parallel", where),
               "tensor_parallel": _counts(document, "tensor_parallel", where) or [1], "sharding": sharding,
               "schedules": schedules, "stages_per_rank": _counts(document, "stages_per_rank", where) or [2],
               "microbatches": _counts(document, "microbatches", where), "search": search}
    work = plan_work(pieces=pieces, limit=config.max_actions,
                     **{key: checked[key] for key in ("ranks", "global_batch", "schedules", "stages_per_rank",
                                                      "microbatches", "data_parallel", "tensor_parallel", "search")})
    check_work(work, f"{where}: the candidates of this plan", config.max_actions)
    return checked
