"""examples/train_hf.py launched as users launch it: one process, and torchrun with 2 ranks.

Oracle: the one-rank run's printed losses. With dropout on, tied weights and global-norm clipping, a
2-rank launch with the same pieces must print the same ``step k loss X`` lines character for character.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.run")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hf.py"
STEPS = 3
LOSS_LINE = re.compile(r"^step (\d+) loss (\S+)$")
TIMEOUT = 240

pytestmark = pytest.mark.timeout(2 * TIMEOUT + 30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_example(*args: str, ranks: int = 1) -> list[str]:
    """The printed loss texts of one launch (checked to be steps 0..STEPS-1 in order)."""
    command = [sys.executable, str(EXAMPLE)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                   "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(EXAMPLE)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([*command, "--steps", str(STEPS), "--seq", "16", *args], capture_output=True, text=True,
                          env=env, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
    matches = [LOSS_LINE.match(line) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert all(matches) and [int(m.group(1)) for m in matches] == list(range(STEPS)), done.stdout
    return [m.group(2) for m in matches]


@pytest.mark.parametrize(("model", "schedule"), [("gpt2", "zbv"), ("bert", "interleaved-1f1b")])
def test_torchrun_prints_the_one_rank_losses(model, schedule):
    one_rank = run_example("--model", model)
    if model == "gpt2":  # next-token prediction on counting sequences learns within a few steps
        assert float(one_rank[0]) > float(one_rank[-1])
    assert run_example("--model", model, "--schedule", schedule, ranks=2) == one_rank


def test_replicas_of_a_meta_built_pipeline_print_the_one_rank_losses():
    """llama, 2 replicas × 2 stages built on the meta device (4 micro-batches each) against one rank running
    the same 2 pieces over 8 micro-batches: dropout draws the same; losses equal to rounding."""
    oracle = run_example("--model", "llama", "--pieces", "2", "--schedule", "zbv", "--microbatches", "8")
    found = run_example("--model", "llama", "--pieces", "2", "--schedule", "1f1b", "--microbatches", "4",
                        "--dp", "2", "--meta", ranks=4)
    assert found[0] == oracle[0]
    assert all(abs(float(a) - float(b)) <= 1e-5 * abs(float(b)) for a, b in zip(found, oracle)), (found, oracle)


def test_a_schedule_for_other_pieces_is_one_line():
    command = [sys.executable, str(EXAMPLE), "--schedule", "zbv", "--steps", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("train_hf: ") and "pieces" in last, done.stderr[-2000:]
