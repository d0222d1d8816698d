"""plan_cluster's Python arguments are checked as strictly as the command line's: flags that are not booleans, layout
mappings, schedule names in any case, and the refusals a new user of the Python API met."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pipeloom.errors import ArgumentError
from pipeloom.plan.cluster import plan_cluster
from pipeloom.plan.cluster.api import framework_options
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.hardware import HardwareError, save_hardware
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.errors import LayoutError, ModelConfigError, NoLayoutFits

SMALL = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}


def _plan(**kw):
    return plan_cluster(SMALL, "h100", **{"gpus": 8, "global_batch": 32, "seq": 4096, **kw})


@pytest.mark.parametrize("flag", ["overlap_grad_reduce", "p2p_overlap", "sequence_parallel", "tp_overlap",
                                  "moe_overlap", "shard_gradients", "distributed_optimizer"])
@pytest.mark.parametrize("value", ["false", 0, None])
def test_a_flag_that_is_not_a_boolean_is_refused_naming_it(flag, value):
    """``shard_gradients="false"`` had been read as true: a ZeRO-2 plan, 13 GiB smaller, asked for by no one."""
    with pytest.raises(ArgumentError, match=rf"^{flag} must be True or False, got {value!r}$"):
        _plan(**{flag: value})


def test_a_layout_mapping_takes_booleans_only_for_fsdp():
    with pytest.raises(LayoutError, match=r"layout tp must be an integer, got True"):
        _plan(layout={"tp": True})  # had been planned as tp=1
    with pytest.raises(LayoutError, match=r"layout recompute must be a name, got True"):
        _plan(layout={"recompute": True})  # had been said as 'recompute=1', which the user never wrote
    assert _plan(layout={"fsdp": True}).best.layout.fsdp is True


def test_schedule_names_are_read_in_any_case_and_a_misspelling_is_named():
    assert _plan(layout="pp=2", schedules=["ZBV"]).best.layout == _plan(layout="pp=2", schedules=["zbv"]).best.layout
    with pytest.raises(ArgumentError, match=r"got \['zb-v'\] \(did you mean 'zbv'\?\)$"):
        _plan(schedules=["zb-v"])
    with pytest.raises(ArgumentError, match=r"give a list: \['zbv', '1f1b'\]"):
        _plan(schedules="zbv,1f1b")


def test_a_schedule_without_a_pipeline_is_told_so_before_its_stage_count():
    """vp=1 with zbv had been told 'use vp=2', which then met 'pp=1 has no pipeline' and 1f1b's 'use vp=1'."""
    for vp in (1, 2):
        with pytest.raises(LayoutError, match=r"^pp=1 has no pipeline to run zbv: use schedule=1f1b with vp=1, or pp "):
            Layout(dp=8, pp=1, vp=vp, schedule="zbv")
    with pytest.raises(LayoutError, match=r"pp=1 has no pipeline to run zbv"):
        _plan(layout="dp=8,tp=1,pp=1,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=zbv")


@pytest.mark.parametrize(("keys", "told"), [
    ("schedule=zbv,vp=3", "zbv places 2 stages per rank in a V: use vp=2, got vp=3"),
    ("schedule=dualpipev,vp=1", "dualpipev places 2 stages per rank in a V: use vp=2, got vp=1"),
    ("schedule=interleaved-1f1b,vp=1", "interleaved-1f1b needs vp >= 2 stages per rank, got vp=1"),
])
def test_a_fixed_schedule_and_its_stage_count_are_told_apart_first(keys, told):
    """A fixed schedule and vp that refuse each other are named, not 'pp=1 has no pipeline' first: following that
    (pp=2) had met the vp refusal next."""
    with pytest.raises(NoLayoutFits, match=re.escape(f"(the first refused: {told}")):
        _plan(layout=keys)


def test_the_plan_says_whether_it_fits():
    fitting = _plan()
    assert fitting.fits is True and fitting.as_dict()["best"]["fits"] is True
    whole = "dp=1,tp=1,pp=8,vp=1,cp=1,ep=1,mbs=4,fsdp=0,recompute=none,schedule=1f1b"
    over = _plan(layout=whole, memory_limit="4GiB")
    assert over.fits is False and over.as_dict()["best"]["fits"] is False
    assert over.best.memory.total > 4 * 2**30


def test_key_value_heads_left_out_are_said_as_defaulted():
    left = {key: value for key, value in SMALL.items() if key != "num_key_value_heads"}
    assert dict(model_spec(left).defaulted)["num_key_value_heads"] == 16  # transformers': the query heads
    assert "num_key_value_heads" not in dict(model_spec(SMALL).defaulted)
    gpt2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 512}
    assert "num_key_value_heads" not in dict(model_spec(gpt2).defaulted)  # its config has no such field
    falcon = {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 128, "ffn_hidden_size": 96, "new_decoder_architecture": True}
    assert dict(model_spec(falcon).defaulted) == {"num_kv_heads": 4}  # its new architecture's field
    assert dict(model_spec({**falcon, "num_kv_heads": 2}).defaulted) == {}
    assert dict(model_spec({**falcon, "new_decoder_architecture": False}).defaulted) == {}  # multi_query instead


def test_fp8_casts_without_fp8_are_told_both_ways():
    with pytest.raises(LayoutError, match=r"plan with --dtype fp8 \(dtype='fp8' in Python\)"):
        _plan(**framework_options("torchtitan", dtype="fp8"))
    assert _plan(dtype="fp8", **framework_options("torchtitan", dtype="fp8")).job.fp8_cast == "dynamic"


def test_a_what_if_no_file_may_hold_is_not_saved(tmp_path):
    what_if = dataclasses.replace(hardware("h100"), scale_up_bandwidth=1e20)
    path = tmp_path / "what-if.json"
    with pytest.raises(HardwareError, match=r"scale_up_bandwidth 1e\+20 is outside .* stays in Python"):
        save_hardware(what_if, path)
    assert not path.exists()
    save_hardware(hardware("h100"), path)
    assert hardware(str(path)) == hardware("h100")


@pytest.mark.parametrize("fixed", ["tp=3,schedule=zbv", "tp=3,vp=2"])
def test_a_fixed_pipeline_schedule_leaves_the_shape_refusal_first(fixed):
    """The early check of the fixed keys tried pp=1 with the schedule, which Layout refuses; the model's heads, which
    no count fixes, went unsaid behind 'pp=1 has no pipeline' (a review found it)."""
    llama = {**SMALL, "num_attention_heads": 32, "num_key_value_heads": 8}
    with pytest.raises(NoLayoutFits, match=r"tp=3 does not split 32 query / 8 key-value heads evenly"):
        plan_cluster(llama, "h100", gpus=12, global_batch=36, seq=4096, layout=fixed)


def test_a_schedule_the_cluster_planner_does_not_price_is_said_so():
    with pytest.raises(ArgumentError, match=r"got \['gpipe'\] \(the cluster planner does not price it; pipeloom plan "
                                            r"--costs searches every built-in schedule\)$"):
        _plan(schedules=["gpipe"])


def test_layout_mapping_keys_are_read_in_any_case():
    assert _plan(layout={"FSDP": True}).best.layout.fsdp is True
    with pytest.raises(LayoutError, match=r"layout recompute must be a name, got True"):
        _plan(layout={"Recompute": True})


def test_a_misspelt_key_value_head_count_is_refused_for_every_family_that_reads_it():
    """llama's defaults do not list num_key_value_heads (its class sets the query heads): a misspelling had been planned
    as multi-head attention, with a note, where mistral's was refused."""
    typo = {**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}, "num_key_value_head": 4}
    for family, default in (("llama", 16), ("granite", 16), ("mistral", 8)):  # mistral: its class default, 8
        with pytest.raises(ModelConfigError, match=rf"did you mean 'num_key_value_heads'\? .* = {default}\) would be"):
            model_spec({**typo, "model_type": family})


def test_the_json_s_hardware_is_the_description_as_given():
    """A 4-GPU job sits in one 8-GPU domain; its --json had written that placement into the hardware object, and a
    64-GPU job planned from that object was placed 4 GPUs to a domain, slower, without a word."""
    from pipeloom.plan.cluster.hardware import hardware_from_dict

    small = _plan(gpus=4, global_batch=16)
    assert small.job.hw.scale_up_placed == 4  # priced in one domain
    described = small.as_dict()["hardware"]
    assert described == hardware("h100").to_dict() and described["scale_up_placed"] is None
    again = plan_cluster(SMALL, hardware_from_dict(described), gpus=4, global_batch=16, seq=4096)
    assert again.best.step_time == small.best.step_time
    large = {"gpus": 64, "global_batch": 256, "seq": 4096}
    assert plan_cluster(SMALL, hardware_from_dict(described), **large).best.step_time == pytest.approx(
        plan_cluster(SMALL, "h100", **large).best.step_time)


def test_fsdp_is_not_searched_with_nothing_to_shard_over():
    """On one GPU FSDP shards over nobody: a 1-GPU plan had listed its fsdp=1 twin as a runner-up, with more memory."""
    one = _plan(gpus=1, global_batch=8, seq=2048)
    assert not [est for est in (one.best, *(est for est, _ in one.runners_up)) if est.layout.fsdp]
    assert _plan(gpus=1, global_batch=8, seq=2048, layout="fsdp=1").best.layout.fsdp  # asked for, it is priced
