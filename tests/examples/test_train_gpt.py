"""examples/train_gpt.py launched as users launch it: one process, and torchrun with 2 and 4 ranks.

Oracle: the one-rank run's printed losses. Every multi-rank launch (any schedule, any split) must
print the same ``step k loss X`` lines character for character, since the engine's gradients equal
the single-device ones bitwise (docs/design.md §5) and the optimizer then does the same arithmetic.

Without torch the module is skipped, unless PIPELOOM_REQUIRE_TORCH=1 (set by ``make test``), which
turns a missing torch into a failure.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _require_torch() -> None:
    """Skip the module without torch's distributed package; fail instead if torch is required."""
    try:
        importlib.import_module("torch.distributed.run")
        return
    except ImportError as error:
        reason = str(error)
    if os.environ.get("PIPELOOM_REQUIRE_TORCH") == "1":
        pytest.fail(f"PIPELOOM_REQUIRE_TORCH=1 but torch cannot be imported: {reason}", pytrace=False)
    pytest.skip(f"torch is not installed ({reason}); set PIPELOOM_REQUIRE_TORCH=1 to make this a failure",
                allow_module_level=True)


_require_torch()

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS = 2
LOSS_LINE = re.compile(r"^step (\d+) loss (\S+)$")
TIMEOUT = 120  # seconds for one launch; the pytest timeout of each test is a little above

pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def _losses(stdout: str, steps: int = STEPS) -> list[str]:
    """The printed loss texts, checked to be steps 0..steps-1 in order and nothing else."""
    matches = [LOSS_LINE.match(line) for line in stdout.splitlines() if line.startswith("step ")]
    assert all(matches), stdout
    assert [int(m.group(1)) for m in matches] == list(range(steps)), stdout
    return [m.group(2) for m in matches]


def run_example(*args: str, ranks: int = 1, steps: int = STEPS) -> str:
    """stdout of the example (one plain process, or torchrun with ``ranks`` processes)."""
    command = [sys.executable, str(EXAMPLE)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   str(EXAMPLE)]  # as the README launches it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU
    env.pop("PIPELOOM_TRACE", None)
    done = subprocess.run([*command, "--steps", str(steps), *args], capture_output=True, text=True,
                          env=env, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    # every rank's process exits 0 and cleanly (a rank once died after its last step with "terminate called
    # without an active exception"): checked on each of this file's five torchrun launches
    assert "terminate called" not in done.stderr, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def one_rank() -> list[str]:
    """Losses of the default run on one rank (1f1b, one stage), the oracle of every launch."""
    return _losses(run_example())


def test_one_rank_loss_starts_near_log_vocab_and_falls(one_rank):
    first, second = (float(text) for text in one_rank)
    assert 3.5 < first < 5.0, one_rank  # ln(64) = 4.16 for an untrained model over 64 tokens
    assert second < first - 0.3, one_rank  # the counting pattern is learnt fast (4.26 -> 3.64)
    assert one_rank[0] == repr(first)  # full precision: repr round-trips


@pytest.mark.parametrize(("ranks", "schedule"), [
    (2, "zbv"),  # split backward (I/W), V placement: 4 pieces on 2 ranks
    (4, "interleaved-1f1b"),  # 8 pieces, the most the default 8 blocks allow
    (2, "dualpipe"),  # two replicas: 2 pieces, each on both ranks
])
def test_torchrun_prints_the_one_rank_losses(one_rank, ranks, schedule):
    assert _losses(run_example("--schedule", schedule, ranks=ranks)) == one_rank


def test_a_meta_build_prints_the_whole_builds_losses(one_rank):
    assert _losses(run_example("--meta")) == one_rank


def test_pipelines_times_replicas_print_the_one_rank_losses_to_rounding():
    """2 replicas × 2 stages, built on meta, 4 micro-batches each: the one-rank run over 8 micro-batches of
    the same batch, to rounding (the replicas' gradients are summed in another order)."""
    oracle = _losses(run_example("--microbatches", "8"))
    found = _losses(run_example("--dp", "2", "--meta", "--microbatches", "4", ranks=4))
    assert found[0] == oracle[0]  # the first step's losses are the same numbers added in the same order
    assert all(abs(float(a) - float(b)) <= 1e-5 * abs(float(b)) for a, b in zip(found, oracle)), (found, oracle)


def test_saved_schedule_file_runs_like_the_built_in(one_rank, tmp_path):
    from pipeloom import build_schedule, save_schedule

    path = tmp_path / "gpipe2.csv"
    save_schedule(build_schedule("gpipe", 2, 8), path)
    assert _losses(run_example("--schedule", str(path), ranks=2)) == one_rank


def test_unbuildable_schedule_is_one_line_and_nonzero():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--schedule", "chimera", "--steps", "1"],
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert "chimera" in done.stderr and "even" in done.stderr
