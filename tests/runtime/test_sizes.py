"""torch.export's symbolic sizes used across a split: computed again in the stage that uses them from sizes
it measures itself (Mamba2's scan padding, a top-k's count made in a ``no_grad`` region), or refused when the split
is made. Oracle: the unsplit model's for-loop reference of DESIGN §5 (torch.equal losses and gradients)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn

from pipeloom.runtime import SplitError, split_model


class Pooled(nn.Module):
    """Stage 1 scales by the input's length, but holds no tensor with that dimension (summed away)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        n = x.shape[1]
        return self.b(self.a(x).sum(1)) * (n % 3 + 1)


class PaddedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h, pad):
        return torch.tanh(self.linear(nn.functional.pad(h, (0, 0, 0, pad))))[:, :h.shape[1]]


class Padded(nn.Module):
    """Every block pads to a multiple of 4 with one size computed once from the input's length, as Mamba2's
    scan does: the blocks after the split need it too."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PaddedBlock() for _ in range(2))

    def forward(self, x):
        pad = (4 - x.shape[1] % 4) % 4
        for block in self.blocks:
            x = block(x, pad)
        return x.sum(1)


class ChosenBlock(nn.Module):
    """Under ``no_grad``, picks each row's top ``min(3, length)`` positions and updates only those."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h):
        with torch.no_grad():
            keep = h.sum(-1).topk(min(3, h.shape[1]), dim=-1).indices
        mask = torch.zeros(h.shape[:2]).scatter(1, keep, 1.0)
        return h + torch.tanh(self.linear(h)) * mask[..., None]


class Chosen(nn.Module):
    """Two blocks choosing their top positions as DeepSeek's sparse attention's indexer does: torch.export makes the
    count ``Min(3, s)`` once, as an output of the first block's ``no_grad`` region, and the second block's reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ChosenBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum(1)


def test_a_size_no_tensor_of_the_stage_carries_is_refused_when_the_split_is_made():
    with pytest.raises(SplitError, match=r"made in stage 0 is used in stage 1 .*stages_from_modules"):
        split_model(Pooled(), ["b"], tracer="export", example_inputs=(torch.randn(2, 5, 4),))


def test_a_size_computed_from_sizes_is_computed_again_in_the_stage_using_it():
    torch.manual_seed(0)
    model = Padded()
    staged = split_model(model, ["blocks.1"], tracer="export", example_inputs=(torch.randn(2, 5, 4),))
    for length in (5, 6, 8):
        x = torch.randn(3, length, 4)
        assert torch.equal(staged.run(x), model(x))


def test_a_size_a_no_grad_region_returns_is_computed_again_from_its_expression():
    """``Min(3, s)`` comes out of the first block's ``no_grad`` region, no integer operation the stage could run
    again: the stage after the split builds it from its expression, ``sym_min(3, sym_size(x, 1))``, on its input, for
    lengths below, at and above 3."""
    torch.manual_seed(0)
    model = Chosen()
    staged = split_model(model, ["blocks.1"], tracer="export", example_inputs=(torch.randn(2, 5, 4),))
    for length in (2, 3, 5, 8):
        x = torch.randn(3, length, 4)
        assert torch.equal(staged.run(x), model(x))


@pytest.mark.timeout(400)
def test_mamba2_splits_after_its_first_layer_bitwise_on_two_ranks():
    pytest.importorskip("transformers")
    from mamba_jobs import mamba2_exactness
    from models import assert_bitwise_reports
    from ranks import run_ranks

    results = run_ranks(2, mamba2_exactness, [("1f1b", 2), ("zbv", 4)], timeout=360)
    for rank, key, outcome in assert_bitwise_reports(results):
        assert outcome["owned"] > 0, (rank, key)
