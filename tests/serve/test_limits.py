"""The work estimates of ``pipeloom serve`` (:mod:`pipeloom.serve.limits`) against what is built: a schedule's
estimate against its actions (exact, or above for the schedules that merge actions), a plan's against every
candidate :func:`plan_mesh` tries, rebuilt here."""

from __future__ import annotations

import pytest

from pipeloom.plan import CostTable, Link, Piece
from pipeloom.plan.mesh import plan_mesh
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.serve.errors import WorkError
from pipeloom.serve.limits import MAX_COUNT, check_count, plan_work, schedule_work


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_schedules_estimate_is_its_actions_and_ranks(name):
    for ranks, microbatches, stages in ((2, 4, None), (4, 8, 3), (3, 6, 1)):
        options = {"stages_per_rank": stages} if stages and "stages_per_rank" in REGISTRY[name].options else {}
        try:
            schedule = build_schedule(name, ranks, microbatches, **options)
        except ValueError:  # a shape this generator refuses
            continue
        estimate = schedule_work(name, ranks, microbatches, stages)
        actual = schedule.num_actions + ranks
        assert actual <= estimate, (name, ranks, microbatches)
        if name not in ("dualpipe", "dualpipev"):  # the others never merge a forward and a backward
            assert actual == estimate, (name, ranks, microbatches)


def _table(pieces: int) -> CostTable:
    items = tuple(Piece(name=f"blocks.{k}", f=0.01, i=0.01, w=0.008, activation_bytes=2**20,
                        w_activation_bytes=2**18, param_bytes=2**19, output_bytes=2**16) for k in range(pieces))
    return CostTable(pieces=items, microbatch_size=1, link=Link(latency=1e-4, bandwidth=1e9))


@pytest.mark.parametrize(("ranks", "global_batch", "options"), [
    (4, 16, {}),
    (4, 8, {"schedules": ["1f1b", "interleaved-1f1b"], "stages_per_rank": [1, 2]}),
    (2, 12, {"data_parallel": [1, 2], "microbatches": [2, 6]}),
])
def test_a_plans_estimate_covers_every_candidate_the_planner_tries(ranks, global_batch, options):
    table = _table(8)
    result = plan_mesh(table, num_ranks=ranks, global_batch=global_batch, **options)
    tried = 0
    for candidate in result.candidates:
        pp = ranks // candidate.data_parallel
        stages = candidate.schedule_options.get("stages_per_rank")
        pieces = REGISTRY[candidate.schedule].num_pieces(pp, candidate.schedule_options or None)
        tried += schedule_work(candidate.schedule, pp, candidate.microbatches, stages) + len(table.pieces) * pieces
    estimate = plan_work(pieces=len(table.pieces), ranks=ranks, global_batch=global_batch,
                         schedules=options.get("schedules"), stages_per_rank=options.get("stages_per_rank", [2]),
                         microbatches=options.get("microbatches"), data_parallel=options.get("data_parallel"),
                         tensor_parallel=[1], search=0.0, limit=10**9)
    # an upper bound, and not a loose one: it counts only what the planner may skip on one-rank pipelines
    assert tried <= estimate <= 2 * tried, (tried, estimate)


def test_counts_are_capped():
    assert check_count(3, "ranks") == 3
    with pytest.raises(WorkError, match="above this server's limit") as error:
        check_count(MAX_COUNT + 1, "ranks")
    assert error.value.status == 413
    with pytest.raises(WorkError, match="expected an integer") as error:
        check_count(True, "ranks")
    assert error.value.status == 400
