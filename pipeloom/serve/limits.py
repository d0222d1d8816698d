"""How much work a request of ``pipeloom serve`` asks for, estimated before anything is built, in one unit for
every request kind: actions (a schedule's actions plus its ranks, whose per-rank state the simulator keeps).

- a named schedule: pieces x micro-batches x kinds (F, B and W for a split backward, else F and B) + ranks,
  where pieces are the schedule's stages (``ScheduleInfo.num_pieces``); exact for most, an upper bound for
  those that merge actions (dualpipe);
- a compare: the sum over its schedules;
- an uploaded schedule: the actions it lists (or its tasks x micro-batches, if more) + its ranks;
- a search: the placement's tasks x micro-batches + ranks;
- a plan: the sum over every candidate the planner would build (tensor-parallel sizes x replica counts x
  schedules x stages-per-rank options x micro-batch counts), each its schedule's actions + ranks + the
  partitioner's pieces x stages, and twice the largest again when it searches.

Past ``ServeConfig.max_actions``: 413 naming the limit. Every count a request carries is also capped
(:data:`MAX_COUNT`, :data:`MAX_LIST`, the cost tables' ``MAX_PIECES``, :data:`MAX_TABLES`, :data:`MAX_SEARCH_RANKS`), so
that no estimate itself takes long.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.arithmetic import divisors
from pipeloom.serve.errors import WorkError

__all__ = ["MAX_COUNT", "MAX_LIST", "MAX_SEARCH_RANKS", "MAX_TABLES", "check_count",
           "check_work", "plan_work", "schedule_work", "uploaded_work"]

MAX_COUNT = 2**20
"""Largest rank, micro-batch, stage or batch count a request may give (the work limit is usually lower)."""
MAX_LIST = 64
"""Longest list of counts or names in a request."""
MAX_TABLES = 16
"""Most cost tables in one plan request."""
MAX_SEARCH_RANKS = 256
"""Most ranks a search may ask for: its placement's tasks are built (to count them) before it is queued, in time
that grows as ranks squared (half a second for 256 ranks), and CP-SAT does not get far on more."""


def check_count(value: object, where: str, *, cap: int = MAX_COUNT) -> int:
    """``value`` as a count 1..cap; WorkError otherwise (400 for a non-count, 413 past the cap)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkError(f"{where}: expected an integer >= 1, got {value!r:.40}", 400)
    if value > cap:
        raise WorkError(f"{where} {value:,} is above this server's limit of {cap:,}", 413)
    return value


def check_work(work: int, what: str, limit: int) -> None:
    """Refuse ``work`` (actions) above ``limit``: 413 naming the limit (``ServeConfig.max_actions``)."""
    if work > limit:
        raise WorkError(f"{what} would take about {work:,} actions of work, above this server's limit of "
                        f"{limit:,} (max_actions); ask for fewer ranks, micro-batches, stages or schedules", 413)


def schedule_work(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> int:
    """Actions of the registered schedule ``name`` with these counts, plus its ranks."""
    from pipeloom.schedules import REGISTRY

    info = REGISTRY[name]
    options = {"stages_per_rank": stages_per_rank} if stages_per_rank and "stages_per_rank" in info.options else {}
    kinds = 3 if info.splits_backward else 2
    return info.num_pieces(ranks, options) * microbatches * kinds + ranks


def uploaded_work(document: dict) -> int:
    """Work of simulating an uploaded ``pipeloom.schedule/1`` object, read from its lists' lengths before it is
    parsed (fields of the wrong type count 0: the strict reader refuses them)."""
    ranks, tasks = document.get("ranks"), document.get("tasks")
    listed = sum(len(r) for r in ranks if isinstance(r, list)) if isinstance(ranks, list) else 0
    count = document.get("num_microbatches")
    count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
    per_task = len(tasks) * count if isinstance(tasks, list) else 0
    num_ranks = document.get("num_ranks")
    num_ranks = num_ranks if isinstance(num_ranks, int) and not isinstance(num_ranks, bool) and num_ranks > 0 else 0
    return max(listed, per_task) + max(num_ranks, len(ranks) if isinstance(ranks, list) else 0)


def plan_work(*, pieces: int, ranks: int, global_batch: int, schedules: Sequence[str] | None,
              stages_per_rank: Sequence[int], microbatches: Sequence[int] | None,
              data_parallel: Sequence[int] | None, tensor_parallel: Sequence[int], search: float, limit: int) -> int:
    """Work of a plan request: every candidate :func:`~pipeloom.plan.mesh.plan_mesh` would build, summed (an
    upper bound: it counts the schedules the planner may skip on a one-rank pipeline). Counting stops past
    ``limit``, so the estimate of a huge request is quick (and above ``limit``)."""
    from pipeloom.plan.planner import MAX_PLAN_MICROBATCHES
    from pipeloom.schedules import REGISTRY

    names = list(schedules) if schedules is not None else list(REGISTRY)
    total, largest = 0, 0
    for tp in (t for t in set(tensor_parallel) if ranks % t == 0):
        share = ranks // tp
        replicas = ([d for d in set(data_parallel) if share % d == 0] if data_parallel is not None else
                    [d for d in divisors(share) if global_batch % d == 0 and share // d <= pieces] or [1])
        for dp in replicas:
            pp, batch = share // dp, max(1, global_batch // dp)
            counts = ([m for m in set(microbatches) if batch % m == 0] if microbatches is not None
                      else divisors(batch, MAX_PLAN_MICROBATCHES))
            for name in names:
                options = stages_per_rank if "stages_per_rank" in REGISTRY[name].options else [None]
                for v in set(options):
                    stages = REGISTRY[name].num_pieces(pp, {"stages_per_rank": v} if v else None)
                    for m in counts:
                        work = schedule_work(name, pp, m, v) + pieces * stages
                        total, largest = total + work, max(largest, work)
                        if total > limit:
                            return total
    return total + (2 * largest if search > 0 else 0)
