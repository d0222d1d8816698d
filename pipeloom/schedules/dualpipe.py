"""DualPipe and DualPipeV (DeepSeek-V3): micro-batches fed from both ends, overlapped forward/backward pairs.

Both run one eight-phase program per rank on a "half" pipeline of P ranks; DualPipeV folds one model
into a V over P ranks, DualPipe runs two model replicas on 2P ranks, rank r and 2P-1-r mirroring.
The F&B pairs are :class:`~pipeloom.ir.Overlap` actions and the reference's full backwards are ``B``
actions on the split stages (docs/semantics.md), as torch's ``ScheduleDualPipeV`` writes them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import count, repeat

from pipeloom.errors import ArgumentError
from pipeloom.ir import Action, Overlap, Schedule
from pipeloom.schedules.common import (
    MemoryLimit,
    check_counts,
    check_even_ranks,
    even_microbatches_hint,
    make_schedule,
    two_replica_problem,
    v_problem,
    v_rank_stages,
)
from pipeloom.stages import Costs

__all__ = ["dualpipe", "dualpipev", "dualpipe_program", "check_dualpipe", "dualpipe_rank_program"]

Step = tuple[str, int]
"""One step of a rank's program: ``(op, phase)``.

``op`` is ``F`` (forward), ``B`` (full backward: I and W at once), ``Z`` (zero-bubble backward: its
W is deferred to a later ``W`` step), ``W`` (run the oldest deferred W; phase -1) or ``FB`` (an
overlapped pair: the forward of ``phase`` with the full backward of the other phase). Phase 0 is the
direction that enters the pipeline on this rank's side, phase 1 the other one.
"""


def dualpipe_program(num_half_ranks: int, *, half_rank: int, num_microbatches: int) -> list[Step]:
    """The reference's eight phases for one rank of a P-rank half pipeline, M micro-batches per phase.

    With P = ``num_half_ranks``, h = ``half_rank`` and M = ``num_microbatches`` (M >= 2P; the
    reference calls them chunks):

    1. ``2(P-h-1)`` x F0;  2. ``h+1`` x (F0 F1);  3. ``P-h-1`` x (Z1 W F1)  (zero bubble);
    4. ``M-2P+h+1`` x (F0&B1 F1&B0), overlapped pairs ``FB``; on the middle rank (h = P-1) the first
       F0&B1 runs as F0 then B1, not overlapped (the reference's choice, which shortens the bubble);
    5. ``P-h-1`` x (B1 F1&B0);  6. ``h+1`` x (B1 B0), the second half of them zero bubble;
    7. ``P-h-1`` x (W Z0);  8. ``h+1`` x W.
    """
    P, h, M = num_half_ranks, half_rank, num_microbatches
    if not 0 <= h < P <= M // 2:
        raise ArgumentError(
            f"dualpipe_program needs 0 <= half_rank < num_half_ranks <= num_microbatches / 2, got "
            f"half_rank={h}, num_half_ranks={P}, num_microbatches={M}"
        )
    tail = P - h - 1
    program: list[Step] = [("F", 0)] * (2 * tail)
    program += [("F", 0), ("F", 1)] * (h + 1)
    program += [("Z", 1), ("W", -1), ("F", 1)] * tail
    main = [("FB", 0), ("FB", 1)] * (M - 2 * P + h + 1)
    if h == P - 1:
        main[:1] = [("F", 0), ("B", 1)]
    program += main
    program += [("B", 1), ("FB", 1)] * tail
    cooldown = [("B", 1), ("B", 0)] * (h + 1)
    program += cooldown[: h + 1] + [("Z", phase) for _, phase in cooldown[h + 1 :]]
    program += [("W", -1), ("Z", 0)] * tail
    program += [("W", -1)] * (h + 1)
    return program


def _next_actions(stages: tuple[int, int], kind: str) -> list:
    """Per phase, a function returning that stage's next ``kind`` action: micro-batch 0, 1, 2, ..."""
    return [map(Action._make, zip(repeat(stage), repeat(kind), count())).__next__ for stage in stages]


def _lower(program: Sequence[Step], stages: tuple[int, int]) -> list[Action | Overlap]:
    """Turn a program into actions: phase k runs ``stages[k]``; micro-batches count up per phase.

    B becomes a full ``B`` (the split stage's I and W in one action); FB an :class:`Overlap` of the
    next forward of its phase and the next full B of the other; Z becomes I and queues its W, which the
    next ``W`` step runs (FIFO, as the reference's weight-gradient store), so every stage's W keep
    micro-batch order.
    """
    next_f, next_i, next_w = (_next_actions(stages, kind) for kind in ("F", "I", "W"))
    deferred: deque[Action] = deque()
    actions: list[Action | Overlap] = []
    emit = actions.append

    def full_backward(phase: int) -> Action:
        next_w[phase]()
        return next_i[phase]()._replace(kind="B")

    for op, phase in program:
        if op == "F":
            emit(next_f[phase]())
        elif op == "FB":
            emit(Overlap(next_f[phase](), full_backward(1 - phase)))
        elif op == "B":
            emit(full_backward(phase))
        elif op == "W":
            emit(deferred.popleft())
        else:
            emit(next_i[phase]())
            deferred.append(next_w[phase]())
    assert not deferred, "every deferred W must run"
    return actions


def dualpipev(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
) -> Schedule:
    """DualPipeV: one model cut into 2p stages in a V; rank r holds stages r and 2p-1-r (share 1/2).

    Every rank runs :func:`dualpipe_program` with P = p, h = r, M = m; phase 0 is stage r (the way
    down), phase 1 stage 2p-1-r (the way back). Requires m >= 2p.

    Bubble per rank, no communication latency: the reference counts (p-1)(F&B + B - 3W) with F,
    B = I + W and W the costs of one stage (half a rank share) and F&B an overlapped pair, there
    max(F, B) (``costs.overlap=1``; by default a pair costs F + B, docs/semantics.md); the idlest rank's
    simulated bubble stays within it when F <= I, and is (p-1)F = (p-1)f/2 when f = b = w with overlapped pairs,
    (p-1)f at the default pair cost (1F1B: 3(p-1)f).
    Activation memory: peak 2p+1 stage forwards = (p + 1/2) x ``costs.memory`` on the last rank (its
    first F&B runs F then B), p elsewhere (a pair frees as it takes), for any ``w_memory``; one model copy.
    """
    check_counts("dualpipev", num_ranks, num_microbatches, min_microbatches=2 * num_ranks)
    p, m = num_ranks, num_microbatches
    problem = v_problem(p, costs=costs, memory_limit=memory_limit)
    ranks = [
        _lower(dualpipe_program(p, half_rank=r, num_microbatches=m), v_rank_stages(p, rank=r))
        for r in range(p)
    ]
    return make_schedule("dualpipev", problem=problem, num_microbatches=m, ranks=ranks)


def dualpipe(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs = Costs(),
    memory_limit: MemoryLimit = None,
) -> Schedule:
    """DualPipe: two model replicas on p ranks (p even), m/2 micro-batches fed from each end.

    Rank r holds stage r of the down replica and stage p-1-r of the up replica (task stages 0..p-1
    down, p..2p-1 up, see :func:`two_replica_problem`), each a full rank share. One IR micro-batch is
    a *pair* of real micro-batches, one per direction, so the schedule has m // 2 micro-batches;
    m must be even and >= 2p (the reference's requirement). Each half of the ranks runs DualPipeV's
    program with P = p/2, h = min(r, p-1-r), M = m/2; its phase 0 is the replica entering on its side.

    Bubble per rank, no communication latency: (p/2-1)(F&B + B - 3W) in the reference, F, B = b + w
    and W being rank-share costs, F&B = max(F, B) (``costs.overlap=1``; F + B by default); the
    idlest rank's simulated bubble stays within it when F <= I, and is (p/2-1)f when f = b = w with overlapped
    pairs, (p-2)f at the default pair cost.
    Activation memory: peak p+1 forwards (x ``costs.memory``) on the two middle ranks, p on the others,
    for any ``w_memory``; 2x weights (two replicas).
    """
    check_dualpipe(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    problem = two_replica_problem(p, costs, split_backward=True, memory_limit=memory_limit)
    ranks = [_lower(*dualpipe_rank_program(p, m, rank=r)) for r in range(p)]
    return make_schedule("dualpipe", problem=problem, num_microbatches=m // 2, ranks=ranks)


def check_dualpipe(num_ranks: int, num_microbatches: int) -> None:
    """ArgumentError or ValueError unless :func:`dualpipe` runs these counts: an even number of ranks, an even
    number of micro-batches, at least 2p."""
    check_counts("dualpipe", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    check_even_ranks("dualpipe", p, reason="its two halves mirror each other")
    if m % 2 or m < 2 * p:
        raise ArgumentError(
            f"dualpipe needs an even number of micro-batches (half enter at each end), at least "
            f"2p = {2 * p} with {p} ranks (the reference's requirement), got {m}; "
            f"{even_microbatches_hint(m, minimum=2 * p)}"
        )


def dualpipe_rank_program(num_ranks: int, num_microbatches: int, *, rank: int) -> tuple[list[Step], tuple[int, int]]:
    """Rank ``rank`` of :func:`dualpipe` (counts :func:`check_dualpipe` accepts): its half pipeline's program (P =
    p/2, h = min(r, p-1-r), M = m/2) and the stages its phases 0 and 1 run, phase 0 the replica entering on its
    side."""
    p, r = num_ranks, rank
    down, up = v_rank_stages(p, rank=r)
    stages = (down, up) if r < p // 2 else (up, down)
    return dualpipe_program(p // 2, half_rank=min(r, p - 1 - r), num_microbatches=num_microbatches // 2), stages
