"""Our CSV schedules against torch.distributed.pipelining's own parser, validator and schedules.

Oracles: torch's ``_Action.from_str`` / ``repr`` (same text both ways), torch's
``_validate_schedule`` on our exports loaded the way its ``_load_csv`` does (csv.reader +
``_Action.from_str``), and torch's own interleaved / zero-bubble orders loaded into ours.

Without torch the module is skipped, unless PIPELOOM_REQUIRE_TORCH=1 (set by ``make test``),
which turns a missing torch into a failure so these checks cannot silently stop running.
"""

from __future__ import annotations

import csv
import io

import pytest

from pipeloom.errors import ScheduleFormatError
from pipeloom.ir import schedule_from_csv, schedule_to_csv
from pipeloom.schedules import build_schedule
from pipeloom.validate import validate
from torch_pipelining import import_torch_schedules, torch_order_csv

torch_schedules = import_torch_schedules()
_Action = torch_schedules._Action

# (registry name, options, stages per rank) of every schedule we export for torch.
EXPORTS = [
    ("gpipe", {}, 1),
    ("1f1b", {}, 1),
    ("interleaved-1f1b", {"stages_per_rank": 2}, 2),
    ("interleaved-1f1b", {"stages_per_rank": 3}, 3),
    ("zb-h1", {}, 1),
    ("zb-h2", {}, 1),
    ("zbv", {}, 2),
]
SIZES = [(1, 1), (2, 3), (4, 4), (4, 8), (3, 7), (8, 16)]


def _torch_load_csv(text: str) -> dict[int, list]:
    """What ``PipelineScheduleMulti._load_csv`` does with a compute-only file."""
    rows = csv.reader(io.StringIO(text))
    return {rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}


@pytest.mark.parametrize(("name", "options", "stages_per_rank"), EXPORTS,
                         ids=[f"{n}-v{v}" for n, _, v in EXPORTS])
@pytest.mark.parametrize(("ranks", "microbatches"), SIZES)
def test_torch_parses_and_accepts_our_csv(name, options, stages_per_rank, ranks, microbatches):
    schedule = build_schedule(name, ranks, microbatches, **options)  # every EXPORTS family takes any size
    text = schedule_to_csv(schedule)
    actions = _torch_load_csv(text)
    for rank, row in actions.items():
        assert [repr(action) for action in row] == [str(a) for a in schedule.ranks[rank]]
    mapping = torch_schedules._validate_schedule(
        actions, ranks, ranks * stages_per_rank, microbatches
    )
    for task in schedule.problem.tasks:
        assert mapping[task.stage] == task.ranks[0]


@pytest.mark.parametrize(("name", "options", "stages_per_rank"), EXPORTS[:2] + EXPORTS[4:5],
                         ids=["gpipe", "1f1b", "zb-h1"])
def test_torch_rejects_a_csv_missing_a_backward(name, options, stages_per_rank):
    """The check above can fail: drop the last cell of rank 0 and torch must complain."""
    schedule = build_schedule(name, 2, 2, **options)
    rows = schedule_to_csv(schedule).splitlines()
    rows[0] = rows[0].rsplit(",", 1)[0]
    with pytest.raises(AssertionError, match="microbatches"):
        torch_schedules._validate_schedule(_torch_load_csv("\n".join(rows)), 2, 2, 2)


@pytest.mark.parametrize(
    "schedule_class",
    ["ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"],
)
@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 8), (4, 12)])
def test_torch_dumped_orders_load_and_validate(schedule_class, ranks, microbatches):
    text = torch_order_csv(getattr(torch_schedules, schedule_class), ranks, microbatches, 2)
    rows = list(csv.reader(io.StringIO(text)))
    assert any("" in row for row in rows), "torch pads idle steps with empty cells; the loader skips them"
    schedule = schedule_from_csv(text)
    assert schedule.num_ranks == ranks and schedule.problem.num_stages == 2 * ranks
    timeline = validate(schedule, ordered=True)
    assert timeline.makespan >= microbatches * max(schedule.problem.work_per_microbatch())


def test_hand_written_torch_csv_with_idle_cells():
    # 1F1B on 2 ranks, 2 micro-batches, written as torch pads it (rank 1 idles one step first).
    text = "0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1,\n"
    schedule = schedule_from_csv(text)
    assert schedule.ranks == build_schedule("1f1b", 2, 2).ranks
    assert validate(schedule, ordered=True).makespan == 3 * 3


def test_torch_dualpipev_order_with_overlapped_pairs_loads_as_ours():
    """torch writes DualPipeV's overlapped F+B pair as ``(1F6;6B2)OVERLAP_F_B``: it loads as an
    Overlap, and torch's whole order is our dualpipev's, cell for cell."""
    text = torch_order_csv(torch_schedules.ScheduleDualPipeV, 4, 8, 2)
    schedule = schedule_from_csv(text)
    assert schedule.ranks == build_schedule("dualpipev", 4, 8).ranks
    validate(schedule, ordered=True)


def test_a_broken_overlapped_cell_is_a_clear_format_error():
    with pytest.raises(ScheduleFormatError, match=r"row 1, column 2: bad overlapped action '\(0F1;\)OVERLAP_F_B'"):
        schedule_from_csv("0F0,(0F1;)OVERLAP_F_B\n")
