"""``pipeloom plan`` and ``pipeloom profile`` run in-process.

Oracles: the library called directly (same plan as ``plan_pipeline``), the files the commands write
(read back with ``load_plan`` / ``load_costs``), and one ``pipeloom: error:`` line for bad input.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeloom.cli import main
from pipeloom.plan import CostTable, Link, Piece, load_costs, load_plan, plan_pipeline, save_costs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(result: tuple[int, str, str], status: int, *fragments: str) -> None:
    code, out, err = result
    assert code == status, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipeloom: error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def costs(tmp_path) -> Path:
    pieces = tuple(Piece(name=f"blocks.{k}", f=0.01, i=0.01, w=0.008, activation_bytes=2**20,
                         w_activation_bytes=2**18, param_bytes=2**19, output_bytes=2**16) for k in range(8))
    path = tmp_path / "costs.json"
    save_costs(CostTable(pieces=pieces, microbatch_size=1, link=Link(latency=1e-4, bandwidth=1e9)), path)
    return path


def test_plan_prints_the_best_plan_and_writes_files(capsys, costs, tmp_path):
    code, out, err = run(capsys, "plan", "--costs", str(costs), "--ranks", "4", "--memory-limit", "16MiB",
                         "--global-batch", "16", "-o", str(tmp_path / "plan.png"), "--save", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "best plan" in out and "runners-up" in out
    assert "wrote plan" in out and "wrote timeline picture" in out
    assert (tmp_path / "plan.png").stat().st_size > 1000
    plan = load_plan(tmp_path / "p.json")
    result = plan_pipeline(load_costs(costs), num_ranks=4, global_batch=16, memory_limit=16 * 2**20)
    expected = result.plan
    assert plan.schedule in out or expected.schedule in out
    if plan.schedule != expected.schedule:  # the cost-aware order differs from the default build: saved beside
        from pipeloom.ir import load_schedule

        assert plan.schedule.endswith("p.schedule.json") and plan.schedule_options == {}
        assert load_schedule(plan.schedule).ranks == result.schedule.ranks
        plan = dataclasses.replace(plan, schedule=expected.schedule, schedule_options=expected.schedule_options)
    assert plan == expected


def test_a_piped_report_is_wide_enough_for_its_numbers(capsys, costs, monkeypatch):
    """Printed to a pipe (here: captured), the runners-up table keeps its step times whole: rich's 80 columns had cut
    them to '0.002…'; COLUMNS, where set, still decides."""
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, err = run(capsys, "plan", "--costs", str(costs), "--ranks", "4", "--global-batch", "16")
    assert code == 0, err
    assert "…" not in out and max(map(len, out.splitlines())) > 80
    monkeypatch.setenv("COLUMNS", "70")
    code, out, err = run(capsys, "plan", "--costs", str(costs), "--ranks", "4", "--global-batch", "16")
    assert code == 0 and max(map(len, out.splitlines())) <= 70


def test_a_weight_shared_across_stages_is_not_exported_to_torchtitan(capsys, tmp_path):
    """torchtitan ties no weight across pipeline stages: a plan whose stages split a shared parameter's users is
    refused before anything is written (it had been exported without a word)."""
    from pipeloom.plan.costs.parts import SharedParam

    pieces = tuple(Piece(name=f"blocks.{k}", f=0.01, i=0.01, w=0.008, activation_bytes=2**20, w_activation_bytes=2**18,
                         param_bytes=2**19, output_bytes=2**16) for k in range(4))
    path = tmp_path / "costs.json"
    save_costs(CostTable(pieces=pieces, microbatch_size=1, link=Link(latency=1e-4, bandwidth=1e9),
                         shared=(SharedParam(name="emb.weight", bytes=2**18, pieces=("blocks.0", "blocks.3")),)), path)
    save = tmp_path / "plan.json"
    one_line_error(run(capsys, "plan", "--costs", str(path), "--ranks", "2", "--global-batch", "8", "--dp", "1",
                       "--schedules", "1f1b", "--save", str(save), "--export", "torchtitan"), 1,
                   "the plan puts the pieces sharing emb.weight on different pipeline stages, and torchtitan ties no "
                   "weight across stages")
    assert not list(tmp_path.glob("plan*"))


def test_plan_json(capsys, costs):
    code, out, err = run(capsys, "plan", "--costs", str(costs), "--ranks", "2", "--global-batch", "8",
                         "--schedules", "1f1b,zb-h1", "-m", "4", "8", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["plan"]["format"] == "pipeloom.plan/1"
    assert {c["schedule"] for c in document["candidates"]} == {"1f1b", "zb-h1"}
    assert {c["microbatches"] for c in document["candidates"]} == {4, 8}
    assert document["plan"]["predicted_step_time"] == min(c["step_time"] for c in document["candidates"])


@pytest.mark.parametrize(("argv", "status", "words"), [
    (["--memory-limit", "80XB"], 2, ["bad size '80XB'"]),
    (["--memory-limit", "-5GiB"], 2, ["--memory-limit: must be more than 0 bytes, got '-5GiB'"]),
    (["--memory-limit", "-1e9"], 2, ["--memory-limit: must be more than 0 bytes, got '-1e9'"]),
    (["--top", "-1"], 2, ["--top: must be an integer >= 0, got '-1'"]),
    (["--memory-limit", "2MiB"], 2, ["no plan fits 2 MiB per rank", "the smallest that fits is about"]),
    (["--memory-limit", "4"], 2, ["--memory-limit: 4 is 4 bytes; give a unit, e.g. 4GiB"]),
    (["--memory-limit", "512KiB"], 2, ["no plan fits 512 KiB per rank"]),  # a small size with its unit is planned
    (["--schedules", "1f1b,3f3b"], 2, ["unknown schedule(s) ['3f3b']"]),
    # flags that disagree with the batch or the ranks are usage errors, as the README says (had exited 1)
    (["-m", "3"], 2, ["does not divide the global batch 16"]),
    (["--dp", "3"], 2, ["data parallel size 3 does not divide 4 ranks"]),
    (["--tp", "3"], 2, ["tensor-parallel size 3 does not divide 4 ranks"]),
    (["--ranks", "9"], 1, ["9 ranks need at least 9 pieces"]),
    # a replica count leaving one rank, where the schedules given do not run (had been "min() arg is an empty
    # sequence")
    (["--schedules", "zbv", "--dp", "4"], 2, ["dp 4 leaves a pipeline of one rank, where none of the schedules given "
                                              "(zbv) runs: give fewer replicas (--dp), or a schedule that runs there "
                                              "(gpipe, 1f1b, zb-h1, zb-h2)"]),
])
def test_plan_errors_are_one_line(capsys, costs, argv, status, words):
    base = {"--ranks": "4"}
    args = ["plan", "--costs", str(costs), "--global-batch", "16"]
    if "--ranks" not in argv:
        args += ["--ranks", base["--ranks"]]
    one_line_error(run(capsys, *args, *argv), status, *words)


def test_every_missing_flag_is_named_at_once(capsys, costs):
    """A user who gives only --model (or only --costs) learns every flag still missing in one line (they had come one
    at a time, --global-batch first, as argparse's required flag)."""
    one_line_error(run(capsys, "plan", "--model", "config.json"), 2,
                   "--model needs --hardware, --gpus, --global-batch, --seq")
    one_line_error(run(capsys, "plan", "--costs", str(costs)), 2, "--costs needs --ranks P and --global-batch B")
    one_line_error(run(capsys, "plan", "--costs", str(costs), "--ranks", "2"), 2, "--costs needs --global-batch B")


def test_plan_bad_costs_file(capsys, tmp_path):
    path = tmp_path / "costs.json"
    path.write_text('{"format": "pipeloom.costs/1", "microbatch_size": 1, "pieces": [], "gpu": 1}')
    one_line_error(run(capsys, "plan", "--costs", str(path), "--ranks", "2", "--global-batch", "4"), 1,
                   "unknown key(s) ['gpu']")


def test_profile_the_gpt_example(capsys, tmp_path):
    pytest.importorskip("torch")
    out_file = tmp_path / "costs.json"
    code, out, err = run(capsys, "profile", f"{EXAMPLE}:build_model", "--batch", "2", "--seq", "8",
                         "--arg", "layers=2", "--arg", "seq_len=8", "--loss", "lm_loss", "--warmup", "0",
                         "--repeats", "1", "--bandwidth", "1GB", "--save", str(out_file))
    assert code == 0, err
    table = load_costs(out_file)
    assert table.names == ("token_embedding", "blocks.0", "blocks.1", "ln_f", "head")
    assert table.microbatch_size == 2 and table.link.bandwidth == 1e9
    assert "wrote cost table" in out and "blocks.1" in out
    # the profiled table plans for 2 ranks, split points the example's model accepts
    code, out, err = run(capsys, "plan", "--costs", str(out_file), "--ranks", "2", "--global-batch", "4")
    assert code == 0, err


@pytest.mark.parametrize(("argv", "words"), [
    (["nofile.py:build_model", "--batch", "2"], ["no file 'nofile.py'"]),
    ([f"{EXAMPLE}:nothing", "--batch", "2"], ["defines no function 'nothing'"]),
    ([f"{EXAMPLE}", "--batch", "2"], ["write FILE.py:FUNCTION"]),
    ([f"{EXAMPLE}:build_model", "--batch", "2"], ["give --seq S"]),
    ([f"{EXAMPLE}:build_model", "--batch", "2", "--seq", "8", "--arg", "layers"], ["write KEY=VALUE"]),
    ([f"{EXAMPLE}:build_model", "--batch", "2", "--seq", "8", "--loss", "nope"], ["--loss 'nope'"]),
])
def test_profile_errors_are_one_line(capsys, argv, words):
    pytest.importorskip("torch")
    one_line_error(run(capsys, "profile", *argv), 2, *words)


@pytest.mark.parametrize(("extra", "code", "words"), [
    (["--arg", "foo=1"], 2, ["cannot take ['foo']", "it takes: layers"]),
    (["--device", "bogus"], 1, ["unknown device 'bogus'"]),
    (["--pieces", "nothere,blocks.0"], 1, ["piece(s) ['nothere'] name no module"]),
])
def test_profile_refuses_bad_arguments_devices_and_pieces(capsys, tmp_path, extra, code, words):
    pytest.importorskip("torch")
    argv = [f"{EXAMPLE}:build_model", "--batch", "2", "--seq", "8", "--arg", "seq_len=8", "--warmup", "0",
            "--repeats", "1", "--save", str(tmp_path / "c.json"), *extra]
    one_line_error(run(capsys, "profile", *argv), code, *words)
    assert not (tmp_path / "c.json").exists()


USER_FILES = {  # what the user's file does wrong -> the words of the one line naming it
    "syntax": ("def build(:\n", "SyntaxError", ":1:", "importing"),
    "nulls": ("x = 1\0\n", "source code string cannot contain null bytes", "importing"),
    "import": ("import no_such_module_here\n", "ModuleNotFoundError", ":1:", "importing"),
    "build": ("def build():\n    raise RuntimeError('out of ideas')\n", "RuntimeError: out of ideas", ":2:",
              "calling"),
    "forward": ("import torch\n"
                "class M(torch.nn.Module):\n"
                "    def __init__(self):\n"
                "        super().__init__()\n"
                "        self.a = torch.nn.Linear(4, 4)\n"
                "    def forward(self, x):\n"
                "        return self.a(x).view(3, -1, 7)\n"
                "def build():\n"
                "    return M(), torch.randn(4, 4)\n", "RuntimeError: shape '[3, -1, 7]' is invalid",
                "profiling the model"),
}


def test_a_loss_that_fails_on_the_made_up_target_is_named_not_the_last_piece(capsys, tmp_path):
    """A regression model with --loss mse on class ids made up for it: the loss and the target are named, with the
    fix (it had been "piece '2' fails when run on its own ... leave '2' out of the pieces")."""
    pytest.importorskip("torch")
    path = tmp_path / "model.py"
    path.write_text("import torch\n"
                    "def build():\n"
                    "    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 10))\n"
                    "def mse(out, target):\n"
                    "    return torch.nn.functional.mse_loss(out, target)\n")
    one_line_error(run(capsys, "profile", f"{path}:build", "--batch", "4", "--loss", "mse", "--warmup", "0",
                       "--repeats", "1"), 2,
                   "--loss mse fails on the model's output (4, 10) and the made-up target, class ids (4,)",
                   "return (model, inputs, target) from the function, or give a loss that takes class ids")


def test_a_tied_embedding_model_gets_token_ids_made_up(capsys, tmp_path):
    """The tracer opens a tied embedding (its weight is used twice) into F.embedding, so the first module called
    was a Dropout: "cannot make inputs for a model starting with Dropout". The lookup's weight names it."""
    pytest.importorskip("torch")
    path = tmp_path / "model.py"
    path.write_text("import torch\n"
                    "from torch import nn\n"
                    "class Tied(nn.Module):\n"
                    "    def __init__(self):\n"
                    "        super().__init__()\n"
                    "        self.head = nn.Linear(16, 50, bias=False)\n"  # registered before the embedding
                    "        self.emb, self.drop = nn.Embedding(50, 16), nn.Dropout(0.1)\n"
                    "        self.pos, self.body = nn.Embedding(8, 16), nn.Linear(16, 16)\n"
                    "        self.emb.weight = self.head.weight\n"
                    "    def forward(self, ids):\n"
                    "        where = torch.arange(ids.size(1))\n"  # the input's size read first
                    "        return self.head(self.body(self.drop(self.emb(ids) + self.pos(where))))\n"
                    "def build():\n"
                    "    return Tied()\n"
                    "def lm(out, target):\n"
                    "    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())\n")
    code, out, err = run(capsys, "profile", f"{path}:build", "--batch", "4", "--seq", "8", "--loss", "lm",
                         "--warmup", "0", "--repeats", "1", "--save", str(tmp_path / "costs.json"))
    assert code == 0, err
    assert "shared: head.weight" in out and load_costs(tmp_path / "costs.json").pieces[0].name == "emb"
    import argparse
    import importlib.util

    from pipeloom.cli.profile_user import _first_module

    spec = importlib.util.spec_from_file_location("tied_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name, first = _first_module(module.build(), argparse.Namespace(leaf_modules=None))
    assert name == "emb" and first.num_embeddings == 50  # not the positions' 8, nor the head


@pytest.mark.parametrize("case", sorted(USER_FILES))
def test_an_error_in_the_users_file_is_one_line_naming_the_file_and_line(capsys, tmp_path, case):
    pytest.importorskip("torch")
    text, *words = USER_FILES[case]
    path = tmp_path / "model.py"
    path.write_bytes(text.encode())
    result = run(capsys, "profile", f"{path}:build", "--batch", "4", "--warmup", "0", "--repeats", "1")
    one_line_error(result, 1, str(path), *words, "(add --verbose for details)")
    code, _, err = run(capsys, "--verbose", "profile", f"{path}:build", "--batch", "4", "--warmup", "0",
                       "--repeats", "1")
    assert code == 1 and "Traceback (most recent call last)" in err


def test_two_cost_tables_of_one_microbatch_size_are_refused(capsys, costs):
    one_line_error(run(capsys, "plan", "--costs", str(costs), str(costs), "--ranks", "2", "--global-batch", "8"),
                   1, "two cost tables are for micro-batch size")


def test_a_cost_table_of_zero_times_is_refused_before_any_report(capsys, tmp_path):
    pieces = tuple(Piece(name=f"b.{k}", f=0.0, i=0.0, w=0.0, activation_bytes=0, w_activation_bytes=0,
                         param_bytes=0, output_bytes=0) for k in range(4))
    path = tmp_path / "zero.json"
    save_costs(CostTable(pieces=pieces, microbatch_size=1), path)
    one_line_error(run(capsys, "plan", "--costs", str(path), "--ranks", "2", "--global-batch", "8"), 1,
                   "takes no time")


def test_a_terminal_view_wider_than_the_cap_is_refused(capsys):
    one_line_error(run(capsys, "show", "1f1b", "--ranks", "2", "--microbatches", "4", "--terminal", "--width",
                       "1000000000"), 2, "--width", "at most 10000")
