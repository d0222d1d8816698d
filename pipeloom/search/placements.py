"""The placement catalog: docs/design.md §6's Tessel placements and the classic linear, V and interleaved ones.

``placement(name, num_ranks)`` returns the per-micro-batch Problem. The classic placements are the
very problems the built-in schedules build with ``Costs()``, so a search can warm-start from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from pipeloom.errors import PipeloomError
from pipeloom.problem import Problem
from pipeloom.schedules import REGISTRY
from pipeloom.schedules.common import chain_problem, v_stage_ranks
from pipeloom.search.blocks import Block, PlacementBuilder, split_span
from pipeloom.stages import Costs, stage_graph

__all__ = ["PLACEMENTS", "PlacementInfo", "placement", "placement_names"]

_F_MEMORY = 1.0
"""A Tessel forward block's activations (docs/design.md §6: F span 1 memory +1)."""
_B_SPAN = 3.0
"""A Tessel backward block's span (docs/design.md §6: B span 3 memory -1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementInfo:
    """A catalog entry: what the placement is and which rank counts it takes."""

    name: str
    """Catalog name, e.g. ``vshape``."""
    summary: str
    """One line for ``pipeloom list`` and the CLI help."""
    min_ranks: int = 1
    """Fewest ranks the shape needs."""
    even_ranks: bool = False
    """Whether the rank count must be even (the shape cuts the ranks in halves)."""
    classic: bool = False
    """A placement built-in schedules are written for (``linear``, ``v``, ``interleaved``): the
    registry entries declaring it (:attr:`ScheduleInfo.placement`) build this very problem."""

    @property
    def rule(self) -> str:
        """The valid rank counts in words."""
        if self.even_ranks:
            return f"an even number of ranks >= {max(2, self.min_ranks)}"
        return f"any number of ranks >= {self.min_ranks}"

    def accepts(self, num_ranks: int) -> bool:
        """Whether ``num_ranks`` follows :attr:`rule`."""
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < self.min_ranks:
            return False
        return not (self.even_ranks and num_ranks % 2)

    def check(self, num_ranks: int) -> None:
        """PipeloomError (a ValueError) naming the rule unless :meth:`accepts`."""
        if not self.accepts(num_ranks):
            raise PipeloomError(
                f"placement {self.name!r} needs {self.rule}, got {num_ranks!r}; "
                f"use {self._nearest(num_ranks)}"
            )

    def builtin_names(self, *, split_backward: bool) -> tuple[str, ...]:
        """Built-in schedules of the same problem for this backward option (warm starts, comparisons):
        the registry's entries declaring this placement and backward, read at call time."""
        if not self.classic:
            return ()
        return tuple(name for name, info in REGISTRY.items()
                     if info.placement == self.name and info.splits_backward == split_backward)

    def _nearest(self, num_ranks: object) -> str:
        low = max(2, self.min_ranks) if self.even_ranks else self.min_ranks
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < low:
            return str(low)
        return f"{num_ranks - 1} or {num_ranks + 1}"


# -- Tessel placements (docs/design.md §6), each a function of the rank count filling a builder ----------


def _forwards(
    b: PlacementBuilder, name: str, ranks: Sequence[int], *, memory: float = _F_MEMORY
) -> list[Block]:
    """One forward block per rank in ``ranks`` (in that order), span 1."""
    return [b.block(f"{name}.f{r}", ranks=[r], memory=memory) for r in ranks]


def _everywhere(b: PlacementBuilder, name: str, *, memory: float = 0.0) -> Block:
    """An "all" forward block: every rank at once, span 1 (memory 0 unless noted)."""
    return b.block(f"{name}.f", ranks=range(b.num_ranks), memory=memory)


def _backwards(b: PlacementBuilder, forwards: Sequence[Block], *, span: float = _B_SPAN) -> list[Block]:
    """The backward of each forward, last forward first, releasing what it took."""
    return [
        b.block(f"{f.name}.b", kind="B", of=f, span=span, memory=0.0 - f.memory)
        for f in reversed(forwards)
    ]


def _vshape(b: PlacementBuilder) -> None:
    """F on 0..n-1 in a chain, then B on n-1..0."""
    forwards = _forwards(b, "v", range(b.num_ranks))
    b.chain(*forwards, *_backwards(b, forwards))


def _xshape(b: PlacementBuilder) -> None:
    """Two independent chains per micro-batch: a V (F 0 -> n-1, B n-1 -> 0) and its mirror."""
    n = b.num_ranks
    down = _forwards(b, "v", range(n))
    up = _forwards(b, "mirror", range(n - 1, -1, -1))
    b.chain(*down, *_backwards(b, down))
    b.chain(*up, *_backwards(b, up))


def _mshape(b: PlacementBuilder) -> None:
    """F(all) -> V -> B(all)."""
    embed = _everywhere(b, "all")
    forwards = _forwards(b, "v", range(b.num_ranks))
    backwards = _backwards(b, forwards)
    b.chain(embed, *forwards, *backwards, *_backwards(b, [embed], span=1.0))


def _nnshape(b: PlacementBuilder) -> None:
    """F(all) -> F first half -> F(all) -> F second half -> B mirrored, with B(all) (span 1)
    between the halves and at the end."""
    half = b.num_ranks // 2
    first_all = _everywhere(b, "all0")
    first = _forwards(b, "first", range(half))
    middle_all = _everywhere(b, "all1")
    second = _forwards(b, "second", range(half, b.num_ranks))
    b.chain(
        first_all, *first, middle_all, *second,
        *_backwards(b, second), *_backwards(b, [middle_all], span=1.0),
        *_backwards(b, first), *_backwards(b, [first_all], span=1.0),
    )


def _mllm(b: PlacementBuilder) -> None:
    """F(all) -> V forward -> F(all) -> B(all) -> V backward -> B(all)."""
    encoder = _everywhere(b, "all0")
    forwards = _forwards(b, "v", range(b.num_ranks))
    head = _everywhere(b, "all1")
    b.chain(
        encoder, *forwards, head, *_backwards(b, [head], span=1.0),
        *_backwards(b, forwards), *_backwards(b, [encoder], span=1.0),
    )


def _kshape(b: PlacementBuilder) -> None:
    """Two half-rank V branches (0..n/2-1, n/2..n-1) joined by a loss block on all ranks (+1/-1, span 1)."""
    half = b.num_ranks // 2
    left = _forwards(b, "left", range(half))
    right = _forwards(b, "right", range(half, b.num_ranks))
    loss = _everywhere(b, "loss", memory=_F_MEMORY)
    (loss_backward,) = _backwards(b, [loss], span=1.0)
    b.chain(*left, loss)
    b.chain(*right, loss)
    b.chain(loss, loss_backward, *_backwards(b, left))
    b.chain(loss_backward, *_backwards(b, right))


def _finetune(b: PlacementBuilder) -> None:
    """F(all) (frozen, no backward) -> F chain 0..n-1 (+1) -> B chain n-1..0 of span 2."""
    frozen = _everywhere(b, "frozen")
    forwards = _forwards(b, "v", range(b.num_ranks))
    b.chain(frozen, *forwards, *_backwards(b, forwards, span=2.0))


def _alphafold(b: PlacementBuilder) -> None:
    """Three forward passes over 0..n-1 (memory 0, 0, +1; span 1), then B of span 1 on n-1..0."""
    ranks = range(b.num_ranks)
    passes = [
        _forwards(b, f"pass{k}", ranks, memory=memory) for k, memory in enumerate((0.0, 0.0, _F_MEMORY))
    ]
    b.chain(*passes[0], *passes[1], *passes[2], *_backwards(b, passes[2], span=1.0))


_TESSEL: Mapping[str, Callable[[PlacementBuilder], None]] = MappingProxyType({
    "vshape": _vshape,
    "xshape": _xshape,
    "mshape": _mshape,
    "nnshape": _nnshape,
    "mllm": _mllm,
    "kshape": _kshape,
    "finetune": _finetune,
    "alphafold": _alphafold,
})


# -- classic placements: the built-in schedules' own problems -----------------------------------


def _classic_stage_ranks(name: str, num_ranks: int) -> tuple[list[int], float]:
    """``(rank of each stage, share of a rank's costs per stage)`` of a classic placement."""
    if name == "linear":
        return list(range(num_ranks)), 1.0
    if name == "v":
        return v_stage_ranks(num_ranks), 0.5
    return [s % num_ranks for s in range(2 * num_ranks)], 0.5  # interleaved, 2 stages per rank


def _classic(
    name: str, num_ranks: int, *, split_backward: bool, inference: bool,
    memory_limit: float | None, costs: Costs,
) -> Problem:
    """The chain the built-ins build (``chain_problem`` with ``costs``)."""
    stage_ranks, share = _classic_stage_ranks(name, num_ranks)
    if inference:
        return stage_graph(
            [costs.stage(rank, share=share) for rank in stage_ranks],
            num_ranks=num_ranks, backward="none", comm_latency=costs.comm, memory_limit=memory_limit,
        )
    return chain_problem(
        stage_ranks, costs, num_ranks=num_ranks, split_backward=split_backward,
        memory_limit=memory_limit, share=share,
    )


_CLASSIC = ("linear", "v", "interleaved")


def _entries(*infos: PlacementInfo) -> Mapping[str, PlacementInfo]:
    return MappingProxyType({info.name: info for info in infos})


PLACEMENTS: Mapping[str, PlacementInfo] = _entries(
    PlacementInfo(name="vshape", summary="F on ranks 0..n-1 in a chain, then B on n-1..0"),
    PlacementInfo(name="xshape", summary="a V and its mirror (F n-1..0, B 0..n-1) in every micro-batch"),
    PlacementInfo(name="mshape", summary="F on all ranks, then a V, then B on all ranks"),
    PlacementInfo(name="nnshape", even_ranks=True, min_ranks=2,
                  summary="all, first half, all, second half; backward mirrored with B(all) between"),
    PlacementInfo(name="mllm", summary="F(all), V forward, F(all), B(all), V backward, B(all)"),
    PlacementInfo(name="kshape", even_ranks=True, min_ranks=2,
                  summary="two half-rank V branches joined by a loss block on all ranks"),
    PlacementInfo(name="finetune", summary="frozen F(all), F chain holding activations, B chain of span 2"),
    PlacementInfo(name="alphafold", summary="three forward passes over the ranks (last holds), B of span 1"),
    PlacementInfo(name="linear", classic=True,
                  summary="stage r on rank r (1F1B layout), Costs(): F 1, B 2 or I 1 + W 1"),
    PlacementInfo(name="v", classic=True,
                  summary="2 stages per rank in a V (rank r: stages r and 2n-1-r), half a share each"),
    PlacementInfo(name="interleaved", classic=True,
                  summary="2 looped stages per rank (stage s on rank s % n), half a share each"),
)
"""Every placement by name: the Tessel shapes of docs/design.md §6, then the classic ones."""


def placement_names() -> tuple[str, ...]:
    """Names of the placements, in catalog order."""
    return tuple(PLACEMENTS)


def placement(
    name: str,
    num_ranks: int,
    *,
    split_backward: bool = False,
    inference: bool = False,
    memory_limit: float | None = None,
    comm_latency: float = 0.0,
    f: float | None = None,
    b: float | None = None,
    w: float | None = None,
    w_memory: float | None = None,
) -> Problem:
    """The per-micro-batch problem of placement ``name`` on ``num_ranks`` ranks.

    Tessel shapes: F span 1 memory +1, B span 3 memory -1, "all" blocks span 1 memory 0, unless
    the shape says otherwise (docs/design.md §6). Classic shapes use ``Costs(comm=comm_latency)``:
    ``linear`` equals the problem of 1F1B/GPipe (ZB-H1/ZB-H2 when split), ``v`` that of ZB-V and
    DualPipeV, ``interleaved`` that of interleaved 1F1B with 2 stages per rank.
    ``split_backward`` splits each B into I + W (Tessel spans by
    :func:`~pipeloom.search.blocks.split_span`: 3 -> 2 + 1, I releases the memory; classic ones by
    Costs(): I = b, W = w); ``inference`` keeps the forwards only, with memory 0.

    ``f``, ``b``, ``w`` and ``w_memory`` are per-rank-share costs (as :class:`~pipeloom.stages.Costs`;
    None keeps the placement's own). Classic shapes: ``Costs(f, b, w, comm, w_memory=w_memory)``
    spread over their stages. Tessel shapes: every single-rank block takes them (F = f; B = b + w,
    or I = b and W = w when split, an absent one keeping its part of the block's span; W releases
    ``w_memory`` of its forward's memory, I the rest); the all-rank blocks keep their spans.
    """
    try:
        info = PLACEMENTS[name]
    except (KeyError, TypeError):
        raise PipeloomError(f"unknown placement {name!r}; choose one of: {', '.join(PLACEMENTS)}") from None
    info.check(num_ranks)
    if split_backward and inference:
        raise PipeloomError("split_backward and inference exclude each other: inference has no backward")
    if w_memory is not None and not split_backward:
        raise PipeloomError("w_memory is W's share of the memory, so it needs split_backward=True")
    if name in _CLASSIC:
        costs = Costs(f=1.0 if f is None else f, b=1.0 if b is None else b, w=1.0 if w is None else w,
                      comm=comm_latency, w_memory=w_memory or 0.0)
        return _classic(name, num_ranks, split_backward=split_backward, inference=inference,
                        memory_limit=memory_limit, costs=costs)
    builder = PlacementBuilder(num_ranks)
    _TESSEL[name](builder)
    problem = builder.build(memory_limit=memory_limit, comm_latency=comm_latency,
                            split_backward=split_backward, inference=inference)
    return _with_share_costs(problem, f=f, b=b, w=w, w_memory=w_memory)


def _with_share_costs(problem: Problem, *, f: float | None, b: float | None, w: float | None,
                      w_memory: float | None) -> Problem:
    """``problem`` with its single-rank blocks costing ``f``, ``b``, ``w`` (None keeps the block's
    own: a full B keeps its :func:`~pipeloom.search.blocks.split_span` part) and W releasing
    ``w_memory`` of its forward's memory (see :func:`placement`)."""
    if f is None and b is None and w is None and w_memory is None:
        return problem
    tasks = []
    for task in problem.tasks:
        duration, memory = task.duration, task.memory
        if len(task.ranks) == 1:
            own_i, own_w = split_span(task.duration)
            duration = {"F": task.duration if f is None else f,
                        "B": (own_i if b is None else b) + (own_w if w is None else w),
                        "I": task.duration if b is None else b,
                        "W": task.duration if w is None else w}[task.kind]
            if w_memory is not None and task.kind in ("I", "W"):
                taken = problem.task((task.stage, "F")).memory
                if not 0 <= w_memory <= taken:
                    raise PipeloomError(f"w_memory {w_memory:g} must lie between 0 and the {taken:g} a "
                                        f"forward of this placement takes; lower it")
                memory = -(taken - w_memory) if task.kind == "I" else -w_memory
        tasks.append(dataclasses.replace(task, duration=duration, memory=memory))
    return dataclasses.replace(problem, tasks=tuple(tasks))
