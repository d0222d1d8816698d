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
    from pipeloom.profile.trials import trial_plans

    result = plan_pipeline(trial_jobs.table(), num_ranks=2, global_batch=8, schedules=["1f1b", "gpipe"],
                           microbatches=[2, 4, 8])
    found = trial_plans(result, 4)
    fitting = [c for c in result.candidates if c.fits]
    assert [(t.plan.schedule, t.plan.microbatches) for t in found] == \
        [(c.schedule, c.microbatches) for c in fitting[:4]]
    assert found[0].plan.predicted_step_time == result.plan.predicted_step_time
    with pytest.raises(PlanError, match="positive integer"):
        trial_plans(result, 0)
