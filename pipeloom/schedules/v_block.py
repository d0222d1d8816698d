"""The building-block construction of V-Half and V-Min ("Pipeline Parallelism with Controllable Memory",
Qi et al., 2024): one micro-batch's passes on a unit-slot grid, repeated every 6 slots, then squeezed.

Every pass of a V stage (F, I or W of half a rank share) takes one slot. Rank r holds stages r ("down")
and 2p-1-r ("up"); per micro-batch it runs six passes, so a block repeated every 6 slots keeps every
rank busy in the steady state. The block's lifespan (first F to last W on a rank) sets the peak memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pipeloom.errors import ArgumentError
from pipeloom.ir import Action

__all__ = ["BLOCK_PERIOD", "Variant", "block_offsets", "block_order"]

Variant = Literal["half", "min"]
BLOCK_PERIOD = 6
"""Slots between two micro-batches' blocks: F, I and W of both of a rank's stages."""

_F_DOWN, _F_UP, _I_UP, _I_DOWN, _W_UP, _W_DOWN = range(6)
_PASSES = 6
_FREES = {_W_UP, _W_DOWN}


def block_offsets(num_ranks: int, variant: Variant) -> list[tuple[int, int, int, int]]:
    """Per rank, the slots of (F down, F up, I up, I down) of micro-batch 0 in the building block.

    V-Min: every pass right after its predecessor, one slot per rank each way:
    F down r, F up 2p-1-r, I up 2p+g+r, I down 4p+g-1-r. Lifespans 4p+g-1-2r (down) and 2r+1+g
    (up) sum to 4p+2g, about 2p/3 half-share activations per 6-slot period (p/3 of a rank share).
    The gap g = 2 when 3 divides p, else I up would land on F down's slot modulo 6.

    V-Half: the down stage's F and the up stage's I move two slots per rank:
    F down 2r, F up 3p-2-r, I up 3p-1+g+2r, I down 6p-2+g-r; lifespans sum to 6p+2g-1, about
    p half-share activations (p/2 of a rank share); g = 3 when p is even, for the same reason.
    """
    p = num_ranks
    if variant == "min":
        g = 2 if p % 3 == 0 else 0
        return [(r, 2 * p - 1 - r, 2 * p + g + r, 4 * p + g - 1 - r) for r in range(p)]
    if variant == "half":
        g = 3 if p % 2 == 0 else 0
        return [(2 * r, 3 * p - 2 - r, 3 * p - 1 + g + 2 * r, 6 * p - 2 + g - r) for r in range(p)]
    raise ArgumentError(f"unknown building block {variant!r}: use 'half' or 'min'")


Grid = list[list[list[int]]]
"""``grid[rank][pass][microbatch]`` = slot; passes F down, F up, I up, I down, W up, W down."""


def _free_slot_ws(rank_slots: Sequence[Sequence[int]]) -> list[list[int]]:
    """W slots of one rank: each W in the first free slot after its I, up stage first (FIFO per stage)."""
    busy = {slot for kind in range(4) for slot in rank_slots[kind]}
    done = sorted((slot, kind) for kind in (_I_UP, _I_DOWN) for slot in rank_slots[kind])
    pending: list[list[int]] = [[], []]  # micro-batches whose I ran and whose W waits: up, down
    ws: list[list[int]] = [[], []]
    slot, index, total = 0, 0, len(done)
    while index < total or pending[0] or pending[1]:
        while index < total and done[index][0] < slot:
            pending[done[index][1] - _I_UP].append(done[index][0])
            index += 1
        if slot not in busy:
            side = 0 if pending[0] else 1 if pending[1] else None
            if side is not None:
                pending[side].pop(0)
                ws[side].append(slot)
        slot += 1
    return ws


def _peak(rank_slots: Sequence[Sequence[int]]) -> int:
    """Most half-share activations held at once: F takes one, its W gives it back (I keeps it)."""
    events = sorted((slot, kind not in _FREES) for kind in (_F_DOWN, _F_UP, _W_UP, _W_DOWN)
                    for slot in rank_slots[kind])
    held = peak = 0
    for _, takes in events:
        held += 1 if takes else -1
        peak = max(peak, held)
    return peak


def _with_ws(rank_slots: Sequence[Sequence[int]]) -> list[list[int]]:
    """F and I slots of one rank plus W in the free slots (W slots already there are dropped)."""
    return [list(rank_slots[kind]) for kind in range(4)] + _free_slot_ws(rank_slots)


def _dep_slots(grid: Grid, rank: int, kind: int, mb: int) -> list[int]:
    """Slots of the passes that must run before (kind, mb) on ``rank``: its chain predecessor (the
    previous stage of the V: F down from rank r-1, F up from r+1, I up from r-1, I down from r+1,
    turning at rank p-1 for F and rank 0 and p-1 for I), its I for a W, and the same pass of mb-1."""
    p = len(grid)
    deps = [grid[rank][kind][mb - 1]] if mb else []
    if kind == _F_DOWN and rank > 0:
        deps.append(grid[rank - 1][_F_DOWN][mb])
    elif kind == _F_UP:
        deps.append(grid[rank + 1][_F_UP][mb] if rank < p - 1 else grid[rank][_F_DOWN][mb])
    elif kind == _I_UP:
        deps.append(grid[rank - 1][_I_UP][mb] if rank > 0 else grid[rank][_F_UP][mb])
    elif kind == _I_DOWN:
        deps.append(grid[rank + 1][_I_DOWN][mb] if rank < p - 1 else grid[rank][_I_UP][mb])
    elif kind in _FREES:
        deps.append(grid[rank][_I_UP if kind == _W_UP else _I_DOWN][mb])
    return deps


def _squeeze(grid: Grid, *, kinds: int, warmup: bool, cap: int) -> None:
    """Move warm-up (if ``warmup``) and cool-down passes to earlier free slots, in place.

    Passes are visited in slot order. Warm-up: before rank 0 ends micro-batch 0 (its I down);
    cool-down: after rank 0 starts the last micro-batch (its F down); the steady state between is
    the repeated block and stays. A visited pass takes the earliest free slot after its deps (already
    final) if the rank's peak (:func:`_peak`, W in free slots when ``kinds`` is 4) stays at most
    ``cap``. ``kinds``: 6 with the W passes on the grid, 4 without.
    """
    p, m = len(grid), len(grid[0][0])
    taken = [{slot for kind in range(kinds) for slot in grid[r][kind]} for r in range(p)]
    visits = sorted((grid[r][kind][mb], r, kind, mb)
                    for r in range(p) for kind in range(kinds) for mb in range(m))
    phase = 0 if warmup else None  # None: warm-up kept as it is
    for slot, r, kind, mb in visits:
        if (r, kind, mb) == (0, _I_DOWN, 0):
            phase = 1
            continue
        if phase == 1:
            if (r, kind, mb) == (0, _F_DOWN, m - 1):
                phase = 2
            continue
        if phase is None:
            continue
        earliest = max(_dep_slots(grid, r, kind, mb), default=-1) + 1
        for candidate in range(earliest, slot):
            if candidate in taken[r]:
                continue
            grid[r][kind][mb] = candidate
            # with W on the grid only an earlier F can raise the peak (an earlier W lowers it)
            fits = kinds == _PASSES and kind not in (_F_DOWN, _F_UP)
            if fits or _peak(grid[r] if kinds == _PASSES else _with_ws(grid[r])) <= cap:
                taken[r].discard(slot)
                taken[r].add(candidate)
                break
            grid[r][kind][mb] = slot


def block_order(num_ranks: int, num_microbatches: int, variant: Variant) -> list[list[Action]]:
    """Every rank's order from the building block: repeat, put W in free slots, squeeze, read in slot order.

    The squeeze runs twice, as in the paper's generator: first with the W passes on the grid
    (warm-up and cool-down), then without them (cool-down only; W goes back into the free slots).
    The cap is the repeated block's peak, so squeezing never raises the memory.
    """
    p, m = num_ranks, num_microbatches
    offsets = block_offsets(p, variant)
    grid: Grid = [[[offsets[r][kind] + BLOCK_PERIOD * mb for mb in range(m)] for kind in range(4)]
                  for r in range(p)]
    grid = [_with_ws(rank_slots) for rank_slots in grid]
    cap = max(_peak(rank_slots) for rank_slots in grid)
    _squeeze(grid, kinds=_PASSES, warmup=True, cap=cap)
    _squeeze(grid, kinds=4, warmup=False, cap=cap)
    grid = [_with_ws(rank_slots) for rank_slots in grid]
    orders = []
    for r, rank_slots in enumerate(grid):
        down, up = r, 2 * p - 1 - r
        names = ((down, "F"), (up, "F"), (up, "I"), (down, "I"), (up, "W"), (down, "W"))
        timed = sorted((slot, kind, mb)
                       for kind in range(_PASSES) for mb, slot in enumerate(rank_slots[kind]))
        orders.append([Action(names[kind][0], names[kind][1], mb) for _, kind, mb in timed])
    return orders
