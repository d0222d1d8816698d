"""Sequence parallelism and the loss-parallel head, run (tp_auto_jobs.sp_job, 4 gloo ranks, pp 2 x tp 2): the
search's ``megatron-sp`` recipe on a transformer whose attention takes the sequence length from its
projections (a sequence-sharded residual stream between regions, SequenceParallel norms, PrepareModuleInput on
the attention and MLP modules as torch's tutorial lays it out) under 1f1b and zb-h1, and the vocabulary-
parallel head whose logits stay sharded for ``loss_parallel()`` (with and without SP) under 1f1b: every rank's
local gradients bitwise equal to the same plan run by torch without pipelining. The collectives of one
forward and backward under each recipe, counted by torch's CommDebugMode (kinds) and pipeloom's
CollectiveCounter (kind and bytes), equal ``region_costs``' prediction."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import tp_auto_jobs as jobs
from ranks import run_ranks

from pipeloom.plan.tp.sharding import LOSS_PARALLEL_REDUCTIONS, ShardingProblem, region_costs
from pipeloom.runtime.parallel.tp_auto import find_regions

COUNT_ROWS = 2  # sequences in the counted forward and backward
CASES = [("sp", "1f1b"), ("sp", "zb-h1"), ("loss", "1f1b"), ("megatron-loss", "1f1b")]
CHOICES = {"sp": jobs.SP_CHOICE, "loss": jobs.LOSS_CHOICE, "megatron-loss": jobs.MEGATRON_LOSS_CHOICE}
TORCH_NAMES = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
               "reduce_scatter": "reduce_scatter_tensor"}


@pytest.fixture(scope="module")
def sp_runs():
    results = run_ranks(4, jobs.sp_job, COUNT_ROWS, timeout=300)
    bad = {rank: value for rank, value in results.items() if value[0] != "ok"}
    assert not bad, bad
    return {rank: value for rank, (_, value) in results.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_pipelined_sequence_parallel_and_loss_parallel_are_bitwise_torch_alone(sp_runs, case):
    """2 SGD steps: the same loss on every rank, equal to torch's; local gradients bitwise equal; every
    parameter with a gradient."""
    name, _ = case
    losses = {tuple(runs[case]["loss"]) for runs in sp_runs.values()}
    assert len(losses) == 1, losses
    for rank, runs in sp_runs.items():
        mine, alone = runs[case], runs["alone"][name]
        assert mine["loss"] == alone["loss"], rank
        for step in range(jobs.STEPS):
            assert mine["missing"][step] == [] and mine["local"][step], (rank, step)
            for param, grad in mine["local"][step].items():
                assert np.array_equal(grad, alone["local"][step][param]), (rank, case, step, param)


def _predicted(choice: dict) -> list[tuple[str, str, int]]:
    """(phase F/B, kind, bytes) of every collective ``region_costs`` predicts for a one-block LM."""
    regions = find_regions(jobs.build(1))
    problem = ShardingProblem(layers=1, hidden=jobs.HIDDEN, heads=regions.heads, seq=jobs.SEQ, vocab=jobs.VOCAB,
                              microbatch_size=COUNT_ROWS, bytes_per_element=8, tp=2, flops_per_second=1e9,
                              loss_parallel=True, modules=regions.modules)
    sp = choice["attention"] == "megatron-sp"
    found = []
    for region, option in choice.items():
        for c in region_costs(problem, region, option, sequence_parallel=sp).collectives:
            found.append(("F" if c.phase == "F" else "B", c.kind, int(c.bytes)))
    return found


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CHOICES))
def test_counted_collectives_equal_the_prediction(sp_runs, name):
    """On each tp group: CommDebugMode's counts by kind equal the predicted counts, forward and backward
    (SP: all-gathers and reduce-scatters, no all-reduce); CollectiveCounter's (kind, bytes) records equal the
    predicted ones, except loss_parallel's per-token all-reduces, which torch issues inside its loss ops
    where the counter's dispatch mode does not see them (CommDebugMode counts them)."""
    predicted = _predicted(CHOICES[name])
    per_token = COUNT_ROWS * jobs.SEQ * 8
    for rank, runs in sp_runs.items():
        counted = runs["counts"][name]
        for phase in ("F", "B"):
            mine = [(kind, nbytes) for p, kind, nbytes in predicted if p == phase]
            kinds = Counter(TORCH_NAMES[kind] for kind, _ in mine)
            assert counted[phase]["torch"] == dict(kinds), (rank, name, phase, counted[phase]["torch"], kinds)
            seen = sorted(record for record in mine if not (record == ("all_reduce", per_token) and name != "sp"))
            assert [tuple(r) for r in counted[phase]["records"]] == seen, (rank, name, phase)
        if name == "sp":
            assert not any(kind == "all_reduce" for _, kind, _ in predicted)
        else:
            assert sum(1 for r in predicted if r == ("F", "all_reduce", per_token)) == LOSS_PARALLEL_REDUCTIONS
