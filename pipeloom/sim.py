"""Event simulation of a schedule with the time and memory semantics of DESIGN §3.

``simulate(schedule)`` replays every rank's list in order and returns a :class:`Timeline`:
start/end of each action, per-rank memory held, makespan, bubble ratio, busy time and peaks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pipeloom.errors import DeadlockError, ScheduleError
from pipeloom.ir import Action, Schedule, format_grid

__all__ = ["Timeline", "simulate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """What happens when a schedule runs: times and memory per rank, aligned with its lists."""

    schedule: Schedule
    """The schedule that was simulated."""
    starts: tuple[tuple[float, ...], ...]
    """``starts[r][i]``: start time of ``schedule.ranks[r][i]``."""
    ends: tuple[tuple[float, ...], ...]
    """``ends[r][i]``: end time of ``schedule.ranks[r][i]``."""
    memory: tuple[tuple[float, ...], ...]
    """``memory[r][i]``: memory held on rank r right after ``schedule.ranks[r][i]`` starts."""
    makespan: float
    """Latest finish over all actions."""
    busy: tuple[float, ...]
    """Per-rank sum of action durations."""
    peak_memory: tuple[float, ...]
    """Per-rank maximum held memory (static memory included)."""

    @property
    def num_ranks(self) -> int:
        """Number of ranks."""
        return len(self.starts)

    @property
    def bubble_ratio(self) -> float:
        """``1 - sum(busy) / (num_ranks * makespan)``; 0 for an empty timeline."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_ranks * self.makespan)

    def events(self, rank: int) -> Iterator[tuple[Action, float, float]]:
        """``(action, start, end)`` of every action of ``rank``, in order."""
        return zip(self.schedule.ranks[rank], self.starts[rank], self.ends[rank])

    def action_times(self) -> dict[Action, tuple[float, float]]:
        """``{action: (start, end)}`` over all ranks (a multi-rank action appears once)."""
        times: dict[Action, tuple[float, float]] = {}
        for rank in range(self.num_ranks):
            for action, start, end in self.events(rank):
                times[action] = (start, end)
        return times

    def memory_curve(self, rank: int) -> list[tuple[float, float]]:
        """Step curve ``[(time, held), ...]`` of rank's memory, starting at ``(0, static)``."""
        static = self.schedule.problem.static_memory
        curve = [(0.0, static[rank] if static else 0.0)]
        curve.extend(zip(self.starts[rank], self.memory[rank]))
        return curve


def simulate(schedule: Schedule) -> Timeline:
    """Replay ``schedule``: each rank runs its list in order, one action at a time.

    An action starts at the latest of its ranks becoming free and each dep's finish (plus the
    communication latency when the dep ran on another set of ranks). Raises DeadlockError when
    the lists cannot run to the end; use :func:`pipeloom.validate.validate` for full checks.
    """
    problem = schedule.problem
    tasks = problem.tasks
    num_mb = schedule.num_microbatches
    latency = problem.comm_latency
    index = {task.key: i for i, task in enumerate(tasks)}
    durations = [task.duration for task in tasks]
    rank_sets = [task.ranks for task in tasks]
    deps = [
        tuple(
            (index[dep], 0.0 if set(tasks[index[dep]].ranks) == set(task.ranks) else latency)
            for dep in task.deps
        )
        for task in tasks
    ]
    num_ranks = problem.num_ranks
    seqs = []
    for r, actions in enumerate(schedule.ranks):
        seq = []
        for step, action in enumerate(actions):
            t = index.get((action[0], action[1]))
            if t is None or not 0 <= action[2] < num_mb:
                raise ScheduleError(
                    f"rank {r} step {step}: {action} is not a task of this schedule's problem "
                    "(run the validator for details)"
                )
            seq.append(t * num_mb + action[2])
        seqs.append(seq)

    finish: list[float | None] = [None] * (len(tasks) * num_mb)
    starts = [[0.0] * len(seq) for seq in seqs]
    ends = [[0.0] * len(seq) for seq in seqs]
    pos = [0] * num_ranks
    free = [0.0] * num_ranks
    waiting_on_action: dict[int, list[int]] = {}
    waiting_on_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    todo = list(range(num_ranks))
    while todo:
        r = todo.pop()
        seq, i, n = seqs[r], pos[r], len(seqs[r])
        rank_starts, rank_ends = starts[r], ends[r]
        now = free[r]
        while i < n:
            slot = seq[i]
            t, mb = divmod(slot, num_mb)
            start = now
            blocked = False
            for d, lat in deps[t]:
                done = finish[d * num_mb + mb]
                if done is None:
                    waiting_on_action.setdefault(d * num_mb + mb, []).append(r)
                    blocked = True
                    break
                if done + lat > start:
                    start = done + lat
            if blocked:
                break
            ranks = rank_sets[t]
            if len(ranks) == 1:
                end = start + durations[t]
                rank_starts[i] = start
                rank_ends[i] = end
                now = end
                i += 1
            else:
                others_ready = True
                for q in ranks:
                    if q != r and (pos[q] >= len(seqs[q]) or seqs[q][pos[q]] != slot):
                        waiting_on_rank[q].append(r)
                        others_ready = False
                        break
                if not others_ready:
                    break
                for q in ranks:
                    if q != r and free[q] > start:
                        start = free[q]
                end = start + durations[t]
                for q in ranks:
                    if q == r:
                        continue
                    starts[q][pos[q]] = start
                    ends[q][pos[q]] = end
                    pos[q] += 1
                    free[q] = end
                    todo.append(q)
                    if waiting_on_rank[q]:
                        todo.extend(waiting_on_rank[q])
                        waiting_on_rank[q].clear()
                rank_starts[i] = start
                rank_ends[i] = end
                now = end
                i += 1
            finish[slot] = end
            woken = waiting_on_action.pop(slot, None)
            if woken:
                todo.extend(woken)
        if i != pos[r]:
            pos[r] = i
            free[r] = now
            if waiting_on_rank[r]:
                todo.extend(waiting_on_rank[r])
                waiting_on_rank[r].clear()

    stuck = [r for r in range(num_ranks) if pos[r] < len(seqs[r])]
    if stuck:
        raise DeadlockError(_deadlock_message(schedule, pos, stuck, finish, num_mb, index))

    static = problem.static_memory or (0.0,) * num_ranks
    memory_delta = [task.memory for task in tasks]
    held_lists, peaks, busy = [], [], []
    for r, seq in enumerate(seqs):
        held = static[r]
        peak = held
        held_list = [0.0] * len(seq)
        total = 0.0
        for i, slot in enumerate(seq):
            t = slot // num_mb
            held += memory_delta[t]
            held_list[i] = held
            if held > peak:
                peak = held
            total += durations[t]
        held_lists.append(tuple(held_list))
        peaks.append(peak)
        busy.append(total)
    makespan = max((e[-1] for e in ends if e), default=0.0)
    return Timeline(
        schedule=schedule,
        starts=tuple(map(tuple, starts)),
        ends=tuple(map(tuple, ends)),
        memory=tuple(held_lists),
        makespan=makespan,
        busy=tuple(busy),
        peak_memory=tuple(peaks),
    )


def _deadlock_message(
    schedule: Schedule,
    pos: list[int],
    stuck: list[int],
    finish: list[float | None],
    num_mb: int,
    index: dict[tuple[int, str], int],
) -> str:
    """Name each stuck rank's head action and what it waits for, then show the grid."""
    problem = schedule.problem
    reasons = []
    for r in stuck:
        action = schedule.ranks[r][pos[r]]
        task = problem.tasks[index[action.task]]
        missing = [
            f"{dep[0]}{dep[1]}{action.microbatch}"
            for dep in task.deps
            if finish[index[dep] * num_mb + action.microbatch] is None
        ]
        if missing:
            why = "waits for " + ", ".join(missing) + ", which never runs first"
        else:
            why = "waits for ranks " + ", ".join(
                str(q) for q in task.ranks if q != r
            ) + " to reach it too"
        reasons.append(f"rank {r} step {pos[r]}: {action} {why}")
    first = stuck[0]
    return (
        f"deadlock in schedule {schedule.name!r}: "
        + "; ".join(reasons[:4])
        + ("; ..." if len(reasons) > 4 else "")
        + "\n"
        + format_grid(schedule.ranks, mark=(first, pos[first]))
    )
