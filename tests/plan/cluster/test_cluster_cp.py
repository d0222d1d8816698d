"""Context parallelism as PyTorch's ``context_parallel`` runs it for torchtitan (``cp_rotate="allgather"``): the K/V
(repeated to the query heads) all-gathered once per pass and hidden only under the first block, fp32 merges of
the block outputs, dK/dV sent in fp32 every step; Megatron's ring (the default) unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.cluster.efficiency import attention_seconds, collective_seconds
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.errors import LayoutError

LLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 1000}
SEQ = 65536
LAYOUT = Layout(dp=1, tp=8, cp=2)  # tp fills the node: the two cp ranks sit in different nodes


def _job(*, rotate: str, nic: float | None = None, slowdown: float | None = None) -> Job:
    hw = hardware("h100")
    if slowdown is not None:
        hw = dataclasses.replace(hw, overlap_slowdown=slowdown)
    if nic is not None:
        hw = dataclasses.replace(hw, scale_out_bandwidth=nic)
    return Job(spec=model_spec(LLAMA), hw=hw, gpus=16, global_batch=1, seq=SEQ, cp_rotate=rotate)


def test_the_gather_is_exposed_beyond_the_first_block():
    fast, slow = _job(rotate="allgather", nic=100e9, slowdown=0.0), _job(rotate="allgather", nic=1e9, slowdown=0.0)
    heads, d = 16 // 8, 128
    tokens = SEQ // 2
    gather = collective_seconds(slow.hw, "all_gather", 2.0 * tokens * heads * 2 * d * 2, 2, ranks_per_domain=1)
    block = attention_seconds(slow.hw, batch=1, heads=heads, seq=SEQ, head_dim=d) / 2 / 2  # the core / cp / cp
    assert gather > block  # K/V at the query heads (16, not 4) over a slow link
    assert collective_seconds(fast.hw, "all_gather", 2.0 * tokens * heads * 2 * d * 2, 2, ranks_per_domain=1) < block
    f_fast, f_slow = layer_times(fast, LAYOUT, "dense").f, layer_times(slow, LAYOUT, "dense").f
    assert f_slow - f_fast == pytest.approx(gather - block, rel=1e-9)
    assert layer_times(slow, LAYOUT, "dense").i > layer_times(fast, LAYOUT, "dense").i


def test_allgather_costs_at_least_the_ring_on_a_fast_link():
    ring, gathered = _job(rotate="ring"), _job(rotate="allgather")
    r, g = layer_times(ring, LAYOUT, "dense"), layer_times(gathered, LAYOUT, "dense")
    assert g.f > r.f and g.i > r.i and g.w == r.w  # fp32 merges and gradient accumulation, nothing on W
    assert layer_times(gathered, dataclasses.replace(LAYOUT, cp=1, dp=2), "dense") == \
        layer_times(ring, dataclasses.replace(LAYOUT, cp=1, dp=2), "dense")  # no cp: no difference


def test_the_option_is_checked():
    with pytest.raises(LayoutError, match="allgather"):
        plan_cluster(LLAMA, "h100", gpus=16, global_batch=1, seq=SEQ, cp_rotate="p2p")


def test_a_hidden_gather_still_slows_the_block_beside_it():
    """With the contention of a collective running beside compute, the hidden K/V gather adds its
    ``s / (1 + s)`` share to the forward; without, nothing."""
    free, shared = _job(rotate="allgather", nic=100e9, slowdown=0.0), _job(rotate="allgather", nic=100e9)
    heads, d = 16 // 8, 128
    gather = collective_seconds(free.hw, "all_gather", 2.0 * (SEQ // 2) * heads * 2 * d * 2, 2, ranks_per_domain=1)
    s = shared.hw.overlap_slowdown
    assert s > 0
    f_free, f_shared = layer_times(free, LAYOUT, "dense").f, layer_times(shared, LAYOUT, "dense").f
    assert f_shared - f_free == pytest.approx(gather * s / (1 + s), rel=1e-9)


def test_the_ring_runs_its_attention_as_cp_calls_on_chunks():
    """Megatron-Core's ring runs a rank's attention as cp kernel calls of equal work, one per ring step, over the 2 cp
    load-balanced chunks of seq / (2 cp) tokens: the diagonal call and half the others loop over two chunks of keys,
    the other half over one, each at the rate of the keys it loops over (the efficiency law's keys / (keys + half));
    PyTorch's all-gather runs one call over the whole sequence. At 8K tokens over cp 4 the calls loop over 2,048 and
    1,024 keys."""
    from pipeloom.plan.cluster.layer_time import _attention_core

    seq, cp = 8192, 4
    ring = dataclasses.replace(_job(rotate="ring"), seq=seq)
    layout = dataclasses.replace(LAYOUT, cp=cp, dp=1, tp=4)
    half = ring.hw.attention_half_seq
    rate = {keys: keys / (keys + half) for keys in (seq, seq // cp, seq // (2 * cp))}
    for backward in (False, True):
        whole = _attention_core(ring, layout, 0, (128, 128), backward=backward)
        calls = _attention_core(ring, layout, 0, (128, 128), backward=backward, ring=True)
        slower = (rate[seq] / rate[seq // cp] + (cp - 1) / 2 * (rate[seq] / rate[seq // (2 * cp)]
                                                                + rate[seq] / rate[seq // cp])) / cp
        overhead = ring.hw.kernel_overhead / cp
        assert calls - overhead == pytest.approx((whole - overhead) * slower, rel=1e-9)
        assert slower > 1.3  # 1,024-2,048-key calls run well below the 8K sequence's rate
