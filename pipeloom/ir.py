"""The schedule IR (DESIGN §2): actions, schedules, and their text, JSON and torch-CSV forms.

An action is ``(stage, kind, microbatch)`` written ``2F0``; a schedule is, per rank, the ordered
list of actions it runs, together with the problem it schedules.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pipeloom.errors import PipeloomError, ScheduleFormatError
from pipeloom.problem import Costs, Problem, Stage, Task, parse_task_name, stage_graph, task_name

__all__ = [
    "FORMAT",
    "Action",
    "Schedule",
    "format_grid",
    "schedule_to_json",
    "schedule_from_json",
    "schedule_to_csv",
    "schedule_from_csv",
    "save_schedule",
    "load_schedule",
]

FORMAT = "pipeloom.schedule/1"
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$", re.ASCII)
_MAX_DIGITS = 18  # indices beyond 10**18 are typos, and int() refuses more than 4300 digits


class Action(NamedTuple):
    """One task of one micro-batch, as a rank runs it: ``Action(2, "F", 0)`` prints ``2F0``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def task(self) -> tuple[int, str]:
        """The task key ``(stage, kind)``."""
        return (self.stage, self.kind)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("2F0") == Action(2, "F", 0)``."""
        match = _ACTION.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleFormatError(
                f"bad action {_shown(text)}: expected STAGE KIND MICROBATCH with kind F, B, I or W, "
                "e.g. '2F0'"
            )
        if max(len(match.group(1)), len(match.group(3))) > _MAX_DIGITS:
            raise ScheduleFormatError(
                f"bad action {_shown(text)}: an index is too long (over {_MAX_DIGITS} digits)"
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """For each rank, the ordered actions it runs, plus the problem they schedule."""

    name: str
    """Schedule name, e.g. ``1f1b``."""
    problem: Problem
    """The task graph and machine the schedule is for."""
    num_microbatches: int
    """Number of micro-batches M; every task runs once for each of 0..M-1."""
    ranks: tuple[tuple[Action, ...], ...]
    """``ranks[r]`` is rank r's action list in execution order."""

    def __post_init__(self) -> None:
        m = self.num_microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PipeloomError(f"num_microbatches must be a positive integer, got {m!r}")
        ranks = tuple(tuple(actions) for actions in self.ranks)
        if len(ranks) != self.problem.num_ranks:
            raise PipeloomError(
                f"schedule {self.name!r} has {len(ranks)} rank lists but the problem has "
                f"{self.problem.num_ranks} ranks; give one list per rank"
            )
        object.__setattr__(self, "ranks", ranks)

    @property
    def num_ranks(self) -> int:
        """Number of ranks."""
        return self.problem.num_ranks

    @property
    def num_actions(self) -> int:
        """Total entries over all rank lists."""
        return sum(len(actions) for actions in self.ranks)

    def to_text(self) -> str:
        """One line per rank: ``rank 0: 0F0 0F1 0B0 ...`` (golden-snapshot friendly)."""
        return "\n".join(
            f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks)
        )


def format_grid(
    ranks: Sequence[Sequence[Any]],
    *,
    mark: tuple[int, int] | None = None,
    context: int = 5,
    max_ranks: int = 12,
) -> str:
    """The step x rank grid of action strings; ``mark=(rank, step)`` flags the failing cell.

    Only ``context`` steps around the mark (and ``max_ranks`` ranks around its rank) are shown
    so that errors stay readable for long schedules.
    """
    num_steps = max((len(actions) for actions in ranks), default=0)
    if mark is None:
        first, last = 0, min(num_steps, 2 * context + 1)
        rank_lo, rank_hi = 0, min(len(ranks), max_ranks)
    else:
        first, last = max(0, mark[1] - context), min(num_steps, mark[1] + context + 1)
        rank_lo = max(0, min(mark[0] - max_ranks // 2, len(ranks) - max_ranks))
        rank_hi = min(len(ranks), rank_lo + max_ranks)
    columns = range(rank_lo, rank_hi)
    cells = [["step"] + [f"rank {r}" for r in columns]]
    for step in range(first, last):
        row = [str(step)]
        for r in columns:
            text = str(ranks[r][step]) if step < len(ranks[r]) else ""
            if mark == (r, step):
                text = f">{text}<"
            row.append(text)
        cells.append(row)
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
    lines = [" | ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in cells]
    if mark is not None and first <= mark[1] < last:
        lines[1 + mark[1] - first] += "   <-- here"
    notes = []
    if first > 0 or last < num_steps:
        notes.append(f"steps {first}..{last - 1} of {num_steps}")
    if rank_lo > 0 or rank_hi < len(ranks):
        notes.append(f"ranks {rank_lo}..{rank_hi - 1} of {len(ranks)}")
    if notes:
        lines.append("(" + ", ".join(notes) + ")")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- JSON

_TOP_KEYS = {
    "format", "name", "num_ranks", "num_microbatches", "tasks", "comm_latency", "memory_limit",
    "static_memory", "ranks",
}
_TASK_KEYS = {"stage", "kind", "ranks", "duration", "memory", "deps"}
_NUMBER = (int, float)


def schedule_to_json(schedule: Schedule, *, indent: int | None = None) -> str:
    """The ``pipeloom.schedule/1`` JSON text of a schedule (tasks, machine facts, rank lists)."""
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
            }
            for task in problem.tasks
        ],
        "comm_latency": problem.comm_latency,
        "memory_limit": problem.memory_limit,
        "static_memory": None if problem.static_memory is None else list(problem.static_memory),
        "ranks": [[str(action) for action in actions] for actions in schedule.ranks],
    }
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
        raise ScheduleFormatError(f"{what}: expected {words}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        raise ScheduleFormatError(f"{what}: expected a list of numbers or null, got {_shown(value)}")
    return None if value is None else tuple(value)


def _task_from_json(entry: Any, i: int) -> Task:
    where = f"tasks[{i}]"
    if not isinstance(entry, dict):
        raise ScheduleFormatError(f"{where}: expected an object, got {_shown(entry)}")
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
        )
    except ScheduleFormatError:
        raise
    except PipeloomError as error:
        raise ScheduleFormatError(f"{where}: {error}") from None


def _rank_lists_from_json(document: dict) -> tuple[tuple[Action, ...], ...]:
    actions = []
    for r, row in enumerate(_require(document, "ranks", list, "schedule")):
        if not isinstance(row, list):
            raise ScheduleFormatError(f"ranks[{r}]: expected a list of action strings")
        try:
            actions.append(tuple(Action.parse(a) for a in row))
        except ScheduleFormatError as error:
            raise ScheduleFormatError(f"ranks[{r}]: {error}") from None
    return tuple(actions)


def _json_document(text: str) -> dict:
    """The parsed top-level object, its format tag and key names checked."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, over-long ints, deep nesting
        raise ScheduleFormatError(f"malformed JSON: {error}") from None
    if not isinstance(document, dict):
        raise ScheduleFormatError("a schedule file must hold a JSON object")
    if "format" not in document:
        raise ScheduleFormatError(f"missing key 'format'; expected \"format\": \"{FORMAT}\"")
    if document["format"] != FORMAT:
        raise ScheduleFormatError(
            f"format {_shown(document['format'])} is not supported; expected {FORMAT!r}"
        )
    unknown = set(document) - _TOP_KEYS
    if unknown:
        raise ScheduleFormatError(f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    return document


def schedule_from_json(text: str) -> Schedule:
    """Parse ``pipeloom.schedule/1`` JSON; unknown keys, another format or a wrong type are errors."""
    document = _json_document(text)
    where = "schedule"
    tasks = [_task_from_json(entry, i) for i, entry in enumerate(_require(document, "tasks", list, where))]
    actions = _rank_lists_from_json(document)
    try:
        problem = Problem(
            num_ranks=_require(document, "num_ranks", int, where),
            tasks=tuple(tasks),
            comm_latency=_typed(document.get("comm_latency", 0.0), _NUMBER, f"{where}.comm_latency"),
            memory_limit=_typed(document.get("memory_limit"), _NUMBER, f"{where}.memory_limit", null=True),
            static_memory=_numbers(document.get("static_memory"), f"{where}.static_memory"),
        )
        return Schedule(
            name=_typed(document.get("name", "schedule"), str, f"{where}.name"),
            problem=problem,
            num_microbatches=_require(document, "num_microbatches", int, where),
            ranks=actions,
        )
    except ScheduleFormatError:
        raise
    except PipeloomError as error:
        raise ScheduleFormatError(str(error)) from None


# ------------------------------------------------------------------------------------------ CSV


def schedule_to_csv(schedule: Schedule) -> str:
    """torch.distributed.pipelining's compute-only CSV: one row per rank, one action per cell.

    Only a schedule whose problem :func:`schedule_from_csv` would infer again can be written
    (ScheduleFormatError otherwise); durations, memory and static memory are not carried.
    """
    obstacle = _csv_obstacle(schedule)
    if obstacle is not None:
        raise ScheduleFormatError(
            f"schedule {schedule.name!r} cannot be saved as torch CSV because {obstacle}; save it as .json"
        )
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in schedule.ranks:
        writer.writerow([str(action) for action in actions])
    return out.getvalue()


_STYLES = {("F",): "none", ("B", "F"): "full", ("F", "I", "W"): "split"}


def _csv_obstacle(schedule: Schedule) -> str | None:
    """Why the CSV reader would not infer ``schedule``'s task graph back, or None if it would.

    The reader sees one rank per task, each stage on one rank, stages 0..S-1 chained s -> s+1
    with the stage-graph builder's deps, one backward style, and no trailing idle rank.
    """
    rank_of: dict[int, int] = {}
    kinds: dict[int, list[str]] = {}
    for task in schedule.problem.tasks:
        if len(task.ranks) != 1:
            return f"task {task.name} runs on ranks {list(task.ranks)} and a CSV cell holds one rank's action"
        owner = rank_of.setdefault(task.stage, task.ranks[0])
        if owner != task.ranks[0]:
            return f"stage {task.stage} runs on ranks {owner} and {task.ranks[0]}"
        kinds.setdefault(task.stage, []).append(task.kind)
    count = 1 + max(rank_of)
    if len(rank_of) != count:
        return f"stages {sorted(set(range(count)) - set(rank_of))} have no tasks (stages 0..{count - 1})"
    styles = [_STYLES.get(tuple(sorted(kinds[s]))) for s in range(count)]
    odd = next((s for s in range(count) if styles[s] is None or styles[s] != styles[0]), None)
    if odd is not None:
        return (f"stage {odd} has tasks {', '.join(sorted(kinds[odd]))} and stage 0 has "
                f"{', '.join(sorted(kinds[0]))}; a CSV gives every stage one backward style "
                "(F+B, F+I+W or F alone)")
    chain = stage_graph([Stage(ranks=rank_of[s]) for s in range(count)], backward=styles[0])
    problem = schedule.problem
    for s in range(1, count):
        if (s - 1, "F") not in problem.task((s, "F")).deps:
            return f"stage {s} does not depend on stage {s - 1} (a CSV chains stages 0 -> 1 -> ...)"
    for task in problem.tasks:
        want = chain.task(task.key).deps
        if set(task.deps) != set(want):
            names = [", ".join(sorted(map(task_name, deps))) or "nothing" for deps in (task.deps, want)]
            return f"task {task.name} waits for {names[0]}, but a CSV would make it wait for {names[1]}"
    if not schedule.ranks[-1]:
        return (f"rank {schedule.num_ranks - 1}, the last, has no actions, and blank rows at the end of "
                "a CSV are not ranks")
    return None


def _csv_rows(text: str) -> list[list[str]]:
    """The rows of ``text`` (strict CSV: a stray or unterminated quote is an error)."""
    reader = csv.reader(io.StringIO(text), strict=True)
    try:
        return list(reader)
    except csv.Error as error:
        raise ScheduleFormatError(
            f"malformed CSV at line {reader.line_num}: {error}; check the quote characters"
        ) from None


def schedule_from_csv(
    text: str,
    *,
    name: str = "csv",
    costs: Costs = Costs(),
    memory_limit: float | None = None,
) -> Schedule:
    """Read a compute-only torch CSV (empty cell = idle) and infer its problem.

    Row r is rank r. An empty row between rows is an idle rank; blank rows after the last row
    with an action are not ranks (files often end in blank lines). Stages form the chain
    0 -> 1 -> ... -> S-1, each on the one rank whose row runs it; the backward is split when
    any I or W appears. ``costs`` are a rank's share of the model (the library's convention),
    so a stage on a rank that runs v stages gets 1/v of them.
    """
    rows = _csv_rows(text)
    if not rows:
        raise ScheduleFormatError("the CSV is empty; expected one row of actions per rank")
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    ranks: list[tuple[Action, ...]] = []
    stage_rank: dict[int, int] = {}
    for r, row in enumerate(rows):
        actions = []
        for c, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                action = Action.parse(cell)
            except ScheduleFormatError as error:
                raise ScheduleFormatError(f"row {r + 1}, column {c + 1}: {error}") from None
            owner = stage_rank.setdefault(action.stage, r)
            if owner != r:
                raise ScheduleFormatError(
                    f"row {r + 1}: stage {action.stage} also runs on rank {owner}; a CSV schedule "
                    "keeps each stage on one rank (save multi-rank tasks as pipeloom JSON)"
                )
            actions.append(action)
        ranks.append(tuple(actions))
    problem = _csv_problem(ranks, stage_rank, costs, memory_limit)
    last_mb = max(action.microbatch for actions in ranks for action in actions)
    return Schedule(name=name, problem=problem, num_microbatches=last_mb + 1, ranks=tuple(ranks))


def _csv_problem(
    ranks: list[tuple[Action, ...]], stage_rank: dict[int, int], costs: Costs, memory_limit: float | None
) -> Problem:
    """The chain 0 -> ... -> S-1 with each stage on its rank and the backward style the actions use."""
    if not stage_rank:
        raise ScheduleFormatError("the CSV holds no actions")
    num_stages = 1 + max(stage_rank)
    missing = [s for s in range(num_stages) if s not in stage_rank]
    if missing:
        raise ScheduleFormatError(
            f"stages {missing} never run; a CSV schedule must run every stage 0..{num_stages - 1}"
        )
    kinds = {action.kind for actions in ranks for action in actions}
    if "B" in kinds and kinds & {"I", "W"}:
        raise ScheduleFormatError("the CSV mixes full backward B with split I/W; use one or the other")
    backward = "split" if kinds & {"I", "W"} else ("full" if "B" in kinds else "none")
    stages_on = Counter(stage_rank.values())
    return stage_graph(
        [costs.stage(stage_rank[s], share=1.0 / stages_on[stage_rank[s]]) for s in range(num_stages)],
        num_ranks=len(ranks),
        backward=backward,
        comm_latency=costs.comm,
        memory_limit=memory_limit,
    )


# ---------------------------------------------------------------------------------------- files


def save_schedule(schedule: Schedule, path: str | Path) -> None:
    """Write ``schedule`` as pipeloom JSON (``.json``) or torch compute-only CSV (``.csv``).

    The suffix is matched case-insensitively; nothing is written when the CSV cannot carry it.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        text = schedule_to_csv(schedule)
    elif suffix == ".json":
        text = schedule_to_json(schedule, indent=1) + "\n"
    else:
        raise ScheduleFormatError(f"cannot save {path}: use a .json or .csv suffix")
    path.write_text(text, encoding="utf-8")


def load_schedule(path: str | Path, *, costs: Costs = Costs()) -> Schedule:
    """Read a schedule saved as pipeloom JSON or torch CSV (chosen by suffix, any case).

    The file must be UTF-8 text (a leading byte-order mark is allowed).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise ScheduleFormatError(f"cannot read {path}: use a .json (pipeloom) or .csv (torch) file")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise ScheduleFormatError(f"cannot read {path}: not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ScheduleFormatError(f"cannot read {path}: {error.strerror or error}") from None
    if suffix == ".csv":
        return schedule_from_csv(text, name=path.stem, costs=costs)
    return schedule_from_json(text)
