"""The profiler on what the runtime runs beyond torch.fx: Hugging Face GPT-2 (tied head) and LLaMA traced
with torch.export, pieces given as modules, and in-place operations at a piece boundary.

Oracles: the models' own parameter bytes (``model.parameters()`` yields a tied tensor once), their
module names in call order, and the one-line errors (what they name and the fix they give).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn

from pipeloom.cli import main
from pipeloom.cli.profile_user import load_function
from pipeloom.plan import load_costs
from pipeloom.plan.costs.parts import SharedParam
from pipeloom.profile.errors import PieceError
from pipeloom.profile.model import profile_model
from pipeloom.profile.pieces import default_pieces

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hf.py"
TINY = ["--arg", "layers=2", "--arg", "width=32", "--arg", "vocab=64", "--arg", "dropout=0.0"]


def _bytes(model: nn.Module) -> float:
    return float(sum(p.numel() * p.element_size() for p in model.parameters()))


def _example():
    pytest.importorskip("transformers")
    module, _ = load_function(f"{EXAMPLE}:build_model")
    return module


def test_cli_profiles_hf_gpt2_and_counts_its_tied_weight_once(tmp_path, capsys):
    example = _example()
    saved = tmp_path / "gpt2.json"
    status = main(["profile", f"{EXAMPLE}:build_model", "--arg", "name=gpt2", *TINY, "--batch", "2", "--seq", "8",
                   "--loss", "lm_loss", "--warmup", "0", "--repeats", "1", "--save", str(saved)])
    assert status == 0, capsys.readouterr().err
    table = load_costs(saved)
    model = example.build_model("gpt2", layers=2, width=32, vocab=64, dropout=0.0)
    assert table.names == ("transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0",
                           "transformer.h.1", "transformer.ln_f", "lm_head")
    assert sum(p.param_bytes for p in table.pieces) == _bytes(model)  # the tied matrix once, not twice
    tied = 64 * 32 * 4
    assert table.shared == (SharedParam(name="transformer.wte.weight", bytes=tied,
                                        pieces=("transformer.wte", "lm_head")),)
    assert table.pieces[-1].param_bytes == 0  # counted in its first user, the embedding
    assert all(p.f > 0 for p in table.pieces)
    assert "shared: transformer.wte.weight (8 KiB, counted once) used by transformer.wte, lm_head" in \
        capsys.readouterr().out


def test_profile_model_cuts_hf_llama_as_the_runtime_does():
    example = _example()
    model = example.build_model("llama", layers=2, width=32, vocab=64, dropout=0.0)
    tokens = torch.randint(1, 64, (2, 8))
    table = profile_model(model, tokens, loss_fn=example.lm_loss, target=torch.randint(0, 64, (2, 8)),
                          warmup=0, repeats=1)
    assert table.names == ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
                           "model.norm", "lm_head")
    assert table.shared == ()  # LLaMA's head is not tied
    assert sum(p.param_bytes for p in table.pieces) == _bytes(model)
    assert table.pieces[-1].output_bytes == 2 * 8 * 64 * 4  # the logits; the loss ran on the ModelOutput
    assert all(p.grad is None for p in model.parameters())


class _Stem(nn.Module):
    """ResNet's stem and a residual block: the piece ``relu`` is an in-place ReLU of ``bn1``'s output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.block(x) + x
        return self.fc(x.mean((2, 3)))


def test_an_in_place_relu_at_a_piece_boundary_is_profiled():
    model = _Stem()
    assert default_pieces(model) == ["conv1", "bn1", "relu", "block.0", "block.1", "fc"]
    table = profile_model(model, torch.randn(2, 3, 6, 6), warmup=0, repeats=1)
    relu = table.pieces[2]
    assert relu.name == "relu" and relu.output_bytes == 2 * 4 * 6 * 6 * 4 and relu.param_bytes == 0
    assert sum(p.param_bytes for p in table.pieces) == _bytes(model)


class _Mutating(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = _ReluFirst()
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.act(self.a(x)))


class _ReluFirst(nn.Module):
    def forward(self, x):
        return torch.relu_(x) * 2  # in place on the piece's input (no schema under fx)


MUTATING = '''
import torch
from torch import nn


class ReluFirst(nn.Module):
    def forward(self, x):
        return torch.relu_(x) * 2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = ReluFirst()
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.act(self.a(x)))


def build():
    return Model(), torch.randn(2, 4)
'''


def test_torch_relu_in_place_on_a_piece_input_is_copied_and_profiled():
    table = profile_model(_Mutating(), torch.randn(2, 4), warmup=0, repeats=1)  # the runtime copies the input
    assert table.names == ("a", "act", "c")


def test_an_in_place_op_the_runtime_cannot_run_is_one_line_naming_the_piece_and_the_boundary(
        tmp_path, capsys, monkeypatch):
    import pipeloom.runtime.model.split as split

    monkeypatch.setattr(split, "copy_mutated_inputs", lambda module: None)  # a write the runtime does not see
    with pytest.raises(PieceError, match=r"piece 'act' changes its input in place .* leave 'act' out of the pieces "
                                         r"so that it runs in 'a' \(pieces a,c\)"):
        profile_model(_Mutating(), torch.randn(2, 4), warmup=0, repeats=1)
    model_file = tmp_path / "mutating.py"
    model_file.write_text(MUTATING)
    assert main(["profile", f"{model_file}:build", "--batch", "2", "--warmup", "0", "--repeats", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "piece 'act' changes its input in place" in err, err


def test_pieces_given_as_modules_share_a_parameter():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight  # tied across the two pieces
    middle = nn.ReLU()
    table = profile_model(nn.ModuleList([first, middle, second]), torch.randn(3, 4), warmup=0, repeats=1)
    assert table.names == ("0", "1", "2")
    assert [p.param_bytes for p in table.pieces] == [(16 + 4) * 4, 0, 4 * 4]
    assert table.shared == (SharedParam(name="0.weight", bytes=16 * 4, pieces=("0", "2")),)
    named = profile_model([first, middle, second], torch.randn(3, 4), pieces=["in", "act", "out"], warmup=0,
                          repeats=1)
    assert named.names == ("in", "act", "out") and named.shared[0].pieces == ("in", "out")
