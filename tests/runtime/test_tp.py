"""Tensor parallelism inside pipeline stages (docs/parallelism.md), on gloo ranks: ``pipeline(model, mesh=,
tp_plan=)`` against the same torch ``parallelize_module`` plan run without pipelining (bitwise) and against
one device (within ``TOLERANCE``: a row-parallel layer sums in another order); boundary DTensors, a
DTensor loss, and what is refused, by message."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from ranks import run_ranks
from tp_jobs import MICROBATCHES, STEPS, batch, build, loss_fn, tp_pipelines

from pipeloom.runtime import PipelineError, pipeline

TOLERANCE = 1e-12  # float64 models: measured at most ~1e-16 against one device (docs/parallelism.md)

PIPELINED = [("tiny", "1f1b", 2, ""), ("tiny", "zb-h1", 2, ""), ("tiny", "zbv", 4, ""),
             ("tiny", "1f1b", 2, "boundary")]
TP_ONLY = [("mlp", "1f1b", 1, ""), ("mlp", "1f1b", 1, "loss_parallel")]


def _ok(results: dict) -> dict:
    bad = {rank: value for rank, value in results.items() if value[0] != "ok"}
    assert not bad, bad
    return {rank: value for rank, (_, value) in results.items()}


@functools.cache
def one_device(model_name: str) -> list[dict]:
    """The single-device reference of DESIGN §5, ``STEPS`` SGD steps: each step's gradients by name."""
    model = build(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step)
        for xm, ym in zip(torch.chunk(x, MICROBATCHES), torch.chunk(y, MICROBATCHES)):
            (loss_fn(model(xm), ym) / MICROBATCHES).backward()
        grads.append({name: p.grad.numpy().copy() for name, p in model.named_parameters()})
        optimizer.step()
    return grads


@pytest.fixture(scope="module")
def tp_only_runs():
    return _ok(run_ranks(2, tp_pipelines, TP_ONLY, (1, 2), ("pp", "tp"), timeout=150))


@pytest.fixture(scope="module")
def pipelined_runs():
    # names in another order than ("pp", "tp"): any order of the mesh's dimensions works
    return _ok(run_ranks(4, tp_pipelines, PIPELINED, (2, 2), ("tp", "pp"), True, timeout=240))


def _check(runs: dict, case: tuple) -> float:
    """Every rank: gradients bitwise equal to the plan without pipelining, none missing, the same loss on
    every rank; the ranks together hold every parameter. Returns the largest difference to one device."""
    model_name, variant = case[0], case[3]
    reference = one_device(model_name)
    seen: set[str] = set()
    worst = 0.0
    losses = {tuple(runs[rank][case]["loss"]) for rank in runs}
    assert len(losses) == 1, losses
    for rank, found in runs.items():
        mine, alone = found[case], found[(model_name, variant)]
        assert mine["loss"] == alone["loss"]
        for step in range(STEPS):
            assert mine["missing"][step] == [], (rank, step)
            assert mine["local"][step], (rank, step)
            for name, grad in mine["local"][step].items():
                assert np.array_equal(grad, alone["local"][step][name]), (rank, step, name)
            for name, grad in mine["full"][step].items():
                worst = max(worst, float(np.abs(grad - reference[step][name]).max()))
        seen.update(mine["local"][0])
    assert seen == set(reference[0])
    assert worst <= TOLERANCE
    print(f"{case}: largest difference to one device {worst:.3g}")
    return worst


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", TP_ONLY, ids=lambda c: c[3] or "mlp")
def test_tp_alone_on_two_ranks_matches_torch_and_one_device(tp_only_runs, case):
    """pp 1 x tp 2: the engine adds nothing to torch's own TP (bitwise), also with a DTensor loss
    (loss_parallel over class-sharded logits)."""
    _check(tp_only_runs, case)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", PIPELINED, ids=lambda c: f"{c[1]}-{c[3] or 'plain'}")
def test_pipelined_tp_is_bitwise_tp_alone(pipelined_runs, case):
    """pp 2 x tp 2 with a Megatron plan, 3 optimizer steps: every rank's local gradients bitwise equal to
    the same plan without pipelining, within TOLERANCE of one device, no parameter without a gradient.
    ``boundary``: a Shard(-1) DTensor crosses the stage boundary as its local tensor and is rebuilt."""
    _check(pipelined_runs, case)


@pytest.mark.timeout(300)
def test_what_a_tp_mesh_refuses_says_so_by_name(pipelined_runs):
    found = {rank: runs["refusals"] for rank, runs in pipelined_runs.items()}
    for rank, refused in found.items():
        assert "schedule 'dualpipe' holds two replicas" in refused["dualpipe"], refused["dualpipe"]
        assert "no tp_plan= was given" in refused["no plan"], refused["no plan"]
        assert "tp_plan='hf'" in refused["hf"] and "not built yet" in refused["hf"], refused["hf"]
        assert "tp_plan key 'layers.*.nope' names no module" in refused["unknown key"], refused["unknown key"]
        late = refused["late"]
        assert "is not the object pipeline() captured" in late and "pass tp_plan= to pipeline()" in late, late
        assert "global rank" in late and "tp " in late, late  # the global rank and its mesh coordinates
        assert refused["late_s"] < 10


def test_a_tp_plan_needs_a_tp_mesh():
    from tp_jobs import megatron_plan

    with pytest.raises(PipelineError, match="shards over the mesh's \"tp\" dimension"):
        pipeline(build("tiny"), schedule="gpipe", split_points=[], microbatches=2, loss_fn=loss_fn,
                 tp_plan=megatron_plan("tiny"))
    with pytest.raises(PipelineError, match="'auto'.*not built yet"):
        pipeline(build("tiny"), schedule="gpipe", split_points=[], microbatches=2, loss_fn=loss_fn, tp_plan="auto")
