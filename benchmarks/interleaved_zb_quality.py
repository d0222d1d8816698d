"""pipeloom's ``interleaved-zb`` against torch's ``ScheduleInterleavedZeroBubble`` order, side by side.

Run ``python benchmarks/interleaved_zb_quality.py``. For p in {2, 4, 8}, v = 2 stages per rank,
m in {8, 16, 24, 32} (where torch accepts m: a multiple of its max(1, m // p) rounds) and three
cost sets, torch's per-rank order is computed by its own class (no GPUs: the order needs only a few
attributes, so the object is made without ``__init__``), loaded with ``schedule_from_csv`` under
the same costs, and simulated by pipeloom next to ours. Memory is per rank; "mem ok" means ours
is at most torch's on every rank. Needs torch; the schedule side needs nothing else.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from torch.distributed.pipelining import schedules as torch_schedules

from pipeloom.ir import schedule_from_csv
from pipeloom.schedules.interleaved_zb import interleaved_zb
from pipeloom.stages import Costs
from pipeloom.validate import validate

__all__ = ["COST_SETS", "Row", "interleaved_zb_vs_torch", "torch_interleaved_zb_csv", "torch_order_csv"]

COST_SETS = {
    "unit": Costs(f=1, b=1, w=1),
    "paper": Costs(f=18522, b=18086, w=9337, comm=601),
    "f1 b2 w.5 c.1": Costs(f=1, b=2, w=0.5, comm=0.1),
}
"""Equal costs; the zero-bubble paper's profiled setting; unequal costs with latency."""
RANKS = (2, 4, 8)
MICROBATCHES = (8, 16, 24, 32)
STAGES_PER_RANK = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One cell of the grid."""

    costs: str
    ranks: int
    microbatches: int
    ours: float
    """Our makespan."""
    torch: float
    """torch's order's makespan under the same costs."""
    our_peaks: tuple[float, ...]
    torch_peaks: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return self.ours / self.torch

    @property
    def memory_ok(self) -> bool:
        return all(a <= b + 1e-9 for a, b in zip(self.our_peaks, self.torch_peaks))


def torch_order_csv(class_name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> str | None:
    """The per-rank order of torch's schedule class ``class_name`` as torch CSV, or None where torch
    refuses m. The classes need real stages in ``__init__``; their order needs only these attributes,
    so the object is made without ``__init__`` (as tests/test_torch_interop.py does)."""
    p, m = num_ranks, num_microbatches
    rounds = max(1, m // p)
    if m % rounds:
        return None
    order = object.__new__(getattr(torch_schedules, class_name))
    order.pp_group_size, order._n_microbatches, order.n_local_stages = p, m, stages_per_rank
    order.number_of_rounds, order.microbatches_per_round = rounds, m // rounds
    order.num_stages = order._num_stages = p * stages_per_rank
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in range(p):
        writer.writerow(["" if a is None else str(a) for a in order._calculate_single_rank_operations(rank)])
    return out.getvalue()


def torch_interleaved_zb_csv(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> str | None:
    """torch's ScheduleInterleavedZeroBubble order as torch CSV, or None where torch refuses m."""
    return torch_order_csv("ScheduleInterleavedZeroBubble", num_ranks, num_microbatches, stages_per_rank)


def interleaved_zb_vs_torch() -> list[Row]:
    """Print the grid (ours vs torch: makespan, ratio, peak memory of rank 0 and the per-rank check)."""
    rows = []
    print(f"interleaved-zb vs torch ScheduleInterleavedZeroBubble (v = {STAGES_PER_RANK}; peaks are per rank)")
    print(f"{'costs':>14} {'p':>2} {'m':>3} {'ours':>12} {'torch':>12} {'ratio':>7} "
          f"{'peak ours':>10} {'peak torch':>10} {'mem ok':>6}")
    for name, costs in COST_SETS.items():
        for p in RANKS:
            for m in MICROBATCHES:
                text = torch_interleaved_zb_csv(p, m, STAGES_PER_RANK)
                if text is None:
                    print(f"{name:>14} {p:>2} {m:>3}  (torch refuses this m)")
                    continue
                theirs = validate(schedule_from_csv(text, costs=costs), ordered=True)
                ours = validate(interleaved_zb(p, m, costs=costs, stages_per_rank=STAGES_PER_RANK), ordered=True)
                row = Row(costs=name, ranks=p, microbatches=m, ours=ours.makespan, torch=theirs.makespan,
                          our_peaks=ours.peak_memory, torch_peaks=theirs.peak_memory)
                rows.append(row)
                print(f"{name:>14} {p:>2} {m:>3} {row.ours:>12.10g} {row.torch:>12.10g} {row.ratio:>7.4f} "
                      f"{max(row.our_peaks):>10.3g} {max(row.torch_peaks):>10.3g} "
                      f"{'yes' if row.memory_ok else 'NO':>6}")
    slower = [row for row in rows if row.ratio > 1 + 1e-12]
    faster = [row for row in rows if row.ratio < 1 - 1e-12]
    over = [row for row in rows if not row.memory_ok]
    worst = max(rows, key=lambda row: row.ratio)
    best = min(rows, key=lambda row: row.ratio)
    print(f"verdict: {len(rows)} cells; slower than torch in {len(slower)} (worst ratio {worst.ratio:.4f}), "
          f"faster in {len(faster)} (best {best.ratio:.4f}: {best.costs}, p={best.ranks}, m={best.microbatches}), "
          f"more memory than torch on some rank in {len(over)}")
    return rows


if __name__ == "__main__":
    interleaved_zb_vs_torch()
