"""A Tessel-style placement builder: blocks with ranks, spans and memory, chained into a Problem.

Each block is one task of the per-micro-batch DAG (docs/design.md §1): a forward block opens a new stage,
a backward block (B, or I/W) names the forward it belongs to with ``of=`` and shares its stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from pipeloom.errors import ProblemError
from pipeloom.problem import KINDS, Problem, Task, TaskKey

__all__ = ["Block", "Layer", "PlacementBuilder", "split_span"]

def split_span(span: float) -> tuple[float, float]:
    """``(I span, W span)`` of a backward of ``span`` split in two.

    I takes half the span rounded up to a whole unit (never more than the span), W the rest:
    3 -> 2 + 1, 2 -> 1 + 1 (the library's Costs(): B = b + w = 1 + 1), 1 -> 1 + 0, 0.5 -> 0.5 + 0.
    Whole spans stay whole, so the solver's integer scaling stays exact.
    """
    input_span = min(span, float(math.ceil(span / 2)))
    return input_span, span - input_span


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """One task of a micro-batch, as returned by :meth:`PlacementBuilder.block`."""

    name: str
    """The caller's name for the block (unique within its builder; used in error messages)."""
    stage: int
    """Stage index: forward blocks get 0, 1, 2, ... in creation order; a backward shares its forward's."""
    kind: str
    """``F``, ``B``, ``I`` or ``W``."""
    ranks: tuple[int, ...]
    """Ranks the block occupies at once."""
    span: float
    """Duration (Tessel's span), >= 0."""
    memory: float
    """Held-memory change on each of its ranks when the block starts."""

    @property
    def key(self) -> TaskKey:
        """``(stage, kind)``: the task this block becomes (a split B becomes ``(stage, "I")`` and W)."""
        return (self.stage, self.kind)


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    """A forward block and its backward, as made by :meth:`PlacementBuilder.layer`."""

    forward: Block
    """The F block."""
    backward: Block
    """The B block releasing what ``forward`` took."""


class PlacementBuilder:
    """Collects blocks and dependencies of one micro-batch; :meth:`build` turns them into a Problem.

    ``b = PlacementBuilder(num_ranks=4)``; ``x = b.block("embed", ranks=[0, 1, 2, 3])``;
    ``y = b.block("layer", ranks=[0], memory=1)``; ``gy = b.block("layer.B", kind="B", of=y,
    span=3, memory=-1)``; ``b.chain(x, y, gy)``; ``problem = b.build(memory_limit=4)``.
    A backward block always waits for its forward (docs/design.md §1); :meth:`build` adds that edge
    unless a declared path already implies it. The builder is a plain local object, no global state.
    """

    def __init__(self, num_ranks: int) -> None:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ProblemError(f"num_ranks must be a positive integer, got {num_ranks!r}")
        self.num_ranks = num_ranks
        self._blocks: dict[str, Block] = {}
        self._deps: dict[str, list[str]] = {}
        self._forward_of: dict[str, str] = {}
        self._stage_kinds: dict[int, set[str]] = {}
        self._next_stage = 0

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every block so far, in creation order."""
        return tuple(self._blocks.values())

    def deps(self, block: Block) -> tuple[Block, ...]:
        """The blocks ``block`` was declared to wait for (the implied wait on its forward excluded)."""
        self._own(block, "deps")
        return tuple(self._blocks[name] for name in self._deps[block.name])

    def block(
        self,
        name: str,
        *,
        ranks: Sequence[int] | None = None,
        span: float = 1.0,
        memory: float = 0.0,
        kind: str = "F",
        of: Block | None = None,
    ) -> Block:
        """Add a block; ``of`` (backward kinds only) names its forward, whose stage and ranks it takes."""
        if not isinstance(name, str) or not name:
            raise ProblemError(f"a block name must be a non-empty string, got {name!r}")
        if name in self._blocks:
            raise ProblemError(f"block {name!r} is defined twice; give each block its own name")
        if kind not in KINDS:
            raise ProblemError(f"block {name!r}: kind must be one of F, B, I, W, got {kind!r}")
        if of is not None:
            self._own(of, f"block {name!r} (of=)")
            if kind == "F":
                raise ProblemError(f"block {name!r}: only a backward block (B, I or W) takes of=")
            if of.kind != "F":
                raise ProblemError(
                    f"block {name!r}: of={of.name!r} is a {of.kind} block; name a forward block"
                )
        if ranks is None:
            if of is None:
                raise ProblemError(f"block {name!r} has no ranks; give ranks=[...]")
            ranks = of.ranks
        block = Block(
            name=name,
            stage=self._stage_for(name, kind, of),
            kind=kind,
            ranks=self._check_ranks(name, ranks),
            span=_check_real(f"block {name!r} span", span, minimum=0.0),
            memory=_check_real(f"block {name!r} memory", memory, minimum=None),
        )
        self._stage_kinds.setdefault(block.stage, set()).add(kind)
        self._blocks[name] = block
        self._deps[name] = []
        if of is not None:
            self._forward_of[name] = of.name
        return block

    def layer(
        self,
        name: str,
        *,
        ranks: Sequence[int],
        f_span: float = 1.0,
        b_span: float = 2.0,
        memory: float = 1.0,
    ) -> Layer:
        """A forward taking ``memory`` and its backward (``name + ".B"``) releasing it.

        The backward declares its wait on the forward, so :meth:`chain_layers` gives exactly the
        dependencies of ``stage_graph`` (B of s waits for F(s) and for B of s+1).
        """
        forward = self.block(name, ranks=ranks, span=f_span, memory=memory)
        backward = self.block(f"{name}.B", kind="B", of=forward, span=b_span, memory=0.0 - forward.memory)
        self.depends(backward, on=forward)
        return Layer(forward=forward, backward=backward)

    def chain(self, *blocks: Block) -> None:
        """Each block waits for the one before it."""
        for before, after in pairwise(blocks):
            self.depends(after, on=before)

    def chain_layers(self, *layers: Layer) -> None:
        """Forwards in the given order, backwards in reverse: the stage_graph chain of docs/design.md §1."""
        self.chain(*(layer.forward for layer in layers))
        self.chain(*(layer.backward for layer in reversed(layers)))

    def depends(self, block: Block, *, on: Block | Iterable[Block]) -> None:
        """``block`` waits for every block in ``on``; ProblemError if that closes a cycle."""
        self._own(block, "depends")
        for dep in (on,) if isinstance(on, Block) else tuple(on):
            self._own(dep, f"depends({block.name!r}, on=...)")
            if dep.name == block.name:
                raise ProblemError(f"block {block.name!r} cannot depend on itself")
            if dep.name in self._deps[block.name]:
                continue
            if self._reaches(dep.name, block.name):
                raise ProblemError(
                    f"making block {block.name!r} wait for {dep.name!r} closes a cycle: "
                    f"{dep.name!r} already waits (directly or through others) for {block.name!r}"
                )
            self._deps[block.name].append(dep.name)

    def build(
        self,
        *,
        memory_limit: float | None = None,
        comm_latency: float = 0.0,
        split_backward: bool = False,
        inference: bool = False,
        static_memory: Sequence[float] | None = None,
    ) -> Problem:
        """The Problem of these blocks.

        ``split_backward`` turns every B block into I (span from :func:`split_span`, all the
        memory, B's deps) and W (the rest of the span, memory 0, waits for I); blocks waiting for
        the B wait for its I. ``inference`` keeps forward blocks only, with memory 0, each waiting
        for the forwards it reached through dropped blocks.
        """
        if not self._blocks:
            raise ProblemError("the placement has no blocks; add at least one with block()")
        if split_backward and inference:
            raise ProblemError("split_backward and inference exclude each other: inference has no backward")
        kept = [b for b in self._blocks.values() if not inference or b.kind == "F"]
        tasks: list[Task] = []
        for block in kept:
            deps = self._task_deps(block, inference=inference, split=split_backward)
            memory = 0.0 if inference else block.memory
            if split_backward and block.kind == "B":
                i_span, w_span = split_span(block.span)
                tasks.append(Task(stage=block.stage, kind="I", ranks=block.ranks, duration=i_span,
                                  memory=memory, deps=deps))
                tasks.append(Task(stage=block.stage, kind="W", ranks=block.ranks, duration=w_span,
                                  memory=0.0, deps=((block.stage, "I"),)))
            else:
                tasks.append(Task(stage=block.stage, kind=block.kind, ranks=block.ranks,
                                  duration=block.span, memory=memory, deps=deps))
        return Problem(
            num_ranks=self.num_ranks,
            tasks=tuple(tasks),
            comm_latency=comm_latency,
            memory_limit=memory_limit,
            static_memory=None if static_memory is None else tuple(static_memory),
        )

    def _task_deps(self, block: Block, *, inference: bool, split: bool) -> tuple[TaskKey, ...]:
        """Task keys ``block`` waits for: declared deps (through dropped blocks when ``inference``),
        then its forward unless a declared path already reaches it."""
        names: list[str] = []
        pending = list(self._deps[block.name])
        forward = self._forward_of.get(block.name)
        if forward is not None and not any(self._reaches(d, forward) for d in pending):
            pending.append(forward)
        while pending:
            name = pending.pop(0)
            dep = self._blocks[name]
            if inference and dep.kind != "F":
                pending.extend(self._all_deps(name))
            elif name not in names:
                names.append(name)
        keys = []
        for name in names:
            dep = self._blocks[name]
            kind = "I" if split and dep.kind == "B" else dep.kind
            if (dep.stage, kind) not in keys:
                keys.append((dep.stage, kind))
        return tuple(keys)

    def _all_deps(self, name: str) -> list[str]:
        """Declared deps of ``name`` plus its implied forward."""
        forward = self._forward_of.get(name)
        return self._deps[name] + ([forward] if forward is not None else [])

    def _reaches(self, start: str, target: str) -> bool:
        """Whether ``start`` is ``target`` or waits for it, through declared deps and implied forwards."""
        seen: set[str] = set()
        stack = [start]
        while stack:
            name = stack.pop()
            if name == target:
                return True
            if name not in seen:
                seen.add(name)
                stack.extend(self._all_deps(name))
        return False

    def _stage_for(self, name: str, kind: str, of: Block | None) -> int:
        if of is None:
            stage, self._next_stage = self._next_stage, self._next_stage + 1
            return stage
        kinds = self._stage_kinds[of.stage]
        if kind in kinds:
            raise ProblemError(f"block {name!r}: forward {of.name!r} already has a {kind} block")
        if (kind == "B" and kinds & {"I", "W"}) or (kind != "B" and "B" in kinds):
            raise ProblemError(
                f"block {name!r}: forward {of.name!r} cannot have both a full backward B and a split "
                "backward I/W; use one B (build(split_backward=True) splits it) or I and W"
            )
        return of.stage

    def _check_ranks(self, name: str, ranks: Sequence[int]) -> tuple[int, ...]:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise ProblemError(f"block {name!r}: ranks must be a list of rank indices, got {ranks!r}")
        ranks = tuple(ranks)
        if not ranks:
            raise ProblemError(f"block {name!r} has no ranks; give at least one")
        for rank in ranks:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
                raise ProblemError(
                    f"block {name!r} names rank {rank!r}, but the ranks are 0..{self.num_ranks - 1}; "
                    "fix the rank or raise num_ranks"
                )
        if len(set(ranks)) != len(ranks):
            raise ProblemError(f"block {name!r} lists a rank twice: {list(ranks)}")
        return ranks

    def _own(self, block: object, where: str) -> None:
        if not isinstance(block, Block):
            raise ProblemError(f"{where}: expected a Block from this builder, got {type(block).__name__}")
        if self._blocks.get(block.name) is not block:
            raise ProblemError(f"{where}: block {block.name!r} was not made by this builder")


def _check_real(what: str, value: object, *, minimum: float | None) -> float:
    """``value`` as a float; ProblemError unless finite (and >= ``minimum`` when given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProblemError(f"{what} must be a number, got {value!r}")
    try:
        real = float(value)
    except OverflowError:
        raise ProblemError(f"{what} must be a finite number, got an integer too large for a float") from None
    if not math.isfinite(real):
        raise ProblemError(f"{what} must be a finite number, got {value!r}")
    if minimum is not None and real < minimum:
        raise ProblemError(f"{what} must be >= {minimum:g}, got {value!r}")
    return real
