"""``try_plans`` (``pipeloom plan --try K``): the K best predicted plans run in the engine on 2 gloo ranks, the
fastest measured is chosen, and its plan file carries every measurement."""

from __future__ import annotations

import statistics

import pytest
from ranks import run_ranks

from pipeloom.plan.plan import Plan, PlanError, plan_from_json, plan_to_json


def test_the_fastest_measured_of_the_best_plans_is_chosen_and_saved(tmp_path):
    import trial_jobs

    results = run_ranks(2, trial_jobs.try_three, str(tmp_path), timeout=240)
    assert all(status == "ok" for status, _ in results.values()), results
    mine, theirs = results[0][1], results[1][1]
    trials = mine["trials"]
    assert len(trials) == 3 and len({(t["schedule"], t["microbatches"]) for t in trials}) == 3
    measured = [t["measured"] for t in trials]
    # two rounds of two timed steps each, no plan dropped (that takes five rounds): fastest median first
    assert all(m > 0 for m in measured) and measured == sorted(measured)
    assert all(len(t["step_times"]) == 4 and t["rounds"] == 2 and "dropped_after" not in t and t["predicted"] > 0
               for t in trials)
    assert all(t["measured"] == statistics.median(t["step_times"]) for t in trials)
    # the plan chosen is the fastest measured, on both ranks (they share every step's slowest time)
    assert (mine["schedule"], mine["microbatches"]) == (trials[0]["schedule"], trials[0]["microbatches"])
    assert theirs["trials"] == trials and theirs["schedule"] == mine["schedule"]
    assert mine["saved_trials"] == trials  # in the plan file


def test_a_plan_whose_step_the_engine_refuses_leaves_the_race():
    """A refusal only a step makes (chimera's two replicas updating BatchNorm's running statistics apart) is that
    plan's error in the trials, and the race goes on (it had ended the whole command, no plan saved)."""
    import trial_jobs

    for warmup in (1, 0):  # refused in the warm-up, or in the first round
        results = run_ranks(2, trial_jobs.try_a_refused_step, ["chimera", "1f1b"], warmup, timeout=240)
        assert all(status == "ok" for status, _ in results.values()), results
    refused = run_ranks(2, trial_jobs.try_a_refused_step, ["chimera"], 0, timeout=240)  # every plan refused
    assert all(status == "ok" and "none of the 1 plans tried could run: " in value and "holds two replicas" in value
               for status, value in refused.values()), refused
    for _, result in results.values():
        assert result["schedule"] == "1f1b"
        by_schedule = {trial["schedule"]: trial for trial in result["trials"]}
        assert by_schedule.keys() == {"chimera", "1f1b"} and by_schedule["1f1b"]["measured"] > 0
        refused = by_schedule["chimera"]
        assert refused["measured"] is None and "holds two replicas of each piece" in refused["error"]
        assert result["trials"][-1]["schedule"] == "chimera"  # the refused one ranked last


def test_trials_round_trip_through_the_plan_file_and_bad_ones_are_refused():
    trial = {"label": "1f1b, 4 micro-batches", "schedule": "1f1b", "schedule_options": {}, "microbatches": 4,
             "data_parallel": 1, "split_points": ["2"], "predicted": 0.5, "measured": 0.6, "step_times": [0.6]}
    plan = Plan(num_ranks=2, split_points=("2",), schedule="1f1b", microbatches=4, global_batch=8,
                predicted_step_time=0.5, trials=(trial,))
    assert plan_from_json(plan_to_json(plan)) == plan
    assert "trials" not in plan_to_json(Plan(num_ranks=2, split_points=("2",), schedule="1f1b", microbatches=4,
                                             global_batch=8, predicted_step_time=0.5))
    text = plan_to_json(plan).replace('"measured": 0.6', '"measured": "fast"')
    with pytest.raises(PlanError, match=r"plan.trials\[0\]"):
        plan_from_json(text)


def test_trial_plans_are_the_best_distinct_fitting_candidates():
    import trial_jobs

    from pipeloom.plan.planner import plan_pipeline
    from pipeloom.plan.race import run_key
    from pipeloom.profile.trials import trial_plans

    result = plan_pipeline(trial_jobs.table(), num_ranks=2, global_batch=8, schedules=["1f1b", "gpipe"],
                           microbatches=[2, 4, 8])
    fitting = [c for c in result.candidates if c.fits]
    # spread 0: the best predicted, in order, each running something of its own
    found = trial_plans(result, 4, spread=0)
    assert [(t.plan.schedule, t.plan.microbatches) for t in found] == \
        [(c.schedule, c.microbatches) for c in fitting[:4]]
    assert len({run_key(c) for c in fitting[:4]}) == 4
    assert found[0].plan.predicted_step_time == result.plan.predicted_step_time
    with pytest.raises(PlanError, match="positive integer"):
        trial_plans(result, 0)
    with pytest.raises(PlanError, match="spread"):
        trial_plans(result, 2, spread=-0.1)


def test_trial_plans_count_schedules_that_coincide_once():
    """gpipe and 1f1b at one micro-batch run the same actions on the same ranks: one trial, not two."""
    import trial_jobs

    from pipeloom.plan.planner import plan_pipeline
    from pipeloom.profile.trials import trial_plans

    result = plan_pipeline(trial_jobs.table(), num_ranks=2, global_batch=8, schedules=["1f1b", "gpipe"],
                           microbatches=[1, 2])
    one = [c for c in result.candidates if c.fits and c.microbatches == 1]
    assert {c.schedule for c in one} == {"1f1b", "gpipe"}  # both searched, both fit
    found = trial_plans(result, 4, spread=0)
    assert sum(t.plan.microbatches == 1 for t in found) == 1
    assert len(found) == 3  # 1f1b and gpipe at 2 differ; at 1 they are one plan


def test_trial_plans_spread_over_micro_batch_counts_within_the_spread():
    """A count whose best plan is predicted within the spread of the best takes a slot ahead of better
    predicted plans of a count already tried; beyond the spread it does not."""
    import trial_jobs

    from pipeloom.plan.planner import plan_pipeline
    from pipeloom.profile.trials import trial_plans

    result = plan_pipeline(trial_jobs.table(), num_ranks=2, global_batch=8, schedules=["1f1b", "gpipe", "zb-h1"],
                           microbatches=[2, 8])
    fitting = [c for c in result.candidates if c.fits]
    best = fitting[0]
    other = next(c for c in fitting if c.microbatches != best.microbatches)
    gap = other.step_time / best.step_time - 1
    assert gap > 0 and fitting.index(other) >= 2  # the other count is not among the two best predicted
    wide = trial_plans(result, 2, spread=gap * 1.01)
    assert [(t.plan.schedule, t.plan.microbatches) for t in wide] == \
        [(best.schedule, best.microbatches), (other.schedule, other.microbatches)]
    narrow = trial_plans(result, 2, spread=gap * 0.99)
    assert [t.plan.microbatches for t in narrow] == [best.microbatches, fitting[1].microbatches]


def test_trial_plans_spread_over_stages_per_rank():
    """Two stages per rank and one are different shapes: with every plan at one micro-batch count, the best
    one-stage-per-rank plan takes a slot ahead of better predicted two-stage ones when it is within the spread."""
    import trial_jobs

    from pipeloom.plan.planner import plan_pipeline
    from pipeloom.plan.race import shape_key
    from pipeloom.profile.trials import trial_plans

    result = plan_pipeline(trial_jobs.table(), num_ranks=2, global_batch=8, microbatches=[4],
                           schedules=["zbv", "interleaved-1f1b", "v-half", "1f1b"])
    fitting = [c for c in result.candidates if c.fits]
    shapes = [shape_key(c) for c in fitting]
    assert {v for _, _, v in shapes} == {1, 2}
    flat = next(c for c in fitting if shape_key(c)[2] == 1)
    gap = flat.step_time / fitting[0].step_time - 1
    found = trial_plans(result, 2, spread=max(gap, 0.0) * 1.01 + 1e-12)
    assert shape_key(fitting[0])[2] == 2 and fitting.index(flat) >= 2  # not among the two best predicted
    assert (found[-1].plan.schedule, found[-1].plan.microbatches) == (flat.schedule, flat.microbatches)
