"""Expert parallelism composed with FSDP on 4 gloo ranks: a tiny Qwen3-MoE (transformers, random init) with
data_parallel='fsdp' on (pp 2, ep 2) and on (dp 2, pp 1, ep 2) against the same model with FSDP on the mesh with
"dp" in place of "ep" (the same replicas and global batch, no sharded experts): losses bitwise equal, gradients
within the ep tolerance, every parameter with a gradient, the experts sharded over "ep" and then over "dp", the
dense parameters over every replica; clipping, full state dicts and a checkpoint read back by the reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ep_compose_jobs import ep_fsdp
from ranks import run_ranks
from test_ep import TOLERANCE, _ok

# layout -> (expert parameters on a rank holding MoE layers, the mesh dimensions they are sharded over, the
# local shape of a gate_up_proj: 4 experts of [2·16, 32] cut over ep and then dp)
EXPECTED = {"pp2_ep2": (4, ["ep"], [2, 32, 32]), "dp2_ep2": (8, ["dp", "ep"], [1, 32, 32])}


@pytest.mark.parametrize("layout", sorted(EXPECTED))
def test_ep_with_fsdp_matches_fsdp_without_ep(layout, tmp_path):
    results = _ok(run_ranks(4, ep_fsdp, layout, "1f1b", 3, str(tmp_path / "ckpt"), timeout=1200))
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
