"""Event replay of a lowered schedule: communication takes its own time on each rank.

A send occupies its rank for ``comm_latency`` per message it carries (one after the other), and a
message arrives when its part of the send ends; a receive waits until every message it takes has
been sent (receives block, sends do not), and occupies its rank from when the rank reaches it until
the last of them has arrived. Compute actions run as in the compute-only replay, their remote
inputs carried by the receives (no latency added on top).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from itertools import accumulate
from operator import add

from pipeloom.errors import DeadlockError, ScheduleError
from pipeloom.ir import (
    Action,
    Comm,
    Overlap,
    Schedule,
    action_duration,
    action_memory,
    compute_parts,
    format_grid,
    part_tasks,
)
from pipeloom.lowering.graph import CommGraph, Message

__all__ = ["LoweredReplay", "replay_lowered"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoweredReplay:
    """Times and memory of every action of a lowered schedule, aligned with its rank lists (the
    fields of :class:`pipeloom.sim.Timeline`, which the simulator builds from them)."""

    starts: tuple[tuple[float, ...], ...]
    """``starts[r][i]``: start of ``schedule.ranks[r][i]``."""
    ends: tuple[tuple[float, ...], ...]
    """``ends[r][i]``: end of ``schedule.ranks[r][i]``."""
    memory: tuple[tuple[float, ...], ...]
    """``memory[r][i]``: memory held on rank r right after action i starts (communication holds none)."""
    makespan: float
    """Latest end over all actions."""
    busy: tuple[float, ...]
    """Per rank: the sum of its compute actions' durations (communication is not work)."""
    peak_memory: tuple[float, ...]
    """Per rank: the most memory held (static memory included)."""


def replay_lowered(schedule: Schedule, *, overlap_overhead: float | None = None) -> LoweredReplay:
    """Replay ``schedule`` (see the module docstring); DeadlockError naming each stuck rank's head
    action and what it waits for when the lists cannot run to the end. An overlapped pair takes
    ``max(forward, backward) + overlap_overhead`` (None: the problem's), a B on a split stage I + W."""
    overhead = schedule.problem.overlap_overhead if overlap_overhead is None else overlap_overhead
    state = _State(schedule, overhead)
    state.run()
    stuck = [r for r, actions in enumerate(schedule.ranks) if state.pos[r] < len(actions)]
    if stuck:
        raise DeadlockError(state.deadlock_message(stuck))
    problem = schedule.problem
    static = problem.static_memory or (0.0,) * problem.num_ranks
    memory, peaks, busy = [], [], []
    for r, actions in enumerate(schedule.ranks):
        computes = [a for a in actions if type(a) is not Comm]
        held = list(accumulate((0.0 if type(a) is Comm else action_memory(problem, a) for a in actions),
                               initial=static[r]))
        memory.append(tuple(held[1:]))
        peaks.append(max(held))
        busy.append(reduce(add, (action_duration(problem, a, overlap_overhead=overhead) for a in computes),
                           0.0))  # as the compute-only sum
    return LoweredReplay(
        starts=tuple(map(tuple, state.starts)), ends=tuple(map(tuple, state.ends)), memory=tuple(memory),
        makespan=max((e[-1] for e in state.ends if e), default=0.0), busy=tuple(busy),
        peak_memory=tuple(peaks),
    )


class _State:
    """Per rank: position, free time and times so far; finished compute and sent messages."""

    def __init__(self, schedule: Schedule, overhead: float) -> None:
        self.schedule = schedule
        self.overhead = overhead
        self.problem = schedule.problem
        self.graph = CommGraph.of(schedule.problem)
        self.latency = schedule.problem.comm_latency
        self.pos = [0] * schedule.num_ranks
        self.free = [0.0] * schedule.num_ranks
        self.starts = [[0.0] * len(actions) for actions in schedule.ranks]
        self.ends = [[0.0] * len(actions) for actions in schedule.ranks]
        self.finish: dict[Action, float] = {}
        self.arrival: dict[Message, float] = {}
        self.waiters: dict[object, list[int]] = {}
        self.todo = list(range(schedule.num_ranks))

    def run(self) -> None:
        """Advance ranks until none can move; a blocked rank parks on what it waits for."""
        while self.todo:
            r = self.todo.pop()
            actions = self.schedule.ranks[r]
            while self.pos[r] < len(actions):
                action = actions[self.pos[r]]
                times = self._comm(action, r) if type(action) is Comm else self._compute(action, r)
                if times is None:
                    break
                i = self.pos[r]
                self.starts[r][i], self.ends[r][i] = times
                self.free[r] = times[1]
                self.pos[r] = i + 1

    def _park(self, key: object, rank: int) -> None:
        self.waiters.setdefault(key, []).append(rank)

    def _wake(self, key: object) -> None:
        self.todo.extend(self.waiters.pop(key, ()))

    def _compute(self, action: Action | Overlap, rank: int) -> tuple[float, float] | None:
        units = [part_tasks(self.problem, part) for part in compute_parts(action)]
        if not all(self.problem.has_task(task.task) for unit in units for task in unit):
            raise ScheduleError(f"rank {rank} step {self.pos[rank]}: {action} is not a task of this "
                                "schedule's problem (run the validator for details)")
        start = self.free[rank]
        for unit in units:  # a W waits for the I of its own B; a pair's parts never wait for each other
            for task in unit:
                for dep in self.problem.task(task.task).deps:
                    needed = Action(dep[0], dep[1], task.microbatch)
                    if needed in unit:
                        continue
                    done = self.finish.get(needed)
                    if done is None:
                        self._park(needed, rank)
                        return None
                    start = max(start, done)
        end = start + action_duration(self.problem, action, overlap_overhead=self.overhead)
        for unit in units:
            for task in unit:
                self.finish[task] = end
                self._wake(task)
        return start, end

    def _comm(self, action: Comm, rank: int) -> tuple[float, float] | None:
        messages = self.graph.messages(action)
        start = self.free[rank]
        if action.is_send:
            for k, message in enumerate(messages, 1):
                self.arrival[message] = start + k * self.latency
                self._wake(message)
            return start, start + len(messages) * self.latency
        end = start
        for message in messages:
            arrives = self.arrival.get(message)
            if arrives is None:
                self._park(message, rank)
                return None
            end = max(end, arrives)
        return start, end

    def deadlock_message(self, stuck: list[int]) -> str:
        """Each stuck rank's head action and what it waits for, then the grid."""
        reasons = []
        for r in stuck:
            action = self.schedule.ranks[r][self.pos[r]]
            if type(action) is Comm:
                missing = [m for m in self.graph.messages(action) if m not in self.arrival]
                send = self.graph.send_of(missing[0])
                why = (f"waits for {missing[0]} from rank {self.graph.source(missing[0])}, "
                       f"whose {send} never runs first")
            else:
                missing_deps = [f"{s}{k}{task.microbatch}" for part in compute_parts(action)
                                for task in part_tasks(self.problem, part)
                                for s, k in self.problem.task(task.task).deps
                                if Action(s, k, task.microbatch) not in self.finish]
                why = "waits for " + ", ".join(missing_deps) + ", which never runs first"
            reasons.append(f"rank {r} step {self.pos[r]}: {action} {why}")
        first = stuck[0]
        return (f"deadlock in schedule {self.schedule.name!r}: " + "; ".join(reasons[:4])
                + ("; ..." if len(reasons) > 4 else "")
                + " (a receive waits until its message is sent; sends do not wait)\n"
                + format_grid(self.schedule.ranks, mark=(first, self.pos[first])))
