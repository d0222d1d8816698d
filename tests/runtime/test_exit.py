"""Ranks exit 0 after a successful run even when the script forgets ``engine.close()`` (and even
``dist.destroy_process_group()``): the engine's helper threads end at interpreter exit. Launched with
torchrun on 2 gloo ranks, three times per case; oracle: the exit status and stderr."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.run")

SCRIPT = Path(__file__).with_name("forgetful_run.py")
RUNS = 2
TIMEOUT = 120


@pytest.mark.timeout(RUNS * TIMEOUT + 30)
@pytest.mark.parametrize("forgets", ["close", "close-and-destroy"])
def test_a_run_that_forgets_to_close_still_exits_zero(forgets):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PIPELOOM_TRACE", None)
    extra = ["--destroy"] if forgets == "close" else []
    for _ in range(RUNS):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(SCRIPT), *extra]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT, check=False)
        assert done.returncode == 0, f"exit {done.returncode}\nstderr:\n{done.stderr}"
        assert "terminate called" not in done.stderr, done.stderr
        # both ranks print; their lines may interleave
        assert sorted(re.findall(r"rank (\d) loss", done.stdout)) == ["0", "1"], done.stdout
