"""The schedule library: one module per family and a registry mapping names to generators.

Every generator is a pure function ``(num_ranks, num_microbatches, *, costs, memory_limit, ...)
-> Schedule``; ``memory_limit=None`` is the schedule's own default memory (:data:`MemoryLimit`). Modules are
imported on first use, so listing names costs nothing.
"""

from __future__ import annotations

import difflib
import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

from pipeloom.errors import ArgumentError, ArgumentTypeError, PipeloomError
from pipeloom.ir import Schedule
from pipeloom.schedules.common import MemoryLimit
from pipeloom.stages import Costs

__all__ = ["PLACEMENT_KINDS", "MemoryLimit", "Placement", "ScheduleInfo", "REGISTRY", "build_schedule",
           "meant_schedule", "schedule_info", "schedule_names"]

Placement = Literal["linear", "interleaved", "v", "bidirectional"]
"""A placement: the kind of stage layout, how a schedule's stages sit on the ranks (see
:attr:`ScheduleInfo.placement`). Not the search catalog's placements
(:func:`pipeloom.search.placement`: a named per-micro-batch task graph on ranks, of which the
classic ones have these names); see docs/architecture.md's glossary."""
PLACEMENT_KINDS: tuple[str, ...] = get_args(Placement)
"""How a built-in schedule's stages sit on the ranks (:attr:`ScheduleInfo.placement`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleInfo:
    """A registry entry: where a generator lives and what it accepts."""

    name: str
    """Registry name, e.g. ``zb-h1``."""
    summary: str
    """One-line description for ``pipeloom list``."""
    module: str
    """Module (under ``pipeloom.schedules``) holding the generator."""
    function: str
    """Generator function name in that module."""
    options: tuple[str, ...] = ()
    """Keyword options beyond ``costs`` and ``memory_limit``, e.g. ``stages_per_rank``."""
    splits_backward: bool = False
    """Whether the schedule runs I and W instead of one B."""
    placement: Placement = "linear"
    """Its placement, the kind of stage layout: how its stages sit on the ranks: ``linear`` (stage r on
    rank r), ``interleaved`` (v looped stages per rank: stage s on rank s % p), ``v`` (rank r holds
    stages r and 2p-1-r) or ``bidirectional`` (two model replicas fed from both ends, each rank
    holding a piece of each). The planner cuts the model for it
    (:data:`pipeloom.plan.partitioning.shape.PartitionPlacement`); the exact layout of one schedule, stage by
    stage, is its shape (:func:`pipeloom.plan.partitioning.shape.schedule_shape`)."""
    memory_aware: bool = False
    """Whether it orders its actions for ``memory_limit`` (the planner tries it with the plan's limit)."""
    in_demo: bool = False
    """Shown by ``pipeloom demo``."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENT_KINDS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENT_KINDS)}, got {self.placement!r}")

    @property
    def replicas(self) -> int:
        """Model copies the schedule runs (2 for the bidirectional ones)."""
        return 2 if self.placement == "bidirectional" else 1

    def num_pieces(self, num_ranks: int, options: Mapping[str, int] | None = None) -> int:
        """Pieces the model is cut into on ``num_ranks`` ranks: p (linear, and bidirectional: each
        rank holds a piece of each replica), p*v (interleaved, v = ``stages_per_rank``, default 2) or
        2p (v)."""
        if self.placement == "interleaved":
            return num_ranks * int((options or {}).get("stages_per_rank", 2))
        return 2 * num_ranks if self.placement == "v" else num_ranks

    def num_actions(self, num_ranks: int, num_microbatches: int, options: Mapping[str, int] | None = None) -> int:
        """The schedule's (task, micro-batch) pairs, its compute actions before pairs or full backwards merge
        any: every stage of every replica (:meth:`num_pieces` x :attr:`replicas`) runs F and B (or F, I and W)
        of each of its micro-batches (a replica takes half of them)."""
        stages = self.num_pieces(num_ranks, options) * self.replicas
        return -(-num_microbatches // self.replicas) * stages * (3 if self.splits_backward else 2)

    @property
    def generator(self) -> Callable[..., Schedule]:
        """The generator function (imports its module on first use)."""
        module = importlib.import_module(f"pipeloom.schedules.{self.module}")
        return getattr(module, self.function)


_BY_NAME: dict[str, ScheduleInfo] = {info.name: info for info in (
    ScheduleInfo(name="gpipe", module="gpipe", function="gpipe", in_demo=True,
                 summary="all forwards, then all backwards; memory m"),
    ScheduleInfo(name="1f1b", module="one_f_one_b", function="one_f_one_b", in_demo=True,
                 summary="warm-up forwards, then one forward / one backward; memory p"),
    ScheduleInfo(name="interleaved-1f1b", module="interleaved", function="interleaved_1f1b",
                 options=("stages_per_rank",), placement="interleaved", in_demo=True,
                 summary="Megatron interleaved 1F1B, v looped stages per rank; bubble / v"),
    ScheduleInfo(name="looped-bfs", module="looped_bfs", function="looped_bfs",
                 options=("stages_per_rank",), placement="interleaved",
                 summary="v looped stages per rank, breadth-first: each stage's forwards together"),
    ScheduleInfo(name="interleaved-zb", module="interleaved_zb", function="interleaved_zb",
                 options=("stages_per_rank",), splits_backward=True, placement="interleaved", memory_aware=True,
                 summary="zero bubble on v looped stages per rank; never slower than torch's "
                         "InterleavedZeroBubble, at its memory"),
    ScheduleInfo(name="zb-h1", module="zero_bubble", function="zb_h1", splits_backward=True, in_demo=True,
                 summary="zero-bubble H1: split backward, W fills bubbles; 1F1B memory"),
    ScheduleInfo(name="zb-h2", module="zero_bubble", function="zb_h2", splits_backward=True, in_demo=True,
                 summary="zero-bubble H2: more warm-up forwards, near-zero bubble; about 2p memory"),
    ScheduleInfo(name="zbv", module="zbv", function="zbv", splits_backward=True, placement="v",
                 memory_aware=True, in_demo=True,
                 summary="zero-bubble V: 2 stages per rank in a V, cost- and memory-aware"),
    ScheduleInfo(name="v-half", module="v_memory", function="v_half", splits_backward=True, placement="v",
                 memory_aware=True, summary="V-Half: V placement at (p+2)//2 activation memory, about half of 1F1B"),
    ScheduleInfo(name="v-min", module="v_memory", function="v_min", splits_backward=True, placement="v",
                 memory_aware=True, summary="V-Min: V placement at (p+4)//3 activation memory, about a third of 1F1B"),
    ScheduleInfo(name="dualpipev", module="dualpipe", function="dualpipev", splits_backward=True, placement="v",
                 in_demo=True, summary="DualPipeV: bidirectional V, 2 stages per rank, one model copy"),
    ScheduleInfo(name="dualpipe", module="dualpipe", function="dualpipe", splits_backward=True,
                 placement="bidirectional", summary="DualPipe: two model replicas fed from both ends; even ranks"),
    ScheduleInfo(name="chimera", module="chimera", function="chimera", placement="bidirectional", options=("order",),
                 summary="Chimera: two opposite 1F1B pipelines sharing the micro-batches"),
)}
REGISTRY: Mapping[str, ScheduleInfo] = MappingProxyType(_BY_NAME)
"""Every built-in schedule by name: the one home of their names, placements and options, read by the
planner, the search, the demo and the tests."""


def schedule_names() -> tuple[str, ...]:
    """Names of the built-in schedules, in registry order."""
    return tuple(REGISTRY)


def meant_schedule(name: str, *, among: Iterable[str] | None = None) -> str:
    """`` (did you mean 'zbv'?)`` for a name that is a built-in schedule's (or one of ``among``'s: those the caller
    takes) spelt otherwise: the same letters and digits (``zb-v``, ``ZBV``, ``interleaved_1f1b``) or close to one
    (``interleaved``, ``dualpipe-vee``); empty if none is."""
    def bare(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    by_bare, key = {bare(known): known for known in (REGISTRY if among is None else among)}, bare(name)
    spelt = next((known for known in REGISTRY if bare(known) == key), None)
    if spelt is not None and spelt not in by_bare.values():  # zb_h2 where zb-h2 is not taken: not zb-h1
        return f" (did you mean {spelt!r}? it is not among those taken here)"
    if key in by_bare:
        meant = [by_bare[key]]
    else:  # the names it begins (interleaved: both interleaved schedules), else the closest spelling
        meant = [known for b, known in by_bare.items() if key and b.startswith(key)] or [
            by_bare[b] for b in difflib.get_close_matches(key, by_bare, n=1, cutoff=0.7)]
    return f" (did you mean {' or '.join(map(repr, meant))}?)" if meant else ""


def schedule_info(name: str) -> ScheduleInfo:
    """The registry entry for ``name``; PipeloomError listing the names if unknown."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise PipeloomError(
            f"unknown schedule {name!r}{meant_schedule(name)}; choose one of: {', '.join(REGISTRY)}"
        ) from None


def _check_size(info: ScheduleInfo, ranks: int, microbatches: int, per_rank: object) -> None:
    """ArgumentError before building a schedule of more actions than a problem holds (:data:`~pipeloom.problem.
    MAX_INTERVALS`), counted over the stages the ranks hold (a bidirectional rank holds a piece of each replica):
    ``1f1b`` over 10**12 micro-batches had run the machine out of memory."""
    from pipeloom.problem import MAX_INTERVALS

    known = {"stages_per_rank": per_rank} if isinstance(per_rank, int) and not isinstance(per_rank, bool) else {}
    actions = info.num_actions(ranks, microbatches, known)  # an option of the wrong kind: the generator says so
    if actions > MAX_INTERVALS:
        shape = f"p={ranks}, m={microbatches}" + (f", stages_per_rank={per_rank}" if per_rank is not None else "")
        raise ArgumentError(f"{info.name} with {shape} would have about {actions:,} actions, more than the "
                            f"{MAX_INTERVALS:,} a schedule may hold (pipeloom.problem.MAX_INTERVALS): use fewer ranks, "
                            "micro-batches or stages per rank")


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
    **options: object,
) -> Schedule:
    """Build the built-in schedule ``name``; options it does not take are an error.

    ``memory_limit``: the per-rank memory the schedule's problem carries; None is the schedule's own default
    (:data:`MemoryLimit`: no limit, or for a memory-aware schedule the memory its docstring states).

    Arguments of the wrong type raise :class:`~pipeloom.errors.ArgumentTypeError` (a TypeError and a
    PipeloomError), bad counts :class:`~pipeloom.errors.ArgumentError`, before anything is built.
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a schedule name (str), got {type(name).__name__}; "
                                f"choose one of: {', '.join(REGISTRY)}")
    info = schedule_info(name)
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(f"{label} must be an integer, got {type(value).__name__} {value!r}")
    if not isinstance(costs, Costs):
        raise ArgumentTypeError(f"costs must be a pipeloom.Costs (e.g. Costs(f=1, b=2, w=1)), got "
                                f"{type(costs).__name__} {costs!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float))):
        raise ArgumentTypeError(f"memory_limit must be a number or None, got {type(memory_limit).__name__} "
                                f"{memory_limit!r}")
    total = (costs.f + costs.b + costs.w + costs.comm + abs(costs.memory)) * 4.0 * max(num_microbatches, 1)
    if not math.isfinite(total):
        given = ", ".join(f"{name}={getattr(costs, name):g}" for name in ("f", "b", "w", "comm", "memory")
                          if getattr(costs, name))  # the fields a user sets, not the dataclass's repr
        raise ArgumentError(f"costs {given} over {num_microbatches} micro-batches overflow the float range when "
                            "added up; scale the costs down (e.g. seconds to milliseconds, bytes to MiB)")
    unknown = sorted(set(options) - set(info.options))
    if unknown:
        takes = ", ".join(info.options) if info.options else "no extra options"
        raise PipeloomError(f"schedule {name!r} does not take {', '.join(unknown)} (it takes {takes})")
    _check_size(info, num_ranks, num_microbatches, options.get("stages_per_rank"))
    return info.generator(num_ranks, num_microbatches, costs=costs, memory_limit=memory_limit, **options)
