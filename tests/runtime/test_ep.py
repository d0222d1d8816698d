"""Expert parallelism on 4 gloo ranks, a (pp 2, ep 2) mesh: tiny Qwen3-MoE and DeepSeek-V3 (transformers, random
init) and a user's own MoE layer against the same model on (pp 2, dp 2) — the same replicas and global batch
without sharded experts; clipping, full state dicts and a checkpoint saved at ep 2 loaded at ep 1; ranks that
disagree on expert counts; a rank failing between the dispatch and the combine all-to-all."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ep_jobs import ep_disagree, ep_exactness, ep_fault, ep_state
from ranks import run_ranks

# The contract (docs/parallelism.md): losses bitwise equal; every gradient within this bound of its tensor's
# largest entry. Measured: up to 1.2e-6 (Qwen3-MoE), 1.3e-7 (the user's layer); the bound leaves room for
# other inputs (each expert's weight gradient is a sum over its tokens whose rows arrive in another order and
# grouping, and those differences reach every parameter upstream through the input gradients).
TOLERANCE = 1e-5


def _ok(results: dict) -> dict:
    bad = {r: str(v)[-2000:] for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    return {r: v[1] for r, v in results.items()}


CASES = [("qwen3_moe", "1f1b"), ("qwen3_moe", "zbv"), ("deepseek_v3", "dualpipev"), ("own", "1f1b"),
         ("own", "zbv")]


def test_ep_matches_the_same_replicas_without_ep():
    """3 SGD steps, each from the same parameters: losses bitwise equal, gradients within TOLERANCE, every
    parameter with a gradient, the experts sharded on the ranks that hold MoE layers."""
    results = _ok(run_ranks(4, ep_exactness, CASES, 3, timeout=1500))
    for rank, cases in results.items():
        for case, found in cases.items():
            assert found["losses_equal"], (rank, case)
            assert found["worst"] <= TOLERANCE, (rank, case, found["worst"])
            assert not found["missing"], (rank, case, found["missing"])
    for name, schedule in CASES:  # every MoE layer's experts sharded somewhere: 2 parameters per experts module
        sharded = sum(results[r][f"{name}/{schedule}"]["expert_params"] for r in (0, 2))
        assert sharded == {"qwen3_moe": 8, "deepseek_v3": 6, "own": 4}[name], (name, schedule, sharded)


def test_ep_state_clip_checkpoint_and_failures(tmp_path):
    results = _ok(run_ranks(4, ep_state, str(tmp_path / "ckpt"), timeout=300))
    for rank, found in results.items():
        ours, theirs = found["norms"]
        assert abs(ours - theirs) <= TOLERANCE * theirs, (rank, ours, theirs)
        assert found["full_equal"] and found["restored"] and found["evaluated"], rank
    assert results[0]["shapes"]["1.experts.up"] == [4, 16, 32]  # whole, under the model's own names
    assert all(found["local_expert_shapes"] == [[2, 16, 32], [2, 32, 16]] for found in results.values())

    told = _ok(run_ranks(4, ep_disagree, timeout=300))
    for rank, message in told.items():
        assert "disagree on their experts" in message and "2 experts" in message, (rank, message)

    timeout = 8.0
    failed = _ok(run_ranks(4, ep_fault, timeout, timeout=300))
    for rank, found in failed.items():
        assert found["error"] != "no error", rank
        assert found["seconds"] < 3 * timeout, (rank, found)
    assert "an expert failed on purpose" in failed[1]["error"]
    assert "all-to-all over \"ep\"" in failed[0]["error"], failed[0]  # blocked in the combine: named so


def test_experts_are_found_by_their_interface():
    """transformers' grouped experts modules and the user's layer have the interface; a plain MLP, a router and
    a module whose parameters are not stacked over the experts do not; experts= names are checked."""
    from ep_jobs import Block, build_moe, build_own

    from pipeloom.runtime import PipelineError
    from pipeloom.runtime.parallel.ep import find_experts, is_experts_module

    assert find_experts(build_moe("qwen3_moe"), None) == [f"model.layers.{k}.mlp.experts" for k in range(4)]
    assert find_experts(build_moe("deepseek_v3"), None) == [f"model.layers.{k}.mlp.experts" for k in (1, 2, 3)]
    own = build_own()
    assert find_experts(own, None) == ["1.experts", "2.experts"] == find_experts(own, ["*.experts"])
    block = Block(16, 4)
    assert not is_experts_module(block.router) and not is_experts_module(block)
    block.experts.num_experts = 3  # its parameters hold 4
    assert not is_experts_module(block.experts)
    with pytest.raises(PipelineError, match="lacks the experts interface"):
        find_experts(own, ["1.router"])
    with pytest.raises(PipelineError, match="names no module"):
        find_experts(own, ["*.moe"])
    with pytest.raises(PipelineError, match="has no experts module"):
        find_experts(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)


def test_experts_without_an_ep_dimension_are_refused():
    from ep_jobs import build_own

    from pipeloom.runtime import Parallelism, PipelineError, pipeline

    with pytest.raises(PipelineError, match="experts= names the modules sharded over the mesh's \"ep\""):
        pipeline(build_own(), schedule="1f1b", split_points=["2"], loss_fn=torch.nn.functional.mse_loss,
                 microbatches=2, parallel=Parallelism(experts=["*.experts"]))


@pytest.mark.parametrize("name", ["own", "deepseek_v3"])
def test_overlapped_pairs_interleave_at_the_all_to_alls(name):
    """dualpipev on (pp 2, ep 2): with overlap_pairs=True each overlapped pair's parts hand over at their
    all-to-alls (counted on the ranks holding MoE layers) and the losses and gradients stay bitwise those of the
    parts run one after the other."""
    from ep_jobs import ep_overlap

    results = _ok(run_ranks(4, ep_overlap, name, timeout=900))
    assert all(found["equal"] for found in results.values()), results
    assert results[2]["handed"] > 0 and results[3]["handed"] > 0, results
