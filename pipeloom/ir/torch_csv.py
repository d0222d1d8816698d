"""torch.distributed.pipelining's per-rank CSV, ``compute_only`` or (a lowered schedule)
``compute_comms``: export (when the reader would infer the same problem back) and import
(inferring the chained stage graph from the actions).
"""

from __future__ import annotations

import csv
import io
import itertools
import re
from collections import Counter
from collections.abc import Sequence

from pipeloom.errors import ScheduleFormatError, shown_list
from pipeloom.ir.core import Action, Comm, Overlap, Schedule, compute_parts, parse_action
from pipeloom.ir.jsonfields import check_text
from pipeloom.problem import Problem, task_name
from pipeloom.stages import Backward, Costs, Stage, stage_graph

__all__ = ["TORCH_ONLY_KINDS", "schedule_to_csv", "schedule_from_csv"]

TORCH_ONLY_KINDS: tuple[str, ...] = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
"""Actions torch's lowering adds for FSDP and data-parallel gradient reduction (``1UNSHARD``, no
micro-batch); pipeloom's IR has no such actions, so the CSV reader skips these cells."""


def schedule_to_csv(schedule: Schedule, *, reduce_grad: bool | None = None) -> str:
    """torch.distributed.pipelining's CSV: one row per rank, one action per cell.

    A compute-only schedule gives torch's ``compute_only`` format; a lowered one (see
    :func:`pipeloom.lower`) its ``compute_comms`` format, which ``_PipelineScheduleRuntime._load_csv(
    path, format="compute_comms")`` runs as it is, with torch's ``sREDUCE_GRAD`` cells where
    ``reduce_grad`` (default: unless the torch installed here is older than 2.10, which cannot read them;
    2.10 and later divide the gradients by M there only). Only a schedule whose problem
    :func:`schedule_from_csv` would infer again can be written (ScheduleFormatError otherwise);
    durations, memory and static memory are not carried.
    """
    obstacle = _csv_obstacle(schedule)
    if obstacle is not None:
        raise ScheduleFormatError(
            f"schedule {schedule.name!r} cannot be saved as torch CSV because {obstacle}; save it as .json"
        )
    cells = schedule.lowered and (_torch_reads_reduce_grad() if reduce_grad is None else reduce_grad)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in schedule.ranks:
        writer.writerow(_with_reduce_grad(actions, schedule.num_microbatches) if cells
                        else [str(action) for action in actions])
    return out.getvalue()


def _torch_reads_reduce_grad() -> bool:
    """Whether the torch installed here reads ``REDUCE_GRAD`` cells: 2.10 and later, or none installed (the file is
    then for a current torch). Read from the package's metadata: torch is not imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        numbers = re.findall(r"\d+", version("torch"))[:2]
    except PackageNotFoundError:
        return True
    return len(numbers) < 2 or (int(numbers[0]), int(numbers[1])) >= (2, 10)


def _with_reduce_grad(actions: Sequence[Action | Overlap | Comm], num_microbatches: int) -> list[str]:
    """One rank's cells with torch's ``sREDUCE_GRAD`` after each stage's last gradient action (its M-th
    ``B`` or ``W``) and the sends right after it, where torch's own lowering puts it: torch 2.10 and later
    divide the gradients by M only there, so a ``compute_comms`` file without it trains with gradients M
    times too large."""
    cells: list[str] = []
    done: Counter[int] = Counter()
    pending: list[int] = []
    for action in actions:
        if pending and not (type(action) is Comm and action.is_send):
            cells += [f"{stage}REDUCE_GRAD" for stage in pending]
            pending.clear()
        cells.append(str(action))
        for part in compute_parts(action):
            if part.kind in ("B", "W"):
                done[part.stage] += 1
                pending += [part.stage] * (done[part.stage] == num_microbatches)
    return cells + [f"{stage}REDUCE_GRAD" for stage in pending]


_STYLES: dict[tuple[str, ...], Backward] = {("F",): "none", ("B", "F"): "full", ("F", "I", "W"): "split"}


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
        return f"stages {shown_list(sorted(set(range(count)) - set(rank_of)))} have no tasks (stages 0..{count - 1})"
    styles = [_STYLES.get(tuple(sorted(kinds[s]))) for s in range(count)]
    odd = next((s for s in range(count) if styles[s] is None or styles[s] != styles[0]), None)
    if odd is not None:
        return (f"stage {odd} has tasks {', '.join(sorted(kinds[odd]))} and stage 0 has "
                f"{', '.join(sorted(kinds[0]))}; a CSV gives every stage one backward style "
                "(F+B, F+I+W or F alone)")
    backward = styles[0]
    assert backward is not None, "a stage of no known style is the odd one above"
    chain = stage_graph([Stage(ranks=(rank_of[s],)) for s in range(count)], backward=backward)
    problem = schedule.problem
    for s in range(1, count):
        if (s - 1, "F") not in problem.task((s, "F")).deps:
            return f"stage {s} does not depend on stage {s - 1} (a CSV chains stages 0 -> 1 -> ...)"
    have, want = problem.waits_for(), chain.waits_for()
    for task in problem.tasks:
        if have[task.key] != want.get(task.key, 0):
            names = [", ".join(map(task_name, graph.keys_in(bits[task.key]))) or "nothing"
                     for graph, bits in ((problem, have), (chain, want))]
            return (f"task {task.name} waits for {names[0]}, but a CSV would make it wait for {names[1]} "
                    "(directly or through others)")
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
    """Read a torch CSV (empty cell = idle) and infer its problem.

    A file with communication cells (``1SEND_F0``: torch's ``compute_comms`` format) gives a lowered schedule;
    cells of :data:`TORCH_ONLY_KINDS` (``0UNSHARD``, ...) are skipped. Row r is rank r. An empty row between
    rows is an idle rank; blank rows after the last row with an action are not ranks (files often end in blank
    lines). Stages form the chain 0 -> 1 -> ... -> S-1, each on the one rank whose row runs it; the backward
    is split when any I or W appears (a ``B`` then runs its stage's I and W as one action). Overlapped pairs
    (``(0F7;7B3)OVERLAP_F_B``, torch's DualPipeV) load as :class:`~pipeloom.ir.Overlap`. ``costs`` are a
    rank's share of the model (the library's convention), so a stage on a rank that runs v stages gets 1/v of
    them.
    """
    rows = _csv_rows(check_text(text, what="CSV"))
    if not rows:
        raise ScheduleFormatError("the CSV is empty; expected one row of actions per rank")
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    ranks: list[tuple[Action | Overlap | Comm, ...]] = []
    stage_rank: dict[int, int] = {}
    for r, row in enumerate(rows):
        actions = []
        for c, cell in enumerate(row):
            if not cell.strip() or cell.strip().lstrip("0123456789") in TORCH_ONLY_KINDS:
                continue
            try:
                action = parse_action(cell)
            except ScheduleFormatError as error:
                raise ScheduleFormatError(f"row {r + 1}, column {c + 1}: {error}") from None
            for part in _placed_parts(action):
                owner = stage_rank.setdefault(part.stage, r)
                if owner != r:
                    raise ScheduleFormatError(
                        f"row {r + 1}: stage {part.stage} also runs on rank {owner}; a CSV schedule "
                        "keeps each stage on one rank (save multi-rank tasks as pipeloom JSON)"
                    )
            actions.append(action)
        ranks.append(tuple(actions))
    problem = _csv_problem(ranks, stage_rank, costs, memory_limit)
    last_mb = max(part.microbatch for actions in ranks for action in actions for part in _placed_parts(action))
    return Schedule(name=name, problem=problem, num_microbatches=last_mb + 1, ranks=tuple(ranks))


def _placed_parts(action: Action | Overlap | Comm) -> tuple[Action | Comm, ...]:
    """The compute actions ``action`` runs, or a communication action itself: each names a stage and a micro-batch."""
    return (action,) if type(action) is Comm else compute_parts(action)


def _csv_problem(
    ranks: list[tuple[Action | Overlap | Comm, ...]], stage_rank: dict[int, int], costs: Costs,
    memory_limit: float | None,
) -> Problem:
    """The chain 0 -> ... -> S-1 with each stage on its rank and the backward style the actions use."""
    if not stage_rank:
        raise ScheduleFormatError("the CSV holds no actions")
    num_stages = 1 + max(stage_rank)
    absent = num_stages - len(stage_rank)
    if absent:  # the first few named, without listing the rest (a stage of 18 digits leaves that many)
        first = list(itertools.islice((s for s in range(num_stages) if s not in stage_rank), 6))
        raise ScheduleFormatError(
            f"stages {shown_list(first, total=absent)} never run; a CSV schedule must run every stage "
            f"0..{num_stages - 1}"
        )
    kinds = {part.kind for actions in ranks for action in actions for part in compute_parts(action)}
    # With I or W anywhere the backward is split; a B then stands for its stage's I and W run together
    # (a full backward on a split stage, as torch's DualPipeV writes some).
    backward: Backward = "split" if kinds & {"I", "W"} else ("full" if "B" in kinds else "none")
    stages_on = Counter(stage_rank.values())
    return stage_graph(
        [costs.stage(stage_rank[s], share=1.0 / stages_on[stage_rank[s]]) for s in range(num_stages)],
        num_ranks=len(ranks),
        backward=backward,
        comm_latency=costs.comm,
        memory_limit=memory_limit,
        overlap_fraction=costs.overlap,
        pair_time=costs.pair_time,
    )

