"""DualPipe's overlapped pairs in the cluster estimate: a MoE layer's expert all-to-all is carried as the
communication part of its forward and input-gradient backward (``PhaseTimes.f_comm`` / ``i_comm``), equal to
the all-to-all seconds the layer itself prices, and a pair hides it under the other part's compute only:
never more than that compute, never more than the all-to-all, and nothing in schedules without pairs."""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.ir import pair_duration
from pipeloom.plan.cluster.dispatch import HYBRIDEP_SMS, pair_slowdown
from pipeloom.plan.cluster.efficiency import collective_seconds, domain_ranks, p2p_seconds
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import PAIRED, Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.cluster.placement import rank_stages, schedule_microbatches, work_bound
from pipeloom.plan.cluster.step import PhaseTimes
from pipeloom.plan.errors import LayoutError
from pipeloom.plan.tp.all_to_all import moe_exchanges

MOE = {"model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
       "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000, "num_local_experts": 16,
       "num_experts_per_tok": 2}
SEQ = 2048


def _job(hw: str = "h100", gpus: int = 64) -> Job:
    return Job(spec=model_spec(MOE), hw=hardware(hw), gpus=gpus, global_batch=256, seq=SEQ)


def _no_comm(times: list[PhaseTimes]) -> list[PhaseTimes]:
    return [dataclasses.replace(t, f_comm=0.0, i_comm=0.0) for t in times]


def test_the_comm_part_is_the_layers_own_all_to_all():
    job = _job()
    layout = Layout(dp=16, pp=4, vp=2, ep=16, schedule="dualpipev")
    times = layer_times(job, layout, "moe")
    tokens = layout.mbs * SEQ
    exchanges = moe_exchanges(tokens=tokens, hidden=MOE["hidden_size"], top_k=MOE["num_experts_per_tok"], ep=16,
                              dtype_bytes=2, experts=MOE["num_local_experts"])
    a2a = {phase: sum(collective_seconds(job.hw, "all_to_all", e.bytes, 16,
                                         ranks_per_domain=domain_ranks(16, 1, job.hw))
                      for e in exchanges if e.phase == phase) for phase in ("F", "I")}
    assert a2a["F"] > 0 and a2a["I"] > 0
    assert times.f_comm == pytest.approx(a2a["F"]) and times.i_comm == pytest.approx(a2a["I"])
    assert times.f_comm < times.f and times.i_comm < times.i
    dense = layer_times(job, layout, "dense") if job.spec.dense_layers else layer_times(job, layout, "head")
    assert dense.f_comm == dense.i_comm == 0.0
    # ep = 1: no all-to-all, nothing to hide
    assert layer_times(job, dataclasses.replace(layout, ep=1), "moe").f_comm == 0.0


def test_full_recomputation_repeats_the_forwards_all_to_all():
    job = _job()
    layout = Layout(dp=16, pp=4, vp=2, ep=16, schedule="dualpipev")
    plain = layer_times(job, layout, "moe")
    full = layer_times(job, dataclasses.replace(layout, recompute="full"), "moe")
    assert full.i_comm == pytest.approx(plain.i_comm + plain.f_comm)


@pytest.mark.parametrize("hw", ["h100", "gb200"])  # over InfiniBand; inside one NVL72 domain
def test_a_pair_hides_at_most_its_all_to_all_and_at_most_the_other_parts_compute(hw):
    job = _job(hw)
    layout = Layout(dp=16, pp=4, vp=2, ep=16, schedule="dualpipev")
    t = layer_times(job, layout, "moe")
    paired = pair_duration((t.f, t.i + t.w), (t.f_comm, t.i_comm))
    saved = t.f + t.i + t.w - paired
    assert 0 < saved <= t.f_comm + t.i_comm + 1e-12
    assert saved <= (t.f - t.f_comm) + (t.i + t.w - t.i_comm) + 1e-12
    f_compute, b_compute = t.f - t.f_comm, t.i + t.w - t.i_comm
    assert saved == pytest.approx(min(t.f_comm, b_compute) + min(t.i_comm, f_compute))
    if t.f_comm <= b_compute and t.i_comm <= f_compute:  # shorter than the other part's compute: hidden whole
        assert saved == pytest.approx(t.f_comm + t.i_comm)


def test_dualpipe_replays_credit_the_all_to_all_and_others_do_not():
    job = _job()
    est = Estimator(job)
    for schedule, vp in (("dualpipev", 2), ("dualpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
        layout = Layout(dp=16, pp=4, vp=vp, ep=16, schedule=schedule)
        m = est.check(layout)
        times, acts, _ = est.stages(layout)
        credited = est._simulate(layout, m, times, acts, 0.0)[0]
        plain = est._simulate(layout, m, _no_comm(times), acts, 0.0)[0]
        assert credited >= work_bound(layout, m, times, paired=est.job.pairs(layout)) * (1 - 1e-12), schedule
        if schedule not in PAIRED:
            assert credited == pytest.approx(plain), schedule
            continue
        runs = schedule_microbatches(layout, m)
        comm = max(runs * sum(times[j].f_comm + times[j].i_comm for j in stages) for stages in rank_stages(layout))
        assert 0 < plain - credited <= comm * (1 + 1e-9)


@pytest.mark.parametrize(("schedule", "vp"), [("dualpipev", 2), ("dualpipe", 1), ("zbv", 2), ("1f1b", 1)])
def test_the_extrapolated_bubble_is_the_full_replays(schedule, vp):
    """Past 3 pp micro-batches the makespan and the bubble come from replays of 2 pp and 3 pp; the busy seconds
    extrapolate with them, pairs counted as they run: until 2026-12-03 the work was counted before the pairs hid
    their all-to-all, and every DualPipe(V) layout past 3 pp micro-batches reported a bubble of 0."""
    est = Estimator(_job())
    layout = Layout(dp=16, pp=4, vp=vp, ep=16, schedule=schedule)
    m = est.check(layout)
    assert m > 3 * layout.pp
    times, acts, _ = est.stages(layout)
    _, full, _ = est._simulate(layout, m, times, acts, 0.0)
    _, extrapolated, _ = est._extrapolated(layout, m, times, acts, 0.0)
    assert full > 0.01
    assert extrapolated == pytest.approx(full, abs=0.005)


def test_blocking_pipeline_sends_lengthen_the_stages_not_the_latency():
    """Megatron-LM 2021 waits for each stage exchange (``p2p_overlap=False``): F of every stage but the last and
    I of every stage but the first grow by the send (its 1/tp piece, then the all-gather over tp); the replay's
    latency between stages is then 0."""
    dense = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000}
    # torch's pipelining sends 1F1B's beside the compute (Megatron-Core blocks there: blocking_1f1b, checked below)
    job = Job(spec=model_spec(dense), hw=hardware("a100-80gb"), gpus=32, global_batch=64, seq=SEQ, blocking_1f1b=False)
    layout = Layout(dp=2, tp=4, pp=4)
    overlapped = Estimator(job).stages(layout)[0]
    megatron = Estimator(dataclasses.replace(job, blocking_1f1b=True)).stages(layout)[0]  # its 1F1B blocks as 2021's
    assert megatron == Estimator(dataclasses.replace(job, p2p_overlap=False)).stages(layout)[0]
    interleaved = Layout(dp=2, tp=4, pp=4, vp=2, schedule="interleaved-1f1b")  # its interleaved 1F1B does not
    assert (Estimator(dataclasses.replace(job, blocking_1f1b=True)).stages(interleaved)[0]
            == Estimator(job).stages(interleaved)[0])
    blocking = Estimator(dataclasses.replace(job, p2p_overlap=False)).stages(layout)[0]
    hidden = layout.mbs * SEQ * 1024 * 2
    send = (p2p_seconds(job.hw, hidden / 4, same_domain=False)
            + collective_seconds(job.hw, "all_gather", hidden, 4, ranks_per_domain=4))
    for j, (a, b) in enumerate(zip(overlapped, blocking)):
        assert b.f - a.f == pytest.approx(send if j < 3 else 0.0)
        assert b.i - a.i == pytest.approx(send if j > 0 else 0.0)
        assert b.w == a.w
    est = Estimator(dataclasses.replace(job, p2p_overlap=False))
    m = est.check(layout)
    times, acts, _ = est.stages(layout)
    est.replay(layout, m, times, acts)
    assert [key[4] for key in est._replays] == [0.0]  # the replays' latency between stages


def test_the_gradient_exchange_hidden_by_compute_still_slows_it_and_fp32_moves_twice_the_bytes():
    """The data-parallel reduce-scatter (in the reduce's dtype) and all-gather (bf16 weights) that the backward and
    forward hide add ``s / (1 + s)`` of their seconds (the compute beside them runs slower); the last bucket stays
    exposed; an fp32 reduce moves twice the bytes of a bf16 one."""
    dense = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 8,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 1000}
    job = Job(spec=model_spec(dense), hw=hardware("h100"), gpus=64, global_batch=64, seq=SEQ)
    layout, params, group = Layout(dp=64), 1e9, 64
    per_domain = domain_ranks(group, 1, job.hw)
    s = job.hw.overlap_slowdown

    def moved(nbytes_rs: float) -> tuple[float, float]:
        return (collective_seconds(job.hw, "reduce_scatter", nbytes_rs, group, ranks_per_domain=per_domain),
                collective_seconds(job.hw, "all_gather", 2 * params, group, ranks_per_domain=per_domain))

    last = 40e6 * 2 / (2 * params)
    for reduce, width in (("bf16", 2), ("fp32", 4)):
        est = Estimator(dataclasses.replace(job, grad_reduce=reduce))
        rs, ag = moved(width * params)
        hidden = est._dp_exposed(layout, params, group, 1, f1=1e3, b1=1e3, m=1)  # compute hides all but the last bucket
        exposed = (rs + ag) * last
        assert hidden == pytest.approx(exposed + (rs + ag - exposed) * s / (1 + s))
        free = Estimator(dataclasses.replace(job, grad_reduce=reduce,
                                             hw=dataclasses.replace(job.hw, overlap_slowdown=0.0)))
        assert free._dp_exposed(layout, params, group, 1, f1=1e3, b1=1e3, m=1) == pytest.approx(exposed)
        assert free._dp_exposed(layout, params, group, 1, f1=0.0, b1=0.0, m=1) == pytest.approx(rs + ag)
    assert moved(4 * params)[0] > 1.9 * moved(2 * params)[0]


def test_tp_overlap_hides_the_tp_exchanges_beside_their_gemms():
    """``Job.tp_overlap``: a dense layer's four tp exchanges (attention in and out, MLP in and out) run beside
    the GEMMs next to them in F and in I, each adding ``overlapped_seconds(gemm, exchange) - gemm``; a MoE layer
    overlaps only its attention's two; nothing changes without tp or without sequence parallelism."""
    from pipeloom.plan.cluster.efficiency import gemm_seconds, overlapped_seconds

    dense = {**MOE, "model_type": "llama", "intermediate_size": 4096}
    job = Job(spec=model_spec(dense), hw=hardware("h100"), gpus=64, global_batch=256, seq=SEQ)
    on = dataclasses.replace(job, tp_overlap=True)
    layout = Layout(dp=8, tp=8, mbs=1, schedule="1f1b")
    plain, hidden = layer_times(job, layout, "dense"), layer_times(on, layout, "dense")
    hw, tokens, h = job.hw, SEQ, 1024
    nbytes = tokens * h * 2
    gather = collective_seconds(hw, "all_gather", nbytes, 8, ranks_per_domain=8)
    scatter = collective_seconds(hw, "reduce_scatter", nbytes, 8, ranks_per_domain=8)
    qkv, out, up, down = (3 * h // 8, h), (h, h // 8), (2 * 4096 // 8, h), (h, 4096 // 8)
    forward = sum(overlapped_seconds(hw, gemm_seconds(hw, tokens, n, k), c) - gemm_seconds(hw, tokens, n, k)
                  for (n, k), c in ((qkv, gather), (out, scatter), (up, gather), (down, scatter)))
    assert hidden.f == pytest.approx(plain.f - 2 * (gather + scatter) + forward)
    backward = sum(overlapped_seconds(hw, gemm_seconds(hw, tokens, k, n), c) - gemm_seconds(hw, tokens, k, n)
                   for (n, k), c in ((qkv, scatter), (out, gather), (up, scatter), (down, gather)))
    assert hidden.i == pytest.approx(plain.i - 2 * (gather + scatter) + backward)
    assert hidden.w == plain.w and hidden.f < plain.f and hidden.i < plain.i
    moe = dataclasses.replace(_job(), tp_overlap=True)
    moe_layout = Layout(dp=8, tp=8, ep=8, mbs=1, schedule="1f1b")
    saved = layer_times(_job(), moe_layout, "moe").f - layer_times(moe, moe_layout, "moe").f
    assert 0 < saved < gather + scatter  # the attention's pair only, and not all of it
    for same in (Layout(dp=64, mbs=1, schedule="1f1b"), layout):
        base = job if same.tp == 1 else dataclasses.replace(job, sequence_parallel=False)
        assert layer_times(base, same, "dense") == layer_times(dataclasses.replace(base, tp_overlap=True), same,
                                                               "dense")


def test_fp8_casts_follow_the_framework():
    """``Job.fp8_cast``: torchao's dynamic scaling casts both inputs of F, I and W with an amax pass (5 bytes per
    element); Transformer Engine's cached casts move 4 bytes per element of F's activation and I's output gradient
    only, its current scaling 6 (an amax pass first); a BF16 job casts nothing either way."""
    from pipeloom.plan.cluster.efficiency import CURRENT_CAST_BYTES, DYNAMIC_CAST_BYTES, FUSED_CAST_BYTES

    dense = {**MOE, "model_type": "llama", "intermediate_size": 4096}
    job = Job(spec=model_spec(dense), hw=hardware("h100"), gpus=64, global_batch=256, seq=SEQ, dtype="fp8")
    dynamic = dataclasses.replace(job, fp8_cast="dynamic")
    assert dynamic.fp8_casts() == ((DYNAMIC_CAST_BYTES, DYNAMIC_CAST_BYTES),) * 3 == ((5, 5),) * 3
    assert job.fp8_casts() == ((FUSED_CAST_BYTES, 0.0), (FUSED_CAST_BYTES, 0.0), (0.0, 0.0)) == ((4, 0), (4, 0), (0, 0))
    current = dataclasses.replace(job, fp8_cast="current")
    assert current.fp8_casts() == ((CURRENT_CAST_BYTES, 0.0), (CURRENT_CAST_BYTES, 0.0), (0.0, 0.0)) == ((6, 0), (6, 0),
                                                                                                      (0, 0))
    layout = Layout(dp=8, tp=8, mbs=1, schedule="1f1b")
    cached, every = layer_times(job, layout, "dense"), layer_times(dynamic, layout, "dense")
    assert cached.f < every.f and cached.i < every.i and cached.w < every.w
    amax = layer_times(current, layout, "dense")  # the amax pass adds to F and I; W reuses F's and I's copies
    assert cached.f < amax.f and cached.i < amax.i and cached.w == amax.w
    with pytest.raises(LayoutError, match="with dtype 'bf16' there are none: plan with --dtype fp8"):
        dataclasses.replace(dynamic, dtype="bf16")  # BF16 GEMMs cast nothing: the choice would change nothing
    with pytest.raises(LayoutError, match="fp8_cast='delayed'"):
        dataclasses.replace(job, fp8_cast="delayed")


def test_mxfp8_casts_two_block_scaled_copies_on_blackwell_only():
    """``fp8_cast="mxfp8"`` (Transformer Engine's MXFP8 block scaling): as the cached casts, F's activation and I's
    output gradient only, each read once and written as two FP8 copies (row- and column-wise blocks of 32) with a
    one-byte scale per block: 4 + 1/16 bytes per element, a little more than Hopper's cached casts' copy and
    transpose and one copy more than Blackwell's (its FP8 GEMMs take either layout: ``fp8_any_layout``, so its
    cached casts move 3 bytes and its current ones 5); W reuses them. Only a GPU whose tensor cores scale per block
    (the Blackwell descriptions' ``mxfp8``) takes it."""
    from pipeloom.plan.cluster.efficiency import MXFP8_CAST_BYTES

    dense = {**MOE, "model_type": "llama", "intermediate_size": 4096}
    job = Job(spec=model_spec(dense), hw=hardware("gb200"), gpus=64, global_batch=256, seq=SEQ, dtype="fp8")
    mx = dataclasses.replace(job, fp8_cast="mxfp8")
    assert MXFP8_CAST_BYTES == 4.0625 and mx.fp8_casts() == ((4.0625, 0.0), (4.0625, 0.0), (0.0, 0.0))
    layout = Layout(dp=8, tp=8, mbs=1, schedule="1f1b")
    cached, block = layer_times(job, layout, "dense"), layer_times(mx, layout, "dense")
    assert cached.f < block.f and cached.i < block.i and cached.w == block.w
    assert block.f - cached.f < 0.02 * cached.f
    assert job.fp8_casts() == ((3, 0), (3, 0), (0, 0))
    assert dataclasses.replace(job, fp8_cast="current").fp8_casts() == ((5, 0), (5, 0), (0, 0))
    hopper = dataclasses.replace(job, hw=hardware("h100"))
    assert hopper.fp8_casts() == ((4, 0), (4, 0), (0, 0))  # the copy and its transpose
    for field in ("mxfp8", "fp8_any_layout"):
        assert [name for name in ("a100-80gb", "h100", "h200", "b200", "gb200", "gb300", "mi300x")
                if getattr(hardware(name), field)] == ["b200", "gb200", "gb300"]
    with pytest.raises(LayoutError, match=r"fp8_cast='mxfp8' needs tensor cores that scale FP8 per block of 32 "
                                          r"\(Blackwell: b200, gb200, gb300\); h100 has none .*--fp8-cast current"):
        dataclasses.replace(mx, hw=hardware("h100"))


def _overlap_job(**options) -> Job:
    return dataclasses.replace(_job(), moe_overlap=True, **options)


def test_megatron_moe_overlap_pairs_interleaved_1f1b_and_one_stage_only():
    """``moe_overlap`` (Megatron-Core's overlap_moe_expert_parallel_comm): interleaved 1F1B with ep > 1 runs its
    backward-forward neighbours as pairs that hide the all-to-all (faster, by at most every F's and I's
    all-to-all); plain 1F1B over pp > 1 (Megatron needs virtual stages there), ep 1 and zero-bubble schedules are
    priced as without it; DualPipe(V) pairs either way."""
    plain, overlap = Estimator(_job()), Estimator(_overlap_job())
    for schedule, vp, ep, paired in (("interleaved-1f1b", 2, 16, True), ("1f1b", 1, 16, False),
                                     ("interleaved-1f1b", 2, 1, False), ("zbv", 2, 16, False),
                                     ("dualpipev", 2, 16, True)):
        layout = Layout(dp=16, pp=4, vp=vp, ep=ep, schedule=schedule)
        assert overlap.job.pairs(layout) == paired, schedule
        before, after = plain.estimate(layout), overlap.estimate(layout)
        if not paired or schedule in PAIRED:
            assert after.step_time == before.step_time, (schedule, ep)
            continue
        m = overlap.check(layout)
        times, _, _ = overlap.stages(layout)
        comm = max(m * sum(times[j].f_comm + times[j].i_comm for j in stages) for stages in rank_stages(layout))
        assert 0 < before.step_time - after.step_time <= comm * (1 + 1e-9)
        assert after.memory.activations <= before.memory.activations


def test_megatron_moe_overlap_on_one_stage_by_hand():
    """pp 1: B0 with F1, ..., B(m-2) with F(m-1): m - 1 pairs, each hiding min(F's all-to-all, B's compute) +
    min(B's all-to-all, F's compute), less what the compute beside it loses while it runs (:func:`pair_slowdown`:
    an NCCL all-to-all the generic slowdown beside a collective, s / (1 + s) of each hidden second)."""
    layout = Layout(dp=64, pp=1, ep=16, mbs=1)
    plain, overlap = Estimator(_job()), Estimator(_overlap_job())
    m = overlap.check(layout)
    t = overlap.stages(layout)[0][0]
    hidden = min(t.f_comm, t.i + t.w - t.i_comm) + min(t.i_comm, t.f - t.f_comm)
    s = overlap.job.hw.overlap_slowdown
    assert hidden > 0 and pair_slowdown(overlap.job) == pytest.approx(s / (1 + s))
    assert plain.estimate(layout).pipeline_time - overlap.estimate(layout).pipeline_time == pytest.approx(
        (m - 1) * hidden / (1 + s))


def test_a_hidden_all_to_all_slows_the_compute_beside_it_by_its_kernels_share():
    """What a pair loses of each second of all-to-all it hides: DeepSeek-V3's kernels nothing (their 20 SMs are
    taken from the compute all along), Hybrid-EP's its 32 SMs' share of the GPU's while it runs (32 / 132 on an
    H100), an NCCL all-to-all the slowdown beside any collective; so Hybrid-EP's pairs on one stage save the
    hidden seconds times 100 / 132."""
    job = _overlap_job()
    assert pair_slowdown(dataclasses.replace(job, moe_comm="deepseek")) == 0.0
    hybrid = dataclasses.replace(job, moe_comm="hybridep")
    assert pair_slowdown(hybrid) == HYBRIDEP_SMS / 132 == 32 / 132
    layout = Layout(dp=64, pp=1, ep=16, mbs=1)
    plain, overlap = Estimator(dataclasses.replace(hybrid, moe_overlap=False)), Estimator(hybrid)
    m = overlap.check(layout)
    t = overlap.stages(layout)[0][0]
    hidden = min(t.f_comm, t.i + t.w - t.i_comm) + min(t.i_comm, t.f - t.f_comm)
    assert plain.estimate(layout).pipeline_time - overlap.estimate(layout).pipeline_time == pytest.approx(
        (m - 1) * hidden * 100 / 132)


def test_megatron_moe_overlap_needs_experts():
    with pytest.raises(LayoutError, match="moe_overlap overlaps the expert all-to-all; the llama model has no experts"):
        Job(spec=model_spec({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
                             "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 1000}),
            hw=hardware("h100"), gpus=8, global_batch=8, seq=1024, moe_overlap=True)


@pytest.mark.parametrize(("name", "options"), [("dualpipev", {}), ("dualpipe", {}), ("zbv", {}), ("1f1b", {}),
                                               ("interleaved-1f1b", {"stages_per_rank": 2})])
def test_a_replay_at_stage_costs_is_the_simulators_replay_of_the_repriced_task_graph(name, options):
    """``replay_stages`` prices a compiled schedule's tasks straight from the stages' F, I, W, their all-to-all and
    activation bytes, without building a task graph per layout: the makespan, bubble and peak equal the simulator's
    on the schedule whose problem carries those costs (its pairs hiding the all-to-all, the latency between
    stages), to the last bit."""
    import random

    from pipeloom.plan.cluster.held import replay_stages
    from pipeloom.problem import Problem
    from pipeloom.schedules import build_schedule
    from pipeloom.sim import compile_schedule, simulate
    from pipeloom.stages import Costs

    split = name not in ("interleaved-1f1b", "1f1b")
    built = build_schedule(name, 4, 12, costs=Costs(f=1.0, b=2.0, w=0.5 if split else 1.0, memory=1.0,
                                                      w_memory=0.3 if split else 0.0), **options)
    compiled = compile_schedule(built)
    stages = 1 + max(task.stage for task in built.problem.tasks)
    rng = random.Random(7)
    for latency in (0.0, 0.013):
        times = [PhaseTimes(f=rng.uniform(0.5, 1.5), i=rng.uniform(0.5, 2.0), w=rng.uniform(0.2, 1.0),
                            f_comm=rng.uniform(0.0, 0.3), i_comm=rng.uniform(0.0, 0.3)) for _ in range(stages)]
        acts = [rng.uniform(1e9, 2e9) for _ in range(stages)]
        taken = {t.stage: t.memory for t in built.problem.tasks if t.kind == "F"}
        tasks = tuple(dataclasses.replace(
            task, duration={"F": times[task.stage].f, "B": times[task.stage].i + times[task.stage].w,
                            "I": times[task.stage].i, "W": times[task.stage].w}[task.kind],
            comm={"F": times[task.stage].f_comm, "B": times[task.stage].i_comm, "I": times[task.stage].i_comm,
                  "W": 0.0}[task.kind],
            memory=task.memory * acts[task.stage] / taken[task.stage]) for task in built.problem.tasks)
        problem = Problem(num_ranks=built.problem.num_ranks, tasks=tasks, comm_latency=latency)
        timeline = simulate(dataclasses.replace(built, problem=problem))
        assert replay_stages(compiled, times, acts, latency) == (timeline.makespan, timeline.bubble_ratio,
                                                                  max(timeline.peak_memory))


@pytest.mark.parametrize("schedule, vp", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2),
                                          ("dualpipev", 2), ("dualpipe", 1)])
def test_the_work_bound_never_passes_a_replay(schedule, vp):
    """The search prunes on :func:`work_bound`, and the estimate never reads below it: on random stage costs (the
    all-to-all from none to twice the compute beside it, uneven stages, the fewest micro-batches a schedule runs and
    more) every replay takes at least the bound, paired schedules' pairs hiding what they can."""
    import random

    rng = random.Random(hash((schedule, vp)) % 1000)
    est = Estimator(_job())
    for pp in (2, 4, 8):  # 8: the middle ranks' bounds (a 1F1B rank's drain after its first stage's last B)
        layout = Layout(dp=64 // pp, pp=pp, vp=vp, ep=min(16, 64 // pp), schedule=schedule)
        for m in sorted({2 * pp, 3 * pp, 5 * pp}):
            if m % (2 if layout.copies == 2 else 1) or (schedule == "interleaved-1f1b" and m % pp):
                continue
            for _ in range(4):
                times = []
                for _ in range(pp * vp * layout.copies):
                    f, i, w = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0), rng.uniform(0.2, 2.0)
                    comm = rng.choice([0.0, 0.3, 1.0, 2.0])
                    times.append(PhaseTimes(f=f * (1 + comm), i=i * (1 + comm), w=w, f_comm=f * comm, i_comm=i * comm))
                acts = [1.0] * len(times)
                made = est._simulate(layout, m, times, acts, 0.0)[0]
                assert made >= work_bound(layout, m, times, paired=est.job.pairs(layout)) * (1 - 1e-9), (pp, m)
