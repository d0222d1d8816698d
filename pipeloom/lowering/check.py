"""Checks of a lowered schedule's communication actions (docs/design.md §2): each on its stage's rank, each
send after the compute that makes its data, every message sent once and received once, messages
between two ranks received in the order they are sent, every remote input received before use.
Deadlock through communication is found by the simulator's replay (:mod:`pipeloom.lowering.replay`).
"""

from __future__ import annotations

from collections import defaultdict

from pipeloom.errors import CommError
from pipeloom.ir import Comm, Schedule, compute_parts, format_grid
from pipeloom.lowering.graph import CommGraph, Message

__all__ = ["check_comms"]

_Where = tuple[int, int, Comm]  # (rank, step, action)


def _fail(schedule: Schedule, rank: int, step: int, message: str) -> None:
    raise CommError(
        f"schedule {schedule.name!r}, rank {rank} step {step}: {message}\n"
        + format_grid(schedule.ranks, mark=(rank, step))
    )


def check_comms(schedule: Schedule) -> None:
    """Raise CommError naming rank, step, action and the fix when the communication is wrong.

    The compute actions are checked by :func:`pipeloom.validate.check_structure`; this checks, in
    order: each communication action (its rank, that it carries something, its micro-batch, once),
    sends after their data, matching (unmatched send, unmatched receive, pair order), then that each
    compute action needing remote data has its receive before it on its rank.
    """
    graph = CommGraph.of(schedule.problem)
    sent: dict[tuple[int, int], list[tuple[Message, _Where]]] = defaultdict(list)
    taken: dict[tuple[int, int], list[tuple[Message, _Where]]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        _check_rank(schedule, graph, rank)
        for step, action in enumerate(actions):
            if type(action) is Comm:
                for message in graph.messages(action):
                    pair = (graph.source(message), graph.target(message))
                    (sent if action.is_send else taken)[pair].append((message, (rank, step, action)))
    for pair in sorted(set(sent) | set(taken)):
        _check_pair(schedule, graph, pair, sent.get(pair, []), taken.get(pair, []))
    for rank in range(schedule.num_ranks):
        _check_inputs(schedule, graph, rank)


def _check_rank(schedule: Schedule, graph: CommGraph, rank: int) -> None:
    """Each communication action of ``rank``: right rank, carries messages, micro-batch in range,
    runs once, and (a send) comes after the compute action that makes its data."""
    done: set = set()
    for step, action in enumerate(schedule.ranks[rank]):
        if type(action) is not Comm:
            for part in compute_parts(action):  # a B on a split stage makes what its I would
                done.update((part, part._replace(kind="I")) if part.kind == "B" else (part,))
            continue
        owner = graph.rank_of.get(action.stage)
        if owner != rank:
            where = "has no tasks" if owner is None else f"runs on rank {owner}"
            _fail(schedule, rank, step, f"{action} is not rank {rank}'s: stage {action.stage} {where}; "
                  "a communication action runs on the rank of its stage")
        if not graph.messages(action):
            _fail(schedule, rank, step, f"{action} carries nothing: stage {action.stage} has no "
                  f"{_peer_words(action)} on another rank; remove it")
        if not 0 <= action.microbatch < schedule.num_microbatches:
            _fail(schedule, rank, step, f"{action} uses micro-batch {action.microbatch}, outside "
                  f"0..{schedule.num_microbatches - 1}")
        if action in done:
            _fail(schedule, rank, step, f"{action} runs twice on rank {rank}; remove one")
        done.add(action)
        source = graph.compute_of(action)
        if action.is_send and source not in done:
            _fail(schedule, rank, step, f"{action} sends the output of {source} before {source} runs; "
                  f"move it right after {source}")


def _peer_words(action: Comm) -> str:
    return {"SEND_F": "consumer", "RECV_F": "producer", "SEND_B": "producer whose gradient task waits for it",
            "RECV_B": "consumer whose gradients it waits for"}[action.kind]


def _check_pair(schedule: Schedule, graph: CommGraph, pair: tuple[int, int],
                sent: list[tuple[Message, _Where]], taken: list[tuple[Message, _Where]]) -> None:
    """Rank ``pair[0]``'s messages to ``pair[1]``: each received exactly once, in send order."""
    src, dst = pair
    sent_set, taken_set = {m for m, _ in sent}, {m for m, _ in taken}
    for message, (rank, step, action) in sent:
        if message not in taken_set:
            receive = graph.receive_of(message)
            _fail(schedule, rank, step, f"{action} sends {message} to rank {dst}, which never receives it "
                  f"(unmatched send): add {receive} on rank {dst} before {graph.compute_of(receive)}")
    for message, (rank, step, action) in taken:
        if message not in sent_set:
            send = graph.send_of(message)
            _fail(schedule, rank, step, f"{action} waits for {message} from rank {src}, which never sends "
                  f"it (unmatched receive): add {send} on rank {src} after {graph.compute_of(send)}")
    for k, ((message, (s_rank, s_step, send)), (other, (rank, step, action))) in enumerate(zip(sent, taken)):
        if message != other:
            _fail(schedule, rank, step,
                  f"pair order: rank {src}'s message #{k + 1} to rank {dst} is {message} ({send}, rank "
                  f"{s_rank} step {s_step}), but rank {dst}'s receive #{k + 1} from rank {src} takes {other} "
                  f"({action}); messages between two ranks are received in the order they are sent: reorder "
                  f"the receives on rank {dst} or the sends on rank {src} (lower() keeps this order)")


def _check_inputs(schedule: Schedule, graph: CommGraph, rank: int) -> None:
    """Every compute action of ``rank`` that needs remote data has its receive earlier on ``rank``."""
    done: set[Comm] = set()
    for step, action in enumerate(schedule.ranks[rank]):
        if type(action) is Comm:
            done.add(action)
            continue
        for receive in graph.receives_before(action):
            if receive not in done:
                peers = sorted({graph.source(m) for m in graph.messages(receive)})
                _fail(schedule, rank, step, f"{action} needs data from rank(s) {peers}, but {receive} does not "
                      f"come before it on rank {rank}: put {receive} before {action}")
