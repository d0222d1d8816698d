"""What the plan search refuses: a request it cannot plan (:func:`check_request`), the answer when no
candidate plan fits the memory or none could be built (:func:`nothing_fits`), and the pieces replicas would update
apart (:func:`running_stats_pieces`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeloom.formatting import format_bytes
from pipeloom.plan.costs.file import MAX_PIECES
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import NoPlanFits, PlanError
from pipeloom.plan.partitioning.partitioner import format_bytes_up
from pipeloom.schedules import REGISTRY

if TYPE_CHECKING:
    from pipeloom.plan.planner import Candidate

__all__ = ["check_request", "nothing_fits", "running_stats_pieces"]


def running_stats_pieces(table: CostTable) -> str:
    """The pieces of ``table`` whose training step updates their buffers (BatchNorm's running statistics), the first
    three named ('' for none): two replicas of them, a schedule's or data-parallel ones, would update them apart."""
    updating = [p.name for p in table.pieces if p.running_stats]
    return ", ".join(updating[:3]) + (f" and {len(updating) - 3} more" if len(updating) > 3 else "")


def check_request(table: CostTable, num_ranks: int, global_batch: int, memory_limit: float | None,
                  schedules: Sequence[str] | None) -> None:
    """PlanError for a request :func:`~pipeloom.plan.planner.plan_pipeline` cannot plan, naming the fault and its
    fix: counts that are not positive integers, too many pieces, a memory limit that is no size, unknown schedules,
    a table of no time, more ranks than pieces."""
    for name, value in (("num_ranks", num_ranks), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    if len(table.pieces) > MAX_PIECES:
        raise PlanError(f"the cost table has {len(table.pieces):,} pieces, above the planner's limit of "
                        f"{MAX_PIECES:,}; profile coarser pieces (whole blocks) or merge them")
    if memory_limit is not None and not memory_limit > 0:
        raise PlanError(f"memory_limit must be a positive number of bytes, got {memory_limit!r}")
    unknown = [name for name in schedules or () if name not in REGISTRY]
    if unknown:
        raise PlanError(f"unknown schedule(s) {unknown}; choose among: {', '.join(REGISTRY)}")
    if not any(p.f > 0 or p.i > 0 or p.w > 0 for p in table.pieces):
        raise PlanError("every piece of the cost table takes no time (f, i and w all 0): there is nothing to "
                        "plan; profile the model (pipeloom profile) or fill in the pieces' times")
    if num_ranks > len(table.pieces):
        raise PlanError(
            f"{num_ranks} ranks need at least {num_ranks} pieces (one stage each), but the cost table has "
            f"{len(table.pieces)}; use at most {len(table.pieces)} ranks, or profile finer pieces"
        )


def nothing_fits(table: CostTable, num_ranks: int, memory_limit: float | None,
                 ranked: Sequence[Candidate]) -> NoPlanFits:
    """The error where no candidate fits: the least memory any needs and its plan (bytes rounded up), or, where none
    could be built, why each failed."""
    sized = [(c.peak_memory, c) for c in ranked if c.peak_memory is not None]
    if memory_limit is not None and sized:
        need, least = min(sized, key=lambda pair: pair[0])
        return NoPlanFits(
            f"no plan fits {format_bytes(memory_limit)} per rank on {num_ranks} ranks; the smallest that fits "
            f"is about {format_bytes_up(need)} (rounded up; {least.label}, {least.microbatches} "
            f"micro-batches of {least.microbatch_size}): raise the memory limit, or use more ranks",
            smallest_limit=need,
        )
    # the most micro-batches first: a count too small to build names itself, the largest meets the real obstacle
    reasons = "; ".join(dict.fromkeys(c.reason for c in sorted(ranked, key=lambda c: -c.microbatches)))
    return NoPlanFits(f"no plan could be built for {len(table.pieces)} pieces on {num_ranks} ranks: {reasons}",
                      smallest_limit=None)
