"""The ``pipeloom.schedule/1`` JSON form of a schedule: tasks, machine facts and rank lists."""

from __future__ import annotations

import json
import math
from typing import Any

from pipeloom.errors import PipeloomError, ScheduleFormatError, shown
from pipeloom.ir.core import Action, Comm, Overlap, Schedule
from pipeloom.ir.jsonfields import check_format, parse_object
from pipeloom.problem import Problem, Task, parse_task_name, task_name

__all__ = ["FORMAT", "check_totals", "problem_from_document", "schedule_from_document", "schedule_from_json",
           "schedule_to_json"]

FORMAT = "pipeloom.schedule/1"

_TOP_KEYS = {
    "format", "name", "num_ranks", "num_microbatches", "tasks", "comm_latency", "memory_limit",
    "static_memory", "overlap_overhead", "overlap_fraction", "pair_time", "ranks",
}
_TASK_KEYS = {"stage", "kind", "ranks", "duration", "memory", "deps", "comm"}
_NUMBER = (int, float)


def schedule_to_json(schedule: Schedule, *, indent: int | None = None) -> str:
    """The ``pipeloom.schedule/1`` JSON text of a schedule (tasks, machine facts, rank lists).

    Files hold compute-only schedules: a lowered one is a ScheduleFormatError (save it as torch
    ``compute_comms`` CSV, or save the schedule before lowering).
    """
    if schedule.lowered:
        raise ScheduleFormatError(
            f"schedule {schedule.name!r} is lowered (it has communication actions) and pipeloom JSON holds "
            "compute-only schedules; save it as a torch compute_comms .csv, or save it before lower()"
        )
    problem = schedule.problem
    document = {
        "format": FORMAT,
        "name": schedule.name,
        "num_ranks": problem.num_ranks,
        "num_microbatches": schedule.num_microbatches,
        "tasks": [
            {
                "stage": task.stage,
                "kind": task.kind,
                "ranks": list(task.ranks),
                "duration": task.duration,
                "memory": task.memory,
                "deps": [task_name(dep) for dep in task.deps],
                **({"comm": task.comm} if task.comm else {}),  # written only when set, as below
            }
            for task in problem.tasks
        ],
        "comm_latency": problem.comm_latency,
        "memory_limit": problem.memory_limit,
        "static_memory": None if problem.static_memory is None else list(problem.static_memory),
        "ranks": [[str(action) for action in actions] for actions in schedule.ranks],
    }
    if problem.overlap_overhead:  # written only when set: files without pairs read as before
        document["overlap_overhead"] = problem.overlap_overhead
    if problem.overlap_fraction:
        document["overlap_fraction"] = problem.overlap_fraction
    if problem.pair_time is not None:
        document["pair_time"] = problem.pair_time
    return json.dumps(document, indent=indent)


def _require(document: dict, key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in document:
        raise ScheduleFormatError(f"{where}: missing key {key!r}")
    return _typed(document[key], types, f"{where}.{key}")


def _typed(value: Any, types: type | tuple[type, ...], what: str, *, null: bool = False) -> Any:
    """``value`` if it is one of ``types`` (a bool is no number), or None when ``null``."""
    types = types if isinstance(types, tuple) else (types,)
    if value is None and null:
        return None
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        words = _type_words(types) + (" or null" if null else "")
        raise ScheduleFormatError(f"{what}: expected {words}, got {shown(value)}")
    return value


def _type_words(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
    if float in types:
        types = tuple(t for t in types if t is not int)
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def _numbers(value: Any, what: str) -> tuple[float, ...] | None:
    """A JSON list of numbers as a tuple, or None for null."""
    if value is not None and not (
        isinstance(value, list)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ScheduleFormatError(f"{what}: expected a list of numbers or null, got {shown(value)}")
    return None if value is None else tuple(value)


def _task_from_json(entry: Any, i: int) -> Task:
    where = f"tasks[{i}]"
    if not isinstance(entry, dict):
        raise ScheduleFormatError(f"{where}: expected an object, got {shown(entry)}")
    unknown = set(entry) - _TASK_KEYS
    if unknown:
        raise ScheduleFormatError(
            f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_TASK_KEYS)}"
        )
    ranks = _require(entry, "ranks", list, where)
    deps = entry.get("deps", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise ScheduleFormatError(f"{where}.deps: expected a list of task names like '0F'")
    try:
        return Task(
            stage=_require(entry, "stage", int, where),
            kind=_require(entry, "kind", str, where),
            ranks=tuple(ranks),
            duration=_require(entry, "duration", (int, float), where),
            memory=_typed(entry.get("memory", 0.0), _NUMBER, f"{where}.memory"),
            deps=tuple(parse_task_name(d) for d in deps),
            comm=_typed(entry.get("comm", 0.0), _NUMBER, f"{where}.comm"),
        )
    except ScheduleFormatError:
        raise
    except PipeloomError as error:
        raise ScheduleFormatError(f"{where}: {error}") from None


def _compute_action(text: str) -> Action | Overlap:
    """A compute action or an overlapped pair from its text (ScheduleFormatError otherwise)."""
    if isinstance(text, str) and text.lstrip().startswith("("):
        return Overlap.parse(text)
    return Action.parse(text)


def _rank_lists_from_json(document: dict) -> tuple[tuple[Action | Overlap, ...], ...]:
    actions = []
    for r, row in enumerate(_require(document, "ranks", list, "schedule")):
        if not isinstance(row, list):
            raise ScheduleFormatError(f"ranks[{r}]: expected a list of action strings")
        try:
            actions.append(tuple(_compute_action(a) for a in row))
        except ScheduleFormatError as error:
            comm = next((a for a in row if _is_comm(a)), None)
            if comm is not None:
                raise ScheduleFormatError(
                    f"ranks[{r}]: {comm} is a communication action; pipeloom JSON holds compute-only "
                    "schedules (a lowered schedule is saved as a torch compute_comms .csv)"
                ) from None
            raise ScheduleFormatError(f"ranks[{r}]: {error}") from None
    return tuple(actions)


def _is_comm(text: Any) -> bool:
    try:
        Comm.parse(text)
    except ScheduleFormatError:
        return False
    return True


def check_totals(problem: Problem, num_microbatches: int, *, where: str = "schedule",
                 error: type[PipeloomError] = ScheduleFormatError) -> None:
    """``error`` naming the largest field when ``problem``'s numbers, each finite, overflow the float
    range once added up over ``num_microbatches`` (the serial time: every task's duration, latency
    and overlap overhead; the memory: every change and the largest static memory), before anything
    sums them: ``tasks[0].duration 1e+308`` instead of an ``inf`` or ``nan`` further down."""
    tasks = problem.tasks
    extra = (problem.comm_latency + problem.overlap_overhead + (problem.pair_time or 0.0)) * len(tasks)
    times = sum(task.duration for task in tasks) + extra  # inf on overflow (fsum raises)
    memory = sum(abs(task.memory) for task in tasks)
    static = max(map(abs, problem.static_memory or (0.0,)))
    count = max(num_microbatches, 1)
    scale = float(count) if count < 1e300 else math.inf  # an int beyond floats would raise, not overflow

    def total(value: float) -> float:
        return 0.0 if value == 0 else value * scale

    if math.isfinite(total(times)) and math.isfinite(total(memory) + static):
        return
    fields = [(f"tasks[{i}].duration", task.duration) for i, task in enumerate(tasks)]
    fields += [("comm_latency", problem.comm_latency), ("overlap_overhead", problem.overlap_overhead)]
    if not math.isfinite(total(times)):
        what = "durations"
    else:
        what = "memory changes"
        fields = [(f"tasks[{i}].memory", abs(task.memory)) for i, task in enumerate(tasks)]
        fields += [(f"static_memory[{r}]", abs(v)) for r, v in enumerate(problem.static_memory or ())]
    field, value = max(fields, key=lambda item: item[1])
    plural = "" if count == 1 else "es"
    shown_count = f"{count:,}" if count < 10**15 else f"about 1e{len(str(count)) - 1}"
    raise error(f"{where}.{field} {value:g}: the {what} overflow the float range when added up over {shown_count} "
                f"micro-batch{plural}; scale them down (e.g. seconds to milliseconds, bytes to MiB)")


def schedule_from_json(text: str) -> Schedule:
    """Parse ``pipeloom.schedule/1`` JSON; unknown keys, another format or a wrong type are errors."""
    return schedule_from_document(parse_object(text, error=ScheduleFormatError, what="schedule file"))


def schedule_from_document(document: dict) -> Schedule:
    """:func:`schedule_from_json` of an already parsed JSON object."""
    check_format(document, fmt=FORMAT, keys=_TOP_KEYS, error=ScheduleFormatError, what="schedule file")
    where = "schedule"
    tasks = _tasks_from_json(document, where)
    actions = _rank_lists_from_json(document)
    try:
        problem = _problem(document, tasks, where)
        num_microbatches = _require(document, "num_microbatches", int, where)
        check_totals(problem, num_microbatches, where=where)
        return Schedule(
            name=_typed(document.get("name", "schedule"), str, f"{where}.name"),
            problem=problem,
            num_microbatches=num_microbatches,
            ranks=actions,
        )
    except ScheduleFormatError:
        raise
    except PipeloomError as error:
        raise ScheduleFormatError(str(error)) from None


def problem_from_document(document: dict, *, where: str = "problem") -> Problem:
    """The problem part of a schedule object (``num_ranks``, ``tasks``, the optional machine facts),
    checked as :func:`schedule_from_json` checks it, errors naming fields under ``where``; its other
    keys are the caller's to check."""
    tasks = _tasks_from_json(document, where)
    try:
        problem = _problem(document, tasks, where)
        check_totals(problem, 1, where=where)
        return problem
    except ScheduleFormatError:
        raise
    except PipeloomError as error:
        raise ScheduleFormatError(str(error)) from None


def _tasks_from_json(document: dict, where: str) -> tuple[Task, ...]:
    entries = _require(document, "tasks", list, where)
    return tuple(_task_from_json(entry, i) for i, entry in enumerate(entries))


def _problem(document: dict, tasks: tuple[Task, ...], where: str) -> Problem:
    """The Problem of ``document`` (ProblemError where its values do not make one)."""
    return Problem(
        num_ranks=_require(document, "num_ranks", int, where),
        tasks=tasks,
        comm_latency=_typed(document.get("comm_latency", 0.0), _NUMBER, f"{where}.comm_latency"),
        memory_limit=_typed(document.get("memory_limit"), _NUMBER, f"{where}.memory_limit", null=True),
        static_memory=_numbers(document.get("static_memory"), f"{where}.static_memory"),
        overlap_overhead=_typed(document.get("overlap_overhead", 0.0), _NUMBER, f"{where}.overlap_overhead"),
        overlap_fraction=_typed(document.get("overlap_fraction", 0.0), _NUMBER, f"{where}.overlap_fraction"),
        pair_time=_typed(document.get("pair_time"), _NUMBER, f"{where}.pair_time", null=True),
    )

