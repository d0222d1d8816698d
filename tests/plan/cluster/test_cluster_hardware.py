"""The GPU descriptions: every built-in loads and is documented, the JSON file format round-trips, and bad
names and files raise HardwareError naming the fix."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.plan.cluster import model_spec
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware, hardware_names
from pipeloom.plan.cluster.hardware import FORMAT, Hardware, load_hardware, save_hardware
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.errors import HardwareError

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
NAMES = ["a100-40gb", "a100-80gb", "h100", "h200", "b200", "gb200", "gb300", "mi300x"]


def test_the_builtin_names_are_the_agreed_ones():
    assert hardware_names() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_builtin_loads_and_every_spec_field_has_a_source(name):
    hw = hardware(name)
    assert hw.name == name
    assert hardware(name.upper()) is hw
    spec = ("peak_flops", "memory_bytes", "memory_bandwidth", "scale_up_size", "scale_up_bandwidth",
            "scale_out_bandwidth", "gemm_efficiency", "attention_efficiency", "attention_backward_efficiency",
            "scale_up_efficiency", "scale_out_efficiency", "gemm_half_dim", "memory_efficiency",
            "scale_up_latency", "scale_out_latency", "kernel_overhead")
    missing = [f for f in spec if not hw.sources.get(f)]
    assert not missing, f"{name}: no source for {missing}"
    # Scale-up is faster than scale-out, fp8 (where present) twice bf16, as every datasheet says.
    assert hw.scale_up_bandwidth > hw.scale_out_bandwidth
    if "fp8" in hw.peak_flops:
        assert hw.peak_flops["fp8"] == pytest.approx(2 * hw.peak_flops["bf16"], rel=1e-3)


def test_datasheet_figures_of_two_gpus():
    h100, a100 = hardware("h100"), hardware("a100-80gb")
    assert h100.peak_flops == {"bf16": 989.4e12, "fp8": 1978.9e12}
    assert h100.memory_bytes == 81559 * 2**20 and h100.memory_bandwidth == 3.35e12  # nvidia-smi's 81,559 MiB
    assert h100.scale_up_bandwidth == 450e9 and h100.scale_up_size == 8
    assert "fp8" not in a100.peak_flops and a100.memory_bandwidth == 2039e9
    assert hardware("gb200").scale_up_size == 72


def test_a_gpu_without_fp8_names_the_dtypes_it_has():
    with pytest.raises(HardwareError, match="a100-40gb has no 'fp8'.*'bf16'"):
        hardware("a100-40gb").peak("fp8")


@pytest.mark.parametrize("name", NAMES)
def test_json_round_trip(tmp_path, name):
    path = tmp_path / f"{name}.json"
    save_hardware(hardware(name), path)
    assert json.loads(path.read_text())["format"] == FORMAT
    assert load_hardware(path) == hardware(name)
    assert hardware(str(path)) == hardware(name)


def test_a_minimal_file_takes_the_h100s_measured_efficiencies(tmp_path):
    """The GEMM and attention fields a file leaves out are the built-in H100's measured ones, each said in its
    sources; the FP8 ceiling scaled from the file's BF16 one as on the H100. They had been the dataclass's round
    priors (FP8 at the BF16 fraction), which priced a copy of the H100's required fields 9 % faster than the h100."""
    from pipeloom.plan.cluster.hardware import PRIORED

    data = {"format": FORMAT, "name": "my-gpu", "peak_flops": {"bf16": 500e12, "fp8": 1e15}, "memory_bytes": 64 * 2**30,
            "memory_bandwidth": 2e12, "scale_up_size": 4, "scale_up_bandwidth": 200e9,
            "scale_out_bandwidth": 25e9, "scale_up_latency": 1e-6, "scale_out_latency": 5e-6}
    h100 = hardware("h100")
    hw = hardware(_write(tmp_path, data))
    assert hw.name == "my-gpu" and all(getattr(hw, name) == getattr(h100, name) for name in PRIORED)
    assert hw.sources["gemm_efficiency"] == "not given: the built-in h100's"
    assert hw.sources["fp8_gemm_efficiency"].startswith("not given: gemm_efficiency x 0.883")
    own = hardware({**data, "gemm_efficiency": 0.6, "sources": {"gemm_efficiency": "my sweep"}})
    assert own.gemm_ceiling("fp8") == pytest.approx(0.6 * 0.709 / 0.803, abs=1e-4)
    assert own.sources["gemm_efficiency"] == "my sweep"
    no_fp8 = hardware({**data, "peak_flops": {"bf16": 500e12}})
    assert no_fp8.fp8_gemm_efficiency is None and no_fp8.attention_half_seq == h100.attention_half_seq
    # read without priors (load_hardware alone), the dataclass's defaults
    assert load_hardware(_write(tmp_path, data)).gemm_efficiency == Hardware.__dataclass_fields__[
        "gemm_efficiency"].default
    # the H100's required fields alone price as the h100 does
    required = {k: v for k, v in h100.to_dict().items() if k in data or k == "sm_count"}
    alone = hardware(_write(tmp_path, required))
    assert dataclasses.replace(alone, sources={}) == dataclasses.replace(h100, sources={})


def test_an_fp8_ceiling_is_the_gpus_own_where_measured():
    """H100: the FP8 MAMF fraction (0.709) is below BF16's (0.803), and FP8 GEMMs take it."""
    h100 = hardware("h100")
    assert h100.gemm_ceiling("bf16") == h100.gemm_efficiency == 0.803
    assert h100.gemm_ceiling("fp8") == h100.fp8_gemm_efficiency == 0.709
    assert "1,402.6 of 1,979" in h100.sources["fp8_gemm_efficiency"]


def test_a_file_naming_a_key_twice_or_not_text_is_refused(tmp_path):
    text = json.dumps(_good())
    with pytest.raises(HardwareError, match="gives 'scale_up_latency' twice; keep one"):
        hardware(_write(tmp_path, text[:-1] + ', "scale_up_latency": 0}'))
    with pytest.raises(HardwareError, match="is not UTF-8 text"):
        path = tmp_path / "binary.json"
        path.write_bytes(b"\xff\xfe\x00")
        hardware(path)
    assert hardware(_write(tmp_path, "\ufeff" + text)) == hardware("h100")  # a byte-order mark, as editors write


def test_a_job_takes_64_gpus_of_each_nvl72_rack(tmp_path):
    """NVIDIA schedules large jobs on an NVL72 rack in segments of 16 of its 18 trays: 64 GPUs of a job share a
    domain, so a group of 64 consecutive ranks stays on NVLink (the gcd with 72 had put 8 per domain), and a
    data-parallel group 4 ranks apart holds 16 per domain; 8-GPU nodes are filled whole. A file written before
    the field existed loads with the whole domain."""
    from pipeloom.plan.cluster.efficiency import domain_ranks

    gb200, b200 = hardware("gb200"), hardware("b200")
    assert (gb200.scale_up_size, gb200.scale_up_placed, gb200.domain_gpus) == (72, 64, 64)
    assert "--segment=16" in gb200.sources["scale_up_placed"] and hardware("gb300").domain_gpus == 64
    assert (b200.scale_up_placed, b200.domain_gpus) == (None, 8)
    assert domain_ranks(64, 1, gb200) == 64 and domain_ranks(16, 4, gb200) == 16 and domain_ranks(64, 1, b200) == 8
    old = gb200.to_dict()
    del old["scale_up_placed"], old["sources"]["scale_up_placed"]
    assert hardware(_write(tmp_path, old)).domain_gpus == 72


def test_a_job_smaller_than_a_domain_sits_in_one():
    """4 GPUs of a 6-GPU domain share it: a group of 4 is priced inside the domain (the gcd with 6 had put 2 per
    domain), as 4 GPUs of a domain of 8 are; on an NVL72 16 GPUs share one domain, as in a domain of 16."""
    from pipeloom.plan.cluster.job import Job

    spec = model_spec(LLAMA_8B)
    six, eight = (dataclasses.replace(hardware("h100"), scale_up_size=size) for size in (6, 8))
    jobs = [Job(spec=spec, hw=hw, gpus=4, global_batch=16, seq=4096) for hw in (six, eight)]
    assert [job.hw.domain_gpus for job in jobs] == [4, 4] and jobs[0].hw.scale_up_size == 6
    layout = Layout(tp=4, pp=1, dp=1)
    times = [Estimator(job).estimate(layout).step_time for job in jobs]
    assert times[0] == pytest.approx(times[1])
    nvl = Job(spec=spec, hw=hardware("gb200"), gpus=16, global_batch=16, seq=4096)
    wide = Job(spec=spec, hw=dataclasses.replace(hardware("gb200"), scale_up_size=16, scale_up_placed=None), gpus=16,
               global_batch=16, seq=4096)
    assert Estimator(nvl).estimate(Layout(dp=16)).step_time == Estimator(wide).estimate(Layout(dp=16)).step_time


def test_pipeline_sends_that_cross_a_domain_go_over_the_nic():
    """Pipeline rank k of the first pipeline is GPU k x tp x cp x dp: with pp 8 over domains of 2 GPUs three of the
    seven sends between ranks cross (interleaved with vp 2: fifteen sends, the last rank's to the first among them,
    seven crossing; the V and DualPipe's copies turn on their last rank); each send is priced at the mean of its
    boundaries', so a slow NIC slows the pipeline that spans domains, and no longer once it fits in one."""
    from pipeloom.plan.cluster.job import Job
    from pipeloom.plan.cluster.placement import crossing_sends, stage_send_seconds

    assert crossing_sends(Layout(pp=8), 2) == (3, 7) and crossing_sends(Layout(pp=8), 8) == (0, 7)
    assert crossing_sends(Layout(pp=8, vp=2, schedule="interleaved-1f1b"), 2) == (7, 15)
    assert crossing_sends(Layout(pp=8, vp=2, schedule="zbv"), 2) == (6, 14)
    assert crossing_sends(Layout(pp=8, schedule="dualpipe"), 2) == (6, 14)
    assert crossing_sends(Layout(pp=4, tp=2), 8) == (0, 3) and crossing_sends(Layout(pp=4, tp=4), 8) == (1, 3)
    spec = model_spec(LLAMA_8B)
    slow = dataclasses.replace(hardware("h100"), scale_out_bandwidth=1e6)
    times = {}
    for size in (1, 2, 8):
        job = Job(spec=spec, hw=dataclasses.replace(slow, scale_up_size=size), gpus=8, global_batch=16, seq=4096)
        times[size] = (stage_send_seconds(job, Layout(pp=8)), Estimator(job).estimate(Layout(pp=8)).step_time)
    assert times[2][0] == pytest.approx((3 * times[1][0] + 4 * times[8][0]) / 7)
    assert times[1][1] > times[2][1] > times[8][1]


def test_counts_written_as_whole_floats_load_and_objects_name_their_type(tmp_path):
    """A JSON writer's 8.5e10 bytes or 8.0 GPUs is a whole count and loads; a dict is a description too (as
    plan_cluster takes one); a Hardware's mappings and save_hardware's argument are checked by name."""
    data = _good()
    data.update(memory_bytes=8.5e10, scale_up_size=8.0)
    loaded = hardware(_write(tmp_path, data))
    assert (loaded.memory_bytes, loaded.scale_up_size) == (85_000_000_000, 8) and type(loaded.scale_up_size) is int
    assert hardware(_good()) == hardware("h100")
    with pytest.raises(HardwareError, match=r"peak_flops must be a mapping \(dtype -> dense FLOP/s\), got None"):
        dataclasses.replace(hardware("h100"), peak_flops=None)
    with pytest.raises(HardwareError, match=r"save_hardware takes a Hardware .* got str"):
        save_hardware("h100", tmp_path / "x.json")


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _good() -> dict:
    return hardware("h100").to_dict()


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(nvlink=1), r"unknown key\(s\) 'nvlink'; the keys are name, peak_flops"),
    (lambda d: d.update(memory_bandwith=d.pop("memory_bandwidth")),
     r"unknown key\(s\) 'memory_bandwith' \(did you mean 'memory_bandwidth' for 'memory_bandwith'\?\)"),
    (lambda d: d.pop("memory_bandwidth"), r"missing key\(s\) 'memory_bandwidth'"),
    (lambda d: d.update(format="pipeloom.hardware/9"), "'format' must be 'pipeloom.hardware/1'"),
    (lambda d: d.update(peak_flops={"fp16": 1e15}), "unknown dtype 'fp16'; use bf16, fp8"),
    (lambda d: d.update(peak_flops={"fp8": 1e15}), "needs a 'bf16' rate"),
    (lambda d: d.update(gemm_efficiency=1.5), r"gemm_efficiency is a fraction of peak in \(0, 1\]"),
    (lambda d: d.update(fp8_gemm_efficiency=0), r"fp8_gemm_efficiency is a fraction of the FP8 peak .* or null"),
    (lambda d: d.update(scale_up_size=0), "scale_up_size must be a whole number of GPUs >= 1"),
    (lambda d: d.update(scale_up_placed=9), r"scale_up_placed is the GPUs of one job .* from 1 to scale_up_size \(8\)"),
    (lambda d: d.update(memory_bytes=8.5e10 + 0.5), "memory_bytes must be a whole number of bytes"),
    (lambda d: d.update(peak_flops={"bf16": 1e15, "fp8": 1e14}), r"peak_flops\['fp8'\] \(1e\+14\) is below the bf16"),
    (lambda d: d.update(peak_flops={"bf16": 1e15}), "fp8_gemm_efficiency is given but peak_flops has no 'fp8'"),
    (lambda d: d.update(sources=None), r"'sources' must be a JSON object"),
    (lambda d: d.update(mxfp8="yes"), "mxfp8 is true or false"),
    (lambda d: d.update(fp8_any_layout=1), "fp8_any_layout is true or false"),
    (lambda d: d.update(scale_out_latency=-1), "scale_out_latency must be seconds >= 0"),
    (lambda d: d.update(sources={"nvlink": "x"}), "sources maps a field name to a string"),
    (lambda d: d.update(peak_flops=[1]), "'peak_flops' must be a JSON object"),
    (lambda d: d.update(memory_bytes=10**30), r"memory_bytes 1e\+30 is outside what any GPU has .* check its unit"),
    (lambda d: d.update(memory_bytes=80), r"memory_bytes 80 is outside what any GPU has \(1 GiB to 16 TiB: bytes"),
    (lambda d: d.update(kernel_overhead=1.0), r"kernel_overhead 1 is outside .* \(a kernel launch: 2e-6\)"),
    (lambda d: d.update(scale_out_bandwidth=400), r"scale_out_bandwidth 400 is outside .*a 400 Gb/s NIC: 5e10"),
    (lambda d: d.update(peak_flops={"bf16": 989.4, "fp8": 1978.9}), r"peak_flops\['bf16'\] 989.4 is outside"),
    (lambda d: d.update(gemm_half_dim=1e12), r"gemm_half_dim 1e\+12 is outside .* check its unit and digits"),
    (lambda d: d.update(flash2_slowdown=1e9), r"flash2_slowdown 1e\+09 is outside .*Hopper: 1.7"),
    (lambda d: d.update(sm_count=10**9), r"sm_count 1e\+09 is outside"),
    (lambda d: d.update(scale_up_size=10**12, scale_up_placed=None), r"scale_up_size 1e\+12 is outside"),
    (lambda d: d.update(attention_half_seq=1e9), r"attention_half_seq 1e\+09 is outside"),
    (lambda d: d.update(overlap_slowdown=50.0), r"overlap_slowdown 50 is outside"),
    (lambda d: d.update(mxfp8=True, peak_flops={"bf16": 1e15}, fp8_gemm_efficiency=None),
     "mxfp8 is true but peak_flops has no 'fp8' rate"),
])
def test_bad_files_name_the_problem(tmp_path, change, message):
    data = _good()
    change(data)
    path = _write(tmp_path, data)
    with pytest.raises(HardwareError, match=message) as info:
        hardware(path)
    assert path in str(info.value)


def test_unreadable_and_unknown(tmp_path):
    with pytest.raises(HardwareError, match="is not JSON"):
        load_hardware(_write(tmp_path, "{nope"))
    with pytest.raises(HardwareError, match="is not JSON: a number of more than 4,300 digits, surely a typo"):
        load_hardware(_write(tmp_path, '{"memory_bytes": ' + "9" * 5000 + "}"))  # had escaped as a bare ValueError
    with pytest.raises(HardwareError, match="expected a JSON object"):
        load_hardware(_write(tmp_path, "[1]"))
    with pytest.raises(HardwareError, match="cannot read hardware file"):
        load_hardware(tmp_path / "absent.json")
    with pytest.raises(HardwareError, match=r"unknown hardware 'h1000': use a built-in name \(a100-40gb, "):
        hardware("h1000")
    with pytest.raises(HardwareError, match=r"'x/gpu.json' \(no such file\)"):
        hardware("x/gpu.json")
    (tmp_path / "gpu.json").mkdir()
    with pytest.raises(HardwareError, match=r"gpu.json' \(a folder, not a file\)"):
        hardware(tmp_path / "gpu.json")
    with pytest.raises(HardwareError, match=r"hardware is empty: use a built-in name \(a100-40gb"):
        hardware("")  # not "a folder, not a file" (the empty path is the current folder)
    with pytest.raises(HardwareError, match="got int"):
        hardware(3)  # type: ignore[arg-type]
    assert issubclass(HardwareError, PipeloomError)


def test_hardware_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        hardware("h100").name = "x"  # type: ignore[misc]


def _sdpa_rate(hw, seq: int, heads: int, backward: bool) -> float:
    from pipeloom.plan.cluster.efficiency import attention_flops, attention_seconds

    shape = {"batch": 1, "heads": heads, "seq": seq, "head_dim": 128, "causal": True}
    return attention_flops(**shape, backward=backward) / attention_seconds(hw, **shape, backward=backward) / 1e12


@pytest.mark.parametrize(("name", "sweep", "heads"), [("gb200", "gb200", 128), ("gb300", "gb300", 128),
                                                      ("h200", "hopper", 64), ("h100", "hopper", 64)])
def test_attention_follows_nvidias_sdpa_sweep(name, sweep, heads):
    """Attention's efficiencies and half-rate sequence are fitted to NVIDIA's published sweep of its training
    attention kernel over the sequence (cudnn-frontend's SDPA benchmark, causal BF16): the model gives every point
    of it back within 12 % (the form ``s / (s + half)`` fits it that closely; it ran 1.2-1.4x faster than measured at
    2K tokens with the prior half of 256 before 2026-12-05), and says where it comes from."""
    from pipeloom.plan.cluster.gpus import _SDPA_SWEEPS

    hw = hardware(name)
    for seq, (forward, backward) in _SDPA_SWEEPS[sweep][1].items():
        for measured, backward_pass in ((forward, False), (backward, True)):
            assert _sdpa_rate(hw, seq, heads, backward_pass) == pytest.approx(measured, rel=0.12), (seq, backward_pass)
    assert hw.attention_half_seq > 1000
    for field in ("attention_efficiency", "attention_backward_efficiency", "attention_half_seq"):
        assert "cudnn-frontend" in hw.sources[field] and "fitted" in hw.sources[field]


def test_b200_attention_reproduces_its_own_sdpa_point():
    """The B200's own measurement is one point (sequence 32,768, cuDNN 9.13.1); its half-rate sequence is the GB200's
    fit (the same GPU), its efficiencies the rates that give that point back."""
    hw = hardware("b200")
    assert _sdpa_rate(hw, 32768, 128, False) == pytest.approx(1419.0, rel=0.01)
    assert _sdpa_rate(hw, 32768, 128, True) == pytest.approx(1108.7, rel=0.01)
    assert hw.attention_half_seq == hardware("gb200").attention_half_seq and hw.flash2_slowdown > 3
    assert "gb200's half-rate sequence" in hw.sources["attention_efficiency"]


def test_every_builtin_gemm_ceiling_is_the_ratio_its_source_quotes():
    """The GEMM ceilings are computed from the maximum achievable matmul table's raw TFLOP/s and peak, which their
    source text quotes: the number and its source cannot drift apart."""
    import re

    from pipeloom.plan.cluster.gpus import BUILTIN

    checked = 0
    for name, hw in BUILTIN.items():
        for field in ("gemm_efficiency", "fp8_gemm_efficiency"):
            value = getattr(hw, field)
            found = re.search(r"([\d,.]+) of ([\d,.]+) TFLOPS", hw.sources.get(field, ""))
            if value is None or found is None:
                continue
            measured, peak = (float(x.replace(",", "")) for x in found.groups())
            assert value == round(measured / peak, 3), (name, field, value, found.group(0))
            checked += 1
    assert checked == 13  # BF16 of all eight GPUs, FP8 of the five with an FP8 row
