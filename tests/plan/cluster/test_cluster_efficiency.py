"""The efficiency model against its closed forms (computed by hand here, on a GPU with round numbers) and
its properties on every built-in GPU: rates rise with size and stay under peak, collectives that cross
scale-up domains are slower than inside one."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pipeloom.plan.cluster.efficiency import (
    attention_flops,
    attention_seconds,
    collective_seconds,
    gemm_efficiency,
    gemm_seconds,
    memory_seconds,
    overlapped_seconds,
    p2p_seconds,
    wave_efficiency,
)
from pipeloom.plan.cluster.gpus import hardware, hardware_names
from pipeloom.plan.cluster.hardware import Hardware
from pipeloom.plan.errors import HardwareError

ROUND = Hardware(name="round", peak_flops={"bf16": 1e15, "fp8": 2e15}, memory_bytes=2**36, memory_bandwidth=1e12,
                 scale_up_size=8, scale_up_bandwidth=100e9, scale_out_bandwidth=10e9, scale_up_latency=1e-6,
                 scale_out_latency=1e-5, gemm_efficiency=0.5, gemm_half_dim=100.0, attention_efficiency=0.5,
                 attention_backward_efficiency=0.25, attention_half_seq=1000.0, memory_efficiency=0.5,
                 scale_up_efficiency=0.5, scale_out_efficiency=0.5, kernel_overhead=1e-6)
UP, OUT = 50e9, 5e9  # achieved bytes/s of ROUND's links


def test_wave_quantization_closed_form():
    # 4096 x 4096 on 132 SMs: 128x128 tiles 1024 -> 8 waves; 256x128 512 -> 4 waves: 7.76 / 8 either way
    assert wave_efficiency(ROUND, 4096, 4096) == pytest.approx(1024 / (132 * 8))
    # 4224 x 4096: 128x128 33 x 32 = 1056 tiles = exactly 8 waves of 132
    assert wave_efficiency(ROUND, 4224, 4096) == pytest.approx(1.0)
    # 4900 x 4900: 128x128 39 x 39 = 1521 -> 12 waves; 256x128 20 x 39 = 780 -> 6 waves; either way the edge
    # tiles run whole: 4900^2 / 128^2 = 1465.4 tiles' work in 12 waves of 132
    assert wave_efficiency(ROUND, 4900, 4900) == pytest.approx(4900 * 4900 / (128 * 128) / (132 * 12))
    # one row more never prices a GEMM faster: 4097 x 4096 fills 8 waves with 33 rows of tiles, the last one nearly
    # empty (a partial row had counted as work: 1056 tiles, "exactly 8 waves", faster than 4096's 7.76 / 8)
    assert wave_efficiency(ROUND, 4097, 4096) == pytest.approx(4097 * 4096 / (128 * 128) / (132 * 8))
    rise = (4097 / (4097 + ROUND.gemm_half_dim)) / (4096 / (4096 + ROUND.gemm_half_dim))  # the smooth rate's alone
    assert gemm_seconds(ROUND, 4097, 4096, 4096) * rise >= gemm_seconds(ROUND, 4096, 4096, 4096)
    # a dimension under one tile counts as one tile (its short tiles are the smooth factor's): 64 x 16384 on 108 SMs
    assert wave_efficiency(dataclasses.replace(ROUND, sm_count=108), 64, 16384) == pytest.approx(128 / (108 * 2))
    # under one wave split-K fills the SMs
    assert wave_efficiency(ROUND, 100, 100) == 1.0
    assert wave_efficiency(ROUND, 1, 8192) == 1.0
    # a grouped kernel: 8 experts' 1024 x 1024 outputs share the waves (512 tiles of 128x128 -> 4 waves)
    assert wave_efficiency(ROUND, 1024, 1024, count=8) == pytest.approx(512 / (132 * 4))
    assert wave_efficiency(dataclasses.replace(ROUND, sm_count=108), 4096, 4096) == pytest.approx(1024 / (108 * 10))


def test_gemm_compute_bound_closed_form():
    # f(100) = 1/2 each: 0.5 * 1/8 of 1e15; 2e6 FLOPs -> 3.2e-8 s (traffic 6e4 bytes: 1.2e-7 s wins)
    assert gemm_seconds(ROUND, 100, 100, 100) == pytest.approx(1e-6 + 3 * 100 * 100 * 2 / 0.5e12)
    m = n = k = 4900  # f = 0.98 each
    compute = 2 * m * n * k / (1e15 * 0.5 * 0.98**3 * wave_efficiency(ROUND, m, n))
    assert compute > 3 * m * n * 2 / 0.5e12
    assert gemm_seconds(ROUND, m, n, k) == pytest.approx(1e-6 + compute)
    # fp8: twice the peak, inputs half as wide, plus the casts of both inputs at the achieved HBM bandwidth, one
    # more kernel: per-tensor dynamic scaling reads for the amax, then reads and writes the copy (5 bytes per
    # element); a cast kernel that takes the amax and writes the copy and its transpose moves 4; a reused copy 0
    cast = 1e-6 + 5 * 2 * m * k / 0.5e12
    assert gemm_seconds(ROUND, m, n, k, dtype="fp8") == pytest.approx(1e-6 + compute / 2 + cast)
    assert gemm_seconds(ROUND, m, n, k, dtype="fp8", cast=(4, 0)) == pytest.approx(
        1e-6 + compute / 2 + 1e-6 + 4 * m * k / 0.5e12)
    assert gemm_seconds(ROUND, m, n, k, dtype="fp8", cast=(0, 0)) == pytest.approx(1e-6 + compute / 2)
    assert gemm_seconds(ROUND, m, n, k, cast=(0, 0)) == gemm_seconds(ROUND, m, n, k)  # bf16: no cast
    with pytest.raises(HardwareError, match="cast_first must be a number >= 0"):
        gemm_seconds(ROUND, m, n, k, dtype="fp8", cast=(-1, 0))
    # with its own FP8 ceiling (0.4 of the FP8 peak against 0.5 of BF16's) the compute part scales by 0.5 / 0.4
    fp8_own = dataclasses.replace(ROUND, fp8_gemm_efficiency=0.4)
    assert gemm_seconds(fp8_own, m, n, k, dtype="fp8") == pytest.approx(1e-6 + compute / 2 * 0.5 / 0.4 + cast)
    assert gemm_seconds(fp8_own, m, n, k) == gemm_seconds(ROUND, m, n, k)  # BF16 unchanged


def test_gemm_memory_bound_closed_form():
    # a matrix-vector product: 1 x 8192 @ 8192 x 8192 reads the whole weight
    traffic = (8192 + 8192 * 8192) * 2 + 8192 * 2
    assert gemm_seconds(ROUND, 1, 8192, 8192) == pytest.approx(1e-6 + traffic / 0.5e12)
    assert gemm_seconds(ROUND, 0, 8192, 8192) == 0.0


@pytest.mark.parametrize("name", hardware_names())
def test_gemm_time_and_smooth_rate_rise_with_every_dimension_and_stay_under_peak(name):
    hw = hardware(name)
    sizes = [16, 64, 256, 1024, 4096, 16384, 65536]  # doubling a size never adds a partial wave: ceil(2x) <= 2 ceil(x)
    for dtype in hw.peak_flops:
        for m, n, k in itertools.product(sizes, repeat=3):
            rate = 2 * m * n * k / gemm_seconds(hw, m, n, k, dtype=dtype)
            assert rate < hw.gemm_ceiling(dtype) * hw.peak_flops[dtype]
            smooth = gemm_efficiency(hw, m, n, k) / wave_efficiency(hw, m, n)
            for grown in ((2 * m, n, k), (m, 2 * n, k), (m, n, 2 * k)):
                # twice the work never takes less time; the smooth part of the rate rises (the waves' saw-tooth
                # may dip: one tile past a full wave)
                assert gemm_seconds(hw, *grown, dtype=dtype) >= gemm_seconds(hw, m, n, k, dtype=dtype)
                assert gemm_efficiency(hw, *grown) / wave_efficiency(hw, *grown[:2]) > smooth
    # small GEMMs run far from peak, large ones near the measured ceiling
    assert 2 * 256**3 / gemm_seconds(hw, 256, 256, 256) < 0.3 * hw.peak_flops["bf16"]
    assert 2 * 16384**3 / gemm_seconds(hw, 16384, 16384, 16384) > 0.95 * hw.gemm_efficiency * hw.peak_flops["bf16"]
    if "fp8" in hw.peak_flops:  # FP8 near its own ceiling (the per-tensor scaling casts cost ~15 % at this size)
        ceiling = hw.gemm_ceiling("fp8") * hw.peak_flops["fp8"]
        assert 0.8 * ceiling < 2 * 16384**3 / gemm_seconds(hw, 16384, 16384, 16384, dtype="fp8") < ceiling


def test_fp8_needs_a_gpu_that_has_it():
    assert gemm_seconds(hardware("h100"), 8192, 8192, 8192, dtype="fp8") < gemm_seconds(
        hardware("h100"), 8192, 8192, 8192)
    with pytest.raises(HardwareError, match="a100-80gb has no 'fp8'"):
        gemm_seconds(hardware("a100-80gb"), 8, 8, 8, dtype="fp8")
    with pytest.raises(HardwareError, match="no 'fp16'"):
        gemm_seconds(hardware("h100"), 8, 8, 8, dtype="fp16")
    with pytest.raises(HardwareError, match="m must be a number >= 0"):
        gemm_seconds(ROUND, -1, 8, 8)
    with pytest.raises(HardwareError, match="count must be a whole number"):
        gemm_seconds(ROUND, 8, 8, 8, count=1.5)  # type: ignore[arg-type]


def test_grouped_gemm_pays_one_overhead_and_takes_average_shapes():
    # 8 experts of 512.5 tokens on average: one kernel overhead, 8x the work at the shape's efficiency
    one = gemm_seconds(ROUND, 512.5, 4096, 1024) - ROUND.kernel_overhead
    assert gemm_seconds(ROUND, 512.5, 4096, 1024, count=8) == pytest.approx(ROUND.kernel_overhead + 8 * one)
    assert gemm_seconds(ROUND, 512.5, 4096, 1024, count=8) < 8 * gemm_seconds(ROUND, 512.5, 4096, 1024)
    assert gemm_seconds(ROUND, 512.5, 4096, 1024, count=0) == 0.0
    # fewer tokens per expert (more experts sharing the same tokens) is slower per FLOP
    few, many = gemm_seconds(ROUND, 64, 4096, 1024, count=64), gemm_seconds(ROUND, 4096, 4096, 1024, count=1)
    assert few > many


def test_attention_flops_and_seconds():
    assert attention_flops(batch=2, heads=4, seq=1000, head_dim=64, causal=False) == 4 * 2 * 4 * 1000**2 * 64
    assert attention_flops(batch=2, heads=4, seq=1000, head_dim=64) == 2 * 2 * 4 * 1000**2 * 64
    assert attention_flops(batch=2, heads=4, seq=1000, head_dim=64, backward=True) == 2.5 * 2 * 2 * 4 * 1000**2 * 64
    # s = s½: half of the 0.5 efficiency (on a GPU with HBM fast enough to be compute-bound)
    fast = dataclasses.replace(ROUND, memory_bandwidth=1e14)
    flops = 2 * 4 * 16 * 1000**2 * 128
    assert attention_seconds(fast, batch=4, heads=16, seq=1000, head_dim=128) == pytest.approx(
        1e-6 + flops / (1e15 * 0.5 * 0.5))
    assert attention_seconds(fast, batch=4, heads=16, seq=1000, head_dim=128, backward=True) == pytest.approx(
        1e-6 + 2.5 * flops / (1e15 * 0.25 * 0.5))
    # on ROUND's 1 TB/s the same shape is bound by reading q, k, v and writing o (x2 backward)
    traffic = 4 * 4 * 16 * 1000 * 128 * 2
    assert attention_seconds(ROUND, batch=4, heads=16, seq=1000, head_dim=128) == pytest.approx(
        1e-6 + traffic / 0.5e12)
    assert attention_seconds(ROUND, batch=4, heads=16, seq=1000, head_dim=128, backward=True) == pytest.approx(
        1e-6 + 2.5 * flops / (1e15 * 0.25 * 0.5))
    assert attention_seconds(ROUND, batch=0, heads=16, seq=1000, head_dim=128) == 0.0


@pytest.mark.parametrize("name", hardware_names())
def test_attention_rate_rises_with_sequence_and_backward_is_slower(name):
    hw = hardware(name)
    previous = 0.0
    for seq in (128, 512, 2048, 8192, 32768):
        shape = {"batch": 1, "heads": 32, "seq": seq, "head_dim": 128}
        forward = attention_seconds(hw, **shape)
        rate = attention_flops(**shape) / forward
        assert previous < rate < hw.attention_efficiency * hw.peak_flops["bf16"]
        previous = rate
        backward = attention_seconds(hw, **shape, backward=True)
        assert backward > forward
        if seq >= 2048:  # compute-bound: 2.5x the FLOPs at a lower efficiency
            assert backward > 2.5 * forward


def test_memory_seconds():
    assert memory_seconds(ROUND, 1e9) == pytest.approx(1e-6 + 1e9 / 0.5e12)
    assert memory_seconds(ROUND, 0) == 0.0
    with pytest.raises(HardwareError, match="nbytes must be a number of bytes >= 0"):
        memory_seconds(ROUND, -1)


def test_collectives_inside_one_domain_are_the_ring():
    s = 1e9
    assert collective_seconds(ROUND, "all_reduce", s, 8, ranks_per_domain=8) == pytest.approx(
        2 * 7 / 8 * s / UP + 14 * 1e-6)
    for kind in ("all_gather", "reduce_scatter"):
        assert collective_seconds(ROUND, kind, s, 8, ranks_per_domain=8) == pytest.approx(7 / 8 * s / UP + 7e-6)
    assert collective_seconds(ROUND, "all_to_all", s, 8, ranks_per_domain=8) == pytest.approx(7 / 8 * s / UP + 1e-6)


def test_collectives_across_domains_closed_forms():
    s = 1e9
    # one rank per domain, 64 domains: the ring's bytes, a tree's 2*log2(64) = 12 steps
    assert collective_seconds(ROUND, "all_reduce", s, 64, ranks_per_domain=1) == pytest.approx(
        2 * 63 / 64 * s / OUT + 12 * 1e-5)
    # 16 ranks, 8 per domain: rs + ag inside, all-reduce of the 1/8 shard across 2 domains, pipelined:
    # the slower level's transfer counts, every level's latency adds
    inside, across = 2 * 7 / 8 * s / UP, 2 * 1 / 2 * (s / 8) / OUT
    assert inside > across  # 0.035 s in the domain against 0.025 s through the NICs: the domain's level counts
    assert collective_seconds(ROUND, "all_reduce", s, 16, ranks_per_domain=8) == pytest.approx(
        inside + 14e-6 + 2e-5)
    # an all-gather of more than one rank per domain is NCCL's ring: 15 steps, one of them across
    assert collective_seconds(ROUND, "all_gather", s, 16, ranks_per_domain=8) == pytest.approx(
        7 / 8 * s / UP + 14e-6 + 1e-5)
    # ... but where a domain holds 16, never faster than the 16 ranks' ring inside one (0.0375 s): the NIC is the
    # slower link
    wide = dataclasses.replace(ROUND, scale_up_size=16)
    flat = 2 * 15 / 16 * s / UP  # the transfer; the latency stays the placement's own
    assert flat > inside
    assert collective_seconds(wide, "all_reduce", s, 16, ranks_per_domain=8) == pytest.approx(flat + 14e-6 + 2e-5)
    assert collective_seconds(wide, "all_gather", s, 16, ranks_per_domain=8) == pytest.approx(
        15 / 16 * s / UP + 14e-6 + 1e-5)
    # with NICs 2.5x slower the cross-domain level is the slower one
    slow_nic = dataclasses.replace(ROUND, scale_out_bandwidth=4e9)
    assert collective_seconds(slow_nic, "all_reduce", s, 16, ranks_per_domain=8) == pytest.approx(
        2 * 1 / 2 * (s / 8) / 2e9 + 14e-6 + 2e-5)
    assert collective_seconds(slow_nic, "all_gather", s, 16, ranks_per_domain=8) == pytest.approx(
        1 / 2 * (s / 8) / 2e9 + 14e-6 + 1e-5)
    assert collective_seconds(ROUND, "reduce_scatter", s, 16, ranks_per_domain=8) == pytest.approx(
        collective_seconds(ROUND, "all_gather", s, 16, ranks_per_domain=8))
    # all-to-all: 8/16 of the buffer leaves the domain through the NIC
    assert collective_seconds(ROUND, "all_to_all", s, 16, ranks_per_domain=8) == pytest.approx(
        8 / 16 * s / OUT + 1e-5)


@pytest.mark.parametrize("name", hardware_names())
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_crossing_domains_is_slower(name, kind):
    hw = hardware(name)
    size = min(8, hw.scale_up_size)
    for nbytes in (1e3, 1e6, 1e9):
        inside = collective_seconds(hw, kind, nbytes, size, ranks_per_domain=size)
        spread = collective_seconds(hw, kind, nbytes, size, ranks_per_domain=size // 2)
        one_each = collective_seconds(hw, kind, nbytes, size, ranks_per_domain=1)
        assert inside < spread < one_each
        # more ranks across domains never make it faster per byte moved
        assert collective_seconds(hw, kind, nbytes, 8 * size, ranks_per_domain=size) > inside
        assert collective_seconds(hw, kind, 2 * nbytes, size, ranks_per_domain=size) > inside


@pytest.mark.parametrize("name", hardware_names())
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_more_ranks_in_a_domain_is_never_slower(name, kind):
    """A group's collective with more of its ranks sharing each scale-up domain never moves its bytes slower (the
    hierarchical algorithm alone would price 16 ranks in two domains of 8 below 16 in one: its domain level moves 7/8
    of the buffer against 15/16). Its latency is the placement's algorithm's and may differ by a few steps either
    way: one rank per domain all-gathers in log-depth steps (NCCL's PAT), more run its ring of ranks - 1 steps; a
    domain's ring all-reduce takes 2 (r - 1) steps, a tree across domains 2 log2 D."""
    hw = hardware(name)
    group = 16 if hw.scale_up_size >= 16 else hw.scale_up_size
    steps = 2 * group * hw.scale_out_latency  # more than any two placements' latencies differ
    for nbytes in (1e8, 1e9):
        times = [collective_seconds(hw, kind, nbytes, group, ranks_per_domain=r)
                 for r in range(1, group + 1) if group % r == 0]
        assert all(a >= b - steps for a, b in zip(times, times[1:])), (nbytes, times)


def test_an_all_gather_over_domains_is_the_ring_with_more_than_one_rank_in_each():
    """NCCL (src/graph/tuning.cc) all-gathers and reduce-scatters in log-depth steps (PAT) only with one GPU per
    node; otherwise its ring's ranks - 1 steps wait each for the last, domains - 1 of them through the NICs. An
    all-reduce takes its tree across (2 log2 D steps) either way."""
    s = 1e3  # latency-bound
    flat = collective_seconds(ROUND, "all_gather", s, 64, ranks_per_domain=1)
    assert flat == pytest.approx(6 * 1e-5 + 63 / 64 * s / OUT)
    ring = collective_seconds(ROUND, "reduce_scatter", s, 64, ranks_per_domain=8)
    assert ring == pytest.approx((64 - 8) * 1e-6 + 7 * 1e-5 + max(7 / 8 * s / UP, 7 / 8 * (s / 8) / OUT))
    assert collective_seconds(ROUND, "all_reduce", s, 64, ranks_per_domain=8) == pytest.approx(
        14 * 1e-6 + 6 * 1e-5 + max(2 * 7 / 8 * s / UP, 2 * 7 / 8 * (s / 8) / OUT))


def test_collective_trivial_and_bad_arguments():
    assert collective_seconds(ROUND, "all_reduce", 1e9, 1, ranks_per_domain=1) == 0.0
    assert collective_seconds(ROUND, "all_reduce", 0, 8, ranks_per_domain=8) == 0.0
    with pytest.raises(HardwareError, match="collective kind 'broadcast' is not one of"):
        collective_seconds(ROUND, "broadcast", 1e9, 8, ranks_per_domain=8)
    with pytest.raises(HardwareError, match=r"ranks_per_domain \(3\) must be >= 1 and divide ranks \(8\)"):
        collective_seconds(ROUND, "all_reduce", 1e9, 8, ranks_per_domain=3)
    with pytest.raises(HardwareError, match="exceeds round's scale-up domain of 8 GPUs"):
        collective_seconds(ROUND, "all_reduce", 1e9, 16, ranks_per_domain=16)


def test_p2p():
    assert p2p_seconds(ROUND, 1e8, same_domain=True) == pytest.approx(1e-6 + 1e8 / UP)
    assert p2p_seconds(ROUND, 1e8, same_domain=False) == pytest.approx(1e-5 + 1e8 / OUT)
    assert p2p_seconds(ROUND, 0, same_domain=False) == 0.0
    for name in hardware_names():
        hw = hardware(name)
        assert p2p_seconds(hw, 1e6, same_domain=True) < p2p_seconds(hw, 1e6, same_domain=False)


def test_a_faster_link_makes_collectives_faster():
    faster = dataclasses.replace(ROUND, scale_out_bandwidth=20e9)
    assert collective_seconds(faster, "all_reduce", 1e9, 64, ranks_per_domain=8) < collective_seconds(
        ROUND, "all_reduce", 1e9, 64, ranks_per_domain=8)


def test_overlapped_compute_and_collective_closed_form():
    """Compute goes ``1 + s`` times slower while a collective runs beside it: ``max(comm, compute + comm·s/(1+s))``;
    a collective longer than the slowed compute is the whole time; with ``s = 0`` the longer of the two."""
    hw = hardware("h100")
    s = hw.overlap_slowdown
    assert s == 0.189 and "2507.03114" in hw.sources["overlap_slowdown"]
    assert overlapped_seconds(hw, 1.0, 0.5) == pytest.approx(1.0 + 0.5 * s / (1 + s))
    assert overlapped_seconds(hw, 1.0, 0.0) == 1.0
    assert overlapped_seconds(hw, 1.0, 1.0 + s) == pytest.approx(1.0 + s)  # the slowed compute just fits under it
    assert overlapped_seconds(hw, 1.0, 3.0) == 3.0
    free = dataclasses.replace(hw, overlap_slowdown=0.0)
    assert [overlapped_seconds(free, 1.0, c) for c in (0.5, 2.0)] == [1.0, 2.0]
    with pytest.raises(HardwareError, match="overlap_slowdown"):
        dataclasses.replace(hw, overlap_slowdown=-0.1)
    with pytest.raises(HardwareError, match="seconds"):
        overlapped_seconds(hw, -1.0, 0.0)


@pytest.mark.parametrize("change", [dict(sm_count=114), dict(kernel_overhead=9e-6), dict(gemm_half_dim=256.0),
                                    dict(memory_bandwidth=1e12), dict(gemm_efficiency=0.5),
                                    dict(peak_flops={"bf16": 5e14, "fp8": 1e15})])
def test_remembered_gemm_prices_follow_every_field_they_read(change):
    """Layer times remember each GEMM's price by the GPU's fields as values: a GPU that differs in any field the price
    reads is priced anew (as with nothing remembered), one made again alike reuses the price."""
    from pipeloom.plan.cluster import layer_time
    from pipeloom.plan.cluster.job import Job
    from pipeloom.plan.cluster.layout import Layout
    from pipeloom.plan.cluster.model.reader import model_spec

    spec = model_spec({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 2,
                       "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000})
    layout = Layout(dp=8, mbs=2, recompute="none", schedule="1f1b")
    base = hardware("h100")
    other = dataclasses.replace(base, **change)
    priced = [layer_time.layer_times(Job(spec=spec, hw=hw, gpus=8, global_batch=16, seq=2048), layout, "dense")
              for hw in (base, other, dataclasses.replace(base))]
    layer_time._GEMMS.clear()
    fresh = layer_time.layer_times(Job(spec=spec, hw=other, gpus=8, global_batch=16, seq=2048), layout, "dense")
    assert priced[1] == fresh and priced[1] != priced[0] and priced[2] == priced[0]
