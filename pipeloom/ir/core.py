"""Actions and schedules (docs/design.md §2): ``Action`` prints ``2F0``, ``Overlap`` (an overlapped forward and
backward pair) prints ``(0F7;7B3)OVERLAP_F_B``, ``Comm`` (made by lowering) prints ``1SEND_F0``; ``Schedule``
holds per-rank action lists with the problem they schedule; ``format_grid`` draws the step x rank grid for
errors.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any, NamedTuple, final

from pipeloom.errors import PipeloomError, ScheduleFormatError, shown
from pipeloom.problem import Problem

__all__ = [
    "COMM_KINDS",
    "OVERLAP_F_B",
    "Action",
    "Comm",
    "Overlap",
    "Schedule",
    "compute_parts",
    "format_grid",
    "parse_action",
]

COMM_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
"""Kinds of a communication action, torch's letters: send/receive forward values (F) or gradients (B)."""

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$", re.ASCII)
_COMM = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$", re.ASCII)
_OVERLAP = re.compile(r"^\(([^;()]*);([^;()]*)\)OVERLAP_F_B$", re.ASCII)
_MAX_DIGITS = 18  # indices beyond 10**18 are typos, and int() refuses more than 4300 digits


@final  # never subclassed: views and the simulator test `type(x) is Action`
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
                f"bad action {shown(text)}: expected STAGE KIND MICROBATCH with kind F, B, I or W, "
                "e.g. '2F0'"
            )
        if max(len(match.group(1)), len(match.group(3))) > _MAX_DIGITS:
            raise ScheduleFormatError(
                f"bad action {shown(text)}: an index is too long (over {_MAX_DIGITS} digits)"
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


@final  # never subclassed: views and the simulator test `type(x) is Action`
class Comm(NamedTuple):
    """A communication action of a lowered schedule, torch's ``sSEND_Fm`` and kin: ``Comm(1, "SEND_F", 0)``
    prints ``1SEND_F0``. It runs on the rank of ``stage`` (its own type: never a sentinel stage).

    - ``SEND_F``: send stage s's forward output of micro-batch m to its consumer stages on other ranks;
    - ``RECV_F``: receive stage s's forward inputs of m from its producer stages on other ranks;
    - ``SEND_B``: send stage s's input gradients of m back to its producer stages on other ranks;
    - ``RECV_B``: receive the gradients of stage s's outputs of m from its consumer stages on other ranks.

    One action covers every peer stage on another rank (see :mod:`pipeloom.lowering` for the order of
    its messages), so a linear pipeline reads exactly as torch writes it.
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_send(self) -> bool:
        """True for ``SEND_F``/``SEND_B``, False for the receives."""
        return self.kind.startswith("SEND")

    @property
    def direction(self) -> str:
        """``"F"`` for forward values, ``"B"`` for gradients."""
        return self.kind[-1]

    @classmethod
    def parse(cls, text: str) -> Comm:
        """Inverse of ``str``: ``Comm.parse("1SEND_F0") == Comm(1, "SEND_F", 0)``."""
        match = _COMM.match(text.strip()) if isinstance(text, str) else None
        if match is None or max(len(match.group(1)), len(match.group(3))) > _MAX_DIGITS:
            raise ScheduleFormatError(
                f"bad communication action {shown(text)}: expected STAGE KIND MICROBATCH with kind "
                "SEND_F, RECV_F, SEND_B or RECV_B, e.g. '1SEND_F0'"
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


OVERLAP_F_B = "OVERLAP_F_B"
"""torch's name of an overlapped forward + backward pair (its ``_ComputationType.OVERLAP_F_B``)."""


@final
@dataclass(frozen=True, slots=True)
class Overlap:
    """A forward and a backward run as one action on one rank (DualPipe's F&B pair): ``Overlap(Action(0,
    "F", 7), Action(7, "B", 3))`` prints ``(0F7;7B3)OVERLAP_F_B``, torch's text of such a pair.

    The pair starts when both parts' dependencies are met, takes a time of its own (by default the
    longer part plus the problem's ``overlap_overhead``) and changes memory by the sum of its parts;
    the runtime runs the forward, then the backward (see docs/semantics.md). Its own type: never a
    sentinel stage (torch writes stage -1).
    """

    forward: Action
    """The forward part (kind ``F``)."""
    backward: Action
    """The backward part (kind ``B``, or ``I``); a ``B`` on a split stage stands for its I and W."""

    def __post_init__(self) -> None:
        if type(self.forward) is not Action or self.forward.kind != "F":
            raise ScheduleFormatError(f"an overlapped pair's first part must be a forward like '0F7', got "
                                      f"{shown(self.forward)}")
        if type(self.backward) is not Action or self.backward.kind not in ("B", "I"):
            raise ScheduleFormatError(f"an overlapped pair's second part must be a backward like '7B3' (kind B "
                                      f"or I), got {shown(self.backward)}")

    def __str__(self) -> str:
        return f"({self.forward};{self.backward}){OVERLAP_F_B}"

    @property
    def parts(self) -> tuple[Action, Action]:
        """``(forward, backward)``, in the order the runtime runs them."""
        return (self.forward, self.backward)

    @classmethod
    def parse(cls, text: str) -> Overlap:
        """Inverse of ``str``: ``Overlap.parse("(0F7;7B3)OVERLAP_F_B")``."""
        match = _OVERLAP.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleFormatError(
                f"bad overlapped action {shown(text)}: expected (FORWARD;BACKWARD)OVERLAP_F_B, "
                "e.g. '(0F7;7B3)OVERLAP_F_B'"
            )
        try:
            return cls(Action.parse(match.group(1)), Action.parse(match.group(2)))
        except ScheduleFormatError as error:
            raise ScheduleFormatError(f"bad overlapped action {shown(text)}: {error}") from None


def compute_parts(action: Action | Overlap | Comm) -> tuple[Action, ...]:
    """The compute actions ``action`` runs, in order: itself, a pair's two parts, none for communication."""
    if type(action) is Action:
        return (action,)
    if type(action) is Overlap:
        return action.parts
    return ()


def parse_action(text: str) -> Action | Overlap | Comm:
    """A compute action (``2F0``), an overlapped pair (``(0F7;7B3)OVERLAP_F_B``) or a communication
    action (``1SEND_F0``) from its text; the error is the parser's of the form the text looks like."""
    if isinstance(text, str) and text.lstrip().startswith("("):
        return Overlap.parse(text)
    if isinstance(text, str) and ("SEND" in text or "RECV" in text):
        return Comm.parse(text)
    return Action.parse(text)


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """For each rank, the ordered actions it runs, plus the problem they schedule."""

    name: str
    """Schedule name, e.g. ``1f1b``."""
    problem: Problem
    """The task graph and machine the schedule is for."""
    num_microbatches: int
    """Number of micro-batches M; every task runs once for each of 0..M-1."""
    ranks: tuple[tuple[Action | Overlap | Comm, ...], ...]
    """``ranks[r]`` is rank r's action list in execution order (``Comm`` actions only after lowering)."""

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
    def lowered(self) -> bool:
        """Whether any rank list holds a communication action (see :func:`pipeloom.lower`)."""
        return any(Comm in set(map(type, actions)) for actions in self.ranks)

    @property
    def num_actions(self) -> int:
        """Total entries over all rank lists."""
        return sum(len(actions) for actions in self.ranks)

    def to_text(self) -> str:
        """One line per rank: ``rank 0: 0F0 0F1 0B0 ...`` (golden-snapshot friendly)."""
        return "\n".join(
            f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks)
        )

    def _repr_html_(self) -> str:
        """The interactive timeline a notebook shows (:func:`pipeloom.viz.html.notebook_html`)."""
        return import_module("pipeloom.viz.html").notebook_html(self)  # viz sits above ir: looked up on use


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

