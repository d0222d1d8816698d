"""Parameters several pieces use (a tied embedding and LM head) in a plan: the bytes every rank holding
one of their users keeps, and the time the runtime takes to combine their gradients after the step.

The runtime (:mod:`pipeloom.runtime.step.shared`) keeps such a parameter on every rank that holds a piece
using it, once per rank. Each use's gradient of each micro-batch is kept aside during the step; after
the last action, every pair of holders exchanges, in one packed message each way, the contributions
of every micro-batch of every use it holds of every parameter both hold (the lower rank sends first
and then receives, the higher one receives and then sends, peers in rank order), and each rank adds
them up. Uses on one rank only are added as they come: no message, no buffer. Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pipeloom.plan.costs.parts import Link, SharedParam
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import CostTableError

__all__ = [
    "held_param_bytes",
    "shared_across_stages",
    "shared_buffer_bytes",
    "shared_extra_bytes",
    "shared_messages",
    "shared_static_bytes",
    "shared_sync_time",
]


def _users(table: CostTable) -> list[tuple[SharedParam, tuple[int, ...]]]:
    """Each shared parameter with its users' piece indices (ascending; the first holds its bytes)."""
    index = {name: k for k, name in enumerate(table.names)}
    return [(entry, tuple(index[name] for name in entry.pieces)) for entry in table.shared]


def shared_extra_bytes(table: CostTable, pieces: Iterable[int]) -> float:
    """Parameter bytes a rank holding ``pieces`` (indices into ``table.pieces``) keeps beyond the sum of
    their ``param_bytes``: each shared parameter one of them uses whose bytes are counted in a piece
    it does not hold (its first user), once."""
    held = set(pieces)
    return sum(entry.bytes for entry, users in _users(table) if users[0] not in held and held.intersection(users))


def held_param_bytes(table: CostTable, pieces: Iterable[int]) -> float:
    """Parameter bytes of a rank holding ``pieces``: each parameter once, shared ones included."""
    held = set(pieces)
    return sum(table.pieces[k].param_bytes for k in held) + shared_extra_bytes(table, held)


def _ranks_pieces(table: CostTable, piece_rank: Sequence[int]) -> dict[int, list[int]]:
    """Rank -> the pieces it holds, from ``piece_rank`` (per piece: its rank), checked."""
    if len(piece_rank) != len(table.pieces):
        raise CostTableError(f"piece_rank gives {len(piece_rank)} rank(s) for the table's {len(table.pieces)} "
                             "pieces; give the rank of every piece")
    on: dict[int, list[int]] = {}
    for k, rank in enumerate(piece_rank):
        on.setdefault(rank, []).append(k)
    return on


def shared_static_bytes(table: CostTable, piece_rank: Sequence[int]) -> dict[int, float]:
    """Per rank (those holding pieces): the static bytes its shared parameters add to the sum of
    :meth:`CostTable.static_bytes` over its pieces: weights, gradients and optimizer state,
    ``shared_extra_bytes × (2 + optimizer_factor)``. ``piece_rank[k]``: the rank holding piece k."""
    factor = 2.0 + table.optimizer_factor
    return {rank: factor * shared_extra_bytes(table, held) for rank, held in _ranks_pieces(table, piece_rank).items()}


def shared_across_stages(table: CostTable, stage_of: Sequence[int]) -> tuple[SharedParam, ...]:
    """The shared parameters whose users fall in more than one stage (``stage_of[k]``: piece k's stage).

    Only these are shared for the runtime (a stage holding every use runs them as one module): it runs
    them with one-replica schedules only (two-replica ones and ``data_parallel="fsdp"`` are refused),
    so a plan search should skip Chimera and DualPipe for a split where this is not empty."""
    return tuple(entry for entry, users in _users(table) if len({stage_of[k] for k in users}) > 1)


def shared_messages(table: CostTable, piece_rank: Sequence[int], num_microbatches: int) -> dict[tuple[int, int], float]:
    """Bytes of the after-step exchange per ``(sender, receiver)`` pair, as the runtime sends them:
    for each shared parameter both ranks hold, the sender's contribution of every micro-batch of
    every use it holds (``num_microbatches × uses × bytes``), all in one packed message."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise CostTableError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    _ranks_pieces(table, piece_rank)
    sent: dict[tuple[int, int], float] = {}
    for entry, users in _users(table):
        uses: dict[int, int] = {}
        for k in users:
            uses[piece_rank[k]] = uses.get(piece_rank[k], 0) + 1
        for src, count in uses.items():
            for dst in uses:
                if dst != src:
                    sent[(src, dst)] = sent.get((src, dst), 0.0) + num_microbatches * count * entry.bytes
    return dict(sorted(sent.items()))


def shared_buffer_bytes(table: CostTable, piece_rank: Sequence[int], num_microbatches: int) -> dict[int, float]:
    """Per rank taking part in the exchange: the bytes it holds for it at the step's end, beyond its
    static bytes: its own contributions kept during the step, their packed copy per peer, and what
    it receives (``Σ`` over its pairs of sent plus received bytes, plus its own contributions once).

    Activations are all freed by then, so a plan fits only if every rank's static bytes plus these
    stay under the memory limit (the contributions build up during the last backwards; the simulated
    peak does not hold them)."""
    sent = shared_messages(table, piece_rank, num_microbatches)
    own: dict[int, float] = {}
    for entry, users in _users(table):
        holders = {piece_rank[k] for k in users}
        if len(holders) > 1:
            for k in users:
                own[piece_rank[k]] = own.get(piece_rank[k], 0.0) + num_microbatches * entry.bytes
    held = dict(own)
    for (src, dst), nbytes in sent.items():
        held[src] += nbytes
        held[dst] += nbytes
    return dict(sorted(held.items()))


def shared_sync_time(table: CostTable, piece_rank: Sequence[int], num_microbatches: int, *,
                     link: Link | None = None) -> float:
    """Seconds the runtime spends after the step's last action combining shared parameters' gradients:
    0 when every shared parameter's users are on one rank.

    The exchange of :func:`shared_messages` replayed as the runtime runs it: each rank goes through its
    peers in rank order; with a higher peer it posts its send (it does not wait) and then waits for the
    peer's message, with a lower one it waits first and sends after. A message posted at time t arrives
    at ``t + link.time(bytes)``; a rank is done when it has received everything and its sends have
    arrived; the time is the last rank's. The link is ``link``, else the table's ``runtime.replica_link``
    (the engine's packed gradient messages, measured), else its ``link``. Adding the contributions
    up is not priced (one pass over them, small next to sending them).
    """
    link = link or table.runtime.replica_link or table.link
    sent = shared_messages(table, piece_rank, num_microbatches)
    if not sent:
        return 0.0
    ranks = sorted({r for pair in sent for r in pair})
    program = {r: [(kind, peer) for peer in ranks if peer != r and (r, peer) in sent
                   for kind in (("send", "recv") if r < peer else ("recv", "send"))] for r in ranks}
    clock = dict.fromkeys(ranks, 0.0)
    arrival: dict[tuple[int, int], float] = {}
    done = dict.fromkeys(ranks, 0)
    while any(done[r] < len(program[r]) for r in ranks):
        moved = False
        for r in ranks:
            while done[r] < len(program[r]):
                kind, peer = program[r][done[r]]
                if kind == "send":
                    arrival[(r, peer)] = clock[r] + link.time(sent[(r, peer)])
                elif (peer, r) in arrival:
                    clock[r] = max(clock[r], arrival[(peer, r)])
                else:
                    break  # waits for the peer to send
                done[r] += 1
                moved = True
        assert moved, "the exchange order cannot deadlock (each pair's lower rank sends first)"
    return max(max(clock[r], *(t for (src, _), t in arrival.items() if src == r)) for r in ranks)
