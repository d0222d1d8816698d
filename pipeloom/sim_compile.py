"""A schedule's rank lists compiled for the replay (:class:`~pipeloom.sim_replay.CompiledSchedule`): each action as a
task index and a micro-batch, composite actions (an overlapped pair, a full ``B`` on a split stage) numbered once
per template, and the micro-batches numbered densely."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

from pipeloom.errors import ScheduleError
from pipeloom.ir import Action, Overlap, Schedule
from pipeloom.sim_pricing import Composite, composite_of

__all__ = ["Links", "compile_lists"]

Links = tuple[tuple[tuple[int, bool], ...], tuple[int, ...]]
"""A composite's dependencies outside it and the slots it completes, less its first part's micro-batch
(:meth:`~pipeloom.sim_pricing.Composite.links`)."""

# Applied to plain actions only (Action or Comm tuples: ``_compile`` rules out an Overlap first).
_TASK_KEY: Callable[[Any], tuple[int, str]] = itemgetter(0, 1)
_MICROBATCH: Callable[[Any], int] = itemgetter(2)


def compile_lists(schedule: Schedule, index: dict[tuple[int, str], int]) -> tuple[
        tuple[list, ...], tuple[list, ...], dict[int, int], tuple[Composite, ...], list[Links]]:
    """Per rank its task indices and dense micro-batches (a composite is index ``len(index) + k`` for template
    ``k``, its micro-batch its first part's), the dense numbering, the composite templates and their links. Where
    the lists use every micro-batch a template stands for every micro-batch (its parts' offsets from the first
    are the replay's too); where they do not, the dense numbers do not keep the offsets, and each action is its own
    template."""
    problem = schedule.problem
    found = _Found(per_action=False)
    seq_tasks, seq_mbs = zip(*(_compile(schedule, r, index, found) for r in range(problem.num_ranks)))
    # conservative: a micro-batch named only by a pair's second part also sends the lists down the per-action path
    if len(set().union(*map(set, seq_mbs))) != schedule.num_microbatches:
        found = _Found(per_action=True)
        seq_tasks, seq_mbs = zip(*(_compile(schedule, r, index, found) for r in range(problem.num_ranks)))
    composites = tuple(found.composites)
    # the parts' micro-batches, for the dense numbering; per template only its first action's, which is all of them
    # where each action is its own template, and where templates are shared the numbering is kept whatever they are
    extra = {first + mb for c, first in zip(composites, found.firsts) for unit in c.units for _, mb in unit}
    seq_mbs, dense = _densify(seq_mbs, schedule.num_microbatches, extra)
    links = [_shifted_links(c, first, problem, index, dense) for c, first in zip(composites, found.firsts)]
    return seq_tasks, seq_mbs, dense, composites, links


class _Found:
    """The composite templates met so far while compiling (:attr:`CompiledSchedule.composites`), each numbered once,
    with the first part's micro-batch of the action that made each (:attr:`firsts`)."""

    def __init__(self, *, per_action: bool) -> None:
        self.per_action = per_action
        self.number: dict[Any, int | None] = {}  # template -> its number; None: names no task of the problem
        self.composites: list[Composite] = []
        self.firsts: list[int] = []
        self.spans: list[tuple[int, int]] = []  # per template, its parts' least and greatest micro-batch offset

    def key(self, action: Action | Overlap) -> Any:
        """What decides a composite's template: its parts' stages and kinds and their micro-batches less its first
        part's (per action: the action itself)."""
        if self.per_action:
            return action
        if type(action) is Overlap:
            forward, backward = action.parts
            return forward.stage, forward.kind, backward.stage, backward.kind, backward.microbatch - forward.microbatch
        return action.stage, action.kind


def _compile(schedule: Schedule, rank: int, index: dict[tuple[int, str], int], found: _Found) -> tuple[list, list]:
    """Task indices and micro-batches of ``rank``'s list (C-level maps: no per-action Python code,
    unless the list holds composite actions, which get indices after the tasks' in ``found``)."""
    actions = schedule.ranks[rank]
    tasks: list[int | None]
    mbs: list[int]
    if Overlap in set(map(type, actions)):  # a plain action beside pairs is still its task (a multi-rank one joins)
        tasks = [None if type(a) is Overlap else index.get(_TASK_KEY(a)) for a in actions]
        mbs = [0 if type(a) is Overlap else _MICROBATCH(a) for a in actions]
    else:
        tasks = list(map(index.get, map(_TASK_KEY, actions)))
        mbs = list(map(_MICROBATCH, actions))
    if None in tasks:
        for i, action in enumerate(actions):
            if tasks[i] is None:
                tasks[i], mbs[i] = _composite_index(schedule, index, action, found)
    if None in tasks or (mbs and (min(mbs) < 0 or max(mbs) >= schedule.num_microbatches)):
        step = next(
            i for i, (t, mb) in enumerate(zip(tasks, mbs))
            if t is None or not 0 <= mb < schedule.num_microbatches
        )
        raise ScheduleError(
            f"rank {rank} step {step}: {actions[step]} is not a task of this schedule's problem "
            "(run the validator for details)"
        )
    return tasks, mbs


def _composite_index(schedule: Schedule, index: dict, action, found: _Found) -> tuple[int | None, int]:
    """``(index, micro-batch)`` of a composite action (its template's, :class:`_Found`; the first part's
    micro-batch; its parts' are checked), or ``(None, 0)`` when ``action`` is none of the problem's."""
    if type(action) not in (Action, Overlap):
        return None, 0
    key = found.key(action)
    first = action.forward.microbatch if type(action) is Overlap else action.microbatch
    if key not in found.number:
        composite = composite_of(schedule.problem, index, action)
        if composite is None:
            found.number[key] = None
        else:
            found.number[key] = len(found.composites)
            units = tuple(tuple((t, mb - first) for t, mb in unit) for unit in composite.units)
            found.composites.append(Composite(action, units, composite.overlapped))
            found.firsts.append(first)
            offsets = [mb for unit in units for _, mb in unit]
            found.spans.append((min(offsets), max(offsets)))
    k = found.number[key]
    if k is None:
        return None, 0
    low, high = found.spans[k]
    if first + low < 0 or first + high >= schedule.num_microbatches:
        return None, -1
    return len(index) + k, first


def _shifted_links(composite: Composite, first: int, problem: Any, index: dict[tuple[int, str], int],
                   dense: dict[int, int]) -> tuple[tuple[tuple[int, bool], ...], tuple[int, ...]]:
    """:meth:`Composite.links` of a template (its first part at micro-batch 0) as made by the action at ``first``,
    its slots less the first part's replay number (the replay adds it back, as for a dependency)."""
    made = Composite(composite.action, tuple(tuple((t, first + mb) for t, mb in unit) for unit in composite.units),
                     composite.overlapped)
    external, slots = made.links(problem, index, len(dense), dense)
    return external, tuple(slot - dense[first] for slot in slots)


def _densify(seq_mbs: tuple[list[int], ...], num_mb: int,
             extra: Iterable[int] = frozenset()) -> tuple[tuple[list[int], ...], dict[int, int]]:
    """Renumber the micro-batches the lists use (and ``extra``: composite parts') as 0..K-1
    (K <= actions) and return that map.

    The replay keeps one slot per (task, micro-batch); a micro-batch no action names has no slot
    anyone waits on, so a schedule claiming M = 10**12 costs memory by its actions, not by M.
    """
    used = sorted(set(extra).union(*map(set, seq_mbs)))
    if len(used) == num_mb:  # every micro-batch appears (a complete schedule): keep the numbers
        return seq_mbs, dict(zip(used, used))
    dense = {mb: i for i, mb in enumerate(used)}
    return tuple(list(map(dense.__getitem__, mbs)) for mbs in seq_mbs), dense
