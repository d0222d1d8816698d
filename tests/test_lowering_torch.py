"""Lowered schedules against torch.distributed.pipelining's ``compute_comms`` IR.

Oracles: torch's ``_PipelineScheduleRuntime._load_csv(path, format="compute_comms")`` and
``_dump_csv`` (our file, action by action, and back), torch's own dry-run
``_simulate_comms_compute`` (it stops on a deadlock through communication), and torch's own
lowering ``_add_send_recv`` of its 1F1B and interleaved orders read by pipeloom.

Without torch the module is skipped, unless PIPELOOM_REQUIRE_TORCH=1 (set by ``make test``).
"""

from __future__ import annotations

import csv
import io

import pytest

from pipeloom import Comm, lower, simulate, validate
from pipeloom.ir import parse_action, schedule_from_csv, schedule_to_csv
from pipeloom.schedules import build_schedule
from torch_pipelining import import_torch_schedules

ts = import_torch_schedules()

# (registry name, options, stages per rank) of chain schedules a torch CSV carries.
CHAINS = [
    ("1f1b", {}, 1),
    ("gpipe", {}, 1),
    ("interleaved-1f1b", {"stages_per_rank": 2}, 2),
    ("zb-h1", {}, 1),
    ("zbv", {}, 2),
]


def _runtime(ranks: int, stages: int, microbatches: int):
    """A ``_PipelineScheduleRuntime`` without stages: ``_load_csv``/``_dump_csv`` need only these."""
    runtime = object.__new__(ts._PipelineScheduleRuntime)
    runtime.pp_group_size, runtime._num_stages, runtime._n_microbatches = ranks, stages, microbatches
    runtime._stages, runtime._defer_pp_recv, runtime.pipeline_order = [], False, {}
    return runtime


def _torch_rows(order: dict) -> str:
    """torch's ``_dump_csv``: ``csv.writer`` rows of its actions, one per rank."""
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in sorted(order):
        writer.writerow(order[rank])
    return out.getvalue()


@pytest.mark.parametrize(("name", "options", "stages_per_rank"), CHAINS, ids=[n for n, _, _ in CHAINS])
@pytest.mark.parametrize(("ranks", "microbatches"), [(4, 8), (2, 3)])
def test_torch_loads_our_compute_comms_csv_action_by_action(tmp_path, name, options, stages_per_rank, ranks,
                                                             microbatches):
    lowered = lower(build_schedule(name, ranks, microbatches, **options))
    path = tmp_path / "lowered.csv"
    path.write_text(schedule_to_csv(lowered))
    stages = ranks * stages_per_rank
    runtime = _runtime(ranks, stages, microbatches)
    runtime._load_csv(str(path), format="compute_comms")
    order = runtime.pipeline_order_with_comms
    assert sorted(order) == list(range(ranks))
    compute_only = _runtime(ranks, stages, microbatches)  # torch's own lowering of the compute actions
    (tmp_path / "compute.csv").write_text(schedule_to_csv(build_schedule(name, ranks, microbatches, **options)))
    compute_only._load_csv(str(tmp_path / "compute.csv"), format="compute_only")
    for rank in range(ranks):
        cells = [repr(action) for action in order[rank]]
        assert [c for c in cells if "REDUCE_GRAD" not in c] == [str(action) for action in lowered.ranks[rank]]
        # one REDUCE_GRAD per stage (torch 2.10+ divides the gradients by M there), after the action torch puts it
        assert _reduce_grads(cells) == _reduce_grads([repr(a) for a in compute_only.pipeline_order_with_comms[rank]])
        assert sorted(stage for stage, _ in _reduce_grads(cells)) == sorted(
            {action.stage for action in lowered.ranks[rank] if hasattr(action, "kind") and action.kind in "BW"})
    # torch's dry run finds no deadlock (it raises "Schedule is not progressing" on one)
    comms = {rank: [a for a in actions if "REDUCE_GRAD" not in repr(a)] for rank, actions in order.items()}
    ts._simulate_comms_compute(comms, lambda s: runtime.stage_index_to_group_rank[s], stages)  # knows no REDUCE_GRAD
    # and what torch dumps, we read back as the same schedule
    runtime._dump_csv(str(tmp_path / "dumped.csv"), format="compute_comms")
    back = schedule_from_csv((tmp_path / "dumped.csv").read_text())
    assert back.ranks == lowered.ranks and back.problem.tasks == lowered.problem.tasks


def _reduce_grads(cells: list[str]) -> list[tuple[int, str]]:
    """Each ``sREDUCE_GRAD`` cell's stage and the last compute cell before it."""
    compute = [c for c in cells if "SEND" not in c and "RECV" not in c and "SHARD" not in c]
    return [(int(c.removesuffix("REDUCE_GRAD")), compute[k - 1]) for k, c in enumerate(compute) if "REDUCE_GRAD" in c]


def _torch_interleaved(ranks: int, microbatches: int, stages_per_rank: int) -> dict[int, list]:
    """torch's ScheduleInterleaved1F1B compute order (1 stage per rank: its 1F1B), without stages."""
    order = object.__new__(ts.ScheduleInterleaved1F1B)
    order.pp_group_size, order._n_microbatches, order.n_local_stages = ranks, microbatches, stages_per_rank
    order.number_of_rounds = max(1, microbatches // ranks)
    order.microbatches_per_round = microbatches // order.number_of_rounds
    order.num_stages = order._num_stages = ranks * stages_per_rank
    return {r: [a for a in order._calculate_single_rank_operations(r) if a is not None] for r in range(ranks)}


@pytest.mark.parametrize("stages_per_rank", [1, 2])
@pytest.mark.parametrize("fsdp_passes", [False, True])
def test_torchs_own_lowering_loads_and_validates(stages_per_rank, fsdp_passes):
    """``_add_send_recv`` places each receive as soon as its send is issued (not right before use);
    with ``fsdp_passes`` torch's UNSHARD/RESHARD/REDUCE_GRAD passes run first, as in its runtime.

    A receive placed early holds its rank until the data arrives (pipeloom's blocking-receive model;
    torch's runtime posts it and waits at the compute), so torch's placement can only take longer
    than the compute-only replay, and pipeloom's own (right before use) takes exactly as long."""
    ranks, microbatches = 4, 8
    stages = ranks * stages_per_rank
    compute = _torch_interleaved(ranks, microbatches, stages_per_rank)
    actions = {r: list(a) for r, a in compute.items()}
    if fsdp_passes:
        actions = {r: ts._add_reduce_grad(ts._add_unshard_reshard(a), microbatches)
                   for r, a in actions.items()}
    lowered_by_torch = ts._add_send_recv(actions, stage_to_rank=lambda s: s % ranks, num_stages=stages)
    schedule = schedule_from_csv(_torch_rows(lowered_by_torch))
    assert schedule.lowered
    for rank in range(ranks):
        computed = [str(a) for a in schedule.ranks[rank] if type(a) is not Comm]
        assert computed == [repr(a) for a in compute[rank]]
    timeline = validate(schedule, ordered=True)
    compute_only = schedule_from_csv(_torch_rows(compute))
    assert timeline.makespan >= simulate(compute_only).makespan
    ours = lower(compute_only)  # the same messages, receives placed right before use instead
    assert sorted(map(str, _comm_actions(ours))) == sorted(map(str, _comm_actions(schedule)))
    assert validate(ours, ordered=True).makespan == simulate(compute_only).makespan


def _comm_actions(schedule) -> list[Comm]:
    return [a for actions in schedule.ranks for a in actions if type(a) is Comm]


def test_torch_and_pipeloom_agree_on_a_deadlock_through_communication(capsys):
    """Rank 0 waits for gradients before sending the forward output rank 1 needs to make them."""
    rows = ["0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"]
    schedule = schedule_from_csv("\n".join(",".join(row.split()) for row in rows) + "\n")
    with pytest.raises(ValueError, match="deadlock"):
        validate(schedule)
    order = {r: [ts._Action.from_str(cell) for cell in row.split()] for r, row in enumerate(rows)}
    with pytest.raises(ValueError, match="not progressing"):
        ts._simulate_comms_compute(order, lambda s: s, 2)
    capsys.readouterr()  # torch prints its partial schedule


def test_our_comm_text_is_torchs_action_text():
    for text in ("1SEND_F0", "2RECV_F13", "0SEND_B3", "5RECV_B7"):
        assert repr(ts._Action.from_str(text)) == str(parse_action(text)) == text
