"""Stage-boundary tensors keep their strides across ranks (channels-last activations, permuted views, and
their gradients), so the kernels after a boundary see the layout one device gives them. Oracle: the unsplit
model's for-loop reference of DESIGN §5 (torch.equal losses and gradients)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pipeloom.runtime.comm.step_messages import LeafMeta, kept_stride


def test_dense_tensors_keep_their_strides_and_others_travel_contiguous():
    x = torch.randn(2, 3, 4, 5)
    last = x.to(memory_format=torch.channels_last)
    assert kept_stride(x) == () and kept_stride(last) == tuple(last.stride())
    assert kept_stride(x.transpose(1, 3)) == tuple(x.transpose(1, 3).stride())
    assert kept_stride(x[:, :2]) == () and kept_stride(x[..., ::2]) == ()  # gaps: sent .contiguous()
    assert kept_stride(torch.randn(3, 1).expand(3, 4)) == ()  # overlapping
    meta = LeafMeta.of(last)
    received = meta.buffer(torch.device("cpu")).copy_(meta.wire(last))
    value = meta.shaped(received)
    assert value.stride() == last.stride() and torch.equal(value, last)
    other = meta.shaped(meta.buffer(torch.device("cpu")).copy_(meta.wire(x)))  # a later step's other layout
    assert other.stride() == last.stride() and torch.equal(other, x)


@pytest.mark.timeout(400)
def test_convnext_channels_last_boundaries_are_bitwise_exact_on_two_ranks():
    pytest.importorskip("transformers")
    from layout_jobs import convnext_exactness
    from models import assert_bitwise_reports
    from ranks import run_ranks

    results = run_ranks(2, convnext_exactness, [("1f1b", 2), ("zbv", 4)], timeout=360)
    for rank, key, outcome in assert_bitwise_reports(results):
        assert outcome["owned"] > 0 and outcome["strides"], (rank, key)  # channels-last crossed ranks
