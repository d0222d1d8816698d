"""An overlapped pair's parts interleaved at their expert all-to-alls on one rank: a user's MoE model whose experts
sit behind the all-to-all dispatch over a one-rank "ep" group, micro-batch 1's forward and micro-batch 0's backward
run one after the other against interleaved (the baton handed over at every all-to-all) — bitwise equal outputs and
gradients. On the CPU over gloo (asynchronous collectives); on CUDA over NCCL, where each part issues its
collectives on a side stream of its own (``gpu``: skipped without CUDA; docs/runtime-gpu.md)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from link_jobs import pair_on_one_rank
from ranks import run_ranks

CUDA = torch.cuda.is_available()


def _check(device: str) -> None:
    results = run_ranks(1, pair_on_one_rank, device, timeout=240)
    status, found = results[0]
    assert status == "ok", found
    assert found["equal"], found
    assert found["turns"] > 0, found  # the parts did interleave
    assert found["cuda"] == (device == "cuda")


@pytest.mark.timeout(300)
def test_a_pair_interleaved_on_the_cpu_is_bitwise_the_parts_in_turn():
    _check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.timeout(300)
def test_a_pair_interleaved_on_side_streams_is_bitwise_the_parts_in_turn():
    _check("cuda")
