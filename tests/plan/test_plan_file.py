"""The ``pipeloom.plan/1`` file: round trip, strict keys, and the checks a hand-edited plan needs.

Oracle: the stage counts each built-in schedule runs (checked against the schedules themselves).
"""

from __future__ import annotations

import json

import pytest

from pipeloom import build_schedule
from pipeloom.ir import schedule_to_json
from pipeloom.plan import PLAN_FORMAT, Plan, PlanError, load_plan, save_plan
from pipeloom.plan.partitioning.shape import schedule_shape
from pipeloom.plan.plan import model_stage_count, plan_from_json, plan_to_json
from pipeloom.schedules import REGISTRY


def _plan(**overrides) -> Plan:
    return Plan(**{"num_ranks": 2, "split_points": ("blocks.2", "blocks.4", "blocks.6"), "schedule": "zbv",
                   "microbatches": 8, "global_batch": 32, "predicted_step_time": 1.5,
                   "peak_memory": (10.0, 12.0), "memory_limit": 16.0, "bubble_ratio": 0.1,
                   "stage_times": (0.1, 0.1, 0.1, 0.1), "device": "cpu", **overrides})


def test_round_trip(tmp_path):
    plan = _plan()
    save_plan(plan, tmp_path / "plan.json")
    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["format"] == PLAN_FORMAT and document["microbatch_size"] == 4
    assert set(document) >= {"num_ranks", "split_points", "schedule", "schedule_options", "microbatches",
                             "global_batch", "predicted_step_time", "peak_memory"}
    assert load_plan(tmp_path / "plan.json") == plan
    assert "sequence_length" not in document  # said by cluster plans only; files without it load as before


def test_the_sequence_length_a_plan_was_priced_for_round_trips(tmp_path):
    plan = _plan(sequence_length=8192)
    save_plan(plan, tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["sequence_length"] == 8192
    assert load_plan(tmp_path / "plan.json") == plan
    for bad in (0, -1, 2.5, True):
        with pytest.raises(PlanError, match="plan sequence_length must be a positive integer"):
            _plan(sequence_length=bad)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_model_stage_count_matches_the_schedules(name):
    options = {"stages_per_rank": 3} if "stages_per_rank" in REGISTRY[name].options else {}
    schedule = build_schedule(name, 4, 8, **options)
    assert model_stage_count(name, 4, options) == schedule_shape(schedule).num_model_stages
    assert model_stage_count("my_schedule.json", 4) is None


def test_plan_checks():
    with pytest.raises(PlanError, match="zbv.* runs 4 model stages.*give 3 split points"):
        _plan(split_points=("blocks.2",))
    with pytest.raises(PlanError, match="not a multiple of microbatches"):
        _plan(global_batch=30)
    with pytest.raises(PlanError, match="does not take stages_per_rank"):
        _plan(schedule_options={"stages_per_rank": 2})
    with pytest.raises(PlanError, match="distinct module names"):
        _plan(split_points=("a", "a", "b"))
    assert _plan(schedule="interleaved-1f1b", schedule_options={"stages_per_rank": 2}).num_stages == 4


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d.update(format="pipeloom.plan/3"), "expected 'pipeloom.plan/1' or 'pipeloom.plan/2'"),
    (lambda d: d.update(expert_parallel=2), r"unknown key\(s\) \['expert_parallel'\]"),  # a /2 key
    (lambda d: d.update(stages=3), r"unknown key\(s\) \['stages'\]"),
    (lambda d: d.pop("schedule"), "missing key 'schedule'"),
    (lambda d: d.update(microbatches="8"), "plan.microbatches: expected an integer"),
    (lambda d: d.update(microbatch_size=3), "microbatch_size 3 is not global_batch / microbatches = 4"),
    (lambda d: d.update(split_points="blocks.2"), "split_points: expected a list of strings"),
])
def test_json_errors(change, words):
    document = json.loads(plan_to_json(_plan()))
    change(document)
    with pytest.raises(PlanError, match=words):
        plan_from_json(json.dumps(document))


def test_expert_parallel_is_written_as_version_2(tmp_path):
    """A plan with expert_parallel > 1 is written as pipeloom.plan/2 and reads back equal; every other plan is
    written as /1 without the key (what older readers take); a /2 file without the key reads expert_parallel 1."""
    plan = _plan(data_parallel=4, expert_parallel=2, global_batch=64)
    save_plan(plan, tmp_path / "plan.json")
    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["format"] == "pipeloom.plan/2" and document["expert_parallel"] == 2
    assert load_plan(tmp_path / "plan.json") == plan and plan.world_size == 8
    plain = json.loads(plan_to_json(_plan(data_parallel=4, global_batch=64)))
    assert plain["format"] == PLAN_FORMAT and "expert_parallel" not in plain
    plain["format"] = "pipeloom.plan/2"
    assert plan_from_json(json.dumps(plain)).expert_parallel == 1
    with pytest.raises(PlanError, match="expert_parallel 3 must divide data_parallel 4"):
        _plan(data_parallel=4, expert_parallel=3, global_batch=64)
    with pytest.raises(PlanError, match="tensor_parallel 1 and sharding 'replicate' only"):
        _plan(data_parallel=2, expert_parallel=2, sharding="fsdp")
    document["expert_parallel"] = 0
    with pytest.raises(PlanError, match="plan.expert_parallel: expected an integer >= 1, got 0"):
        plan_from_json(json.dumps(document))


def test_context_parallel_is_written_as_version_2_and_the_runtime_refuses_it(tmp_path):
    """A plan saved for torchtitan with cp 2 carries it (/2): its ranks count cp, and pipeline(plan=) names cp rather
    than running the layout without it on the other ranks (it had: the file left cp out)."""
    from pipeloom.runtime import Parallelism
    from pipeloom.runtime.errors import PipelineError
    from pipeloom.runtime.plan_file import plan_arguments

    plan = _plan(data_parallel=2, context_parallel=2)
    save_plan(plan, tmp_path / "plan.json")
    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["format"] == "pipeloom.plan/2" and document["context_parallel"] == 2
    assert load_plan(tmp_path / "plan.json") == plan and plan.world_size == 8
    assert "context_parallel" not in json.loads(plan_to_json(_plan()))
    with pytest.raises(PipelineError, match=r"cuts each sequence over 2 ranks \(context_parallel.*--export torchtitan"
                                            r".*has no context parallelism"):
        plan_arguments(tmp_path / "plan.json", None, None, None, None, parallel=Parallelism(), device="cpu")
    # a schedule file's suffix in any case (a plan of one rank: no process group to launch)
    save_plan(_plan(num_ranks=1, schedule="S.JSON", peak_memory=(10.0,)), tmp_path / "upper.json")
    (tmp_path / "S.JSON").write_text(schedule_to_json(build_schedule("zbv", 1, 8)))
    assert plan_arguments(tmp_path / "upper.json", None, None, None, None, parallel=Parallelism(), device="cpu")
    document["format"] = PLAN_FORMAT  # a /1 file does not take the key
    with pytest.raises(PlanError, match=r"unknown key\(s\) \['context_parallel'\]"):
        plan_from_json(json.dumps(document))


def test_a_saved_schedule_is_found_next_to_the_plan(tmp_path):
    plan = _plan(schedule="searched.json")
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.schedule == str(tmp_path / "searched.json")


def test_load_plan_names_the_file(tmp_path):
    with pytest.raises(PlanError, match="nowhere.json"):
        load_plan(tmp_path / "nowhere.json")
