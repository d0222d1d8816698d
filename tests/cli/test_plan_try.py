"""``pipeloom plan --try K`` launched as users launch it (torchrun, 2 gloo ranks), and its usage errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeloom.cli import main

ROOT = Path(__file__).resolve().parent.parent.parent
MODEL = '''
import torch
from torch import nn


def build(width: int = 16):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)))
    return model, torch.randn(8, width), torch.randn(8, width)


def build_model(width: int = 16):
    """The model alone: its inputs and target made up (the first module is a Linear)."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)))


def mse(output, target):
    return ((output - target) ** 2).mean()


def ce(output, target):
    return nn.functional.cross_entropy(output, target)
'''


def _costs(folder: Path) -> Path:
    pieces = [{"name": f"{k}", "f": 1e-4, "i": 1e-4, "w": 1e-4, "activation_bytes": 64.0, "param_bytes": 1024.0,
               "output_bytes": 64.0} for k in range(4)]
    path = folder / "costs.json"
    path.write_text(json.dumps({"format": "pipeloom.costs/2", "microbatch_size": 1, "pieces": pieces}))
    return path


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("build, loss", [("build", "mse"), ("build_model", "ce")])
def test_try_runs_the_best_plans_on_two_ranks_and_saves_what_it_measured(tmp_path, build, loss):
    """--build returning (model, inputs, target), or the model alone (its inputs made up as profile makes them:
    that had failed on a flag of profile's the plan command does not have)."""
    (tmp_path / "model.py").write_text(MODEL)
    _costs(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={_port()}", "-m", "pipeloom", "plan", "--costs", "costs.json", "--ranks", "2",
               "--global-batch", "8", "--schedules", "1f1b,gpipe", "--microbatches", "2", "4", "--try", "3",
               "--build", f"model.py:{build}", "--loss", loss, "--try-steps", "6", "--try-seconds", "60",
               "--save", "plan.json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "120"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    tried = [line for line in done.stdout.splitlines() if line.startswith("tried ")]
    assert len(tried) == 3 and tried[0].endswith("<- chosen"), done.stdout  # printed once: rank 0
    assert all("(median of 6 steps in 2 rounds)" in line for line in tried), done.stdout  # 2 rounds of 3 steps
    saved = json.loads((tmp_path / "plan.json").read_text())
    trials = saved["trials"]
    assert len(trials) == 3 and [t["measured"] for t in trials] == sorted(t["measured"] for t in trials)
    assert all(len(t["step_times"]) == 6 and t["rounds"] == 2 for t in trials)
    assert (saved["schedule"], saved["microbatches"]) == (trials[0]["schedule"], trials[0]["microbatches"])


@pytest.mark.parametrize(("flags", "message"), [
    (["--try", "2"], "--try runs the plans in the engine: give --build FILE.py:FUNCTION and --loss NAME"),
    (["--build", "m.py:f"], "--build goes with --try K"),
    (["--try-seconds", "5"], "--try-seconds goes with --try K"),
    (["--try", "2", "--build", "m.py:f", "--loss", "l"], "--try runs on every rank of a launch: torchrun"),
])
def test_try_usage_errors(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["plan", "--costs", str(_costs(tmp_path)), "--ranks", "2", "--global-batch", "8", *flags])
    assert code == 2 and message in capsys.readouterr().err


def test_ranks_other_than_the_plans_are_refused_before_any_group_is_joined(tmp_path, capsys, monkeypatch):
    """Every rank of a launch of another size says so before it joins the process group (rank 0 had said it after,
    and left the others to crash in the group's rendezvous with a traceback); no group is made: none is at hand."""
    (tmp_path / "m.py").write_text(MODEL)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(name, raising=False)  # a process group could not form here
    code = main(["plan", "--costs", str(_costs(tmp_path)), "--ranks", "4", "--global-batch", "8", "--try", "2",
                 "--build", f"{tmp_path / 'm.py'}:build", "--loss", "mse"])
    assert code == 1
    assert capsys.readouterr().err.strip() == ("pipeloom: error: the plan runs on 4 ranks but 2 are at hand; try the "
                                               "plans on 4 ranks (torchrun --nproc-per-node 4)")


def test_trial_lines_say_how_each_plan_was_measured_and_which_left_early():
    import types

    from pipeloom.cli.plan_try import trial_lines

    trials = [{"label": "1f1b, 4 micro-batches", "predicted": 0.5, "measured": 0.4, "step_times": [0.4] * 15,
               "rounds": 5},
              {"label": "gpipe, 4 micro-batches", "predicted": 0.45, "measured": 0.6, "step_times": [0.6] * 15,
               "rounds": 5, "dropped_after": 5},
              {"label": "zbv, 2 micro-batches", "predicted": 0.55, "measured": None, "step_times": [], "rounds": 0,
               "error": "PlanError: refused"}]
    lines = trial_lines(types.SimpleNamespace(trials=trials))
    assert lines == [
        "tried 1f1b, 4 micro-batches: predicted 0.5000 s, measured 0.4000 s (median of 15 steps in 5 rounds)"
        "  <- chosen",
        "tried gpipe, 4 micro-batches: predicted 0.4500 s, measured 0.6000 s (median of 15 steps in 5 rounds), "
        "dropped after round 5 as clearly slower",
        "tried zbv, 2 micro-batches: predicted 0.5500 s, not run: PlanError: refused"]
