"""Expert parallelism composed with FSDP and with tensor parallelism on gloo ranks: a tiny Qwen3-MoE (transformers,
random init) with data_parallel='fsdp' on (pp 2, ep 2), (dp 2, pp 1, ep 2) and, on 8 ranks, (dp 2, pp 2, ep 2)
against the same model with FSDP on the mesh with "dp" in place of "ep" (the same replicas and global batch, no
sharded experts): losses bitwise equal, gradients within the ep tolerance, every parameter with a gradient, the
experts sharded over "ep" and then over "dp", the dense parameters over every replica; clipping, full state dicts
and a checkpoint read back by the reference. And pp 1 × ep 2 × tp 2 (attention and dense MLPs tensor-parallel,
experts over "ep" only) against pp 1 × dp 2 × tp 2 (Qwen2-MoE: shared experts tensor-parallel too), with the
plans that do not compose refused by name."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ep_compose_jobs import MESHES, ep_fsdp, ep_tp
from ep_jobs import build_moe
from ranks import run_ranks
from test_ep import TOLERANCE, _ok

# layout -> (expert parameters on a rank holding MoE layers, the mesh dimensions they are sharded over, the
# local shape of a gate_up_proj: 4 experts of [2·16, 32] cut over ep and then dp)
EXPECTED = {"pp2_ep2": (4, ["ep"], [2, 32, 32]), "dp2_ep2": (8, ["dp", "ep"], [1, 32, 32]),
            "dp2_pp2_ep2": (4, ["dp", "ep"], [1, 32, 32])}


@pytest.mark.parametrize("layout", sorted(EXPECTED))
def test_ep_with_fsdp_matches_fsdp_without_ep(layout, tmp_path):
    world = math.prod(MESHES[layout][0])  # 4 ranks, 8 for dp 2 × pp 2 × ep 2
    results = _ok(run_ranks(world, ep_fsdp, layout, "1f1b", 3, str(tmp_path / "ckpt"), timeout=1200))
    count, dims, shape = EXPECTED[layout]
    for rank, found in results.items():
        assert found["losses_equal"], rank
        assert found["worst"] <= TOLERANCE, (rank, found["worst"])
        assert not found["missing"], (rank, found["missing"])
        assert len(found["experts"]) == count, (rank, found["experts"])
        for key, (where, local) in found["experts"].items():
            assert where == dims, (rank, key, where)
            if key.endswith("gate_up_proj"):
                assert local == shape, (rank, key, local)
        assert found["dense"] == ["('replicas',)"], (rank, found["dense"])  # FSDP over every replica
        ours, theirs = found["norms"]
        assert abs(ours - theirs) <= TOLERANCE * theirs, (rank, ours, theirs)
        assert found["full_equal"] and found["restored"], rank
    assert results[0]["ranks"] == 47  # the whole model's state dict on the first pipeline rank


def test_ep_with_tp_matches_tp_without_ep():
    results = _ok(run_ranks(4, ep_tp, 3, timeout=1200))
    for rank, found in results.items():
        assert found["losses_equal"], (rank, found["losses"])
        assert found["worst"] <= TOLERANCE, (rank, found["worst"])
        assert not found["missing"], (rank, found["missing"])
        assert found["experts"] == 6, rank  # 2 per MoE layer (layers 1-3), sharded over "ep" only
        placed = found["placed"]
        assert placed["model.layers.1.self_attn.q_proj.weight"] == ["tp"] == placed["model.layers.0.mlp.up_proj.weight"]
        assert placed["model.layers.2.mlp.shared_expert.down_proj.weight"] == ["tp"], placed
        assert placed["model.layers.1.mlp.experts.gate_up_proj"] == ["ep"], placed
        ours, theirs = found["norms"]
        assert abs(ours - theirs) <= TOLERANCE * theirs, (rank, ours, theirs)
        assert found["full_equal"], rank
        refused = found["refused"]
        assert "names 'model.layers.1.mlp.experts', which is or holds the experts module" in refused["experts"]
        assert "is SequenceParallel, which with an \"ep\" dimension is not built yet" in refused["sp"]
        assert "tp_plan='auto' with an \"ep\" dimension is not built yet" in refused["auto"]
        assert all("works: attention and dense MLPs tensor-parallel" in m for m in refused.values()), refused
    assert results[0]["keys"] == len(build_moe("qwen2_moe", mlp_only_layers=[0]).state_dict())  # the whole model
