"""The stage-graph builder: model fragments (``Stage``), one rank's per-micro-batch ``Costs``, and
``stage_graph``, which derives a :class:`~pipeloom.problem.Problem`'s task graph from them (docs/design.md §1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pipeloom.errors import ProblemError
from pipeloom.problem import Problem, Task, _check_number

__all__ = ["Backward", "Costs", "Stage", "stage_graph"]

Backward = Literal["full", "split", "none"]
"""How the stage-graph builder derives backward tasks: one B, I+W, or none (inference)."""

@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """A model fragment in a stage graph: where it runs and what it costs per micro-batch."""

    ranks: tuple[int, ...]
    """Ranks the stage occupies (an int is taken as one rank)."""
    f: float = 1.0
    """Forward time."""
    b: float = 1.0
    """Input-gradient backward time (I); a full backward B takes ``b + w``."""
    w: float = 1.0
    """Weight-gradient backward time (W)."""
    memory: float = 1.0
    """Activation memory the forward takes and the backward releases."""
    w_memory: float = 0.0
    """Part of ``memory`` still held after I and released by W (split backward only)."""
    f_comm: float = 0.0
    """Part of ``f`` spent waiting on communication inside the forward (e.g. an MoE all-to-all)."""
    b_comm: float = 0.0
    """Part of ``b`` spent waiting on communication inside the input-gradient backward."""

    def __post_init__(self) -> None:
        ranks = (self.ranks,) if isinstance(self.ranks, int) else tuple(self.ranks)
        object.__setattr__(self, "ranks", ranks)
        for name in ("f", "b", "w", "memory", "w_memory", "f_comm", "b_comm"):
            object.__setattr__(self, name, _check_number(f"stage {name}", getattr(self, name)))
        _check_comm_parts("stage", self.f, self.b, self.f_comm, self.b_comm)
        if self.w_memory > self.memory:
            raise ProblemError(
                f"stage w_memory {self.w_memory:g} exceeds its memory {self.memory:g}; "
                "W can release at most what F took"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """Per-micro-batch costs of one rank's share of the model (a stage of the 1F1B layout).

    A schedule that cuts each rank's share into ``v`` stages gives each of them ``1/v`` of the
    time and memory, so every schedule of the library runs the same model.
    """

    f: float = 1.0
    """Forward time."""
    b: float = 1.0
    """Input-gradient backward time; schedules without split backward run one B of ``b + w``."""
    w: float = 1.0
    """Weight-gradient backward time."""
    comm: float = 0.0
    """Communication latency between ranks."""
    memory: float = 1.0
    """Activation memory one forward takes (1 = "one micro-batch of activations")."""
    w_memory: float = 0.0
    """Part of ``memory`` held until W when the backward is split."""
    f_comm: float = 0.0
    """Part of ``f`` spent waiting on communication inside the forward (an overlapped pair can hide it)."""
    b_comm: float = 0.0
    """Part of ``b`` spent waiting on communication inside the backward (an overlapped pair can hide it)."""
    overlap: float = 0.0
    """``Problem.overlap_fraction`` of the schedules built: 0 (default) runs a pair's compute one part after
    the other, 1 prices it as ``max(F, B)``."""
    pair_time: float | None = None
    """``Problem.pair_time`` of the schedules built: a measured time of one overlapped pair (None: priced)."""

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm", "memory", "w_memory", "f_comm", "b_comm", "overlap"):
            object.__setattr__(self, name, _check_number(f"cost {name}", getattr(self, name)))
        _check_comm_parts("cost", self.f, self.b, self.f_comm, self.b_comm)
        if self.overlap > 1:
            raise ProblemError(f"cost overlap must be between 0 and 1, got {self.overlap!r}")
        if self.pair_time is not None:
            object.__setattr__(self, "pair_time", _check_number("cost pair_time", self.pair_time))
        if self.w_memory > self.memory:
            raise ProblemError(
                f"w_memory {self.w_memory:g} exceeds memory {self.memory:g}; W can release at most what F took"
            )

    def stage(self, ranks: int | Sequence[int], *, share: float = 1.0) -> Stage:
        """A stage on ``ranks`` carrying ``share`` of these costs (``1/v`` for v stages per rank)."""
        return Stage(
            ranks=(ranks,) if isinstance(ranks, int) else tuple(ranks),
            f=self.f * share,
            b=self.b * share,
            w=self.w * share,
            memory=self.memory * share,
            w_memory=self.w_memory * share,
            f_comm=self.f_comm * share,
            b_comm=self.b_comm * share,
        )


def _check_comm_parts(what: str, f: float, b: float, f_comm: float, b_comm: float) -> None:
    """ProblemError when a communication part exceeds the time it is part of."""
    for name, part, whole in (("f_comm", f_comm, f), ("b_comm", b_comm, b)):
        if part > whole:
            raise ProblemError(f"{what} {name} {part:g} exceeds {name[0]} {whole:g}; it is the part of "
                               f"{name[0]} spent communicating")


def _edge_lists(
    edges: Sequence[tuple[int, int]] | None, count: int
) -> tuple[list[list[int]], list[list[int]]]:
    """``(producers, consumers)`` of each of ``count`` stages; ``edges=None`` is the chain.

    Each edge must be a (producer, consumer) pair of distinct stage indices; a repeated edge
    counts once, and the lists keep the order edges first appear in.
    """
    if edges is None:
        edges = [(s, s + 1) for s in range(count - 1)]
    producers: list[list[int]] = [[] for _ in range(count)]
    consumers: list[list[int]] = [[] for _ in range(count)]
    for edge in edges:
        if not isinstance(edge, (tuple, list)) or len(edge) != 2:
            raise ProblemError(f"edge {edge!r} must be a (producer, consumer) pair of stage indices")
        u, v = edge
        for s in (u, v):
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < count:
                raise ProblemError(f"edge {edge!r} names stage {s!r}; stages are 0..{count - 1}")
        if u == v:
            raise ProblemError(f"edge {edge!r} joins stage {u} to itself; remove it")
        if v not in consumers[u]:
            consumers[u].append(v)
            producers[v].append(u)
    return producers, consumers


def _stage_tasks(
    s: int, stage: Stage, producers: list[int], consumers: list[int], backward: Backward
) -> list[Task]:
    """The tasks of stage ``s`` with the deps of docs/design.md §1 (see :func:`stage_graph`)."""
    forward = Task(
        stage=s, kind="F", ranks=stage.ranks, duration=stage.f,
        memory=0.0 if backward == "none" else stage.memory,
        deps=tuple((u, "F") for u in producers), comm=stage.f_comm,
    )
    if backward == "none":
        return [forward]
    back = "I" if backward == "split" else "B"
    deps = ((s, "F"),) + tuple((v, back) for v in consumers)
    if backward == "full":
        return [forward, Task(stage=s, kind="B", ranks=stage.ranks, duration=stage.b + stage.w,
                              memory=-stage.memory, deps=deps, comm=stage.b_comm)]
    return [
        forward,
        Task(stage=s, kind="I", ranks=stage.ranks, duration=stage.b,
             memory=-(stage.memory - stage.w_memory), deps=deps, comm=stage.b_comm),
        Task(stage=s, kind="W", ranks=stage.ranks, duration=stage.w,
             memory=-stage.w_memory, deps=((s, "I"),)),
    ]


def stage_graph(
    stages: Sequence[Stage],
    *,
    num_ranks: int | None = None,
    edges: Sequence[tuple[int, int]] | None = None,
    backward: Backward = "full",
    comm_latency: float = 0.0,
    memory_limit: float | None = None,
    static_memory: Sequence[float] | None = None,
    overlap_fraction: float = 0.0,
    pair_time: float | None = None,
) -> Problem:
    """Derive the task graph of docs/design.md §1 from stages and forward edges.

    F(s) waits for F(u) of every producer u; B or I of s waits for F(s) and for B/I of every
    consumer of s; W(s) waits for I(s). ``edges`` default to the chain 0 -> 1 -> ... -> S-1.
    ``backward="full"`` gives one B per stage (``b + w``), ``"split"`` gives I (``b``) and
    W (``w``), ``"none"`` gives forward-only tasks with no memory (inference). ``overlap_fraction`` and
    ``pair_time`` price overlapped pairs (see :class:`Problem`).
    """
    if backward not in ("full", "split", "none"):
        raise ProblemError(f"backward must be 'full', 'split' or 'none', got {backward!r}")
    stages = list(stages)
    if not stages:
        raise ProblemError("the stage graph has no stages; give at least one")
    producers, consumers = _edge_lists(edges, len(stages))
    if num_ranks is None:
        num_ranks = 1 + max(max(stage.ranks, default=0) for stage in stages)
    tasks = [
        task
        for s, stage in enumerate(stages)
        for task in _stage_tasks(s, stage, producers[s], consumers[s], backward)
    ]
    return Problem(
        num_ranks=num_ranks,
        tasks=tuple(tasks),
        comm_latency=comm_latency,
        memory_limit=memory_limit,
        static_memory=None if static_memory is None else tuple(static_memory),
        overlap_fraction=overlap_fraction,
        pair_time=pair_time,
    )
